"""gpipe-plan calibrate: a run's measured stage times folded back into its profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpipe_plan.artifacts import file_sha256
from gpipe_plan.cli import main
from gpipe_plan.plan_layout import plan_chunks
from gpipe_plan.planner.command import solve_file
from gpipe_plan.profiles.overhead import measure_overhead
from gpipe_plan.schema import FORMAT_VERSIONS, REPORT_FORMAT

from helpers.plan_docs import chunked_plan
from helpers.calibration import profile_doc, report_doc, SIZES


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
    assert result.exit_code == 2 and "40.00x the prediction" in result.output and "--force" in result.output
    assert not (tmp / "profile.calibrated.json").exists()
    # a run of another model is refused even with --force: no run can make it this profile's
    report.write_text(json.dumps(other))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile), "--force"])
    assert result.exit_code == 2 and "another model" in result.output
    result = CliRunner().invoke(main, ["calibrate", str(tmp / "absent.json"), "--profile", str(profile)])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_a_run_whose_speed_probe_cannot_be_trusted_is_folded_in_with_a_note(files):
    """The run's own headline could not trust its probe (the machine's speed moved during it): the
    ratios may be the machine's as much as the model's, and calibrate says so; a trusted or absent
    probe says nothing."""
    tmp, profile, plan = files
    report = tmp / "report.json"
    doc = report_doc(plan, [1.3, 1.2], [1.3, 1.2], None)
    doc["headline"] = {"predicted_step_s": plan["predicted"]["step_s"], "basis": "profile", "noise_fraction": 0.1,
                       "step_time_ratio": 1.25, "within_noise": False, "at_run_speed": None,
                       "speed_left_out": "its readings before and after training differ by ±14%", "host_busy": None}
    report.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert ("note: the run's speed probe cannot be trusted (its readings before and after training differ by "
            "±14%): the machine's speed may have moved these ratios") in said
    for left_out in (None, "no speed probe"):
        doc["headline"]["speed_left_out"] = left_out
        report.write_text(json.dumps(doc))
        result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile), "--out",
                                           str(tmp / "again.json")])
        assert result.exit_code == 0, result.output
        assert "cannot be trusted" not in result.output


def test_calibrate_never_writes_over_the_profile_or_plan_the_report_leads_to(files):
    # (found through the report, they were not inputs: --out profile.json replaced the measured profile)
    tmp, profile, plan = files
    report = tmp / "report.json"
    doc = report_doc(plan, [1.0, 1.0], [1.0, 1.0], None)
    doc["plan"] = {"path": str(tmp / "plan.json"), "sha256": file_sha256(tmp / "plan.json")}
    report.write_text(json.dumps(doc))
    before = {p: file_sha256(p) for p in (profile, tmp / "plan.json")}
    for target in before:
        result = CliRunner().invoke(main, ["calibrate", str(report), "--out", str(target), "--force"])
        assert result.exit_code == 2, result.output
        assert f"cannot write --out '{target}': it is the file this command reads" in result.output
    assert {p: file_sha256(p) for p in before} == before
    # --profile is read as a profile: a missing one or a plan is named as such, not as a checksum
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(tmp / "missing.json")])
    assert result.exit_code == 2 and f"profile '{tmp / 'missing.json'}' does not exist" in result.output
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(tmp / "plan.json")])
    assert result.exit_code == 2 and "is not a gpipe-plan profile" in result.output and "(it is a plan)" in result.output
    result = CliRunner().invoke(main, ["calibrate", str(report), "--out", str(tmp / "c.json"), "--force"])
    assert result.exit_code == 0 and (tmp / "c.json").exists(), result.output


def busy(other_cores: float, cores: int = 2, needed: int = 2) -> dict:
    """A report's ``host_load`` (version 5) of one host whose other processes used ``other_cores``."""
    host = {"host": "vm", "cores": cores, "ranks": [0, 1], "needed_cores": needed, "run_cores": 1.0,
            "other_cores": other_cores, "steal_cores": 0.0, "window_s": 30.0,
            "contended_cores": max(0.0, min(other_cores, other_cores + needed - cores))}
    return {"window_s": 30.0, "other_cores": other_cores, "contended_cores": host["contended_cores"], "hosts": [host]}


