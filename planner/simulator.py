"""How long a training step takes: the GPipe closed form and one event simulator for every schedule.

A schedule (:mod:`gpipe_plan.schedules`) fixes, for every stage, the order in which it runs
its actions: F, B (or I then W) of each of its chunks for each micro-batch. Given each chunk's
per-micro-batch times, the step is then determined: an action starts when its stage is free
and its inputs are there. :func:`simulate_plan` plays the lists out:

- F of chunk c needs F of chunk c-1 (same micro-batch), sent over the link when the two chunks
  sit on different stages, handed over for free when they share one;
- B or I of chunk c needs the B or I of chunk c+1 the same way (the last chunk: its own F,
  which its stage ran earlier);
- W needs its own I, which its stage ran earlier.

Sends are work too, on links: one per ordered pair of stages and direction (activations one
way, gradients the other), each carrying one message at a time in the order they were sent,
so a slow link queues micro-batches like a slow stage.

GPipe (fill-drain) with one chunk per stage runs all forwards, then all backwards. Its forward
phase is a flow line of M identical jobs through the stations F_0, C_0, F_1, ..., F_{K-1}, and
the makespan of such a line is the sum of the station times plus (M-1) times the slowest
station; the backward phase is the same line in reverse. Hence the closed form::

    makespan = sum F + sum C + (M-1) max(F, C)  +  sum B + sum C + (M-1) max(B, C)

The other schedules have no such closed form; the simulator gives their makespan (and GPipe's
too: the tests check that both agree).

After the last backward every stage runs its optimizer step (the runtime first agrees on
the loss, a tiny all-reduce). The next step begins on stage 0 after its optimizer step; stage
k is needed again only when that step's first micro-batch reaches it: at the time its first
action started in this step (after the forwards and sends of the chunks before it). So the
step is the makespan plus ``max_k (optimizer_k - start of stage k's first action)``: stage 0's
optimizer step, unless a later stage's is longer than what the next step's fill hides.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

from ..schedules import SPLIT_BACKWARD, all_actions, chunks_per_stage, segment_actions, stage_of_chunk
from ..weight_versions import ASYNC_SCHEDULES


@dataclass(frozen=True)
class ChunkTimes:
    """One chunk's times per micro-batch. ``backward_s`` is the whole backward B (schedules that
    run B); ``backward_input_s`` and ``backward_weight_s`` its halves I and W (schedules that
    split it). ``recompute_s``: the part of B (or I) that reruns the forward. ``send_s``: to
    the next chunk, when it sits on another stage (0 for the last chunk)."""

    forward_s: float
    backward_s: float
    backward_input_s: float
    backward_weight_s: float
    send_s: float
    recompute_s: float = 0.0


@dataclass(frozen=True)
class Event:
    stage: int            # for a send: the stage that sends
    kind: str             # forward | backward | backward_input | backward_weight | recompute | send | optimizer
    micro_batch: int      # -1 for the optimizer step
    start_s: float
    end_s: float
    chunk: int            # the chunk that runs (for a send: that sends); -1 for the optimizer step


@dataclass
class Timeline:
    makespan_s: float
    step_s: float
    busy_s: list[float]
    events: list[Event] = field(default_factory=list)
    optimizer_tail_s: float = 0.0    # step_s - makespan_s: the optimizer steps the next fill does not hide


def gpipe_makespan(forward_s: Sequence[float], backward_s: Sequence[float], send_s: Sequence[float], M: int) -> float:
    """The closed form above; ``send_s`` has one entry per cut (K-1 of them)."""
    fwd_stations = list(forward_s) + list(send_s)
    bwd_stations = list(backward_s) + list(send_s)
    comm = sum(send_s)
    return (sum(forward_s) + comm + (M - 1) * max(fwd_stations)
            + sum(backward_s) + comm + (M - 1) * max(bwd_stations))


# An action, compiled for the simulator: (duration index, wait slot, produce slot, link, cut,
# kind, chunk, micro-batch). Durations are looked up as times[kind * C + chunk]; slots index
# the arrival times of activations (chunk c's output: c M + m) and gradients (for chunk c:
# C M + c M + m); -1 when there is nothing to wait for / to send; link -1: a free handover.
_Op = tuple[int, int, int, int, int, int, int, int]
_KIND_INDEX = {"F": 0, "B": 1, "I": 2, "W": 3}
_KIND_OF_INDEX = ("forward", "backward", "backward_input", "backward_weight")


@dataclass(frozen=True)
class Program:
    stages: int
    chunks: int
    ops: tuple[tuple[_Op, ...], ...]     # per stage, in its order
    links: int

    @property
    def actions(self) -> int:
        """How many actions the stages run in all."""
        return sum(len(ops) for ops in self.ops)


@functools.lru_cache(maxsize=32)
def compiled_program(schedule: str, stages: int, micro_batches: int, virtual_stages: int, steps: int = 1) -> Program:
    """The schedule's action lists with every dependency resolved to an index (made once per
    shape: the solvers simulate thousands of partitions of the same shape; planner/timeshare.py
    plays the same program out on shared cores). ``steps`` > 1: an asynchronous schedule's
    segment of that many steps without a flush (schedules.segment_actions), its micro-batches
    numbered over the segment."""
    if steps != 1 and schedule not in ASYNC_SCHEDULES:
        raise ValueError(f"{schedule} flushes every step: only an asynchronous schedule plays a segment of steps")
    lists = ([segment_actions(k, stages, micro_batches, steps) for k in range(stages)] if steps != 1
             else all_actions(schedule, stages, micro_batches, virtual_stages))
    K, M = stages, micro_batches * steps
    C = K * chunks_per_stage(schedule, virtual_stages)
    where = [stage_of_chunk(schedule, c, K) for c in range(C)]
    links: dict[tuple[int, int, int], int] = {}

    def link(src: int, dst: int, direction: int) -> int:
        if src == dst:
            return -1
        return links.setdefault((src, dst, direction), len(links))

    program = []
    for stage_list in lists:
        ops = []
        for a in stage_list:
            c, m, kind = a.chunk, a.micro_batch, _KIND_INDEX[a.kind]
            wait = produce = lnk = cut = -1
            if a.kind == "F":
                if c > 0:
                    wait = (c - 1) * M + m
                if c < C - 1:
                    produce, lnk, cut = c * M + m, link(where[c], where[c + 1], 0), c
            elif a.kind in ("B", "I"):
                if c < C - 1:
                    wait = C * M + c * M + m
                if c > 0:
                    produce, lnk, cut = C * M + (c - 1) * M + m, link(where[c], where[c - 1], 1), c - 1
            ops.append((kind * C + c, wait, produce, lnk, cut, kind, c, m))
        program.append(tuple(ops))
    return Program(K, C, tuple(program), len(links))


def simulate_plan(schedule: str, stages: int, micro_batches: int, virtual_stages: int,
                  chunks: Sequence[ChunkTimes], optimizer_s: Sequence[float] | None = None,
                  record: bool = False, steps: int = 1) -> Timeline:
    """Play one training step of ``schedule`` out, action by action (``steps`` > 1: a segment of
    an asynchronous schedule, :func:`compiled_program`).

    ``chunks``: one :class:`ChunkTimes` per chunk in pipeline order (K times chunks-per-stage);
    ``optimizer_s``: one per stage. ``record`` keeps every action, send and optimizer step as
    an :class:`Event` (the timeline picture); without it only the times are computed.
    """
    prog = compiled_program(schedule, stages, micro_batches, virtual_stages, steps)
    K, C, M = prog.stages, prog.chunks, micro_batches * steps
    if len(chunks) != C:
        raise ValueError(f"{schedule} with {K} stages has {C} chunks; got times for {len(chunks)}")
    opt = [float(x) for x in optimizer_s] if optimizer_s is not None else [0.0] * K
    times = ([ch.forward_s for ch in chunks] + [ch.backward_s for ch in chunks]
             + [ch.backward_input_s for ch in chunks] + [ch.backward_weight_s for ch in chunks])
    send = [ch.send_s for ch in chunks]
    arrived = [-1.0] * (2 * C * M)
    link_free = [0.0] * prog.links
    stage_free = [0.0] * K
    first_start = [-1.0] * K
    position = [0] * K
    events: list[Event] = []
    remaining = sum(len(ops) for ops in prog.ops)
    while remaining:
        progressed = False
        for k in range(K):
            ops = prog.ops[k]
            p, n, t = position[k], len(ops), stage_free[k]
            start_p = p
            while p < n:
                dur, wait, produce, lnk, cut, kind, c, m = ops[p]
                start = t
                if wait >= 0:
                    ready = arrived[wait]
                    if ready < 0.0:
                        break
                    if ready > t:
                        start = ready
                t = start + times[dur]
                if produce >= 0:
                    if lnk >= 0:
                        free = link_free[lnk]
                        send_start = free if free > t else t
                        arrived[produce] = link_free[lnk] = send_start + send[cut]
                        if record and send[cut] > 0:
                            events.append(Event(k, "send", m, send_start, send_start + send[cut], c))
                    else:
                        arrived[produce] = t
                if record:
                    record_action(events, k, kind, c, m, start, t, chunks[c].recompute_s)
                if p == 0:
                    first_start[k] = start
                p += 1
            if p > start_p:
                progressed = True
                remaining -= p - start_p
                position[k], stage_free[k] = p, t
        if not progressed:  # pragma: no cover - check_actions-valid lists never deadlock
            raise RuntimeError(f"schedule {schedule} deadlocked")
    makespan = max(stage_free)
    if record:
        for k in range(K):
            if opt[k] > 0:
                events.append(Event(k, "optimizer", -1, makespan, makespan + opt[k], -1))
    split = schedule in SPLIT_BACKWARD
    work = [0.0] * K
    for c, ch in enumerate(chunks):
        backward = ch.backward_input_s + ch.backward_weight_s if split else ch.backward_s
        work[stage_of_chunk(schedule, c, K)] += ch.forward_s + backward
    busy = [M * work[k] + opt[k] for k in range(K)]
    tail = max(opt[k] - first_start[k] for k in range(K))
    return Timeline(makespan_s=makespan, step_s=makespan + tail, busy_s=busy, events=events,
                    optimizer_tail_s=tail)


def record_action(events: list[Event], stage: int, kind: int, chunk: int, micro_batch: int,
            start: float, end: float, recompute_s: float) -> None:
    """An action as events: the recomputed forward is the first part of a B or I (of chunk 0's
    W, which runs its whole backward: costmodel.CostModel.backward_input)."""
    reruns = kind == 1 or (kind == 2 and chunk > 0) or (kind == 3 and chunk == 0)
    if reruns and recompute_s > 0:
        events.append(Event(stage, "recompute", micro_batch, start, start + recompute_s, chunk))
        start += recompute_s
    events.append(Event(stage, _KIND_OF_INDEX[kind], micro_batch, start, end, chunk))
