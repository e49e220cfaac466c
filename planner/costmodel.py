"""The cost model: what one pipeline stage costs, in time and memory.

A plan cuts the L layers into K contiguous stages. Stage k holds layers ``[s, e)`` and, with
micro-batches of size b (figures from :mod:`planner.profile`), costs per micro-batch::

    F_k = sum(forward_s[s:e])  + overhead            forward
    B_k = sum(backward_s[s:e]) + overhead            backward
    B_k = sum(recompute_backward_s[s:e]) + overhead + recompute_call   when the stage recomputes
    C_k = latency + output_bytes[e-1] / bandwidth    send to stage k+1 (0 for the last stage)

``overhead`` is the runtime's fixed cost per micro-batch and stage (profile key
``overhead.per_microbatch_s``; zero unless calibrated).

Recomputation (activation checkpointing) is not free beyond the rerun forward: the checkpointed
forward runs hooks on every tensor it would have saved, the rerun happens inside the backward,
and the wrapper itself costs a fixed ~0.1-0.5 ms per call on a CPU. A profile that timed the
layers under ``torch.utils.checkpoint`` (profile version 3) gives each layer's recomputing
backward (rerun included, plus what checkpointing added to its forward: a recomputing stage's
whole extra work is charged to its backward, the forward stays the plain one) and the wrapper's
cost ``recompute_call``, charged once per stage and micro-batch, as the runtime checkpoints a
stage as one piece. Older and imported profiles take the textbook figure: backward + forward.

Neighbours: the profile times each layer in one process alone, but the K stages of a pipeline
on one CPU host compute at the same time and share caches, memory bandwidth and, on a virtual
machine, whatever the host shares between its virtual cores. A CPU profile measures how much
slower the model computes with neighbours (``contention.slowdown``, at ``processes`` at once);
every forward, backward and optimizer time is then multiplied by :func:`neighbour_scale`: the
slowdown, weighted by how many other stages there are. Scaling the layer times by one factor per
setting keeps every solver exact.

Memory of stage k, in bytes::

    parameters + gradients + optimizer state (Adam 2x, momentum 1x, SGD 0x the parameters)
    + buffers
    + activations: n_k micro-batches in flight hold their saved activations; a stage that
      recomputes keeps only each micro-batch's *input* and, while it recomputes one
      micro-batch, that one's activations. The stage's first layer saves its own input for
      backward (a linear, norm, attention or embedding layer does), so the micro-batch being
      recomputed does not hold its input twice:
      (n_k - 1) * input_bytes + max(activation_bytes, input_bytes)
    + the largest transient peak of its layers (CUDA profiles)

n_k is how many micro-batches the schedule keeps in flight on stage k: GPipe runs every
forward before any backward, so n_k = M; 1F1B starts backwards early, so n_k = min(M, K - k).

Time of a whole step is a property of the schedule, not of one stage: see
:mod:`planner.schedule` (GPipe closed form and the event simulator).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from .profile import LayerFigures

OPTIMIZER_STATE_MULTIPLIER = {"adam": 2, "momentum": 1, "sgd": 0}
SCHEDULES = ("gpipe", "1f1b")
RECOMPUTE_MODES = ("never", "always", "auto")


@dataclass(frozen=True)
class Setting:
    """Everything about a plan except where the stage boundaries go."""

    stages: int
    micro_batches: int
    schedule: str = "gpipe"
    recompute: str = "never"
    memory_limit_bytes: float | None = None
    link_bandwidth_bytes_per_s: float = math.inf   # inf: communication is free
    link_latency_s: float = 0.0
    optimizer: str = "adam"
    overhead_s: float = 0.0
    compute_scale: float = 1.0    # neighbour_scale(...): every layer time is multiplied by it

    @property
    def comm_on(self) -> bool:
        return math.isfinite(self.link_bandwidth_bytes_per_s)


def neighbour_scale(slowdown: float, processes: int, stages: int) -> float:
    """The factor on every layer time of a K-stage plan, from a profile's measured slowdown.

    ``slowdown`` was measured with ``processes`` copies computing at once. With K stages a
    stage has K - 1 neighbours; we take the interference as growing in proportion to them
    (capped at what was measured). It does not depend on how much the stages overlap in time:
    on the development VM two stages that take turns (M = 1) ran each operation about as much
    slower than one stage as two that overlap (M >= 2), in two accuracy runs (docs/planner.md,
    "Neighbours"): the penalty comes with the neighbour process, not only with its computing at
    the same moment. One stage computes as profiled.
    """
    if stages <= 1 or slowdown <= 1.0:
        return 1.0
    neighbours = min(stages - 1, processes - 1) / max(1, processes - 1)
    return 1.0 + (slowdown - 1.0) * neighbours


@dataclass(frozen=True)
class StageCost:
    """Predicted figures of one stage; times are per micro-batch."""

    start: int
    end: int
    index: int
    recompute: bool
    forward_s: float
    backward_s: float        # includes the recomputed forward when `recompute`
    recompute_s: float       # the part of backward_s that is recomputation
    send_s: float
    optimizer_s: float
    in_flight: int
    params_bytes: float
    gradients_bytes: float
    optimizer_state_bytes: float
    buffers_bytes: float
    activations_bytes: float
    transient_bytes: float

    @property
    def memory_bytes(self) -> float:
        return (self.params_bytes + self.gradients_bytes + self.optimizer_state_bytes
                + self.buffers_bytes + self.activations_bytes + self.transient_bytes)


class CostModel:
    """Per-stage costs for one :class:`Setting`, from prefix sums: any stage costs O(1)."""

    def __init__(self, figures: LayerFigures, setting: Setting):
        if setting.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {setting.schedule!r}")
        if setting.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"unknown recompute mode {setting.recompute!r}")
        if setting.compute_scale != 1.0:
            figures = figures.times_scaled(setting.compute_scale)
        self.figures = figures
        self.setting = setting
        self.L = figures.num_layers
        self.K = setting.stages
        self.M = setting.micro_batches
        # Costs are clamped to >= 0 (NaN to 0) here, where every solver reads them: the solvers'
        # loops step through thresholds that only grow with a stage, and a negative cost would
        # let them walk forever (a negative calibrated overhead once did). See _cost.
        self.overhead = _cost(setting.overhead_s)
        self.limit = setting.memory_limit_bytes
        state_mult = OPTIMIZER_STATE_MULTIPLIER[setting.optimizer]
        # Prefix sums: the sum over layers [s, e) is pre[e] - pre[s].
        self.pf = _prefix(figures.forward_s)
        self.pg = _prefix(figures.backward_s)
        # Backward of a recomputing stage re-runs its forward: one prefix for both, so that the
        # solvers and the evaluation compute the very same float for it.
        self.pgr = _prefix(figures.recomputing_backward_s())
        # ... plus the checkpoint wrapper's own cost, once per stage and micro-batch.
        self.overhead_recompute = self.overhead + _cost(figures.recompute_call_s)
        self.pa = _prefix(figures.activation_bytes)
        self.pp = _prefix(figures.param_bytes)
        self.pbuf = _prefix(figures.buffer_bytes)
        self.popt = _prefix(figures.optimizer_s)
        self.static_per_param = 2 + state_mult     # parameters + gradients + optimizer state
        self.state_mult = state_mult
        self.has_transient = any(figures.transient_bytes)
        # The sparse table takes O(L log L) to build: only when some layer has a transient peak.
        self.transient = _RangeMax(figures.transient_bytes if self.has_transient else [])
        # comm[e]: time to send what crosses the cut before layer e (e = 1..L-1); no cut at L.
        self.comm = [0.0] * (self.L + 1)
        if setting.comm_on:
            for e in range(1, self.L):
                self.comm[e] = _cost(setting.link_latency_s + figures.output_bytes[e - 1]
                                     / setting.link_bandwidth_bytes_per_s)
        # in_bytes[s]: one micro-batch of what stage starting at s receives (kept when recomputing).
        self.in_bytes = [figures.input_bytes] + list(figures.output_bytes[:-1])
        self._max_end: dict[tuple[int, int, bool], int] = {}
        self.allowed_recompute: tuple[bool, ...] = {
            "never": (False,), "always": (True,), "auto": (False, True)}[setting.recompute]

    # ------------------------------------------------------------------ pieces
    def in_flight(self, k: int) -> int:
        if self.setting.schedule == "gpipe":
            return self.M
        return min(self.M, self.K - k)

    def forward(self, s: int, e: int) -> float:
        return self.pf[e] - self.pf[s] + self.overhead

    def backward(self, s: int, e: int, recompute: bool) -> float:
        if recompute:
            return self.pgr[e] - self.pgr[s] + self.overhead_recompute
        return self.pg[e] - self.pg[s] + self.overhead

    def backward_overhead(self, recompute: bool) -> float:
        """The fixed part of a stage's backward: the runtime's, and checkpointing's when recomputing."""
        return self.overhead_recompute if recompute else self.overhead

    def optimizer(self, s: int, e: int) -> float:
        """The step after the backward: the optimizer on layers [s, e), and tied-gradient exchanges."""
        return self.popt[e] - self.popt[s] + self.tied_exchange(s, e)

    def least_first_optimizer(self) -> float:
        """A lower bound on stage 0's optimizer step over every partition: the least over its
        possible ends (the optimizer time alone grows with the stage; a tie's exchange need not)."""
        if not self.figures.tied:
            return self.optimizer(0, 1)
        return min(self.optimizer(0, e) for e in range(1, self.L - self.K + 2))

    def tied_exchange(self, s: int, e: int) -> float:
        """Summing tied copies' gradients: a stage holding some, not all, of a tie's layers sends
        and receives the parameter's gradient once a step (runtime.tied). Free without a link."""
        total = 0.0
        for t, (layers, _) in enumerate(self.figures.tied):
            inside = sum(1 for i in layers if s <= i < e)
            if 0 < inside < len(layers):
                total += self.tied_exchange_s(t)
        return total

    def tied_exchange_s(self, tie: int) -> float:
        """One exchange of tie ``tie``'s gradient over the link (0 when communication is free)."""
        if not self.setting.comm_on:
            return 0.0
        return self.setting.link_latency_s + self.figures.tied[tie][1] / self.setting.link_bandwidth_bytes_per_s

    def static_memory(self, s: int, e: int) -> float:
        return (self.pp[e] - self.pp[s]) * self.static_per_param + (self.pbuf[e] - self.pbuf[s])

    def memory(self, s: int, e: int, k: int, recompute: bool) -> float:
        act = self.pa[e] - self.pa[s]
        n = self.in_flight(k)
        activations = self._recompute_activations(s, n, act) if recompute else n * act
        mem = self.static_memory(s, e) + activations
        if self.has_transient:
            mem += self.transient.query(s, e)
        return mem

    def _recompute_activations(self, s: int, in_flight: int, act: float) -> float:
        inp = self.in_bytes[s]
        return (in_flight - 1) * inp + (act if act > inp else inp)

    def fits(self, s: int, e: int, k: int, recompute: bool) -> bool:
        return self.limit is None or e <= self.max_end(s, k, recompute)

    def max_end(self, s: int, k: int, recompute: bool) -> int:
        """The longest stage starting at s that fits: the largest e with memory(s, e) <= limit
        (s when not even one layer fits). For a fixed start, memory only grows with the end,
        so this one number answers every "does [s, e) fit?" question; it is cached."""
        if self.limit is None:
            return self.L
        key = (s, self.in_flight(k), recompute)
        found = self._max_end.get(key)
        if found is None:
            lo, hi = s, self.L          # lo fits (or is s); find the last e that fits
            if self.memory(s, hi, k, recompute) <= self.limit:
                lo = hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self.memory(s, mid, k, recompute) <= self.limit:
                    lo = mid
                else:
                    hi = mid
            found = self._max_end[key] = lo
        return found

    def choose_recompute(self, s: int, e: int, k: int) -> bool | None:
        """The recompute choice for a stage, or None when no allowed choice fits in memory.

        Recomputation only ever adds time (it re-runs the forward), so it is chosen only when
        the stage would not fit without it: that is the time-optimal per-stage rule, and the
        brute-force tests check it against trying both.
        """
        for r in self.allowed_recompute:
            if self.fits(s, e, k, r):
                return r
        return None

    def stage(self, s: int, e: int, k: int, recompute: bool | None = None) -> StageCost:
        if recompute is None:
            chosen = self.choose_recompute(s, e, k)
            recompute = bool(chosen) if chosen is not None else self.allowed_recompute[-1]
        params = self.pp[e] - self.pp[s]
        act = self.pa[e] - self.pa[s]
        n = self.in_flight(k)
        return StageCost(
            start=s, end=e, index=k, recompute=recompute,
            forward_s=self.forward(s, e),
            backward_s=self.backward(s, e, recompute),
            recompute_s=self.backward(s, e, True) - self.backward(s, e, False) if recompute else 0.0,
            send_s=self.comm[e] if e < self.L else 0.0,
            optimizer_s=self.optimizer(s, e),
            in_flight=n,
            params_bytes=params,
            gradients_bytes=params,
            optimizer_state_bytes=params * self.state_mult,
            buffers_bytes=self.pbuf[e] - self.pbuf[s],
            activations_bytes=self._recompute_activations(s, n, act) if recompute else n * act,
            transient_bytes=self.transient.query(s, e) if self.has_transient else 0.0,
        )

    def stages(self, bounds: Sequence[int], recompute: Sequence[bool] | None = None) -> list[StageCost]:
        """The stages of a partition given by its boundaries ``0 = b0 < b1 < ... < bK = L``."""
        return [
            self.stage(bounds[k], bounds[k + 1], k, None if recompute is None else recompute[k])
            for k in range(len(bounds) - 1)
        ]


