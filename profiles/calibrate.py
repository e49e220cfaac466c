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

Pure JSON in, JSON out: no torch here.
"""

from __future__ import annotations

import copy
from typing import Any

from ..artifacts import (PROFILE_FORMAT, REPORT_FORMAT, BadInput, file_sha256, precision_label, precision_of,
                         read_artifact)

# A stage measured this far from its prediction is more likely a broken run than a slowdown.
PLAUSIBLE = (0.2, 5.0)


def calibrate(profile_path: str, report_path: str, use_speed_probe: bool = False) -> dict[str, Any]:
    """The profile at ``profile_path`` with its layer times scaled by the run in ``report_path``."""
    profile = read_artifact(profile_path, PROFILE_FORMAT)
    report = read_artifact(report_path, REPORT_FORMAT)
    if report.get("model") != profile.get("model"):
        raise BadInput(f"'{report_path}' is a run of another model than '{profile_path}' profiles: "
                       "calibrate with the profile the run's plan was made from")
    profiled = precision_of(profile, f"profile '{profile_path}'")
    run = report.get("run") if isinstance(report.get("run"), dict) else {}
    ran = precision_of(run, f"report '{report_path}' run")
    if ran != profiled:
        raise BadInput(f"'{report_path}' ran {precision_label(*ran)} but '{profile_path}' was measured "
                       f"{precision_label(*profiled)}: calibrate with the profile the run's plan was made from")
    index = {layer["name"]: i for i, layer in enumerate(profile["layers"])}
    speed = (report.get("speed") or {}).get("ratio") if use_speed_probe else None
    drift = speed if speed and speed > 0 else 1.0
    out = copy.deepcopy(profile)
    rounds = []
    for stage in report.get("stages", []):
        missing = [name for name in stage.get("layers", []) if name not in index]
        if missing:
            raise BadInput(f"'{report_path}' stage {stage.get('index')} runs layer {missing[0]!r}, which "
                           f"'{profile_path}' does not have: calibrate with the profile the plan was made from")
        scales = {}
        for kind in ("forward", "backward", "optimizer"):
            measured = stage.get(f"measured_{kind}_s")
            predicted = stage.get(f"predicted_{kind}_s")
            if kind == "optimizer" and predicted is None:
                predicted = sum(profile["layers"][index[n]].get("optimizer_s") or 0.0 for n in stage["layers"])
            if not measured or not predicted:
                continue
            scale = measured / drift / predicted
            if not PLAUSIBLE[0] <= scale <= PLAUSIBLE[1]:
                raise BadInput(f"'{report_path}' stage {stage['index']} measured its {kind} {scale:.2f}x the "
                               "prediction: that run looks broken (or its plan came from another profile); "
                               "not calibrating with it")
            scales[kind] = scale
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
                       **{f"{k}_scale": v for k, v in scales.items()}})
    if not rounds:
        raise BadInput(f"'{report_path}' has no per-stage measurements to calibrate with")
    history = list(profile.get("calibration") or [])
    history.append({
        "report": report_path,
        "report_sha256": file_sha256(report_path),
        "micro_batch_size": report.get("micro_batch_size"),
        "speed_ratio_divided_out": drift,
        "stages": rounds,
    })
    out["calibration"] = history
    return out
