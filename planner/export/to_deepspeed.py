"""DeepSpeed: the plan as a ``PipelineModule`` partition and the batch settings of its config.

DeepSpeed's pipeline engine takes the model as a list of layers (``PipelineModule(layers=...,
num_stages=K, partition_method=...)``) and cuts it by a *rule*: ``uniform`` (equal layer
counts), ``parameters`` (equal parameter counts) or ``type:REGEX`` (equal counts of the layers
whose class matches). It has no way to pass a list of boundaries, so an arbitrary balance
is not expressible through its public arguments. This export says whether the plan's
balance is what ``uniform`` gives (then it is exact), and otherwise gives two things:

- the nearest split its arguments express, ``uniform``, with the planner's predicted cost;
- the exact balance as the stage boundaries ``parts`` for a ``PipelineModule`` subclass that
  sets them itself (``_partition_layers`` is DeepSpeed's private method: it works with the
  versions that have it, and is marked as such).

The config's batch keys: ``train_micro_batch_size_per_gpu`` = the plan's micro-batch size,
``gradient_accumulation_steps`` = M, ``train_batch_size`` = the global batch (DeepSpeed checks
it equals micro-batch x M x data-parallel size). Its ``pipeline`` section: DeepSpeed's config
reads one (``get_pipeline_config``: ``stages``, ``partition``, ``activation_checkpoint_interval``,
...), and of it the engine applies ``activation_checkpoint_interval`` (to the
``PipelineModule``): where the plan recomputes every chunk, the largest stage's layer count,
so that each stage is checkpointed as one run, as the plan's chunks are. ``stages`` and
``partition_method`` there are ``PipelineModule``'s arguments (``num_stages``,
``partition_method``) for the user's script: the engine does not cut by them. DeepSpeed's pipeline runs one schedule, 1F1B
(``TrainSchedule``), one chunk per stage: a plan of another schedule exports its balance with
1F1B's order, and a plan of several chunks per stage (interleaved, zb-v) cannot be expressed.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...artifacts import BadInput
from ..baselines import uniform as uniform_bounds
from . import Exported
from .expressible import balance_of, bounds_of
from ...plan_view import PlanView
from .view import placement_note


def export(view: PlanView, out: str) -> Exported:
    if view.virtual_stages > 1:
        raise BadInput(f"plan '{view.path}': DeepSpeed's pipeline holds one chunk per stage; this plan's {view.schedule} "
                       f"holds {view.virtual_stages}: solve with --schedule 1f1b (or gpipe) to export to DeepSpeed")
    balance = view.balance
    # DeepSpeed's 'uniform' (deepspeed.runtime.utils.partition_uniform) gives the same boundaries.
    by_bounds = uniform_bounds(sum(balance), view.num_stages)
    uniform = balance_of(by_bounds[1:-1], by_bounds[-1])
    by_rule = balance == uniform          # partition_method 'uniform' says the plan's balance
    notes: list[str] = []
    if view.schedule != "1f1b":
        notes.append(f"DeepSpeed runs 1F1B only: the plan's {view.schedule} order does not export, its balance does")
    if not by_rule:
        notes.append(f"partition_method cannot say the balance {balance}: 'uniform' gives {uniform}; the exact "
                     f"boundaries are in 'gpipe_plan.parts'")
    placement = placement_note(view, "DeepSpeed")
    if placement:
        notes.append(placement)
    if view.gradient_sync == "fsdp":
        notes.append("DeepSpeed's pipeline engine does not shard parameters across replicas (ZeRO stage 1 at most): "
                     "the plan's fsdp memory does not hold there")
    flags = [chunk.recompute for chunk in view.chunks]
    pipeline: dict[str, object] = {"stages": view.num_stages, "partition_method": "uniform"}
    if all(flags):
        # The engine hands pipeline.activation_checkpoint_interval to the PipelineModule, whose forward
        # checkpoints runs of that many of a stage's layers: the largest stage's count makes each stage
        # one recomputed run, as the plan's chunks are.
        pipeline["activation_checkpoint_interval"] = max(balance)
    elif any(flags):
        notes.append(f"recomputation is per stage in the plan ({flags}); DeepSpeed's activation_checkpoint_interval "
                     f"applies to every stage alike")
    parts = bounds_of(balance)
    config = {
        "train_batch_size": view.global_batch_size,
        "train_micro_batch_size_per_gpu": view.micro_batch_size,
        "gradient_accumulation_steps": view.micro_batches,
        "pipeline": pipeline,
        "gpipe_plan": {
            "plan": view.path, "exact_with_partition_method": by_rule,
            "parts": parts, "balance": balance, "layers": view.layer_names,
            "data_parallel": view.data_parallel, "notes": notes,
        },
    }
    files = {out: json.dumps(config, indent=2) + "\n"}
    if not by_rule:
        snippet = str(Path(out).with_suffix(".partition.py"))
        files[snippet] = SUBCLASS_SNIPPET.format(balance=balance, parts=parts, stages=view.num_stages,
                                                 first=view.layer_names[0], last=view.layer_names[-1])
        notes.append(f"the exact split: {snippet} (a PipelineModule subclass setting DeepSpeed's private 'parts')")
    return Exported("deepspeed", files, exact=by_rule and not placement, notes=notes,
                    exported_balance=None if by_rule else uniform,
                    summary=f"deepspeed: {view.num_stages} stages, partition_method 'uniform' "
                            f"({'exact' if by_rule else 'nearest'}), M = {view.micro_batches} "
                            f"micro-batches of {view.micro_batch_size}")


SUBCLASS_SNIPPET = '''\
from deepspeed.pipe import PipelineModule

class PlannedPipelineModule(PipelineModule):
    """A PipelineModule cut at gpipe-plan's boundaries (DeepSpeed's private _partition_layers)."""

    def __init__(self, *args, parts, **kwargs):
        self._planned_parts = parts
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method="uniform"):
        # What DeepSpeed's own _partition_layers does, with the plan's boundaries for its rule.
        self.parts = list(self._planned_parts)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


# Layers per stage {balance}: stage k holds layers PARTS[k] to PARTS[k+1] - 1 of the list you
# give PipelineModule (the unsplit model's layers, in order: {first} ... {last}).
PARTS = {parts}
# model = PlannedPipelineModule(layers=..., num_stages={stages}, loss_fn=..., parts=PARTS)
'''
