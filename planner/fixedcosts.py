"""The runtime's fixed costs: what every action and every message costs beyond its layers.

A profile times each layer's arithmetic, less the cost of timing an empty layer (the
profiler's *harness*: mostly autograd starting a backward), because a stage pays that once
per action, not once per layer. A pipeline pays it on every action of every chunk, and more
besides: the executor choosing the next action and keeping what the backward needs, making
the received tensors leaves of the chunk's graph, posting a send (gloo copies the tensor out
in the caller's thread) and, on the receiving side, waiting on a receive that has already
landed and posting the next. None of it grows with the layers, all of it grows with the
actions: a schedule of v chunks per stage runs v times the actions of one chunk per stage,
and pays v times these costs. Left out, the planner finds interleaving v = 3 cheaper than
1F1B where it runs 1.4x slower (docs/benchmarks/fidelity.md).

``profile`` measures them with a short real pipeline (profiles/fixedcosts.py): two processes,
the runtime's own executor and backend, the model's own layers, at several chunk counts. The
planner charges, per micro-batch (:class:`FixedCosts`, read by planner/costmodel.py):

- ``forward_s``, ``backward_s``, ``backward_input_s``, ``backward_weight_s``: on every F, B, I
  and W of every chunk (chunk 0's I computes nothing, torch runs no I there: it pays only its
  messages);
- ``send_s``: on an action that sends its output (F) or its input gradient (B, I) to a chunk
  on another stage, paid by the sender;
- ``receive_s``: on an action that takes its input (F) or its output gradient (B, I) from a
  chunk on another stage, paid by the receiver.

A hand-over between two chunks on one stage (the bottom of a zb-v V) is no message: it costs
neither (the executor passes the tensors on itself), which is what makes a zb-v stage's two
chunks cheaper to link than two stages. :func:`messages` says, per chunk, which of its
actions send and receive.

The per-action cost *between* actions (the executor's loop, Python's own call costs) is
``between_actions_s``: calibrate measures the same quantity from a run's report
(``overhead.per_microbatch_s``, profiles/overhead.py), which, when present, replaces the
profile-time figure (a run of this very model at its plan's size is the better measurement;
:func:`between_actions_s` is the one rule). The two are never added.

Pure Python: the planner never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..schedules import chunks_per_stage, stage_of_chunk


@dataclass(frozen=True)
class FixedCosts:
    """Fixed costs per action kind and per message, in seconds (all zero: none charged): the
    profile's ``fixed_costs`` keys of the same names (schema.FIXED_COST_KEYS) but the cost
    between actions, which the planner charges as ``Setting.overhead_s``."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    backward_input_s: float = 0.0
    backward_weight_s: float = 0.0
    send_s: float = 0.0
    receive_s: float = 0.0

    def scaled(self, factor: float) -> "FixedCosts":
        """Every cost times ``factor`` (ranks that share cores: planner/timeshare.py)."""
        if factor == 1.0:
            return self
        return FixedCosts(**{f.name: getattr(self, f.name) * factor for f in fields(self)})

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def record(self) -> dict[str, float] | None:
        """What a plan records of them (``options.fixed_costs``; None when none were charged)."""
        return {f.name: getattr(self, f.name) for f in fields(self)} if self.any else None

    @classmethod
    def from_record(cls, record: Any) -> "FixedCosts":
        """The inverse of :meth:`record` (and the profile's ``fixed_costs``): missing or null keys are 0."""
        if not isinstance(record, dict):
            return cls()
        return cls(**{f.name: _seconds(record.get(f.name)) for f in fields(cls)})


@dataclass(frozen=True)
class ChunkMessages:
    """Which of one chunk's actions exchange a message with another stage (1) or not (0)."""

    forward_sends: int       # F hands its output to chunk c+1 on another stage
    forward_receives: int    # F takes its input from chunk c-1 on another stage
    backward_sends: int      # B or I hands its input gradient to chunk c-1 on another stage
    backward_receives: int   # B or I takes its output gradient from chunk c+1 on another stage


def messages(schedule: str, stages: int, virtual_stages: int = 1) -> tuple[ChunkMessages, ...]:
    """Per chunk, in pipeline order, which of its actions send and receive across stages.

    Chunk c's forward receives from c-1 and sends to c+1, its backward the other way round,
    each only when that neighbour runs on another stage (not for the pipeline's ends, nor for
    a zb-v stage's own pair, which it hands over itself)."""
    C = stages * chunks_per_stage(schedule, virtual_stages)
    where = [stage_of_chunk(schedule, c, stages) for c in range(C)]
    out = []
    for c in range(C):
        up = int(c < C - 1 and where[c + 1] != where[c])
        down = int(c > 0 and where[c - 1] != where[c])
        out.append(ChunkMessages(forward_sends=up, forward_receives=down, backward_sends=down, backward_receives=up))
    return tuple(out)


