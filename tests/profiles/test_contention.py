"""Neighbours: a CPU profile's measured contention, and how plans charge it."""

from __future__ import annotations


import pytest
from click.testing import CliRunner

from gpipe_plan.artifacts import BadInput
from gpipe_plan.cli import main
from gpipe_plan.hostload import robust_spread
from gpipe_plan.models import model_spec
from gpipe_plan.planner.costmodel import neighbour_scale
from gpipe_plan.planner.explore import explore
from gpipe_plan.planner.plan import build_plan
from gpipe_plan.planner.profile import Profile
from gpipe_plan.planner.problem import SolveOptions
from gpipe_plan.planner.search import search
from gpipe_plan.profiles.contention import cycle_ratios, measure_contention, recorded_slowdown
from gpipe_plan.profiles.profiler import ProfileRequest, profile_model
from gpipe_plan.schema import FORMAT_VERSIONS, PROFILE_FORMAT

from helpers.planner import profile_doc

TINY_GPT = model_spec("gpt", layers=2, width=16, heads=2, seq_len=8, vocab_size=64)


def test_neighbour_scale_grows_with_the_neighbours_up_to_what_was_measured() -> None:
    assert neighbour_scale(1.4, 2, stages=1) == 1.0                          # one stage: no neighbours
    assert neighbour_scale(1.4, 2, stages=2) == pytest.approx(1.4)
    assert neighbour_scale(1.4, 2, stages=8) == pytest.approx(1.4)           # capped at the measured 2
    assert neighbour_scale(1.6, 4, stages=2) == pytest.approx(1 + 0.6 / 3)   # one neighbour of the 3 measured
    assert neighbour_scale(1.0, 2, stages=4) == 1.0


def test_plans_scale_stage_times_by_the_profiles_slowdown() -> None:
    plain = profile_doc(6, batch_size=8)
    crowded = {**profile_doc(6, batch_size=8), "version": 2, "contention": {"processes": 2, "slowdown": 1.5}}
    options = SolveOptions(stages=2, global_batch_size=8, micro_batches=4, schedule="gpipe", recompute="never")
    base = search(Profile(plain), options).best.solution.evaluation
    scaled = search(Profile(crowded), options).best.solution.evaluation
    factor = 1.5
    # One factor on every layer time: the same optimal cut, every time scaled by it.
    assert [s.end for s in scaled.chunks] == [s.end for s in base.chunks]
    for a, b in zip(base.chunks, scaled.chunks):
        assert b.forward_s == pytest.approx(a.forward_s * factor)
        assert b.backward_s == pytest.approx(a.backward_s * factor)
    assert scaled.step_s == pytest.approx(base.step_s * factor)
    one_stage = SolveOptions(stages=1, global_batch_size=8, micro_batches=4)
    assert search(Profile(crowded), one_stage).best.solution.evaluation.step_s == \
        pytest.approx(search(Profile(plain), one_stage).best.solution.evaluation.step_s)


def test_explore_cells_agree_with_solve_under_contention() -> None:
    doc = {**profile_doc(8, batch_size=8), "contention": {"processes": 2, "slowdown": 1.3}}
    profile = Profile(doc)
    ex = explore(profile, [1, 2, 4], [1, 2, 4, 8], 8, schedules=("gpipe", "1f1b"), recomputes=("never",),
                 time_budget_s=5.0)
    for cell in ex.cells:
        best = search(profile, SolveOptions(stages=cell.stages, global_batch_size=8, micro_batches=cell.micro_batches,
                                            schedule=cell.schedule, recompute="never")).best
        assert cell.step_s == pytest.approx(best.solution.evaluation.step_s, rel=1e-9), cell


@pytest.mark.parametrize("contention", [{"processes": 2}, {"processes": 1, "slowdown": 1.2},
                                        {"processes": 2, "slowdown": 0.8}, "fast"])
def test_a_bad_contention_key_is_named(contention) -> None:
    with pytest.raises(BadInput, match="'contention"):
        Profile({**profile_doc(4), "contention": contention})


def test_a_version_1_profile_plans_without_contention() -> None:
    """A profile without `contention` (version 1 had none) is planned as profiled; the same
    figures with a measured slowdown are charged for it (so this would see the path break)."""
    doc = profile_doc(4)
    assert doc["version"] == 1 and "contention" not in doc
    options = SolveOptions(stages=2, global_batch_size=8, micro_batches=4, schedule="gpipe", recompute="never")
    plain = search(Profile(doc), options).best.solution.evaluation
    slowed = {**doc, "version": FORMAT_VERSIONS[PROFILE_FORMAT], "device": {"type": "cpu", "name": "test"},
              "contention": {"processes": 2, "threads_per_process": 1, "micro_batch_size": 2, "alone_step_s": 0.01,
                             "together_step_s": 0.015, "slowest_step_s": 0.015, "cycle_ratios": [1.5],
                             "slowdown": 1.5}}
    charged = search(Profile(slowed), options).best.solution.evaluation
    assert Profile(doc).contention_slowdown == 1.0
    assert charged.step_s == pytest.approx(plain.step_s * 1.5, rel=1e-9)


def test_contention_is_measured_on_the_model() -> None:
    out = measure_contention(TINY_GPT, micro_batch_size=2, processes=2, seconds=0.05, cycles=2)
    assert out["processes"] == 2 and len(out["cycle_ratios"]) == 2
    assert all(r > 0 for r in out["cycle_ratios"])
    assert out["slowdown"] == recorded_slowdown(out["cycle_ratios"])
    assert out["alone_step_s"] > 0 and 0 < out["together_step_s"] <= out["slowest_step_s"]


