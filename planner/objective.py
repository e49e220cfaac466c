"""The objective every solver minimises: the schedule's predicted step time of a partition."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .costmodel import ChunkCost, CostModel, StageCost
from .simulator import gpipe_makespan, simulate_plan
from .timeshare import time_shared_makespan

# Bounds and step times are sums of floats, so two equal costs can differ in their last bits:
# a search prunes a branch, or prefers a plan, only when it is better by more than this share.
RELATIVE_SLACK = 1e-12


def proven_optimal(step_s: float, lower_bound_s: float) -> bool:
    """Whether a plan of ``step_s`` is proven optimal: no plan can be faster than the lower bound,
    and the bound reaches the plan's step time (up to :data:`RELATIVE_SLACK`)."""
    return lower_bound_s >= step_s * (1 - RELATIVE_SLACK)


@dataclass(frozen=True)
class Evaluation:
    bounds: tuple[int, ...]          # 0 = b0 < b1 < ... < bC = L; chunk c holds layers [b_c, b_c+1)
    chunks: tuple[ChunkCost, ...]    # in pipeline order
    stages: tuple[StageCost, ...]    # one per device
    step_s: float
    makespan_s: float
    fits: bool                       # every stage within the memory limit
    optimizer_wait_s: float = 0.0    # what later stages' optimizer steps add beyond stage 0's
    dedicated_step_s: float | None = None   # time-shared (planner/timeshare.py): the step on a core per rank
    # The asynchronous schedules (planner/asynchronous.py): the steady state's time per
    # micro-batch (step_s is M of them), the one-time fill and drain beyond, the updates a step.
    steady_state_period_s: float | None = None
    fill_drain_s: float | None = None
    updates_per_step: int = 1

    @property
    def recompute(self) -> tuple[bool, ...]:
        """Per stage (its chunks alike)."""
        return tuple(s.recompute for s in self.stages)

    @property
    def balance(self) -> list[int]:
        """Layers per chunk, in pipeline order."""
        return [c.end - c.start for c in self.chunks]

    @property
    def peak_memory_bytes(self) -> float:
        return max(s.memory_bytes for s in self.stages)

    def busy_s(self, micro_batches: int) -> list[float]:
        """Each stage's work in one step: its chunks' forwards and backwards, and its optimizer."""
        busy = [self.updates_per_step * s.optimizer_s for s in self.stages]
        for c in self.chunks:
            busy[c.stage] += micro_batches * (c.forward_s + c.backward_s)
        return busy

    def bubble_fraction(self, micro_batches: int) -> float:
        """The share of stage-time left idle: 1 - sum(busy) / (K * step); 0 for an asynchronous
        schedule, which never flushes (its stages idle only by imbalance: their idle_fraction)."""
        if self.steady_state_period_s is not None:
            return 0.0
        K = len(self.stages)
        return 1.0 - sum(self.busy_s(micro_batches)) / (K * self.step_s) if self.step_s > 0 else 0.0



@dataclass
class Solution:
    """A solver's answer for one setting: the best plan it found, and how sure it is.

    ``proven``: no partition of the setting is faster; ``lower_bound_s``: none is faster than
    this (the gap to ``evaluation.step_s`` when not proven); ``method``: how it was found, in
    words; ``bound_by``: which method gave ``lower_bound_s`` (one of schema.BOUND_METHODS)."""

    evaluation: Evaluation
    proven: bool
    lower_bound_s: float
    method: str
    stats: dict = field(default_factory=dict)
    bound_by: str = "branch and bound"



class Incumbent:
    """The best plan a search has found so far: every partition it tries goes through
    :meth:`consider`, which evaluates it and keeps it when it fits and is faster.

    ``cutoff_s``: a step time the search need not beat (a plan found elsewhere is as fast), so
    branches are pruned at it as at the best plan's step."""

    def __init__(self, cm: CostModel, cutoff_s: float = math.inf) -> None:
        self.cm = cm
        self.cutoff_s = cutoff_s
        self.best: Evaluation | None = None

    def threshold(self) -> float:
        """What a branch's bound must be under to be worth exploring: the best step found so
        far, or the cutoff when lower, less :data:`RELATIVE_SLACK` (called per search node)."""
        return min(self.best.step_s if self.best else math.inf, self.cutoff_s) * (1 - RELATIVE_SLACK)

    def lower_bound(self, global_bound: float, open_bound: float) -> float:
        """The search's lower bound once it stops (a plan found): every partition was pruned at
        the best plan or the cutoff, simulated (no faster than the best), or left open by the
        time budget (no faster than ``open_bound``); none beats ``global_bound`` either."""
        assert self.best is not None
        return max(global_bound, min(self.best.step_s, self.cutoff_s, open_bound))

    def consider(self, bounds: Sequence[int]) -> Evaluation:
        ev = evaluate(self.cm, bounds)
        if ev.fits and (self.best is None or ev.step_s < self.best.step_s):
            self.best = ev
        return ev


