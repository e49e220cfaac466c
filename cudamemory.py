"""GPU memory that PyTorch's caching allocator does not hold.

``torch.cuda.max_memory_allocated`` sees only the tensors PyTorch allocates. A card also holds
the CUDA context (made when a process first touches the GPU), NCCL's buffers, the libraries'
workspaces, and whatever other processes hold: none of it is in the allocator, and all of it is
unavailable to a stage. The profiler reads this at its start (the context, which the planner
takes off the card's memory) and every rank at its start and end (the report's baseline and
what NCCL added). Only ``profile`` and ``run`` use it.
"""

from __future__ import annotations

import torch


def outside_allocator_bytes(device: torch.device) -> int:
    """Bytes in use on ``device`` that the caching allocator does not hold (reserved excluded)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total - free - torch.cuda.memory_reserved(device)))
