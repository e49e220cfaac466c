"""Python objects between ranks: pickled into byte tensors and sent over gloo.

``torch.distributed.gather_object`` does the same but goes through NumPy, which a CPU-only
install may lack; these few lines need only torch. Used once per run (the report's figures,
the saved model's pieces) and on resume (which checkpoints each rank has): never per step.
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _decode(t: torch.Tensor, size: int) -> Any:
    return pickle.loads(ctypes.string_at(t.data_ptr(), size))


def _sizes(payload: torch.Tensor, world_size: int, group: dist.ProcessGroup | None) -> list[int]:
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    return [int(s) for s in sizes]


def _padded(payload: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=torch.uint8)
    out[:payload.numel()] = payload
    return out


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, on every rank, in rank order."""
    world_size = dist.get_world_size(group)
    payload = _encode(obj)
    sizes = _sizes(payload, world_size, group)
    longest = max(sizes)
    received = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(received, _padded(payload, longest), group=group)
    return [_decode(t, n) for t, n in zip(received, sizes)]


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0, in rank order (None on the other ranks)."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    payload = _encode(obj)
    sizes = _sizes(payload, world_size, group)
    longest = max(sizes)
    received = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)] if rank == 0 else None
    dist.gather(_padded(payload, longest), received, dst=0, group=group)
    if received is None:
        return None
    return [_decode(t, n) for t, n in zip(received, sizes)]
