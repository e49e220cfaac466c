"""The plan as the runtime reads it: checked once, up front, then plain attributes.

A plan (docs/plan-format.md) says how the layers are cut into chunks and which stage (device,
rank) holds each, how the batch is split into micro-batches, the schedule whose action lists
(``gpipe_plan.schedules``) order every stage's work, and what the planner predicted. Plans
of format 4 and before, whose stages each held one run of layers, read as one chunk per
stage (``gpipe_plan.plan_layout``). The
runtime trusts nothing it has not checked: a hand-edited or truncated plan is refused here,
in one line that names the key, before any process starts. Checks that need the model (do
the layer names match it?) happen on each rank, in :mod:`.stage`.

No torch here: ``gpipe-plan run`` reads the plan in the launching process, which does not
import torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..artifacts import BadInput, file_sha256, json_number, precision_of
from ..schema import PLAN_FORMAT, read_artifact, validate
from ..plan_layout import check_replicas, data_parallel, gradient_sync, plan_chunks, sync_every, virtual_stages
from ..schedules import SPLIT_BACKWARD, Action, all_actions, chunks_of_stage


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk of the plan (a contiguous run of layers), the stage that runs it, and what the
    planner predicted for it, per micro-batch."""

    index: int                       # place in the pipeline (model) order
    stage: int                       # the stage (device, rank) that runs it
    layers: tuple[str, ...]
    first_layer: int
    recompute: bool
    forward_s: float | None
    backward_s: float | None         # the whole backward B (with recomputation); I + W when split
    backward_input_s: float | None   # I: the gradient of the chunk's input
    backward_weight_s: float | None  # W: the gradient of the chunk's weights
    output_shapes: tuple[tuple[int, ...], ...] | None   # per sample; None: derive by running
    output_dtypes: tuple[str, ...] | None
    # Per output: True (the default) when it is made per sample, its shape above without the
    # batch; False when it is the same for every micro-batch, its shape above whole.
    output_batched: tuple[bool, ...] | None = None


@dataclass(frozen=True)
class StagePlan:
    """One stage (device, rank) of the plan: the chunks it holds and its predicted memory and idle time."""

    index: int
    chunks: tuple[int, ...]          # chunk indices, pipeline order
    memory_bytes: float | None       # predicted peak
    memory_parts: dict[str, float]   # the parts of memory_bytes (params_bytes, activations_bytes, ...)
    idle_fraction: float | None
    in_flight: int | None = None     # most micro-batches whose activations it holds at once
    gradient_sync_s: float | None = None   # predicted time per step of its replicas' gradient sync (format 6)


