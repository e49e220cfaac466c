"""The walk: every layer's real inputs, with one layer real at a time, and which layers are alike.

The profiler measures a layer on the inputs it gets in the model, so it needs each layer's
inputs at every micro-batch size. With the whole model in memory that is one forward pass;
for a model built on the meta device (models/materialize.py) it is the same pass, made one
layer at a time: make layer i real, run it on layer i-1's outputs at every size (without
gradients), give its parameters back, go on with its outputs. Memory: one layer, and the
tensors crossing one cut.

On the way, each layer gets its kind (:mod:`.kinds`): the first layer of each kind keeps its
inputs to be measured; the others will share its figures, and their inputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import LayeredModel, layer_materialized
from ..models.precision import Autocast
from .kinds import layer_kind

Tensors = tuple[torch.Tensor, ...]


@dataclass
class Walk:
    """What the walk found: the layers to measure, their inputs, and whose figures each layer takes."""

    measured_as: list[int]              # layer i takes the figures of layer measured_as[i] (i: its own)
    inputs: dict[int, list[Tensors]]    # each measured layer's inputs, one tuple per micro-batch size

    @property
    def measured(self) -> list[int]:
        return [i for i, rep in enumerate(self.measured_as) if rep == i]


def walk_layers(model: LayeredModel, inputs: list[Tensors], device: torch.device, autocast: Autocast,
                share: bool = True) -> Walk:
    """Run ``inputs`` (one tuple per micro-batch size) through ``model``, one layer real at a time.

    ``share``: layers of one kind take the first one's figures; False measures every layer.
    The caller has checked the model (``streamed(model).check``): a layer that raises here
    raises as it is.
    """
    measured_as: list[int] = []
    kept: dict[int, list[Tensors]] = {}
    kinds: dict[str, int] = {}
    last = len(model.layers) - 1
    xs_per_size = inputs
    for i, (name, _) in enumerate(model.layers):
        with torch.no_grad(), layer_materialized(model, i, device) as layer, autocast():
            outputs = [layer(*xs) for xs in xs_per_size]
            kind = layer_kind(layer, xs_per_size, outputs, first=i == 0, last=i == last) if share else name
        first_of_kind = kinds.setdefault(kind, i)
        measured_as.append(first_of_kind)
        if first_of_kind == i:
            kept[i] = xs_per_size
        xs_per_size = outputs
    return Walk(measured_as, kept)
