"""The solver for 1F1B: a lower bound per stage, and branch and bound over the cuts.

1F1B has no closed form: its step time is what :func:`planner.simulator.simulate_plan` finds by
playing the operations out. What we do have is a lower bound for every stage k that
depends only on where the stage starts and ends, because stage k runs its operations one at
a time and some of its waits are forced:

* before its first forward, micro-batch 0 must pass every earlier stage and link;
* after its last backward, that gradient must pass them all again on the way back;
* between its first forward and the first backward, micro-batch 0 goes down the rest of the
  pipeline and back (``down``), while the stage can only run its other warm-up forwards
  (``min(M, K-k) - 1`` of them); the same holds between its last forward and last backward,
  with the cool-down backwards. (When all M forwards fit in the warm-up, the two windows
  overlap and only the larger wait counts.)

So ``step >= before + M (F_k + B_k) + max(0, down - (w-1) F_k) + max(0, down - (w-1) B_k)``
for every k, plus stage 0's optimizer step. The bound is tight for most partitions (the
tests measure how often), and it makes branch and bound effective: cut stages left to right,
drop every prefix whose bound (its stages' bounds, and the best the remaining layers could do,
from a DP over suffixes) cannot beat the best plan simulated so far, and simulate the
partitions that survive. When the search finishes, the plan is proven optimal; when it runs
out of its time budget, the plan says so and reports the proven lower bound and the gap.
"""

from __future__ import annotations

import math
import time
from typing import Iterable

from .budgets import SOLVER_TIME_BUDGET_S, WORK_PER_SECOND
from .costmodel import CostModel
from .objective import Incumbent, Solution, work_floor

INF = math.inf


class _OutOfTime(Exception):
    """The time budget ran out while the suffix tables were being built (see _without_bounds)."""


