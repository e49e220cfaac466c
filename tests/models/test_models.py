"""Models: specs, deterministic construction, and cutting models into layers."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gpipe_plan.artifacts import BadInput
from gpipe_plan.models import Classification, LayeredModel, build_model, is_language_model, model_spec
from gpipe_plan.models.user import split

from helpers.user_models import SKIP_NET

TINY_GPT = {"layers": 2, "width": 32, "heads": 2, "seq_len": 8, "vocab_size": 256}
TINY_RESNET = {"blocks": [1, 1], "width": 8, "image_size": 8, "num_classes": 5}

def run_layers(model: LayeredModel, batch: int = 3) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    inputs, _ = model.synthetic_batch(batch, torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.forward(*inputs), model.forward_layers(*inputs)


# --------------------------------------------------------------------------- specs
def test_spec_fills_defaults_and_keeps_given_options() -> None:
    spec = model_spec("gpt", layers=2, width=None)
    assert spec == {"source": "builtin", "name": "gpt",
                    "options": {"layers": 2, "width": 128, "heads": 4, "seq_len": 64, "vocab_size": 256}}
    assert model_spec("resnet", blocks="1,2")["options"]["blocks"] == [1, 2]


@pytest.mark.parametrize("model, options, words", [
    ("bert", {}, "unknown model 'bert'"),
    ("gpt", {"blocks": "1,2"}, "--blocks does not apply"),
    ("gpt", {"width": 30, "heads": 4}, "not divisible"),
    ("resnet", {"blocks": "2,x"}, "--blocks"),
    ("nosuchpackage_zz.models:make", {"input_shape": "8", "num_classes": 3},
     "No module named 'nosuchpackage_zz': run from the folder that holds the package nosuchpackage_zz/, or add "
     "that folder to PYTHONPATH"),
    ("nosuchmodule_zz:make", {"input_shape": "8", "num_classes": 3}, "holds nosuchmodule_zz.py, or add that folder"),
    ("os:path", {"num_classes": 3}, "needs --input-shape"),
    ("os:getcwd", {"input_shape": "8", "num_classes": 3, "layers": 2}, "applies to the built-ins only"),
    ("os:getcwd", {"input_shape": "8", "num_classes": 3, "input_dtype": "int64"}, "needs --vocab-size"),
    ("os:nothing_here", {"input_shape": "8", "num_classes": 3}, "has no 'nothing_here'"),
])
def test_bad_specs_are_one_line(model: str, options: dict, words: str) -> None:
    with pytest.raises(BadInput) as info:
        model_spec(model, **options)
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_a_module_that_imports_a_missing_package_says_to_install_it(user_module) -> None:
    name = user_module("import nosuchdependency_zz\n")
    with pytest.raises(BadInput, match=f"'{name}' imports 'nosuchdependency_zz', which this Python does not have: "
                                       f"install it"):
        model_spec(f"{name}:make", input_shape="8", num_classes=3)


# --------------------------------------------------------------------------- built-ins
@pytest.mark.parametrize("name, options", [("gpt", TINY_GPT), ("resnet", TINY_RESNET)])
def test_builtin_layers_compute_the_whole_model(name: str, options: dict) -> None:
    model = build_model(model_spec(name, **options))
    whole, layered = run_layers(model)
    assert len(whole) == len(layered) == 1
    torch.testing.assert_close(whole[0], layered[0], rtol=0, atol=0)


@pytest.mark.parametrize("name, options", [("gpt", TINY_GPT), ("resnet", TINY_RESNET)])
def test_same_seed_same_parameters_bit_for_bit(name: str, options: dict) -> None:
    spec = model_spec(name, **options)
    a, b, c = build_model(spec, seed=3), build_model(spec, seed=3), build_model(spec, seed=4)
    for (key, x), (_, y), (_, z) in zip(a.module.state_dict().items(), b.module.state_dict().items(),
                                        c.module.state_dict().items()):
        assert torch.equal(x, y), key
    assert any(not torch.equal(x, z) for x, z in zip(a.module.parameters(), c.module.parameters()))


@pytest.mark.parametrize("name, options", [("gpt", TINY_GPT), ("resnet", TINY_RESNET)])
def test_layers_share_the_modules_parameters(name: str, options: dict) -> None:
    model = build_model(model_spec(name, **options))
    keys = model.param_keys()
    used = [id(p) for _, layer in model.layers for p in layer.parameters()]
    assert sorted(used) == sorted(keys)  # every parameter in exactly one layer, no copies
    assert model.layer_param_keys(0)[0] in model.module.state_dict()


def test_layer_names() -> None:
    gpt = build_model(model_spec("gpt", **TINY_GPT))
    assert [n for n, _ in gpt.layers] == ["embed", "block0", "block1", "head"]
    resnet = build_model(model_spec("resnet", **TINY_RESNET))
    assert [n for n, _ in resnet.layers] == ["stem", "stage1.block0", "stage2.block0", "head"]


def test_gpt_batch_is_next_token_prediction() -> None:
    model = build_model(model_spec("gpt", **TINY_GPT))
    (ids,), targets = model.synthetic_batch(4, torch.Generator().manual_seed(0))
    (again,), _ = model.synthetic_batch(4, torch.Generator().manual_seed(0))
    assert ids.dtype == torch.int64 and ids.shape == targets.shape == (4, 8)
    assert torch.equal(ids, again)
    assert torch.equal(ids[:, 1:], targets[:, :-1])  # each target is the next input token
    loss = model.loss(model.forward(ids), targets)
    assert loss.dim() == 0 and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_resnet_has_no_batch_statistics() -> None:
    """A sample's output must not depend on the other samples: micro-batching stays exact."""
    model = build_model(model_spec("resnet", **TINY_RESNET))
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.module.modules())
    (x,), _ = model.synthetic_batch(4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        together = model.forward(x)[0]
        apart = torch.cat([model.forward(x[i:i + 1])[0] for i in range(4)])
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- user models
def test_user_sequential_splits_at_children(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        from torch import nn
        def make():
            return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    """)
    model = build_model(model_spec(f"{name}:make", input_shape="6", num_classes=3))
    assert [n for n, _ in model.layers] == ["0", "1", "2"]
    whole, layered = run_layers(model)
    torch.testing.assert_close(whole[0], layered[0], rtol=0, atol=0)
    assert all(isinstance(out, tuple) for out in model.check(batch_size=2))


def test_traced_skip_connection_crosses_the_cuts(user_module: Callable[[str], str]) -> None:
    name = user_module(SKIP_NET)
    model = build_model(model_spec(f"{name}:make", input_shape=[8], num_classes=4))
    assert [n for n, _ in model.layers] == ["fc1", "fc2", "fc3", "out"]
    outputs = model.check(batch_size=2)
    # After fc2 the cut carries relu(fc2(h)) *and* the skipped h; after fc3 they are added.
    assert [[tuple(t.shape) for t in out] for out in outputs] == [[(2, 16)], [(2, 16), (2, 16)], [(2, 16)], [(2, 4)]]
    whole, layered = run_layers(model)
    torch.testing.assert_close(whole[0], layered[0], rtol=0, atol=0)


def test_traced_shared_weights_stay_in_one_layer() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.a(self.b(self.a(x))))  # a used twice, around b

    model = Shared()
    layers = split(model)
    assert [n for n, _ in layers] == ["a..a_1", "c"]
    x = torch.randn(3, 4)
    with torch.no_grad():
        xs = (x,)
        for _, layer in layers:
            xs = layer(*xs)
        torch.testing.assert_close(xs[0], model(x), rtol=0, atol=0)


def test_a_cut_at_that_matches_no_module_is_refused_and_one_a_sequential_ignores_is_noted() -> None:
    # (both were ignored without a word)
    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    with pytest.raises(BadInput, match=r"^--cut-at 'nomatch' matches no module of the model"):
        split(Blocks(), example_inputs=(torch.randn(2, 4),), cut_at="nomatch")
    names = [n for n, _ in split(Blocks(), example_inputs=(torch.randn(2, 4),), cut_at=r"layers\.\d+|inp|head")]
    assert names == ["inp", "layers.0", "layers.1", "layers.2", "head"]
    notes: list[str] = []
    assert len(split(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), "m:f", cut_at="x", notes=notes)) == 2
    assert notes == ["--cut-at is not used: 'm:f' is an nn.Sequential, cut at its children"]


def test_a_number_crossing_a_cut_is_refused() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.size(1)  # a Python int, made in the first layer, used in the last
            return self.b(self.a(x)) * n

    spec = {"source": "import", "factory": "test:scaled", "input_shape": [4], "num_classes": 2}
    module = Scaled()
    model = LayeredModel(spec, module, split(module), Classification((4,), torch.float32, 2))
    with pytest.raises(BadInput, match="only tensors can cross a cut"):
        model.check()


def test_untraceable_model_says_wrap_it_as_sequential(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        from torch import nn
        class Branchy(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 2)
            def forward(self, x):
                if x.sum() > 0:          # data-dependent control flow: fx cannot trace it
                    return self.fc(x)
                return self.fc(-x)
        def make():
            return Branchy()
    """)
    spec = model_spec(f"{name}:make", input_shape="4", num_classes=2)
    with pytest.raises(BadInput, match=r"torch.export cannot capture.*x.sum\(\) > 0.*wrap the model as an nn.Sequential"):
        build_model(spec)


@pytest.mark.parametrize("body, words", [
    ("def make():\n    raise RuntimeError('boom')", "raised RuntimeError: boom"),
    ("def make():\n    return 42", "returned an int, not a torch.nn.Module"),
])
def test_bad_factories(user_module: Callable[[str], str], body: str, words: str) -> None:
    name = user_module(body)
    with pytest.raises(BadInput, match=words):
        build_model(model_spec(f"{name}:make", input_shape="4", num_classes=2))


def test_input_shape_that_does_not_fit(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        from torch import nn
        def make():
            return nn.Sequential(nn.Linear(8, 3))
    """)
    model = build_model(model_spec(f"{name}:make", input_shape="7", num_classes=3))
    with pytest.raises(BadInput, match=r"input \[7\] float32 does not fit"):
        model.check()
    wrong_classes = build_model(model_spec(f"{name}:make", input_shape="8", num_classes=5))
    with pytest.raises(BadInput, match="expected logits"):
        wrong_classes.check()


def test_token_inputs_for_user_models(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        from torch import nn
        class Bag(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(50, 8)
                self.fc = nn.Linear(8, 3)
            def forward(self, ids):
                return self.fc(self.embed(ids).mean(dim=1))
        def make():
            return Bag()
    """)
    model = build_model(model_spec(f"{name}:make", input_shape="5", num_classes=3, input_dtype="int64",
                                   vocab_size=50))
    (ids,), targets = model.synthetic_batch(6, torch.Generator().manual_seed(0))
    assert ids.dtype == torch.int64 and ids.shape == (6, 5) and int(ids.max()) < 50
    assert targets.shape == (6,)
    model.check(batch_size=2)


def test_build_model_rebuilds_from_a_json_spec(user_module: Callable[[str], str]) -> None:
    import json

    name = user_module(SKIP_NET)
    spec = json.loads(json.dumps(model_spec(f"{name}:make", input_shape="8", num_classes=4)))
    a, b = build_model(spec, seed=1), build_model(spec, seed=1)
    for x, y in itertools.zip_longest(a.module.parameters(), b.module.parameters()):
        assert torch.equal(x, y)
    with pytest.raises(BadInput, match="can be planned"):
        build_model({"source": "pipedream", "name": "vgg16"})


def test_a_language_model_is_gpt_or_ones_own_under_loss_lm() -> None:
    """One answer (models.spec.is_language_model) for tokens/s and ``run --data FILE.txt``."""
    assert is_language_model(model_spec("gpt"))
    assert not is_language_model(model_spec("resnet"))
    own = {"source": "import", "factory": "pkg.m:make", "input_shape": [8], "input_dtype": "int64",
           "num_classes": None, "vocab_size": 256}
    assert is_language_model({**own, "loss": "lm"})
    assert not is_language_model({**own, "loss": "classify"})
    assert not is_language_model({"source": "pipedream", "name": "gpt"})   # an imported graph builds nothing
