"""What a profile, a plan and a report may hold: one declarative schema per artifact, and one check.

Every key a command reads is declared here, once, with its type, whether it must be there,
whether it may be ``null``, and the range a sane value lies in. :func:`validate` walks a
document against its schema before any command acts on it, and refuses the first problem
in one line that names the file, the key's path (``layers[3].forward_s[1]``) and what is
wrong, as a :class:`~gpipe_plan.artifacts.BadInput` (the CLI prints it and exits with 2).
The format documents (docs/profile-format.md, plan-format.md, report-format.md) say what the
keys mean; this module is the one place that says what values they accept.

Why ranges and not only types: JSON numbers are unbounded. ``1e400`` parses as infinity, a
400-digit integer parses as an ``int`` that ``float()`` cannot hold, and ``1e308`` bytes is
finite but overflows to infinity as soon as two layers are added. Each number therefore
has a ceiling far above any real machine (:data:`MAX_BYTES`, :data:`MAX_SECONDS`,
:data:`MAX_COUNT`) and far below where the planner's sums stop being finite.

Keys not declared are let through untouched: a newer writer may add keys, and readers
``.get`` only what is declared. Pure Python, no torch: ``gpipe-plan solve`` imports this.

The formats' names and versions live here too (:data:`FORMAT_VERSIONS`, :data:`READABLE_VERSIONS`,
with what each version added), and so do the two doors every artifact goes through:
:func:`read_artifact` (the right format, at a version this code reads; :func:`read_profile` and :func:`read_report`
check the keys too, and a plan's door is ``gpipe_plan.plan_view``) and :func:`write_artifact`
(a document this code built is checked against its schema before it is written, so a writer
that drifts from the format fails at once instead of writing a file no reader accepts).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .artifacts import BadInput, Outputs, dumps, precision_of, read_json
from .plan_layout import GRADIENT_SYNCS, PLACEMENT_ORDERS

# Ceilings: far above any real value, far below where sums of them overflow a float.
MAX_BYTES = 2.0 ** 60        # 1 EiB: bytes of one tensor, layer or device
MAX_SECONDS = 1e7            # about 4 months: one measured time
MAX_COUNT = 2 ** 40          # a micro-batch size, a dimension, a step count


def check_global_batch_size(value: int) -> None:
    """``--global-batch-size`` (profile, solve, explore) within what a profile and plan record."""
    if not 1 <= value <= MAX_COUNT:
        raise BadInput(f"--global-batch-size must be a whole number of samples from 1 to 2^40, got {value}")
MAX_RATE = 1e18              # bytes per second of a link
MAX_RATIO = 1e6              # a ratio or a fraction: any finite value of modest size
MAX_LOSS = 1e300             # a loss: whatever the user's loss function returns, if finite

_CEILING_NAMES = {MAX_BYTES: "2^60", float(MAX_COUNT): "2^40"}   # as messages print them

# The dtypes the runtime can send between stages (runtime/stage.py, ``_DTYPES``).
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


# --------------------------------------------------------------------------- formats and versions
PROFILE_FORMAT = "gpipe-plan.profile"
PLAN_FORMAT = "gpipe-plan.plan"
REPORT_FORMAT = "gpipe-plan.report"

# The version each format is written with, and the versions this code reads. Each version only
# adds keys or refines a measurement, so older files still read: what one lacks is read as a
# default (a profile: "What an older profile lacks" below; a plan: gpipe_plan/plan_layout.py).
#
# Profile
#   2  ``contention`` (a version 1 profile plans as if neighbours cost nothing).
#   3  the recompute timings.
#   4  ``contention.slowdown`` from the slowest process (and ``slowest_step_s``).
#   5  the precision (``precision``, ``param_dtype``; before it, fp32); on CUDA, the memory the
#      CUDA context takes.
#   6  each kind of layer measured once (``measured_as``); ``contention`` times one layer;
#      ``consistency`` may be left out (a model too large to step whole); ``global_batch_size``;
#      layers' ``output_batched``; ``tied_parameters``; an imported model's ``loss``, ``cut_at``
#      and ``data`` in its spec.
#   7  each layer's backward split in two (``backward_input_s``, ``backward_weight_s``) and what
#      stays alive between the halves (``weight_kept_bytes``).
#   8  the all-reduce in ``link`` (``allreduce_bandwidth_bytes_per_s``, ...): what a data-parallel
#      gradient sync costs; each layer's ``module``.
#   9  ``fixed_costs``: the runtime's fixed cost per action kind and per message, and between
#      actions, measured with a short real pipeline (profiles/fixedcosts.py); on CUDA each
#      layer's CPU issue time (``issue_forward_s``, ``issue_backward_s``) beside its GPU time,
#      which is then measured behind a backlog (profiles/issue.py).
#      A CPU profile's ``device.memory_bytes``: the host's memory (or its container's limit), which
#      a plan's ranks on that host share; plans fit it unless ``--memory-limit`` says otherwise;
#      and its ``device.cores``: the CPUs the ranks share (more ranks than cores time-share them).
#      ``host_load``: per phase of the measurement, the cores other processes used and took from
#      it; a plan from a profile measured on a busy host says so.
#  10  ``fixed_costs.shared_cores``: on a CPU host that runs at most 4 ranks at once, the probe
#      pipeline again on twice as many processes as it runs at once, and how much slower every
#      action runs when ranks share cores (``slowdown``, ``per_action_s``), which a plan of more
#      ranks than cores charges (planner/timeshare.py).
#  11  ``fixed_costs.per_micro_batch_size``: the probe pipeline at every profiled micro-batch
#      size, each size's figures; a plan is charged those at its own size (planner/fixedcosts.py,
#      ``figures_at``). The record's own figures stay those of the middle size.
#  12  the probe cuts each run's window so that its busiest stage has the least work (profiles/
#      fixedcosts.py, ``balanced_bounds``), as a plan is cut; each run's ``configurations`` entry
#      records its cut (``bounds``). Before it, chunks of equal layer counts; read as they are.
#      ``contention.spread`` and ``readings``: a reading whose cycles spread is taken again, the
#      steadiest kept (profiles/contention.py); absent: one reading, its spread not recorded.
#  13  ``measurement.host_speed``: the host's own speed by the speed probe (``fastest_probe_s``)
#      and each try's slowness (``layer_tries``): layers timed while the probes around them read
#      the host more than speedprobe.STEADY slow are timed again, the least slow try kept
#      ([Note: layers timed at the host's own speed]); ``measurement.speed_probe_s`` the kept
#      try's two probes. Absent: one try, the host's own speed not read.
#  14  ``fixed_costs.optimizer_scale`` (and ``optimizer_scale_spread``): the probe steps Adam over
#      each rank's chunks after every step, and this is how much longer that took than the
#      layers' ``optimizer_s`` say; plans charge the layers' figures times it ([Note: the
#      optimizer timed where it runs], profiles/fixedcosts.py). Absent: 1 (as profiled).
# Plan
#   2  ``options.compute_scale``.
#   3  the precision (``precision``, ``param_dtype``; before it, fp32).
#   4  the best one-device plan of the same global batch (``predicted.one_stage_step_s``,
#      ``speedup_over_one_stage``) and the noise band.
#   5  ``chunks`` placed on ``stages`` (several per stage for interleaved and zb-v); a plan before
#      it reads as one chunk per stage.
#   6  d replicas of the pipeline (``data_parallel``, ``gradient_sync``, ``placement``,
#      ``factorisations``); a plan before it is one replica, stage k on rank k.
#   7  ``options.fixed_costs``: the fixed costs per action kind and message the plan charged
#      (planner/fixedcosts.py; absent or null: none beyond ``per_microbatch_overhead_s``); the
#      placement order ``data-only`` for one stage of d > 1 replicas (no pipeline: version 6
#      named it ``pipeline-inner``, and reads as it is); ``options.concurrent_ranks`` and
#      ``predicted.dedicated_step_s`` where the ranks share fewer cores than they are (absent or
#      null: a core each, as before); what proved or bounded the plan (``optimality.bound_by``,
#      ``settings_bound_by``, one of BOUND_METHODS each, and ``milp_solver``); a plan before it
#      does not say.
#   8  the asynchronous schedules (``pipedream``, ``pipedream-2bw``: gpipe_plan.weight_versions):
#      ``updates_per_step``; per stage ``staleness_updates`` and ``weight_versions``;
#      ``predicted.steady_state_period_s`` and ``fill_drain_s`` (null for a synchronous
#      schedule). A plan before it is synchronous: 1 update a step, staleness 0, one version.
#   9  ``options.shared_core_slowdown`` and ``shared_core_action_s``: where the ranks share cores,
#      the factor charged on every action's time and the cost added to each (absent or null: 1
#      and 0, as before).
#  10  per chunk, ``param_bytes``: each layer's parameter bytes as the profile measured them, which
#      ``run`` checks the rebuilt model against before any step (absent: not checked, as before).
#  11  ``tuning``: a plan ``gpipe-plan tune`` chose by running it and the plans predicted as fast
#      (planner/alternatives.py): each candidate's source, setting, cut, predicted step and the
#      step measured in each round; absent: a plan solve chose by its prediction alone.
# Report
#   2  the run's precision and, on CUDA, the allocator's reserved memory and what lies outside it.
#   3  the per-micro-batch times move into ``chunks`` (with the halves of a split backward); its
#      ``stages`` are devices, with their memory and idle time.
#   4  data parallel: ``data_parallel``, ``gradient_sync``, per stage its measured gradient sync
#      beside the plan's and its ``replicas``; the stages' figures are replica 0's.
#   5  the host's load over the steps (``host_load``: the cores other processes used, and took
#      from the run); each speed probe's spread (``speed.per_rank_probe_spread``); the headline
#      judges the plan's own prediction (``basis`` "profile"), with the speed-adjusted one beside
#      it only where the probe held steady (``at_run_speed``, else ``speed_left_out``) and
#      ``host_busy``. A version-4 headline (its prediction the speed-adjusted one) is read and
#      shown as version 5 would make it from the report's own fields.
#   6  whether the plan's ranks shared the host's cores and what it charged every action there
#      (``concurrent_ranks``, ``shared_core_slowdown``, ``shared_core_action_s``: the plan's
#      options; null, 1 and 0 where they did not): calibrate refuses such a round unless forced,
#      and takes the charges off what it compares. Before it: read from the plan the report names
#      where that is at hand, else a core per rank.
FORMAT_VERSIONS: dict[str, int] = {PROFILE_FORMAT: 14, PLAN_FORMAT: 11, REPORT_FORMAT: 6}
READABLE_VERSIONS: dict[str, tuple[int, ...]] = {PROFILE_FORMAT: (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14),
                                                 PLAN_FORMAT: (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11),
                                                 REPORT_FORMAT: (1, 2, 3, 4, 5, 6)}


# What can give a searched setting its lower bound, as a plan's ``optimality.bound_by`` names it
# (version 7): GPipe's threshold search (planner/gpipe_solver.py), the branch and bound of 1F1B and the
# chunked schedules (planner/onefoneb.py, planner/chunked.py), the schedule MILP
# (planner/milp.py; or its linear relaxation alone, milp_solve.relaxation_bound), the GPipe/1F1B
# ILP of ``--solver ilp`` (planner/ilp.py).
BOUND_METHODS = ("dp", "branch and bound", "milp", "ilp")
# What the MILP runs on (``optimality.milp_solver``; null: neither highspy nor pulp is installed).
MILP_SOLVERS = ("HiGHS", "CBC")


# What an older profile lacks, and what it is read as: the one place that says so, beside the
# versions above and the PROFILE schema below (every key and its type). A reader (the planner's
# planner/profile.py, the viewer profiles/show.py) asks the functions below whether a
# profile has a measurement, never which version it is, because newer profiles leave some out too
# (a GPU has no contention; ``profile --no-recompute-timing`` times no recomputation).
#   ``contention`` (before 2; never on a GPU): neighbours cost nothing (slowdown 1).
#   the recompute timings (before 3): recomputation costs one more forward (:func:`recompute_timed`).
#   ``contention.slowest_step_s`` (before 4): the slowdown is the median process's (:func:`slowdown_of_slowest`).
#   ``precision``, ``param_dtype`` (before 5): fp32 (gpipe_plan.artifacts.precision_of).
#   ``measured_as`` (before 6): every layer was measured (:func:`layers_sharing_figures`).
#   the split backward (before 7): I = W = backward / 2 (:func:`split_backward_timed`, LayerFigures).
#   the all-reduce in ``link`` (before 8): a gradient sync is priced with the point-to-point figures.
#   ``fixed_costs`` (before 9; ``profile --no-fixed-costs``): none are charged but the calibrated
#   overhead, with several stages only, and a plan says so (planner/fixedcosts.py).
#   the issue times (before 9; never on a CPU): an action takes its layers' time.
#   a CPU's ``device.memory_bytes`` (before 9): a CPU plan has no memory limit but ``--memory-limit``.
#   a CPU's ``device.cores`` (before 9): its ranks are taken to have a core each (no time-sharing).
#   ``host_load`` (before 9): how busy the host was is not known, and nothing is said of it.
#   ``fixed_costs.shared_cores`` (before 10; ``profile --no-shared-cores``; a host that runs more
#   than 4 ranks at once): ranks that share cores are charged no slowdown beyond the sharing
#   itself, and a plan of more ranks than cores says so.
#   ``fixed_costs.per_micro_batch_size`` (before 11): every plan is charged the figures of the one
#   size the probe measured (``fixed_costs.micro_batch_size``), whatever its own.
RECOMPUTE_FIELDS = ("recompute_forward_s", "recompute_backward_s")
SPLIT_FIELDS = ("backward_input_s", "backward_weight_s", "weight_kept_bytes")
ISSUE_FIELDS = ("issue_forward_s", "issue_backward_s")          # version 9, CUDA profiles


def recompute_timed(doc: dict[str, Any]) -> bool:
    """Whether the profile timed recomputation: ``recompute_call_s`` and every layer's recompute times."""
    return doc.get("recompute_call_s") is not None and all(
        layer.get(key) is not None for layer in doc["layers"] for key in RECOMPUTE_FIELDS)


