"""gpipe-plan calibrate: a run's measured stage times folded back into its profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpipe_plan.artifacts import FORMAT_VERSIONS, PROFILE_FORMAT, REPORT_FORMAT
from gpipe_plan.cli import main
from gpipe_plan.planner.command import solve_file

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
    for st, ff, bf in zip(plan["stages"], forward_factor, backward_factor):
        stages.append({"index": st["index"], "layers": st["layers"], "recompute": st["recompute"],
                       "predicted_forward_s": st["forward_s"], "measured_forward_s": st["forward_s"] * ff * drift,
                       "predicted_backward_s": st["backward_s"], "measured_backward_s": st["backward_s"] * bf * drift,
                       "measured_optimizer_s": st["optimizer_s"] * drift})
    return {"format": REPORT_FORMAT, "version": FORMAT_VERSIONS[REPORT_FORMAT], "model": plan["model"],
            "micro_batch_size": plan["micro_batch_size"], "predicted_step_s": plan["predicted"]["step_s"],
            "speed": {"ratio": speed_ratio}, "stages": stages}


@pytest.fixture()
def files(tmp_path: Path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_doc()))
    plan = solve_file(str(profile), str(tmp_path / "plan.json"), stages=2, micro_batches=4, schedule="gpipe")
    return tmp_path, profile, plan


def test_calibrated_profile_predicts_what_was_measured(files):
    tmp, profile, plan = files
    report = tmp / "report.json"
    report.write_text(json.dumps(report_doc(plan, [1.3, 1.1], [1.2, 1.5], speed_ratio=1.25)))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile), "--speed-correction"])
    assert result.exit_code == 0, result.output
    calibrated = json.loads((tmp / "profile.calibrated.json").read_text())
    # Re-plan the same partition with the calibrated profile: each stage now predicts what the
    # run measured, with the machine's drift (1.25) divided out.
    again = solve_file(str(tmp / "profile.calibrated.json"), None, stages=2, micro_batches=4, schedule="gpipe")
    assert [s["layers"] for s in again["stages"]] == [s["layers"] for s in plan["stages"]]
    for before, after, ff, bf in zip(plan["stages"], again["stages"], [1.3, 1.1], [1.2, 1.5]):
        assert after["forward_s"] == pytest.approx(before["forward_s"] * ff)
        assert after["backward_s"] == pytest.approx(before["backward_s"] * bf)
    # every micro-batch size is scaled alike, and the round is on record
    first = plan["stages"][0]["layers"][0]
    layer = next(layer for layer in calibrated["layers"] if layer["name"] == first)
    assert layer["forward_s"] == pytest.approx([1.3e-3 * b for b in SIZES])
    assert calibrated["calibration"][-1]["speed_ratio_divided_out"] == pytest.approx(1.25)
    # a second round composes with the first
    report.write_text(json.dumps(report_doc(again, [2.0, 1.0], [1.0, 1.0], speed_ratio=None)))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(tmp / "profile.calibrated.json"),
                                       "--out", str(tmp / "twice.json")])
    assert result.exit_code == 0, result.output
    twice = json.loads((tmp / "twice.json").read_text())
    layer = next(layer for layer in twice["layers"] if layer["name"] == first)
    assert layer["forward_s"] == pytest.approx([2.6e-3 * b for b in SIZES])
    assert len(twice["calibration"]) == 2


def test_by_default_calibration_keeps_the_runs_speed(files):
    """Without --speed-correction the times are taken as measured, drift and all."""
    tmp, profile, plan = files
    report = tmp / "report.json"
    report.write_text(json.dumps(report_doc(plan, [1.3, 1.1], [1.2, 1.5], speed_ratio=1.25)))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 0, result.output
    assert "divided out" not in result.output
    again = solve_file(str(tmp / "profile.calibrated.json"), None, stages=2, micro_batches=4, schedule="gpipe")
    for before, after, ff in zip(plan["stages"], again["stages"], [1.3, 1.1]):
        assert after["forward_s"] == pytest.approx(before["forward_s"] * ff * 1.25)
    calibrated = json.loads((tmp / "profile.calibrated.json").read_text())
    assert calibrated["calibration"][-1]["speed_ratio_divided_out"] == 1.0


def test_calibrate_refuses_a_report_of_another_model_or_a_broken_run(files):
    tmp, profile, plan = files
    report = tmp / "report.json"
    other = report_doc(plan, [1.0, 1.0], [1.0, 1.0], None)
    other["model"] = {"source": "builtin", "name": "resnet", "options": {}}
    report.write_text(json.dumps(other))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 2 and "another model" in result.output
    report.write_text(json.dumps(report_doc(plan, [40.0, 1.0], [1.0, 1.0], None)))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 2 and "looks broken" in result.output
    assert not (tmp / "profile.calibrated.json").exists()
    result = CliRunner().invoke(main, ["calibrate", str(tmp / "absent.json"), "--profile", str(profile)])
    assert result.exit_code == 2 and "does not exist" in result.output
