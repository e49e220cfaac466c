"""Calibration: fold what a run measured back into the profile it was planned from.

A profile times each layer alone, on an otherwise idle machine. In a pipeline the same layers
run back to back with other micro-batches in flight, next to the other stages' processes, with
the runtime's own work per micro-batch: a stage often computes 10-40% slower than the sum of
its layers' profiled times (docs/benchmarks.md measures it). The run's report has, per stage,
the measured forward, backward and optimizer times at the plan's micro-batch size. Calibration
scales each layer's times by its stage's measured / predicted ratio, at every micro-batch size,
so that a second ``solve`` plans with what the pipeline really costs. Rounds compose: each is
recorded under ``calibration`` in the profile.

The report also says how fast the machine was during the run against the profile's moment
(``speed.ratio``, from a reference workload each rank ran alone). That would be the machine's
drift, not a property of the pipeline, if the reference tracked the model; a generic workload
does so poorly (two accuracy runs on the development VM, 192 and 288 runs: one calibration
round left the step 10.3% and 11.5% off in the median with the ratio divided out, 8.4% and
5.4% without). So by default the measured times are kept as they are; ``use_speed_probe``
divides the ratio out.

One run is one sample of a machine whose speed wanders (docs/runtime.md, "The machine's
speed"): folding a noisy run's ratios in whole once made the next prediction worse (-1% before,
+6% after). So each ratio is shrunk toward 1 by the run's own spread (:func:`shrink`): a stage
that ran 3% slow in a run whose steps spread by 5% is mostly noise and moves the profile a
little; one that ran 30% slow in the same run moves it almost all the way.

Pure JSON in, JSON out: no torch here.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

from ..artifacts import (PROFILE_FORMAT, REPORT_FORMAT, BadInput, file_sha256, precision_label, precision_of,
                         read_artifact)
from ..schema import validate

# A stage measured this far from its prediction is more likely a broken run than a slowdown.
PLAUSIBLE = (0.2, 5.0)


def calibrate(profile_path: str, report_path: str, use_speed_probe: bool = False) -> dict[str, Any]:
    """The profile at ``profile_path`` with its layer times scaled by the run in ``report_path``."""
    profile = read_artifact(profile_path, PROFILE_FORMAT)
    validate(profile, "profile", f"profile '{profile_path}'")
    report = read_artifact(report_path, REPORT_FORMAT)
    validate(report, "report", f"report '{report_path}'")   # from here on, every key has its type
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
    index = {layer["name"]: i for i, layer in enumerate(profile["layers"])}
    spread = run_spread(report)
    speed = (report.get("speed") or {}).get("ratio") if use_speed_probe else None
    drift = speed if speed and speed > 0 else 1.0
    out = copy.deepcopy(profile)
    rounds = []
    for stage in report["stages"]:
        missing = [name for name in stage["layers"] if name not in index]
        if missing:
            raise BadInput(f"'{report_path}' stage {stage.get('index')} runs layer {missing[0]!r}, which "
                           f"'{profile_path}' does not have: calibrate with the profile the plan was made from")
        scales: dict[str, float] = {}
        measured_ratios: dict[str, float] = {}
        for kind in ("forward", "backward", "optimizer"):
            measured = stage.get(f"measured_{kind}_s")
            predicted = stage.get(f"predicted_{kind}_s")
            if kind == "optimizer" and predicted is None:
                predicted = sum(profile["layers"][index[n]].get("optimizer_s") or 0.0 for n in stage["layers"])
            if not measured or not predicted:
                continue
            ratio = measured / drift / predicted
            if not PLAUSIBLE[0] <= ratio <= PLAUSIBLE[1]:
                raise BadInput(f"'{report_path}' stage {stage['index']} measured its {kind} {ratio:.2f}x the "
                               "prediction: that run looks broken (or its plan came from another profile); "
                               "not calibrating with it")
            scale = shrink(ratio, spread)
            scales[kind] = scale
            measured_ratios[kind] = ratio
            for name in stage["layers"]:
                layer = out["layers"][index[name]]
                if kind == "optimizer":
                    if layer.get("optimizer_s") is not None:
                        layer["optimizer_s"] = layer["optimizer_s"] * scale
                else:
                    # The same pass under checkpointing (profiles that timed it) scales alike.
                    for key in (f"{kind}_s", f"recompute_{kind}_s"):
                        if layer.get(key) is not None:
                            layer[key] = [t * scale for t in layer[key]]
        rounds.append({"stage": stage["index"], "layers": stage["layers"],
                       **{f"{k}_scale": v for k, v in scales.items()},
                       **{f"measured_{k}_ratio": v for k, v in measured_ratios.items()}})
    if not rounds:
        raise BadInput(f"'{report_path}' has no per-stage measurements to calibrate with")
    history = list(profile.get("calibration") or [])
    history.append({
        "report": report_path,
        "report_sha256": file_sha256(report_path),
        "micro_batch_size": report.get("micro_batch_size"),
        "speed_ratio_divided_out": drift,
        "run_spread": spread,
        "stages": rounds,
    })
    out["calibration"] = history
    return out


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


# The normal distribution's interquartile range in standard deviations: IQR / 1.349 estimates
# the standard deviation while ignoring a stray slow step, as a plain standard deviation would not.
IQR_PER_SIGMA = 1.349
# Fewer measured steps give no spread worth the name: their ratios are then taken whole.
MIN_STEPS_FOR_SPREAD = 4


def run_spread(report: dict[str, Any]) -> float | None:
    """The relative spread of a run's step times: their IQR / 1.349, over their median.

    Over the steps the report's medians count (all but the first the run made, which pays for
    warm-up). None when the report has fewer than ``MIN_STEPS_FOR_SPREAD`` of them.
    """
    per_step = report.get("measured_step_s_per_step") or {}
    try:
        ordered = [float(per_step[k]) for k in sorted(per_step, key=int)]
    except (TypeError, ValueError):
        return None
    times = ordered[1:]
    if len(times) < MIN_STEPS_FOR_SPREAD or not all(t > 0 for t in times):
        return None
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / IQR_PER_SIGMA / statistics.median(times)


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
