"""The once-a-step exchange: every rank learns the step's loss, and the gradient norm to clip by.

Only the stage holding the last chunk computes the loss (the last stage; stage 0 under
``zb-v``, whose V ends where it starts), but every rank needs it: to show progress (rank 0), and
to stop together, before any optimizer step, when it is NaN. Clipping by the global gradient
norm also needs every stage's share of it.

With clipping, and in fp16 (an overflow shows as a non-finite norm, and every stage must skip
the same steps: .loss_scale), one all-reduce of (loss, squared norm) does both. Otherwise that stage
just sends its loss to the others, and each of them posts that receive when the step starts,
so the message is waiting for them when they finish: a gloo all-reduce of two numbers costs
a few round trips (milliseconds on a busy machine), a pre-posted receive nothing. On NCCL a
receive posted early would block the stream its sends queue on, so CUDA always all-reduces.

With d replicas (data parallel) each replica's loss rank has its replica's loss, the mean over
its 1/d of the batch; the step's loss is their mean, so every rank all-reduces (loss / d on a
loss rank, 0 elsewhere; its share of the squared norm), whatever the clipping.
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from .p2p import PeerLost, TimedOut

LOSS_TAG = 1 << 30  # far above the tags of activations and gradients (see p2p.tag)


class LossExchange:
    """One rank's side of the once-a-step exchange of the loss (and the squared gradient norm)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, clip: bool, timeout_s: float,
                 loss_ranks: tuple[int, ...] | None = None) -> None:
        """``loss_ranks``: the rank that computes the loss in each replica, replica 0's first (their
        losses are averaged); by default the last rank, alone."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.loss_ranks = loss_ranks or (world_size - 1,)
        self.last = self.loss_ranks[0]   # the rank that computes the loss (replica 0's, with several)
        self.all_reduce = clip or device.type != "cpu" or len(self.loss_ranks) > 1
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.buffer = torch.zeros(1, dtype=torch.float64)
        self.pending: dist.Work | None = None
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []

    def begin_step(self) -> None:
        """Post the receive of this step's loss (ranks other than the loss's, without clipping)."""
        if self.world_size > 1 and not self.all_reduce and self.rank != self.last:
            self.buffer = torch.zeros(1, dtype=torch.float64)
            self.pending = dist.irecv(self.buffer, src=self.last, tag=LOSS_TAG)

    def finish_step(self, loss: float, grad_sq: float) -> tuple[float, float]:
        """(mean loss, global gradient norm) on every rank; ``loss`` counts on the loss's rank only."""
        if self.world_size == 1:
            return loss, math.sqrt(grad_sq)
        if self.all_reduce:
            share = loss / len(self.loss_ranks) if self.rank in self.loss_ranks else 0.0
            shared = torch.tensor([share, grad_sq], dtype=torch.float64, device=self.device)
            dist.all_reduce(shared)
            return float(shared[0]), math.sqrt(float(shared[1]))
        if self.rank == self.last:
            for work, _ in self.sends:  # last step's, long done: keep their buffers until then
                work.wait(self.timeout)
            value = torch.tensor([loss], dtype=torch.float64)
            self.sends = [(dist.isend(value, dst=r, tag=LOSS_TAG), value) for r in range(self.world_size)
                          if r != self.last]
            return loss, 0.0
        assert self.pending is not None
        try:
            self.pending.wait(self.timeout)
        except RuntimeError as exc:
            text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            kind = TimedOut if "Timed out" in text else PeerLost
            raise kind(f"rank {self.rank} did not receive the step's loss from rank {self.last}: {text}") from None
        self.pending = None
        return float(self.buffer[0]), 0.0

    def close(self) -> None:
        for work, _ in self.sends:
            work.wait(self.timeout)
        self.sends = []
