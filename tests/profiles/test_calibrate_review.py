"""gpipe-plan calibrate, as a user misuses it: the same report twice, and files that moved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpipe_plan.artifacts import file_sha256
from gpipe_plan.cli import main
from gpipe_plan.planner.command import solve_file

from helpers.calibration import profile_doc, report_doc


def solved(folder: Path) -> tuple[Path, Path, dict]:
    """A profile and a plan of it in ``folder``, the plan naming its profile as 'profile.json'
    (relative, as `solve profile.json` run there records it), and a report of a run of it that
    names the plan by its absolute path (as `run` records it)."""
    folder.mkdir(parents=True, exist_ok=True)
    profile = folder / "profile.json"
    profile.write_text(json.dumps(profile_doc()))
    plan = solve_file(str(profile), str(folder / "plan.json"), stages=2, micro_batches=4, schedule="gpipe")
    doc = json.loads((folder / "plan.json").read_text())
    doc["profile"]["path"] = "profile.json"
    (folder / "plan.json").write_text(json.dumps(doc))
    report = report_doc(plan, [1.3, 1.1], [1.2, 1.5], None)
    report["plan"] = {"path": str(folder / "plan.json"), "sha256": file_sha256(folder / "plan.json")}
    (folder / "report.json").write_text(json.dumps(report))
    return profile, folder / "report.json", plan


def calibrate(*args: str):
    return CliRunner().invoke(main, ["calibrate", *map(str, args)])


def test_a_report_already_folded_into_the_profile_is_refused_not_applied_twice(tmp_path: Path) -> None:
    """Round 1 wrote profile.calibrated.json; the same report again on that profile (its plan
    moved away, so the plan's record of its profile cannot say it is another) scaled every layer
    by the run's ratios a second time: 1.3 became 1.69."""
    profile, report, plan = solved(tmp_path)
    assert calibrate(report, "--profile", profile).exit_code == 0
    once = tmp_path / "profile.calibrated.json"
    (tmp_path / "plan.json").rename(tmp_path / "elsewhere.json")
    for force in ((), ("--force",)):
        result = calibrate(report, "--profile", once, "--out", tmp_path / "twice.json", *force)
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.output
        said = " ".join(result.output.split())
        assert f"'{report}' is already folded into '{once}' (its calibration round 1 of 1" in said, said
        assert "twice" in said and "Traceback" not in said
        assert not (tmp_path / "twice.json").exists()
    # a new run's report still composes with the round before
    again = solve_file(str(once), None, stages=2, micro_batches=4, schedule="gpipe")
    (tmp_path / "report2.json").write_text(json.dumps(report_doc(again, [2.0, 1.0], [1.0, 1.0], None)))
    assert calibrate(tmp_path / "report2.json", "--profile", once, "--out", tmp_path / "twice.json").exit_code == 0
    assert len(json.loads((tmp_path / "twice.json").read_text())["calibration"]) == 2


def test_a_folder_moved_whole_is_calibrated_from_the_plan_beside_its_report(tmp_path: Path, monkeypatch) -> None:
    """The report records its plan's absolute path; moved with its folder, the plan sat beside the
    report unchanged, yet calibrate said it 'is gone'."""
    solved(tmp_path / "run1")
    shutil.move(str(tmp_path / "run1"), str(tmp_path / "moved"))
    monkeypatch.chdir(tmp_path / "moved")
    result = calibrate("report.json")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "moved" / "profile.calibrated.json").exists()


def test_a_same_named_profile_in_the_current_folder_does_not_hide_the_one_beside_the_plan(
        tmp_path: Path, monkeypatch) -> None:
    """The plan names 'profile.json'; run from a folder holding another profile.json, calibrate
    took that one, and refused: 'has changed since', though the plan's own sat unchanged beside it
    (tune of the same plan found it)."""
    profile, report, _ = solved(tmp_path / "run")
    other = tmp_path / "other"
    other.mkdir()
    doc = json.loads(profile.read_text())
    doc["layers"][0]["forward_s"] = [t * 1.5 for t in doc["layers"][0]["forward_s"]]
    (other / "profile.json").write_text(json.dumps(doc))
    before = (other / "profile.json").read_text()
    monkeypatch.chdir(other)
    result = calibrate(report, "--out", other / "out.json")
    assert result.exit_code == 0, result.output
    # (rich wraps the long path wherever the width falls, mid-word too: compared without whitespace)
    assert f"calibrating'{profile}'" in "".join(result.output.split()), result.output
    assert json.loads((other / "out.json").read_text())["layers"][1]["forward_s"] != doc["layers"][1]["forward_s"]
    assert (other / "profile.json").read_text() == before
    # a profile that did change is still refused
    profile.write_text(json.dumps(doc))
    result = calibrate(report, "--out", other / "out2.json")
    assert result.exit_code == 2 and "has changed since" in result.output, result.output


def test_the_optimizer_ratio_is_against_what_the_plan_charged_not_the_bare_layer_figures(tmp_path: Path) -> None:
    """A plan charges each layer's optimizer_s times the neighbours' factor (compute_scale, here
    1.5; and the profile's optimizer_scale, where it has one); calibrate took its ratio against
    the bare sum, so a run whose optimizer took 1.2x the plan's prediction was folded in as 1.8x,
    and the next plan charged the factor again: 1.8x its first prediction instead of 1.2x."""
    doc = profile_doc()
    doc["contention"] = {"processes": 2, "threads_per_process": 1, "micro_batch_size": 4, "layer": "l0",
                         "alone_step_s": 0.01, "together_step_s": 0.015, "slowest_step_s": 0.015,
                         "cycle_ratios": [1.5, 1.5], "slowdown": 1.5, "spread": 0.0, "readings": 2}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc))
    plan = solve_file(str(profile), str(tmp_path / "plan.json"), stages=2, micro_batches=4, schedule="gpipe")
    assert plan["options"]["compute_scale"] > 1.0
    report = report_doc(plan, [1.0, 1.0], [1.0, 1.0], None)
    for stage in report["stages"]:
        stage["measured_optimizer_s"] *= 1.2
    report["plan"] = {"path": str(tmp_path / "plan.json"), "sha256": file_sha256(tmp_path / "plan.json")}
    (tmp_path / "report.json").write_text(json.dumps(report))
    result = calibrate(tmp_path / "report.json")
    assert result.exit_code == 0, result.output
    calibrated = json.loads((tmp_path / "profile.calibrated.json").read_text())
    assert [st["measured_optimizer_ratio"] for st in calibrated["calibration"][-1]["stages"]] == \
        [pytest.approx(1.2), pytest.approx(1.2)]
    again = solve_file(str(tmp_path / "profile.calibrated.json"), None, stages=2, micro_batches=4, schedule="gpipe")
    for before, after in zip(plan["stages"], again["stages"]):
        assert after["optimizer_s"] == pytest.approx(before["optimizer_s"] * 1.2)
