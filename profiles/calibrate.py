"""Calibration: fold what a run measured back into the profile it was planned from.

A profile times each layer alone, on an otherwise idle machine. In a pipeline the same layers
run back to back with other micro-batches in flight, next to the other stages' processes, with
the runtime's own work per micro-batch: a stage often computes 10-40% slower than the sum of
its layers' profiled times (docs/benchmarks.md measures it). The run's report has, per chunk
(a contiguous run of layers; with one chunk per stage, the stage), the measured forward and
backward times at the plan's micro-batch size, and per stage the optimizer's. Calibration
scales each layer's forward and backward times by its chunk's measured / predicted ratio, and
its optimizer time by its stage's, at every micro-batch size, so that a second ``solve`` plans
with what the pipeline really costs. A schedule that splits the backward into the input
gradient (I) and the weight gradient (W) reports their sum per micro-batch as the chunk's
backward; its ratio scales B, I and W alike (one run cannot tell which half ran slow). Rounds
compose: each is recorded under ``calibration`` in the profile.

A report before version 3 has no chunks: its stages are the chunks. A version-3 report lists
its chunks, each naming its layers (or, where one does not, those of the plan the report
names: gpipe_plan/plan_layout.py).

The report also says how fast the machine was during the run against the profile's moment
(``speed.ratio``, from a reference workload each rank ran alone). That would be the machine's
drift, not a property of the pipeline, if the reference tracked the model; a generic workload
does so poorly: it is timed for a second beside a run of minutes, and misses slow spells the run
catches (and the other way round), so dividing its ratio out left the calibrated predictions
further off, not closer (docs/benchmarks.md, "Cost-model accuracy on this CPU"). So by default
the measured times are kept as they are; ``use_speed_probe`` divides the ratio out.

One run is one sample of a machine whose speed wanders (docs/runtime.md, "The machine's
speed"): folding a noisy run's ratios in whole carries its noise into every later plan, and can
leave the next prediction further off than the uncalibrated one. So each ratio is shrunk toward
1 by the run's own spread (:func:`shrink`): a stage that ran 3% slow in a run whose steps spread
by 5% is mostly noise and moves the profile a little; one that ran 30% slow in the same run
moves it almost all the way.

The runtime also spends time between its actions (choosing the next one, bookkeeping of sends
and receives), in no span the report times per chunk. Calibration measures it per action from
each stage's step, busy and waiting time (profiles/overhead.py) and writes it to the profile's
``overhead.per_microbatch_s``, which the planner charges on every action of a pipeline; the
chunk ratios are then taken against the predictions less the overhead they included.

Pure JSON in, JSON out: no torch here.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Any

from ..artifacts import BadInput, file_sha256, locate, precision_label, precision_of
from ..hostload import SPREAD_VALUES, robust_spread
from ..plan_view import ChunkPlan, read_plan
from ..schema import read_profile, read_report, report_chunks, timing_key
from ..planner.fixedcosts import optimizer_scale
from .overhead import fixed_in_times, measure_overhead, profiled_at_run_size
from .plausibility import Ratio, check_round


def calibrate(profile_path: str, report_path: str, use_speed_probe: bool = False,
              force: bool = False) -> dict[str, Any]:
    """The profile at ``profile_path`` with its layer times scaled by the run in ``report_path``.

    A round whose ratios are not the model's (a busy host, a ratio no correct run gives) is
    refused in one line that says what explains them (profiles/plausibility.py); ``force``
    folds it in anyway, and the round records what was forced (``forced``)."""
    profile = read_profile(profile_path)
    report = read_report(report_path)   # from here on, every key has its type
    report_sha256 = file_sha256(report_path)
    _check_not_folded_in(profile, profile_path, report_path, report_sha256)
    if report.get("model") != profile.get("model"):
        raise BadInput(f"'{report_path}' is a run of another model than '{profile_path}' profiles: "
                       "calibrate with the profile the run's plan was made from")
    profiled = precision_of(profile, f"profile '{profile_path}'")
    run = report.get("run") if isinstance(report.get("run"), dict) else {}
    ran = precision_of(run, f"report '{report_path}' run")
    if ran != profiled:
        raise BadInput(f"'{report_path}' ran {precision_label(*ran)} but '{profile_path}' was measured "
                       f"{precision_label(*profiled)}: calibrate with the profile the run's plan was made from")
    _check_stages(report["stages"], report_path)
    chunks = chunks_with_layers(report, report_path)
    index = {layer["name"]: i for i, layer in enumerate(profile["layers"])}
    for unit in (*report["stages"], *chunks):
        missing = [name for name in unit["layers"] if name not in index]
        if missing:
            raise BadInput(f"'{report_path}' stage {unit.get('stage', unit.get('index'))} runs layer {missing[0]!r}, "
                           f"which '{profile_path}' does not have: calibrate with the profile the plan was made from")
    spread = run_spread(report)
    speed = (report.get("speed") or {}).get("ratio") if use_speed_probe else None
    drift = speed if speed and speed > 0 else 1.0
    out = copy.deepcopy(profile)
    layers = out["layers"]
    measured_any = False
    # What plans charged between actions before this round: an earlier round's figure, else the
    # profile's own at the run's micro-batch size (fixed_costs.between_actions_s), which a
    # calibrated one replaces.
    previous_overhead = (profile.get("overhead") or {}).get("per_microbatch_s")
    profiled = profiled_at_run_size(profile, report)
    previous_charged = previous_overhead if previous_overhead is not None else \
        (profiled["between_actions_s"] if profiled is not None else None)
    # The plan's chunk times include the fixed costs it charged (the per-action overhead and,
    # from a version-9 profile, each kind's and each message's), some of which the run measures
    # in its spans and some between them: the layers' ratio is of what is left of both.
    sharing = plan_sharing(report, report_path)
    shared_cores = (sharing.slowdown, sharing.action_s)
    fixed = fixed_in_times(profile, report, shared_cores)

    ratios: list[Ratio] = []   # every ratio folded in, checked before the round is kept

    def ratio_of(unit: dict[str, Any], kind: str, predicted: float | None, what: str) -> float | None:
        """The unit's measured / predicted ``kind`` time with the drift divided out (None: not measured)."""
        measured = unit.get(timing_key("measured", kind))
        if not measured or not predicted or predicted <= 0:
            return None
        ratio = measured / drift / predicted
        ratios.append(Ratio(what, kind, ratio))
        return ratio

    stage_rounds = []
    planned = planned_optimizer_s(report, report_path)
    for stage in report["stages"]:
        predicted = stage.get(timing_key("predicted", "optimizer"))
        if predicted is None:
            predicted = planned.get(stage["index"])
        if predicted is None:
            # No plan at hand: the layers' figures as a plan charges them, the profile's factor
            # for the optimizer in a pipeline and the sharing of cores (not the neighbours' factor,
            # which only the plan records).
            predicted = sum(layers[index[n]].get("optimizer_s") or 0.0 for n in stage["layers"]) \
                * optimizer_scale(profile.get("fixed_costs")) * sharing.slowdown
        entry: dict[str, Any] = {"stage": stage["index"], "layers": stage["layers"]}
        if report.get("gradient_sync") == "fsdp":
            # Sharded (DTensor) optimizer steps are not the profile's plain ones: they would
            # rescale the layers' optimizer_s for every later plan. Left as profiled.
            entry["optimizer_scale_skipped"] = "fsdp run: sharded optimizer steps"
            stage_rounds.append(entry)
            continue
        ratio = ratio_of(stage, "optimizer", predicted, f"stage {stage['index']}")
        if ratio is not None:
            scale = shrink(ratio, spread)
            entry.update(optimizer_scale=scale, measured_optimizer_ratio=ratio)
            measured_any = True
            for name in stage["layers"]:
                layer = layers[index[name]]
                if layer.get("optimizer_s") is not None:
                    layer["optimizer_s"] = layer["optimizer_s"] * scale
        stage_rounds.append(entry)
    chunk_rounds = []
    for chunk in chunks:
        entry = {"chunk": chunk["index"], "stage": chunk["stage"], "layers": chunk["layers"]}
        for kind in ("forward", "backward"):
            predicted = chunk.get(timing_key("predicted", kind))
            measured = chunk.get(timing_key("measured", kind))
            if predicted and measured:
                in_prediction, in_span = fixed.of(chunk["index"], kind)
                predicted -= in_prediction
                measured = max(0.0, measured - in_span)     # 0: no layer time left to scale
            ratio = ratio_of({timing_key("measured", kind): measured}, kind, predicted, chunk["what"])
            if ratio is None:
                continue
            scale = shrink(ratio, spread)
            entry.update({f"{kind}_scale": scale, f"measured_{kind}_ratio": ratio})
            measured_any = True
            for name in chunk["layers"]:
                layer = layers[index[name]]
                for key in SCALED[kind]:
                    if layer.get(key) is not None:
                        layer[key] = [t * scale for t in layer[key]]
        chunk_rounds.append(entry)
    if not measured_any:
        raise BadInput(f"'{report_path}' has no per-stage measurements to calibrate with")
    forced = check_round(report, report_path, ratios, force, sharing.concurrent_ranks)
    overhead = measure_overhead(report, shared_cores)
    if overhead.per_microbatch_s is not None:
        out["overhead"] = {**(out.get("overhead") or {}), "per_microbatch_s": overhead.per_microbatch_s}
    history = list(profile.get("calibration") or [])
    history.append({
        "report": report_path,
        "report_sha256": report_sha256,
        "micro_batch_size": report.get("micro_batch_size"),
        "speed_ratio_divided_out": drift,
        "run_spread": spread,
        "stages": stage_rounds,
        "chunks": chunk_rounds,
        "overhead": overhead.record(previous_charged if overhead.per_microbatch_s is not None else previous_overhead),
        **({"forced": forced} if forced else {}),
    })
    out["calibration"] = history
    return out


