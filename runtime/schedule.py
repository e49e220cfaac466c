"""Pipeline schedules: the order in which one stage runs its forwards and backwards.

A schedule is nothing but, for every stage k of K, a list of operations ``F m`` (forward of
micro-batch m) and ``B m`` (its backward). The data dependencies (F m on stage k needs F m of
stage k-1; B m on stage k needs B m of stage k+1) then fix everything else: each stage runs
its list in order and waits for what it needs. Two schedules:

GPipe (fill-drain)::

    stage 0:  F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
    stage 1:  .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3

Every stage runs all M forwards, then all M backwards, so it holds M micro-batches of
activations at the peak.

1F1B (PipeDream-flush, torch's ``Schedule1F1B``)::

    stage 0:  F0 F1 .  .  B0 F2 B1 F3 B2 .  B3
    stage 1:  .  F0 B0 F1 B1 F2 B2 F3 B3

Stage k first runs ``min(M, K - k)`` forwards, then alternates one backward and one forward,
then drains its backwards: it never holds more than K - k micro-batches of activations, and
with balanced stages its bubble is the same as GPipe's.

These orders are exactly the planner's (``planner.schedule.operation_order``), so that what
the runtime does is what the plan predicted; a test checks that they agree.

No torch here: this is bookkeeping the tests check on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Op:
    """One operation of a stage: the forward or the backward of one micro-batch."""

    kind: Literal["F", "B"]
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Op]:
    """All forwards, then all backwards (in the same micro-batch order)."""
    del stage, stages  # every stage runs the same order; the waits make the diagonal
    return [Op("F", m) for m in range(micro_batches)] + [Op("B", m) for m in range(micro_batches)]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Op]:
    """Warm up with ``min(M, K - k)`` forwards, then alternate B and F, then drain."""
    warmup = min(micro_batches, stages - stage)
    ops = [Op("F", m) for m in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_backward < micro_batches:
        ops.append(Op("B", next_backward))
        next_backward += 1
        if next_forward < micro_batches:
            ops.append(Op("F", next_forward))
            next_forward += 1
    return ops


def stage_ops(schedule: str, stage: int, stages: int, micro_batches: int) -> list[Op]:
    """The operations stage ``stage`` of ``stages`` runs in one training step, in order."""
    if schedule == "gpipe":
        return gpipe(stage, stages, micro_batches)
    if schedule == "1f1b":
        return one_f_one_b(stage, stages, micro_batches)
    raise ValueError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")


def max_in_flight(ops: list[Op]) -> int:
    """The most micro-batches whose forward has run and backward has not, at any point."""
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak
