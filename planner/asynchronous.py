"""The asynchronous pipelines (``pipedream``, ``pipedream-2bw``): their step time, and the exact cut.

The rules of which weights a micro-batch meets live in :mod:`gpipe_plan.weight_versions`; this
module is what they cost. Neither schedule flushes: every stage runs 1F1B over the whole run
(:func:`gpipe_plan.schedules.segment_actions`), so after the first fill the pipeline is in a
*steady state* where each stage repeats one backward and one forward per micro-batch, and a
step of M micro-batches takes M times the steady state's *period*. The fill and the drain are
paid once per run (and at each checkpoint, where the run drains), not once per step.

The period. Stage k's work per micro-batch is its chunk's F and B as the cost model charges
1F1B's actions (:meth:`CostModel.formula`: the layers, the fixed cost of each action and of its
messages) plus its share of the updates: ``updates_per_step / M`` times its step after the
backward (gradient sync over the replicas, optimizer, tied exchanges;
:meth:`CostModel.optimizer`): pipedream updates, and all-reduces its gradient, after every
micro-batch; 2bw once a step. Call it ``w_k``. The period is the longest of what repeats once
per micro-batch, the max-plus cycle means of the steady state:

- each link, one message per micro-batch each way: ``C_k``, the send after stage k;
- each window of consecutive stages k..j: ``(sum_{k<=i<=j} w_i + 2 sum_{k<=i<j} C_i) / (j-k+1)``.
  1F1B keeps ``K - k`` micro-batches in flight on stage k, one more than on stage k+1: stage
  k's forward of micro-batch ``i + K - k`` follows its backward of i, which waited for i to
  go down to stage j and back, while stage j ran its own 1F1B in between. The window of one
  stage is ``w_k``; with free links a window's mean is never above its slowest stage; with
  slow links a window's sends there and back can be what limits a pipeline that keeps so few
  micro-batches in flight.

So the period is the slowest stage's work per micro-batch unless the links are slow. The
tests play long segments out in the event simulator (planner/simulator.py) on random
instances, slow links included, and find the same rate.

The exact cut. The period is a min-max over contiguous cuts: for a trial period P, a cut
meets it when every link is within P and every window of stages has
``sum (P - w_i) - 2 sum C_i >= 0``; a dynamic programme over the stages left to right keeps,
for each stage and first layer, the largest reserve the cuts before leave (:meth:`AsyncSolver.
feasible`), with no stage recomputing (the rerun would meet the newest weights: CostModel allows none here; the
stage would not fit in memory otherwise: recomputing only adds time). Bisection on P between a
proven infeasible value and the best cut found closes to ``_CLOSE`` (a tenth of
:data:`~.objective.RELATIVE_SLACK`):
the plan is proven optimal, with that lower bound.

Memory: stage k holds ``weight_copies`` copies of its parameters (the gradients and the
optimizer state once) and 1F1B's ``K - k`` micro-batches of activations
(:class:`~.costmodel.CostModel`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable, Sequence

from ..weight_versions import updates_per_step
from .costmodel import ChunkCost, CostModel, StageCost
from .objective import RELATIVE_SLACK, Evaluation, Solution, proven_optimal
from .simulator import ChunkTimes, Event, Timeline, simulate_plan

INF = math.inf
# The bisection stops once its bracket is this much narrower than the best period found.
_CLOSE = RELATIVE_SLACK / 10
_MAX_PROBES = 200


def update_share(cm: CostModel) -> float:
    """The updates a stage applies per micro-batch: 1 for pipedream, 1/M for 2bw."""
    return updates_per_step(cm.schedule, cm.M) / cm.M


def stage_work_s(chunks: Sequence[ChunkCost], stages: Sequence[StageCost], share: float) -> list[float]:
    """Each stage's work per micro-batch in steady state: F + B of its chunk, and ``share`` of its
    update (gradient sync, optimizer, tied exchanges: ``optimizer_s``)."""
    return [c.forward_s + c.backward_s + share * st.optimizer_s for c, st in zip(chunks, stages)]


def steady_period_s(work_s: Sequence[float], send_s: Sequence[float]) -> float:
    """The steady state's time per micro-batch (module docstring): the largest of each link's
    send (``send_s[k]``: after stage k, one per stage, the last 0) and, over every window of
    consecutive stages k..j, their work and the sends between them both ways, per stage
    (``j - k + 1`` micro-batches in flight more on stage k than after stage j)."""
    K = len(work_s)
    period = max(send_s[:K - 1], default=0.0)
    for k in range(K):
        total = 0.0
        for j in range(k, K):
            total += work_s[j]
            mean = total / (j - k + 1)
            if mean > period:
                period = mean
            total += 2 * send_s[j] if j < K - 1 else 0.0
    return period


def evaluate_async(cm: CostModel, bounds: Sequence[int], recompute: Sequence[bool] | None = None) -> Evaluation:
    """The step of the cut ``bounds``: M periods (fill and drain amortised over the run), and the
    one-time fill and drain beyond them: one step played out alone (1F1B's makespan over M
    micro-batches, each backward followed by its share of the stage's update, as the period
    charges it) less its M periods, at least 0."""
    chunks, stages = cm.layout(bounds, recompute)
    fits = cm.limit is None or all(s.memory_bytes <= cm.limit for s in stages)
    share = update_share(cm)
    period = steady_period_s(stage_work_s(chunks, stages, share), [c.send_s for c in chunks])
    step = cm.M * period
    # The updates are in the period, so they are in the step played alone too: else a stage's
    # updates would cancel its fill and drain (pipedream with an optimizer step as long as a
    # micro-batch's F + B would show none at all).
    alone = simulate_plan(cm.schedule, cm.K, cm.M, 1, [
        replace(c.times(), backward_s=c.backward_s + share * st.optimizer_s)
        for c, st in zip(chunks, stages)]).makespan_s
    return Evaluation(tuple(bounds), tuple(chunks), tuple(stages), step, step, fits,
                      steady_state_period_s=period, fill_drain_s=max(0.0, alone - step),
                      updates_per_step=updates_per_step(cm.schedule, cm.M))


class AsyncSolver:
    """The exact least period over every cut into K stages (module docstring)."""

    def __init__(self, cm: CostModel, seeds: Iterable[Sequence[int]] = ()):
        if not cm.asynchronous:
            raise ValueError(f"{cm.schedule} is not an asynchronous schedule")
        self.cm = cm
        self.seeds = [tuple(b) for b in seeds if len(b) == cm.K + 1]
        self.share = update_share(cm)
        self.formulas = [cm.formula(k) for k in range(cm.K)]
        # Weights tied across stages have no rule here (each stage updates its own weights on its
        # own clock; runtime/train.py refuses them): a cut at c between layers c-1 and c splits a
        # tie whose layers lie on both sides of it, so no stage may end there.
        self.split_ties = frozenset(c for layers, _ in cm.figures.tied
                                    for c in range(min(layers) + 1, max(layers) + 1))
        self.rows: dict[tuple[int, int], list[float]] = {}
        self.probes = 0
        # No probe asks past the first period probed: a row stops at its first work above it.
        self.cap = INF

    def work(self, k: int, s: int) -> list[float]:
        """Stage k's work per micro-batch from layer s, for each end e > s that fits in memory
        (``row[e - s - 1]``), with its recomputation chosen as 1F1B's search chooses it
        (:meth:`CostModel.choose_recompute`): cached, and the same floats as the evaluation."""
        key = (k, s)
        row = self.rows.get(key)
        if row is None:
            cm, forward, backward = self.cm, *self.formulas[k]
            last = cm.L if k == cm.K - 1 else cm.L - (cm.K - 1 - k)
            first = cm.L if k == cm.K - 1 else s + 1
            row = [INF] * (first - s - 1)       # the last stage ends at L
            for e in range(first, last + 1):
                if e in self.split_ties:
                    row.append(INF)              # no stage ends inside a tie
                    continue
                r = cm.choose_recompute(s, e, k)
                if r is None:
                    break                        # memory only grows with the stage
                row.append(forward(s, e) + backward(s, e, r) + self.share * cm.optimizer(s, e))
                if row[-1] > self.cap:
                    break                        # (work only grows with the stage)
            self.rows[key] = row
        return row

    def feasible(self, period: float) -> tuple[int, ...] | None:
        """A cut whose every link and window of stages is within ``period``, or None.

        Stages left to right: a window k..j meets the period when the sum over its stages of
        ``period - w_i``, less twice its sends, is >= 0. What the stages before j leave for the
        windows ending at j is the least of those sums over the windows ending just before j,
        clamped at 0 (``reserve``, <= 0); it only grows with its predecessor's, so for each
        stage and first layer the largest reserve over the cuts before dominates the others,
        and keeping it alone is exact."""
        self.probes += 1
        cm, L, K = self.cm, self.cm.L, self.cm.K
        comm = cm.comm
        reserve = [[-INF] * (L + 1) for _ in range(K + 1)]
        came_from = [[-1] * (L + 1) for _ in range(K + 1)]
        reserve[0][0] = 0.0
        for k in range(K):
            here, after, back = reserve[k], reserve[k + 1], came_from[k + 1]
            for s in range(k, L - (K - 1 - k)):
                before = here[s]
                if before == -INF:
                    continue
                for i, w in enumerate(self.work(k, s)):
                    if w == INF:
                        continue                 # (the last stage: only e = L)
                    left = before + period - w
                    if left < 0.0:
                        break                    # work only grows with the stage
                    e = s + 1 + i
                    if e < L:
                        send = comm[e]
                        if send > period:
                            continue
                        left -= 2 * send
                    value = left if left < 0.0 else 0.0
                    if value > after[e]:
                        after[e], back[e] = value, s
        if reserve[K][L] == -INF:
            return None
        bounds, e = [L], L
        for k in range(K, 0, -1):
            e = came_from[k][e]
            bounds.append(e)
        return tuple(reversed(bounds))

    def solve(self) -> Solution | None:
        cm = self.cm
        best: Evaluation | None = None

        def consider(bounds: Sequence[int]) -> None:
            nonlocal best
            if self.split_ties.intersection(bounds):
                return                           # a seed that cuts a tie cannot run
            ev = evaluate_async(cm, bounds)
            if ev.fits and (best is None or ev.step_s < best.step_s):
                best = ev

        for seed in self.seeds:
            consider(seed)
        if best is None:
            # No seed fits: any cut that fits in memory (an unbounded period), else none does.
            found = self.feasible(INF)
            if found is None:
                return None
            consider(found)
        assert best is not None
        lo, hi = 0.0, best.steady_state_period_s
        self.cap = hi
        while hi - lo > hi * _CLOSE and self.probes < _MAX_PROBES:
            mid = (lo + hi) / 2
            cut = self.feasible(mid)
            if cut is None:
                lo = mid
            else:
                consider(cut)
                hi = min(mid, best.steady_state_period_s)
        lower_bound = cm.M * lo
        if lower_bound > best.step_s:      # (rounding between the programme's slack and the evaluation)
            lower_bound = best.step_s
        return Solution(best, proven_optimal(best.step_s, lower_bound), lower_bound,
                        "min-max dynamic programme over the cuts (the steady state's period, bisected)",
                        stats={"probes": self.probes}, bound_by="dp")


def steady_window(schedule: str, stages: int, micro_batches: int, chunks: Sequence[ChunkTimes],
                  steps: int = 3) -> Timeline:
    """The middle step of a ``steps``-step segment played out (for the timeline): the events
    that overlap it, clipped to it and moved to start at 0, and its span. The window runs from
    stage 0's first forward of the middle step to its first forward of the step after (or, for
    the last, the segment's end)."""
    middle = steps // 2
    played = simulate_plan(schedule, stages, micro_batches, 1, chunks, record=True, steps=steps)
    starts = {e.micro_batch: e.start_s for e in played.events
              if e.stage == 0 and e.kind == "forward" and e.micro_batch % micro_batches == 0}
    begin = starts[middle * micro_batches]
    end = starts.get((middle + 1) * micro_batches, played.makespan_s)
    events = [Event(e.stage, e.kind, e.micro_batch, max(e.start_s, begin) - begin, min(e.end_s, end) - begin, e.chunk)
              for e in played.events if e.end_s > begin and e.start_s < end]
    return Timeline(makespan_s=end - begin, step_s=end - begin, busy_s=played.busy_s, events=events)
