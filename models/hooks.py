"""The user's data and loss, named ``pkg.module:function`` like the model's factory.

``--data pkg.module:factory``: ``factory(batch_size)`` returns an iterable of mini-batches
``(inputs, targets)`` of ``batch_size`` samples each (``inputs`` a tensor or a tuple of
tensors, batch first). It is called with the *global* batch size of a run (a profile calls it
with each micro-batch size it measures) and iterated one mini-batch per step.

Every rank that needs data (the first stage its inputs, the last its targets) builds its own
stream, so the streams must agree without anything being sent: :class:`DataStream` runs the
factory and every ``next()`` on a private torch RNG state seeded from ``--seed``. A factory
that draws from torch's generator (``torch.randint``, ``torch.randperm``, a ``DataLoader``
with ``shuffle=True`` and no workers) then yields the same batches on every rank and in every
run, and touches no other random state (the model's initialisation, say). Step ``s`` is the
``s``-th mini-batch, so a resumed run skips ``s`` of them.

The loss is the user's or one of the two built-in ones, whose targets say what they need
(:func:`check_declared` holds the first mini-batch to it, in one line if it does not fit):

- ``--loss classify`` (the default): targets are class ids, integers of shape ``(batch,)``; the
  model's first output is logits ``(batch, classes)``;
- ``--loss lm``: one input of token ids ``(batch, seq)`` and targets of the same shape (the next
  token of each), both integers; the first output is logits ``(batch, seq, vocab)``;
- ``--loss pkg.module:fn``: ``fn(outputs, targets)`` returns the mean loss over the micro-batch
  as a scalar tensor; ``outputs`` is what the model returns (one tensor, or the tuple of its
  tensors). The pipeline averages it over the micro-batches, which is the mean over the batch.

``--input-shape``, ``--input-dtype``, ``--num-classes`` and ``--vocab-size`` need not be given
with a factory (its batches say it all); given, they must agree with its batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..artifacts import BadInput, first_line
from .data import SyntheticData

Tensors = tuple[torch.Tensor, ...]
Batch = tuple[Tensors, torch.Tensor]


class DataStream:
    """The mini-batches of ``factory(batch_size)``, drawn on a private RNG seeded with ``seed``."""

    def __init__(self, factory: Callable[[int], Any], path: str, batch_size: int, seed: int) -> None:
        self.path, self.batch_size = path, batch_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                self._items: Iterator[Any] = iter(factory(batch_size))
            except Exception as exc:
                raise BadInput(f"data factory '{path}' raised {type(exc).__name__}: {first_line(exc)}") from None
            self._rng = torch.get_rng_state()
        self.position = 0  # mini-batches drawn so far

    def next(self) -> Batch:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng)
            try:
                item = next(self._items)
            except StopIteration:
                raise BadInput(f"data factory '{self.path}' ran out after {self.position} mini-batches: "
                               f"make it yield as many as --steps (loop over the data)") from None
            except Exception as exc:
                raise BadInput(f"data factory '{self.path}' raised {type(exc).__name__} at mini-batch "
                               f"{self.position}: {first_line(exc)}") from None
            self._rng = torch.get_rng_state()
        self.position += 1
        return check_batch(item, self.batch_size, self.path)


def check_batch(item: Any, batch_size: int, path: str) -> Batch:
    """``(inputs, targets)`` as a tuple of tensors and a tensor, each ``batch_size`` long."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise BadInput(f"data factory '{path}' yields {type(item).__name__}; it must yield (inputs, targets)")
    inputs, targets = item
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    tensors = [*inputs, targets]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise BadInput(f"data factory '{path}' yields {[type(t).__name__ for t in tensors]}: inputs and targets "
                       f"must be tensors")
    wrong = [list(t.shape) for t in tensors if t.ndim == 0 or t.shape[0] != batch_size]
    if wrong:
        raise BadInput(f"data factory '{path}' was asked for {batch_size} samples and yields a tensor of shape "
                       f"{wrong[0]}: every input and the targets need the batch first")
    return inputs, targets


def user_loss(fn: Callable[..., Any], path: str) -> Callable[[Tensors, torch.Tensor], torch.Tensor]:
    """The model's loss from the user's ``fn(outputs, targets)``, checked to be a scalar."""

    def loss(outputs: Tensors, targets: torch.Tensor) -> torch.Tensor:
        value = fn(outputs[0] if len(outputs) == 1 else outputs, targets)
        if not isinstance(value, torch.Tensor) or value.ndim != 0:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise BadInput(f"loss '{path}' returns {shape}; it must return a scalar tensor (the mean over the "
                           f"micro-batch)")
        return value

    return loss




