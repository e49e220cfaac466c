"""The exact solver for GPipe: thresholds, a feasibility probe, and branch and bound.

GPipe's step time for a partition P of the layers into K stages (see :mod:`planner.simulator`)
splits into a part that adds up over stages and a part set by the slowest stations::

    T(P) = A(P) + (M - 1) * (Phi(P) + Gamma(P))

    A(P)     = sum_k (F_k + B_k + 2 C_k)  +  optimizer step of stage 0
    Phi(P)   = max_k max(F_k, C_k)      the slowest forward station (stage or link)
    Gamma(P) = max_k max(B_k, C_k)      the slowest backward station

Two maxima and a sum: minimising max_k (F_k + B_k), the usual min-max partition, is not the
same problem (a stage heavy in forward and another heavy in backward both count in full), so
a min-max DP on F + B is not exact. Instead:

1. Fix thresholds X for Phi and Y for Gamma. Whether some partition keeps every station under
   them is a *feasibility probe*; the cheapest A(P) among those partitions, D(X, Y), is a
   shortest path over the cut positions (a DP over stages and cuts).
2. T* = min over (X, Y) of D(X, Y) + (M - 1)(X + Y), where only values that some stage or link
   actually takes matter. Branch and bound finds it over boxes [Xa, Xb] x [Ya, Yb]: a box
   cannot beat D(Xb, Yb) + (M - 1)(Xa + Ya); solving D at the box's corner gives a real plan
   P* with stations (Phi*, Gamma*), which settles every threshold pair above (Phi*, Gamma*);
   what is left of the box is the two boxes {X < Phi*} and {X >= Phi*, Y < Gamma*}.
3. The smallest achievable Phi + Gamma (a "staircase" walk along the Pareto front of the two
   maxima, using probes only) bounds every box from below and gives the first incumbents.

When A(P) is the same for every partition (no communication, no optimizer time, one
recompute setting for all stages), D is just the probe and the search is the staircase walk.

The probe and D come in a fast form and a general one. Fast: with no communication and
memory that only grows with a stage, a stage that fits still fits when it sheds layers, so a
greedy cut (each stage as long as the thresholds allow) decides feasibility in O(K log L), and
D is a DP whose candidate predecessors form a sliding window, O(K L). General (links whose
cost depends on where you cut, or recomputation whose memory depends on the stage's input):
reachable cut positions stage by stage, and a DP over (stage, cut, previous cut).
"""

from __future__ import annotations

import bisect
import heapq
import math
import struct
import time
from collections import deque
from typing import Iterable, Sequence

from .budgets import SOLVER_TIME_BUDGET_S
from .costmodel import CostModel
from .objective import RELATIVE_SLACK, Evaluation, Solution, evaluate, work_floor

INF = math.inf
# A bisection over the bits of a float >= 0 ends within 64 halvings (and the jumps after a failed
# greedy probe only shorten it); the cap makes "every loop ends" hold whatever the numbers.
_MAX_BISECTION_STEPS = 256


class _OutOfTime(Exception):
    """The time budget ran out inside a DP or a probe (see GPipeSolver.solve)."""


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def below(x: float) -> float:
    """The largest float strictly below x (x >= 0)."""
    return math.nextafter(x, -INF)


