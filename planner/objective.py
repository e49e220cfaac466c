"""The objective every solver minimises: the schedule's predicted step time of a partition."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .costmodel import CostModel, StageCost
from .schedule import gpipe_makespan, simulate


@dataclass(frozen=True)
class Evaluation:
    bounds: tuple[int, ...]          # 0 = b0 < b1 < ... < bK = L; stage k holds layers [b_k, b_k+1)
    stages: tuple[StageCost, ...]
    step_s: float
    makespan_s: float
    fits: bool                       # every stage within the memory limit
    optimizer_wait_s: float = 0.0    # what later stages' optimizer steps add beyond stage 0's

    @property
    def recompute(self) -> tuple[bool, ...]:
        return tuple(s.recompute for s in self.stages)

    @property
    def peak_memory_bytes(self) -> float:
        return max(s.memory_bytes for s in self.stages)

    @property
    def forward_station_s(self) -> float:
        """The slowest forward station (stage or link) of the flow line: GPipe's forward rate."""
        return max(max(s.forward_s, s.send_s) for s in self.stages)

    @property
    def backward_station_s(self) -> float:
        return max(max(s.backward_s, s.send_s) for s in self.stages)

    def busy_s(self, micro_batches: int) -> list[float]:
        return [micro_batches * (s.forward_s + s.backward_s) + s.optimizer_s for s in self.stages]

    def bubble_fraction(self, micro_batches: int) -> float:
        K = len(self.stages)
        return 1.0 - sum(self.busy_s(micro_batches)) / (K * self.step_s) if self.step_s > 0 else 0.0


def evaluate(cm: CostModel, bounds: Sequence[int], recompute: Sequence[bool] | None = None) -> Evaluation:
    """Step time and memory of the partition ``bounds`` (recompute chosen per stage if not given)."""
    stages = cm.stages(bounds, recompute)
    makespan = makespan_of(cm.setting.schedule, stages, cm.M)
    fits = cm.limit is None or all(s.memory_bytes <= cm.limit for s in stages)
    optimizer = optimizer_tail(stages)
    return Evaluation(tuple(bounds), tuple(stages), makespan + optimizer, makespan, fits,
                      optimizer - stages[0].optimizer_s)


def optimizer_tail(stages: Sequence[StageCost]) -> float:
    """How long after the last backward the next step can begin: every stage steps its
    optimizer once the step's backwards are done (the runtime agrees on the loss first), and
    stage k is needed again only when the next step's first micro-batch reaches it, after the
    forwards and sends of the stages before it. So the wait is max_k (optimizer_k - that)."""
    tail, before = 0.0, 0.0
    for st in stages:
        tail = max(tail, st.optimizer_s - before)
        before += st.forward_s + st.send_s
    return tail


def makespan_of(schedule: str, stages: Sequence[StageCost], M: int) -> float:
    if schedule == "gpipe":
        return gpipe_makespan([s.forward_s for s in stages], [s.backward_s for s in stages],
                              [s.send_s for s in stages[:-1]], M)
    return simulate(schedule, stages, M).makespan_s