# The layer times one measured ratio scales: the same pass under checkpointing (profiles that
# timed it) scales alike, and so do the backward's two halves, input (I) and weight (W).
SCALED = {
    "forward": ("forward_s", "recompute_forward_s"),
    "backward": ("backward_s", "recompute_backward_s", "backward_input_s", "backward_weight_s"),
}


def chunks_with_layers(report: dict[str, Any], report_path: str) -> list[dict[str, Any]]:
    """The report's chunks, each with its ``index``, ``stage``, ``layers``, predicted and measured
    forward and backward times, and ``what`` (how a message names it).

    A report before version 3 has none: each stage is one chunk. A version-3 report's chunk
    names its layers; where one does not, they are taken from the plan the report names. Either
    way the chunks of each stage must hold that stage's layers.
    """
    if report.get("chunks") is None:
        return [{**chunk, "what": f"stage {chunk['stage']}"} for chunk in report_chunks(report)]
    planned: tuple[ChunkPlan, ...] | None = None
    source = f"report '{report_path}'"
    if not all(chunk.get("layers") for chunk in report["chunks"]):
        plan_path = plan_of_report(report, report_path)
        source = f"plan '{plan_path}'"
        planned = read_plan(plan_path).chunks
    chunks = []
    for c, chunk in enumerate(report["chunks"]):
        elsewhere = planned is not None and (c >= len(planned) or chunk["stage"] != planned[c].stage)
        if chunk["index"] != c or elsewhere:
            raise BadInput(f"report '{report_path}': 'chunks[{c}]' is not chunk {c} of {source}: "
                           "calibrate with the plan the run ran")
        if chunk.get("layers"):
            layers = chunk["layers"]
        else:
            assert planned is not None       # read above: some chunk names no layers
            layers = list(planned[c].layers)
        chunks.append({**chunk, "layers": layers, "what": f"chunk {c} (stage {chunk['stage']})"})
    for k, stage in enumerate(report["stages"]):
        held = [name for chunk in chunks if chunk["stage"] == k for name in chunk["layers"]]
        if sorted(held) != sorted(stage["layers"]):
            raise BadInput(f"report '{report_path}': stage {k}'s layers are not those of its chunks in {source}: "
                           "calibrate with the plan the run ran")
    return chunks


