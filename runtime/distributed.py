"""Who am I in the pipeline, on which device, and how the ranks talk.

One process per stage; rank k runs stage k. The process learns its rank the way ``torchrun``
tells it, from environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), and ``gpipe-plan run`` sets the same
ones when it starts the ranks itself: one code path for both.

Backends: gloo on the CPU, NCCL on CUDA with one GPU per rank (``cuda:LOCAL_RANK``). Python
objects (the report's figures, the saved model's pieces) always travel over gloo: on CUDA we
open a second, gloo group for them.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..artifacts import BadInput
from .plan import RunPlan


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str          # "gpipe-plan" (started by `gpipe-plan run`) or "torchrun"


def world_from_env() -> World | None:
    """The rank this process is, from torchrun's (or our launcher's) environment; None if alone."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        raise BadInput("RANK, WORLD_SIZE, LOCAL_RANK must be integers (set by torchrun)") from None
    launcher = "gpipe-plan" if env.get("GPIPE_PLAN_LAUNCHER") == "gpipe-plan" else "torchrun"
    return World(rank, world_size, local_rank, local_world_size, launcher)


def check_world(world: World, plan: RunPlan) -> None:
    """Refuse to start when the number of processes is not the plan's number of stages."""
    if world.world_size != plan.num_stages:
        raise BadInput(f"plan '{plan.path}' has {plan.num_stages} stages but {world.world_size} processes were "
                       f"started: give torchrun --nnodes x --nproc-per-node = {plan.num_stages}")


def choose_device(requested: str, plan: RunPlan, local_rank: int) -> torch.device:
    """``--device``: cpu, cuda (one GPU per local rank), or auto (the profile's kind, if here)."""
    kind = requested
    if kind == "auto":
        profiled = plan.profile_device.get("type")
        kind = "cuda" if profiled in ("cuda", "gpu") and torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise BadInput("--device cuda: no CUDA GPU is available here; use --device cpu")
        if local_rank >= torch.cuda.device_count():
            raise BadInput(f"local rank {local_rank} needs cuda:{local_rank} but this machine has "
                           f"{torch.cuda.device_count()} GPU(s): start at most that many ranks per machine")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(world: World, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """Join the process group; return the (gloo) group for Python objects."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=max(timeout_s, 30.0))
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=world.rank, world_size=world.world_size, timeout=timeout, **kwargs)
    if backend == "gloo":
        return dist.group.WORLD  # type: ignore[return-value]
    return dist.new_group(backend="gloo", timeout=timeout)
