"""Models larger than one process: built on meta, made real a layer at a time, measured once per kind."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gpipe_plan.cli import main
from gpipe_plan.models import (AsTuple, Classification, LayeredModel, Precision, build_model, built_whole,
                               layer_materialized, materialize_layers, model_spec, release_layers)
from gpipe_plan.profiles import profiler
from gpipe_plan.profiles.kinds import layer_kind
from gpipe_plan.profiles.profiler import ProfileRequest, profile_model
from helpers.handplan import hand_plan
from gpipe_plan.runtime.plan import load_plan
from gpipe_plan.runtime.stage import build_chunk

GPT = model_spec("gpt", layers=3, width=16, heads=2, seq_len=8, vocab_size=32)
RESNET = model_spec("resnet", blocks=[2, 1], width=8, image_size=8, num_classes=3)
SEQUENTIAL = """
    from torch import nn
    def make():
        return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))
"""
FAST = dict(warmup=0, repeats=1, layer_by_layer=True)


def real(model: LayeredModel, index: int) -> bool:
    params = list(model.layers[index][1].parameters())
    assert all(p.is_meta for p in params) or not any(p.is_meta for p in params), "a layer half real"
    return not any(p.is_meta for p in params)


def assert_same_values(a: LayeredModel, b: LayeredModel) -> None:
    ours, reference = b.module.state_dict(), a.module.state_dict()
    assert list(ours) == list(reference)
    for key, value in reference.items():
        assert torch.equal(ours[key], value), key


# --------------------------------------------------------------------------- materialising
@pytest.mark.parametrize("spec", [GPT, RESNET], ids=["gpt", "resnet"])
def test_any_layers_made_real_in_any_order_have_the_full_builds_values(spec: dict) -> None:
    full = build_model(spec, seed=5)
    assert built_whole(full) is None
    count = len(full.layers)
    for first in ([0], [count - 1], [1, 3]):
        part = build_model(spec, seed=5, materialize=first)
        assert [real(part, i) for i in range(count)] == [i in first for i in range(count)]
        rest = [i for i in reversed(range(count)) if i not in first]
        for i in rest:                     # one at a time, backwards: order must not matter
            materialize_layers(part, [i])
        assert_same_values(full, part)


def test_a_user_sequential_is_built_on_meta_too(user_module: Callable[[str], str]) -> None:
    spec = model_spec(f"{user_module(SEQUENTIAL)}:make", input_shape="6", num_classes=3)
    full, part = build_model(spec, seed=1), build_model(spec, seed=1, materialize=[2])
    assert built_whole(full) is None and real(part, 2) and not real(part, 0)
    materialize_layers(part, [4, 0])
    assert_same_values(full, part)
    assert not torch.equal(full.module[0].weight, build_model(spec, seed=2).module[0].weight)


def test_a_layer_never_made_real_stays_on_meta_and_one_given_back_returns_alike() -> None:
    model = build_model(GPT, seed=0, materialize=[1])
    qkv = model.module.blocks[1].attn.qkv.weight          # block1 is layer 2
    assert qkv.is_meta and qkv.untyped_storage().data_ptr() == 0
    before = model.module.blocks[0].attn.qkv.weight
    values = before.detach().clone()
    release_layers(model, [1])
    assert before.is_meta and model.module.blocks[0].attn.qkv.weight is before   # same object, no memory
    with layer_materialized(model, 1) as layer:
        assert torch.equal(before, values) and layer is model.layers[1][1]
    assert before.is_meta                                  # given back after the block
    materialize_layers(model, [1])
    assert torch.equal(before, values)


def test_a_cast_model_is_initialised_in_fp32_then_cast() -> None:
    reference = build_model(GPT, seed=0)
    Precision("bf16", "bf16").cast(reference)
    lazy = build_model(GPT, seed=0, materialize=())
    Precision("bf16", "bf16").cast(lazy)
    materialize_layers(lazy, range(len(lazy.layers)))
    assert lazy.module.head.proj.weight.dtype == torch.bfloat16
    assert_same_values(reference, lazy)


CUSTOM_INIT = {
    "init function": "nn.init.zeros_(net[2].bias)",
    "write through .data": "net[0].weight.data.normal_(0, 0.01)",
}


@pytest.mark.parametrize("how", list(CUSTOM_INIT))
def test_a_constructor_initialising_its_own_way_is_built_whole(user_module: Callable[[str], str], how: str) -> None:
    name = user_module(f"""
        from torch import nn
        def make():
            net = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
            {CUSTOM_INIT[how]}
            return net
    """)
    model = build_model(model_spec(f"{name}:make", input_shape="6", num_classes=3), seed=0, materialize=[0])
    assert "otherwise than its reset_parameters()" in (built_whole(model) or "")
    assert not any(p.is_meta for p in model.module.parameters())   # built whole: every layer real
    if how == "init function":
        assert torch.equal(model.module[2].bias, torch.zeros(3))    # the user's own initial values


def test_a_module_without_reset_parameters_is_built_whole_unless_the_model_says_how(
        user_module: Callable[[str], str]) -> None:
    source = """
        import torch
        from torch import nn
        class Scale(nn.Module):
            def __init__(self):
                super().__init__()
                self.gain = nn.Parameter(torch.ones(6))
            def forward(self, x):
                return x * self.gain
        class Declared(nn.Sequential):
            def _init_weights(self, module):
                if isinstance(module, Scale):
                    nn.init.ones_(module.gain)
        def plain():
            return nn.Sequential(Scale(), nn.Linear(6, 3))
        def declared():
            return Declared(Scale(), nn.Linear(6, 3))
    """
    name = user_module(source)
    plain = build_model(model_spec(f"{name}:plain", input_shape="6", num_classes=3))
    assert "no reset_parameters()" in (built_whole(plain) or "")
    spec = model_spec(f"{name}:declared", input_shape="6", num_classes=3)
    declared = build_model(spec, seed=0, materialize=[0])
    assert built_whole(declared) is None and real(declared, 0) and not real(declared, 1)
    assert torch.equal(declared.module[0].gain, torch.ones(6))
    materialize_layers(declared, [1])     # nn.Linear: the root's _init_weights leaves it to reset_parameters()
    assert_same_values(build_model(spec, seed=0), declared)


# --------------------------------------------------------------------------- a run
def test_a_stage_makes_only_its_own_layers_real(tmp_path: Path) -> None:
    """What `run` does on each rank: the other stage's parameters never take memory."""
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(hand_plan(GPT, [2, 3], micro_batches=2, micro_batch_size=2, with_shapes=False)))
    plan = load_plan(str(plan_path))
    full = build_model(GPT, seed=4).module.state_dict()
    for k, mine in ((0, range(0, 2)), (1, range(2, 5))):
        model = build_model(GPT, seed=4, materialize=())       # as runtime/train.py builds it
        Precision().cast(model)
        stage = build_chunk(model, plan, k)
        assert [real(model, i) for i in range(5)] == [i in mine for i in range(5)]
        held = sum(p.numel() for p in model.module.parameters() if not p.is_meta)
        assert held == sum(p.numel() for p in stage.parameters()) < sum(p.numel() for p in model.module.parameters())
        for key, value in stage.state_dict().items():
            assert torch.equal(value, full[key]), key
        # The plan carried no shapes: they were read off a run through the earlier stage.
        assert stage.input_meta[0].shape == ((2, 8) if k == 0 else (2, 8, 16))


