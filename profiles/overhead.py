"""The runtime's cost per action, measured from a run: what ``calibrate`` writes to
``overhead.per_microbatch_s``.

A stage runs a list of actions per step (gpipe_plan/schedules.py: each forward, backward, or
input- and weight-gradient half, of each chunk and micro-batch). The report times each action
as a span (its computation, the loss, posting its sends) and each wait for a neighbour's
tensors as another; what the stage spends between them (the executor choosing the next
action, bookkeeping of receives and sends, Python's own cost per call) is in neither. The
planner charges that as a fixed cost on every action (planner/costmodel.py, ``overhead``:
once on F and on B, once each on I and W), so a schedule of many small actions (interleaved
with v = 3) pays for its many actions, as it does when it runs.

Per stage, the time of a step not spent in its actions, its waits or its gradient sync (which
the planner charges apart) is that cost summed over the stage's actions::

    per action = (step - busy - wait - gradient sync - other) / actions per step

with ``busy`` the stage's action spans and its optimizer step, ``other`` the step's other
spans where the report gives them (``measured_other_s``: drawing the batch, the end-of-step
loss exchange), and the action count from the schedule. The figure is the median over stages
(one stage's odd step does not decide it), never below zero. It is a direct measurement, not a
ratio against a prediction: a second round replaces the first's figure.

Pure JSON in, numbers out: no torch here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from ..artifacts import json_number
from ..schedules import SCHEDULES, SPLIT_BACKWARD, chunks_per_stage, problem, stage_actions


@dataclass(frozen=True)
class StageGap:
    """One stage's time per step outside its actions, waits and gradient sync, and its actions."""

    stage: int
    outside_s: float      # per step (may be below 0 by measurement noise; clamped in the median)
    actions: int          # actions per step, from the schedule

    @property
    def per_action_s(self) -> float:
        return max(0.0, self.outside_s / self.actions)


@dataclass(frozen=True)
class OverheadMeasurement:
    """``per_microbatch_s``: the runtime's cost per action (None: the report cannot tell, see ``reason``)."""

    per_microbatch_s: float | None
    stages: tuple[StageGap, ...] = ()
    reason: str = ""

    def record(self, previous_s: float | None) -> dict[str, Any]:
        """What a calibration round records of it (the profile's ``calibration[i].overhead``)."""
        if self.per_microbatch_s is None:
            return {"measured": False, "reason": self.reason, "per_microbatch_s": previous_s}
        return {"measured": True, "per_microbatch_s": self.per_microbatch_s, "previous_per_microbatch_s": previous_s,
                "stages": [{"stage": g.stage, "outside_actions_s": g.outside_s, "actions": g.actions,
                            "per_action_s": g.per_action_s} for g in self.stages]}


def measure_overhead(report: dict[str, Any], shared_cores: tuple[float, float] = (1.0, 0.0)) -> OverheadMeasurement:
    """The runtime's cost per action in the run ``report`` describes (a validated report).

    ``shared_cores``: what the run's plan charged every action for its ranks sharing cores
    (slowdown, added seconds). A plan charges the cost between actions times that slowdown, plus
    the added cost (planner/costmodel.py), so a run on shared cores measures it so: the figure is
    taken back to a core of its own, ``(per action - added) / slowdown``, as a profile records it.

    Not measured, with the reason, when the report lacks what it takes: the step time, the
    schedule's shape (schedule, stages, micro-batches), or a stage's busy or waiting time.
    """
    step_s = json_number(report.get("measured_step_s"))
    schedule, stages, micro_batches = report.get("schedule"), report.get("num_stages"), report.get("micro_batches")
    if step_s is None:
        return OverheadMeasurement(None, reason="the report has no measured step time")
    if not (isinstance(stages, int) and isinstance(micro_batches, int) and isinstance(schedule, str)):
        return OverheadMeasurement(None, reason="the report does not say its schedule, stages and micro-batches")
    v = report.get("virtual_stages") if isinstance(report.get("virtual_stages"), int) else chunks_per_stage(schedule)
    why_not = problem(schedule, stages, micro_batches, v)
    if why_not:
        return OverheadMeasurement(None, reason=f"its schedule cannot be replayed ({why_not})")
    gaps = []
    for stage in report["stages"]:
        k = stage["index"]
        busy, wait = json_number(stage.get("measured_busy_s")), json_number(stage.get("measured_wait_s"))
        if busy is None or wait is None or k >= stages:
            return OverheadMeasurement(None, reason=f"the report does not give stage {k}'s busy and waiting time "
                                                    "per step (measured_busy_s, measured_wait_s)")
        apart = (json_number(stage.get("measured_gradient_sync_s")) or 0.0) + (json_number(stage.get("measured_other_s")) or 0.0)
        actions = len(stage_actions(schedule, k, stages, micro_batches, v))
        gaps.append(StageGap(k, step_s - busy - wait - apart, actions))
    if not gaps:
        return OverheadMeasurement(None, reason="the report has no stages")
    slowdown, added = shared_cores
    per_action = statistics.median(g.per_action_s for g in gaps)
    return OverheadMeasurement(max(0.0, (per_action - added) / max(1.0, slowdown)), tuple(gaps))


