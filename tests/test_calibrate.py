"""gpipe-plan calibrate: a run's measured stage times folded back into its profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpipe_plan.artifacts import FORMAT_VERSIONS, PROFILE_FORMAT, REPORT_FORMAT, file_sha256
from gpipe_plan.cli import main
from gpipe_plan.plan_layout import plan_chunks
from gpipe_plan.planner.command import solve_file

from plan_docs import chunked_plan

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
    before_chunks, after_chunks = plan_chunks(plan, "plan"), plan_chunks(again, "plan")
    assert [c["layers"] for c in after_chunks] == [c["layers"] for c in before_chunks]
    for before, after, ff, bf in zip(before_chunks, after_chunks, [1.3, 1.1], [1.2, 1.5]):
        assert after["forward_s"] == pytest.approx(before["forward_s"] * ff)
        assert after["backward_s"] == pytest.approx(before["backward_s"] * bf)
    # every micro-batch size is scaled alike, and the round is on record
    first = before_chunks[0]["layers"][0]
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
    for before, after, ff in zip(plan_chunks(plan, "plan"), plan_chunks(again, "plan"), [1.3, 1.1]):
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


def chunked_run(tmp: Path, forward_factor: list[float], backward_factor: list[float]) -> tuple[Path, Path, dict]:
    """A zb-v plan of the test profile (2 stages, 4 chunks of one layer: stage 0 holds chunks 0
    and 3) and a version-3 report of a run in which chunk c ran its forward ``forward_factor[c]``
    and its backward (I + W) ``backward_factor[c]`` times the prediction."""
    doc = profile_doc()
    for layer in doc["layers"]:
        layer["name"] = layer["name"].replace("l", "layer")
        layer["backward_input_s"] = [t / 2 for t in layer["backward_s"]]
        layer["backward_weight_s"] = [t / 2 for t in layer["backward_s"]]
    profile = tmp / "profile.json"
    profile.write_text(json.dumps(doc))
    plan = chunked_plan("zb-v", 2, micro_batches=4)
    plan.update(model=doc["model"], profile={"path": "profile.json", "sha256": file_sha256(profile)})
    (tmp / "plan.json").write_text(json.dumps(plan))
    chunks = [{"index": c["index"], "stage": c["stage"],
               "predicted_forward_s": c["forward_s"], "measured_forward_s": c["forward_s"] * ff,
               "predicted_backward_s": c["backward_s"], "measured_backward_s": c["backward_s"] * bf,
               "predicted_backward_input_s": c["backward_input_s"],
               "measured_backward_input_s": c["backward_input_s"] * bf,
               "predicted_backward_weight_s": c["backward_weight_s"],
               "measured_backward_weight_s": c["backward_weight_s"] * bf}
              for c, ff, bf in zip(plan["chunks"], forward_factor, backward_factor)]
    stages = [{"index": k, "layers": [f"layer{c}" for c in st["chunks"]]} for k, st in enumerate(plan["stages"])]
    report = {"format": REPORT_FORMAT, "version": FORMAT_VERSIONS[REPORT_FORMAT], "model": doc["model"],
              "plan": {"path": "plan.json", "sha256": file_sha256(tmp / "plan.json")},
              "micro_batch_size": 1, "schedule": "zb-v", "stages": stages, "chunks": chunks}
    (tmp / "report.json").write_text(json.dumps(report))
    return profile, tmp / "report.json", report


def test_a_chunked_run_scales_each_chunks_layers_by_that_chunks_ratio(tmp_path: Path) -> None:
    """Stage 0 runs chunks 0 and 3: each keeps its own ratio, and I and W scale with B."""
    ff, bf = [1.3, 1.0, 1.0, 0.8], [1.2, 1.0, 1.5, 1.1]
    profile, report, _ = chunked_run(tmp_path, ff, bf)
    result = CliRunner().invoke(main, ["calibrate", str(report)])     # finds the profile through the plan
    assert result.exit_code == 0, result.output
    before = json.loads(profile.read_text())["layers"]
    after = json.loads((tmp_path / "profile.calibrated.json").read_text())
    for c, (old, new) in enumerate(zip(before, after["layers"])):
        assert new["forward_s"] == pytest.approx([t * ff[c] for t in old["forward_s"]])
        for key in ("backward_s", "backward_input_s", "backward_weight_s"):
            assert new[key] == pytest.approx([t * bf[c] for t in old[key]])
    record = after["calibration"][-1]
    assert [(ch["chunk"], ch["stage"], ch["layers"]) for ch in record["chunks"]] == \
        [(0, 0, ["layer0"]), (1, 1, ["layer1"]), (2, 1, ["layer2"]), (3, 0, ["layer3"])]
    assert [ch["forward_scale"] for ch in record["chunks"]] == pytest.approx(ff)


def test_a_chunked_run_without_its_chunks_layers_needs_the_plan_it_ran(tmp_path: Path) -> None:
    profile, report, doc = chunked_run(tmp_path, [1.0] * 4, [1.0] * 4)
    doc["chunks"][3]["stage"] = 1                                    # not where the plan put chunk 3
    report.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 2 and "'chunks[3]' is not chunk 3 of plan" in result.output
    doc["chunks"][3]["stage"] = 0
    report.write_text(json.dumps(doc))
    (tmp_path / "plan.json").unlink()
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 2 and "which is gone" in result.output and "\n" not in result.output.strip()
    assert not (tmp_path / "profile.calibrated.json").exists()
    # a report whose chunks name their layers needs no plan, but they must be its stages' layers
    for chunk, layers in zip(doc["chunks"], [["layer0"], ["layer1"], ["layer2"], ["layer3"]]):
        chunk["layers"] = layers
    report.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 0, result.output
    doc["chunks"][0]["layers"], doc["chunks"][1]["layers"] = ["layer1"], ["layer0"]
    report.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile),
                                       "--out", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "stage 0's layers are not those of its chunks" in result.output