class GPipeSolver:
    """Exact minimum of GPipe's step time over all partitions into exactly K stages.

    The searches after the staircase stop after ``time_budget_s``; the solution then says it
    is not proven and carries the lower bound that the unexplored part still allows.
    """

    def __init__(self, cm: CostModel, time_budget_s: float = SOLVER_TIME_BUDGET_S,
                 seeds: Iterable[Sequence[int]] = ()):
        """``seeds``: cuts to evaluate first (planner/seeds.py), kept when the search stops early."""
        self.cm = cm
        self.time_budget_s = time_budget_s
        self.seeds = [tuple(b) for b in seeds if len(b) == cm.K + 1]
        self.started = time.perf_counter()
        self.L, self.K, self.M = cm.L, cm.K, cm.M
        comm_on = cm.setting.comm_on
        has_limit = cm.limit is not None
        # The recompute choice, when it is the same for every stage.
        if cm.setting.recompute == "never" or not has_limit:
            self.fixed_recompute: bool | None = cm.setting.recompute == "always"
        elif cm.setting.recompute == "always":
            self.fixed_recompute = True
        else:
            self.fixed_recompute = None
        # Memory that only grows with the stage: true unless a recomputing stage's memory
        # depends on its input (the cut it starts at) under a limit.
        shrink_safe = not has_limit or self.fixed_recompute is False
        self.comm_on = comm_on
        # Each stage's F and B as its chunk (messages in the fixed parts: the first and the last
        # stage exchange fewer than the others), and which stages share them (a class).
        self.formulas = [cm.formula(k) for k in range(self.K)]
        self.fixed = [(cm.chunk_fixed("F", k), cm.chunk_fixed("B", k, False), cm.chunk_fixed("B", k, True))
                      for k in range(self.K)]
        classes: dict[tuple[float, float, float], int] = {}
        self.stage_class = [classes.setdefault(f, len(classes)) for f in self.fixed]
        self.classes = len(classes)
        # The greedy probe cuts each stage with its own class's fixed parts (see _probe_greedy).
        self.greedy_ok = shrink_safe
        # Cut positions by send time, to count those a threshold allows (see _probe_greedy).
        self.sorted_comm = sorted(cm.comm[1:cm.L])
        # The sliding-window DP and the per-first-stage search take F + B to add up to the same
        # total for every partition: not so under the CPU-issue bound (the larger of two sums).
        self.window_ok = self.fixed_recompute is not None and shrink_safe and cm.issue is None
        # no after-the-backward term at all (optimizer step, gradient sync): it only grows with a stage
        self.constant_additive = self.window_ok and not comm_on and cm.optimizer(0, cm.L) == 0.0
        self.probes = 0
        self.dp_runs = 0
        self.deadline = INF              # set by solve()
        self._seen: Evaluation | None = None
        self._floor = 0.0
        self.next_forward = self.next_backward = INF   # see _probe_greedy
        self._min_forward: dict[tuple[float, int | None], tuple[float, tuple[int, ...]] | None] = {}
        self._min_backward: dict[tuple[float, int | None], tuple[float, tuple[int, ...]] | None] = {}

    # ----------------------------------------------------------------- stations
    def stations(self, bounds: tuple[int, ...]) -> tuple[float, float]:
        """(Phi, Gamma) of a partition, with the recompute choice the solver would make."""
        cm = self.cm
        phi = gamma = 0.0
        for k in range(self.K):
            s, e = bounds[k], bounds[k + 1]
            r = self._recompute(s, e)
            c = cm.comm[e] if e < self.L else 0.0
            forward, backward = self.formulas[k]
            phi = max(phi, forward(s, e), c)
            gamma = max(gamma, backward(s, e, bool(r)), c)
        return phi, gamma

    def _reaches(self, s: int, X: float, Y: float, recompute: bool, k: int) -> tuple[int, int]:
        """The longest stage k from s whose forward is <= X, and whose backward is <= Y."""
        cm = self.cm
        forward_fixed, plain_fixed, rerun_fixed = self.fixed[k]
        return (cm.forward_reach(s, X, forward_fixed),
                cm.backward_reach(s, Y, recompute, rerun_fixed if recompute else plain_fixed))

    def _recompute(self, s: int, e: int) -> bool | None:
        # GPipe keeps M micro-batches in flight on every stage: the stage index does not matter.
        return self.cm.choose_recompute(s, e, 0)

    # ----------------------------------------------------------------- probe
    def probe(self, X: float, Y: float, first_cap: int | None = None) -> tuple[int, ...] | None:
        """Some partition whose every forward station is <= X and backward station <= Y
        (and whose first stage ends at or before ``first_cap``, greedy probe only)."""
        self.probes += 1
        if self.greedy_ok:
            return self._probe_greedy(X, Y, first_cap)
        return self._probe_reachable(X, Y, first_cap)

    def _mem_reach(self, s: int, hi: int, recompute: bool) -> int:
        """The largest e in [s, hi] whose stage [s, e) fits in memory (s if none)."""
        return min(hi, self.cm.max_end(s, 0, recompute))

    def _probe_greedy(self, X: float, Y: float, first_cap: int | None) -> tuple[int, ...] | None:
        """Cut each stage as long as the thresholds allow; feasible iff that needs <= K stages.

        A stage may end only where the send to the next stage meets both thresholds; the greedy
        stage steps back to the last such cut. Shorter stages still meet the thresholds, so a
        greedy plan with m stages becomes one with K as long as there are enough allowed cuts.

        Stage k is cut with its own fixed parts (its class: the first and last stages exchange
        fewer messages than the others). The greedy cut is still exact where it says "no" after
        K stages (every feasible partition's k-th cut is at or before the greedy's, stage by
        stage); where it could be wrong, it asks the reachability sweep: a middle stage that
        cannot take one layer (that layer may belong to the last stage, which pays less), or
        stages added to a greedy plan of fewer than K that no longer meet their own class.

        On failure it also notes, in ``self.next_forward`` / ``self.next_backward``, the least
        threshold at which the greedy cuts could change (a held-back stage could take one more
        layer, or a skipped cut becomes allowed): every threshold below it fails too.
        """
        cm, L, K = self.cm, self.L, self.K
        r = bool(self.fixed_recompute)
        cut_cap = min(X, Y)
        comm = cm.comm
        bounds = [0]
        s = 0
        next_forward = next_backward = INF
        while s < L:
            k = min(len(bounds) - 1, K - 1)
            forward, backward = self.formulas[k]
            e_forward, e_backward = self._reaches(s, X, Y, r, k)
            e = self._mem_reach(s, min(e_forward, e_backward), r)
            if s == 0 and first_cap is not None:
                e = min(e, first_cap)
            if e < L:
                if e_forward == e and e_forward < e_backward:
                    next_forward = min(next_forward, forward(s, e + 1))
                if e_backward == e and e_backward < e_forward:
                    next_backward = min(next_backward, backward(s, e + 1, r))
            if self.comm_on:
                skipped = INF
                while s < e < L and comm[e] > cut_cap:
                    skipped = min(skipped, comm[e])
                    e -= 1
                if skipped < INF:
                    if X <= Y:
                        next_forward = min(next_forward, skipped)
                    if Y <= X:
                        next_backward = min(next_backward, skipped)
            if len(bounds) > K:
                self.next_forward, self.next_backward = next_forward, next_backward
                return None
            if e <= s:
                if 0 < k < K - 1 and self.stage_class[k] != self.stage_class[K - 1]:
                    return self._probe_exactly(X, Y, first_cap)
                self.next_forward, self.next_backward = next_forward, next_backward
                return None
            bounds.append(e)
            s = e
        missing = K - (len(bounds) - 1)
        if missing:
            taken = set(bounds)
            extra = [p for p in range(1, L) if p not in taken and comm[p] <= cut_cap][:missing]
            if len(extra) < missing:
                # Too few allowed cuts: raising min(X, Y) to the next send time is the first change.
                allowed = bisect.bisect_right(self.sorted_comm, cut_cap)
                nxt = self.sorted_comm[allowed] if allowed < len(self.sorted_comm) else INF
                self.next_forward = nxt if X <= Y else INF
                self.next_backward = nxt if Y <= X else INF
                return None
            bounds = sorted(taken.union(extra))
            if self.classes > 1 and not self._within(bounds, X, Y, r, first_cap):
                return self._probe_exactly(X, Y, first_cap)
        return tuple(bounds)

    def _within(self, bounds: list[int], X: float, Y: float, r: bool, first_cap: int | None) -> bool:
        """Whether every stage of ``bounds`` meets the thresholds and memory as its own class."""
        for k in range(self.K):
            s, e = bounds[k], bounds[k + 1]
            forward, backward = self.formulas[k]
            if forward(s, e) > X or backward(s, e, r) > Y or not self.cm.fits(s, e, 0, r):
                return False
        return first_cap is None or bounds[1] <= first_cap

    def _probe_exactly(self, X: float, Y: float, first_cap: int | None) -> tuple[int, ...] | None:
        """The reachability sweep where the greedy cut cannot decide: exact, with no jump to
        offer on failure (the next threshold to try is the next float)."""
        self.next_forward = self.next_backward = 0.0
        return self._probe_reachable(X, Y, first_cap)

    def _valid_ends(self, s: int, X: float, Y: float, k: int = 0) -> list[tuple[int, int]]:
        """Intervals (lo, hi) of ends e for which stage k = [s, e) meets X, Y and memory."""
        e_forward, e_plain = self._reaches(s, X, Y, False, k)
        if e_forward <= s:
            return []
        if self.fixed_recompute is not None:
            r = self.fixed_recompute
            e = self._mem_reach(s, min(e_forward, self._reaches(s, X, Y, r, k)[1]), r)
            return [(s + 1, e)] if e > s else []
        # Per-stage choice: without recomputation while it fits, with it beyond.
        fits_plain = self._mem_reach(s, e_forward, False)
        out = []
        e0 = min(fits_plain, e_plain)
        if e0 > s:
            out.append((s + 1, e0))
        if fits_plain < e_forward:
            e1 = self._mem_reach(s, min(e_forward, self._reaches(s, X, Y, True, k)[1]), True)
            if e1 > fits_plain:
                out.append((fits_plain + 1, e1))
        return out

    def _probe_reachable(self, X: float, Y: float, first_cap: int | None = None) -> tuple[int, ...] | None:
        """Some partition within X, Y (and the first stage ending by ``first_cap``), by the cut
        positions each stage can reach from those the stages before it reached."""
        cm, L, K = self.cm, self.L, self.K
        cut_cap = min(X, Y)
        cut_ok = [e == L or cm.comm[e] <= cut_cap for e in range(L + 1)]
        current = [False] * (L + 1)
        current[0] = True
        parents: list[list[int]] = []
        # GPipe: a stage's ends depend on its start and on k only through its fixed parts (class).
        ends: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for k in range(K):
            self._check_deadline()
            intervals = []
            cls = self.stage_class[k]
            for s in range(L):
                if current[s]:
                    if (s, cls) not in ends:
                        ends[(s, cls)] = self._valid_ends(s, X, Y, k)
                    for lo, hi in ends[(s, cls)]:
                        if k == 0 and first_cap is not None:
                            hi = min(hi, first_cap)
                            if hi < lo:
                                continue
                        intervals.append((lo, hi, s))
            intervals.sort()
            nxt = [False] * (L + 1)
            parent = [-1] * (L + 1)
            heap: list[tuple[int, int]] = []
            i = 0
            first, last = k + 1, L - (K - 1 - k)
            for e in range(1, L + 1):
                while i < len(intervals) and intervals[i][0] <= e:
                    heapq.heappush(heap, (-intervals[i][1], intervals[i][2]))
                    i += 1
                while heap and -heap[0][0] < e:
                    heapq.heappop(heap)
                if heap and first <= e <= last and cut_ok[e] and (k == K - 1) == (e == L):
                    nxt[e] = True
                    parent[e] = heap[0][1]
            parents.append(parent)
            current = nxt
        if not current[L]:
            return None
        bounds = [L]
        for k in range(K - 1, -1, -1):
            bounds.append(parents[k][bounds[-1]])
        return tuple(reversed(bounds))

    # ----------------------------------------------------------------- thresholds
    def min_forward(self, Y: float, first_cap: int | None = None) -> tuple[float, tuple[int, ...]] | None:
        """The smallest Phi of a partition with Gamma <= Y, and such a partition."""
        key = (Y, first_cap)
        if key not in self._min_forward:
            self._min_forward[key] = self._minimise(
                lambda x: self.probe(x, Y, first_cap), lambda b: self.stations(b)[0],
                lambda: self.next_forward, self._forward_floor())
        return self._min_forward[key]

    def min_backward(self, X: float, first_cap: int | None = None) -> tuple[float, tuple[int, ...]] | None:
        """The smallest Gamma of a partition with Phi <= X, and such a partition."""
        key = (X, first_cap)
        if key not in self._min_backward:
            self._min_backward[key] = self._minimise(
                lambda y: self.probe(X, y, first_cap), lambda b: self.stations(b)[1],
                lambda: self.next_backward, self._backward_floor())
        return self._min_backward[key]

    def staircase(self, first_cap: int | None = None) -> tuple[float, list[tuple[int, ...]]] | None:
        """The least Phi + Gamma over partitions (first stage ending by ``first_cap``), walking
        the Pareto front of the two maxima; returns it with the front's partitions, best first."""
        y_floor_found = self.min_backward(INF, first_cap)
        if y_floor_found is None:
            return None
        y_floor = y_floor_found[0]
        least, front = INF, []
        step = self.min_forward(INF, first_cap)
        while step is not None:
            x, _ = step
            y_found = self.min_backward(x, first_cap)
            assert y_found is not None
            y, b = y_found
            if x + y < least:
                least = x + y
                front.insert(0, b)
            else:
                front.append(b)
            if y <= y_floor:
                break
            step = self.min_forward(below(y), first_cap)
            if step is None or step[0] + y_floor >= least:
                break
        return least, front

    def _forward_floor(self) -> float:
        """No Phi is below the heaviest layer's forward as the stage of least fixed part."""
        forward = min(self.formulas, key=lambda pair: pair[0](0, 0))[0]
        return max(forward(i, i + 1) for i in range(self.L))

    def _backward_floor(self) -> float:
        backward = min(self.formulas, key=lambda pair: pair[1](0, 0, False))[1]
        return max(backward(i, i + 1, False) for i in range(self.L))

    def _minimise(self, probe, value, jump, floor: float) -> tuple[float, tuple[int, ...]] | None:
        """The least threshold whose probe succeeds: bisection over the floats themselves,
        snapping down to what the found plan really reaches and, after a failed greedy probe,
        jumping up to the next threshold that changes anything."""
        found = probe(INF)
        if found is None:
            return None
        hi, best = value(found), found
        # Every threshold below lo fails. Costs are never negative (CostModel clamps them), and
        # the bisection on float bits is only ordered for floats >= 0: a floor below 0 would
        # send it to NaN and back; so it starts at 0 at worst, and is bounded besides.
        lo = max(0.0, floor)
        for _ in range(_MAX_BISECTION_STEPS):   # 64 bits: each step halves the interval
            if not lo < hi:
                break
            self._check_deadline()
            mid = _from_bits((_bits(lo) + _bits(hi)) // 2)
            found = probe(mid)
            if found is None:
                lo = max(math.nextafter(mid, INF), jump() if self.greedy_ok else 0.0)
            else:
                hi, best = value(found), found
        return hi, best

    # ----------------------------------------------------------------- additive DP
    def min_additive(self, X: float, Y: float) -> tuple[float, tuple[int, ...]] | None:
        """D(X, Y): the least A(P) over partitions within the thresholds, and such a partition."""
        if self.constant_additive:
            bounds = self.probe(X, Y)
            if bounds is None:
                return None
            return self._additive(bounds), bounds
        self.dp_runs += 1
        if self.window_ok:
            return self._additive_window(X, Y)
        return self._additive_general(X, Y)

    def _additive(self, bounds: tuple[int, ...]) -> float:
        cm = self.cm
        total = cm.optimizer(bounds[0], bounds[1])
        for k in range(self.K):
            s, e = bounds[k], bounds[k + 1]
            r = bool(self._recompute(s, e))
            forward, backward = self.formulas[k]
            total += forward(s, e) + backward(s, e, r) + 2 * (cm.comm[e] if e < self.L else 0.0)
        return total

    def _additive_window(self, X: float, Y: float) -> tuple[float, tuple[int, ...]] | None:
        """Stage costs F + B add up to a constant here; what varies is 2 C at each cut and
        stage 0's optimizer step. The stages that may end at e start in a window [lo(e), e)."""
        cm, L, K = self.cm, self.L, self.K
        r = bool(self.fixed_recompute)
        cut_cap = min(X, Y)
        fits = cm.fits
        # lo[e] per class of stage (their fixed parts differ: see __init__)
        los: dict[int, list[int]] = {}
        for k in range(K):
            if self.stage_class[k] in los:
                continue
            forward, backward = self.formulas[k]
            lo = [0] * (L + 1)
            s = 0
            for e in range(1, L + 1):
                while s < e and not (forward(s, e) <= X and backward(s, e, r) <= Y and fits(s, e, 0, r)):
                    s += 1
                lo[e] = s
            los[self.stage_class[k]] = lo
        comm2 = [2 * c for c in cm.comm]
        cost = [INF] * (L + 1)
        lo = los[self.stage_class[0]]
        for e in range(1, L - K + 2):
            if lo[e] == 0 and cm.comm[e] <= cut_cap:
                cost[e] = cm.optimizer(0, e) + comm2[e]
        parents: list[list[int]] = []
        for k in range(1, K):
            lo = los[self.stage_class[k]]
            first, last = (k + 1 if k < K - 1 else L), L - (K - 1 - k)
            new = [INF] * (L + 1)
            parent = [-1] * (L + 1)
            window: deque[int] = deque()
            pushed = k     # candidates s are pushed in increasing order
            for e in range(first, last + 1):
                while pushed < e:
                    if cost[pushed] < INF:
                        while window and cost[window[-1]] > cost[pushed]:
                            window.pop()
                        window.append(pushed)
                    pushed += 1
                while window and window[0] < lo[e]:
                    window.popleft()
                if window and (e == L or cm.comm[e] <= cut_cap):
                    new[e] = cost[window[0]] + (comm2[e] if e < L else 0.0)
                    parent[e] = window[0]
            parents.append(parent)
            cost = new
        if cost[L] == INF:
            return None
        bounds = [L]
        for parent in reversed(parents):
            bounds.append(parent[bounds[-1]])
        bounds.append(0)
        bounds = tuple(reversed(bounds))
        return self._additive(bounds), bounds

    def _additive_general(self, X: float, Y: float) -> tuple[float, tuple[int, ...]] | None:
        """D(X, Y) by relaxing, from every reachable cut s, the stages [s, e) that meet the
        thresholds (their ends form at most two intervals: see _valid_ends)."""
        cm, L, K = self.cm, self.L, self.K
        comm = cm.comm
        cut_cap = min(X, Y)
        plain_ok = False in cm.allowed_recompute
        cost = [INF] * (L + 1)
        cost[0] = 0.0
        parents: list[list[int]] = []
        ends: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for k in range(K):
            forward, backward = self.formulas[k]
            cls = self.stage_class[k]
            last = L - (K - 1 - k)
            new = [INF] * (L + 1)
            parent = [-1] * (L + 1)
            for s in range(k, last):
                if s % 64 == 0:
                    self._check_deadline()
                base = cost[s]
                if base == INF:
                    continue
                if (s, cls) not in ends:
                    ends[(s, cls)] = self._valid_ends(s, X, Y, k)
                plain_end = cm.max_end(s, 0, False) if plain_ok else s
                for lo, hi in ends[(s, cls)]:
                    # the last stage ends at L: its other ends need not be visited
                    for e in range(max(lo, k + 1, L if k == K - 1 else 0), min(hi, last) + 1):
                        send = comm[e]           # 0.0 at e = L: there is no cut there
                        if send > cut_cap:
                            continue
                        c = (base + forward(s, e) + backward(s, e, e > plain_end) + 2 * send
                             + (cm.optimizer(0, e) if k == 0 else 0.0))
                        if c < new[e] or (c == new[e] and s > parent[e]):
                            new[e], parent[e] = c, s
            parents.append(parent)
            cost = new
        if cost[L] == INF:
            return None
        bounds = [L]
        for k in range(K - 1, -1, -1):
            bounds.append(parents[k][bounds[-1]])
        bounds = tuple(reversed(bounds))
        return self._additive(bounds), bounds

    # ----------------------------------------------------------------- search
    def _out_of_time(self) -> bool:
        return time.perf_counter() - self.started > self.time_budget_s

    def solve(self, cutoff_s: float = INF) -> Solution | None:
        """The optimum, or, when it cannot beat ``cutoff_s`` (a step time already achieved by
        another setting), the best plan found on the way and a lower bound that is >= it.

        Within ``time_budget_s``: the searches after the staircase stop at it and say what they
        left open; the general DP and probes (memory limits with per-stage recomputation) check
        it too, and when it runs out inside them the solve ends with what it has
        (:meth:`_out_of_time_solution`).
        """
        if self.cm.setting.time_shared:
            # On shared cores the step is no closed form, and the thresholds' optimum need not be
            # the time-shared one: the branch and bound over cuts evaluates every plan it keeps
            # (its dedicated bounds are lower bounds here too: planner/timeshare.py), so it is exact.
            from .onefoneb import OneFOneBSolver

            return OneFOneBSolver(self.cm, seeds=self.seeds, time_budget_s=self.time_budget_s, cutoff_s=cutoff_s).solve()
        self.started = time.perf_counter()
        self.deadline = self.started + self.time_budget_s
        # (self._seen, the best plan evaluated so far, is kept from an earlier solve of the same
        # setting: still a valid plan. The floor depends on the cutoff's run, so it starts over.)
        self._floor = 0.0                          # a proven lower bound, once the staircase gave one
        try:
            return self._solve(cutoff_s)
        except _OutOfTime:
            return self._out_of_time_solution()

    def _consider_seeds(self) -> None:
        """Evaluate the seeds (each O(K)), keeping the fastest that fits in ``_seen``."""
        for bounds in self.seeds:
            ev = evaluate(self.cm, bounds)
            if ev.fits and (self._seen is None or ev.step_s < self._seen.step_s):
                self._seen = ev
        self.seeds = []                  # once per solver: a second solve keeps what they gave

    def _check_deadline(self) -> None:
        """Raise _OutOfTime once the budget is spent (called from the loops that grow with L)."""
        if time.perf_counter() > self.deadline:
            raise _OutOfTime

    def _out_of_time_solution(self) -> Solution | None:
        """The budget ran out inside a DP or probe: the best plan seen, else any plan that fits
        (a reachability probe with no thresholds, O(K L log L)), with the best bound known: the
        staircase's if it finished, and always the average stage's work (each stage runs its M
        forwards and backwards one at a time, so the busiest takes at least the average)."""
        cm, L, K = self.cm, self.L, self.K
        self.deadline = INF
        self._consider_seeds()
        best = self._seen
        if best is None:
            even = evaluate(cm, tuple(k * L // K for k in range(K + 1)))   # O(K): try it first
            bounds = even.bounds if even.fits else self._probe_reachable(INF, INF)
            if bounds is None:
                return None                               # nothing fits in memory
            best = self._seen = even if even.fits else evaluate(cm, bounds)
        lower = min(best.step_s, max(self._floor, work_floor(cm)))
        stats = {"probes": self.probes, "dp_runs": self.dp_runs,
                 "seconds": round(time.perf_counter() - self.started, 3)}
        return Solution(best, lower >= best.step_s, lower,
                        "gpipe closed form; out of time inside the DP: best plan seen, work bound", stats,
                        bound_by="dp")

    def _solve(self, cutoff_s: float) -> Solution | None:
        cm, M = self.cm, self.M
        root = self.min_additive(INF, INF)
        if root is None:
            return None                                   # nothing fits in memory
        additive_floor, bounds = root
        best = evaluate(cm, bounds)
        if self._seen is None or best.step_s < self._seen.step_s:
            self._seen = best
        # The searches reason about A(P) with stage 0's optimizer step, which is exact unless a
        # later stage's optimizer step outlasts the next step's fill (see planner.objective).
        # Where a plan they settle on pays such a wait, the plans it stood for are only known
        # to be no faster than its step without the wait: keep that as a lower bound.
        unsettled = best.step_s - best.optimizer_wait_s if best.optimizer_wait_s > 0 else INF

        def consider(b: tuple[int, ...]) -> None:
            nonlocal best, unsettled
            ev = evaluate(cm, b)
            if ev.optimizer_wait_s > 0:
                unsettled = min(unsettled, ev.step_s - ev.optimizer_wait_s)
            if ev.step_s < best.step_s:
                best = ev
                if ev.step_s < self._seen.step_s:
                    self._seen = ev

        def incumbent() -> float:
            return min(best.step_s, cutoff_s)

        # Seeds prune like any plan found (they stand for no other plans: no optimizer wait to
        # settle), and are kept if the search cannot improve on them.
        self._consider_seeds()
        if self._seen.step_s < best.step_s:
            best = self._seen

        stair = self.staircase()
        assert stair is not None
        least_sum, front = stair
        for b in front:
            consider(b)
        floor = additive_floor + (M - 1) * least_sum     # no plan of this setting is faster
        self._floor = floor
        open_bound = INF      # least bound of what was left unexplored
        if self.constant_additive or M == 1:
            # A(P) is the same for every plan, or (M = 1) it is the whole objective: done.
            method = "staircase over the two maxima" if M > 1 else "least-additive DP"
        elif floor >= incumbent() * (1 - RELATIVE_SLACK):
            method = "lower bound"
        elif self.window_ok and not self.comm_on:
            open_bound = self._first_stage_search(least_sum, front[0], consider, incumbent)
            method = "staircase per first-stage length (optimizer time of stage 0)"
        else:
            open_bound = self._box_search(additive_floor, least_sum, consider, incumbent)
            method = "branch and bound over threshold boxes, " + (
                "sliding-window DP" if self.window_ok else "general DP")
        # Every plan was either found (>= best), pruned (>= best or the cutoff at the time),
        # left open by the time budget (>= open_bound), or stood for by a plan with an
        # optimizer wait (>= unsettled).
        lower = max(floor, min(best.step_s, cutoff_s, open_bound, unsettled))
        stats = {"probes": self.probes, "dp_runs": self.dp_runs}
        if unsettled < min(best.step_s, cutoff_s, open_bound) and not self._out_of_time():
            # A later stage's optimizer step is what kept these searches from settling: finish
            # with the branch and bound over cuts, whose bounds and leaves both count it exactly.
            from .onefoneb import OneFOneBSolver

            remaining = max(0.1, self.time_budget_s - (time.perf_counter() - self.started))
            exact = OneFOneBSolver(cm, seeds=[best.bounds], time_budget_s=remaining, cutoff_s=cutoff_s).solve()
            if exact is not None:
                if exact.evaluation.step_s < best.step_s:
                    best = exact.evaluation
                lower = max(lower, min(exact.lower_bound_s, best.step_s))
                method += " + branch and bound over cuts (optimizer waits)"
        stats["seconds"] = round(time.perf_counter() - self.started, 3)
        return Solution(best, lower >= best.step_s, lower, "gpipe closed form; " + method, stats, bound_by="dp")

    def _first_stage_search(self, least_sum, best_front, consider, incumbent) -> float:
        """No communication: A(P) is a constant plus stage 0's optimizer step, which grows with
        stage 0's length e0. So T* = min over e0 of const + O(e0) + (M-1) h(e0), with h(e0) the
        least Phi + Gamma when stage 0 ends by e0. The best plan overall ends stage 0 at e*, so
        only shorter first stages can do better, and they are tried from e* down, each a
        staircase walk, until even the cheapest optimizer step cannot pay for the slower rest."""
        cm, L, K, M = self.cm, self.L, self.K, self.M
        e_star = best_front[1]
        constant = self._additive(best_front) - cm.optimizer(0, e_star)
        cheapest_optimizer = cm.least_first_optimizer()
        cap = e_star - 1
        while cap >= 1 and K > 1:
            rest = K - 1
            rest_floor = ((cm.pf[L] - cm.pf[cap] + sum(f for f, _, _ in self.fixed[1:])) / rest
                          + (cm.pg[L] - cm.pg[cap] + sum(b for _, b, _ in self.fixed[1:])) / rest)
            floor = constant + cheapest_optimizer + (M - 1) * max(least_sum, rest_floor)
            if floor >= incumbent() * (1 - RELATIVE_SLACK):
                break
            if self._out_of_time():
                return floor
            found = self.staircase(cap)
            if found is None:
                break                      # shorter first stages cannot fit either
            for b in found[1]:
                consider(b)
            cap = min(cap, found[1][0][1]) - 1
        return INF

    def _box_search(self, additive_floor, least_sum, consider, incumbent) -> float:
        M = self.M

        def bound(d: float, xa: float, ya: float) -> float:
            return d + (M - 1) * max(least_sum, xa + ya)

        boxes: list[tuple[float, int, float, float, float, float]] = []
        counter = 0
        heapq.heappush(boxes, (bound(additive_floor, 0.0, 0.0), counter, 0.0, INF, 0.0, INF))
        while boxes:
            box_bound, _, xa, xb, ya, yb = heapq.heappop(boxes)
            if box_bound >= incumbent() * (1 - RELATIVE_SLACK):
                break
            if self._out_of_time():
                return box_bound
            ym = self.min_backward(xb)
            if ym is None or ym[0] > yb:
                continue
            xm = self.min_forward(yb)
            if xm is None or xm[0] > xb:
                continue
            xa, ya = max(xa, xm[0]), max(ya, ym[0])
            corner = self.min_additive(xb, yb)
            if corner is None:
                continue
            d, b = corner
            if bound(d, xa, ya) >= incumbent() * (1 - RELATIVE_SLACK):
                continue
            consider(b)
            phi, gamma = self.stations(b)
            if phi > xa:
                counter += 1
                heapq.heappush(boxes, (bound(d, xa, ya), counter, xa, below(phi), ya, yb))
            if gamma > ya:
                counter += 1
                heapq.heappush(boxes, (bound(d, phi, ya), counter, phi, xb, ya, below(gamma)))
        return INF
