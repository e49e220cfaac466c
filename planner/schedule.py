"""How long a training step takes: the GPipe closed form and an event simulator.

A schedule fixes, for every stage, the order in which it runs its M forwards and M backwards.
Given each stage's per-micro-batch times, the step is then determined: an operation starts
when its stage is free and its input has arrived. Sends are operations too, on the link
between two stages (one link each way), so a slow link queues micro-batches like a slow stage.

GPipe (fill-drain) runs all forwards, then all backwards. Its forward phase is a flow line of
M identical jobs through the stations F_0, C_0, F_1, ..., F_{K-1}, and the makespan of such a
line is the sum of the station times plus (M-1) times the slowest station; the backward phase
is the same line in reverse. Hence the closed form::

    makespan = sum F + sum C + (M-1) max(F, C)  +  sum B + sum C + (M-1) max(B, C)

1F1B (PipeDream-flush, torch's ``Schedule1F1B``) lets stage k run ``min(M, K-k)`` forwards,
then alternates one backward and one forward, then drains its backwards: the same bubble as
GPipe when stages are balanced, with at most K-k micro-batches in flight instead of M. It has
no such closed form, so :func:`simulate` plays the operations out.

After the last backward every stage runs its optimizer step (the runtime first agrees on
the loss, a tiny all-reduce). The next step begins on stage 0 after its optimizer step; stage
k is needed again only when that step's first micro-batch reaches it, after the forwards and
sends of the stages before it. So the step is the makespan plus
``max_k (optimizer_k - time before stage k's first forward)``: stage 0's optimizer step, unless
a later stage's is longer than what the next step's fill hides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .costmodel import StageCost


@dataclass(frozen=True)
class Event:
    stage: int            # for a send: the stage that sends
    kind: str             # forward | backward | recompute | send | optimizer
    micro_batch: int      # -1 for the optimizer step
    start_s: float
    end_s: float


@dataclass
class Timeline:
    makespan_s: float
    step_s: float
    busy_s: list[float]
    events: list[Event] = field(default_factory=list)


def gpipe_makespan(forward_s: Sequence[float], backward_s: Sequence[float], send_s: Sequence[float], M: int) -> float:
    """The closed form above; ``send_s`` has one entry per cut (K-1 of them)."""
    fwd_stations = list(forward_s) + list(send_s)
    bwd_stations = list(backward_s) + list(send_s)
    comm = sum(send_s)
    return (sum(forward_s) + comm + (M - 1) * max(fwd_stations)
            + sum(backward_s) + comm + (M - 1) * max(bwd_stations))


def operation_order(schedule: str, K: int, M: int, k: int) -> list[tuple[str, int]]:
    """The order in which stage k runs its operations: ('F', m) and ('B', m)."""
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    if schedule == "1f1b":
        warmup = min(M, K - k)
        order = [("F", m) for m in range(warmup)]
        next_f, next_b = warmup, 0
        while next_b < M:
            order.append(("B", next_b))
            next_b += 1
            if next_f < M:
                order.append(("F", next_f))
                next_f += 1
        return order
    raise ValueError(f"unknown schedule {schedule!r}")


def simulate(schedule: str, stages: Sequence[StageCost], M: int, record: bool = False) -> Timeline:
    """Play one training step out, operation by operation."""
    return simulate_times(
        schedule,
        [s.forward_s for s in stages],
        [s.backward_s for s in stages],
        [s.send_s for s in stages[:-1]],
        M,
        optimizer_s=[s.optimizer_s for s in stages],
        recompute_s=[s.recompute_s for s in stages],
        record=record,
    )


def simulate_times(
    schedule: str,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    send_s: Sequence[float],
    M: int,
    optimizer_s: Sequence[float] | None = None,
    recompute_s: Sequence[float] | None = None,
    record: bool = False,
) -> Timeline:
    K = len(forward_s)
    orders = [operation_order(schedule, K, M, k) for k in range(K)]
    position = [0] * K
    stage_free = [0.0] * K
    link_fwd_free = [0.0] * max(K - 1, 0)      # link k carries stage k -> k+1
    link_bwd_free = [0.0] * max(K - 1, 0)      # link k carries stage k+1 -> k
    arrived_fwd: list[dict[int, float]] = [dict() for _ in range(K)]   # activations at stage k
    arrived_bwd: list[dict[int, float]] = [dict() for _ in range(K)]   # gradients at stage k
    forward_done: list[dict[int, float]] = [dict() for _ in range(K)]
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for k in range(K):
            order = orders[k]
            while position[k] < len(order):
                kind, m = order[position[k]]
                if kind == "F":
                    ready = 0.0 if k == 0 else arrived_fwd[k].get(m)
                    duration = forward_s[k]
                else:
                    ready = forward_done[k].get(m) if k == K - 1 else arrived_bwd[k].get(m)
                    duration = backward_s[k]
                if ready is None:
                    break
                start = max(stage_free[k], ready)
                end = start + duration
                stage_free[k] = end
                position[k] += 1
                remaining -= 1
                progressed = True
                if kind == "F":
                    forward_done[k][m] = end
                    if record:
                        events.append(Event(k, "forward", m, start, end))
                    if k < K - 1:
                        send_start = max(link_fwd_free[k], end)
                        link_fwd_free[k] = send_start + send_s[k]
                        arrived_fwd[k + 1][m] = link_fwd_free[k]
                        if record and send_s[k] > 0:
                            events.append(Event(k, "send", m, send_start, link_fwd_free[k]))
                else:
                    if record:
                        r = recompute_s[k] if recompute_s else 0.0
                        if r > 0:
                            events.append(Event(k, "recompute", m, start, start + r))
                        events.append(Event(k, "backward", m, start + r, end))
                    if k > 0:
                        send_start = max(link_bwd_free[k - 1], end)
                        link_bwd_free[k - 1] = send_start + send_s[k - 1]
                        arrived_bwd[k - 1][m] = link_bwd_free[k - 1]
                        if record and send_s[k - 1] > 0:
                            events.append(Event(k, "send", m, send_start, link_bwd_free[k - 1]))
        if not progressed:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError(f"schedule {schedule} deadlocked")
    makespan = max(stage_free)
    opt = list(optimizer_s) if optimizer_s else [0.0] * K
    if record:
        for k in range(K):
            if opt[k] > 0:
                events.append(Event(k, "optimizer", -1, makespan, makespan + opt[k]))
    busy = [M * (forward_s[k] + backward_s[k]) + opt[k] for k in range(K)]
    # The first forward of stage k starts when micro-batch 0 arrives: the fill before it.
    first_forward = [0.0] + [forward_done[k][0] - forward_s[k] for k in range(1, K)]
    tail = max(opt[k] - first_forward[k] for k in range(K))
    return Timeline(makespan_s=makespan, step_s=makespan + tail, busy_s=busy, events=events)
