"""A model cut into layers: the unit that profiles measure, plans balance and stages run.

A pipeline needs a model as a *sequence*: stage k runs a contiguous run of layers and hands
what comes out of its last layer to stage k+1. :class:`LayeredModel` is that sequence, plus
what is needed to feed it (synthetic batches) and to train it (the loss).

The contract every layer keeps, whatever model it came from:

- layer i is called as ``layer(*xs)``, where ``xs`` is the tuple layer i-1 returned (layer 0
  gets the model inputs), and it always returns a tuple of tensors. A stage boundary is then
  just "send this tuple", whatever the model's own calling convention;
- the layers' parameters are the very Parameter objects of :attr:`LayeredModel.module`, never
  copies, so a runtime can map ``id(param)`` to the unsplit model's ``state_dict`` key and
  save a trained pipeline as the user's own model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..artifacts import BadInput
from .data import SyntheticData

Tensors = tuple[torch.Tensor, ...]


class AsTuple(nn.Module):
    """Calls a module and returns its output as a tuple of tensors.

    The wrapped module is a submodule, so the wrapper adds no parameters of its own and its
    ``parameters()`` are the wrapped module's very objects.

    ``nn.Sequential`` hands one value from child to child; the pipeline hands tuples. A layer
    that receives one tensor passes it on as is, and one that receives several passes them as
    one tuple argument, as ``nn.Sequential`` would have.
    """

    def __init__(self, module: nn.Module, spread: bool = False) -> None:
        super().__init__()
        self.module = module
        # spread: call module(*xs) (our own built-in layers take several arguments), instead
        # of the nn.Sequential convention module(x) / module((x1, x2)).
        self.spread = spread

    def forward(self, *xs: Any) -> Tensors:
        if self.spread:
            out = self.module(*xs)
        else:
            out = self.module(xs[0] if len(xs) == 1 else xs)
        return as_tuple(out)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def as_tuple(out: Any) -> Tensors:
    """A model's or layer's output as a tuple of tensors (a bare tensor becomes a 1-tuple)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    raise TypeError(f"expected a tensor or a tuple of tensors, got {type(out).__name__}")


class LayeredModel:
    """The whole model, and the same model as a sequence of layers.

    Attributes:
        spec: the JSON-able model spec that rebuilds this model (see ``model_spec``).
        module: the whole, unsplit model. It owns every parameter and buffer, and its
            ``state_dict`` keys are the user's own.
        layers: ``(name, layer)`` in execution order, names unique. See the module docstring
            for the calling convention.
        data: how inputs and targets look, and how synthetic ones are drawn.
    """

    def __init__(self, spec: dict[str, Any], module: nn.Module,
                 layers: Sequence[tuple[str, nn.Module]], data: SyntheticData) -> None:
        names = [name for name, _ in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names are not unique: {names}")
        if not layers:
            raise ValueError("a model needs at least one layer")
        self.spec = spec
        self.module = module
        self.layers: list[tuple[str, nn.Module]] = list(layers)
        self.data = data

    # ----------------------------------------------------------------- inputs and targets
    @property
    def input_shapes(self) -> list[list[int]]:
        """Per-sample shapes of the model inputs (batch dimension left out)."""
        return [list(s) for s in self.data.input_shapes]

    @property
    def input_dtypes(self) -> list[torch.dtype]:
        return list(self.data.input_dtypes)

    def synthetic_batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensors, torch.Tensor]:
        """``(inputs, targets)`` for ``batch_size`` samples, on the CPU, drawn from ``generator``.

        Deterministic given the generator's state: every rank of a pipeline that seeds its
        generator alike draws the same batch.
        """
        return self.data.batch(batch_size, generator)

    def loss(self, outputs: Tensors, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the first output (logits, classes last) against ``targets``.

        Logits of shape (batch, ..., classes) pair with integer targets of shape (batch, ...):
        a classifier's (batch, classes) with (batch,), a language model's (batch, seq, vocab)
        with (batch, seq).
        """
        logits = outputs[0]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    # ----------------------------------------------------------------- running it
    def forward(self, *inputs: torch.Tensor) -> Tensors:
        """The whole model's forward, as a tuple: what the unsplit model computes."""
        return as_tuple(self.module(*inputs))

    def forward_layers(self, *inputs: torch.Tensor) -> Tensors:
        """Run the layers one after another: the same function as :meth:`forward`."""
        xs: Tensors = tuple(inputs)
        for _, layer in self.layers:
            xs = layer(*xs)
        return xs

    def check(self, batch_size: int = 1, device: torch.device | str = "cpu") -> list[Tensors]:
        """Run one synthetic batch through the layers and the loss; return each layer's outputs.

        Raises :class:`BadInput` naming the layer when the inputs do not fit the model (a
        wrong ``--input-shape``), the output is not logits over ``num_classes``, or a layer
        returns something other than tensors. Leaves the global random state as it was.
        """
        name = "the model"
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            inputs, targets = self.synthetic_batch(batch_size, torch.Generator().manual_seed(0))
            xs: Tensors = tuple(x.to(device) for x in inputs)
            outputs: list[Tensors] = []
            try:
                for name, layer in self.layers:
                    xs = layer(*xs)
                    outputs.append(xs)
                    if not isinstance(xs, tuple) or not all(isinstance(x, torch.Tensor) for x in xs):
                        kinds = [type(x).__name__ for x in (xs if isinstance(xs, tuple) else [xs])]
                        raise BadInput(f"layer {name!r} of {self._title()} passes {kinds} to the next layer; "
                                       f"only tensors can cross a cut between pipeline stages")
                name = "the loss"
                self.loss(xs, targets.to(device))
            except BadInput:
                raise
            except Exception as exc:
                raise BadInput(f"{self._inputs_text()} does not fit {self._title()}: {name!r} raised "
                               f"{type(exc).__name__}: {_first_line(exc)}") from None
        classes = getattr(self.data, "num_classes", None)
        if classes is not None and xs[0].shape != (batch_size, classes):
            raise BadInput(f"{self._title()} returns shape {list(xs[0].shape[1:])} per sample; "
                           f"expected logits [{classes}] (--num-classes {classes})")
        return outputs

    def _title(self) -> str:
        return f"model '{self.spec.get('name') or self.spec.get('factory')}'"

    def _inputs_text(self) -> str:
        parts = [f"{list(s)} {str(d).replace('torch.', '')}" for s, d in zip(self.input_shapes, self.input_dtypes)]
        return "input " + ", ".join(parts)

    def to(self, device: torch.device | str) -> "LayeredModel":
        """Move the model and its layers to ``device``, in place.

        Parameters keep their identity (``Module.to`` changes their data, not the objects).
        The layers are moved too because a traced layer may hold its own reference to a buffer
        or a constant, which moving ``module`` alone would leave behind.
        """
        self.module.to(device)
        for _, layer in self.layers:
            layer.to(device)
        return self

    # ----------------------------------------------------------------- parameters
    def param_keys(self) -> dict[int, str]:
        """``id(parameter) -> key`` in ``module.state_dict()``, for every parameter."""
        return {id(p): key for key, p in self.module.named_parameters()}

    def layer_param_keys(self, index: int) -> list[str]:
        """The ``module.state_dict()`` keys of the parameters that layer ``index`` uses."""
        keys = self.param_keys()
        return [keys[id(p)] for p in self.layers[index][1].parameters()]

    def __repr__(self) -> str:
        names = ", ".join(name for name, _ in self.layers)
        return f"LayeredModel({self.spec.get('name') or self.spec.get('factory')}: {names})"