@dataclass(frozen=True)
class PlanSharing:
    """Whether the run's plan had its ranks share the host's cores, and what it charged there."""

    concurrent_ranks: float | None = None   # the ranks the host ran at once; None: a core each
    slowdown: float = 1.0                   # every action's time charged this many times over
    action_s: float = 0.0                   # ... plus this


def plan_sharing(report: dict[str, Any], report_path: str) -> PlanSharing:
    """What the run's plan said of its ranks sharing cores. A version-6 report says; an older
    one's plan does, where it is at hand and unchanged; else a core per rank (as calibrate took
    every run before)."""
    if report.get("version", 0) >= 6:
        return PlanSharing(report.get("concurrent_ranks"), float(report.get("shared_core_slowdown") or 1.0),
                           float(report.get("shared_core_action_s") or 0.0))
    try:
        options = read_plan(plan_of_report(report, report_path)).options
    except BadInput:
        return PlanSharing()
    return PlanSharing(options.concurrent_ranks, options.shared_core_slowdown, options.shared_core_action_s)


def planned_optimizer_s(report: dict[str, Any], report_path: str) -> dict[int, float]:
    """Per stage, the optimizer step the run's plan predicted (its ``stages[k].optimizer_s``),
    where that plan is at hand, unchanged, and its stage holds the report's stage's layers; {}
    where not.

    A report gives no predicted optimizer time, and the layers' ``optimizer_s`` are not what a
    plan charges: it multiplies them by the profile's ``fixed_costs.optimizer_scale``, the
    neighbours' ``compute_scale`` and, on shared cores, ``shared_core_slowdown``. A ratio taken
    against the bare sum holds those factors, and the plans of the calibrated profile charge
    them again on top: on the 2-core VM a run whose optimizer took 1.16x its plan's prediction
    was folded in as 2.34x (the neighbours' 2.01x), and the next plan predicted it at about 4.7x."""
    try:
        plan = read_plan(plan_of_report(report, report_path))
    except BadInput:
        return {}
    by_stage = {stage["index"]: sorted(stage["layers"]) for stage in report["stages"]}
    chunk_layers = {chunk.index: chunk.layers for chunk in plan.chunks}
    planned = {}
    for stage in plan.stages:
        held = sorted(name for c in stage.chunks for name in chunk_layers.get(c, ()))
        if stage.optimizer_s is not None and by_stage.get(stage.index) == held:
            planned[stage.index] = stage.optimizer_s
    return planned