class OneFOneBSolver:
    def __init__(self, cm: CostModel, seeds: Iterable[tuple[int, ...]] = (),
                 time_budget_s: float = SOLVER_TIME_BUDGET_S,
                 cutoff_s: float = INF, suffix_tables: dict[int, list[float]] | None = None,
                 work_budget_s: float | None = None):
        """``cutoff_s``: a step time already achieved elsewhere (another setting); partitions
        that cannot beat it are not explored, and if none can, the search is skipped.
        ``suffix_tables``: shared between solvers that differ only in K (see _suffix_tables).
        ``time_budget_s``: wall time at most; ``work_budget_s`` (default the same): the seconds
        of work (budgets.WORK_PER_SECOND) after which the search stops, whatever the clock, so
        that a search cut short gives the same plan on every run."""
        # GPipe runs all M forwards first, as if its warm-up were M deep: the same bounds hold
        # for it (GPipeSolver falls back on this search when its own cannot settle a case).
        self.gpipe = cm.setting.schedule == "gpipe"
        self.cm = cm
        self.suffix_tables = {} if suffix_tables is None else suffix_tables
        # The other stages' backward, at its least: with recomputation when every stage must.
        self.other_backward = cm.least_backward_prefix
        # Each stage's F and B as its own chunk (its messages in their fixed parts), and the
        # fixed parts of one forward and one backward of every stage before k and after k: the
        # least time the stages around k add to its waits, whatever their layers.
        K = cm.K
        self.formulas = [cm.formula(k) for k in range(K)]
        fixed = [cm.chunk_fixed("F", k) + cm.chunk_fixed("B", k) for k in range(K)]
        self.fixed_before = [sum(fixed[:k]) for k in range(K)]
        self.fixed_after = [sum(fixed[k + 1:]) for k in range(K)]
        self.cutoff_s = cutoff_s
        self.L, self.K, self.M = cm.L, cm.K, cm.M
        self.seeds = list(seeds)
        self.time_budget_s = time_budget_s
        self.work_budget = (time_budget_s if work_budget_s is None else work_budget_s) * WORK_PER_SECOND
        self.work_done = 0.0
        self.stopped_early = False     # the budget ended the search (else it searched every cut)
        self.simulation_work = max(1.0, 2 * cm.K * cm.M / 16)   # one unit per 16 actions played out
        self.simulations = 0
        self.nodes = 0
        self.deadline = INF      # set by solve(): when the suffix tables must give up

    # ----------------------------------------------------------------- the bound
    def stage_bound(self, s: int, e: int, k: int, recompute: bool, before: float | None = None) -> float:
        """Lower bound on the step from stage k = [s, e) alone; ``before`` = the exact time
        earlier stages and links add (known once they are chosen), else their least value."""
        cm, L, M = self.cm, self.L, self.M
        if before is None:
            before = cm.pf[s] + self.other_backward[s] + self.fixed_before[k]
        forward, backward = self.formulas[k]
        f = forward(s, e)
        b = backward(s, e, recompute)
        # (the same expressions as in _suffix_tables, so that both give the very same float)
        ob = self.other_backward
        total = cm.pf[L] + ob[L]
        down = total - cm.pf[e] - ob[e] + self.fixed_after[k] + (2 * cm.comm[e] if e < L else 0.0)
        warmup = cm.in_flight(k)      # forwards before its first backward (schedules.py's list)
        if warmup < M:
            idle = max(0.0, down - (warmup - 1) * f) + max(0.0, down - (warmup - 1) * b)
        else:
            # All forwards come first (GPipe-like on this stage): the two windows overlap, so
            # only the larger wait is certain.
            idle = max(0.0, down - (M - 1) * f, down - (M - 1) * b)
        return before + M * (f + b) + idle

    def partition_bound(self, bounds: tuple[int, ...]) -> float:
        """The bound of a whole partition, with the exact time of earlier stages."""
        cm = self.cm
        before, worst = 0.0, 0.0
        for k in range(self.K):
            s, e = bounds[k], bounds[k + 1]
            r = cm.choose_recompute(s, e, k)
            if r is None:
                return INF
            worst = max(worst, self.stage_bound(s, e, k, r, before))
            forward, backward = self.formulas[k]
            before += forward(s, e) + backward(s, e, r) + (2 * cm.comm[e] if e < self.L else 0.0)
        return worst + cm.optimizer(bounds[0], bounds[1])

    def _suffix_bounds(self) -> list[list[float]]:
        """rest[k][s]: the least, over ways to cut layers [s, L) into stages k..K-1, of their
        largest stage bound (with the least time before each stage)."""
        tables = self._suffix_tables()
        return [[v + self.fixed_before[k] for v in tables[_table_key(self.K - k, self.K)]]
                for k in range(self.K)] + [tables[0]]

    def _suffix_tables(self) -> dict[int | tuple[str, int], list[float]]:
        """tables[R][s]: rest[K - R][s] less the fixed costs of the stages before K - R, which
        every term of it carries (the first stage's table: tables[("first", K)]).

        What the last R stages of a pipeline can do depends on R, not on K (warm-up depth,
        in-flight micro-batches and waits all count the stages left, and a stage's messages
        depend on whether it is the last), except where they are the whole pipeline (its first
        stage receives nothing), so one table serves every K: pass the same ``suffix_tables``
        dict to the solvers of several K (explore).

        Without communication a stage's bound only grows as it takes more layers (each extra
        layer adds M times its work and takes at most (M-1) times it off the waits), so the
        scan over a stage's end stops at the first end whose bound passes the best so far.
        """
        cm, L, K, M = self.cm, self.L, self.K, self.M
        pf, comm = cm.pf, cm.comm
        ob = self.other_backward
        total = pf[L] + ob[L]
        # (not under the CPU-issue bound: a layer may add less to a pass than the waits lose)
        monotone = not cm.setting.comm_on and cm.issue is None
        plain_allowed = False in cm.allowed_recompute
        recompute_allowed = True in cm.allowed_recompute
        tables = self.suffix_tables
        deadline = self.deadline
        if 0 not in tables:
            tables[0] = [INF] * L + [0.0]
        for R in range(1, K + 1):
            key = _table_key(R, K)
            if key in tables:
                continue
            k = K - R                          # as stage k of this pipeline (memory: in flight)
            warmup = cm.in_flight(k)  # the same for the last R stages of any K: min(M, R)
            forward, backward = self.formulas[k]   # the stage-time formula (costmodel), as stage k
            after_k = tables[_table_key(R - 1, K)]
            here = [INF] * (L + 1)
            waits = self.fixed_after[k]
            for s in range(0, L - R + 1):
                # The work every start (a start scans up to L ends: every 64th let a table of 60,000
                # layers overrun its share 14 times), the clock every 64th (it costs more).
                if self.work_done >= self.work_budget or (s % 64 == 0 and time.perf_counter() > deadline):
                    raise _OutOfTime     # a table is stored only once complete: nothing half-done stays
                best = INF
                first, last = (L, L) if R == 1 else (s + 1, L - (R - 1))
                before = pf[s] + ob[s]
                # Which ends fit in memory without / with recomputation (a prefix of ends each).
                plain_end = cm.max_end(s, k, False) if plain_allowed else s
                fit_end = max(plain_end, cm.max_end(s, k, True) if recompute_allowed else s)
                scanned = 0
                for e in range(first, min(last, fit_end) + 1):
                    scanned += 1
                    f = forward(s, e)
                    b = backward(s, e, e > plain_end)
                    work = before + M * (f + b)
                    if work >= best:
                        break                    # even without waits it is no better, nor is a longer stage
                    after = after_k[e]
                    down = total - pf[e] - ob[e] + waits + (2 * comm[e] if e < L else 0.0)
                    if warmup < M:
                        idle = max(0.0, down - (warmup - 1) * f) + max(0.0, down - (warmup - 1) * b)
                    else:
                        idle = max(0.0, down - (M - 1) * f, down - (M - 1) * b)
                    bound = work + idle
                    if bound >= best and monotone:
                        break
                    value = bound if bound > after else after
                    if value < best:
                        best = value
                here[s] = best
                self.work_done += scanned / 48          # (a table's ends are cheaper than the search's)
            tables[key] = here
        return tables

    # ----------------------------------------------------------------- search
    def _spent(self, started: float) -> bool:
        """Whether the budget is used up: in work, or (a safety net) in wall time (then
        :attr:`stopped_early`: what it did not search may hold a plan)."""
        spent = self.work_done >= self.work_budget or time.perf_counter() - started > self.time_budget_s
        self.stopped_early |= spent
        return spent

    def solve(self) -> Solution | None:
        cm, L, K = self.cm, self.L, self.K
        started = time.perf_counter()
        self.deadline = started + self.time_budget_s
        try:
            rest = self._suffix_bounds()
        except _OutOfTime:
            self.stopped_early = True
            return self._without_bounds(started)
        least_optimizer = cm.least_first_optimizer()
        global_bound = rest[0][0] + least_optimizer
        if global_bound == INF:
            return None
        found = Incumbent(cm, self.cutoff_s)

        def consider(bounds: tuple[int, ...]) -> None:
            found.consider(bounds)
            self.simulations += 1
            self.work_done += self.simulation_work

        for seed in self.seeds:      # (every one, whatever the budget: a search is never worse than them)
            if len(seed) == K + 1 and seed[-1] == L:
                consider(tuple(seed))
        consider(self._least_bound_partition(rest))
        out_of_time = False
        open_bound = INF        # the least bound among prefixes left unexplored
        incumbent = found.threshold      # bound once: called per node

        # The optimizer tail, max_k (optimizer_k - start of stage k's first action), is counted
        # for every stage cut so far: stage 0's optimizer step, and a later stage's beyond the
        # fill before it (the forwards and sends of the stages before), where any stage has an
        # optimizer step, a gradient sync or a tied exchange at all.
        later_stages = cm.popt[L] > 0 or cm.sync_on or any(cm.tied_exchange_s(t) > 0 for t in range(len(cm.figures.tied)))

        def dfs(k: int, s: int, before: float, fill: float, worst: float, tail: float, cuts: list[int]) -> None:
            """Stage k starts at layer s; ``before``: the forwards, backwards and sends of the
            stages before it; ``fill``: their forwards and sends; ``tail``: the optimizer tail
            of those stages."""
            nonlocal out_of_time, open_bound
            self.nodes += 1
            # Every node: one node scans up to L ends, so with many layers a few nodes are seconds.
            if out_of_time or self._spent(started):
                out_of_time = True
                open_bound = min(open_bound, max(worst, rest[k][s]) + tail)
                return
            if k == K - 1:
                consider(tuple(cuts + [L]))
                return
            candidates = []
            for e in range(s + 1, L - (K - 1 - k) + 1):
                self.work_done += 1 / 16           # (a node scans up to L ends)
                r = cm.choose_recompute(s, e, k)
                if r is None:
                    break
                if k == 0:
                    stage_tail = cm.optimizer(0, e)
                elif later_stages:
                    stage_tail = max(tail, cm.optimizer(s, e) - fill)
                else:
                    stage_tail = tail
                bound = max(worst, self.stage_bound(s, e, k, r, before), rest[k + 1][e]) + stage_tail
                if bound < incumbent():
                    candidates.append((bound, e, r, stage_tail))
            candidates.sort()
            for bound, e, r, stage_tail in candidates:
                if bound >= incumbent():
                    break
                if out_of_time:
                    open_bound = min(open_bound, bound)
                    continue
                forward, backward = self.formulas[k]
                send = cm.comm[e] if e < L else 0.0
                step_before = before + forward(s, e) + backward(s, e, r) + 2 * send
                dfs(k + 1, e, step_before, fill + forward(s, e) + send,
                    max(worst, self.stage_bound(s, e, k, r, before)), stage_tail, cuts + [e])

        if global_bound < incumbent():
            dfs(0, 0, 0.0, 0.0, 0.0, 0.0, [0])
        if found.best is None:
            return None
        # What the search did not rule out (time ran out, or it could not beat the cutoff)
        # keeps a lower bound; with nothing left open, `found.best` is this setting's optimum.
        # Every partition was pruned (bound >= the found.best or the cutoff at the time), simulated
        # (>= found.best), or left open by the time budget (>= open_bound).
        lower = found.lower_bound(global_bound, open_bound)
        proven = lower >= found.best.step_s
        return Solution(found.best, proven, lower,
                        f"{cm.setting.schedule} {'closed form' if self.gpipe else 'event simulation'}; "
                        "per-stage lower bounds + branch and bound",
                        {"simulations": self.simulations, "nodes": self.nodes, "work": round(self.work_done),
                         "seconds": round(time.perf_counter() - started, 3)})

    def _without_bounds(self, started: float) -> Solution | None:
        """Out of time before the suffix tables were done (very many layers: they take O(K L^2)).

        The plan is the best of the seeds (GPipe's partition of the same M, in a search) and
        an even split by layer count; the lower bound is the one that needs no table: every
        stage runs its M forwards and M backwards one at a time, so the step takes at least the
        busiest stage's work (objective.work_floor). The gap is then wide but
        honest, and the solve ends within its budget.
        """
        cm, L, K = self.cm, self.L, self.K
        even = tuple(k * L // K for k in range(K + 1))
        found = Incumbent(cm)
        for bounds in [*self.seeds, even]:
            if len(bounds) == K + 1 and bounds[0] == 0 and bounds[-1] == L:
                found.consider(tuple(bounds))
                self.simulations += 1
        best = found.best
        if best is None:
            return None
        lower = min(best.step_s, work_floor(cm))
        return Solution(best, lower >= best.step_s, lower,
                        f"{cm.setting.schedule} {'closed form' if self.gpipe else 'event simulation'}; "
                        "out of time before the per-stage bounds: best seed, work bound",
                        {"simulations": self.simulations, "nodes": self.nodes,
                         "seconds": round(time.perf_counter() - started, 3)})

    def _least_bound_partition(self, rest: list[list[float]]) -> tuple[int, ...]:
        """A partition that attains rest[0][0] (the least position-only bound)."""
        cm, L, K = self.cm, self.L, self.K
        cuts, s = [0], 0
        for k in range(K):
            chosen, chosen_value = (L if k == K - 1 else s + 1), INF
            for e in ([L] if k == K - 1 else range(s + 1, L - (K - 1 - k) + 1)):
                r = cm.choose_recompute(s, e, k)
                if r is None:
                    break
                value = max(self.stage_bound(s, e, k, r), rest[k + 1][e])
                if value < chosen_value:
                    chosen, chosen_value = e, value
            cuts.append(chosen)
            s = chosen
        return tuple(cuts)


def _table_key(R: int, K: int) -> int | tuple[str, int]:
    """The key of the last R stages' suffix table in a pipeline of K: R, or ("first", K) for the
    whole pipeline, whose first stage's messages differ (0: nothing left)."""
    return ("first", K) if R == K and R > 0 else R
