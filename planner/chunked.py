"""The solver for interleaved 1F1B, ZB-H1 and ZB-V: a lower bound per stage, and branch and bound.

These schedules cut the layers into C = K v chunks (v chunks per stage: v for ``interleaved``,
2 for ``zb-v``, 1 for ``zb-h1``) and run a fixed list of actions on each stage
(:mod:`gpipe_plan.schedules`). Their step time is what the event simulator finds; what we
have without simulating is a lower bound for every stage k, because the stage runs its list
in order, one action at a time, and some waits are forced:

* ``before``: its first action (F of its lowest chunk c0, micro-batch 0) waits for micro-batch
  0 to pass every chunk below c0 and the links between them;
* the warm-up wait: its first backward (B or I of chunk cb for micro-batch mb) waits for that
  micro-batch's forward to run down to the last chunk and its gradient to come back to cb;
  meanwhile the stage can only run the actions its list puts before that backward;
* the drain: after its last backward of c0, that gradient still goes down every chunk below
  c0 (and, for a split backward, chunk 0's W follows its I);
* in between, all of its own work.

So, writing ``pre(x)`` for the work of the stage's first x actions and ``chain`` for the
waits above (sums of chunk times and sends)::

    step >= before + max(pre(first B), pre(F of mb) + down-and-back)
                   + max(pre(last B of c0) - pre(first B) + drain, all - pre(first B))
           + stage 0's optimizer step

Every term is a sum of chunk times with non-negative counts read off the stage's list once
per setting, so a bound costs O(chunks); and a chunk not chosen yet contributes at least 0,
so the same formula bounds a partial cut. What the chunks not cut yet will add is bounded on
its own: every stage's makespan covers its idle time (before its first action, and the part
of the drain its last actions do not cover) and all its work, and the work of the layers not
cut yet goes to the stages that still have chunks to fill, at best evened out among them
(a water level), with the heaviest of those layers whole on one of them.

The search seeds itself (chunks of equal work, of equal layer count, given seeds) and moves
single cuts while that helps, then cuts the chunks left to right, drops a prefix whose bound
cannot beat the best plan simulated so far, and simulates the cuts that survive. When it
finishes, the plan is proven optimal; when its time budget runs out, the plan carries the least
bound of what was left open, and the gap.

Recomputation is decided per stage, for all its chunks alike: a stage recomputes only when it
does not fit in memory without (recomputing only adds time to its backward, and with fixed
action lists a longer action never makes the step shorter). A stage's memory is known once
its last chunk is cut; until then its chunks are bounded with their cheaper, plain times.
"""

from __future__ import annotations

import bisect
import math
import time
from itertools import accumulate
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..schedules import all_actions
from .budgets import SOLVER_TIME_BUDGET_S, WORK_PER_SECOND
from .costmodel import CostModel
from .objective import Incumbent, Solution, evaluate

INF = math.inf
_KIND = {"F": 0, "B": 1, "I": 1, "W": 2}    # forward, the backward the previous chunk waits for, W


@dataclass(frozen=True)
class _StageShape:
    """What the bound needs of one stage's list: counts of (kind, chunk) up to a few positions."""

    lowest: int                                   # its lowest chunk c0
    first_backward_chunk: int                     # cb
    to_first_backward: tuple[tuple[int, int, int], ...]        # pre(first B): (kind, chunk, count)
    to_first_backward_forward: tuple[tuple[int, int, int], ...]  # pre(F of mb) incl. that F
    to_last_lowest_backward: tuple[tuple[int, int, int], ...]  # pre(last B of c0) incl. it
    total: tuple[tuple[int, int, int], ...]
    after_last_lowest_chunks: tuple[int, ...]     # the chunks of the actions after the last B of c0
    before_first_backward_chunks: tuple[int, ...]  # the chunks of the actions before its first B


def _counts(actions, upto: int) -> tuple[tuple[int, int, int], ...]:
    tally: dict[tuple[int, int], int] = {}
    for a in actions[:upto]:
        key = (_KIND[a.kind], a.chunk)
        tally[key] = tally.get(key, 0) + 1
    return tuple((kind, chunk, n) for (kind, chunk), n in sorted(tally.items()))