# The flags that say what a batch looks like; with --data they are checked against its batches.
DECLARED = ("input_shape", "input_dtype", "num_classes", "vocab_size")


def check_declared(inputs: Tensors, targets: torch.Tensor, loss: str, declared: dict[str, Any], path: str) -> None:
    """Refuse, in one line, a mini-batch that the built-in ``loss`` cannot train on, or that
    contradicts what the user declared of it (``declared``: ``input_shape``, ``input_dtype`` as a
    torch dtype, ``num_classes``, ``vocab_size``; each optional)."""
    where = f"data factory '{path}'"
    shapes = [list(x.shape[1:]) for x in inputs]
    integer = [not (x.dtype.is_floating_point or x.dtype.is_complex) for x in (*inputs, targets)]
    if loss == "lm" and (len(inputs) != 1 or inputs[0].ndim != 2 or not integer[0] or not integer[-1]
                         or targets.shape != inputs[0].shape):
        raise BadInput(f"--loss lm trains on (ids, next ids): one integer tensor [batch, seq] in and targets of the "
                       f"same shape; {where} yields {_describe(inputs, targets)}: give your own --loss pkg.module:fn")
    if loss == "classify" and (targets.ndim != 1 or not integer[-1]):
        raise BadInput(f"--loss classify (the default) trains on class ids: integer targets of shape [batch]; {where} "
                       f"yields {_describe(inputs, targets)}: give --loss lm for next-token targets, or your own "
                       f"--loss pkg.module:fn")
    if "input_shape" in declared and (len(inputs) != 1 or shapes[0] != list(declared["input_shape"])):
        raise BadInput(f"--input-shape {','.join(map(str, declared['input_shape']))} contradicts {where}, whose "
                       f"samples are {' and '.join(map(str, shapes))}: drop the flag or mend one of them")
    dtype = declared.get("input_dtype")
    if dtype is not None and (len(inputs) != 1 or inputs[0].dtype != dtype):
        raise BadInput(f"--input-dtype {_dtype(dtype)} contradicts {where}, whose inputs are "
                       f"{' and '.join(_dtype(x.dtype) for x in inputs)}: drop the flag or mend one of them")
    vocab = declared.get("vocab_size")
    if vocab is not None:
        ids = [x for x, is_int in zip(inputs, integer) if is_int]
        if not ids:
            raise BadInput(f"--vocab-size {vocab} is the range of integer inputs, but {where} yields "
                           f"{' and '.join(_dtype(x.dtype) for x in inputs)}: drop the flag")
        top = max((int(x.max()) for x in ids if x.numel()), default=-1)
        if top >= vocab:
            raise BadInput(f"--vocab-size {vocab} contradicts {where}: its inputs hold id {top}")
    classes = declared.get("num_classes")
    if classes is not None and targets.numel() and int(targets.max()) >= classes:
        raise BadInput(f"--num-classes {classes} contradicts {where}: its targets hold class {int(targets.max())}")


def _describe(inputs: Tensors, targets: torch.Tensor) -> str:
    """``inputs [2, 8] float32, targets [2] int64``: a mini-batch as a user reads it (batch first)."""
    parts = ", ".join(f"{list(x.shape)} {_dtype(x.dtype)}" for x in inputs)
    return f"inputs {parts}, targets {list(targets.shape)} {_dtype(targets.dtype)}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class FactoryData(SyntheticData):
    """A model's data from the user's factory: shapes read off a first mini-batch (a
    :class:`~.data.SyntheticData` for the profiler and ``check``), which is held to the
    built-in ``loss`` and to what the user ``declared`` of it (:func:`check_declared`).

    With ``loss="lm"`` it has ``seq_len`` (and ``vocab_size`` if declared), with ``classify``
    ``num_classes`` if declared: what ``LayeredModel.check`` holds the logits to, as for
    :class:`~.data.NextToken` and :class:`~.data.Classification`.
    """

    def __init__(self, factory: Callable[[int], Any], path: str, loss: str = "classify",
                 declared: dict[str, Any] | None = None) -> None:
        self.factory, self.path = factory, path
        inputs, targets = self.batch(2, torch.Generator().manual_seed(0))
        self.input_shapes = tuple(tuple(x.shape[1:]) for x in inputs)
        self.input_dtypes = tuple(x.dtype for x in inputs)
        declared = declared or {}
        check_declared(inputs, targets, loss, declared, path)
        if loss == "lm":
            self.seq_len, self.vocab_size = int(inputs[0].shape[1]), declared.get("vocab_size")
        elif loss == "classify":
            self.num_classes = declared.get("num_classes")

    def batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        """The first mini-batch of ``factory(batch_size)``, on a stream seeded from ``generator``."""
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        return DataStream(self.factory, self.path, batch_size, seed).next()
