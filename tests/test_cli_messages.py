"""What a trainer is told (issue 19, items 3, 4, 6, 7, 8): which batch a plan is for, whether pipelining
pays, one headline prediction and a calibration that does not overfit a noisy run, what the
terminal shows, and the demo's text."""

from __future__ import annotations

import io
import json
import math
import re
import statistics
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress, TimeRemainingColumn

from gpipe_plan.artifacts import BadInput
from gpipe_plan.plan_view import Prediction, view_of
from gpipe_plan.planner.command import CountColumn, solve_file
from gpipe_plan.planner.explore import explore
from gpipe_plan.planner.explore_view import exploration_chart, never_fitting
from gpipe_plan.planner.profile import Profile
from gpipe_plan.planner.render import one_device_line, plan_timeline_svg
from gpipe_plan.planner.timeline import WIDTH
from gpipe_plan.units import format_percent
from gpipe_plan.profiles.calibrate import calibrate, run_spread, shrink
from gpipe_plan.profiles.command import PhaseLines, _Bar, _progress_for, intended_global_batch, phase_of
from gpipe_plan.profiles.show import render_profile
from gpipe_plan.runtime.progress import TrainingProgress, fit_fields
from gpipe_plan.runtime.report import headline, print_summary, step_line
from gpipe_plan.schema import FORMAT_VERSIONS, PLAN_FORMAT, PROFILE_FORMAT

from helpers.planner import cli, profile_doc, write_json
from helpers.reports import report_doc

pytestmark = pytest.mark.filterwarnings("ignore:.*PuLP 4:DeprecationWarning")

CURRENT = FORMAT_VERSIONS[PROFILE_FORMAT]


def balanced(L: int = 6, **extra) -> dict:
    """Identical layers, times linear in the micro-batch size: a model pipelining suits."""
    return profile_doc(L=L, sizes=(1, 2, 4, 8), batch_size=8, forward_per_sample=[1e-3] * L,
                       backward_per_sample=[2e-3] * L, activation_per_sample=[1000] * L,
                       output_per_sample=[100] * L, param_bytes=[4000] * L, version=CURRENT, **extra)


# =========================================================================== 3. which batch?
def test_profile_global_batch_defaults_to_the_largest_size_measured() -> None:
    assert intended_global_batch(None, [1, 2, 4, 16]) == 16
    assert intended_global_batch(48, [1, 2, 4]) == 48     # need not be a measured size
    for bad in (0, 2 ** 40 + 1):
        with pytest.raises(BadInput, match="--global-batch-size must be a whole number of samples from 1 to 2"):
            intended_global_batch(bad, [1, 2])


@pytest.mark.parametrize("command", ["solve", "explore"])
def test_a_global_batch_past_2_to_the_40_is_refused_at_once(user_dir: Path, command: str) -> None:
    # (it was searched for divisors, for minutes, at 10^18)
    write_json(user_dir / "profile.json", balanced())
    result = cli(command, "profile.json", "--stages", "2", "--global-batch-size", str(10 ** 18))
    assert result.exit_code == 2, result.output
    assert "--global-batch-size must be a whole number of samples from 1 to 2^40, got 1000000000000000000" in result.output