def split_backward_timed(layers: list[dict[str, Any]]) -> bool:
    """Whether every layer has its backward split in two (I, W) and what W keeps alive."""
    return bool(layers) and all(layer.get(key) is not None for layer in layers for key in SPLIT_FIELDS)


def layers_sharing_figures(layers: list[dict[str, Any]]) -> int | None:
    """How many layers took another's figures (``measured_as``); None: not recorded, every layer measured."""
    if any("measured_as" not in layer for layer in layers):
        return None
    return sum(1 for layer in layers if layer["measured_as"])


def slowdown_of_slowest(contention: dict[str, Any]) -> bool:
    """Whether ``contention.slowdown`` is the slowest process's (else the median one's)."""
    return "slowest_step_s" in contention


def check_format(doc: Any, fmt: str, where: str) -> None:
    """Refuse a document that is not ``fmt`` at a version this code reads."""
    what = fmt.split(".")[-1]
    if not isinstance(doc, dict):
        raise BadInput(f"'{where}' is not a gpipe-plan {what}: expected a JSON object")
    found = doc.get("format")
    if found != fmt:
        hint = f" (it is a {found.split('.')[-1]})" if isinstance(found, str) and found in READABLE_VERSIONS else ""
        raise BadInput(f"'{where}' is not a gpipe-plan {what}: \"format\" is {found!r}, expected {fmt!r}{hint}")
    version = doc.get("version")
    readable = READABLE_VERSIONS[fmt]
    whole = (isinstance(version, int) and not isinstance(version, bool)) or \
        (isinstance(version, float) and version.is_integer())     # (not inf nor nan)
    # A version is a whole number. Past the newest this code reads, whatever its spelling (14.0 is
    # 14), a newer gpipe-plan wrote it and the file is fine: re-creating it would throw its
    # measurements away. Any other value but a missing one (2.5, "11", true) no gpipe-plan wrote:
    # say what a version is. That holds for 11.0 too, as for every count in these formats: a JSON
    # integer (an edited 11.0 would slip past the checks that compare the version, in validate).
    if whole and version > max(readable):
        advice = "a newer gpipe-plan wrote it: read it with that version, or upgrade this one"
    elif version is not None and not (whole and isinstance(version, int)):
        advice = "the version must be an integer, as gpipe-plan writes it"
    elif version not in readable:
        advice = "re-create it with this version of gpipe-plan"
    else:
        return
    raise BadInput(f"'{where}' is {what} format version {_show(version)}; this gpipe-plan reads "
                   f"{_versions(readable)}: {advice}")


