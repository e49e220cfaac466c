"""Data parallel around the pipeline: d replicas of it, each stage's replicas sharing gradients.

A plan of format 6 (docs/plan-format.md) may run ``data_parallel`` = d copies of the pipeline
side by side on K·d ranks: rank ``placement.ranks[k][r]`` runs stage k of replica r. The ranks
form a 2-D ``torch.distributed.device_mesh`` with dimensions ``("dp", "pp")``: along ``pp`` the
K stages of one replica pass activations and gradients (the pipeline, as with one replica);
along ``dp`` the d replicas of one stage average their gradients once a step. Each replica
takes its own 1/d of the global batch, so the averaged gradient is the unsplit model's on the
whole batch.

When the replicas synchronise: after the stage's last action of the step, before the
optimizer (the moment torch's pipelining runs its REDUCE_GRAD action), never inside a
backward: a reduction there would delay the gradient the previous stage waits for. Every
backward of the step only accumulates into the local ``.grad``. The planner charges the same
thing (docs/planner.md, "Data parallel").

Three ways, the plan's ``gradient_sync``:

- ``ddp``: every replica keeps whole parameters and optimizer state; the gradients are
  all-reduced (averaged) in buckets over the stage's ``dp`` group.
- ``fsdp``: FSDP2 ``fully_shard`` over the ``dp`` group (:mod:`.fsdp`): each replica keeps 1/d
  of the stage's parameters, gradients and optimizer state between steps, all-gathers the
  parameters for the step and reduce-scatters the gradients.
- ``localsgd`` (:class:`LocalSgdSync`): another algorithm, not another way to compute the same
  one. No gradient is exchanged: each replica steps its own optimizer on the gradient of its
  own rows, so the replicas drift apart, and after every ``sync_every`` = H steps their
  parameters are replaced by their mean (torch's ``PeriodicModelAverager`` over the ``dp``
  group). One all-reduce of the parameters every H steps instead of one of the gradients every
  step: 1/H of the traffic. With H = 1 and plain SGD it is ddp again (the mean of the d updated
  weights is the weights updated by the mean gradient); with momentum or Adam, or H > 1, it is
  not. Its one-process reference is :func:`gpipe_plan.runtime.async_reference.localsgd_reference`.

:class:`GradientSync` is the interface ``train`` calls; :func:`make_gradient_sync` picks one.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .optim import squared_grad_norm
from .stage import StageChunks

# Gradients are all-reduced in buckets of about this many bytes: one flat tensor per bucket
# turns many small messages (a bias, a norm's weight) into a few large ones, each paying the
# ring's latency once; 25 MB is DistributedDataParallel's default bucket size.
BUCKET_BYTES = 25 * 1024 * 1024
T = TypeVar("T", bound=torch.Tensor)


class GradientSync(Protocol):
    """What a rank's training loop asks of its stage's replicas (one object per rank)."""

    mode: str            # "ddp" | "fsdp" | "localsgd" ("none" for one replica)
    replicas: int        # d

    def prepare(self, stage: StageChunks) -> None:
        """Before the optimizer is made: wrap or shard the stage's chunk modules (fsdp turns the
        parameters into DTensors, so the optimizer must be built from ``stage.parameters()``
        after this). Every backward from now on only accumulates locally."""

    def gather(self) -> None:
        """Before the step's first action: the step's parameters whole (fsdp: waits for the gather
        :meth:`after_optimizer` started, or gathers now on a run's first step), so that no
        forward's time holds it. The training loop times it with :meth:`finish` as the step's
        gradient sync, which is what the planner charges (reduce-scatter and all-gather)."""

    def finish(self) -> None:
        """After this stage's last action of the step: average the gradients over the replicas."""

    def start_at(self, steps_done: int) -> None:
        """Once, before the run's first step: the steps done before it (a resumed run's checkpoint
        step, else 0). localsgd counts its averaging period from it."""

    def after_update(self) -> bool:
        """Right after the optimizer step, before the gradients are cleared and before the step's
        checkpoint: localsgd averages the parameters after every H-th step. True when it did
        (the training loop times that as the step's gradient sync)."""

    def checkpoint_prefix(self) -> str:
        """What this rank's tensors are saved under in a checkpoint, before ``model/`` and
        ``optim/``: "" (the replicas hold the same tensors, the plain keys), except for the
        replicas after the first under localsgd, whose own weights differ (``replica-<r>/``)."""

    def after_optimizer(self) -> None:
        """After the optimizer step: fsdp starts gathering the next step's parameters."""

    def squared_norm_share(self, parameters: list[nn.Parameter]) -> float:
        """This rank's share of the squared global gradient norm: summed over every rank of the
        world, the shares give the whole model's squared norm exactly once."""

    def full_state_dict(self, stage: StageChunks) -> dict[str, torch.Tensor]:
        """The stage's whole tensors, under the unsplit model's keys, where they are: the caller
        copies what it keeps (a collective over ``dp`` under fsdp: every replica of the stage
        calls it)."""


class NoSync:
    """One replica: nothing to share; the rank's gradients are the stage's whole gradients."""

    mode = "none"
    replicas = 1

    def prepare(self, stage: StageChunks) -> None:
        pass

    def gather(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def start_at(self, steps_done: int) -> None:
        pass

    def after_update(self) -> bool:
        return False

    def checkpoint_prefix(self) -> str:
        return ""

    def after_optimizer(self) -> None:
        pass

    def squared_norm_share(self, parameters: list[nn.Parameter]) -> float:
        return squared_grad_norm(parameters)

    def full_state_dict(self, stage: StageChunks) -> dict[str, torch.Tensor]:
        return stage.state_dict()


class DdpSync(NoSync):
    """``ddp``: every replica holds the stage's whole parameters; gradients averaged in buckets.

    After the stage's last backward of the step, :meth:`finish` flattens the gradients into
    buckets of about :data:`BUCKET_BYTES`, all-reduces (sums) each over the stage's ``dp``
    group, divides by d and copies them back: every replica then holds the mean of the d
    replicas' gradients, each of which is the mean over its own 1/d of the batch, so the
    result is the gradient of the whole batch, as one process would compute it. The replicas
    start equal (:func:`broadcast_from_replica_zero`), and the same optimizer step from the same
    state keeps them equal without sending parameters again.
    From :class:`NoSync` it keeps doing nothing in :meth:`gather` (every replica keeps whole
    parameters) and :meth:`after_optimizer`, and returning the stage's own tensors.
    """

    mode = "ddp"

    def __init__(self, replicas: int, group: dist.ProcessGroup | None, replica: int = 0,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.replicas, self.group = replicas, group
        self.replica, self.bucket_bytes = replica, bucket_bytes
        self.parameters: list[nn.Parameter] = []

    def prepare(self, stage: StageChunks) -> None:
        self.parameters = [p for p in stage.parameters() if p.requires_grad]

    def finish(self) -> None:
        for bucket in self.buckets():
            # A replica whose share produced no gradient (all its micro-batches skipped) still
            # takes part, with zeros: every replica must call the same all-reduces.
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat /= self.replicas
            offset = 0
            for p, g in zip(bucket, grads):
                p.grad = flat[offset:offset + g.numel()].view_as(p).clone() if p.grad is None else \
                    p.grad.copy_(flat[offset:offset + g.numel()].view_as(p))
                offset += g.numel()

    def buckets(self) -> list[list[nn.Parameter]]:
        """The parameters in buckets of about ``bucket_bytes``, in order, one dtype per bucket."""
        return buckets_of(self.parameters, self.bucket_bytes)

    def squared_norm_share(self, parameters: list[nn.Parameter]) -> float:
        """Replica 0's squared norm, 0 elsewhere: after :meth:`finish` every replica holds the
        same gradients, so one of them counts the stage once (exactly, no division)."""
        return squared_grad_norm(parameters) if self.replica == 0 else 0.0


class LocalSgdSync(NoSync):
    """``localsgd``: no gradient exchange; the stage's parameters averaged over its replicas after
    every H-th step, by torch's :class:`~torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager`.

    torch's rule (averagers.py): each call averages when its ``step`` counter is divisible by
    ``period`` (past ``warmup_steps``), then adds one to the counter. The reference averages after
    steps H, 2H, ... counted from 1, so the averager is made with period = H, warmup 0, and its
    counter set to the steps done + 1 before the run's first call (:meth:`start_at`): a run
    resumed at step s averages after the same steps as one that never stopped, without the
    counter being saved anywhere. It is called after every optimizer step, before the gradients
    are cleared (torch averages only the parameters that hold a gradient: here every trainable
    one, on every replica alike) and before the step's checkpoint, which so holds the weights
    the next step starts from.

    Everything else is :class:`NoSync`'s, each replica on its own: :meth:`finish` leaves the
    gradients alone, and :meth:`squared_norm_share` is the rank's own squared norm, whose sum
    over the world is finite exactly when every replica's is (fp16's overflow check: every
    replica then skips the step together; clipping by it would mix the replicas' norms, so
    ``run`` refuses ``--grad-clip`` with localsgd). Checkpoints keep every replica's own
    weights and optimizer state (:meth:`checkpoint_prefix`); ``--save`` writes the mean of the
    replicas' parameters (:meth:`full_state_dict`), the model LocalSGD trains; buffers (a
    norm's running statistics) are not averaged, by torch or here: replica 0's are saved.
    """

    mode = "localsgd"

    def __init__(self, replicas: int, group: dist.ProcessGroup | None, replica: int, sync_every: int) -> None:
        import warnings

        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        self.replicas, self.group, self.replica, self.sync_every = replicas, group, replica, sync_every
        with warnings.catch_warnings():   # H = 1 is ddp's traffic, which torch warns of; the plan chose it
            warnings.simplefilter("ignore")
            self.averager = PeriodicModelAverager(period=sync_every, warmup_steps=0, process_group=group)
        self.parameters: list[nn.Parameter] = []
        self.stage: StageChunks | None = None

    def prepare(self, stage: StageChunks) -> None:
        self.stage, self.parameters = stage, list(stage.parameters())

    def start_at(self, steps_done: int) -> None:
        self.averager.step = steps_done + 1

    def after_update(self) -> bool:
        averages = self.averager.step % self.sync_every == 0   # torch's test, asked before it runs
        # torch averages the parameters holding a gradient, concatenated: none (a stage of
        # parameter-free or frozen layers) would fail its torch.cat. Every replica of the stage
        # has the same none, so skipping alike keeps the group in step; the count still moves.
        # Averaging rebinds each parameter's .data to a view of one flat buffer: harmless to the
        # optimizer (it holds the Parameter objects) and to checkpoints (they read .data).
        if any(p.grad is not None for p in self.parameters):
            self.averager.average_parameters(self.parameters)
        else:
            self.averager.step += 1
        return averages

    def checkpoint_prefix(self) -> str:
        return f"replica-{self.replica}/" if self.replica > 0 else ""

    def full_state_dict(self, stage: StageChunks) -> dict[str, torch.Tensor]:
        """The stage's tensors with every parameter the mean over the replicas (torch's
        ``average_parameters`` on copies: the replicas' own weights stay as they are), buffers
        this replica's own. Collective over ``dp``: every replica calls it."""
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        whole = dict(stage.state_dict())
        keys = [key for key, _ in stage.named_parameters()]
        copies = [whole[key].detach().clone() for key in keys]
        if copies:   # torch.cat of nothing fails; a stage without parameters has nothing to average
            average_parameters(iter(copies), self.group)
        whole.update(zip(keys, copies))
        return whole


def buckets_of(tensors: list[T], bucket_bytes: int) -> list[list[T]]:
    """``tensors`` in buckets of about ``bucket_bytes``, in order, one dtype and device per bucket
    (each bucket travels as one flat tensor)."""
    buckets: list[list[T]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][0].dtype != tensor.dtype \
                or buckets[-1][0].device != tensor.device:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


def broadcast_from_replica_zero(stage: StageChunks, group: dist.ProcessGroup | None, src: int,
                                bucket_bytes: int = BUCKET_BYTES) -> None:
    """Give every replica of the stage replica 0's parameters and buffers, as DDP does when it is built.

    The ranks build their stages from the seed, which gives every replica the same values only
    when the model's initialisation draws from torch's seeded generator; a factory that draws
    from Python's ``random``, NumPy or the clock gives each replica its own weights, and the
    replicas would train apart while ``--save`` kept replica 0's. So, once at the start (before
    fsdp shards them, and before ``--init-from`` or a checkpoint, which load alike everywhere),
    every tensor of the stage is broadcast from ``src`` (the global rank of the stage's replica 0)
    over its ``dp`` group, in flat buckets of one dtype (a few messages, not one per tensor).
    """
    tensors: dict[int, torch.Tensor] = {}
    for tensor in [*stage.module.parameters(), *stage.module.buffers(), *stage.state_dict().values()]:
        tensors.setdefault(id(tensor), tensor)
    with torch.no_grad():
        for bucket in buckets_of(list(tensors.values()), bucket_bytes):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def make_gradient_sync(mode: str, replicas: int, group: dist.ProcessGroup | None, mesh: object | None,
                       replica: int = 0, sync_every: int = 1) -> GradientSync:
    """The plan's ``gradient_sync`` for this rank's stage; ``group``/``mesh``: its ``dp`` group and 1-D mesh.

    One replica needs no sync (:class:`NoSync`), whatever the mode. ``replica``: this rank's
    replica index (ddp: replica 0 counts the stage in the global norm). ``sync_every``:
    localsgd's H. The training loop records each :meth:`GradientSync.finish`, and each
    averaging :meth:`GradientSync.after_update` did, as a span of kind ``gradient_sync``.
    """
    if replicas == 1:
        return NoSync()
    if mode == "ddp":
        return DdpSync(replicas, group, replica)
    if mode == "localsgd":
        return LocalSgdSync(replicas, group, replica, sync_every)
    if mode == "fsdp":
        from .fsdp import FsdpSync  # the fsdp engineer's module; only fsdp runs need it

        return FsdpSync(replicas, mesh)
    raise ValueError(f"gradient_sync {mode!r} is not one of ddp, fsdp, localsgd")