class _RangeMax:
    """Maximum over any range of a fixed list in O(1) (a sparse table)."""

    def __init__(self, values: Sequence[float]):
        self.table = [list(values)]
        n, width = len(values), 1
        while 2 * width <= n:
            prev = self.table[-1]
            self.table.append([max(prev[i], prev[i + width]) for i in range(n - 2 * width + 1)])
            width *= 2

    def query(self, s: int, e: int) -> float:
        """max(values[s:e]) for s < e."""
        level = (e - s).bit_length() - 1
        row = self.table[level]
        return max(row[s], row[e - (1 << level)])


def _cost(value: float) -> float:
    """A time or a size as the solvers may use it: never negative, NaN read as 0.

    ``max(0.0, nan)`` is 0.0 (the comparison is false, so the first argument wins).
    """
    return max(0.0, float(value))


def _prefix(values: Sequence[float]) -> list[float]:
    """Prefix sums of clamped costs (see :func:`_cost`): non-decreasing, as bisection needs.

    Clamping each value costs as much as the sum itself, so it is done only when needed: a
    sum that is not NaN (no NaN inside) and a least value >= 0 mean there is nothing to clamp.
    """
    floats = list(map(float, values))
    total = sum(floats)
    if not (total == total and min(floats, default=0.0) >= 0.0):
        floats = [_cost(v) for v in floats]
    return [0.0, *accumulate(floats)]


def reach(prefix: list[float], start: int, budget: float, extra: float = 0.0) -> int:
    """The largest e >= start with ``prefix[e] - prefix[start] + extra <= budget`` (start if none).

    Bisection finds it on the rearranged inequality; the two loops then settle it on the very
    expression the rest of the planner evaluates, so that rounding can never make a stage
    pass here and exceed the budget there.
    """
    base = prefix[start]
    e = max(start, bisect.bisect_right(prefix, base + budget - extra) - 1)
    while e > start and prefix[e] - base + extra > budget:
        e -= 1
    last = len(prefix) - 1
    while e < last and prefix[e + 1] - base + extra <= budget:
        e += 1
    return e