def stage_shapes(schedule: str, stages: int, micro_batches: int, virtual_stages: int) -> list[_StageShape]:
    shapes = []
    for actions in all_actions(schedule, stages, micro_batches, virtual_stages):
        lowest = min(a.chunk for a in actions)
        first_b = next(i for i, a in enumerate(actions) if a.kind in ("B", "I"))
        cb, mb = actions[first_b].chunk, actions[first_b].micro_batch
        forward_of_mb = next(i for i, a in enumerate(actions) if a.kind == "F" and a.chunk == cb and a.micro_batch == mb)
        last_lowest = max(i for i, a in enumerate(actions) if a.kind in ("B", "I") and a.chunk == lowest)
        shapes.append(_StageShape(lowest, cb, _counts(actions, first_b), _counts(actions, forward_of_mb + 1),
                                  _counts(actions, last_lowest + 1), _counts(actions, len(actions)),
                                  tuple(sorted({a.chunk for a in actions[last_lowest + 1:]})),
                                  tuple(sorted({a.chunk for a in actions[:first_b]}))))
    return shapes


# A search the cutoff pruned to nothing looks for any cut that fits (ChunkedSolver._first_fit)
# on this share of its work budget: enough for small problems and for most whose memory limit
# leaves room; where nothing fits the look is all waste. On the rest of the budget instead, gnmt on
# 8 stages under a 600 MiB limit (27 settings pruned to nothing) took 49 s of a 10 s budget.
FIRST_FIT_SHARE = 0.05