def _versions(readable: tuple[int, ...]) -> str:
    """(1,) -> 'version 1'; (1, 2, 3) -> 'versions 1, 2 or 3'."""
    if len(readable) == 1:
        return f"version {readable[0]}"
    return "versions " + ", ".join(map(str, readable[:-1])) + f" or {readable[-1]}"


def read_artifact(path: str | os.PathLike[str], fmt: str) -> dict[str, Any]:
    """Read a gpipe-plan artifact and check that it is the expected format and version.

    Its keys are checked by :func:`validate`, which the reader calls with the schema it reads
    by (a plan shown needs its predictions; a plan run does not)."""
    what = fmt.split(".")[-1]
    doc = read_json(path, what)
    check_format(doc, fmt, str(path))
    return doc


def read_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A profile file as ``show`` and ``calibrate`` take it: at a version this code reads, every
    key checked, its precision one this code runs. (``solve``'s door is ``planner.profile.Profile``,
    which checks the document it is handed the same way, once.)"""
    where = f"profile '{path}'"
    doc = read_artifact(path, PROFILE_FORMAT)
    validate(doc, "profile", where)
    precision_of(doc, where)
    return doc


def read_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A run's report as every reader takes it (``show``, ``calibrate``): at a version this code
    reads, every key checked. Its chunks, whatever its version, are :func:`report_chunks`'."""
    doc = read_artifact(path, REPORT_FORMAT)
    validate(doc, "report", f"report '{path}'")
    return doc


# --------------------------------------------------------------------------- the spec language
class Spec:
    """One value's description. ``check`` returns if the value is fine, else raises through
    ``ctx.fail`` (one line: the file, the key's path, what is wrong). ``null`` is handled by the
    walk: it passes where ``nullable`` says so and is refused elsewhere."""

    nullable: bool = False

    def check(self, value: Any, path: str, ctx: "_Context") -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Number(Spec):
    """A finite JSON number in ``[minimum, maximum]``; ``integer``: a whole number (an int in JSON)."""

    minimum: float | None = 0.0
    maximum: float = MAX_RATIO
    integer: bool = False
    nullable: bool = False
    above: bool = False            # the minimum itself is excluded (a rate, a ratio > 0)

    def check(self, value: Any, path: str, ctx: "_Context") -> None:
        kind = "an integer" if self.integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (self.integer and not isinstance(value, int)):
            ctx.fail(path, f"must be {kind}{self._range()}, found {_show(value)}")
        try:
            as_float = float(value)
        except OverflowError:
            ctx.fail(path, f"is an integer too large to use ({len(str(abs(value)))} digits)")
        if not math.isfinite(as_float):
            ctx.fail(path, f"must be a finite number, found {_show(value)}")
        too_low = self.minimum is not None and (as_float <= self.minimum if self.above else as_float < self.minimum)
        if too_low or as_float > self.maximum:
            ctx.fail(path, f"must be {kind}{self._range()}, found {_show(value)}")

    def _range(self) -> str:
        low = "" if self.minimum is None else f"{'>' if self.above else '>='} {self.minimum:g}"
        high = _CEILING_NAMES.get(self.maximum, f"{self.maximum:g}")
        return f" ({low}{', ' if low else ''}<= {high})"


@dataclass(frozen=True)
class Text(Spec):
    """A JSON string; ``choices``: one of them; ``nonempty``: not ``""``."""

    choices: tuple[str, ...] | None = None
    nonempty: bool = False
    nullable: bool = False

    def check(self, value: Any, path: str, ctx: "_Context") -> None:
        if not isinstance(value, str):
            ctx.fail(path, f"must be a string, found {_show(value)}")
        if self.nonempty and not value:
            ctx.fail(path, "must not be empty")
        if self.choices is not None and value not in self.choices:
            ctx.fail(path, f"is {_show(value)}, not one of {', '.join(self.choices)}")


@dataclass(frozen=True)
class Flag(Spec):
    """``true`` or ``false``."""

    nullable: bool = False

    def check(self, value: Any, path: str, ctx: "_Context") -> None:
        if not isinstance(value, bool):
            ctx.fail(path, f"must be true or false, found {_show(value)}")


@dataclass(frozen=True)
class Anything(Spec):
    """Any JSON value: a key only copied or printed, never computed with."""

    nullable: bool = True

    def check(self, value: Any, path: str, ctx: "_Context") -> None:
        return None


@dataclass(frozen=True)
class Items(Spec):
    """A JSON list of ``of``; ``per_size``: one entry per profiled micro-batch size."""

    of: Spec
    min_len: int = 0
    per_size: bool = False
    nullable: bool = False

    def check(self, value: Any, path: str, ctx: "_Context") -> None:
        if not isinstance(value, list):
            ctx.fail(path, f"must be a list, found {_show(value)}")
        if self.per_size and ctx.sizes is not None and len(value) != ctx.sizes:
            ctx.fail(path, f"must be a list of {ctx.sizes} numbers, one per micro-batch size, "
                           f"found {len(value)}")
        if len(value) < self.min_len:
            ctx.fail(path, f"must have at least {self.min_len} entr{'y' if self.min_len == 1 else 'ies'}")
        for i, item in enumerate(value):
            ctx.walk(self.of, item, f"{path}[{i}]")


@dataclass(frozen=True)
class Key:
    """A key of an :class:`Object`: its spec and whether it must be present."""

    spec: Spec
    required: bool = False


