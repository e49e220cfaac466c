"""Who am I in the pipeline, on which device, and how the ranks talk.

One process per stage of each replica: a plan with K stages and ``data_parallel`` = d runs on
K·d ranks, rank ``placement.ranks[k][r]`` running stage k of replica r (with one replica, rank
k runs stage k). The process learns its rank the way ``torchrun``
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
from ..plan_view import PlanView


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


def check_world(world: World, plan: PlanView) -> list[str]:
    """Refuse to start when the number of processes is not the plan's K·d; return warnings.

    Under torchrun, a machine holding another number of ranks than the plan's placement
    assumed (``placement.devices_per_node``) is warned about: the ranks then fall on other
    machines than planned, so pipeline sends or gradient syncs cross the network where the
    plan expected a link, and its prediction will not hold.
    """
    need = plan.world_size
    if world.world_size != need:
        shape = f"{plan.num_stages} stages" if plan.data_parallel == 1 else \
            f"{plan.num_stages} stages x {plan.data_parallel} replicas = {need} ranks"
        raise BadInput(f"plan '{plan.path}' has {shape} but {world.world_size} processes were "
                       f"started: give torchrun --nnodes x --nproc-per-node y with x*y = {need}")
    per_node = plan.devices_per_node
    if world.launcher == "torchrun" and per_node is not None and world.local_world_size != per_node:
        return [f"the plan placed its {need} ranks {per_node} per machine, torchrun started "
                f"{world.local_world_size} per machine: the placement is not the one planned, so the "
                f"prediction may not hold (use --nproc-per-node {per_node})"]
    return []


@dataclass(frozen=True)
class Replicas:
    """Where this rank stands among the K·d: its stage and replica, and the groups it talks in.

    ``pp``: the ranks of this replica's K stages, in stage order (the pipeline's sends stay in
    it); ``dp``: the ranks of this stage's d replicas (the gradient sync). ``pp_group`` and
    ``dp_group`` are their process groups (None with one replica: the world is the pipeline
    then, and nothing syncs); ``mesh`` the 2-D device mesh ``("dp", "pp")`` they come from.
    """

    stage: int
    replica: int
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    mesh: object | None = None

    def dp_mesh(self) -> object | None:
        """The 1-D mesh of this stage's replicas (what FSDP2's ``fully_shard`` takes)."""
        return self.mesh["dp"] if self.mesh is not None else None  # type: ignore[index]


def replicas_of(plan: PlanView, rank: int, device: torch.device) -> Replicas:
    """This rank's stage and replica, and (d > 1) the device mesh and its two groups.

    The mesh is a ``[d][K]`` tensor of global ranks, row r the pipeline of replica r: the
    placement may put the ranks anywhere (``pipeline-inner``, ``data-inner`` or any other),
    and ``DeviceMesh`` takes them as given. Building it is collective: every rank of the
    world calls this, and it creates every replica's and every stage's group (each rank
    belongs to one of each). With d = 1 no mesh and no group is made: the world is the one
    pipeline, exactly as before data parallelism.
    """
    stage, replica = plan.position_of(rank)
    pp_ranks, dp_ranks = tuple(plan.replica_ranks(replica)), tuple(plan.stage_ranks(stage))
    if plan.data_parallel == 1:
        return Replicas(stage, replica, pp_ranks, dp_ranks)
    from torch.distributed.device_mesh import DeviceMesh

    layout = torch.tensor([plan.replica_ranks(r) for r in range(plan.data_parallel)], dtype=torch.int64)
    mesh = DeviceMesh(device.type, mesh=layout, mesh_dim_names=("dp", "pp"))
    return Replicas(stage, replica, pp_ranks, dp_ranks, pp_group=mesh.get_group("pp"),
                    dp_group=mesh.get_group("dp"), mesh=mesh)


def choose_device(requested: str, plan: PlanView, local_rank: int) -> torch.device:
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


COLLECTIVE_MARGIN_S = 5.0


def init(world: World, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """Join the process group; return the (gloo) group for Python objects."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The group's own timeout bounds the collectives of the set-up (the ranks start at different
    # speeds: at least 30 s). During the steps the watchdog (runtime/watchdog.py) stops a rank at
    # --timeout, in one line; the group's timeout is later, so that gloo's own error (a traceback
    # naming neither rank nor checkpoint) does not come first.
    timeout = datetime.timedelta(seconds=max(timeout_s, 30.0) + COLLECTIVE_MARGIN_S)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=world.rank, world_size=world.world_size, timeout=timeout, **kwargs)
    if backend == "gloo":
        return dist.group.WORLD  # type: ignore[return-value]
    return dist.new_group(backend="gloo", timeout=timeout)
