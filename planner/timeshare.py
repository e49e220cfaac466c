"""More ranks than cores: a pipeline whose stages share the host's cores, played out in time.

The planner's premise is a device per stage: stage k computes whenever its next action's
input is there. On one CPU host with fewer cores than ranks (4 stages on 2 cores, or any K
beyond ``cores / threads``), that does not hold: the kernel shares the cores among the ranks
that are computing, and a rank computes slower while more of them want a core than there are.
The stages still idle while they wait for a neighbour, and a waiting rank takes no core; so
neither extreme is right: charging every action as if all K ranks computed at once (the
neighbours' slowdown measured with K processes) overstates a pipeline that spends part of its
step in bubbles, and a core per rank understates it.

The model here is the kernel's fair sharing, taken as fluid: while ``r`` ranks are computing
and the host runs ``n`` of them at full speed (its cores over each rank's threads), each
progresses at ``min(1, n / r)`` of its speed alone; an action whose duration the cost model
gives (with its neighbours' slowdown and fixed costs, as for a rank with its own cores) ends
once it has had that much time at full speed. Dependencies, per-stage orders and links are
the dedicated simulator's (:func:`planner.simulator.simulate_plan` runs the very same compiled
program), so:

- with ``n >= K`` every rank always runs at full speed and this is that simulator's makespan;
- an action never runs faster than its duration and the per-stage orders are fixed, so every
  event comes no earlier than on dedicated cores: the time-shared makespan is never below
  the dedicated one, and every lower bound the solvers prove from dedicated times (their
  branch and bound, the DP's staircase) stays a lower bound here;
- the cores cannot do more than ``n`` ranks' work at once: the makespan is at least the
  total work over ``n``.

The step adds the optimizer's tail as the dedicated model computes it (the next step's fill
hides what it hides there; the optimizer steps are a small part of a step and their sharing is
not modelled). Sharing also costs more than the share itself: a rank's caches are cold when it
gets its core back, the kernel hands cores over in slices of milliseconds, and a rank woken by a
message may wait for one to end. That is measured, not modelled here: the profile times ranks
sharing its cores (``fixed_costs.shared_cores``, profiles/fixedcosts.py) and the cost model
charges every action what it found (``Setting.shared_core_slowdown`` and
``shared_core_action_s``) before this plays the step out; a plan that time-shares says so.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

from .simulator import ChunkTimes, Event, compiled_program, record_action

# Two remaining works this close (relative to the longest action) end at the same moment.
_SAME_MOMENT = 1e-12


def time_shared_makespan(schedule: str, stages: int, micro_batches: int, virtual_stages: int,
                         chunks: Sequence[ChunkTimes], concurrent_ranks: float,
                         record: bool = False) -> tuple[float, list[Event]]:
    """The makespan of one step of ``schedule`` when at most ``concurrent_ranks`` of its
    ``stages`` ranks compute at full speed at once (see the module docstring), and, with
    ``record``, every action and send as an :class:`~planner.simulator.Event`."""
    prog = compiled_program(schedule, stages, micro_batches, virtual_stages)
    K, C = prog.stages, prog.chunks
    if len(chunks) != C:
        raise ValueError(f"{schedule} with {K} stages has {C} chunks; got times for {len(chunks)}")
    if not concurrent_ranks > 0:
        raise ValueError(f"concurrent ranks must be positive, got {concurrent_ranks}")
    times = ([ch.forward_s for ch in chunks] + [ch.backward_s for ch in chunks]
             + [ch.backward_input_s for ch in chunks] + [ch.backward_weight_s for ch in chunks])
    send = [ch.send_s for ch in chunks]
    arrived = [-1.0] * (2 * C * micro_batches)   # when each message is there (-1: not sent yet)
    future: list[float] = []                     # arrival times still ahead (a heap)
    link_free = [0.0] * prog.links
    position = [0] * K
    remaining = [0.0] * K          # full-speed time left of the running action
    started = [-1.0] * K           # when the running action began (-1: the stage is not computing)
    events: list[Event] = []
    longest = max(times, default=0.0)
    t = 0.0
    end = 0.0
    while True:
        for k in range(K):                    # every stage whose next action can begin, begins
            if started[k] < 0.0 and position[k] < len(prog.ops[k]):
                wait = prog.ops[k][position[k]][1]
                if wait < 0 or 0.0 <= arrived[wait] <= t:
                    started[k] = t
                    remaining[k] = times[prog.ops[k][position[k]][0]]
        running = [k for k in range(K) if started[k] >= 0.0]
        while future and future[0] <= t:
            heapq.heappop(future)
        if not running:
            if future:                        # every stage waits for a message still on a link
                t = future[0]
                continue
            break
        rate = min(1.0, concurrent_ranks / len(running))
        least = min(remaining[k] for k in running)
        step = least / rate
        if future and future[0] - t < step:   # a message lands first: the sharing may change then
            step = future[0] - t
            least = step * rate
        t += step
        done = [k for k in running if remaining[k] - least <= _SAME_MOMENT * longest]
        for k in running:
            remaining[k] -= least
        for k in done:
            dur, _, produce, lnk, cut, kind, c, m = prog.ops[k][position[k]]
            if produce >= 0:
                if lnk >= 0:
                    free = link_free[lnk]
                    send_start = free if free > t else t
                    arrived[produce] = link_free[lnk] = send_start + send[cut]
                    if arrived[produce] > t:
                        heapq.heappush(future, arrived[produce])
                    if record and send[cut] > 0:
                        events.append(Event(k, "send", m, send_start, send_start + send[cut], c))
                else:
                    arrived[produce] = t
            if record:
                # The recomputed forward takes its share of the action's stretched span.
                stretch = (t - started[k]) / times[dur] if times[dur] > 0 else 1.0
                record_action(events, k, kind, c, m, started[k], t, chunks[c].recompute_s * stretch)
            started[k] = -1.0
            remaining[k] = 0.0
            position[k] += 1
            end = t
    if any(position[k] < len(prog.ops[k]) for k in range(K)):  # pragma: no cover - valid lists never deadlock
        raise RuntimeError(f"schedule {schedule} deadlocked")
    return end, events


def concurrent_ranks_of(cores: float | None, threads_per_rank: int, ranks_per_host: int,
                        stages: int) -> float:
    """How many of a pipeline's ``stages`` ranks its host runs at full speed at once: the
    host's ``cores`` over the threads of each of its ``ranks_per_host`` ranks, shared alike by
    the pipelines on it (``ranks_per_host / stages`` replicas); ``math.inf`` where every rank
    has its cores (or the profile did not say how many the host has)."""
    if cores is None or cores <= 0:
        return math.inf
    replicas_here = max(1.0, ranks_per_host / stages)
    concurrent = cores / max(1, threads_per_rank) / replicas_here
    return math.inf if concurrent >= stages else concurrent