def plan_of_report(report: dict[str, Any], report_path: str) -> str:
    """The plan the report's run ran, as the report names it: found, and unchanged since."""
    return named_file(*recorded_file(report, "plan"), "plan", f"report '{report_path}'", report_path, "a run of plan",
                      hint="keep the plan beside the report: its chunks say which layers each measured time is for")


def _check_not_folded_in(profile: dict[str, Any], profile_path: str, report_path: str, digest: str) -> None:
    """Refuse a report the profile's rounds already hold (the same file, by its SHA-256): its
    ratios are of the predictions before that round, so folding it in again would scale the
    layers by them twice. ``--force`` or not: no run makes that right. ``digest``: the report's."""
    rounds = [r for r in profile.get("calibration") or [] if isinstance(r, dict)]
    for n, done in enumerate(rounds, 1):
        if done.get("report_sha256") == digest:
            raise BadInput(f"'{report_path}' is already folded into '{profile_path}' (its calibration round {n} of "
                           f"{len(rounds)}, from '{done.get('report')}'): a second time would scale its layers by that "
                           "run's ratios twice; to calibrate further, solve with this profile, run that plan and "
                           "calibrate with its report")


def _check_stages(stages: list[dict[str, Any]], report_path: str) -> None:
    """A report's stages are numbered 0, 1, ... in order and no layer runs in two of them
    (else one layer's times would be scaled twice, or by another stage's ratio)."""
    seen: set[str] = set()
    for k, stage in enumerate(stages):
        if stage["index"] != k:
            raise BadInput(f"report '{report_path}': 'stages[{k}].index' is {stage['index']}, expected {k}")
        for name in stage["layers"]:
            if name in seen:
                raise BadInput(f"report '{report_path}': layer {name!r} appears twice in its stages")
            seen.add(name)


def run_spread(report: dict[str, Any]) -> float | None:
    """The relative spread of a run's step times: their IQR / 1.349, over their median.

    Over the steps the report's medians count (all but the first the run made, which pays for
    warm-up). None when the report has fewer than ``hostload.SPREAD_VALUES`` of them (no spread
    worth the name: their ratios are then taken whole).
    """
    per_step = report.get("measured_step_s_per_step") or {}
    try:
        ordered = [float(per_step[k]) for k in sorted(per_step, key=int)]
    except (TypeError, ValueError):
        return None
    times = ordered[1:]
    if len(times) < SPREAD_VALUES or not all(t > 0 for t in times):
        return None
    # IQR / 1.349 estimates the standard deviation while ignoring a stray slow step, as a plain
    # standard deviation would not.
    return robust_spread(times) / statistics.median(times)


def shrink(ratio: float, spread: float | None) -> float:
    """A measured / predicted ratio shrunk toward 1 by the run's spread (positive-part James-Stein).

    ``1 + (ratio - 1) * max(0, 1 - spread^2 / (ratio - 1)^2)``: the share of the deviation that
    stands out from the run's own noise is kept. A deviation within the spread is taken for
    noise (no change); one far beyond it is kept nearly whole; a steady run (spread 0, or
    unknown) keeps the ratio as measured.
    """
    deviation = ratio - 1.0
    if not spread or deviation == 0.0:
        return ratio
    return 1.0 + deviation * max(0.0, 1.0 - (spread / deviation) ** 2)


def named_file(recorded_path: str | None, recorded_sha256: str | None, key: str, label: str, doc_path: str,
               relation: str, hint: str) -> str:
    """The ``key`` file an artifact at ``doc_path`` names (its recorded path and SHA-256), found
    and unchanged (``artifacts.locate`` by path and SHA-256); else one line ending in ``hint``."""
    if not recorded_path:
        raise BadInput(f"{label} does not name its {key}: {hint}")
    path = locate(recorded_path, doc_path, recorded_sha256)
    if path is None:
        raise BadInput(f"{label} is {relation} '{recorded_path}', which is gone: {hint}")
    if recorded_sha256 and file_sha256(path) != recorded_sha256:
        raise BadInput(f"{key} '{path}' has changed since {label} was made from it: {hint}")
    return path


def recorded_file(doc: dict[str, Any], key: str) -> tuple[str | None, str | None]:
    """The path and SHA-256 an artifact records of the file under ``key`` (a report's plan)."""
    recorded = doc.get(key) if isinstance(doc.get(key), dict) else {}
    return recorded.get("path"), recorded.get("sha256")
