"""A profile and the report of a run of its plan, as calibration reads them."""

from __future__ import annotations

from gpipe_plan.plan_layout import plan_chunks
from gpipe_plan.schema import FORMAT_VERSIONS, PROFILE_FORMAT, REPORT_FORMAT

SIZES = [1, 2, 4]


def profile_doc() -> dict:
    layers = [{"name": f"l{i}", "forward_s": [1e-3 * b for b in SIZES], "backward_s": [2e-3 * b for b in SIZES],
               "activation_bytes": [100 * b for b in SIZES], "output_bytes": [10 * b for b in SIZES],
               "param_bytes": 1000, "optimizer_s": 1e-4} for i in range(4)]
    return {"format": PROFILE_FORMAT, "version": FORMAT_VERSIONS[PROFILE_FORMAT],
            "model": {"source": "builtin", "name": "gpt", "options": {}},
            "device": {"type": "cpu", "name": "test", "threads": 1, "speed_probe_s": 0.02},
            "micro_batch_sizes": SIZES, "batch_size": 4, "layers": layers}


def report_doc(plan: dict, forward_factor: list[float], backward_factor: list[float], speed_ratio: float | None) -> dict:
    """What a run of ``plan`` would report if each stage ran ``factor`` times its prediction
    and the machine as a whole ran at ``speed_ratio`` times the profile's time."""
    drift = speed_ratio or 1.0
    stages = []
    for ch, st, ff, bf in zip(plan_chunks(plan, "plan"), plan["stages"], forward_factor, backward_factor):
        stages.append({"index": ch["index"], "layers": ch["layers"], "recompute": ch["recompute"],
                       "predicted_forward_s": ch["forward_s"], "measured_forward_s": ch["forward_s"] * ff * drift,
                       "predicted_backward_s": ch["backward_s"], "measured_backward_s": ch["backward_s"] * bf * drift,
                       "measured_optimizer_s": st["optimizer_s"] * drift})
    return {"format": REPORT_FORMAT, "version": FORMAT_VERSIONS[REPORT_FORMAT], "model": plan["model"],
            "micro_batch_size": plan["micro_batch_size"], "predicted_step_s": plan["predicted"]["step_s"],
            "speed": {"ratio": speed_ratio}, "stages": stages}
