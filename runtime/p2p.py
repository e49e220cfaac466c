"""Point-to-point messages between neighbouring stages, with receives posted ahead.

Stage k sends activations to k+1 and receives gradients from it; it receives activations
from k-1 and sends gradients back. Every message's shape is known in advance (static
shapes), so a stage can post a receive into a buffer of the right size *before* the sender
is ready: when the sender's data comes, gloo writes it straight into that buffer, and the
receiving stage finds it there when it needs it instead of paying a round trip on the
critical path. How many receives of each kind are in flight is the executor's choice
(:class:`.executor.NativeExecutor`: every activation receive a stage keeps inputs for anyway,
and two gradient receives); this module only posts and waits.

Sends are asynchronous: a stage posts the send and goes on computing. The tensor must stay
alive until the send completes, so the sends are kept, and waited on at the end of the step.

Tags keep the messages apart: activations and gradients of each micro-batch and each tensor
of the tuple have their own tag, so a message can never be mistaken for another even when
several are in flight.

This is for gloo (CPU). NCCL queues sends and receives to one peer on one stream, where a
receive posted early can block a later send; the CUDA path therefore uses
``torch.distributed.pipelining`` (:mod:`.torch_executor`), whose schedules pair them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..artifacts import RunFailure
from .stage import TensorMeta

ACTIVATION, GRADIENT = 0, 1


def tag(kind: int, micro_batch: int, index: int, width: int) -> int:
    """A unique tag per (kind, micro-batch, tensor of the tuple)."""
    return ((micro_batch * width) + index) * 2 + kind


@dataclass
class PendingReceive:
    """Buffers a receive is writing into, and the works to wait on before reading them."""

    what: str
    buffers: tuple[torch.Tensor, ...]
    works: list[dist.Work]


class Neighbours:
    """The messages of one stage with the stage before it and the stage after it."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float,
                 group: dist.ProcessGroup | None = None) -> None:
        self.rank = rank
        self.prev = rank - 1 if rank > 0 else None
        self.next = rank + 1 if rank < world_size - 1 else None
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = group
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []

    def post_receive(self, kind: int, micro_batch: int, metas: tuple[TensorMeta, ...]) -> PendingReceive:
        """Start receiving the activations (from prev) or gradients (from next) of a micro-batch."""
        peer = self.prev if kind == ACTIVATION else self.next
        assert peer is not None
        width = len(metas)
        buffers = tuple(m.empty(self.device) for m in metas)
        works = [dist.irecv(buf, src=peer, group=self.group, tag=tag(kind, micro_batch, i, width))
                 for i, buf in enumerate(buffers)]
        what = f"{'activations' if kind == ACTIVATION else 'gradients'} of micro-batch {micro_batch} from rank {peer}"
        return PendingReceive(what, buffers, [w for w in works if w is not None])

    def wait(self, pending: PendingReceive) -> tuple[torch.Tensor, ...]:
        for work in pending.works:
            self._wait(work, f"waiting for the {pending.what}")
        return pending.buffers

    def send(self, kind: int, micro_batch: int, tensors: tuple[torch.Tensor, ...]) -> None:
        """Post the sends of a micro-batch's outputs (to next) or input gradients (to prev)."""
        peer = self.next if kind == ACTIVATION else self.prev
        assert peer is not None
        width = len(tensors)
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            work = dist.isend(t, dst=peer, group=self.group, tag=tag(kind, micro_batch, i, width))
            if work is not None:
                self.sends.append((work, t))

    def finish_sends(self) -> None:
        """Wait until every posted send has completed (its buffer may then be freed)."""
        for work, _ in self.sends:
            self._wait(work, "sending to a neighbour stage")
        self.sends.clear()

    def _wait(self, work: dist.Work, doing: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            if "Timed out" in text or "timeout" in text.lower():
                raise RunFailure(f"rank {self.rank} timed out after {self.timeout.total_seconds():g} s "
                                 f"{doing} (is a rank stuck? raise --timeout for slow steps)") from None
            raise PeerLost(f"rank {self.rank} lost its neighbour while {doing}: {text}") from None


class PeerLost(RunFailure):
    """A neighbour's connection broke: usually because that rank failed first."""
