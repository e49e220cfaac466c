"""FSDP2 gradient sync: each replica of a stage keeps 1/d of its parameters between steps.

With ``gradient_sync: "fsdp"`` the d replicas of a stage (its ``dp`` group, :mod:`.gradient_sync`)
shard every parameter of the stage along its first dimension with FSDP2's ``fully_shard``:
between steps a rank holds 1/d of the parameters, of their gradients and of the optimizer
state (Adam's two moments), so the optimizer steps only its own shard. Within a step:

1. the parameters are all-gathered, once: ``reshard_after_forward=False`` keeps them whole for
   all M micro-batches (one gather per step, not per micro-batch: the planner's memory model
   counts the whole parameters P during the step plus the P/d shard);
2. every backward, whole (``torch.autograd.backward``) or split in an input half and a weight
   half (``stage_backward_input`` / ``stage_backward_weight``), only adds into the whole
   parameters' local ``.grad``: gradient sync is off, as in torch's own pipelining
   (``backward_maybe_with_nosync``), since a reduction inside a backward would delay the
   gradient the previous stage waits for;
3. after the stage's last action, :meth:`FsdpSync.finish` reduce-scatters the summed
   gradients (each rank receives the average over the replicas of its own shard: the unsplit
   model's gradient on the whole batch, since each replica's loss is the mean over its 1/d)
   and frees the whole parameters, as torch's ``perform_reduce_grad`` (its REDUCE_GRAD
   action) does;
4. the optimizer steps the shards (DTensors); :meth:`FsdpSync.after_optimizer` starts the next
   step's all-gather at once, so that it overlaps the wait for the first activation.

Reduce-scatter plus all-gather move the same bytes in as many ring steps as one all-reduce,
so the planner charges fsdp the same time as ddp (docs/planner.md, "Data parallel").

Each chunk module is its own FSDP unit and root: torch's ``PipelineStage`` takes one chunk as
its module (:class:`.torch_executor.TorchExecutor` hands it ours), and seeing an FSDP module
there, torch's runtime does steps 1 to 3 itself (its UNSHARD, REDUCE_GRAD and RESHARD
actions); :meth:`FsdpSync.finish` then finds nothing left to reduce, and the gather that
:meth:`FsdpSync.after_optimizer` started is the one torch's UNSHARD waits for. A parameter
that two chunks of one stage share (a tied embedding at both ends of a ``zb-v`` V) would have
to be sharded by a unit holding both chunks, which nobody calls; it is refused in one line. A
parameter tied across stages is a copy per stage (:mod:`.tied`), sharded alike on each (same
shape, same d): summing the copies' shard gradients across the stages, after
:meth:`FsdpSync.finish`, is summing the whole gradients.

What the training loop does differently with sharded parameters: a parameter, its gradient
and its optimizer state are DTensors, whose ``numel()`` is the whole tensor's while a rank
holds only its local shard (``to_local()``, ``memory.local_tensor``). What a rank holds is
counted in :mod:`.memory` (``local_bytes``, ``static_bytes(..., sharded=True)``); the helper
below makes a whole tensor (:func:`whole_tensor`); the squared gradient norm sums the local shards
(``optim.squared_grad_norm``). In-place arithmetic on the gradients (clipping, fp16
unscaling) works on DTensors as it is.
"""

from __future__ import annotations

from typing import Any

import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from ..artifacts import BadInput
from .optim import squared_grad_norm
from .stage import StageChunks