def overheads_in_prediction(schedule: str | None, kind: str) -> int:
    """How many per-action overheads a plan's per-micro-batch ``kind`` time of a chunk includes:
    one in a forward, one in a whole backward B, two in a split one (I + W)."""
    if kind == "backward" and schedule in SPLIT_BACKWARD:
        return 2
    return 1


@dataclass(frozen=True)
class FixedInTimes:
    """What of a chunk's predicted and measured per-micro-batch times is fixed cost, not layers.

    A plan's chunk time includes every fixed cost its actions pay (planner/fixedcosts.py): the
    cost between actions, its kind's own and its messages'. A run's span of that action times
    its kind's own and its sends (the executor posts them inside the action) but neither the
    time between actions nor its receives (those are in the waits). Calibration scales the
    layers by what is left of both (profiles/calibrate.py), so a fixed cost is never rescaled
    as if it were a layer's time.
    """

    schedule: str | None
    between_s: float                 # charged once per action
    fixed: Any                       # planner.fixedcosts.FixedCosts
    messages: tuple[Any, ...]        # planner.fixedcosts.ChunkMessages per chunk
    # Where the plan's ranks shared cores (planner/costmodel.py): every action's time charged
    # this many times over, and this much added to each (with the cost between actions).
    shared_core_slowdown: float = 1.0
    shared_core_action_s: float = 0.0

    def of(self, chunk: int, kind: str) -> tuple[float, float]:
        """(in the prediction, in the measured span) of chunk ``chunk``'s ``forward`` or ``backward``
        (a split backward's: I and W together, as the report gives it)."""
        f, split = self.fixed, self.schedule in SPLIT_BACKWARD
        m = self.messages[chunk] if chunk < len(self.messages) else None
        if kind == "forward":
            sends, receives = (m.forward_sends, m.forward_receives) if m else (0, 0)
            own = f.forward_s
        else:
            sends, receives = (m.backward_sends, m.backward_receives) if m else (0, 0)
            own = (f.backward_weight_s + (f.backward_input_s if chunk > 0 else 0.0)) if split else f.backward_s
        actions = overheads_in_prediction(self.schedule, kind)
        # On shared cores the run's spans are as much slower as the plan's layers: the factor is
        # on both sides, the added cost (between actions, as the overhead) on the prediction's.
        in_span = (own + sends * f.send_s) * self.shared_core_slowdown
        in_prediction = ((self.between_s * actions + own + sends * f.send_s + receives * f.receive_s)
                         * self.shared_core_slowdown + self.shared_core_action_s * actions)
        return in_prediction, in_span


def profiled_at_run_size(profile: dict[str, Any], report: dict[str, Any]) -> dict[str, float] | None:
    """The profile's fixed costs at the run's micro-batch size, as its plan charged them (profile
    version 11: per size; planner/fixedcosts.py, ``figures_at``); None: the profile has none."""
    from ..planner.fixedcosts import figures_at

    size = report.get("micro_batch_size")
    return figures_at(profile.get("fixed_costs"), size if isinstance(size, (int, float)) else None)


def fixed_in_times(profile: dict[str, Any], report: dict[str, Any],
                   shared_cores: tuple[float, float] = (1.0, 0.0)) -> FixedInTimes:
    """The fixed costs the run's plan charged, as the planner charges them from ``profile`` (the
    profile the plan was made from, before this round) for the report's schedule and stages;
    ``shared_cores``: what the plan charged every action for its ranks sharing cores (slowdown,
    added seconds: profiles/calibrate.py, ``plan_sharing``)."""
    from ..planner.fixedcosts import FixedCosts, between_actions_s, messages

    schedule, stages = report.get("schedule"), report.get("num_stages") or len(report["stages"])
    v = report.get("virtual_stages") if isinstance(report.get("virtual_stages"), int) else chunks_per_stage(schedule)
    recorded = profiled_at_run_size(profile, report)
    calibrated = (profile.get("overhead") or {}).get("per_microbatch_s")
    between = between_actions_s(calibrated, recorded["between_actions_s"] if recorded else None, stages)
    shape_ok = schedule in SCHEDULES and isinstance(stages, int) and stages >= 1 and isinstance(v, int) and v >= 1
    chunk_messages = messages(schedule, stages, v) if recorded and shape_ok else ()
    return FixedInTimes(schedule, between, FixedCosts.from_record(recorded), chunk_messages, *shared_cores)
