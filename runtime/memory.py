"""Measuring a stage's memory in the terms the plan predicts it.

The planner predicts a stage's peak as parameters + gradients + optimizer state + buffers +
the activations of the micro-batches in flight. On CUDA the allocator knows the true peak
(``torch.cuda.max_memory_allocated``). On the CPU nothing tracks tensor memory, and the
process's resident size mixes in the PyTorch runtime and the whole model every rank built,
so we measure each part directly:

- parameters, gradients, optimizer state and buffers: the bytes of those very tensors;
- activations: the bytes autograd saves for backward, counted by the profiler's own meter
  (gpipe_plan/tensor_memory.py, ``SavedTensors``: parameters and buffers excluded), summed
  over the (chunk, micro-batch) pairs whose backward has not finished yet (under a split
  backward, until the weight half W: the graph I leaves behind holds them), at its largest. A chunk that recomputes keeps only its inputs
  per micro-batch, plus one micro-batch's activations while it recomputes; we measure that
  one once.

On CUDA the allocated peak is not all a stage costs the card: the caching allocator reserves
more than it hands out (``max_memory_reserved``), and the CUDA context, NCCL's buffers and
the libraries' workspaces lie outside the allocator altogether. :func:`cuda_memory` reports
each, so a plan's headroom (planner/profile.py, ``DEVICE_MEMORY_HEADROOM``) can be checked
against what a run really took.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..cudamemory import outside_allocator_bytes
from ..tensor_memory import SavedTensors, StorageKey, element_bytes, storage_key


Key = tuple[int, int]   # (chunk, micro-batch)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (fsdp), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (a DTensor's ``numel()`` is the whole tensor's: not that)."""
    return element_bytes(local_tensor(t))


@dataclass
class ActivationMeter:
    """Live bytes saved for backward, per (chunk, micro-batch) in flight, and their peak."""

    exclude: set[StorageKey] = field(default_factory=set)   # storages never counted (parameters, buffers)
    live: dict[Key, int] = field(default_factory=dict)
    peak_bytes: int = 0           # most bytes held at once by the micro-batches in flight
    transient_bytes: int = 0      # recomputing stages: one micro-batch's activations
    # Whose parameters and buffers are never activations, looked at when a forward saves its first
    # tensor: under fsdp the parameters a forward uses are gathered for the step (other storages
    # than the shards the meter was made with), and they are parameters, not activations.
    module: nn.Module | None = None
    device: torch.device | None = None   # count only storages on the run's device (as the profile)

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.transient_bytes

    @classmethod
    def for_module(cls, module: nn.Module, device: torch.device | None = None) -> "ActivationMeter":
        return cls(exclude=module_storages(module), module=module, device=device)

    @contextlib.contextmanager
    def forward(self, key: Key) -> Iterator[None]:
        """Count what autograd saves during this (chunk, micro-batch)'s forward (each storage once)."""
        def never() -> set[StorageKey]:
            return self.exclude | (module_storages(self.module) if self.module is not None else set())

        saved = SavedTensors(exclude=never, device=self.device)
        with saved.recording():
            yield
        self.hold(key, saved.nbytes)

    def hold(self, key: Key, nbytes: int) -> None:
        self.live[key] = self.live.get(key, 0) + nbytes
        self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))

    def release(self, key: Key) -> None:
        self.live.pop(key, None)

    def measure_once(self, fn: Callable[..., object], *xs: torch.Tensor) -> int:
        """Bytes ``fn(*xs)`` saves for backward (run with gradients, then thrown away)."""
        meter = ActivationMeter(exclude=self.exclude, module=self.module, device=self.device)
        with meter.forward((0, 0)):
            fn(*xs)
        return meter.peak_bytes


def module_storages(module: nn.Module) -> set[StorageKey]:
    """The storages holding the module's parameters and buffers (a DTensor's: its local shard's)."""
    return {storage_key(local_tensor(t)) for t in (*module.parameters(), *module.buffers())}


def static_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 sharded: bool = False) -> dict[str, int]:
    """Bytes of parameters, their gradients, the optimizer's state and the buffers, as measured on
    this rank (the planner's charge for them is ``planner.costmodel.charged_static_bytes``).

    ``sharded`` (fsdp, which needs ``optimizer``): the stage's peak, in the planner's terms
    (docs/planner.md, "Data parallel"): during the step a rank holds the whole parameters P
    (gathered once, kept for all micro-batches) besides its shard P/d, the whole gradients P
    (accumulated before the reduce-scatter), and optimizer state for its shard only. The shards
    are the optimizer's parameters (DTensors: ``numel()`` is the whole tensor's, ``to_local()``
    the shard's); read at any moment, ``module.parameters()`` would be the shards or the
    gathered tensors, depending on the phase of the step.
    """
    if sharded:
        assert optimizer is not None, "a sharded stage's parameters are its optimizer's"
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        whole = sum(element_bytes(p) for p in shards)
        state = sum(local_bytes(v) for per_param in optimizer.state.values() for v in per_param.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {
            "params_bytes": whole + sum(local_bytes(p) for p in shards),
            "gradients_bytes": sum(element_bytes(p) for p in shards if p.requires_grad),
            "optimizer_state_bytes": state,
            "buffers_bytes": sum(local_bytes(b) for b in module.buffers()),
        }
    params = list(module.parameters())
    state = 0
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += sum(element_bytes(v) for v in per_param.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {
        "params_bytes": sum(element_bytes(p) for p in params),
        "gradients_bytes": sum(element_bytes(p) for p in params if p.requires_grad),
        "optimizer_state_bytes": state,
        "buffers_bytes": sum(element_bytes(b) for b in module.buffers()),
    }


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports kilobytes)."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):  # pragma: no cover - not Linux
        return 0


def cuda_memory(device: torch.device, context_bytes: int) -> dict[str, int]:
    """The report's CUDA memory beyond the allocated peak; ``context_bytes`` as read at the start."""
    free, total = torch.cuda.mem_get_info(device)
    outside = outside_allocator_bytes(device)
    return {
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "context_bytes": int(context_bytes),
        # NCCL's buffers and library workspaces: outside the allocator, beyond the context.
        "outside_allocator_bytes": max(0, outside - int(context_bytes)),
        "device_used_bytes": int(total - free),
        "device_total_bytes": int(total),
    }