@dataclass(frozen=True)
class Object(Spec):
    """A JSON object with the declared ``keys`` (others are let through).

    ``when_true``: flag -> keys that must be present and not null when that flag is true
    (a runner-up that ``fits`` has a step time; one that does not, none).
    """

    keys: Mapping[str, Key] = field(default_factory=dict)
    nullable: bool = False
    when_true: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def check(self, value: Any, path: str, ctx: "_Context") -> None:
        if not isinstance(value, dict):
            ctx.fail(path, f"must be an object, found {_show(value)}")
        for name, key in self.keys.items():
            where = f"{path}.{name}" if path else name
            if name not in value:
                if key.required:
                    ctx.missing(where)
                continue
            ctx.walk(key.spec, value[name], where)
        for flag, needed in self.when_true.items():
            for name in needed if value.get(flag) is True else ():
                if value.get(name) is None:
                    ctx.fail(f"{path}.{name}" if path else name, f"must be given when '{flag}' is true")


@dataclass(frozen=True)
class Table(Spec):
    """A JSON object used as a table: any keys (matching ``key_pattern``), every value a ``values``."""

    values: Spec
    key_pattern: str | None = None
    nullable: bool = False

    def check(self, value: Any, path: str, ctx: "_Context") -> None:
        if not isinstance(value, dict):
            ctx.fail(path, f"must be an object, found {_show(value)}")
        for name, item in value.items():
            if self.key_pattern is not None and not re.fullmatch(self.key_pattern, name):
                ctx.fail(path, f"has the key {_show(name)}, expected keys like {self.key_pattern!r}")
            ctx.walk(self.values, item, f"{path}.{name}")


def need(spec: Spec) -> Key:
    """A key that must be present."""
    return Key(spec, required=True)


def may(spec: Spec) -> Key:
    """A key that may be absent."""
    return Key(spec, required=False)


# --------------------------------------------------------------------------- the walk
class _Context:
    """Where the walk is (the file) and what it knows (how many micro-batch sizes)."""

    def __init__(self, where: str, sizes: int | None):
        self.where = where
        self.sizes = sizes

    def walk(self, spec: Spec, value: Any, path: str) -> None:
        if value is None and spec.nullable:
            return
        if value is None:
            self.fail(path, "must not be null")
        spec.check(value, path, self)

    def fail(self, path: str, what: str) -> None:
        raise BadInput(f"{self.where}: '{path or '(top level)'}' {what}")

    def missing(self, path: str) -> None:
        raise BadInput(f"{self.where} has no '{path}'")


def _show(value: Any) -> str:
    """A value as the message shows it: short, on one line."""
    if isinstance(value, int) and not isinstance(value, bool) and len(str(abs(value))) > 20:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value) if isinstance(value, (str, int, float, bool)) else type(value).__name__
    text = {"dict": "an object", "list": "a list", "NoneType": "null"}.get(text, text)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------- the three schemas
def _seconds(nullable: bool = False) -> Number:
    return Number(0.0, MAX_SECONDS, nullable=nullable)


def _bytes(nullable: bool = False) -> Number:
    return Number(0.0, MAX_BYTES, nullable=nullable)


def _count(minimum: int = 0, nullable: bool = False) -> Number:
    return Number(minimum, MAX_COUNT, integer=True, nullable=nullable)


def _ratio(nullable: bool = True) -> Number:
    return Number(None, MAX_RATIO, nullable=nullable)


def _cores(nullable: bool = False) -> Number:
    """A number of CPU cores in use on average (a share of a host's): >= 0."""
    return Number(0.0, float(MAX_COUNT), nullable=nullable)


def _loss() -> Number:
    return Number(None, MAX_LOSS, nullable=True)


def _per_size(item: Spec, nullable: bool = False) -> Items:
    return Items(item, per_size=True, nullable=nullable)


SHAPES = Items(Items(_count(0)), nullable=True)
DTYPE_NAMES = Items(Text(), nullable=True)
CUT_DTYPES = Items(Text(choices=DTYPES + tuple(f"torch.{d}" for d in DTYPES)), nullable=True)

# The model spec (docs/profile-format.md, "Model spec"): copied between artifacts; the keys
# that are printed are typed, the rest is read by the model builders, which check it.
MODEL = Object({
    "source": may(Text()),
    "name": may(Text(nullable=True)),
    "factory": may(Text(nullable=True)),
    "options": may(Object(nullable=True)),
})

DEVICE = Object({
    "type": may(Text(nullable=True)),
    "name": may(Anything()),
    "threads": may(_count(1, nullable=True)),
    "index": may(_count(0, nullable=True)),
    "memory_bytes": may(_bytes(nullable=True)),
    "context_bytes": may(_bytes(nullable=True)),
    "speed_probe_s": may(_seconds(nullable=True)),
    "speed_probe_workload": may(Items(_count(0), nullable=True)),
    # Version 9, CPU: the CPUs the profiler could run on (its affinity mask): the cores the
    # ranks of a plan on that host share (docs/planner.md, "More ranks than cores").
    "cores": may(_count(1, nullable=True)),
})

LAYER = Object({
    "name": need(Text(nonempty=True)),
    # Version 8: the unsplit model's name of the module the layer is (null: not one module).
    "module": may(Text(nonempty=True, nullable=True)),
    # Imported profiles (import-pipedream): the node's operator as PipeDream's graph writes it.
    "op": may(Text()),
    "forward_s": need(_per_size(_seconds())),
    "backward_s": need(_per_size(_seconds())),
    "activation_bytes": need(_per_size(_bytes())),
    "output_bytes": need(_per_size(_bytes())),
    "param_bytes": need(_bytes()),
    "measured_as": may(Text(nullable=True)),
    "optimizer_s": may(_seconds(nullable=True)),
    "peak_transient_bytes": may(_per_size(_bytes(), nullable=True)),
    "output_shapes": may(SHAPES),
    "output_dtypes": may(DTYPE_NAMES),
    "output_batched": may(Items(Flag(), nullable=True)),
    "buffer_bytes": may(_bytes(nullable=True)),
    "recompute_forward_s": may(_per_size(_seconds(), nullable=True)),
    "recompute_backward_s": may(_per_size(_seconds(), nullable=True)),
    # Version 7: the backward split as zero-bubble schedules run it (absent: the planner estimates).
    "backward_input_s": may(_per_size(_seconds(), nullable=True)),
    "backward_weight_s": may(_per_size(_seconds(), nullable=True)),
    "weight_kept_bytes": may(_per_size(_bytes(), nullable=True)),
    # Version 9, CUDA: the CPU's time to issue the layer's passes (the GPU busy meanwhile).
    "issue_forward_s": may(_per_size(_seconds(), nullable=True)),
    "issue_backward_s": may(_per_size(_seconds(), nullable=True)),
})

# One host over one window (gpipe_plan/hostload.py, window_load): a run's report per host
# (version 5), a profile's per phase (version 9).
HOST_WINDOW = {
    "cores": need(_count(1)),
    "needed_cores": need(_count(0)),
    "run_cores": may(_cores()),
    "other_cores": need(_cores()),
    "steal_cores": may(_cores()),
    "contended_cores": need(_cores()),
    "window_s": may(_seconds()),
}

FIXED_COST_KEYS = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "send_s", "receive_s",
                   "between_actions_s")