def test_solve_and_explore_plan_for_the_profiles_global_batch(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", balanced(global_batch_size=32))
    result = cli("solve", "profile.json", "-k", "2", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("plan.json").read_text())
    assert plan["global_batch_size"] == 32 and plan["options"]["global_batch_size_source"] == "profile"
    first = result.stdout.splitlines()[0]
    assert f"global batch 32 = {plan['micro_batches']} micro-batch" in first
    assert f"of {plan['micro_batch_size']}" in first and plan["micro_batches"] * plan["micro_batch_size"] == 32
    assert "note:" not in result.stdout      # the batch is the one the user recorded
    # --global-batch-size still wins
    assert cli("solve", "profile.json", "-k", "2", "-b", "16", "--out", "p16.json").exit_code == 0
    assert json.loads(Path("p16.json").read_text())["options"]["global_batch_size_source"] == "option"
    assert json.loads(Path("p16.json").read_text())["global_batch_size"] == 16
    assert explore(Profile(balanced(global_batch_size=32)), [1, 2]).global_batch_size == 32


def test_older_profiles_keep_todays_batch_and_solve_says_where_it_came_from(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", balanced())      # no global_batch_size: batch_size 8
    result = cli("solve", "profile.json", "-k", "2", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("plan.json").read_text())
    assert plan["global_batch_size"] == 8 and plan["options"]["global_batch_size_source"] == "largest micro-batch"
    assert "global batch 8 = " in result.stdout.splitlines()[0]
    assert "give --global-batch-size" in result.stdout
    assert explore(Profile(balanced()), [1, 2]).global_batch_size == 8


def test_profile_command_records_the_global_batch_and_reports_phases_without_a_terminal(user_dir: Path) -> None:
    """A real (tiny) profile: the key is written, and stderr, not a terminal, gets one line per phase.
    ``-b`` is ``--global-batch-size`` here as in solve and explore (not the largest micro-batch)."""
    result = cli("profile", "gpt", "--layers", "1", "--width", "16", "--heads", "2", "--seq-len", "8",
                 "--micro-batch-sizes", "1,2", "--repeats", "1", "--warmup", "0", "--contention-processes", "0",
                 "--no-recompute-timing", "--no-fixed-costs", "-b", "6", "--out", "tiny.json")
    assert result.exit_code == 0, result.output
    assert json.loads(Path("tiny.json").read_text())["global_batch_size"] == 6
    lines = result.stderr.splitlines()
    phases = [re.sub(r"^profiling \[[ \d?%]+, +\d+ s\] ", "", line) for line in lines]
    assert all(line.startswith("profiling [") for line in lines), lines
    # each phase once, in the order it began (how the profiler orders its rounds is its own affair):
    # the phase lines before any unit of work (profiles/phases.py), then the units'
    assert phases[0] == "building model 'gpt'" and phases[1] == "checking the 3 layers on a micro-batch", lines
    assert phases[2] == "measuring 3 layers at sizes 1,2: memory, then 1 timed round", lines
    assert phases[3:6] == ["embed", "block0", "head"] and "whole model" in phases and phases[-1] == "done", lines
    assert len(set(phases)) == len(phases), lines
    assert "global batch    6" in result.stdout


# =========================================================================== 4. is pipelining worth it?
def test_plan_compares_itself_with_the_best_one_device_plan(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", balanced(global_batch_size=8))
    plan = solve_file("profile.json", "plan.json", stages=2, micro_batches=8)
    one = solve_file("profile.json", None, stages=1)            # the same options, one stage, M open
    pred = plan["predicted"]
    assert pred["one_stage_fits"] is True
    assert pred["one_stage_step_s"] == pytest.approx(one["predicted"]["step_s"])
    assert pred["one_stage_peak_memory_bytes"] == one["predicted"]["peak_memory_bytes"]
    assert pred["speedup_over_one_stage"] == pytest.approx(one["predicted"]["step_s"] / pred["step_s"])
    assert pred["speedup_over_one_stage"] > 1.3                 # balanced layers, 8 micro-batches
    assert plan["version"] == FORMAT_VERSIONS[PLAN_FORMAT] == 11
    shown = cli("show", "plan.json")
    assert shown.exit_code == 0, shown.output
    assert f"{pred['speedup_over_one_stage']:.2f}x faster than one device" in shown.stdout
    # a one-stage plan is its own baseline and says nothing about pipelining
    assert one["predicted"]["speedup_over_one_stage"] == 1.0
    assert one_device_line(view_of(one).predicted, 1) is None


def test_when_one_device_is_faster_solve_says_so(user_dir: Path) -> None:
    """Stages that slow each other down 2x (measured contention) lose to one device."""
    contention = {"processes": 2, "slowdown": 2.0, "cycle_ratios": [2.0] * 9}
    write_json(user_dir / "profile.json", balanced(contention=contention))
    result = cli("solve", "profile.json", "-k", "2", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    pred = json.loads(Path("plan.json").read_text())["predicted"]
    assert pred["speedup_over_one_stage"] < 1.0
    assert "one device is faster" in result.stdout and "pipelining does not pay here" in result.stdout
    assert "proven optimal for 2 stages" in result.stdout


def test_one_device_as_fast_is_said_plainly() -> None:
    """The issue's case: 33.35 ms on 2 stages against 33.22 ms on one."""
    pred = Prediction(step_s=0.03335, peak_memory_bytes=70 * 2**20, one_stage_step_s=0.03322, one_stage_compared=True,
                      one_stage_fits=True, one_stage_peak_memory_bytes=130 * 2**20,
                      speedup_over_one_stage=0.03322 / 0.03335)
    line = one_device_line(pred, 2)
    assert line is not None and "one device is as fast" in line
    assert "33.220 ms vs 33.350 ms" in line and "pipelining does not pay here" in line
    assert "130.00 MiB on one device" in line and "70.00 MiB per device on 2 stages" in line
    pred = replace(pred, one_stage_step_s=0.05, speedup_over_one_stage=0.05 / 0.03335)
    assert one_device_line(pred, 2).startswith("1.50x faster than one device")


def test_when_one_device_does_not_fit_solve_says_so(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", balanced())
    # Each layer holds 4000 B of parameters x (1 + gradients + Adam's 2) = 16 kB: 6 layers do not fit
    # 60 kB, 3 do.
    result = cli("solve", "profile.json", "-k", "2", "--memory-limit", "60KB", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    pred = json.loads(Path("plan.json").read_text())["predicted"]
    assert pred["one_stage_fits"] is False and pred["one_stage_step_s"] is None
    assert pred["speedup_over_one_stage"] is None
    assert pred["one_stage_peak_memory_bytes"] > 60_000
    assert "one device does not fit" in result.stdout


def test_plans_of_version_3_are_still_shown_and_run(user_dir: Path) -> None:
    from gpipe_plan.runtime.plan import load_plan

    write_json(user_dir / "profile.json", balanced())
    plan = solve_file("profile.json", None, stages=2)
    for key in ("one_stage_step_s", "one_stage_fits", "one_stage_peak_memory_bytes", "speedup_over_one_stage",
                "noise_fraction", "noise_sources"):
        plan["predicted"].pop(key, None)
    plan["options"].pop("global_batch_size_source")
    plan["version"] = 3
    write_json(user_dir / "old.json", plan)
    shown = cli("show", "old.json")
    assert shown.exit_code == 0, shown.output
    assert "one device" not in shown.stdout and "global batch 8 = " in shown.stdout
    assert load_plan(user_dir / "old.json").num_stages == 2


# =========================================================================== 6. one headline prediction
def noisy_profile(**extra) -> dict:
    return balanced(measurement={"speed_probe_s": [0.010, 0.011]},
                    contention={"processes": 2, "slowdown": 1.2,
                                "cycle_ratios": [1.1, 1.15, 1.2, 1.2, 1.2, 1.25, 1.3, 1.3, 1.4]}, **extra)


def test_plan_noise_band_comes_from_the_profiles_own_spread(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", noisy_profile())
    pred = solve_file("profile.json", None, stages=2)["predicted"]
    drift = (0.011 - 0.010) / (0.011 + 0.010)              # half the difference over the mean
    ratios = [1.1, 1.15, 1.2, 1.2, 1.2, 1.25, 1.3, 1.3, 1.4]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    neighbours = (q3 - q1) / 2 / 1.2                         # K = 2 of 2 processes: the whole slowdown
    assert pred["noise_sources"] == pytest.approx({"profile_speed_drift": drift, "neighbours_spread": neighbours})
    assert pred["noise_fraction"] == pytest.approx(math.hypot(drift, neighbours))
    # one stage has no neighbours
    one = solve_file("profile.json", None, stages=1)["predicted"]
    assert one["noise_sources"] == pytest.approx({"profile_speed_drift": drift})


def test_headline_judges_the_plans_prediction_with_the_speed_adjusted_one_beside_it() -> None:
    speed = {"ratio": 1.2, "predicted_step_s_at_run_speed": 0.024, "per_rank_probe_s": {"0": [0.012, 0.0125]},
             "per_rank_probe_spread": {"0": [0.02, 0.03]}}
    head = headline(0.020, {"profile_speed_drift": 0.03}, speed, measured_step_s=0.025)
    assert head["basis"] == "profile" and head["predicted_step_s"] == 0.020
    run_drift = (0.0125 - 0.012) / (0.0125 + 0.012)
    assert head["noise_sources"] == pytest.approx({"profile_speed_drift": 0.03, "run_speed_drift": run_drift})
    assert head["noise_fraction"] == pytest.approx(math.hypot(0.03, run_drift))
    assert head["step_time_ratio"] == pytest.approx(1.25) and head["within_noise"] is False
    # the probe held steady: the prediction at the run's speed beside it, its band with half the correction
    at = head["at_run_speed"]
    assert at["predicted_step_s"] == pytest.approx(0.024) and at["speed_ratio"] == 1.2
    assert at["noise_fraction"] == pytest.approx(math.hypot(math.hypot(0.03, run_drift), 0.1))
    assert at["step_time_ratio"] == pytest.approx(0.025 / 0.024) and at["within_noise"] is True
    assert head["speed_left_out"] is None and head["host_busy"] is None      # no host_load: not measured
    # without a speed probe: the plan's own prediction, and it says so
    raw = headline(0.020, {"profile_speed_drift": 0.03}, {"ratio": None}, measured_step_s=0.025)
    assert raw["basis"] == "profile" and raw["predicted_step_s"] == 0.020 and raw["at_run_speed"] is None
    assert raw["noise_sources"] == {"profile_speed_drift": 0.03} and raw["within_noise"] is False
    assert raw["speed_left_out"] == "no speed probe"


def test_an_unsteady_probe_does_not_turn_a_good_prediction_into_a_miss() -> None:
    """Issue 26: the probe read 0.26x (a disturbed reading) and turned a raw 0.83x into "+221%"."""
    speed = {"ratio": 0.26, "profile_probe_s": 0.010, "per_rank_probe_s": {"0": [0.0021, 0.0031], "1": [0.0024, 0.0029]},
             "per_rank_probe_spread": {"0": [0.3, 0.05], "1": [0.04, 0.06]}}
    head = headline(0.100, {"profile_speed_drift": 0.02}, speed, measured_step_s=0.083)
    assert head["predicted_step_s"] == 0.100 and head["step_time_ratio"] == pytest.approx(0.83)
    assert head["at_run_speed"] is None and "before and after training differ by ±19%" in head["speed_left_out"]
    steady = dict(speed, per_rank_probe_s={"0": [0.0026, 0.0026]}, per_rank_probe_spread={"0": [0.3, 0.02]})
    assert "repeats spread by 30%" in headline(0.1, None, steady, 0.083)["speed_left_out"]
    still = dict(steady, per_rank_probe_spread={"0": [0.02, 0.02]})      # steady, but 0.26x: not one machine's drift
    assert "more than one machine drifts" in headline(0.1, None, still, 0.083)["speed_left_out"]
    same = dict(still, ratio=1.02)                                       # the profile's speed: nothing to adjust
    assert headline(0.1, None, same, 0.083)["at_run_speed"] is None and headline(0.1, None, same, 0.083)[
        "speed_left_out"] is None


def test_run_prints_the_plans_prediction_and_beside_it_the_one_at_the_runs_speed(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", balanced())
    plan = solve_file("profile.json", "plan.json", stages=2, micro_batches=4)
    report = report_doc(plan, factor=1.5, speed_ratio=1.25)
    console = Console(file=io.StringIO(), width=400)
    print_summary(report, console)
    out = console.file.getvalue()
    at_speed = plan["predicted"]["step_s"] * 1.25
    raw = plan["predicted"]["step_s"]
    assert f"{raw * 1e3:.2f} ms predicted (+50%, beyond the expected" in out
    assert f"at this machine's speed (25% slower than at profiling, by the speed probe) {at_speed * 1e3:.2f} ms " \
           "predicted (+20%, beyond" in out                  # 1.5 / 1.25
    assert "the cost model misses something here" in out
    assert "loss 5.5000 at step 1 -> 2.5000 at step 8" in out
    assert "-0%" not in out and "bubble 20% / " in out


def test_a_busy_host_is_named_and_not_blamed_on_the_cost_model(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", balanced())
    plan = solve_file("profile.json", "plan.json", stages=2, micro_batches=4)
    report = report_doc(plan, factor=1.6)
    report["host_load"] = {"window_s": 20.0, "other_cores": 1.6, "contended_cores": 1.6, "hosts": [
        {"host": "vm", "cores": 2, "ranks": [0, 1], "needed_cores": 2, "run_cores": 1.1, "other_cores": 1.6,
         "steal_cores": 0.0, "contended_cores": 1.6, "window_s": 20.0}]}
    console = Console(file=io.StringIO(), width=300)
    print_summary(report, console)
    out = console.file.getvalue()
    assert "other processes used 1.60 of the 2 cores during the run (the run needed 2)" in out
    assert "rerun on a quiet machine" in out and "cost model" not in out


def test_a_probe_that_cannot_be_trusted_does_not_blame_the_cost_model(user_dir: Path) -> None:
    """The demo on a VM whose speed swung: +38%, the probe's readings before and after training
    14% apart. The miss may be the machine's as much as the model's: the line says so, and
    not that the cost model misses something."""
    write_json(user_dir / "profile.json", balanced())
    plan = solve_file("profile.json", "plan.json", stages=2, micro_batches=4)
    report = report_doc(plan, factor=1.38)
    report["speed"] = dict(report["speed"], ratio=1.3, per_rank_probe_s={"0": [0.0110, 0.0146], "1": [0.0112, 0.0140]})
    report["headline"] = headline(report["predicted_step_s"], plan["predicted"].get("noise_sources"),
                                  report["speed"], report["measured_step_s"])
    assert report["headline"]["within_noise"] is False and "before and after" in report["headline"]["speed_left_out"]
    line = step_line(report)
    assert "(+38%, beyond the expected" in line and "misses something" not in line
    assert "the speed probe cannot be trusted (its readings before and after training differ" in line
    assert line.endswith("the machine's speed may explain the miss as much as the cost model; rerun on a quiet "
                         "machine to judge the prediction")
    # A miss within the band needs no such words; one with no probe at all is judged as before.
    calm = dict(report, headline=headline(report["predicted_step_s"], {"profile_speed_drift": 0.5},
                                          report["speed"], report["measured_step_s"]))
    assert calm["headline"]["within_noise"] and "may explain the miss" not in step_line(calm)
    unprobed = dict(report, speed={"ratio": None})
    unprobed["headline"] = headline(report["predicted_step_s"], {"profile_speed_drift": 0.05}, unprobed["speed"],
                                    report["measured_step_s"])
    assert unprobed["headline"]["speed_left_out"] == "no speed probe"
    assert "the cost model misses something here" in step_line(unprobed)


# --------------------------------------------------------------------------- calibration
def test_run_spread_is_the_robust_relative_spread_of_the_measured_steps() -> None:
    times = [9.0, 1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0]          # the first (warm-up) step does not count
    # By hand: the seven counted steps sorted are 0.8 0.9 1.0 1.0 1.0 1.1 1.2; their quartiles are
    # the 2nd and 6th ((7 + 1) / 4 and 3 (7 + 1) / 4), 0.9 and 1.1, and the median the 4th, 1.0:
    # an IQR of 0.2, so a spread of 0.2 / 1.349 / 1.0. (With the warm-up step it would be
    # 0.25 / 1.349 = 0.185; with inclusive quartiles 0.95 and 1.05, 0.1 / 1.349 = 0.074.)
    report = {"measured_step_s_per_step": {str(i): t for i, t in enumerate(times)}}
    assert run_spread(report) == pytest.approx(0.2 / 1.349) == pytest.approx(0.14826, abs=1e-5)
    assert run_spread({"measured_step_s_per_step": {"0": 1.0, "1": 1.0, "2": 1.0}}) is None   # too few
    assert shrink(1.3, 0.0) == 1.3 and shrink(1.3, None) == 1.3
    assert shrink(1.04, 0.05) == 1.0 and shrink(0.97, 0.05) == 1.0      # within the spread: noise
    assert shrink(1.3, 0.05) == pytest.approx(1 + 0.3 * (1 - (0.05 / 0.3) ** 2))
    assert 0.5 < shrink(0.5, 0.2) < 1.0                                 # toward 1, never past it


def test_a_noisy_run_moves_the_calibration_less_than_a_steady_one(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", balanced())
    plan = solve_file("profile.json", "plan.json", stages=2, micro_batches=4, schedule="gpipe")
    step = plan["predicted"]["step_s"] * 1.1
    steady = report_doc(plan, factor=1.1, step_times=[step] * 12)
    noisy = report_doc(plan, factor=1.1, step_times=[step * f for f in
                                                     (1.0, 0.85, 1.15, 0.9, 1.1, 0.95, 1.05, 1.2, 0.8, 1.0, 1.1, 0.9)])
    scales = {}
    for name, report in (("steady", steady), ("noisy", noisy)):
        write_json(user_dir / f"{name}.json", report)
        doc = calibrate("profile.json", f"{name}.json")
        scales[name] = doc["calibration"][-1]["chunks"][0]["forward_scale"]
        assert doc["calibration"][-1]["chunks"][0]["measured_forward_ratio"] == pytest.approx(1.1)
    assert scales["steady"] == pytest.approx(1.1)
    assert 1.0 <= scales["noisy"] < 1.1 - 0.02


# =========================================================================== 7. terminal
def test_progress_line_fits_80_columns_without_cutting() -> None:
    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    progress = TrainingProgress(30, 0, 32, 64, 10, True, console=console)
    for step in range(19):
        progress.update(step, 4.12345, 0.0331)
    out = Console(file=io.StringIO(), width=80, color_system=None)
    out.print(progress._progress.get_renderable())
    progress.close()
    lines = [line for line in out.file.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1 and len(lines[0]) <= 80, lines
    assert "…" not in lines[0]
    assert lines[0].startswith("step 19/30  loss 4.1235  33.1 ms/step"), lines[0]
    assert fit_fields(["step 1/2", "loss 1", "tokens 9"], 16) == "step 1/2  loss 1"


def test_solve_progress_shows_no_none_while_the_total_is_unknown() -> None:
    progress = Progress()
    task = progress.add_task("solving", total=None)
    assert "None" not in CountColumn().render(progress.tasks[0]).plain
    progress.update(task, total=8, completed=3)
    assert CountColumn().render(progress.tasks[0]).plain == "3/8"


def test_show_reprints_a_reports_table(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", balanced())
    plan = solve_file("profile.json", "plan.json", stages=2, micro_batches=4)
    write_json(user_dir / "report.json", report_doc(plan, factor=1.02))
    result = cli("show", "report.json")
    assert result.exit_code == 0, result.output
    assert "measured vs predicted, per chunk" in result.stdout and "layer0" in result.stdout
    assert "+2%" in result.stdout and "loss 5.5000" in result.stdout
    assert "-0%" not in result.stdout


def test_show_of_a_report_does_not_import_torch(user_dir: Path) -> None:
    import subprocess
    import sys

    write_json(user_dir / "profile.json", balanced())
    plan = solve_file("profile.json", "plan.json", stages=2, micro_batches=4)
    write_json(user_dir / "report.json", report_doc(plan))
    code = ("import sys; from click.testing import CliRunner; from gpipe_plan.cli import main; "
            "r = CliRunner().invoke(main, ['show', 'report.json']); assert r.exit_code == 0, r.output; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=user_dir)


def run_of_a_solved_plan(folder: Path) -> None:
    """profile.json, plan.json solved from it, and report.json of a run of that plan, in ``folder``."""
    from gpipe_plan.artifacts import file_sha256

    write_json(folder / "profile.json", balanced())
    plan = solve_file("profile.json", "plan.json", stages=2, micro_batches=4)
    report = report_doc(plan, factor=1.2)
    report["plan"]["sha256"] = file_sha256("plan.json")
    write_json(folder / "report.json", report)


def test_calibrate_finds_the_profile_the_report_names(user_dir: Path) -> None:
    run_of_a_solved_plan(user_dir)
    result = cli("calibrate", "report.json")
    assert result.exit_code == 0, result.output
    assert "calibrating 'profile.json'" in result.stdout
    assert json.loads(Path("profile.calibrated.json").read_text())["calibration"][-1]["report"] == "report.json"
    Path("profile.json").rename("gone.json")
    result = cli("calibrate", "report.json")
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert "made from profile 'profile.json', which is gone: give --profile" in result.stderr
    Path("gone.json").rename("profile.json")
    Path("profile.json").write_text(Path("profile.json").read_text() + "\n")      # changed since
    result = cli("calibrate", "report.json")
    assert result.exit_code == 2 and "has changed since" in result.stderr


def test_calibrate_refuses_another_profile_of_the_same_model(user_dir: Path) -> None:
    run_of_a_solved_plan(user_dir)
    other = balanced()
    other["layers"][0]["forward_s"] = [t * 2 for t in other["layers"][0]["forward_s"]]
    write_json(user_dir / "other.json", other)
    result = cli("calibrate", "report.json", "--profile", "other.json")
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.output
    assert "'other.json' is not the one plan 'plan.json' was made from" in result.stderr
    assert not Path("other.calibrated.json").exists()
    assert cli("calibrate", "report.json", "--profile", "profile.json").exit_code == 0


def test_explore_chart_gives_each_line_its_colour_and_lists_what_never_fits() -> None:
    profile = Profile(balanced(L=8))
    # 8 layers of 4000 B of parameters, x4 with gradients and Adam's state: 128 kB on one device
    ex = explore(profile, [1, 2, 4, 8], recomputes=("never", "always", "auto"), memory_limit_bytes=100_000)
    svg = exploration_chart(ex)
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    paths = [p for p in root.iter(f"{ns}path")]
    colours = [p.get("stroke") for p in paths]
    assert len(paths) > 8 and len(set(colours)) == len(colours)     # more lines than the palette, all distinct
    never = never_fitting(ex)
    assert set(never) == {f"K=1 {s} rc={r}" for s in ("gpipe", "1f1b") for r in ("never", "always", "auto")}
    texts = [t.text for t in root.iter(f"{ns}text")]
    for label in never:
        assert any(text and text.startswith(label + ":") for text in texts), label


def test_timeline_last_axis_label_has_room(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", balanced())
    svg = plan_timeline_svg(view_of(solve_file("profile.json", None, stages=2, micro_batches=4)))
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    labels = [t for t in root.iter(f"{ns}text") if t.get("text-anchor") == "middle" and t.text
              and re.fullmatch(r"0|[\d.]+ (s|ms|µs)", t.text)]
    assert len(labels) == 6
    assert labels[0].text == "0"                  # the step's start, in no unit (issue 31: not "0 µs")
    for label in labels:   # 11 px sans-serif: at most ~7 px a character
        assert float(label.get("x")) + 7 * len(label.text) / 2 <= WIDTH, label.text


def test_percentages_are_never_negative_zero() -> None:
    assert format_percent(-0.001) == "0%" and format_percent(-0.0004, 1) == "0.0%"
    assert format_percent(-0.05) == "-5%" and format_percent(0.05, sign=True) == "+5%"
    assert format_percent(0.0, sign=True) == "0%"


def test_profile_progress_plain_lines_without_a_terminal_and_an_eta_with_one() -> None:
    stream = io.StringIO()
    now = [0.0]
    lines = PhaseLines(stream, heartbeat_s=30.0, clock=lambda: now[0])
    with lines:
        lines.begin(10)
        for what in ("b=1 embed", "harness", "b=2 embed", "embed optimizer step", "b=1 block0 (recompute)",
                     "recompute harness", "b=1 embed", "b=1 whole model"):    # embed again: a later round
            lines.step(what)
        now[0] = 31.0                                                        # a long stretch, no new phase
        lines.step("b=2 whole model")
        lines.step("2 processes computing side by side")
    printed = [re.sub(r"^profiling \[[ \d%]+, +\d+ s\] ", "", line) for line in stream.getvalue().splitlines()]
    assert printed == ["embed", "block0", "whole model", "still whole model", "2 processes computing side by side",
                       "done"]
    assert phase_of("harness") is None and phase_of("b=16 head (recompute)") == "head"
    not_a_terminal = Console(file=io.StringIO(), force_terminal=False)
    assert isinstance(_progress_for(not_a_terminal, quiet=False), PhaseLines)
    assert isinstance(_progress_for(not_a_terminal, quiet=True), _Bar)      # a disabled bar: nothing
    terminal = Console(file=io.StringIO(), force_terminal=True, width=80)
    bar = _progress_for(terminal, quiet=False)
    assert any(isinstance(c, TimeRemainingColumn) for c in bar._progress.columns)
    bar.begin(1356)
    for _ in range(356):
        bar.step("2 processes computing side by side")
    shown = Console(file=io.StringIO(), width=80, color_system=None)
    shown.print(bar._progress.get_renderable())
    line = shown.file.getvalue().rstrip("\n")
    assert len(line) <= 80 and re.search(r"356/1356 \d:\d\d:\d\d (-|\d):[-\d]{2}:[-\d]{2} 2 processes", line), line


def test_profile_summary_explains_the_consistency_ratio() -> None:
    doc = balanced(consistency={"layer_sum_s": [0.01] * 4, "model_step_s": [0.0105] * 4, "ratio": [0.95] * 4},
                   global_batch_size=32)
    console = Console(file=io.StringIO(), width=200)
    render_profile(doc, console)
    out = console.file.getvalue()
    assert "near 1 means the per-layer figures add up" in out
    assert "global batch    32" in out


# =========================================================================== 8. the demo's text
def test_the_demo_text_is_shipped_with_its_source_and_licence() -> None:
    import tomllib

    from gpipe_plan.demo import DEMO_TEXT

    text = DEMO_TEXT.read_text(encoding="utf-8")
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("Public domain" in line for line in header)
    assert any("archives.gov" in line for line in header)
    assert "When in the Course of human events" in text and len(text.encode()) > 8000
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert "texts/*.txt" in pyproject["tool"]["setuptools"]["package-data"]["gpipe_plan.runtime"]


def test_the_demo_recipe_learns_the_shipped_text() -> None:
    """The demo's recipe (Adam, warm-up, clipping) on a small gpt, one process: the loss falls well
    below ln 256 = 5.55 in 40 steps. One process computes what K stages do (runtime/test_train.py)."""
    import torch

    from gpipe_plan.models import build_model, model_spec
    from gpipe_plan.runtime.data import TextBatches
    from gpipe_plan.demo import DEMO_TEXT, GRAD_CLIP, LEARNING_RATE
    from gpipe_plan.runtime.optim import learning_rate
    from gpipe_plan.runtime.options import RunOptions

    torch.manual_seed(0)
    spec = model_spec("gpt", layers=2, width=32, heads=2, seq_len=32, vocab_size=256)
    model = build_model(spec, seed=0)
    data = TextBatches(str(DEMO_TEXT), 32, 16, seed=0)
    steps = 40
    options = RunOptions(plan="-", steps=steps, lr=LEARNING_RATE, warmup_steps=steps // 10, grad_clip=GRAD_CLIP)
    optimizer = torch.optim.Adam(model.module.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, LEARNING_RATE, options)
        (x,), y = data.batch(step)
        loss = model.loss(model.forward(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.module.parameters(), GRAD_CLIP)
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)
    assert statistics.mean(losses[-5:]) < losses[0] - 1.5, losses
