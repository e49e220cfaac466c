"""The backward split in two (input gradient I, weight gradient W), as zero-bubble schedules run it.

What is checked: the split runner computes what the plain backward computes (same gradients),
what it keeps between I and W is what torch's retained graph really holds, the profile
carries the three version-7 keys wherever it has layers, and older profiles still read.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from torch import nn

from gpipe_plan.artifacts import BadInput
from gpipe_plan.cli import main
from gpipe_plan.models import AsTuple, model_spec
from gpipe_plan.profiles.clock import clock_for
from gpipe_plan.profiles.command import phase_of
from gpipe_plan.profiles.measure import (LayerMeasurement, harness_runner, has_weights, prepare_layer, record_split,
                                         split_harness_runner, split_runner, time_rounds)
from gpipe_plan.profiles.profiler import ProfileRequest, profile_model
from gpipe_plan.profiles.show import render_profile
from gpipe_plan.schema import FORMAT_VERSIONS, PROFILE_FORMAT, read_artifact, validate

CPU = torch.device("cpu")
TINY_GPT = model_spec("gpt", layers=3, width=16, heads=2, seq_len=8, vocab_size=32)
TINY_RESNET = model_spec("resnet", blocks=[1, 1], width=8, image_size=8)
SPLIT_KEYS = ("backward_input_s", "backward_weight_s", "weight_kept_bytes")


def _weigh(layer: nn.Module, xs: tuple[torch.Tensor, ...], first: bool = False) -> tuple[LayerMeasurement, object]:
    figures, _ = prepare_layer("layer", layer, xs, first=first, loss=None)
    return figures, split_runner("layer (split)", layer, xs, figures, first=first, loss=None)


# --------------------------------------------------------------------------- what I and W compute
def test_split_runner_computes_the_plain_gradients() -> None:
    """I then W leave the same input and weight gradients as one plain backward from the same output gradient."""
    torch.manual_seed(0)
    layer = AsTuple(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)))
    xs = (torch.randn(5, 6),)
    _, runner = _weigh(layer, xs)
    assert runner is not None
    layer.zero_grad(set_to_none=True)
    outputs, leaves = runner.forward()
    groups = runner.backward((outputs, leaves))
    input_grad = leaves[0].grad.clone()
    assert all(p.grad is None for p in layer.parameters())   # I alone leaves the weights alone
    runner.backward_weight(groups)
    split_grads = [p.grad.clone() for p in layer.parameters()]

    layer.zero_grad(set_to_none=True)
    x = xs[0].detach().requires_grad_(True)
    (out,) = layer(x)
    out.backward(torch.ones_like(out))
    assert torch.allclose(input_grad, x.grad)
    for split, plain in zip(split_grads, (p.grad for p in layer.parameters())):
        assert torch.allclose(split, plain)


def test_a_view_output_is_split_like_any_other() -> None:
    """torch's I detaches outputs in place, which a view refuses: the runner still runs, same gradients."""
    class Viewed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (self.fc(x).view(-1, 2, 3),)

    layer = Viewed()
    _, runner = _weigh(layer, (torch.randn(3, 4),))
    layer.zero_grad(set_to_none=True)
    runner.backward_weight(runner.backward(runner.forward()))
    assert layer.fc.weight.grad is not None and layer.fc.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------- what stays alive between I and W
def test_linear_keeps_its_input_and_its_output_gradient() -> None:
    """W of a Linear needs its input (saved) and the gradient of its output (left by I): exactly those bytes."""
    b, i, o = 4, 24, 40
    figures, _ = _weigh(AsTuple(nn.Linear(i, o)), (torch.randn(b, i),))
    assert figures.activation_bytes == b * i * 4
    assert figures.weight_kept_bytes == b * i * 4 + b * o * 4


def test_what_lies_above_the_last_weights_is_freed_by_i() -> None:
    """Two tanh after a Linear save their outputs; W needs neither, and I frees both."""
    b, i, o = 4, 24, 40
    figures, _ = _weigh(AsTuple(nn.Sequential(nn.Linear(i, o), nn.Tanh(), nn.Tanh())), (torch.randn(b, i),))
    assert figures.activation_bytes == b * i * 4 + 2 * b * o * 4
    assert figures.weight_kept_bytes == b * i * 4 + b * o * 4 < figures.activation_bytes


def test_a_layer_without_weights_keeps_nothing_and_has_no_weight_time() -> None:
    layer = AsTuple(nn.Tanh())
    figures, runner = _weigh(layer, (torch.randn(4, 8),))
    assert figures.activation_bytes > 0 and figures.weight_kept_bytes == 0
    assert not has_weights(layer)
    harness = split_harness_runner(CPU)
    (timed_harness, timed), = time_rounds([[harness, runner]], clock_for(CPU, 1), warmup=1, repeats=3)
    record_split(figures, timed, timed_harness, has_weights(layer))
    assert figures.backward_weight_s == 0.0


def test_the_first_layer_runs_no_input_gradient() -> None:
    """torch's first stage runs no I (its inputs need no gradient) and its W is the whole backward."""
    figures, runner = _weigh(AsTuple(nn.Linear(8, 8)), (torch.randn(4, 8),), first=True)
    assert runner is None
    assert figures.weight_kept_bytes == figures.activation_bytes
    figures.backward_s = 1e-3
    record_split(figures, None, None, has_weights=True)
    assert figures.backward_input_s == 0.0 and figures.backward_weight_s == figures.backward_s


