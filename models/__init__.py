"""Models for gpipe-plan: built-ins and users' own, each cut into a sequence of layers.

The profiler measures the layers, the planner balances them into stages, the runtime runs
them; all three see a model only as a :class:`LayeredModel`, built from a JSON spec::

    spec = model_spec("gpt", layers=4)             # or "resnet", or "pkg.module:factory"
    model = build_model(spec, seed=0)              # same spec and seed: same parameters, bit for bit
    inputs, targets = model.synthetic_batch(8, torch.Generator().manual_seed(0))
    xs = inputs
    for name, layer in model.layers:               # layer(*xs) -> tuple of tensors
        xs = layer(*xs)
    model.loss(xs, targets).backward()
"""

from __future__ import annotations

from typing import Any

import torch

from ..artifacts import BadInput
from . import gpt, resnet, user
from .data import Classification, NextToken, SyntheticData
from .layered import AsTuple, LayeredModel, as_tuple
from .precision import Precision
from .spec import BUILTINS, IMPORT_OPTIONS, model_spec

__all__ = [
    "BUILTINS", "AsTuple", "Classification", "LayeredModel", "NextToken", "Precision", "SyntheticData",
    "as_tuple", "build_model", "model_spec",
]

_BUILDERS = {"gpt": gpt.build, "resnet": resnet.build}


def build_model(spec: dict[str, Any], seed: int = 0) -> LayeredModel:
    """Construct the model ``spec`` describes, its parameters drawn after ``torch.manual_seed(seed)``.

    Every process that calls this with the same spec and seed gets bit-identical parameters,
    which is how the ranks of a pipeline agree on the initial model without sending it.
    The model is on the CPU, in float32, in training mode.
    """
    source = spec.get("source") if isinstance(spec, dict) else None
    if source == "builtin":
        name = spec.get("name")
        if name not in _BUILDERS:
            raise BadInput(f"unknown built-in model '{name}': the built-ins are {', '.join(BUILTINS)}")
        # Re-validate: a spec may come from a hand-edited file; model_spec fills defaults too.
        spec = model_spec(name, **spec.get("options", {}))
        builder = _BUILDERS[name]
    elif source == "import":
        spec = model_spec(str(spec.get("factory")), **{k: spec.get(k) for k in IMPORT_OPTIONS})
        builder = user.build
    elif source == "pipedream":
        raise BadInput(f"model '{spec.get('name')}' comes from an imported PipeDream profile: "
                       f"it can be planned, but there is no PyTorch model to run")
    else:
        raise BadInput(f"not a model spec: source is {source!r}, expected 'builtin' or 'import'")
    torch.manual_seed(seed)
    model = builder(spec)
    model.module.train()
    return model