class ChunkedSolver:
    """Branch and bound over the C - 1 cuts of a chunked or split-backward schedule."""

    def __init__(self, cm: CostModel, seeds: Iterable[Sequence[int]] = (),
                 time_budget_s: float = SOLVER_TIME_BUDGET_S,
                 cutoff_s: float = INF, work_budget_s: float | None = None):
        """``time_budget_s``: wall time at most; ``work_budget_s`` (default the same): the
        seconds of work (WORK_PER_SECOND) after which the search stops, whatever the clock."""
        self.cm = cm
        self.L, self.K, self.M, self.C = cm.L, cm.K, cm.M, cm.C
        self.seeds = [tuple(s) for s in seeds]
        self.time_budget_s = time_budget_s
        self.work_budget = (time_budget_s if work_budget_s is None else work_budget_s) * WORK_PER_SECOND
        self.work_done = 0.0
        self.stopped_early = False     # the budget ended the search (else it searched every cut)
        # a simulation's share of work: one unit per 64 of its actions (at least one)
        self.simulation_work = max(1.0, 3 * cm.C * cm.M / 64)
        self.cutoff_s = cutoff_s
        self.shapes = stage_shapes(cm.schedule, cm.K, cm.M, cm.virtual_stages)
        self.stage_of = cm.stage_of_chunk
        self.last_chunk_of = [max(cm.peaks[k].chunks) for k in range(cm.K)]
        self.plain = cm.allowed_recompute[0]      # the cheaper choice (False unless only True is allowed)
        # Prefix sums of each layer's backward at its least (B, or I + W), for the work not cut yet.
        self.plain_backward = cm.least_backward_prefix
        self.layer_floor = cm.layer_floor_s            # [Note: a layer's floor]
        # The fixed parts of the chunks not cut yet, from chunk c on: of their forwards, and of all
        # their actions (F, and B or I + W); chunk 0's are the least it can have (no rerun).
        forward_fixed = [cm.chunk_fixed("F", c) for c in range(cm.C)]
        action_fixed = [forward_fixed[c] + (cm.chunk_fixed("I", c) + cm.chunk_fixed("W", c) if cm.split
                                            else cm.chunk_fixed("B", c)) for c in range(cm.C)]
        self.forward_fixed_from = [*accumulate(reversed(forward_fixed))][::-1] + [0.0]
        self.action_fixed_from = [*accumulate(reversed(action_fixed))][::-1] + [0.0]
        self.layer_work = [f + b for f, b in zip(cm.pf, self.plain_backward)]   # prefix of F + B per layer
        # heaviest_from[s]: the most work (F + B, plain) of one layer among layers s..L-1
        self.heaviest_from = _heaviest_from(self.layer_work)
        # whether any stage can have an optimizer step, gradient sync or tied exchange to wait for
        self.optimizer_matters = cm.popt[cm.L] > 0 or cm.sync_on or any(
            cm.tied_exchange_s(t) > 0 for t in range(len(cm.figures.tied)))
        # Per layer, the least it adds to its stage's optimizer step (its optimizer time and its
        # bytes' share of the sync), alone and with its M forwards and plain backwards, as prefix
        # sums and the heaviest layer from each on ([Note: the optimizer steps the stages share]).
        sync_per_byte = cm.gradient_sync_s_per_byte()
        self.optimizer_prefix = [cm.popt[i] + sync_per_byte * cm.pp[i] for i in range(self.L + 1)]
        self.joint_prefix = [self.M * self.layer_work[i] + self.optimizer_prefix[i] for i in range(self.L + 1)]
        self.optimizer_heaviest_from = _heaviest_from(self.optimizer_prefix)
        self.joint_heaviest_from = _heaviest_from(self.joint_prefix)
        self.slowest_send = max(cm.comm, default=0.0)
        self.simulations = 0
        self.nodes = 0

    # ----------------------------------------------------------------- the bound
    def _times(self, bounds: Sequence[int], recompute: Sequence[bool | None]) -> tuple[list[list[float]], list[float]]:
        """Per chunk [F, B or I, W] and send times of the chunks cut so far (zeros beyond)."""
        cm, C = self.cm, self.C
        times = [[0.0] * C for _ in range(3)]
        send = [0.0] * C
        for c in range(len(bounds) - 1):
            s, e = bounds[c], bounds[c + 1]
            r = recompute[self.stage_of[c]]
            r = self.plain if r is None else r
            f, b, i, w = cm.chunk_times(c, s, e, r)
            times[0][c] = f
            if cm.split:
                times[1][c], times[2][c] = i, w
            else:
                times[1][c] = b
            if c < C - 1 and self.stage_of[c + 1] != self.stage_of[c]:
                send[c] = cm.comm[e]
        return times, send

    def _spent(self, started: float, share: float = 1.0) -> bool:
        """Whether ``share`` of the budget is used up: in work, or (a safety net) in wall time
        (then :attr:`stopped_early`: what it did not search may hold a plan)."""
        spent = (self.work_done >= share * self.work_budget
                 or time.perf_counter() - started > share * self.time_budget_s)
        self.stopped_early |= spent
        return spent

    def bound(self, bounds: Sequence[int], recompute: Sequence[bool | None]) -> float:
        """A lower bound on the step of every cut that begins with ``bounds`` (chunk boundaries
        0 = b0 < ... < bj; the rest not chosen), recompute per stage (None: not chosen)."""
        self.work_done += 1
        times, send = self._times(bounds, recompute)
        F, BI, W = times
        C = self.C
        # fwd[c]: micro-batch 0's arrival at chunk c's forward; bwd[c]: the backward chain.
        fwd = [0.0] * (C + 1)
        for c in range(C):
            fwd[c + 1] = fwd[c] + F[c] + send[c]
        down = [0.0] * (C + 1)        # down[c]: from F(c) done to its gradient arriving back at c
        for c in range(C - 2, -1, -1):
            down[c] = down[c + 1] + send[c] + F[c + 1] + BI[c + 1] + send[c]
        drain = [0.0] * C              # after chunk c's B/I: the rest of the backward below it
        for c in range(1, C):
            drain[c] = drain[c - 1] + send[c - 1] + BI[c - 1]
        w0 = W[0]
        decided = len(bounds) - 1
        # Any first backward waits for its micro-batch's forward through every chunk (whose
        # forwards are known in sum even before they are cut) and the backward chain back.
        cm = self.cm
        forward_all = fwd[decided]
        if decided < C:
            forward_all += cm.pf[self.L] - cm.pf[bounds[-1]] + self.forward_fixed_from[decided]
        back = [0.0] * C               # back[c]: from the last chunk's B/I start to the gradient at c
        for c in range(C - 2, -1, -1):
            back[c] = back[c + 1] + BI[c + 1] + send[c]
        worst = 0.0
        busy_floor = []              # per stage: its idle time and its known work, a floor on the makespan
        tail_floor = []              # per stage: its known optimizer step less its latest first start
        joint_floor = []             # per stage: its known work and optimizer step, a floor on the step
        # micro-batch 0's forward reaches any chunk not cut yet by then at the latest
        latest_start = forward_all + (C - decided) * self.slowest_send
        for k, shape in enumerate(self.shapes):
            def pre(counts):
                return sum(n * times[kind][chunk] for kind, chunk, n in counts)
            first_b = pre(shape.to_first_backward)
            lowest = shape.lowest
            start_b = max(fwd[lowest] + first_b,
                          fwd[lowest] + pre(shape.to_first_backward_forward) + down[shape.first_backward_chunk],
                          forward_all + back[shape.first_backward_chunk])
            to_last = pre(shape.to_last_lowest_backward)
            drain_after = drain[lowest] + (w0 if lowest > 0 else 0.0)
            total = pre(shape.total)
            value = start_b + max(to_last - first_b + drain_after, total - first_b)
            if value > worst:
                worst = value
            # The stage idles before its first action (before its first backward, less the work
            # it does before it, once that work is known), and after its own work for as much of
            # the drain as its remaining actions (all known) do not cover.
            idle = fwd[min(lowest, decided)]
            if all(c < decided for c in shape.before_first_backward_chunks):
                idle = max(idle, start_b - first_b)
            if all(c < decided for c in shape.after_last_lowest_chunks):
                idle += max(0.0, drain_after - (total - to_last))
            busy_floor.append(idle + total)
            if self.optimizer_matters:
                # what its chunks cut so far already cost (none: the layers not cut yet count it)
                known = self._least_optimizer(bounds, recompute, k) if any(
                    c < decided for c in self.cm.peaks[k].chunks) else 0.0
                tail_floor.append(known - (fwd[lowest] if lowest <= decided else latest_start))
                joint_floor.append(total + known)
        worst = max(worst, self._water_level(busy_floor, bounds[-1], decided), self.layer_floor)
        # The optimizer tail, max_k (optimizer_k - start of stage k's first action): stage 0's,
        # and every other stage's whose first action's start is known (micro-batch 0 reaching its
        # lowest chunk: the chunks below are cut).
        tail = self._least_optimizer(bounds, recompute, 0)
        if not self.optimizer_matters:
            return worst + tail
        for k in range(1, self.K):
            lowest = self.shapes[k].lowest
            if lowest < decided:
                tail = max(tail, self._least_optimizer(bounds, recompute, k) - fwd[lowest])
        start, extra = bounds[-1], self.M * self.action_fixed_from[decided]
        tail = max(tail, self._shared_level(tail_floor, start, decided, self.optimizer_prefix,
                                            self.optimizer_heaviest_from))
        return max(worst + tail, self._shared_level(joint_floor, start, decided, self.joint_prefix,
                                                    self.joint_heaviest_from, extra))

    # [Note: the optimizer steps the stages share]
    # The step is the makespan plus the tail max_k (optimizer_k - first start_k)
    # (planner/simulator.py). Every layer's optimizer time and parameter bytes land on some
    # stage, and each byte a stage gains adds at least the ring's per-byte time to its sync, so
    # the stages' optimizer steps are at least a water level of what the layers not cut yet
    # bring, over the stages that hold the chunks not cut yet; a first start is at most micro-
    # batch 0's forward through every layer. So the tail is at least that level. Besides, stage
    # k runs all its actions one at a time from its first start on, so the makespan is at least
    # first start_k + work_k: the step is at least work_k + optimizer_k (the start cancels), a
    # level of work and optimizer steps together. Without them the tail's bound knows only the
    # stages whose chunks below are cut (before any cut, stage 0's first layer), far below a step
    # whose syncs take half of it (gnmt on 512 devices: docs/benchmarks/exactness.md).
    def _shared_level(self, floors: list[float], start: int, decided: int, prefix: Sequence[float],
                      heaviest_from: Sequence[float], extra: float = 0.0) -> float:
        """The least of max over stages of (floor + what the layers not cut yet bring it):
        ``prefix`` sums what each layer brings, ``extra`` is what the chunks not cut yet bring
        whatever their layers (their fixed costs); they go to the stages holding those chunks,
        as evenly as helps most, but the heaviest layer whole to one of them."""
        if decided >= self.C:
            return max(floors)
        open_stages = sorted(floors[k] for k in {self.stage_of[c] for c in range(decided, self.C)})
        rest = prefix[self.L] - prefix[start] + extra
        return max(max(floors), _level(open_stages, rest), open_stages[0] + heaviest_from[start])

    def _least_optimizer(self, bounds: Sequence[int], recompute: Sequence[bool | None], k: int) -> float:
        """Stage k's optimizer step (CostModel.stage_optimizer) once it is complete; before, what
        its chunks cut so far already cost, which only grows with the stage: their optimizer time
        and gradient sync, not the tied exchanges (a later chunk may join a tie's layers). Stage 0
        holds layer 0 at least."""
        cm = self.cm
        decided = len(bounds) - 1
        spans = [(bounds[c], bounds[c + 1]) for c in cm.peaks[k].chunks if c < decided]
        if recompute[k] is not None:
            return cm.stage_optimizer(spans)
        if k == 0 and not spans:
            spans = [(0, 1)]
        return sum(cm.popt[e] - cm.popt[s] for s, e in spans) + cm.gradient_sync_s(spans)

    def _water_level(self, floors: list[float], start: int, decided: int) -> float:
        """The least makespan that leaves room for the work not cut yet.

        Every stage's makespan covers its idle time and all its work (``floors``: what is known
        of both). The layers from ``start`` on, in the chunks not cut yet, add ``rest`` of work
        (plain times), spread over the stages that hold those chunks as evenly as helps most:
        the makespan is at least the level T with sum over them of max(0, T - floor) = rest.
        """
        if decided >= self.C:
            return max(floors)
        cm = self.cm
        rest = self.M * (cm.pf[self.L] - cm.pf[start] + self.plain_backward[self.L] - self.plain_backward[start]
                         + self.action_fixed_from[decided])
        open_stages = sorted(floors[k] for k in {self.stage_of[c] for c in range(decided, self.C)})
        # ... and the heaviest layer left lands whole on one of them
        heaviest = open_stages[0] + self.M * self.heaviest_from[start]
        return max(max(floors), _level(open_stages, rest), heaviest)

    # ----------------------------------------------------------------- search
    def solve(self) -> Solution | None:
        cm, L, C, K = self.cm, self.L, self.C, self.K
        started = time.perf_counter()
        if C > L:
            return None
        found = Incumbent(cm, self.cutoff_s)

        def consider(bounds: tuple[int, ...]) -> None:
            found.consider(bounds)
            self.simulations += 1
            self.work_done += self.simulation_work

        for seed in [*self.seeds, *self._heuristic_seeds()]:
            if len(seed) == C + 1 and seed[0] == 0 and seed[-1] == L and all(a < b for a, b in zip(seed, seed[1:])):
                consider(tuple(seed))
        # A first incumbent worth pruning with: move one cut at a time by one layer while that
        # helps (a quarter of the budget at most; the search below is what proves anything).
        improved = found.best is not None
        while improved and not self._spent(started, 0.25):
            current = found.best
            for step in (1, 2, 4, 8):
                for j in range(1, C):
                    for move in (-step, step):
                        cuts = list(current.bounds)
                        cuts[j] += move
                        if cuts[j - 1] < cuts[j] < cuts[j + 1]:
                            consider(tuple(cuts))
                if found.best is not current:
                    break
            improved = found.best is not current
        global_bound = self.bound((0,), [None] * K)
        out_of_time = False
        open_bound = INF
        incumbent = found.threshold      # bound once: called per node

        def dfs(cuts: list[int], recompute: list[bool | None]) -> None:
            nonlocal out_of_time, open_bound
            self.nodes += 1
            j = len(cuts) - 1                  # the chunk to cut next
            s = cuts[-1]
            if out_of_time or self._spent(started):
                out_of_time = True
                open_bound = min(open_bound, self.bound(cuts, recompute))
                return
            ends = [L] if j == C - 1 else range(s + 1, L - (C - 1 - j) + 1)
            children = []
            for e in ends:
                # With many layers one node scans thousands of ends: the budget is checked per end,
                # and the ends left unscanned keep this node's own bound.
                if self._spent(started):
                    out_of_time = True
                    open_bound = min(open_bound, self.bound(cuts, recompute))
                    break
                child = self._child(cuts, recompute, e)
                if child is None:
                    continue
                child_cuts, child_recompute = child
                b = self.bound(child_cuts, child_recompute)
                if b < incumbent():
                    children.append((b, e, child_cuts, child_recompute))
            children.sort(key=lambda item: (item[0], item[1]))
            for b, e, child_cuts, child_recompute in children:
                if b >= incumbent():
                    continue
                if out_of_time:
                    open_bound = min(open_bound, b)
                    continue
                if j == C - 1:
                    consider(tuple(child_cuts))
                else:
                    dfs(child_cuts, child_recompute)

        if global_bound < incumbent():
            dfs([0], [None] * K)
        if found.best is None and self.cutoff_s < INF and not out_of_time:
            # Nothing found, but perhaps only because the cutoff pruned every branch. A setting
            # with no plan reads as one that does not fit (a runner-up "does not fit in memory"),
            # so look for any cut that fits, on a small share of the budget (FIRST_FIT_SHARE).
            fitting = self._first_fit(started)
            if fitting is not None:
                consider(fitting)
        if found.best is None:
            return None
        lower = found.lower_bound(global_bound, open_bound)
        return Solution(found.best, lower >= found.best.step_s, lower,
                        f"{cm.schedule} event simulation; per-stage lower bounds + branch and bound over the chunk cuts",
                        {"simulations": self.simulations, "nodes": self.nodes, "work": round(self.work_done),
                         "seconds": round(time.perf_counter() - started, 3)})

    def _first_fit(self, started: float) -> tuple[int, ...] | None:
        """A cut that fits in memory, whatever its step (None: none found, or the budget ended).

        Depth first, each node's children in the order of their bound, so that the first cut
        that fits is a good one; a stage's memory is checked as its last chunk is cut (as the
        search does), and a cut of every chunk is evaluated. Where nothing fits it would explore
        every cut the memory allows, and a setting that returns no plan charges nothing to the
        budget the settings share, so it gets :data:`FIRST_FIT_SHARE` of the setting's work
        budget (and stops where the search would, :meth:`_spent`)."""
        cm, L, C = self.cm, self.L, self.C
        budget = self.work_done + FIRST_FIT_SHARE * self.work_budget

        def dfs(cuts: list[int], recompute: list[bool | None]) -> tuple[int, ...] | None:
            j = len(cuts) - 1
            children = []
            for e in ([L] if j == C - 1 else range(cuts[-1] + 1, L - (C - 1 - j) + 1)):
                if self.work_done >= budget or self._spent(started):
                    return None
                child = self._child(cuts, recompute, e)
                if child is not None:
                    children.append((self.bound(*child), e, *child))
            for _, _, child_cuts, child_recompute in sorted(children, key=lambda item: item[:2]):
                if j == C - 1:
                    self.work_done += self.simulation_work
                    if evaluate(cm, child_cuts).fits:
                        return tuple(child_cuts)
                    continue
                fitting = dfs(child_cuts, child_recompute)
                if fitting is not None or self.work_done >= budget or self._spent(started):
                    return fitting
            return None

        return dfs([0], [None] * self.K)

    def _child(self, cuts: list[int], recompute: list[bool | None], e: int) -> tuple[list[int], list[bool | None]] | None:
        """The next chunk cut to end at layer ``e``, and the recomputation per stage: chosen
        once the cut completes a stage (its last chunk), None when that stage fits in no way."""
        child_cuts = cuts + [e]
        j = len(cuts) - 1
        k = self.stage_of[j]
        if self.last_chunk_of[k] != j:
            return child_cuts, recompute
        r = self.cm.choose_stage_recompute(k, self.cm.spans(child_cuts, k))
        if r is None:
            return None
        child_recompute = recompute.copy()
        child_recompute[k] = r
        return child_cuts, child_recompute

    def _heuristic_seeds(self) -> list[tuple[int, ...]]:
        """First incumbents: chunks of equal work, and of equal layer counts."""
        L, C = self.L, self.C
        work = self.layer_work
        total = work[L]
        cuts = [0]
        for j in range(1, C):
            e = bisect.bisect_left(work, total * j / C)
            e = min(max(e, cuts[-1] + 1), L - (C - j))
            cuts.append(e)
        even = tuple(j * L // C for j in range(C + 1))
        return [tuple(cuts + [L]), even]


def _level(floors: list[float], rest: float) -> float:
    """The level T at which ``Σ max(0, T - floor) = rest``: ``rest`` poured over the stages whose
    ``floors`` are given (ascending), as evenly as helps most."""
    level = floors[0]
    for n, floor in enumerate(floors[1:], start=1):
        if (floor - level) * n >= rest:
            return level + rest / n
        rest -= (floor - level) * n
        level = floor
    return level + rest / len(floors)


def _heaviest_from(prefix: Sequence[float]) -> list[float]:
    """Per layer i, the most any one layer from i on adds to the prefix sums ``prefix``."""
    out = [0.0] * len(prefix)
    for i in range(len(prefix) - 2, -1, -1):
        out[i] = max(out[i + 1], prefix[i + 1] - prefix[i])
    return out