FIXED_COSTS = Object({
    **{key: need(_seconds()) for key in FIXED_COST_KEYS},
    "spread": may(Table(_seconds(), nullable=True)),
    "executor": may(Text(nullable=True)),
    "backend": may(Text(nullable=True)),
    "processes": may(_count(2, nullable=True)),
    "threads_per_process": may(_count(1, nullable=True)),
    "micro_batch_size": may(_count(1, nullable=True)),
    "compute_scale": may(Number(0.0, MAX_RATIO, nullable=True)),
    "layers": may(Items(Text(), nullable=True)),
    "configurations": may(Items(Anything(), nullable=True)),
    "seconds": may(_seconds(nullable=True)),
    # Version 14 (profiles/fixedcosts.py, fit_optimizer_scale): the optimizer step in the pipeline
    # over the layers' own figures, which plans charge them times (absent: 1).
    "optimizer_scale": may(Number(0.0, MAX_RATIO, nullable=True)),
    "optimizer_scale_spread": may(Number(0.0, MAX_RATIO, nullable=True)),
    # Version 11 (profiles/fixedcosts.py, measure_fixed_costs): the figures at each size measured.
    "per_micro_batch_size": may(Items(Object({
        "micro_batch_size": need(_count(1)),
        **{key: need(_seconds()) for key in FIXED_COST_KEYS},
        "spread": may(Table(_seconds(), nullable=True)),
        "configurations": may(Items(Anything(), nullable=True)),
    }), nullable=True)),
    # Version 10 (profiles/fixedcosts.py, measure_shared_cores): null or absent, not measured.
    "shared_cores": may(Object({
        "slowdown": need(Number(1.0, MAX_RATIO)),
        "per_action_s": may(_seconds(nullable=True)),
        "spread": may(Table(Number(0.0, MAX_RATIO), nullable=True)),
        "processes": need(_count(2)),
        "concurrent_ranks": may(Number(0.0, MAX_RATIO, nullable=True)),
        "threads_per_process": may(_count(1, nullable=True)),
        "micro_batch_size": may(_count(1, nullable=True)),
        "layers": may(Items(Text(), nullable=True)),
        "configurations": may(Items(Anything(), nullable=True)),
        "seconds": may(_seconds(nullable=True)),
    }, nullable=True)),
}, nullable=True)

PROFILE = Object({
    "model": need(MODEL),
    "device": need(DEVICE),
    "micro_batch_sizes": need(Items(_count(1), min_len=1)),
    "layers": need(Items(LAYER, min_len=1)),
    "input_bytes": may(_per_size(_bytes(), nullable=True)),
    "input": may(Object({"shapes": may(SHAPES), "dtypes": may(DTYPE_NAMES)}, nullable=True)),
    "precision": may(Text()),
    "param_dtype": may(Text()),
    "batch_size": may(_count(1, nullable=True)),
    "global_batch_size": may(_count(1, nullable=True)),
    "link": may(Object({
        "backend": may(Anything()),
        "bandwidth_bytes_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
        "latency_s": may(_seconds(nullable=True)),
        "message_bytes": may(Items(_bytes(), nullable=True)),
        "one_way_s": may(Items(_seconds(), nullable=True)),
        # Version 8: an all-reduce over `allreduce_processes`, fitted to the ring model.
        "allreduce_bandwidth_bytes_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
        "allreduce_latency_s": may(_seconds(nullable=True)),
        "allreduce_processes": may(_count(2, nullable=True)),
        "allreduce_message_bytes": may(Items(_bytes(), nullable=True)),
        "allreduce_s": may(Items(_seconds(), nullable=True)),
    }, nullable=True)),
    "contention": may(Object({
        "processes": need(_count(2)),
        "slowdown": need(Number(1.0, MAX_RATIO)),
        "threads_per_process": may(_count(1, nullable=True)),
        "micro_batch_size": may(_count(1, nullable=True)),
        "alone_step_s": may(_seconds(nullable=True)),
        "together_step_s": may(_seconds(nullable=True)),
        "slowest_step_s": may(_seconds(nullable=True)),
        "cycle_ratios": may(Items(Number(0.0, MAX_RATIO))),   # show: .get("cycle_ratios", [])
        # Version 12 (profiles/contention.py): the kept reading's spread, and how many were taken.
        "spread": may(Number(0.0, MAX_RATIO, nullable=True)),
        "readings": may(_count(1, nullable=True)),
    }, nullable=True)),
    "recompute_call_s": may(_per_size(_seconds(), nullable=True)),
    "overhead": may(Object({"per_microbatch_s": may(_seconds(nullable=True))}, nullable=True)),
    "fixed_costs": may(FIXED_COSTS),
    "calibration": may(Items(Anything(), nullable=True)),
    "consistency": may(Object({
        key: may(_per_size(Number(0.0, MAX_SECONDS, nullable=True), nullable=True))
        for key in ("layer_sum_s", "model_step_s", "ratio", "model_forward_s", "model_backward_s")
    }, nullable=True)),
    "tied_parameters": may(Items(Object({
        "layers": need(Items(Text(), min_len=1)),
        "bytes": need(_bytes()),
    }), nullable=True)),
    # How the times were taken (docs/profile-format.md, "measurement"): printed but for these, which
    # the planner computes with.
    "measurement": may(Object({
        # The speed probe right before and after the layers were timed (the kept try's, from version
        # 13): how far apart they read is part of a plan's noise (planner/plan.py, prediction_noise).
        "speed_probe_s": may(Items(_seconds(), nullable=True)),
        # Version 13 (profiles/profiler.py, _timed_at_speed): the host's own speed by the probe, and
        # each try's slowness, the slower probe around it over that speed (>= 1 as written; a reader
        # keeps those above 0), the least slow of which a plan warns of ([Note: layers timed at the
        # host's own speed]). Absent: one try, the host's speed not read.
        "host_speed": may(Object({
            "fastest_probe_s": may(_seconds(nullable=True)),
            "layer_tries": may(Items(Number(0.0, MAX_RATIO), nullable=True)),
        }, nullable=True)),
    }, nullable=True)),
    # Version 9: what other processes used of the host's cores while each phase was measured.
    "host_load": may(Object({
        "phases": need(Items(Object({"phase": need(Text(nonempty=True)), **HOST_WINDOW}))),
    }, nullable=True)),
})


def _layer_run(solved: bool) -> dict[str, Any]:
    """The keys of a contiguous run of layers in a plan: a version-5 chunk, or a version-4
    stage (which is its one chunk); ``solved``: with the predictions ``show`` prints (a
    hand-written plan has none)."""
    predicted = need if solved else may
    return {
        "index": predicted(_count(0)),
        "layers": need(Items(Text(), min_len=1)),
        "first_layer": may(_count(0)),
        "recompute": predicted(Flag()),
        "forward_s": predicted(_seconds(nullable=not solved)),
        "backward_s": predicted(_seconds(nullable=not solved)),
        "recompute_s": may(_seconds(nullable=True)),
        "send_s": may(_seconds(nullable=True)),
        "output_shapes": may(SHAPES),
        "output_dtypes": may(CUT_DTYPES),
        "output_batched": may(Items(Flag(), nullable=True)),
    }