# --------------------------------------------------------------------------- profiling
def test_layers_alike_are_measured_once_and_share_the_figures() -> None:
    doc = profile_model(ProfileRequest(spec=GPT, micro_batch_sizes=[1, 2], **FAST))
    layers = {layer["name"]: layer for layer in doc["layers"]}
    assert [layer["measured_as"] for layer in doc["layers"]] == [None, None, "block0", "block0", None]
    for name in ("block1", "block2"):
        for key in ("forward_s", "backward_s", "activation_bytes", "output_bytes", "optimizer_s",
                    "recompute_forward_s", "recompute_backward_s", "output_shapes", "param_bytes"):
            assert layers[name][key] == layers["block0"][key], key
    assert doc["measurement"]["shared_figures"] is True and doc["measurement"]["built_whole"] is None
    assert doc["consistency"]["layer_sum_s"][0] == pytest.approx(
        sum(layer["forward_s"][0] + layer["backward_s"][0] for layer in doc["layers"]))


def test_a_model_that_fits_is_timed_whole_every_layer_in_the_same_rounds() -> None:
    """The default below 1 GiB of parameters: no sharing, the whole model's step beside the layers."""
    doc = profile_model(ProfileRequest(spec=GPT, micro_batch_sizes=[1, 2], warmup=0, repeats=1))
    assert doc["measurement"]["layer_by_layer"] is False and doc["measurement"]["shared_figures"] is False
    assert [layer["measured_as"] for layer in doc["layers"]] == [None] * 5
    assert doc["consistency"]["model_step_s"][0] > 0