# The figures a profile records per micro-batch size (its ``fixed_costs`` keys, less the spread).
FIGURES = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "send_s", "receive_s",
           "between_actions_s")


def figures_at(record: Any, micro_batch_size: float | None) -> dict[str, float] | None:
    """A profile's fixed costs (its ``fixed_costs`` record) at ``micro_batch_size``: each figure
    interpolated between the sizes the probe measured (``per_micro_batch_size``, profile version
    11), piecewise-linear and extended linearly past the ends, never below zero, as the layers'
    times are (planner/profile.py, ``interpolate``); one measured size, or a record without
    sizes (before version 11), or no size asked: the record's own figures. None: no record."""
    from .profile import interpolate

    if not isinstance(record, dict):
        return None
    own = {key: _seconds(record.get(key)) for key in FIGURES}
    entries = _sizes(record)
    if micro_batch_size is None or len(entries) < 2:
        return own
    sizes = [float(e["micro_batch_size"]) for e in entries]
    return {key: interpolate(sizes, [_seconds(e.get(key)) for e in entries], float(micro_batch_size))
            for key in FIGURES}


# A probe run of a plan's schedule shape that ran this much slower than the fitted figures
# predict it is worth a warning: the plan's own prediction is then likely as optimistic.
PROBE_MISFIT_WARN = 1.05


def probe_misfit(record: Any, schedule: str, virtual_stages: int,
                 micro_batch_size: float | None) -> tuple[float, int] | None:
    """How the probe's run of ``schedule`` (``virtual_stages`` chunks per stage for interleaved)
    fared against the fitted figures: (measured / fitted step, the micro-batch size it ran at), at
    the measured size nearest ``micro_batch_size`` (the record's own with none asked or none per
    size); None where the probe ran no such shape (GPipe, v = 4, too few layers) or no record.

    The fitted figures are one set for all the probe's runs, so a shape whose run the set explains
    badly (on a CPU, interleaved v = 3 runs slower than fitted: docs/planner.md, "Fixed costs") is
    predicted about as badly in a plan of it."""
    if not isinstance(record, dict):
        return None
    entry = record
    entries = _sizes(record)
    if entries and micro_batch_size is not None:
        entry = min(entries, key=lambda e: (abs(e["micro_batch_size"] - micro_batch_size), e["micro_batch_size"]))
    size = entry.get("micro_batch_size")
    for run in entry.get("configurations") or []:
        if not isinstance(run, dict) or run.get("schedule") != schedule:
            continue
        if schedule == "interleaved" and run.get("virtual_stages") != virtual_stages:
            continue
        measured, fitted = _seconds(run.get("measured_step_s")), _seconds(run.get("predicted_step_s"))
        if measured > 0 and fitted > 0:
            return measured / fitted, int(size) if isinstance(size, (int, float)) else 0
    return None


def optimizer_scale(record: Any) -> float:
    """What an optimizer step of the layers takes in a pipeline over their ``optimizer_s``: a
    profile's ``fixed_costs.optimizer_scale`` (version 14, [Note: the optimizer timed where it
    runs], profiles/fixedcosts.py), which plans charge on every layer's; 1 where it measured none."""
    scale = record.get("optimizer_scale") if isinstance(record, dict) else None
    return float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0 else 1.0


def _sizes(record: dict) -> list[dict]:
    """A record's per-size entries (``per_micro_batch_size``) that name a size, ascending by it."""
    entries = record.get("per_micro_batch_size")
    return sorted((e for e in entries if isinstance(e, dict) and _seconds(e.get("micro_batch_size")) > 0),
                  key=lambda e: e["micro_batch_size"]) if isinstance(entries, list) else []


def _seconds(value: Any) -> float:
    """A recorded figure as a float (missing, null or not a number: 0)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def between_actions_s(calibrated_s: float | None, profiled_s: float | None, stages: int) -> float:
    """The per-action cost between actions a plan of ``stages`` is charged.

    A calibrated figure (``overhead.per_microbatch_s``, measured from a run) replaces the
    profile's (``fixed_costs.between_actions_s``); never both. Without profile-time fixed
    costs a calibrated figure is charged with several stages only, as it always was (a profile
    made before them measured nothing a one-stage run would pay)."""
    if profiled_s is None:
        return calibrated_s or 0.0 if stages > 1 else 0.0
    return calibrated_s if calibrated_s is not None else profiled_s