@dataclass(frozen=True)
class RunPlan:
    """Everything the runtime needs from a plan file."""

    path: str
    sha256: str
    doc: dict[str, Any]
    model: dict[str, Any]
    chunks: tuple[ChunkPlan, ...]
    stages: tuple[StagePlan, ...]
    micro_batches: int
    micro_batch_size: int
    global_batch_size: int
    schedule: str
    virtual_stages: int              # chunks per stage: v for interleaved, 2 for zb-v, else 1
    predicted_step_s: float | None
    predicted_bubble_fraction: float | None
    predicted_samples_per_s: float | None
    profile_device: dict[str, Any]
    optimizer: str | None            # the optimizer the plan's memory model counted
    precision: str = "fp32"          # the compute dtype the profile measured (artifacts.PRECISIONS)
    param_dtype: str = "fp32"        # the dtype the parameters were kept in
    # Data parallel (plan format 6): d replicas of the pipeline, ranks[k][r] runs stage k of
    # replica r; one replica on ranks 0..K-1 (stage k on rank k) before version 6.
    data_parallel: int = 1
    gradient_sync: str = "ddp"       # how a stage's replicas share gradients: "ddp" | "fsdp" | "localsgd"
    sync_every: int = 1              # localsgd: H, the steps between two averagings of the parameters
    ranks: tuple[tuple[int, ...], ...] = ()
    devices_per_node: int | None = None   # the placement's, when the plan says (format 6)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        """How many processes run the plan: K stages times d replicas."""
        return self.num_stages * self.data_parallel

    @property
    def replica_batch_size(self) -> int:
        """The samples of one step that one replica trains on: the global batch over d."""
        return self.global_batch_size // self.data_parallel

    def rank_of(self, stage: int, replica: int) -> int:
        """The global rank that runs ``stage`` of ``replica``."""
        return self.ranks[stage][replica] if self.ranks else stage

    def position_of(self, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` that global rank ``rank`` runs."""
        for k, row in enumerate(self.ranks or tuple((k,) for k in range(self.num_stages))):
            if rank in row:
                return k, row.index(rank)
        raise BadInput(f"plan '{self.path}' places no stage on rank {rank}: it runs on {self.world_size} ranks")

    def replica_ranks(self, replica: int) -> list[int]:
        """The ranks of ``replica``'s stages, in stage order (its pipeline)."""
        return [self.rank_of(k, replica) for k in range(self.num_stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks of ``stage``'s replicas, in replica order (its gradient sync group)."""
        return [self.rank_of(stage, r) for r in range(self.data_parallel)]

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def split_backward(self) -> bool:
        """Whether the schedule runs the backward as I then W (zero bubble) instead of B."""
        return self.schedule in SPLIT_BACKWARD

    @property
    def profile_threads(self) -> int | None:
        threads = self.profile_device.get("threads")
        return threads if isinstance(threads, int) and threads >= 1 else None

    @property
    def layer_names(self) -> list[str]:
        return [name for chunk in self.chunks for name in chunk.layers]

    def chunks_of(self, stage: int) -> list[ChunkPlan]:
        """The chunks stage ``stage`` holds, in pipeline order."""
        return [self.chunks[c] for c in self.stages[stage].chunks]

    def actions(self) -> list[list[Action]]:
        """Every stage's actions for one step, in order (``all_actions(...)[k]`` is stage k's)."""
        return all_actions(self.schedule, self.num_stages, self.micro_batches, self.virtual_stages)


def load_plan(path: str | os.PathLike[str]) -> RunPlan:
    """Read and check a plan file; raise :class:`BadInput` naming the first problem.

    Each key on its own is the schema's to check (gpipe_plan/schema.py), how the keys fit
    together is plan_layout's (shared with every other reader); what is left here is to refuse
    a model there is nothing to run of, and to turn the document into plain attributes.
    """
    where = f"plan '{path}'"
    doc = read_artifact(path, PLAN_FORMAT)
    validate(doc, "plan", where)
    precision, param_dtype = precision_of(doc, where)
    _refuse_imported_model(doc["model"], where)
    # Each of the d replicas runs M micro-batches of b samples (together the global batch), on
    # the ranks of a permutation: checked where every reader checks it.
    ranks = tuple(tuple(row) for row in check_replicas(doc, where))
    # The chunks, each on its stage, whatever the plan's version; refuses a schedule that
    # cannot run this many stages and micro-batches, and chunks that do not fit together.
    chunks = tuple(_chunk_plan(raw) for raw in plan_chunks(doc, where))
    predicted = _section(doc, "predicted")
    return RunPlan(
        path=os.fspath(path),
        sha256=file_sha256(path),
        doc=doc,
        model=doc["model"],
        chunks=chunks,
        stages=_stage_plans(doc),
        micro_batches=doc["micro_batches"],
        micro_batch_size=doc["micro_batch_size"],
        global_batch_size=doc["global_batch_size"],
        schedule=doc["schedule"],
        virtual_stages=virtual_stages(doc),
        predicted_step_s=json_number(predicted.get("step_s")),
        predicted_bubble_fraction=json_number(predicted.get("bubble_fraction")),
        predicted_samples_per_s=json_number(predicted.get("samples_per_s")),
        profile_device=_section(_section(doc, "profile"), "device"),
        optimizer=_text_or_none(_section(doc, "options").get("optimizer")),
        precision=precision,
        param_dtype=param_dtype,
        data_parallel=data_parallel(doc),
        gradient_sync=gradient_sync(doc),
        sync_every=sync_every(doc),
        ranks=ranks,
        devices_per_node=_int_or_none(_section(doc, "placement").get("devices_per_node")),
    )


def check_sync_matches(plan: RunPlan, grad_clip: float | None) -> None:
    """Refuse, in one line, run options the plan's gradient sync cannot honour: ``--grad-clip``
    under localsgd, which clips by the global gradient norm while each replica steps on its own
    gradient (one norm over d different gradients would clip none of them by its own)."""
    if plan.gradient_sync == "localsgd" and plan.data_parallel > 1 and grad_clip is not None:
        raise BadInput("--grad-clip clips by the global gradient norm, but under the plan's localsgd each replica "
                       "steps on its own gradient: leave --grad-clip out, or solve with --gradient-sync ddp")


def check_precision_matches(plan: RunPlan, precision: str | None, param_dtype: str | None) -> tuple[str, str]:
    """The precision to run with: the plan's, unless asked for another, which is refused.

    A plan's times and memory were measured in its profile's precision; run in another, the
    prediction is off by up to an order of magnitude in time and 2x in memory, and the
    shapes it sends between stages have other dtypes.
    """
    for flag, asked, planned in (("--precision", precision, plan.precision),
                                 ("--param-dtype", param_dtype, plan.param_dtype)):
        if asked is not None and asked != planned:
            wanted = (precision or plan.precision, param_dtype or plan.param_dtype)
            raise BadInput(f"{flag} {asked} differs from plan '{plan.path}', made from a profile measured with "
                           f"{flag} {planned}: re-profile with --precision {wanted[0]} --param-dtype {wanted[1]} "
                           f"and solve again, or drop {flag}")
    return plan.precision, plan.param_dtype


def _refuse_imported_model(model: dict[str, Any], where: str) -> None:
    """Refuse a plan of an imported PipeDream profile: it names no PyTorch model to build."""
    if model.get("source") == "pipedream":
        raise BadInput(f"{where} was made from an imported PipeDream profile ('{model.get('name')}'): "
                       f"it can be planned and shown, but there is no PyTorch model to run")


def _chunk_plan(raw: dict[str, Any]) -> ChunkPlan:
    """One chunk as :func:`gpipe_plan.plan_layout.plan_chunks` gives it (every key present,
    None where the plan says nothing), as the runtime reads it."""
    shapes = raw["output_shapes"]
    return ChunkPlan(
        index=raw["index"],
        stage=raw["stage"],
        layers=tuple(raw["layers"]),
        first_layer=raw["first_layer"],
        recompute=raw["recompute"],
        forward_s=json_number(raw["forward_s"]),
        backward_s=json_number(raw["backward_s"]),
        backward_input_s=json_number(raw["backward_input_s"]),
        backward_weight_s=json_number(raw["backward_weight_s"]),
        output_shapes=tuple(tuple(int(size) for size in shape) for shape in shapes) if shapes is not None else None,
        # plan_chunks gives a dtype per shape whenever there are shapes.
        output_dtypes=tuple(str(dtype) for dtype in raw["output_dtypes"]) if shapes is not None else None,
        output_batched=tuple(raw["output_batched"]) if raw["output_batched"] is not None else None,
    )


def _stage_plans(doc: dict[str, Any]) -> tuple[StagePlan, ...]:
    """Each stage: the chunks its schedule places on it, and what the planner predicted for it."""
    raw_stages = doc["stages"]
    K, v = len(raw_stages), virtual_stages(doc)
    return tuple(StagePlan(
        index=k,
        chunks=tuple(chunks_of_stage(doc["schedule"], k, K, v)),
        memory_bytes=json_number(raw.get("memory_bytes")),
        memory_parts={part: float(size) for part, size in (raw.get("memory") or {}).items()
                      if json_number(size) is not None},
        idle_fraction=json_number(raw.get("idle_fraction")),
        in_flight=_int_or_none(raw.get("in_flight")),
        gradient_sync_s=json_number(raw.get("gradient_sync_s")),
    ) for k, raw in enumerate(raw_stages))


def _section(doc: dict[str, Any], key: str) -> dict[str, Any]:
    """The object under ``key``, or an empty one where the plan has none (an older or hand-made plan)."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