def test_a_slow_run_on_a_busy_host_is_refused_with_the_measured_load_and_force_folds_it_in(files):
    """Issue 31, item 1: "stage 0 measured its optimizer 6.74x the prediction: that run looks broken"."""
    tmp, profile, plan = files
    report = tmp / "report.json"
    doc = report_doc(plan, [1.5, 1.4], [1.6, 1.3], None)
    doc["stages"][0]["measured_optimizer_s"] *= 6.74
    doc["host_load"] = busy(1.6)
    report.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert "other processes used 1.60 of the 2 cores during the run (the run needed 2)" in line
    assert "up to 6.74x the prediction, stage 0's optimizer" in line and "is that load, not the model's cost" in line
    assert "rerun on a quiet machine, or pass --force" in line and "broken" not in line
    assert not (tmp / "profile.calibrated.json").exists()
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile), "--force"])
    assert result.exit_code == 0, result.output
    assert "--force: folded in although other processes used 1.60" in result.output
    round_ = json.loads((tmp / "profile.calibrated.json").read_text())["calibration"][-1]
    busy_note, outside_note = round_["forced"]       # the load, and the 6.74x beyond 0.2-5x it explains
    assert busy_note.startswith("other processes used 1.60")
    assert outside_note.startswith("stage 0 measured its optimizer 6.74x") and "the busy host's load explains" in outside_note
    assert round_["stages"][0]["measured_optimizer_ratio"] == pytest.approx(6.74)
    # let through without --force: a busy host that did not slow the run, a quiet one, and one
    # of 64 cores with room beside the run for the others' 10
    for load, factor in ((busy(1.6), 1.02), (busy(0.1), 1.5), (busy(10.0, cores=64), 1.5)):
        doc = report_doc(plan, [factor, factor], [factor, factor], None)
        doc["host_load"] = load
        report.write_text(json.dumps(doc))
        result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
        assert result.exit_code == 0, (load, result.output)
        assert "forced" not in json.loads((tmp / "profile.calibrated.json").read_text())["calibration"][-1]


@pytest.mark.parametrize("speed, load, said", [
    (None, None, "neither the host (the report, from before report version 5, does not record the host's load) "
                 "nor the machine's speed (no speed probe) explains it"),
    (None, "quiet", "neither the host (other processes used 0.05 cores) nor the machine's speed"),
    (8.0, "quiet", "as the machine ran at 8.00x the profile's time (speed probe): profile again on this machine"),
])
def test_an_implausible_ratio_is_refused_with_what_explains_it(files, speed, load, said):
    tmp, profile, plan = files
    report = tmp / "report.json"
    doc = report_doc(plan, [40.0, 1.0], [1.0, 1.0], None)
    doc["speed"] = {"ratio": speed}
    if load:
        doc["host_load"] = busy(0.05)
    report.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 2 and said in result.output, result.output
    assert "stage 0 measured its forward 40.00x the prediction, beyond the 0.2-5x" in result.output
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile), "--force"])
    assert result.exit_code == 0 and "--force: folded in although stage 0 measured" in result.output


def test_calibrate_never_writes_over_the_profile_it_reads(files):
    """The plan names its profile by SHA-256: calibrating in place would orphan every plan made from it."""
    tmp, profile, plan = files
    report = tmp / "report.json"
    report.write_text(json.dumps(report_doc(plan, [1.3, 1.1], [1.2, 1.5], speed_ratio=None)))
    before = profile.read_text()
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile), "--out", str(profile)])
    assert result.exit_code == 2 and "--out" in result.output and len(result.output.strip().splitlines()) == 1
    assert profile.read_text() == before


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


# --------------------------------------------------------------------------- per-action overhead
def flat(output: str) -> str:
    """The command's output on one line (the console wraps at its width)."""
    return " ".join(output.split())


