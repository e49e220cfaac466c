"""What recomputation costs: measured by the profiler, priced by the planner, kept by calibration.

Activation checkpointing costs more than "one more forward": hooks on every tensor the
checkpointed forward would have saved, the rerun inside the backward, and a fixed cost per
checkpoint call (~0.1-0.5 ms on a CPU). Version 3 profiles time each layer under checkpointing
and the call alone; the planner charges the per-layer figures and the call once per stage.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpipe_plan.artifacts import BadInput
from gpipe_plan.cli import main
from gpipe_plan.models import model_spec
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.profile import Profile
from gpipe_plan.profiles.calibrate import calibrate
from gpipe_plan.profiles.profiler import ProfileRequest, profile_model

from helpers.planner import profile_doc

TINY_GPT = model_spec("gpt", layers=2, width=32, heads=2, seq_len=16, vocab_size=64)


def with_recompute(doc: dict, rerun_per_sample: float = 3e-3, checkpointed_forward_factor: float = 1.1,
                   call: tuple[float, ...] = (5e-4, 5e-4, 5e-4)) -> dict:
    """``doc`` with recompute timings: each layer's checkpointed backward = backward + a rerun of
    ``rerun_per_sample`` x b, its checkpointed forward = ``checkpointed_forward_factor`` x forward."""
    out = json.loads(json.dumps(doc))
    out["version"] = 3
    for layer in out["layers"]:
        layer["recompute_forward_s"] = [f * checkpointed_forward_factor for f in layer["forward_s"]]
        layer["recompute_backward_s"] = [g + rerun_per_sample * b
                                         for g, b in zip(layer["backward_s"], out["micro_batch_sizes"])]
    out["recompute_call_s"] = list(call)
    return out


# --------------------------------------------------------------------------- the planner
def test_recomputing_stage_is_priced_as_measured_plus_one_call_per_stage() -> None:
    doc = with_recompute(profile_doc(6, sizes=(1, 2, 4)))
    figures = Profile(doc).at(2)
    plain = Profile(profile_doc(6, sizes=(1, 2, 4))).at(2)
    cm = CostModel(figures, Setting(stages=2, micro_batches=4, recompute="always"))
    textbook = CostModel(plain, Setting(stages=2, micro_batches=4, recompute="always"))
    for s, e in ((0, 3), (3, 6), (0, 1)):
        # per layer: backward + rerun + what checkpointing added to the forward; plus one call
        expected = sum(plain.backward_s[i] + 3e-3 * 2 + 0.1 * plain.forward_s[i] for i in range(s, e)) + 5e-4
        assert cm.backward(s, e, True) == pytest.approx(expected)
        assert textbook.backward(s, e, True) == pytest.approx(sum(plain.backward_s[s:e]) + sum(plain.forward_s[s:e]))
        assert cm.forward(s, e) == pytest.approx(textbook.forward(s, e))       # the forward stays the plain one
        assert cm.backward(s, e, False) == pytest.approx(textbook.backward(s, e, False))
    # the call is charged per stage, not per layer: two one-layer stages pay it twice
    assert cm.backward(0, 2, True) + 5e-4 == pytest.approx(cm.backward(0, 1, True) + cm.backward(1, 2, True))


def test_a_plan_reports_the_measured_recompute_time(tmp_path: Path) -> None:
    from gpipe_plan.planner.command import solve_file

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(with_recompute(profile_doc(6, sizes=(1, 2, 4), batch_size=8))))
    plan = solve_file(str(profile), None, stages=2, micro_batches=4, schedule="gpipe", recompute="always")
    assert plan["micro_batch_size"] == 2
    for stage in plan["chunks"]:   # plan format 5: times per chunk
        # the rerun (3 ms x b=2 per layer) + what checkpointing added to the forward + one call
        assert stage["recompute"] is True
        assert stage["recompute_s"] == pytest.approx(len(stage["layers"]) * 6e-3 + 0.1 * stage["forward_s"] + 5e-4)


def test_partial_recompute_timings_are_refused_in_one_line() -> None:
    doc = with_recompute(profile_doc(4, sizes=(1, 2, 4)))
    del doc["layers"][2]["recompute_backward_s"]
    with pytest.raises(BadInput, match="recompute timings are partial"):
        Profile(doc)
    doc = with_recompute(profile_doc(4, sizes=(1, 2, 4)))
    doc["recompute_call_s"] = [1e-4]
    with pytest.raises(BadInput, match="'recompute_call_s' must be a list of 3 numbers"):
        Profile(doc)


def test_profiles_without_recompute_timings_price_one_more_forward() -> None:
    figures = Profile(profile_doc(4, sizes=(1, 2, 4))).at(4)
    assert figures.recompute_backward_s is None and figures.recompute_call_s == 0.0
    assert figures.recomputing_backward_s() == tuple(b + f for b, f in zip(figures.backward_s, figures.forward_s))


def test_neighbour_scaling_scales_the_recompute_figures_too() -> None:
    figures = Profile(with_recompute(profile_doc(4, sizes=(1, 2, 4)))).at(1)
    scaled = figures.times_scaled(1.5)
    assert scaled.recompute_call_s == pytest.approx(1.5 * figures.recompute_call_s)
    assert scaled.recompute_backward_s == pytest.approx([1.5 * t for t in figures.recompute_backward_s])


# --------------------------------------------------------------------------- calibration
def test_calibration_scales_the_checkpointed_passes_with_the_plain_ones(tmp_path: Path) -> None:
    doc = with_recompute(profile_doc(2, sizes=(1, 2, 4)))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc))
    names = [layer["name"] for layer in doc["layers"]]
    report = {"format": "gpipe-plan.report", "version": 1, "model": doc["model"], "micro_batch_size": 2,
              "stages": [{"index": 0, "layers": names, "recompute": True,
                          "predicted_forward_s": 1.0, "measured_forward_s": 1.2,
                          "predicted_backward_s": 1.0, "measured_backward_s": 1.5}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    out = calibrate(str(profile), str(tmp_path / "report.json"))
    for before, after in zip(doc["layers"], out["layers"]):
        assert after["recompute_forward_s"] == pytest.approx([1.2 * t for t in before["recompute_forward_s"]])
        assert after["recompute_backward_s"] == pytest.approx([1.5 * t for t in before["recompute_backward_s"]])
    assert out["recompute_call_s"] == doc["recompute_call_s"]


# --------------------------------------------------------------------------- the profiler
def test_profiler_times_every_layer_under_checkpointing() -> None:
    doc = profile_model(ProfileRequest(spec=TINY_GPT, micro_batch_sizes=[1, 2], warmup=1, repeats=3))
    assert doc["version"] >= 3   # recompute timings came with version 3
    assert len(doc["recompute_call_s"]) == 2 and all(t > 0 for t in doc["recompute_call_s"])
    for layer in doc["layers"]:
        for key in ("recompute_forward_s", "recompute_backward_s"):
            assert len(layer[key]) == 2 and all(math.isfinite(t) and t >= 0 for t in layer[key])
    Profile(doc).at(2)   # the planner reads it
    skipped = profile_model(ProfileRequest(spec=TINY_GPT, micro_batch_sizes=[1], warmup=0, repeats=1,
                                           recompute=False))
    assert "recompute_call_s" not in skipped
    assert all("recompute_backward_s" not in layer for layer in skipped["layers"])


def test_checkpointed_backward_includes_the_rerun(user_module) -> None:
    # A layer whose forward is a large share of its backward: the rerun must show.
    name = user_module("""
        import torch
        from torch import nn
        class Wide(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(512, 512)
            def forward(self, x):
                return torch.tanh(self.fc(x))
        def make():
            return nn.Sequential(Wide(), Wide(), nn.Linear(512, 4))
    """)
    spec = model_spec(f"{name}:make", input_shape="512", num_classes=4)
    doc = profile_model(ProfileRequest(spec=spec, micro_batch_sizes=[128], warmup=2, repeats=7))
    for layer in doc["layers"][:2]:
        assert layer["recompute_backward_s"][0] > layer["backward_s"][0] + 0.5 * layer["forward_s"][0], layer


def test_no_recompute_timing_flag(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["profile", "gpt", "--layers", "1", "--width", "16", "--heads", "2",
                                       "--seq-len", "8", "--vocab-size", "32", "--micro-batch-sizes", "1",
                                       "--warmup", "0", "--repeats", "1", "--contention-processes", "0",
                                       "--no-recompute-timing", "--no-fixed-costs", "-q", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "recompute_call_s" not in json.loads(out.read_text())
