"""What tensors take in memory: their bytes, and the bytes a computation keeps for its backward.

One home for both, since the profile's prediction and the run's measurement must count alike:
``profile`` weighs each layer with :class:`SavedTensors` (profiles/measure.py), and ``run``'s
activation meter counts each micro-batch's forward with the same class (runtime/memory.py).

During the forward pass autograd stores, for every operation, the tensors its backward needs
(a linear layer keeps its input to compute the weight gradient; a ReLU keeps its output).
Those tensors are the *activations* a pipeline stage must hold from a micro-batch's forward
until its backward, M of them at once under GPipe. ``torch.autograd.graph.saved_tensors_hooks``
lets us see every tensor as autograd stores it, so the count is exact, not a guess from shapes.

Two rules make the count mean memory:

- count each storage once: several saved tensors are often views of one buffer (the three
  parts of a fused q/k/v projection), and memory holds the buffer once;
- leave parameters (and buffers) out: a stage holds them whatever the micro-batch, and the
  memory model counts them separately.

A layer's input, when saved, counts: it is memory the layer keeps alive for its backward.
Only storages on the profiled device count: on CUDA the attention kernels save two 8-byte
CPU tensors (their random seed and offset), which are not the GPU's memory and do not grow
with the micro-batch.

A split backward (zero-bubble schedules) runs in two halves, the input gradient I and later the
weight gradient W, and between them the stage keeps part of what it saved: the graph under
the operations that have weights, which W starts from. Which part is a fact of autograd, not
of shapes, so it is counted too: every saved tensor is handed to autograd as an alias of its
own, and an alias still alive after I is one the retained graph holds (:meth:`SavedTensors.nbytes_alive`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch


StorageKey = tuple[str, int]   # (device, data pointer): one storage, however many tensors view it


class SavedTensors:
    """Collects the storages autograd saves inside :meth:`recording`; :attr:`nbytes` totals them.

    ``exclude``: tensors whose storages are never counted (a layer's parameters and buffers), or
    a function giving their storage keys, called when the first tensor is saved: under fsdp the
    parameters a forward uses are gathered for it, other storages than the shards it started
    with. ``device``: count only storages on that device type (None: every one).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] | Callable[[], set[StorageKey]] = (),
                 device: torch.device | None = None) -> None:
        self._exclude = exclude if callable(exclude) else None
        self._excluded: set[StorageKey] | None = None if callable(exclude) else {storage_key(t) for t in exclude}
        self._device = device
        self._storages: dict[StorageKey, int] = {}
        # The alias handed to autograd for each saved tensor counted, by storage: it lives as
        # long as the graph node that saved it, and nothing else holds it.
        self._aliases: list[tuple[StorageKey, weakref.ref[torch.Tensor]]] = []

    @contextmanager
    def recording(self) -> Iterator["SavedTensors"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._excluded is None:
            self._excluded = self._exclude()
        key = storage_key(tensor)
        on_device = self._device is None or tensor.device.type == self._device.type
        # A detached alias: the same storage, nothing moved or copied. Handing autograd the
        # tensor itself would leak the graph: a saved *output* (attention saves its result)
        # would hold its own grad_fn, a cycle through C++ that Python's collector cannot see,
        # and with it the layer's parameters, which then cannot be given back (models/materialize.py).
        alias = tensor.detach()
        if key not in self._excluded and on_device:
            self._storages[key] = tensor.untyped_storage().nbytes()
            self._aliases.append((key, weakref.ref(alias)))
        return alias

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    def nbytes_alive(self) -> int:
        """Bytes of the saved storages the graph still holds: those with an alias not yet freed.

        Right after the forward this is :attr:`nbytes`; after a backward that keeps its graph
        (``retain_graph``, as the input half of a split backward does) and after the graph's
        upper part is dropped, it is what the rest of the graph keeps alive. The storage
        itself may live on elsewhere (a layer's input, which the caller holds): what counts is
        whether the graph holds it.
        """
        alive = {key for key, alias in self._aliases if alias() is not None}
        return sum(self._storages[key] for key in alive)

    def nbytes_except(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the saved storages other than those of ``tensors`` (e.g. the layer's inputs)."""
        others = {storage_key(t) for t in tensors}
        return sum(n for key, n in self._storages.items() if key not in others)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def storage_key(tensor: torch.Tensor) -> StorageKey:
    """Which storage ``tensor`` views (a DTensor has none of its own: pass its local shard)."""
    storage = tensor.untyped_storage()
    return (str(storage.device), storage.data_ptr())


def element_bytes(t: torch.Tensor) -> int:
    """Bytes of one tensor's elements."""
    return t.numel() * t.element_size()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' elements, as they would be sent over a link."""
    return sum(element_bytes(t) for t in tensors)


def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct tensors (a parameter used twice counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t)] = element_bytes(t)
    return sum(seen.values())