def with_gaps(report: dict, step_s: float, per_action_s: list[float], actions: int,
              gradient_sync_s: float = 0.0, other_s: float = 0.0) -> dict:
    """``report`` with a step of ``step_s`` in which stage k spent ``per_action_s[k]`` between
    each of its ``actions`` actions, ``gradient_sync_s`` syncing gradients, ``other_s`` in the
    step's other spans, waited 10% of the step, and was busy the rest."""
    report = {**report, "measured_step_s": step_s, "schedule": report.get("schedule", "gpipe"), "num_stages": 2,
              "micro_batches": 4}
    stages = []
    for stage, gap in zip(report["stages"], per_action_s):
        wait = 0.1 * step_s
        busy = step_s - wait - gap * actions - gradient_sync_s - other_s
        stages.append({**stage, "measured_busy_s": busy, "measured_wait_s": wait,
                       "measured_gradient_sync_s": gradient_sync_s, "measured_other_s": other_s})
    return {**report, "stages": stages}


def test_calibrate_learns_the_per_action_overhead_from_the_steps_gaps(files):
    """A gpipe run, K = 2, M = 4: 8 actions per stage (4 F, 4 B). Stage 0 spent 0.4 ms between
    actions, stage 1 0.6 ms: the profile learns the median, 0.5 ms, and says how it got it."""
    tmp, profile, plan = files
    report = tmp / "report.json"
    report.write_text(json.dumps(with_gaps(report_doc(plan, [1.0, 1.0], [1.0, 1.0], None), 0.05,
                                           [0.4e-3, 0.6e-3], actions=8, gradient_sync_s=0.004, other_s=0.002)))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 0, result.output
    calibrated = json.loads((tmp / "profile.calibrated.json").read_text())
    assert calibrated["overhead"]["per_microbatch_s"] == pytest.approx(0.5e-3)
    record = calibrated["calibration"][-1]["overhead"]
    assert record["measured"] and [g["actions"] for g in record["stages"]] == [8, 8]
    assert [g["per_action_s"] for g in record["stages"]] == pytest.approx([0.4e-3, 0.6e-3])
    assert "per-action overhead: 0.500 ms (was none)" in flat(result.output)
    assert "stage 0 0.400 ms over 8 actions, stage 1 0.600 ms over 8 actions" in flat(result.output)
    # the next plan charges it on each forward and backward of a pipeline
    again = solve_file(str(tmp / "profile.calibrated.json"), None, stages=2, micro_batches=4, schedule="gpipe")
    for before, after in zip(plan_chunks(plan, "plan"), plan_chunks(again, "plan")):
        assert after["forward_s"] == pytest.approx(before["forward_s"] + 0.5e-3)
        assert after["backward_s"] == pytest.approx(before["backward_s"] + 0.5e-3)


def test_the_overhead_it_replaces_is_the_profiles_cost_between_actions(tmp_path: Path):
    """A version-9 profile charged its fixed cost between actions (0.020 ms) until calibrated:
    that is what the round says it was, not "none"."""
    doc = profile_doc()
    doc["fixed_costs"] = {"forward_s": 0.0, "backward_s": 0.0, "backward_input_s": 0.0, "backward_weight_s": 0.0,
                          "send_s": 0.0, "receive_s": 0.0, "between_actions_s": 2e-5}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc))
    plan = solve_file(str(profile), str(tmp_path / "plan.json"), stages=2, micro_batches=4, schedule="gpipe")
    report = tmp_path / "report.json"
    report.write_text(json.dumps(with_gaps(report_doc(plan, [1.0, 1.0], [1.0, 1.0], None), 0.05,
                                           [0.4e-3, 0.6e-3], actions=8)))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 0, result.output
    assert "per-action overhead: 0.500 ms (was 0.020 ms)" in flat(result.output)
    record = json.loads((tmp_path / "profile.calibrated.json").read_text())["calibration"][-1]["overhead"]
    assert record["previous_per_microbatch_s"] == 2e-5


def test_a_stage_that_ran_faster_than_its_spans_add_up_counts_as_no_overhead(files):
    tmp, profile, plan = files
    report = tmp / "report.json"
    report.write_text(json.dumps(with_gaps(report_doc(plan, [1.0, 1.0], [1.0, 1.0], None), 0.05,
                                           [-0.2e-3, 0.6e-3], actions=8)))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 0, result.output
    calibrated = json.loads((tmp / "profile.calibrated.json").read_text())
    assert calibrated["overhead"]["per_microbatch_s"] == pytest.approx(0.3e-3)   # median of 0 and 0.6 ms