def _stage_needs(solved: bool) -> dict[str, Any]:
    """What a stage (a device) needs and does, in a plan of any version."""
    predicted = need if solved else may
    return {
        "optimizer_s": may(_seconds(nullable=True)),
        "gradient_sync_s": may(_seconds(nullable=True)),     # version 6: its part of optimizer_s
        "memory_bytes": predicted(_bytes(nullable=not solved)),
        "memory": may(Table(_bytes(nullable=True), nullable=True)),
        "in_flight": may(_count(0, nullable=True)),
        "busy_s": may(_seconds(nullable=True)),
        "idle_fraction": may(_ratio()),
        # Version 8 (absent: synchronous, 0 and 1): gpipe_plan.weight_versions's staleness and
        # stashed versions of the stage.
        "staleness_updates": may(_count(0)),
        "weight_versions": may(_count(1)),
    }


def _plan_stage(solved: bool) -> Object:
    """A version-4 plan's stage: its one chunk's keys, and the stage's own predictions."""
    return Object({**_layer_run(solved), **_stage_needs(solved)})


def _plan_chunk(solved: bool) -> Object:
    """A version-5 plan's chunk: a contiguous run of layers, what one pass over it costs, what it sends.
    How chunks and stages fit together is gpipe_plan/plan_layout.py's to check."""
    predicted = need if solved else may
    return Object({
        **_layer_run(solved),
        "stage": predicted(_count(0)),
        "backward_input_s": may(_seconds(nullable=True)),
        "backward_weight_s": may(_seconds(nullable=True)),
        # Version 6: per layer, the module it is in the unsplit model (null: none), for export.
        "modules": may(Items(Text(nonempty=True, nullable=True))),
        # Version 10: per layer, its parameters' bytes (the profile's layers[i].param_bytes).
        "param_bytes": may(Items(_bytes())),
    })


def _plan_device(solved: bool) -> Object:
    """A version-5 plan's stage: one device, the chunks it holds and what it needs."""
    predicted = need if solved else may
    return Object({
        "index": predicted(_count(0)),
        "chunks": predicted(Items(_count(0), min_len=1)),
        **_stage_needs(solved),
    })


# A setting ``solve`` also tried (plan ``runners_up``): what ``show`` prints of it.
RUNNER_UP = Object({
    "micro_batches": need(_count(1)),
    "micro_batch_size": need(_count(1)),
    "schedule": need(Text()),
    "virtual_stages": may(_count(1, nullable=True)),
    "fits": may(Flag(nullable=True)),
    "step_s": may(_seconds(nullable=True)),
    "bubble_fraction": may(_ratio()),
    "peak_memory_bytes": may(_bytes(nullable=True)),
    "balance": may(Items(_count(1))),   # show: .get("balance", [])
    "data_parallel": may(_count(1)),    # version 6
}, when_true={"fits": ("step_s", "bubble_fraction", "peak_memory_bytes")})

# Plan version 6: how N devices are used, K stages x d replicas (docs/plan-format.md).
PLACEMENT = Object({
    "nodes": need(_count(1)),
    "devices_per_node": need(_count(1)),
    "order": need(Text(choices=PLACEMENT_ORDERS)),
    # ranks[k][r]: rank of stage k, replica r; plan_layout.placement_ranks checks it is a permutation
    "ranks": need(Items(Items(_count(0), min_len=1), min_len=1)),
    "reason": may(Text(nullable=True)),
    # What each traffic was charged (null bandwidth: free): the pipeline's sends, the gradient sync.
    "pipeline_bandwidth_bytes_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
    "pipeline_latency_s": may(_seconds(nullable=True)),
    "sync_bandwidth_bytes_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
    "sync_latency_s": may(_seconds(nullable=True)),
})
# One (stages, data_parallel) pair ``solve`` searched (plan ``factorisations``), best first.
FACTORISATION = Object({
    "stages": need(_count(1)),
    "data_parallel": need(_count(1)),
    "order": may(Text(choices=PLACEMENT_ORDERS, nullable=True)),
    "fits": need(Flag()),
    "step_s": may(_seconds(nullable=True)),
    "samples_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
    "proven": may(Flag(nullable=True)),
    "reason": may(Text(nullable=True)),
}, when_true={"fits": ("step_s",)})


# Plan version 11: what ``gpipe-plan tune`` ran to choose the plan (tune.py): the plans in the
# order run, each one's measured step per round it ran (``failed``: why a run failed; it ran no more).
TUNING_SOURCES = ("solve's plan", "runner-up", "one move")
TUNING = Object({
    "tuned_from": need(Object({"path": need(Text()), "sha256": need(Text())})),
    "within": need(_ratio(nullable=False)),
    "steps": need(_count(2)),
    "rounds": need(_count(1)),
    "candidates": need(Items(Object({
        "source": need(Text(choices=TUNING_SOURCES)),
        "schedule": need(Text()),
        "virtual_stages": need(_count(1)),
        "micro_batches": need(_count(1)),
        "micro_batch_size": need(_count(1)),
        "balance": need(Items(_count(1), min_len=1)),
        "predicted_step_s": need(_seconds()),
        "measured_step_s": need(Items(_seconds(nullable=True))),
        "failed": may(Text(nullable=True)),
        "chosen": need(Flag()),
    }), min_len=1)),
})


