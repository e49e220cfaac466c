"""Models for gpipe-plan: built-ins and users' own, each cut into a sequence of layers.

The profiler measures the layers, the planner balances them into stages, the runtime runs
them; all three see a model only as a :class:`LayeredModel`, built from a JSON spec::

    spec = model_spec("gpt", layers=4)             # or "resnet", or "pkg.module:factory"
    model = build_model(spec, seed=0)              # same spec and seed: same parameters, bit for bit
    part = build_model(spec, seed=0, materialize=[1, 2])   # only layers 1 and 2 real, the rest on meta
    inputs, targets = model.synthetic_batch(8, torch.Generator().manual_seed(0))
    xs = inputs
    for name, layer in model.layers:               # layer(*xs) -> tuple of tensors
        xs = layer(*xs)
    model.loss(xs, targets).backward()
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from ..artifacts import BadInput
from . import gpt, resnet, user
from .data import Classification, NextToken, SyntheticData
from .layered import AsTuple, LayeredModel, as_tuple
from .materialize import (build_on_meta, built_whole, forward_streamed, layer_materialized, materialize_layers,
                          release_layers)
from .precision import Precision
from .spec import BUILTINS, IMPORT_OPTIONS, is_language_model, model_spec

__all__ = [
    "BUILTINS", "AsTuple", "Classification", "LayeredModel", "NextToken", "Precision", "SyntheticData",
    "as_tuple", "build_model", "built_whole", "forward_streamed", "layer_materialized", "materialize_layers",
    "is_language_model", "model_spec", "release_layers",
]

_BUILDERS = {"gpt": gpt.build, "resnet": resnet.build}


def build_model(spec: dict[str, Any], seed: int = 0, materialize: Collection[int] | None = None,
                announce: Callable[[str], None] | None = None) -> LayeredModel:
    """Construct the model ``spec`` describes, with the initial parameters ``seed`` gives it.

    Every process that calls this with the same spec and seed gets bit-identical parameters,
    which is how the ranks of a pipeline agree on the initial model without sending it.
    The model is on the CPU, in float32, in training mode.

    ``materialize``: None (the default) makes every parameter real. A collection of layer
    indices makes only those layers' parameters real and leaves the others on the ``meta``
    device, taking no memory, for :func:`materialize_layers` to make real later: a layer's
    values never depend on which others are real (models/materialize.py). A model that cannot
    be built that way is built whole, every parameter real (:func:`built_whole` says why).

    ``announce``: told, in one line, each slow phase of the build as it begins (a capture
    with ``torch.export``), for the profiler's phase lines (profiles/phases.py).
    """
    builder = _builder(spec, announce)
    model = build_on_meta(builder, seed)
    model.module.train()
    everything = materialize is None
    materialize_layers(model, range(len(model.layers)) if everything else materialize, unused=everything)
    return model


def _builder(spec: dict[str, Any], announce: Callable[[str], None] | None = None) -> Callable[[], LayeredModel]:
    """The checked spec's builder, ready to call (BadInput for a spec that names no model)."""
    source = spec.get("source") if isinstance(spec, dict) else None
    if source == "builtin":
        name = spec.get("name")
        if name not in _BUILDERS:
            raise BadInput(f"unknown built-in model '{name}': the built-ins are {', '.join(BUILTINS)}")
        # Re-validate: a spec may come from a hand-edited file; model_spec fills defaults too.
        checked = model_spec(name, **spec.get("options", {}))
        build = _BUILDERS[name]
    elif source == "import":
        checked = model_spec(str(spec.get("factory")), **{k: spec.get(k) for k in IMPORT_OPTIONS})
        return lambda: user.build(checked, announce)
    elif source == "pipedream":
        raise BadInput(f"model '{spec.get('name')}' comes from an imported PipeDream profile: "
                       f"it can be planned, but there is no PyTorch model to run")
    else:
        raise BadInput(f"not a model spec: source is {source!r}, expected 'builtin' or 'import'")
    return lambda: build(checked)
