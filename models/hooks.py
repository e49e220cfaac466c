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

``--loss pkg.module:fn``: ``fn(outputs, targets)`` returns the mean loss over the micro-batch
as a scalar tensor; ``outputs`` is what the model returns (one tensor, or the tuple of its
tensors). The pipeline averages it over the micro-batches, which is the mean over the batch.
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




class FactoryData(SyntheticData):
    """A model's data from the user's factory: shapes read off a first mini-batch (a
    :class:`~.data.SyntheticData` for the profiler and ``check``)."""

    def __init__(self, factory: Callable[[int], Any], path: str) -> None:
        self.factory, self.path = factory, path
        inputs, targets = self.batch(2, torch.Generator().manual_seed(0))
        self.input_shapes = tuple(tuple(x.shape[1:]) for x in inputs)
        self.input_dtypes = tuple(x.dtype for x in inputs)

    def batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        """The first mini-batch of ``factory(batch_size)``, on a stream seeded from ``generator``."""
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        return DataStream(self.factory, self.path, batch_size, seed).next()
