"""The profiler: exact memory figures, the profile document, and bad input through the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from torch import nn

from gpipe_plan.artifacts import BadInput, write_json_atomic
from gpipe_plan.cli import main
from gpipe_plan.models import AsTuple, model_spec
from gpipe_plan.collectives import ring_allreduce_s
from gpipe_plan.profiles.command import parse_sizes
from gpipe_plan.profiles.link import fit_line, fit_ring, measure_link
from gpipe_plan.profiles.measure import prepare_layer
from gpipe_plan.tensor_memory import SavedTensors
from gpipe_plan.profiles.profiler import ProfileRequest, default_sizes, profile_model
from gpipe_plan.profiles.show import render_profile
from gpipe_plan.schema import FORMAT_VERSIONS, PROFILE_FORMAT, read_artifact, validate

from helpers.planner import profile_doc
from helpers.user_models import SKIP_NET

# The fixed-cost probe (a 2-process pipeline, seconds) has its own tests (tests/planner/test_fixedcosts.py).
# (contention, about 7 s of 2 processes by design, has its own tests: tests/profiles/test_contention.py)
FAST = ["--warmup", "0", "--repeats", "1", "--no-fixed-costs", "--contention-processes", "0"]


def profile(spec: dict, sizes: list[int], device: str = "cpu") -> dict:
    return profile_model(ProfileRequest(spec=spec, micro_batch_sizes=sizes, device=torch.device(device),
                                        warmup=0, repeats=1))


# --------------------------------------------------------------------------- activation bytes
@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_linear_saves_exactly_its_input(b: int, input_requires_grad: bool) -> None:
    """nn.Linear(i, o) keeps its input (b x i x 4 bytes in fp32) and its weight, which is a parameter."""
    i, o = 24, 5
    layer = nn.Linear(i, o)
    saved = SavedTensors(exclude=layer.parameters())
    x = torch.randn(b, i, requires_grad=input_requires_grad)
    with saved.recording():
        layer(x)
    assert saved.nbytes == b * i * 4


def test_prepare_layer_reports_linear_activation_and_output() -> None:
    b, i, o = 4, 24, 5
    figures, runner = prepare_layer("fc", AsTuple(nn.Linear(i, o)), (torch.randn(b, i),), first=False, loss=None)
    assert figures.activation_bytes == b * i * 4
    assert figures.output_bytes == b * o * 4 and figures.output_shapes == [[b, o]]
    runner.backward(runner.forward())  # the runner runs as the profiler times it


def test_saved_views_of_one_storage_count_once() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    saved = SavedTensors()
    with saved.recording():
        a, b = x.split(3, dim=1)
        (a * b).sum()  # saves both halves: two views of x's storage
    assert saved.nbytes == 4 * 6 * 4


@pytest.mark.parametrize("name, options", [
    ("gpt", {"layers": 2, "width": 32, "heads": 2, "seq_len": 8}),
    ("resnet", {"blocks": [1, 1], "width": 8, "image_size": 8}),
])
def test_builtin_activation_bytes_scale_linearly_with_batch(name: str, options: dict) -> None:
    doc = profile(model_spec(name, **options), [1, 2, 4])
    for layer in doc["layers"]:
        act = layer["activation_bytes"]
        # Proportional to b, up to a few scalars autograd keeps (the loss's total weight).
        assert act[0] > 0
        for b, value in zip(doc["micro_batch_sizes"], act):
            assert abs(value - b * act[0]) <= 0.001 * value + 16, (layer["name"], act)
        assert layer["output_bytes"] == [b * layer["output_bytes"][0] for b in (1, 2, 4)]


# --------------------------------------------------------------------------- the document
def test_user_model_profiles_through_the_import_path(user_module: Callable[[str], str],
                                                    user_dir: Path) -> None:
    i, o = 16, 12
    name = user_module(f"""
        from torch import nn
        def make():
            return nn.Sequential(nn.Linear({i}, {o}), nn.ReLU(), nn.Linear({o}, 3))
    """)
    out = user_dir / "profile.json"
    result = CliRunner().invoke(main, ["profile", f"{name}:make", "--input-shape", str(i), "--num-classes", "3",
                                       "--micro-batch-sizes", "1,2,4", "--out", str(out), *FAST])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["format"] == PROFILE_FORMAT and doc["version"] == FORMAT_VERSIONS[PROFILE_FORMAT]
    assert doc["model"] == {"source": "import", "factory": f"{name}:make", "input_shape": [i],
                            "input_dtype": "float32", "num_classes": 3, "vocab_size": None, "loss": "classify"}
    assert doc["device"]["type"] == "cpu" and doc["device"]["threads"] == 1
    assert doc["micro_batch_sizes"] == [1, 2, 4]
    first = doc["layers"][0]
    assert first["name"] == "0"
    assert first["activation_bytes"] == [b * i * 4 for b in (1, 2, 4)]
    assert first["output_bytes"] == [b * o * 4 for b in (1, 2, 4)]
    assert first["param_bytes"] == (i * o + o) * 4
    for layer in doc["layers"]:
        for key in ("forward_s", "backward_s", "activation_bytes", "output_bytes"):
            assert len(layer[key]) == 3 and all(v >= 0 for v in layer[key])
    assert doc["input_bytes"] == [b * i * 4 for b in (1, 2, 4)]
    consistency = doc["consistency"]
    assert len(consistency["ratio"]) == 3
    assert consistency["ratio"][0] == pytest.approx(consistency["layer_sum_s"][0] / consistency["model_step_s"][0])


def test_traced_skip_connection_counts_in_cut_bytes(user_module: Callable[[str], str]) -> None:
    name = user_module(SKIP_NET)
    doc = profile(model_spec(f"{name}:make", input_shape="8", num_classes=4), [1, 2])
    by_name = {layer["name"]: layer for layer in doc["layers"]}
    # The cut after fc2 carries relu(fc2(h)) and the skipped h: 16 + 16 floats per sample.
    assert by_name["fc2"]["output_bytes"] == [b * (16 + 16) * 4 for b in (1, 2)]
    assert by_name["fc2"]["output_shapes"] == [[16], [16]]
    assert by_name["fc1"]["output_bytes"] == [b * 16 * 4 for b in (1, 2)]
    assert by_name["fc3"]["output_bytes"] == [b * 16 * 4 for b in (1, 2)]


def test_sizes() -> None:
    assert default_sizes(8) == [1, 2, 4, 8]
    assert default_sizes(12) == [1, 2, 4, 8, 12]
    assert default_sizes(1) == [1]
    assert parse_sizes(None, None) == ([1, 2, 4, 8], 8)
    assert parse_sizes("4,1, 2", None) == ([1, 2, 4], 4)
    assert parse_sizes("1,8", 8) == ([1, 8], 8)
    for text, batch in (("1,x", None), ("0,2", None), ("1,16", 8), ("1,2", 8), ("4,1,2,2", None), ("1,,2", None),
                        ("1,2,", None), ("", None)):
        with pytest.raises(BadInput):
            parse_sizes(text, batch)


class _Steps:
    def __init__(self) -> None:
        self.total, self.names = 0, []

    def begin(self, total: int) -> None:
        self.total = total

    def step(self, description: str) -> None:
        self.names.append(description)


def test_every_size_is_timed_in_the_same_rounds() -> None:
    """A slow spell must land on all sizes alike: round 1 runs every size before round 2 starts."""
    spec = model_spec("gpt", layers=1, width=16, heads=2, seq_len=8, vocab_size=32)
    steps = _Steps()
    doc = profile_model(ProfileRequest(spec=spec, micro_batch_sizes=[1, 2], warmup=1, repeats=2), steps)
    whole = [name for name in steps.names if name.endswith("whole model")]
    # Forward and backward of the whole model, per size and round: b=1, b=2, then again.
    assert whole == ["b=1 whole model"] * 2 + ["b=2 whole model"] * 2 + ["b=1 whole model"] * 2 \
        + ["b=2 whole model"] * 2 + ["b=1 whole model"] * 2 + ["b=2 whole model"] * 2
    assert len(steps.names) == steps.total   # the progress bar ends full
    # A layer's time is its timing less the empty harness's, clamped at 0: on a loaded host the
    # harness's noise can swamp a layer of a few microseconds (CI saw the embedding at 0). So each
    # figure is >= 0 and each size's model, a few hundred microseconds, is timed above 0.
    for key in ("forward_s", "recompute_backward_s"):
        per_size = [layer[key] for layer in doc["layers"]]
        assert all(len(times) == 2 and all(t >= 0 for t in times) for times in per_size)
        assert all(sum(times[i] for times in per_size) > 0 for i in range(2))


# --------------------------------------------------------------------------- bad input
BAD_FACTORIES = {
    "raises": "def make():\n    raise ValueError('no such layer size')\n",
    "not_a_module": "def make():\n    return {'weights': 1}\n",
    "sequential": "from torch import nn\ndef make():\n    return nn.Sequential(nn.Linear(8, 3))\n",
}


@pytest.mark.parametrize("case, words", [
    ("unknown built-in", "unknown model"),
    ("import fails", "cannot import"),
    ("factory raises", "raised ValueError"),
    ("not a module", "not a torch.nn.Module"),
    ("shape does not fit", "does not fit"),
    ("no such device", "not one of cpu, cuda"),
    ("cuda without a GPU", "no CUDA GPU"),
])
def test_bad_input_exits_2_in_one_line_without_a_file(user_module: Callable[[str], str], user_dir: Path,
                                                     case: str, words: str) -> None:
    if case == "cuda without a GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    names = {key: user_module(body) for key, body in BAD_FACTORIES.items()}
    user = ["--num-classes", "3", "--input-shape", "8"]
    args = {
        "unknown built-in": ["bert"],
        "import fails": ["no_such_package_zz.models:make", *user],
        "factory raises": [f"{names['raises']}:make", *user],
        "not a module": [f"{names['not_a_module']}:make", *user],
        "shape does not fit": [f"{names['sequential']}:make", "--num-classes", "3", "--input-shape", "3,32,32"],
        "no such device": ["gpt", "--device", "tpu"],
        "cuda without a GPU": ["gpt", "--device", "cuda"],
    }[case]
    out = user_dir / "profile.json"
    result = CliRunner().invoke(main, ["profile", *args, "--out", str(out), *FAST])
    assert result.exit_code == 2, result.output
    # The error is one line, the last; the phase lines before it say how far the profile got.
    *phases, error = result.stderr.strip().splitlines()
    assert words in error and all(line.startswith("profiling [") for line in phases), result.stderr
    assert "Traceback" not in result.output
    assert not out.exists()
    assert not list(user_dir.glob(".profile.json.*"))  # no temporary file left behind either


def test_profile_help_does_not_need_torch() -> None:
    code = ("import sys; from click.testing import CliRunner; from gpipe_plan.cli import main; "
            "from gpipe_plan.profiles.show import render_profile; "
            "r = CliRunner().invoke(main, ['profile', '--help']); assert r.exit_code == 0, r.output; "
            "assert '--micro-batch-sizes' in r.output and '--layer-by-layer' in r.output, r.output; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- show
def test_render_profile_handles_a_minimal_imported_profile() -> None:
    doc = {"format": PROFILE_FORMAT, "version": 1, "model": {"source": "pipedream", "name": "vgg16"},
           "device": {"type": "gpu", "name": "V100"}, "micro_batch_sizes": [32],
           "layers": [{"name": "conv1", "forward_s": [0.002], "backward_s": [0.004], "activation_bytes": [1 << 20],
                       "output_bytes": [1 << 19], "param_bytes": 7000}]}
    console = Console(record=True, width=100)
    render_profile(doc, console)
    text = console.export_text()
    assert "conv1" in text and re.search(r"forward ms\s+backward ms\s+saved MiB", text)   # units in the heading
    assert re.search(r"conv1\s+2\.00\s+4\.00\s+1\.00\s", text)


# --------------------------------------------------------------------------- link
def test_fit_line_recovers_latency_and_bandwidth() -> None:
    sizes = [4, 1024, 1 << 16, 1 << 20]
    latency, bandwidth = fit_line(sizes, [20e-6 + s / 2e9 for s in sizes])
    assert latency == pytest.approx(20e-6, rel=1e-6) and bandwidth == pytest.approx(2e9, rel=1e-6)


@pytest.mark.parametrize("processes", [2, 4, 8])
def test_fit_ring_recovers_latency_per_step_and_bus_bandwidth(processes: int) -> None:
    """All-reduce times made by hand from the ring model: 2(d-1) steps of 30 us, and 2(d-1)/d of
    each message through every process at 5 GB/s; the fit gives both figures back."""
    d = processes
    sizes = [4, 1 << 14, 1 << 18, 1 << 20, 1 << 24]
    seconds = [2 * (d - 1) * 30e-6 + 2 * (d - 1) / d * size / 5e9 for size in sizes]
    latency, bandwidth = fit_ring(sizes, seconds, d)
    assert latency == pytest.approx(30e-6, rel=1e-6) and bandwidth == pytest.approx(5e9, rel=1e-6)


def test_fit_ring_gives_the_planner_formula_back_its_measured_times() -> None:
    """The fit and the planner's ring formula are one model: with the fitted figures, the formula
    predicts the measured points (here noisy ones) as well as a least-squares line can."""
    sizes = [4, 1 << 16, 1 << 20, 1 << 22]
    seconds = [0.0003, 0.0004, 0.0027, 0.0103]
    latency, bandwidth = fit_ring(sizes, seconds, 2)
    predicted = [ring_allreduce_s(size, 2, bandwidth, latency) for size in sizes]
    assert sum(predicted) == pytest.approx(sum(seconds), rel=1e-9)   # least squares: residuals sum to 0
    assert all(p == pytest.approx(s, rel=0.25) for p, s in zip(predicted[1:], seconds[1:]))


def test_fit_ring_of_flat_times_has_no_cost_per_byte() -> None:
    latency, bandwidth = fit_ring([4, 1 << 20], [1e-4, 1e-4], 2)
    assert bandwidth == float("inf") and latency == pytest.approx(1e-4 / 2)


def test_measure_link_between_two_cpu_processes(tmp_path: Path) -> None:
    """One launch of two gloo processes: the ping-pong and the all-reduce, both fitted, positive,
    finite, and a profile holding them is valid JSON that the schema and the planner accept."""
    link = measure_link(torch.device("cpu"), sizes=(4, 1 << 16, 1 << 20), repeats=3, warmup=1,
                        allreduce_sizes=(4, 1 << 20, 1 << 22), allreduce_repeats=3)
    assert link["backend"] == "gloo"
    assert link["latency_s"] >= 0 and link["bandwidth_bytes_per_s"] > 0
    assert len(link["one_way_s"]) == 3
    assert link["allreduce_processes"] == 2 and link["allreduce_message_bytes"] == [4, 1 << 20, 1 << 22]
    assert len(link["allreduce_s"]) == 3 and all(0 < t < 10 for t in link["allreduce_s"])
    # A latency fitted under noise may clamp at 0. So may the cost per byte: on a busy host (the
    # suite's other worker beside it) a 4-byte all-reduce once took as long as a 4 MiB one, and a
    # slope that is not positive fits an infinite bandwidth (fit_line), which a profile stores as
    # null ("no cost per byte").
    assert 0 <= link["allreduce_latency_s"] < 1 and link["allreduce_bandwidth_bytes_per_s"] > 0
    doc = profile_doc(L=1, sizes=(1,), link=link)
    write_json_atomic(tmp_path / "p.json", doc)
    back = read_artifact(tmp_path / "p.json", PROFILE_FORMAT)
    validate(back, "profile", "profile")
    stored = {k: (None if v == float("inf") else v) for k, v in link.items() if k.startswith("allreduce")}
    assert {k: v for k, v in back["link"].items() if k.startswith("allreduce")} == stored


@pytest.mark.parametrize("key, value, problem", [
    ("allreduce_latency_s", -1e-6, "must be a number"),
    ("allreduce_processes", 1, "must be an integer"),
    ("allreduce_s", [1e400], "must be a finite number"),
])
def test_schema_refuses_a_bad_allreduce_figure(key: str, value: object, problem: str) -> None:
    doc = profile_doc(L=1, sizes=(1,))
    doc["link"] = {key: value}   # after profile_doc, which checks what it builds
    with pytest.raises(BadInput, match=f"'link.{key}.*' {problem}"):
        validate(doc, "profile", "profile 'p.json'")


def test_show_prints_the_all_reduce() -> None:
    doc = profile_doc(L=1, sizes=(1,), link={"backend": "gloo", "latency_s": 5e-5, "bandwidth_bytes_per_s": 4e9,
                                             "allreduce_processes": 2, "allreduce_latency_s": 8e-5,
                                             "allreduce_bandwidth_bytes_per_s": 1.1e9})
    console = Console(record=True, width=200)
    render_profile(doc, console)
    assert "all-reduce over 2 processes (ring): latency 80.0 µs per step, bus bandwidth 1.10 GB/s" in console.export_text()


# --------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_gpt_on_cuda_uses_events_and_reports_peak_memory() -> None:
    doc = profile(model_spec("gpt", layers=2, width=64, heads=2, seq_len=16), [1, 2], device="cuda")
    assert doc["device"]["type"] == "cuda"
    assert doc["measurement"]["timer"] == "cuda_events"
    for layer in doc["layers"]:
        assert len(layer["peak_transient_bytes"]) == 2 and all(v >= 0 for v in layer["peak_transient_bytes"])
        assert all(t > 0 for t in layer["forward_s"] + layer["backward_s"])
    assert doc["layers"][1]["activation_bytes"][1] == 2 * doc["layers"][1]["activation_bytes"][0]