def _plan(solved: bool, chunked: bool) -> Object:
    """A plan; ``solved``: one ``solve`` wrote, with the predictions ``show`` prints; ``chunked``:
    with ``chunks`` (version 5), else stages that are each one chunk (version 4 and before)."""
    predicted_key = need if solved else may
    layout = {"chunks": need(Items(_plan_chunk(solved), min_len=1)),
              "stages": need(Items(_plan_device(solved), min_len=1))} if chunked else \
             {"stages": need(Items(_plan_stage(solved), min_len=1))}
    return Object({
        "model": need(MODEL),
        "precision": may(Text()),
        "param_dtype": may(Text()),
        "profile": may(Object({
            "path": may(Text(nullable=True)),
            "sha256": may(Text(nullable=True)),
            "device": may(DEVICE),
            "micro_batch_sizes": may(Items(_count(1), nullable=True)),
        })),   # not null: show reads .get("profile", {}).get("device", {})
        "options": may(Object({
            "optimizer": may(Text(nullable=True)),
            "memory_limit_bytes": may(_bytes(nullable=True)),
            "memory_limit_source": may(Text(nullable=True)),
            "link_bandwidth_bytes_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
            "link_latency_s": may(_seconds(nullable=True)),
            "per_microbatch_overhead_s": may(_seconds(nullable=True)),
            "fixed_costs": may(Object({key: may(_seconds(nullable=True)) for key in FIXED_COST_KEYS[:-1]},
                                      nullable=True)),
            "compute_scale": may(Number(0.0, MAX_RATIO, nullable=True)),
            # Version 7: the ranks the host ran at once, when fewer than K (planner/timeshare.py).
            "concurrent_ranks": may(Number(0.0, MAX_RATIO, nullable=True)),
            # Version 9: the factor charged on every action there (profile fixed_costs.shared_cores).
            "shared_core_slowdown": may(Number(1.0, MAX_RATIO, nullable=True)),
            "shared_core_action_s": may(_seconds(nullable=True)),
            "devices": may(_count(1, nullable=True)),
            "data_parallel": may(Anything()),        # an integer >= 1 or "auto", as asked: only printed
            "nodes": may(_count(1, nullable=True)),
            "network_bandwidth_bytes_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
            "network_latency_s": may(_seconds(nullable=True)),
            "gradient_sync": may(Text(choices=GRADIENT_SYNCS, nullable=True)),
            "sync_every": may(_count(1)),            # localsgd's --sync-every H (absent: not localsgd)
        })),
        "balance": need(Items(_count(1), min_len=1)),
        "micro_batches": need(_count(1)),
        "micro_batch_size": need(_count(1)),
        "global_batch_size": need(_count(1)),
        "schedule": need(Text()),
        "virtual_stages": may(_count(1)),
        "data_parallel": may(_count(1)),               # version 6 (absent: 1)
        "gradient_sync": may(Text(choices=GRADIENT_SYNCS)),
        "updates_per_step": may(_count(1)),            # version 8 (absent: 1)
        # localsgd: H, the steps between two averagings of the replicas' parameters (absent: 1;
        # since version 8: plan_layout.sync_every).
        "sync_every": may(_count(1)),
        "placement": may(PLACEMENT),
        "factorisations": may(Items(FACTORISATION, nullable=True)),
        **layout,
        "predicted": predicted_key(Object({
            "step_s": predicted_key(_seconds(nullable=not solved)),
            "bubble_fraction": predicted_key(_ratio(nullable=not solved)),
            "samples_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
            "peak_memory_bytes": predicted_key(_bytes(nullable=not solved)),
            "speedup_over_one_stage": may(_ratio()),
            "one_stage_step_s": may(_seconds(nullable=True)),
            "one_stage_fits": may(Flag(nullable=True)),
            "one_stage_peak_memory_bytes": may(_bytes(nullable=True)),
            "noise_fraction": may(_ratio()),
            "noise_sources": may(Table(_ratio(), nullable=True)),
            "gradient_sync_s": may(_seconds(nullable=True)),
            "dedicated_step_s": may(_seconds(nullable=True)),     # version 7: time-shared plans
            # version 8: asynchronous schedules (null: synchronous)
            "steady_state_period_s": may(_seconds(nullable=True)),
            "fill_drain_s": may(_seconds(nullable=True)),
        }, nullable=not solved)),
        "optimality": may(Object({
            "proven": may(Flag(nullable=True)),
            "method": may(Text(nullable=True)),
            "settings_searched": may(_count(0, nullable=True)),
            "lower_bound_s": may(_seconds(nullable=True)),
            "gap": may(_ratio()),
            # version 7
            "bound_by": may(Text(choices=BOUND_METHODS, nullable=True)),
            "settings_bound_by": may(Table(_count(0), key_pattern="|".join(BOUND_METHODS), nullable=True)),
            "milp_solver": may(Text(choices=MILP_SOLVERS, nullable=True)),
        })),
        "warnings": may(Items(Text(), nullable=True)),
        "runners_up": may(Items(RUNNER_UP, nullable=True)),
        "tuning": may(TUNING),                         # version 11
    })


_STEP_KEYS = r"\d{1,12}"   # "0", "1", ...: step numbers as JSON object keys

# A report's stage (a device): its memory, busy and idle time; before version 3 also the
# per-micro-batch times of its one chunk, which version 3 keeps in REPORT_CHUNK.
REPORT_STAGE = Object({
    "index": need(_count(0)),
    "chunks": may(Items(_count(0), nullable=True)),
    "layers": need(Items(Text(), min_len=1)),
    "recompute": may(Flag(nullable=True)),
    **{f"{who}_{kind}_s": may(_seconds(nullable=True))
       for who in ("predicted", "measured") for kind in ("forward", "backward", "optimizer")},
    "predicted_memory_bytes": may(_bytes(nullable=True)),
    "measured_peak_memory_bytes": may(_bytes(nullable=True)),
    "predicted_memory": may(Table(_bytes(nullable=True), nullable=True)),
    "measured_memory": may(Object(nullable=True)),
    "measured_busy_s": may(_seconds(nullable=True)),
    "measured_wait_s": may(_seconds(nullable=True)),
    "measured_cpu_s": may(_seconds(nullable=True)),
    "predicted_idle_fraction": may(_ratio()),
    "measured_idle_fraction": may(_ratio()),
    # Version 4: the step's data, tied-weight and loss exchanges (what is neither work nor a wait).
    "measured_other_s": may(_seconds(nullable=True)),
    # Version 4 (data parallel): the stage's gradient sync per step, and each replica's figures.
    "predicted_gradient_sync_s": may(_seconds(nullable=True)),
    "measured_gradient_sync_s": may(_seconds(nullable=True)),
    "replicas": may(Items(Object({
        "replica": need(_count(0)),
        "rank": need(_count(0)),
        "measured_busy_s": may(_seconds(nullable=True)),
        "measured_wait_s": may(_seconds(nullable=True)),
        "measured_gradient_sync_s": may(_seconds(nullable=True)),
        "measured_peak_memory_bytes": may(_bytes(nullable=True)),
    }), nullable=True)),
})


