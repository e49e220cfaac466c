"""Point-to-point messages between the stages that hold neighbouring chunks, with receives posted ahead.

Chunk c sends its outputs (activations) to chunk c+1 and receives their gradients back from
it; it receives activations from chunk c-1 and sends it the gradients of its inputs. When
the two chunks of a cut ("boundary" c, between chunk c and c+1) are on different stages,
that is a message between those two ranks; on one stage the executor hands the tensors over
itself, no message. With one chunk per stage the peers are the stages k-1 and k+1; with
several (``interleaved``, ``zb-v``) a stage exchanges with whichever stages hold the chunks
next to its own, so every call names its peer.

Every message's shape is known in advance (static shapes), so a stage can post a receive
into a buffer of the right size *before* the sender is ready: when the sender's data comes,
gloo writes it straight into that buffer, and the receiving stage finds it there when it
needs it instead of paying a round trip on the critical path. How many receives are in
flight is the executor's choice (:class:`.executor.NativeExecutor`): per chunk, activation
receives for one more micro-batch than the chunk holds at its peak (``schedules.in_flight``
of the stage's actions, at most M), and two gradient receives. This module only posts and waits.

Sends are asynchronous: a stage posts the send and goes on computing. The tensor must stay
alive until the send completes, so the sends are kept, and waited on at the end of the step
(an asynchronous pipeline's at the end of its segment, letting go of the completed ones
each step: .async_executor).

Tags keep the messages apart: activations and gradients of each boundary, each micro-batch
and each tensor of the tuple have their own tag, so a message can never be mistaken for
another even when several are in flight.

This is for gloo (CPU). NCCL queues sends and receives to one peer on one stream, where a
receive posted early can block a later send; the CUDA path therefore uses
``torch.distributed.pipelining`` (:mod:`.torch_executor`), whose schedules pair them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..artifacts import RunFailure
from . import watchdog
from .stage import TensorMeta

ACTIVATION, GRADIENT = 0, 1


# Bounds that keep every tag below the step's loss message (sync.LOSS_TAG, 2^30).
MAX_BOUNDARIES = 256     # cuts between chunks: chunks - 1
MAX_TENSORS = 64         # tensors crossing one cut
MAX_MICRO_BATCHES = 32767


def tag(kind: int, boundary: int, micro_batch: int, index: int) -> int:
    """A unique tag per (kind, boundary between chunk ``boundary`` and the next, micro-batch,
    tensor of the tuple)."""
    if not (0 <= boundary < MAX_BOUNDARIES and 0 <= index < MAX_TENSORS and 0 <= micro_batch < MAX_MICRO_BATCHES):
        raise RunFailure(f"a pipeline of more than {MAX_BOUNDARIES + 1} chunks, {MAX_MICRO_BATCHES} micro-batches or "
                         f"{MAX_TENSORS} tensors crossing one cut is beyond the native executor; use --executor torch")
    return ((micro_batch * MAX_BOUNDARIES + boundary) * MAX_TENSORS + index) * 2 + kind


@dataclass
class PendingReceive:
    """Buffers a receive is writing into, and the works to wait on before reading them."""

    what: str
    buffers: tuple[torch.Tensor, ...]
    works: list[dist.Work]


class Neighbours:
    """The messages of one stage with the stages holding the chunks next to its own."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float,
                 group: dist.ProcessGroup | None = None, stage_ranks: Sequence[int] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = group
        # The global rank of each stage of this rank's replica (data parallel: the pipeline of
        # replica r is ranks[k][r], not rank k); a message to stage k goes to stage_ranks[k].
        self.stage_ranks = list(stage_ranks) if stage_ranks is not None else None
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []

    def rank_of(self, stage: int) -> int:
        """The global rank of stage ``stage`` in this replica."""
        return self.stage_ranks[stage] if self.stage_ranks is not None else stage

    def post_receive(self, kind: int, boundary: int, micro_batch: int, metas: tuple[TensorMeta, ...],
                     peer: int) -> PendingReceive:
        """Start receiving, from stage ``peer``, the activations crossing cut ``boundary``
        forward (chunk boundary to boundary+1) or the gradients crossing it backward."""
        buffers = tuple(m.empty(self.device) for m in metas)
        peer = self.rank_of(peer)
        works = [dist.irecv(buf, src=peer, group=self.group, tag=tag(kind, boundary, micro_batch, i))
                 for i, buf in enumerate(buffers)]
        receiver = boundary + 1 if kind == ACTIVATION else boundary
        what = (f"{'activations' if kind == ACTIVATION else 'gradients'} of micro-batch {micro_batch} for chunk "
                f"{receiver} from rank {peer}")
        return PendingReceive(what, buffers, [w for w in works if w is not None])

    def wait(self, pending: PendingReceive) -> tuple[torch.Tensor, ...]:
        for work in pending.works:
            self._wait(work, f"waiting for the {pending.what}")
        return pending.buffers

    def send(self, kind: int, boundary: int, micro_batch: int, tensors: tuple[torch.Tensor, ...], peer: int) -> None:
        """Post the sends, to stage ``peer``, of a micro-batch's tensors crossing cut ``boundary``
        (outputs forward, input gradients backward)."""
        peer = self.rank_of(peer)
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            work = dist.isend(t, dst=peer, group=self.group, tag=tag(kind, boundary, micro_batch, i))
            if work is not None:
                self.sends.append((work, t))

    def forget_completed_sends(self) -> None:
        """Let go of the sends already completed (their buffers may be freed), waiting for none:
        a pipeline that does not flush (.async_executor) waits for the rest only when it drains."""
        self.sends = [(work, t) for work, t in self.sends if not work.is_completed()]

    def finish_sends(self) -> None:
        """Wait until every posted send has completed (its buffer may then be freed)."""
        for work, _ in self.sends:
            self._wait(work, "sending to a neighbour stage")
        self.sends.clear()

    def _wait(self, work: dist.Work, doing: str) -> None:
        watchdog.doing(doing, waiting=True)
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            if "Timed out" in text or "timeout" in text.lower():
                raise TimedOut(f"rank {self.rank} timed out after {self.timeout.total_seconds():g} s "
                               f"{doing} (is a rank stuck? raise --timeout for slow steps)") from None
            raise PeerLost(f"rank {self.rank} lost its neighbour while {doing}: {text}") from None


class PeerLost(RunFailure):
    """A neighbour's connection broke: usually because that rank failed first."""


def looks_like_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is gloo's (or the socket's) word for a neighbour that went away."""
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                   "pair closure", "Connection refused", "ECONNRESET"))


class TimedOut(RunFailure):
    """A wait for another rank outlasted ``--timeout``: what followed a stuck rank, rarely the cause
    (the launcher prefers the stuck rank's own report: runtime/watchdog.py)."""
