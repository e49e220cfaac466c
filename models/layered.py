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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..artifacts import BadInput, first_line
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

    def __init__(self, module: nn.Module, spread: bool = False, notes: list[str] | None = None) -> None:
        super().__init__()
        self.module = module
        # spread: call module(*xs) (our own built-in layers take several arguments), instead
        # of the nn.Sequential convention module(x) / module((x1, x2)).
        self.spread = spread
        self.notes = notes   # the model's notes (LayeredModel.notes): which value of a dict the loss takes

    def forward(self, *xs: Any) -> Tensors:
        if self.spread:
            out = self.module(*xs)
        else:
            out = self.module(xs[0] if len(xs) == 1 else xs)
        return as_tuple(out, self.notes)




def as_tuple(out: Any, notes: list[str] | None = None) -> Tensors:
    """A model's or layer's output as a tuple of tensors (a bare tensor becomes a 1-tuple).

    A ``ModelOutput`` or dict becomes its tensors, ``logits`` first (the loss trains on the
    first); without ``logits``, its first tensor comes first, and ``notes`` (when given) gets
    the line saying so (:func:`loss_output_note`).
    """
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    if isinstance(out, Mapping):  # a ModelOutput or a dict: its logits first, as the captured layers give
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        if tensors:
            first = "logits" if "logits" in tensors else next(iter(tensors))
            note = loss_output_note([str(k) for k in tensors])
            if note is not None and notes is not None and note not in notes:
                notes.append(note)
            return (tensors.pop(first), *tensors.values())
    raise TypeError(f"expected a tensor or a tuple of tensors, got {type(out).__name__}")


def loss_output_note(keys: Sequence[str]) -> str | None:
    """What a user must be told of a model whose output is a dict with these keys, in order:
    nothing when it has ``logits`` (the loss's input, by the Hugging Face convention), else
    that the loss takes its first value, which may not be the one they meant."""
    if not keys or "logits" in keys:
        return None
    others = f" (the others ride along: {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""
    return (f"the model returns a dict without 'logits': the loss trains on its first value, {keys[0]!r}{others}; "
            f"name the value to train on 'logits' to choose another")


def batch_dimensions(layer: str, small: Sequence[Sequence[int]], small_size: int,
                     large: Sequence[Sequence[int]], large_size: int) -> list[bool]:
    """Which of a layer's outputs carry the batch, from their shapes at two micro-batch sizes.

    An output whose first dimension follows the micro-batch size is made per sample; one whose
    shape does not change with it is the same for every micro-batch (a rotary table of shape
    ``(1, T, d)`` handed along an ``nn.Sequential``) and crosses a cut whole, in its own shape.
    An output whose batch is another dimension cannot be cut into micro-batches: refused in
    one line. With one size only (``small_size == large_size``), a first dimension equal to
    the size is taken for the batch.
    """
    flags = []
    for a, b in zip(map(list, small), map(list, large)):
        if small_size == large_size:
            flags.append(len(a) > 0 and a[0] == small_size)
        elif a == b:
            flags.append(False)
        elif len(a) > 0 and (a[0], b[0]) == (small_size, large_size) and a[1:] == b[1:]:
            flags.append(True)
        else:
            raise BadInput(f"layer {layer!r} passes on a tensor of shape {a} at micro-batch {small_size} and {b} "
                           f"at {large_size}: a pipeline cuts batches along the first dimension, so put the "
                           f"batch first (transpose a sequence-first layout)")
    return flags