def evaluate(cm: CostModel, bounds: Sequence[int], recompute: Sequence[bool] | None = None) -> Evaluation:
    """Step time and memory of the chunk boundaries ``bounds`` (recompute per stage; chosen per
    stage when not given).

    When the ranks share fewer cores than they are (``Setting.time_shared``), the makespan is
    the one played out on shared cores (planner/timeshare.py), never below the dedicated one,
    which stays in ``dedicated_step_s``; the optimizer's tail is the dedicated model's."""
    if cm.asynchronous:
        from .asynchronous import evaluate_async

        return evaluate_async(cm, bounds, recompute)
    chunks, stages = cm.layout(bounds, recompute)
    fits = cm.limit is None or all(s.memory_bytes <= cm.limit for s in stages)
    if cm.schedule == "gpipe":
        makespan = gpipe_makespan([c.forward_s for c in chunks], [c.backward_s for c in chunks],
                                  [c.send_s for c in chunks[:-1]], cm.M)
        tail = gpipe_optimizer_tail(chunks, stages)
    else:
        timeline = simulate_plan(cm.schedule, cm.K, cm.M, cm.virtual_stages, [c.times() for c in chunks],
                                 [s.optimizer_s for s in stages])
        makespan, tail = timeline.makespan_s, timeline.optimizer_tail_s
    dedicated = None
    if cm.setting.time_shared:
        dedicated = makespan + tail
        shared, _ = time_shared_makespan(cm.schedule, cm.K, cm.M, cm.virtual_stages, [c.times() for c in chunks],
                                         cm.setting.concurrent_ranks)
        makespan = max(makespan, shared)      # never below (the module says why); max() keeps it so bit for bit
    return Evaluation(tuple(bounds), tuple(chunks), tuple(stages), makespan + tail, makespan, fits,
                      tail - stages[0].optimizer_s, dedicated)


def gpipe_optimizer_tail(chunks: Sequence[ChunkCost], stages: Sequence[StageCost]) -> float:
    """How long after GPipe's last backward the next step can begin (planner.simulator): stage k
    is needed again when the next step's first micro-batch reaches it, after the forwards and
    sends of the stages before it. So the wait is max_k (optimizer_k - that)."""
    tail, before = 0.0, 0.0
    for chunk, stage in zip(chunks, stages):
        tail = max(tail, stage.optimizer_s - before)
        before += chunk.forward_s + chunk.send_s
    return tail


def work_floor(cm: CostModel) -> float:
    """A lower bound on every plan's step that needs no table (what a search that ran out of time
    before its bounds keeps): each stage runs its M forwards and backwards one at a time, so the
    makespan is at least the average stage's work, and at least the heaviest layer's M forwards
    and backwards on whichever stage holds it, with the layers before it once on either side
    (CostModel.layer_floor_s); then stage 0 steps its optimizer (its least).
    Each layer's backward at its least (CostModel.least_backward_prefix). For the one-chunk
    schedules it serves (GPipe, 1F1B): stage k's fixed part per micro-batch is its forward's
    and its least backward's (``CostModel.chunk_fixed``, messages included)."""
    L, K, M = cm.L, cm.K, cm.M
    pf, backward_prefix = cm.pf, cm.least_backward_prefix
    fixed = [cm.chunk_fixed("F", k) + min(cm.chunk_fixed("B", k, r) for r in cm.allowed_recompute)
             for k in range(K)]
    average = M * (pf[L] + backward_prefix[L] + sum(fixed)) / K
    heaviest = M * (max(pf[i + 1] - pf[i] + backward_prefix[i + 1] - backward_prefix[i] for i in range(L))
                    + min(fixed))
    return max(average, heaviest, cm.layer_floor_s) + cm.least_first_optimizer()

