"""A run's report, as a run of a plan would write it, for the tests of what a trainer is told."""

from __future__ import annotations

import statistics

from gpipe_plan.plan_layout import plan_chunks
from gpipe_plan.runtime.report import headline
from gpipe_plan.schema import FORMAT_VERSIONS, REPORT_FORMAT


def report_doc(plan: dict, factor: float = 1.0, step_times: list[float] | None = None,
               speed_ratio: float | None = None, bubble: float = 0.2) -> dict:
    """What a run of ``plan`` reports if every chunk ran ``factor`` times its prediction."""
    predicted = plan["predicted"]["step_s"]
    times = step_times or [predicted * factor] * 8
    measured = statistics.median(times[1:])
    speed = {"ratio": speed_ratio, "per_rank_probe_s": {"0": [0.01, 0.01]}, "per_rank_probe_spread": {"0": [0.01, 0.01]},
             "predicted_step_s_at_run_speed": predicted * speed_ratio if speed_ratio else None}
    chunks = [{"index": c["index"], "stage": c["stage"], "layers": c["layers"], "recompute": c["recompute"],
               "predicted_forward_s": c["forward_s"], "measured_forward_s": c["forward_s"] * factor,
               "predicted_backward_s": c["backward_s"], "measured_backward_s": c["backward_s"] * factor}
              for c in plan_chunks(plan, "plan")]
    stages = [{"index": st["index"], "chunks": st["chunks"],
               "layers": [name for c in st["chunks"] for name in chunks[c]["layers"]],
               "measured_optimizer_s": None, "predicted_memory_bytes": st["memory_bytes"],
               "measured_peak_memory_bytes": st["memory_bytes"], "predicted_idle_fraction": st["idle_fraction"],
               "measured_idle_fraction": -0.001} for st in plan["stages"]]
    report = {"format": REPORT_FORMAT, "version": FORMAT_VERSIONS[REPORT_FORMAT],
              "plan": {"path": "plan.json", "sha256": None}, "model": plan["model"], "schedule": plan["schedule"],
              "num_stages": len(plan["stages"]), "micro_batches": plan["micro_batches"],
              "micro_batch_size": plan["micro_batch_size"], "global_batch_size": plan["global_batch_size"],
              "run": {}, "steps_run": len(times), "steps_measured": len(times) - 1,
              "predicted_step_s": predicted, "measured_step_s": measured, "step_time_ratio": measured / predicted,
              "speed": speed, "measured_step_s_per_step": {str(i): t for i, t in enumerate(times)},
              "predicted_bubble_fraction": plan["predicted"]["bubble_fraction"], "measured_bubble_fraction": bubble,
              "predicted_samples_per_s": None, "samples_per_s": 100.0, "tokens_per_s": None,
              "loss": {"first": 5.5, "last": 2.5, "per_step": {str(i): 5.5 - 3 * i / 7 for i in range(8)}},
              "stages": stages, "chunks": chunks}
    report["headline"] = headline(predicted, plan["predicted"].get("noise_sources"), speed, measured)
    return report