def report_chunks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's chunks; a report before version 3 has none, and its stages (which carry the
    times) are each one chunk on its own stage."""
    if report.get("chunks") is not None:
        return list(report["chunks"])
    return [{**st, "stage": st.get("index")} for st in report.get("stages") or []]


def timing_key(who: str, kind: str) -> str:
    """A report's time key: ``who`` (``measured`` or ``predicted``) x ``kind`` (``forward``,
    ``backward``, ``backward_input``, ``backward_weight``, ``optimizer``): ``measured_forward_s``.
    The report writes these keys and calibrate reads them by this one spelling."""
    return f"{who}_{kind}_s"


CHUNK_TIME_KINDS = ("forward", "backward", "backward_input", "backward_weight")

# A version-3 report's chunk: per micro-batch, the forward and the backward (B, or I + W)
# measured beside the plan's, and the two halves of a split backward (null under B).
REPORT_CHUNK = Object({
    "index": need(_count(0)),
    "stage": need(_count(0)),
    "layers": may(Items(Text(), min_len=1, nullable=True)),
    "recompute": may(Flag(nullable=True)),
    **{timing_key(who, kind): may(_seconds(nullable=True))
       for who in ("predicted", "measured") for kind in CHUNK_TIME_KINDS},
})

REPORT = Object({
    "model": need(MODEL),
    "plan": may(Object({"path": may(Text(nullable=True)), "sha256": may(Text(nullable=True))}, nullable=True)),
    "run": may(Object({"precision": may(Text()), "param_dtype": may(Text()),
                       "warnings": may(Items(Text(), nullable=True))}, nullable=True)),
    "schedule": may(Text(nullable=True)),
    "virtual_stages": may(_count(1, nullable=True)),
    "num_stages": may(_count(1, nullable=True)),
    # Version 6: the plan's options.concurrent_ranks, shared_core_slowdown and shared_core_action_s
    # (null, 1 and 0: a core per rank).
    "concurrent_ranks": may(Number(0.0, MAX_RATIO, nullable=True)),
    "shared_core_slowdown": may(Number(1.0, MAX_RATIO, nullable=True)),
    "shared_core_action_s": may(_seconds(nullable=True)),
    "data_parallel": may(_count(1, nullable=True)),            # version 4 (absent: 1)
    "gradient_sync": may(Text(choices=GRADIENT_SYNCS, nullable=True)),   # null with one replica
    "predicted_gradient_sync_s": may(_seconds(nullable=True)),  # the slowest stage's, as measured below
    "measured_gradient_sync_s": may(_seconds(nullable=True)),  # the slowest stage's
    "predicted_exposed_gradient_sync_s": may(_seconds(nullable=True)),   # what the syncs add to the step
    "micro_batches": may(_count(1, nullable=True)),
    "micro_batch_size": may(_count(1, nullable=True)),
    "global_batch_size": may(_count(1, nullable=True)),
    "steps_run": may(_count(0, nullable=True)),
    "steps_measured": may(_count(0, nullable=True)),
    "predicted_step_s": may(_seconds(nullable=True)),
    "measured_step_s": may(_seconds(nullable=True)),
    "step_time_ratio": may(_ratio()),
    "speed": may(Object({
        "profile_probe_s": may(_seconds(nullable=True)),
        "run_probe_s": may(_seconds(nullable=True)),
        "per_rank_probe_s": may(Table(Items(_seconds(nullable=True)), nullable=True)),
        "per_rank_probe_spread": may(Table(Items(_ratio()), nullable=True)),    # version 5
        "ratio": may(Number(0.0, MAX_RATIO, nullable=True)),
        "predicted_step_s_at_run_speed": may(_seconds(nullable=True)),
        "step_time_ratio_at_run_speed": may(_ratio()),
    }, nullable=True)),
    "headline": may(Object({
        "predicted_step_s": need(_seconds(nullable=True)),
        "basis": need(Text(choices=("run_speed", "profile"))),
        "noise_fraction": need(_ratio()),
        "noise_sources": may(Table(_ratio(), nullable=True)),
        "step_time_ratio": need(_ratio()),
        "within_noise": need(Flag(nullable=True)),
        # Version 5: the speed-adjusted comparison where the probe held steady, else why not; the host.
        "at_run_speed": may(Object({
            "predicted_step_s": need(_seconds()),
            "speed_ratio": need(Number(0.0, MAX_RATIO)),
            "noise_fraction": need(_ratio()),
            "step_time_ratio": need(_ratio()),
            "within_noise": need(Flag(nullable=True)),
        }, nullable=True)),
        "speed_left_out": may(Text(nullable=True)),
        "host_busy": may(Flag(nullable=True)),
    }, nullable=True)),
    # Version 5: what the host's other processes used over the steps (gpipe_plan/hostload.py).
    "host_load": may(Object({
        "window_s": need(_seconds()),
        "other_cores": need(_cores()),
        "contended_cores": need(_cores()),
        "hosts": need(Items(Object({
            "host": may(Text(nullable=True)),
            "ranks": may(Items(_count(0), nullable=True)),
            **HOST_WINDOW,
        }))),
    }, nullable=True)),
    "measured_step_s_per_step": may(Table(_seconds(nullable=True), key_pattern=_STEP_KEYS, nullable=True)),
    "predicted_bubble_fraction": may(_ratio()),
    "measured_bubble_fraction": may(_ratio()),
    "predicted_samples_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
    "samples_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
    "tokens_per_s": may(Number(0.0, MAX_RATE, nullable=True)),
    "loss": may(Object({
        "first": may(_loss()),
        "last": may(_loss()),
        "per_step": may(Table(_loss(), key_pattern=_STEP_KEYS, nullable=True)),
    }, nullable=True)),
    "chunks": may(Items(REPORT_CHUNK, nullable=True)),   # version 3; before it, the stages are the chunks
    "stages": need(Items(REPORT_STAGE)),   # empty: calibrate says it has nothing to calibrate with
})

SCHEMAS: dict[str, Object] = {"profile": PROFILE, "plan": _plan(solved=False, chunked=False),
                              "solved plan": _plan(solved=True, chunked=False),
                              "chunked plan": _plan(solved=False, chunked=True),
                              "solved chunked plan": _plan(solved=True, chunked=True),
                              "report": REPORT}


def validate(doc: Any, kind: str, where: str) -> None:
    """Check ``doc`` against the schema of ``kind`` (a key of :data:`SCHEMAS`); raise one-line
    :class:`BadInput` naming ``where`` (e.g. ``profile 'p.json'``), the key's path and the problem.

    A profile's per-size lists are checked against the length of its ``micro_batch_sizes``,
    which is therefore checked first. A plan with ``chunks`` (version 5) is checked against the
    chunked plan schema, one without against the one whose stages carry the layers.
    """
    if not isinstance(doc, dict):
        raise BadInput(f"{where} is not a JSON object")
    if kind in ("plan", "solved plan"):
        version = doc.get("version")
        if "chunks" in doc:   # version 5: chunks placed on stages
            kind = kind.replace("plan", "chunked plan")
        elif isinstance(version, int) and not isinstance(version, bool) and version >= 5:
            raise BadInput(f"{where} has no 'chunks' (a plan of format {version} keeps its layers there)")
    schema = SCHEMAS[kind]
    sizes: int | None = None
    if kind == "profile":
        sizes_key = schema.keys["micro_batch_sizes"]
        if "micro_batch_sizes" not in doc:
            raise BadInput(f"{where} has no 'micro_batch_sizes'")
        _Context(where, None).walk(sizes_key.spec, doc["micro_batch_sizes"], "micro_batch_sizes")
        sizes = len(doc["micro_batch_sizes"])
    _Context(where, sizes).walk(schema, doc, "")



# --------------------------------------------------------------------------- writing
# The format each schema's documents carry in their ``format`` key.
FORMAT_OF: dict[str, str] = {"profile": PROFILE_FORMAT, "report": REPORT_FORMAT,
                             **{kind: PLAN_FORMAT for kind in SCHEMAS if kind.endswith("plan")}}


class InvalidOutput(Exception):
    """A document gpipe-plan built that its own schema refuses: a bug in gpipe-plan, not in the
    user's input. It is not a :class:`~gpipe_plan.artifacts.BadInput`, which tells the user to
    fix something: the CLI lets it through with its traceback, which shows where it was built."""


def check_built(doc: Any, kind: str, where: str) -> None:
    """Check a document this code built against the schema of ``kind`` (a key of :data:`SCHEMAS`),
    as a reader will read it back; :class:`InvalidOutput` if it is refused.

    Read back: through :func:`~gpipe_plan.artifacts.dumps` and ``json.loads``, so that what is
    checked is what a file would hold (an infinity as null, a tuple as a list). ``where`` names
    the document in the message: the file it is for, or the function that built it.
    """
    _check_written(dumps(doc), kind, where)


def write_artifact(path: str | os.PathLike[str], doc: Any, kind: str, outputs: Outputs | None = None,
                   flag: str | None = None) -> None:
    """Write a profile, plan or report: checked as :func:`check_built` checks it, then written
    atomically (:class:`~gpipe_plan.artifacts.Outputs`). The one way an artifact is written: a
    document its own schema refuses is never written, and the writer fails loudly.

    ``outputs``: the set of the command's files this one joins (written with them, all or none);
    without it, the file is written now. ``flag`` names it in a one-line error.
    """
    text = dumps(doc)
    _check_written(text, kind, str(path))
    if outputs is None:
        with Outputs() as alone:
            alone.add(path, text, flag)
    else:
        outputs.add(path, text, flag)


def _check_written(text: str, kind: str, where: str) -> None:
    read_back = json.loads(text)
    try:
        check_format(read_back, FORMAT_OF[kind], where)
        validate(read_back, kind, f"{kind} '{where}'")
    except BadInput as exc:
        raise InvalidOutput(f"gpipe-plan built a {kind} that its own schema refuses (a bug in gpipe-plan): "
                            f"{exc}") from None