class FsdpSync:
    """The ``GradientSync`` of :mod:`.gradient_sync` for ``gradient_sync: "fsdp"`` (one per rank)."""

    mode = "fsdp"

    def __init__(self, replicas: int, mesh: Any) -> None:
        """``mesh``: the 1-D ``dp`` DeviceMesh of this rank's stage (its d replicas)."""
        self.replicas = replicas
        self.mesh = mesh
        self.units: list[FSDPModule] = []
        self.pending: list[Any] = []   # the next step's all-gathers in flight (UnshardHandle)

    # ------------------------------------------------------------------ the step
    def prepare(self, stage: StageChunks) -> None:
        """Shard each chunk of the stage over the replicas; every backward from now on accumulates.

        Build the optimizer after this, from ``stage.parameters()``: they are now the DTensor
        shards, new Parameter objects under the same names (whoever kept the old objects finds
        the new ones by name: ``chunk.module.get_parameter(name)``).
        """
        refuse_shared_parameters(stage)
        # FSDP2 warns when a module returns a view (a chunk ending in a reshape), because an
        # in-place op on it would skip its pre-backward hook. The executors never change a
        # chunk's outputs in place (they send them, or hand them to the next chunk as inputs),
        # and tests/runtime/test_fsdp.py checks the gradients: the warning would only alarm every run.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                                category=UserWarning)
        self.units = []
        for chunk in stage.chunks:
            unit = fully_shard(chunk.module, mesh=self.mesh, reshard_after_forward=False)
            assert isinstance(unit, FSDPModule)
            self.units.append(unit)
        self._accumulate_only()

    def finish(self) -> None:
        """Reduce-scatter the step's summed gradients (averaged over the replicas), then reshard.

        What torch's ``perform_reduce_grad`` does after a stage's last backward: the backwards
        ran outside FSDP's own sense of "the last backward", so its post-backward (which
        reduces) is called here by hand for every parameter group, then the final callback
        that waits for the reductions. Afterwards ``.grad`` of each sharded parameter holds
        this rank's shard of the averaged gradient and the whole parameters are freed.
        """
        for unit in self.units:
            unit.set_is_last_backward(True)
            unit.set_reshard_after_backward(True)
            unit.set_requires_gradient_sync(True)
            state = fully_shard.state(unit)  # type: ignore[attr-defined]
            for each in state._state_ctx.all_states:
                for group in _param_groups(each):
                    group.post_backward()
            state._root_post_backward_final_callback()
        self._accumulate_only()

    def gather(self) -> None:
        """Have the step's parameters whole before its first action: wait for the gathers
        :meth:`after_optimizer` started, or (the run's first step, or after a resume) gather now."""
        if self.pending:
            self._wait_for_gathers()
        else:
            for unit in self.units:
                unit.unshard()

    def start_at(self, steps_done: int) -> None:
        """Nothing: fsdp syncs every step, whatever step it starts from."""

    def after_update(self) -> bool:
        """Nothing to average: the gradients were (:meth:`finish`)."""
        return False

    def checkpoint_prefix(self) -> str:
        """The plain keys: DCP saves each shard of the replicas' common tensors once."""
        return ""

    def after_optimizer(self) -> None:
        """Start all-gathering the next step's parameters now (asynchronously).

        :meth:`gather` waits for it before the next step's first action, so the gather
        overlaps the optimizer's end, the checkpoint and the batch; the planner charges it next
        to the optimizer step.
        """
        self.pending = [unit.unshard(async_op=True) for unit in self.units]

    def _accumulate_only(self) -> None:
        """Every backward until :meth:`finish`: add into the whole parameters' ``.grad``, keep them whole."""
        for unit in self.units:
            unit.set_is_last_backward(False)
            unit.set_reshard_after_backward(False)
            unit.set_requires_gradient_sync(False)

    def _wait_for_gathers(self) -> None:
        for handle in self.pending:
            if handle is not None:
                handle.wait()
        self.pending = []

    # ------------------------------------------------------------------ norms and saving
    def squared_norm_share(self, parameters: list[nn.Parameter]) -> float:
        """Squared norm of this rank's gradient shards: shards do not overlap, so summed over the
        world the shares count every element of the whole model's gradient exactly once."""
        return squared_grad_norm(parameters)

    def full_state_dict(self, stage: StageChunks) -> dict[str, torch.Tensor]:
        """The stage's whole tensors under the unsplit model's keys, on every replica, where they
        are (the caller copies what it keeps).

        Collective over ``dp``: each DTensor is all-gathered (``full_tensor``), in the same
        order on every replica (the same modules). A gather started by :meth:`after_optimizer`
        is waited for first, so that no collective of this rank overtakes it.
        """
        self._wait_for_gathers()
        return {key: whole_tensor(value) for key, value in stage.state_dict().items()}


def _param_groups(state: Any) -> list[Any]:
    """An FSDP state's parameter groups: a list in recent torch, one (or none) in older releases
    (torch 2.11 on the GPU machine may be either; this private layout is what torch's own
    ``perform_reduce_grad`` walks)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def refuse_shared_parameters(stage: StageChunks) -> None:
    """Refuse a stage whose chunks share a parameter: one FSDP unit per chunk cannot shard it twice.

    FSDP2 shards a parameter once, in the unit of the lowest module holding every use of it;
    here that would be the stage's list of chunks, which no executor calls (each chunk runs on
    its own), so its gathers and reductions would never be triggered.
    """
    owner: dict[int, int] = {}
    for chunk in stage.chunks:
        whole_key = {local: key for key, local in chunk.global_to_local.items()}
        for name, p in chunk.module.named_parameters():
            if id(p) in owner and owner[id(p)] != chunk.index:
                raise BadInput(f"gradient_sync fsdp cannot shard '{whole_key.get(name, name)}': chunks "
                               f"{owner[id(p)]} and {chunk.index} of stage {stage.index} share it (tied weights); "
                               f"use gradient_sync ddp, or a schedule that puts those chunks on different stages")
            owner[id(p)] = chunk.index


# ---------------------------------------------------------------------- DTensor-aware helpers
def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on this rank: a DTensor all-gathered (collective over its mesh), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t