@pytest.mark.parametrize("ratios, slowdown", [([1.01, 1.015], 1.0), ([0.9, 0.95], 1.0), ([1.3, 1.5], 1.4),
                                              ([1.0, 1.5, 1.1], 1.1), ([1.02, 1.03, 1.0], 1.02)])
def test_the_slowdown_is_the_median_cycle_and_noise_is_none(ratios: list[float], slowdown: float) -> None:
    # The median, not the mean or the last cycle: one slow spell cannot move it; within 2% of 1
    # (or a machine that sped up) is noise, recorded as no slowdown at all.
    assert recorded_slowdown(ratios) == pytest.approx(slowdown)


def test_a_reading_taken_while_the_host_swung_is_taken_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycles that disagree (the host's own speed swung: a virtual machine's neighbours) are
    read again, at most READINGS times, and the steadiest reading is kept; a steady first
    reading is kept at once."""
    from gpipe_plan.profiles import contention

    def readings(*ratio_sets: list[float]):
        left = list(ratio_sets)

        def reading(*args, **kwargs):
            ratios = left.pop(0)
            return {"processes": 2, "cycle_ratios": ratios, "slowdown": contention.recorded_slowdown(ratios),
                    "spread": robust_spread(ratios)}
        return reading

    swung = [0.71, 1.05, 1.35, 1.55, 1.25, 1.59, 1.68, 1.05, 1.35]     # measured so on the development VM
    steady = [1.03, 1.04, 1.04, 1.03, 1.01, 1.05, 1.03, 1.02, 1.01]
    less = [1.0, 1.1, 1.2, 1.3, 1.1, 1.2, 1.0, 1.1, 1.2]
    assert robust_spread(swung) > 0.3 and robust_spread(steady) < 0.02
    monkeypatch.setattr(contention, "_reading", readings(swung, steady))
    out = contention.measure_contention(TINY_GPT, micro_batch_size=2)
    assert out["readings"] == 2 and out["slowdown"] == pytest.approx(1.03) and out["spread"] < 0.02
    monkeypatch.setattr(contention, "_reading", readings(steady))
    assert contention.measure_contention(TINY_GPT, micro_batch_size=2)["readings"] == 1
    monkeypatch.setattr(contention, "_reading", readings(swung, less, swung))
    out = contention.measure_contention(TINY_GPT, micro_batch_size=2)
    assert out["readings"] == contention.READINGS == 3 and out["cycle_ratios"] == less


def test_a_plan_says_when_the_slowdown_it_charges_was_measured_on_a_swinging_host() -> None:
    doc = profile_doc(L=4, batch_size=8)
    contended = {**doc, "version": FORMAT_VERSIONS[PROFILE_FORMAT], "device": {"type": "cpu", "name": "test"},
                 "contention": {"processes": 2, "slowdown": 1.35, "cycle_ratios": [1.35], "spread": 0.39,
                                "readings": 3}}
    options = SolveOptions(stages=2, global_batch_size=8, micro_batches=4, schedule="1f1b", recompute="never")

    def warnings(profile_doc_: dict) -> list[str]:
        profile = Profile(profile_doc_)
        return build_plan(profile, "p.json", "0" * 64, options, search(profile, options))["warnings"]

    assert any("speed swung" in w and "3 readings" in w for w in warnings(contended))
    steady = {**contended, "contention": {**contended["contention"], "spread": 0.05}}
    assert not any("speed swung" in w for w in warnings(steady))


def test_the_slowest_neighbour_sets_the_slowdown() -> None:
    # Process 0 runs as fast beside its neighbour as alone; process 1 runs 1.2x slower: a
    # pipeline goes at its slowest stage's pace, so the cycle's ratio is 1.2, not the mean 1.1.
    phases = {0: {"alone": [10.0, 20.0], "together": [10.0, 20.0]},
              1: {"alone": [], "together": [12.0, 24.0]}}
    assert cycle_ratios(phases) == pytest.approx([1.2, 1.2])


def test_profile_records_contention_only_when_asked() -> None:
    request = ProfileRequest(spec=TINY_GPT, micro_batch_sizes=[1, 2], warmup=0, repeats=1)
    assert "contention" not in profile_model(request)
    doc = profile_model(ProfileRequest(spec=TINY_GPT, micro_batch_sizes=[1, 2], warmup=0, repeats=1,
                                       contention_processes=2))
    assert doc["version"] == FORMAT_VERSIONS[PROFILE_FORMAT] == 14
    assert doc["contention"]["processes"] == 2 and doc["contention"]["micro_batch_size"] == 2
    Profile(doc)   # the planner reads what the profiler wrote


def test_cli_refuses_one_contention_process(tmp_path) -> None:
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["profile", "gpt", "--layers", "1", "--contention-processes", "1",
                                       "-o", str(out)])
    assert result.exit_code == 2 and "--contention-processes must be 0" in result.output
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--seed", str(2 ** 63)], "--seed must be a whole number from -2^40 to 2^40"),
    (["--whole-model", "--measure-every-layer"], "--measure-every-layer is for a profile taken layer by layer"),
    (["--whole-model", "--no-whole-model-check"], "--whole-model-check/--no-whole-model-check is for a profile"),
])
def test_cli_refuses_options_it_could_not_honour_before_measuring(tmp_path, args, message) -> None:
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["profile", "gpt", "--layers", "1", *args, "-o", str(out)])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()


def test_a_micro_batch_no_memory_holds_is_said_as_such(tmp_path) -> None:
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["profile", "gpt", "--layers", "1", "--micro-batch-sizes", "99999999999",
                                       "--no-fixed-costs", "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert "out of memory while profiling: use smaller --micro-batch-sizes" in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()