def test_a_report_without_the_step_gaps_leaves_the_overhead_and_says_so(tmp_path: Path):
    doc = profile_doc()
    doc["overhead"] = {"per_microbatch_s": 0.2e-3}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc))
    plan = solve_file(str(profile), str(tmp_path / "plan.json"), stages=2, micro_batches=4, schedule="gpipe")
    report = tmp_path / "report.json"
    report.write_text(json.dumps(report_doc(plan, [1.0, 1.0], [1.0, 1.0], None)))   # no step, busy or wait
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile)])
    assert result.exit_code == 0, result.output
    assert "per-action overhead not measured: the report has no measured step time; left as it was (0.200 ms)" \
        in flat(result.output)
    calibrated = json.loads((tmp_path / "profile.calibrated.json").read_text())
    assert calibrated["overhead"] == {"per_microbatch_s": 0.2e-3}
    assert calibrated["calibration"][-1]["overhead"]["measured"] is False
    # with the step but not a stage's waits it cannot tell either
    partial = report_doc(plan, [1.0, 1.0], [1.0, 1.0], None)
    partial.update(measured_step_s=0.05, schedule="gpipe", num_stages=2, micro_batches=4)
    report.write_text(json.dumps(partial))
    result = CliRunner().invoke(main, ["calibrate", str(report), "--profile", str(profile), "--out",
                                       str(tmp_path / "x.json")])
    assert result.exit_code == 0, result.output
    assert "does not give stage 0's busy and waiting time" in flat(result.output)
    assert json.loads((tmp_path / "x.json").read_text())["overhead"] == {"per_microbatch_s": 0.2e-3}


def test_the_layers_ratio_leaves_out_the_overhead_the_prediction_included(tmp_path: Path):
    """A profile with a 1 ms per-action overhead: the plan predicts layers + 1 ms per forward. A
    run whose forward spans took exactly the layers' time ran them as profiled: scale 1, not
    (layers / (layers + 1 ms)), or a second round would shrink the layers for what is overhead."""
    doc = profile_doc()
    doc["overhead"] = {"per_microbatch_s": 1e-3}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc))
    plan = solve_file(str(profile), str(tmp_path / "plan.json"), stages=2, micro_batches=4, schedule="gpipe")
    report = report_doc(plan, [1.0, 1.0], [1.0, 1.0], None)
    for stage in report["stages"]:
        stage["measured_forward_s"] = stage["predicted_forward_s"] - 1e-3
        stage["measured_backward_s"] = stage["predicted_backward_s"] - 1e-3
    (tmp_path / "report.json").write_text(json.dumps(report))
    result = CliRunner().invoke(main, ["calibrate", str(tmp_path / "report.json"), "--profile", str(profile)])
    assert result.exit_code == 0, result.output
    calibrated = json.loads((tmp_path / "profile.calibrated.json").read_text())
    assert [layer["forward_s"] for layer in calibrated["layers"]] == [layer["forward_s"] for layer in doc["layers"]]
    assert [ch["forward_scale"] for ch in calibrated["calibration"][-1]["chunks"]] == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("schedule, virtual_stages, actions", [
    ("gpipe", 1, 8),          # 4 F + 4 B
    ("zb-h1", 1, 12),         # 4 F + 4 I + 4 W
    ("interleaved", 3, 24),   # 3 chunks x (4 F + 4 B)
    ("zb-v", 2, 24),          # 2 chunks x (4 F + 4 I + 4 W)
])
def test_overhead_counts_the_actions_each_stage_runs(schedule: str, virtual_stages: int, actions: int) -> None:
    report = {"measured_step_s": 0.1, "schedule": schedule, "num_stages": 2, "micro_batches": 4,
              "virtual_stages": virtual_stages,
              "stages": [{"index": k, "measured_busy_s": 0.08, "measured_wait_s": 0.01 * k} for k in range(2)]}
    measured = measure_overhead(report)
    assert [g.actions for g in measured.stages] == [actions, actions]
    assert [g.outside_s for g in measured.stages] == pytest.approx([0.02, 0.01])
    assert measured.per_microbatch_s == pytest.approx((0.02 / actions + 0.01 / actions) / 2)