def test_linear_input_and_weight_halves_both_take_time() -> None:
    """A Linear big enough to time: both halves cost something once the harness is taken off,
    and together about what one plain backward does (a wide band: the split pays a few calls more)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the thread-time clock sees this thread's work only, as the profiler runs it
    try:
        _time_a_big_linear()
    finally:
        torch.set_num_threads(threads)


def _time_a_big_linear() -> None:
    layer = AsTuple(nn.Linear(512, 512))
    xs = (torch.randn(128, 512),)
    figures, plain = prepare_layer("fc", layer, xs, first=False, loss=None)
    split = split_runner("fc (split)", layer, xs, figures, first=False, loss=None)
    (harness, plain_timing), (split_harness, split_timing) = time_rounds(
        [[harness_runner(CPU), plain], [split_harness_runner(CPU), split]], clock_for(CPU, 1), warmup=1, repeats=5)
    figures.backward_s = plain_timing.backward_s - harness.backward_s
    record_split(figures, split_timing, split_harness, has_weights(layer))
    assert figures.backward_input_s > 0 and figures.backward_weight_s > 0
    assert 0.5 < (figures.backward_input_s + figures.backward_weight_s) / figures.backward_s < 3


# --------------------------------------------------------------------------- the profile
@pytest.mark.parametrize("spec, layer_by_layer", [(TINY_GPT, False), (TINY_GPT, True), (TINY_RESNET, False)])
def test_profile_carries_the_split_for_every_layer(spec: dict, layer_by_layer: bool) -> None:
    steps: list[str] = []

    class Steps:
        total = 0

        def begin(self, total: int) -> None:
            Steps.total = total

        def step(self, description: str) -> None:
            steps.append(description)

    # (one cold timing each, warmup 0 and repeats 1, once read 0 for the head's input backward
    # less its harness on a busy CI host: a measurement too short to hold, not a wrong split)
    doc = profile_model(ProfileRequest(spec=spec, micro_batch_sizes=[1, 2], warmup=1, repeats=3,
                                       layer_by_layer=layer_by_layer), Steps())
    assert len(steps) == Steps.total   # the progress bar ends full
    assert doc["version"] == FORMAT_VERSIONS[PROFILE_FORMAT] == 14
    validate(doc, "profile", "profile")
    first, *rest = doc["layers"]
    for layer in doc["layers"]:
        for key in SPLIT_KEYS:
            assert len(layer[key]) == 2 and all(v >= 0 for v in layer[key]), (layer["name"], key)
    assert first["backward_input_s"] == [0.0, 0.0] and first["backward_weight_s"] == first["backward_s"]
    assert first["weight_kept_bytes"] == first["activation_bytes"]
    for layer in rest:
        assert all(k > 0 for k in layer["weight_kept_bytes"]), layer["name"]
        if layer["param_bytes"] > 0:
            assert all(i > 0 for i in layer["backward_input_s"]), layer["name"]
    harness = doc["measurement"]
    assert len(harness["split_harness_backward_input_s"]) == len(harness["split_harness_backward_weight_s"]) == 2
    if layer_by_layer:   # a layer that shares another's figures shares these too
        shared = [layer for layer in doc["layers"] if layer["measured_as"]]
        assert shared
        for layer in shared:
            source = next(other for other in doc["layers"] if other["name"] == layer["measured_as"])
            assert all(layer[key] == source[key] for key in SPLIT_KEYS)


def test_no_split_backward_timing_leaves_the_keys_out(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["profile", "gpt", "--layers", "1", "--width", "16", "--heads", "2",
                                       "--seq-len", "8", "--vocab-size", "32", "--micro-batch-sizes", "1",
                                       "--warmup", "0", "--repeats", "1", "--contention-processes", "0",
                                       "--no-recompute-timing", "--no-split-backward-timing", "--no-fixed-costs", "--quiet",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert not any(key in layer for layer in doc["layers"] for key in SPLIT_KEYS)
    assert "split_harness_backward_input_s" not in doc["measurement"]


def test_split_runs_count_toward_their_layers_phase() -> None:
    assert phase_of("b=4 block0 (split)") == "block0" and phase_of("split harness") is None


def test_show_prints_the_two_halves() -> None:
    doc = profile_model(ProfileRequest(spec=TINY_GPT, micro_batch_sizes=[2], warmup=0, repeats=1))
    buffer = io.StringIO()
    render_profile(doc, Console(file=buffer, width=160))
    text = buffer.getvalue()
    assert "kept" in text and "split backward: I + W take" in text


# --------------------------------------------------------------------------- reading
def _v6_profile() -> dict:
    return {"format": PROFILE_FORMAT, "version": 6, "model": model_spec("gpt"), "device": {"type": "cpu"},
            "micro_batch_sizes": [1, 2],
            "layers": [{"name": "a", "forward_s": [1e-3, 2e-3], "backward_s": [2e-3, 4e-3],
                        "activation_bytes": [10, 20], "output_bytes": [4, 8], "param_bytes": 100}]}


def test_a_version_6_profile_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_v6_profile()))
    doc = read_artifact(path, PROFILE_FORMAT)
    validate(doc, "profile", "profile 'old.json'")


@pytest.mark.parametrize("key, value, words", [
    ("weight_kept_bytes", [10], "one per micro-batch size"),
    ("backward_weight_s", [1e-3, -1.0], "backward_weight_s[1]"),
    ("backward_input_s", [1e-3, "fast"], "must be a number"),
])
def test_schema_checks_the_split_keys(key: str, value: list, words: str) -> None:
    doc = _v6_profile()
    doc["version"] = 7
    doc["layers"][0][key] = value
    with pytest.raises(BadInput, match=words.replace("[", r"\[").replace("]", r"\]")):
        validate(doc, "profile", "profile 'p.json'")