class LayeredModel:
    """The whole model, and the same model as a sequence of layers.

    Attributes:
        spec: the JSON-able model spec that rebuilds this model (see ``model_spec``).
        module: the whole, unsplit model. It owns every parameter and buffer, and its
            ``state_dict`` keys are the user's own.
        layers: ``(name, layer)`` in execution order, names unique. See the module docstring
            for the calling convention.
        data: how inputs and targets look, and how synthetic ones are drawn.
        notes: what the user should be told of how the model was read (``profile`` prints them).
    """

    def __init__(self, spec: dict[str, Any], module: nn.Module, layers: Sequence[tuple[str, nn.Module]],
                 data: SyntheticData, loss_fn: Callable[[Tensors, torch.Tensor], torch.Tensor] | None = None,
                 notes: list[str] | None = None) -> None:
        names = [name for name, _ in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names are not unique: {names}")
        if not layers:
            raise ValueError("a model needs at least one layer")
        self.spec = spec
        self.module = module
        self.layers: list[tuple[str, nn.Module]] = list(layers)
        self.data = data
        self.loss_fn = loss_fn  # the user's loss (models.hooks); None: cross-entropy
        # Which value of a dict output the loss takes, filled as it is found: when the model is
        # captured, or when an nn.Sequential's last child first runs (``check``).
        self.notes: list[str] = notes if notes is not None else []

    def module_names(self) -> list[str | None]:
        """Per layer, the unsplit model's fully qualified name of the module it is, None if none.

        Other trainers name a model's parts this way (torchtitan's ``module_fqns_per_model_part``,
        torch's ``split_spec``). A layer is module ``m`` when it wraps ``m`` itself (the built-in
        models, an ``nn.Sequential``'s children) or is named by ``m``'s path and holds exactly
        ``m``'s parameters (a captured Hugging Face block, ``model.layers.3``). A piece of a
        captured graph, or a module reused under another name (``relu_1``), is none.
        """
        paths = dict(self.module.named_modules())
        by_id = {id(m): path for path, m in paths.items() if path}
        names: list[str | None] = []
        for name, layer in self.layers:
            inner = getattr(layer, "module", None)      # AsTuple's wrapped module
            if isinstance(inner, nn.Module) and id(inner) in by_id:
                names.append(by_id[id(inner)])
            elif name in paths and name and \
                    {id(p) for p in paths[name].parameters()} == {id(p) for p in layer.parameters()}:
                names.append(name)
            else:
                names.append(None)
        return names

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
        """The user's loss if the spec names one (models.hooks), else the mean cross-entropy of
        the first output (logits, classes last) against ``targets``.

        Logits of shape (batch, ..., classes) pair with integer targets of shape (batch, ...):
        a classifier's (batch, classes) with (batch,), a language model's (batch, seq, vocab)
        with (batch, seq).
        """
        if self.loss_fn is not None:
            return self.loss_fn(outputs, targets)
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
                self._check_logits(xs[0], batch_size)
                name = "the loss"
                self.loss(xs, targets.to(device))
            except BadInput:
                raise
            except Exception as exc:
                raise BadInput(f"{self._inputs_text()} does not fit {self._title()}: {name!r} raised "
                               f"{type(exc).__name__}: {first_line(exc)}") from None
        return outputs

    def _check_logits(self, logits: torch.Tensor, batch_size: int) -> None:
        """The first output is what the objective needs: (batch, classes) or (batch, seq, vocab)."""
        classes = getattr(self.data, "num_classes", None)
        if classes is not None and logits.shape != (batch_size, classes):
            raise BadInput(f"{self._title()} returns shape {list(logits.shape[1:])} per sample; "
                           f"expected logits [{classes}] (--num-classes {classes})")
        vocab, seq = getattr(self.data, "vocab_size", None), getattr(self.data, "seq_len", None)
        if seq is not None and (logits.shape[:2] != (batch_size, seq) or logits.ndim != 3
                                or (vocab is not None and logits.shape[2] != vocab)):
            raise BadInput(f"{self._title()} returns shape {list(logits.shape[1:])} per sample; --loss lm "
                           f"needs logits [seq, vocab] = [{seq}, {vocab or 'vocab'}] (batch, seq, vocab)")

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

    def tied_parameters(self) -> list[dict[str, Any]]:
        """Parameters that several layers use (tied weights), as a profile records them.

        ``[{"key": state_dict key, "layers": [layer names], "bytes": size}]``: a plan that puts
        those layers in different stages keeps a copy on each and sums their gradients every
        step (runtime.tied); the planner charges that exchange.
        """
        uses: dict[int, list[int]] = {}
        params: dict[int, torch.Tensor] = {}
        for index, (_, layer) in enumerate(self.layers):
            for p in layer.parameters():
                if index not in uses.setdefault(id(p), []):
                    uses[id(p)].append(index)
                params[id(p)] = p
        keys = self.param_keys()
        return [{"key": keys[pid], "layers": [self.layers[i][0] for i in where],
                 "bytes": params[pid].numel() * params[pid].element_size()}
                for pid, where in uses.items() if len(where) > 1]

    def __repr__(self) -> str:
        names = ", ".join(name for name, _ in self.layers)
        return f"LayeredModel({self.spec.get('name') or self.spec.get('factory')}: {names})"