def test_kinds_tell_apart_what_costs_differently() -> None:
    from gpipe_plan.models.gpt import CausalSelfAttention

    resnet = build_model(RESNET)
    doc = profile_model(ProfileRequest(spec=RESNET, micro_batch_sizes=[2], **FAST))
    # stage1.block1 repeats stage1.block0; stage2.block0 halves the image: its own kind.
    assert [layer["measured_as"] for layer in doc["layers"]] == [None, None, "stage1.block0", None, None]
    assert [n for n, _ in resnet.layers] == [layer["name"] for layer in doc["layers"]]
    x = (torch.randn(2, 4, 16),)
    two, four = AsTuple(CausalSelfAttention(16, 2)), AsTuple(CausalSelfAttention(16, 4))
    with torch.no_grad():
        kinds = [layer_kind(layer, [x], [layer(*x)], first=False, last=False) for layer in (two, four, two)]
    assert kinds[0] == kinds[2] != kinds[1]       # same shapes, another head count


def test_measure_every_layer_gives_the_same_layers(user_dir: Path) -> None:
    args = ["profile", "gpt", "--layer-by-layer", "--layers", "3", "--width", "16", "--heads", "2", "--seq-len", "8",
            "--vocab-size", "32", "--micro-batch-sizes", "1,2", "--warmup", "0", "--repeats", "1",
            "--contention-processes", "0", "--no-recompute-timing", "--no-fixed-costs"]
    shared = CliRunner().invoke(main, [*args, "--out", "shared.json"])
    every = CliRunner().invoke(main, [*args, "--measure-every-layer", "--out", "every.json"])
    assert shared.exit_code == 0 and every.exit_code == 0, shared.output + every.output
    assert "measured 3 distinct layers of 5; 2 share their figures" in shared.output
    assert "measured all 5 layers" in every.output
    a, b = json.loads(Path("shared.json").read_text()), json.loads(Path("every.json").read_text())
    assert [layer["measured_as"] for layer in b["layers"]] == [None] * 5
    for x, y in zip(a["layers"], b["layers"]):
        for key in ("name", "param_bytes", "activation_bytes", "output_bytes", "output_shapes", "output_dtypes"):
            assert x[key] == y[key], (x["name"], key)


def test_profiling_holds_one_layer_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[LayeredModel] = []

    def build_and_keep(*args: object, **kwargs: object) -> LayeredModel:
        built.append(build_model(*args, **kwargs))   # type: ignore[arg-type]
        return built[-1]

    class Watch:
        most = 0

        def begin(self, total: int) -> None:
            pass

        def step(self, description: str) -> None:
            model = built[0]
            self.most = max(self.most, sum(real(model, i) for i in range(len(model.layers))))

    monkeypatch.setattr(profiler, "build_model", build_and_keep)
    watch = Watch()
    doc = profile_model(ProfileRequest(spec=GPT, micro_batch_sizes=[1, 2], whole_model_check=False, **FAST), watch)
    assert watch.most == 1 and "consistency" not in doc
    assert not any(real(built[0], i) for i in range(len(built[0].layers)))    # all given back at the end


def test_contention_times_one_layer() -> None:
    from gpipe_plan.profiles.contention import measure_contention

    out = measure_contention(GPT, micro_batch_size=2, processes=2, seconds=0.05, cycles=2, layer=2)
    assert out["layer"] == "block1" and out["alone_step_s"] > 0 and len(out["cycle_ratios"]) == 2


def test_a_model_built_whole_says_so_and_still_profiles(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        from torch import nn
        def make():
            net = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
            nn.init.zeros_(net[2].bias)
            return net
    """)
    result = CliRunner().invoke(main, ["profile", f"{name}:make", "--input-shape", "6", "--num-classes", "3",
                                       "--micro-batch-sizes", "1", "--warmup", "0", "--repeats", "1",
                                       "--contention-processes", "0", "--no-fixed-costs", "--out", "p.json"])
    assert result.exit_code == 0, result.output
    assert "built whole" in result.output
    assert "reset_parameters" in json.loads(Path("p.json").read_text())["measurement"]["built_whole"]


def test_a_hand_made_layered_model_is_real_as_it_is() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = LayeredModel({"source": "import", "factory": "x:y"}, net, [("a", AsTuple(net[0])), ("b", AsTuple(net[1]))],
                         Classification((4,), torch.float32, 2))
    materialize_layers(model, [0, 1])     # nothing to do
    assert built_whole(model) and not any(p.is_meta for p in net.parameters())
