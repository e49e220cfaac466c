"""The one door a plan file comes in by: read, checked, and seen as plain attributes.

A plan (docs/plan-format.md) says how the layers are cut into chunks and which stage (device,
rank) holds each, how the batch is split into micro-batches, the schedule whose action lists
(``gpipe_plan.schedules``) order every stage's work, what the planner predicted, and for
every layer the module of the unsplit model it is. Every reader (``run``, ``show``,
``export``, ``calibrate``) comes in by :func:`read_plan`: the file is read at a version this
code reads (``schema.read_artifact``), each key checked on its own (``schema.validate``), how
they fit together and every older version's shape settled once (``gpipe_plan.plan_layout``:
a plan of format 4 and before, whose stages each held one run of layers, reads as one chunk
per stage), and what comes out is one :class:`PlanView`, the same for all of them, so none
adapts a version or re-checks a key (``solve`` sees the plan it has just made the same way,
through :func:`view_of`). A hand-edited or truncated plan is refused here, in one
line that names the key, before any process starts; checks that need the model (do the layer
names match it?) happen on each rank, in ``runtime/stage.py``.

**Module names.** A trainer names a model's parts by their fully qualified names in the
unsplit model (``model.layers.3``, ``lm_head``, ``0`` for an ``nn.Sequential``'s first child):
torchtitan's ``module_fqns_per_model_part``, torch's ``split_spec``. Since profile format 8 each
layer records the module it is (``layers[i].module``, null when a layer is not one module:
a piece of a traced graph, several merged modules), and a plan of format 6 copies them into
``chunks[c].modules``. An older plan of an imported model (a Hugging Face model or an
``nn.Sequential``) is read with the layer names as the module names, since those are how its
layers were named; a built-in model's older plan has no module names.

No torch here: ``gpipe-plan run`` reads the plan in the launching process, which does not
import torch, and the planner's commands (show, export) never do.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from .artifacts import BadInput, file_sha256, json_number, locate, precision_of
from .plan_layout import check_replicas, data_parallel, gradient_sync, plan_chunks, sync_every, virtual_stages
from .schedules import SPLIT_BACKWARD, Action, all_actions, chunks_of_stage
from .schema import PLAN_FORMAT, read_artifact, validate


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
    recompute_s: float | None        # the forward again before the backward, when it recomputes
    send_s: float | None             # sending its output on to the next chunk's stage
    output_shapes: tuple[tuple[int, ...], ...] | None   # per sample; None: derive by running
    output_dtypes: tuple[str, ...] | None
    # Per output: True (the default) when it is made per sample, its shape above without the
    # batch; False when it is the same for every micro-batch, its shape above whole.
    output_batched: tuple[bool, ...] | None = None
    # Per layer: the unsplit model's module name, None where a layer is not one module.
    modules: tuple[str | None, ...] = ()
    # Per layer: its parameters' bytes as profiled (version 10), which run checks the rebuilt
    # model against; None: not recorded, not checked.
    param_bytes: tuple[int, ...] | None = None


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
    busy_s: float | None = None      # predicted time per step it computes
    optimizer_s: float | None = None  # predicted time of its optimizer step
    # An asynchronous schedule's (format 8): the updates its gradients lag the weights they are
    # applied to, and the weight versions it stashes; a synchronous one's are 0 and 1.
    staleness_updates: int = 0
    weight_versions: int = 1


@dataclass(frozen=True)
class Prediction:
    """What the planner predicted for the whole step (``predicted``; None: not recorded)."""

    step_s: float | None = None
    bubble_fraction: float | None = None
    samples_per_s: float | None = None
    peak_memory_bytes: float | None = None
    gradient_sync_s: float | None = None     # what the gradient syncs add to the step (format 6)
    # The best plan of the same batch on one device (format 4); compared: the plan records it.
    one_stage_compared: bool = False
    one_stage_fits: bool | None = None
    one_stage_step_s: float | None = None
    one_stage_peak_memory_bytes: float | None = None
    speedup_over_one_stage: float | None = None
    # How far chance alone may move a run from step_s, and from what (planner/plan.py).
    noise_fraction: float | None = None
    noise_sources: dict[str, float] | None = None
    # An asynchronous schedule's (format 8): step_s is M periods of the steady state, plus the
    # fill and drain paid once per run.
    steady_state_period_s: float | None = None
    fill_drain_s: float | None = None


@dataclass(frozen=True)
class Optimality:
    """Whether the search proved the plan the fastest (``optimality``), and how."""

    proven: bool
    method: str | None
    settings_searched: int | None
    gap: float | None                # to the proven lower bound, when not proven


@dataclass(frozen=True)
class RunnerUp:
    """A setting (M, schedule) of the chosen stages and replicas that ``solve`` tried and
    found slower (``runners_up``)."""

    micro_batches: int
    micro_batch_size: int
    schedule: str
    virtual_stages: int
    fits: bool
    step_s: float | None
    bubble_fraction: float | None
    peak_memory_bytes: float | None
    balance: tuple[int, ...]


@dataclass(frozen=True)
class TunedCandidate:
    """One plan ``gpipe-plan tune`` ran (``tuning.candidates``)."""

    source: str
    schedule: str
    virtual_stages: int
    micro_batches: int
    balance: tuple[int, ...]
    predicted_step_s: float
    measured_step_s: tuple[float | None, ...]
    failed: str | None
    chosen: bool

    @property
    def median_step_s(self) -> float | None:
        return median_of_rounds(self.measured_step_s, self.failed)


def median_of_rounds(steps_s: Sequence[float | None], failed: str | None) -> float | None:
    """A tune candidate's step: the median over the rounds it ran (None: it never ran, or its
    run failed)."""
    got = [x for x in steps_s if x is not None]
    return statistics.median(got) if got and failed is None else None


@dataclass(frozen=True)
class Tuning:
    """What ``gpipe-plan tune`` ran to choose the plan (``tuning``, plan format 11)."""

    steps: int
    rounds: int
    within: float
    candidates: tuple[TunedCandidate, ...]


@dataclass(frozen=True)
class Factorisation:
    """One (stages, replicas) pair ``solve --devices`` searched (``factorisations``)."""

    stages: int
    data_parallel: int
    order: str | None
    fits: bool
    step_s: float | None
    samples_per_s: float | None
    reason: str | None               # why it lost, or cannot run


@dataclass(frozen=True)
class PlanOptions:
    """What ``solve`` was asked and what its setting charged, as far as a reader needs them again:
    to print the plan (``show``) and to rebuild its cost model (``export``). From the plan's
    ``options``, and ``placement`` for what its sends and syncs were charged (format 6)."""

    memory_limit_bytes: float | None = None
    memory_limit_source: str | None = None   # "device" | "host" | None (the user's)
    global_batch_size_source: str | None = None
    recompute: str = "auto"
    compute_scale: float = 1.0       # layer times x this: neighbours computing side by side
    concurrent_ranks: float | None = None    # the ranks the host ran at once (None: a core each)
    shared_core_slowdown: float = 1.0        # ... and every action's time x this there (format 9)
    shared_core_action_s: float = 0.0        # ... plus this
    per_microbatch_overhead_s: float = 0.0
    fixed_costs: dict[str, Any] | None = None   # planner/fixedcosts.py's record
    # The pipeline's sends (None bandwidth: a free link): the placement's (format 6), else the link.
    pipeline_bandwidth_bytes_per_s: float | None = None
    pipeline_latency_s: float = 0.0
    # The replicas' gradient syncs (format 6).
    sync_bandwidth_bytes_per_s: float | None = None
    sync_latency_s: float = 0.0


@dataclass(frozen=True)
class PlanView:
    """A plan file as every reader sees it (:func:`read_plan`)."""

    path: str                        # the file read ("" for the plan solve has just made)
    sha256: str
    model: dict[str, Any]
    chunks: tuple[ChunkPlan, ...]
    stages: tuple[StagePlan, ...]
    micro_batches: int
    micro_batch_size: int
    global_batch_size: int
    schedule: str
    virtual_stages: int              # chunks per stage: v for interleaved, 2 for zb-v, else 1
    predicted: Prediction
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
    placement_order: str = "pipeline-inner"    # how the plan laid ranks out (plan_layout.PLACEMENT_ORDERS)
    nodes: int = 1                   # machines the placement spreads the ranks over
    placement_reason: str | None = None
    # The profile the plan was made from, where the plan records it.
    profile_path: str | None = None
    profile_sha256: str | None = None
    options: PlanOptions = PlanOptions()
    updates_per_step: int = 1        # each stage's updates a step (asynchronous schedules: format 8)
    optimality: Optimality | None = None
    runners_up: tuple[RunnerUp, ...] = ()
    factorisations: tuple[Factorisation, ...] = ()
    warnings: tuple[str, ...] = ()
    tuning: Tuning | None = None     # what ``gpipe-plan tune`` ran to choose it (format 11)

    @property
    def predicted_step_s(self) -> float | None:
        return self.predicted.step_s

    @property
    def predicted_bubble_fraction(self) -> float | None:
        return self.predicted.bubble_fraction

    @property
    def predicted_samples_per_s(self) -> float | None:
        return self.predicted.samples_per_s

    @property
    def where(self) -> str:
        """The plan as its one-line errors name it: its file, or "plan" for one solve has just made."""
        return f"plan '{self.path}'" if self.path else "plan"

    @property
    def model_name(self) -> str:
        """The model's name as printed: its name, else its factory."""
        return self.model.get("name") or self.model.get("factory") or "model"

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
        raise BadInput(f"{self.where} places no stage on rank {rank}: it runs on {self.world_size} ranks")

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
        """Every layer, in model order."""
        return [name for chunk in self.chunks for name in chunk.layers]

    @property
    def balance(self) -> list[int]:
        """Layers per chunk, in pipeline order."""
        return [len(chunk.layers) for chunk in self.chunks]

    def chunks_of(self, stage: int) -> list[ChunkPlan]:
        """The chunks stage ``stage`` holds, in pipeline order."""
        return [self.chunks[c] for c in self.stages[stage].chunks]

    def actions(self) -> list[list[Action]]:
        """Every stage's actions for one step, in order (``all_actions(...)[k]`` is stage k's)."""
        return all_actions(self.schedule, self.num_stages, self.micro_batches, self.virtual_stages)


def read_plan(path: str | os.PathLike[str], what: str = "plan") -> PlanView:
    """Read and check a plan file; raise :class:`BadInput` naming the first problem.

    ``what``: the schema's kind to check it as: "plan" (what run and export need), or "solved
    plan" (what show renders: the planner's predictions too).
    """
    return view_of(read_artifact(path, PLAN_FORMAT), what, f"plan '{path}'", os.fspath(path), file_sha256(path))


def profile_file_of(plan_path: str | os.PathLike[str]) -> str | None:
    """The profile the plan at ``plan_path`` was made from, where it still is (as the plan
    records it, else beside the plan); None where it is not found or the plan cannot be read
    (the command reading the plan says why). An output written over it would lose what a later
    calibrate or tune of that plan reads, so the commands that write beside a plan count it
    among their inputs."""
    try:
        recorded = read_plan(plan_path).profile_path
    except BadInput:
        return None
    return locate(recorded, os.fspath(plan_path)) if recorded else None


def view_of(doc: dict[str, Any], what: str = "solved plan", where: str = "plan", path: str = "",
            sha256: str = "") -> PlanView:
    """Check a plan document and see it as a :class:`PlanView`: a file :func:`read_plan` has
    read, or the plan ``solve`` has just made (``path`` and ``sha256``: the file's, where it is
    one). Each key on its own is the schema's to check (gpipe_plan/schema.py), how the keys fit
    together plan_layout's; what is left here is to turn the document into plain attributes.
    """
    validate(doc, what, where)
    precision, param_dtype = precision_of(doc, where)
    # Each of the d replicas runs M micro-batches of b samples (together the global batch), on
    # the ranks of a permutation: checked where every reader checks it.
    ranks = tuple(tuple(row) for row in check_replicas(doc, where))
    # The chunks, each on its stage, whatever the plan's version; refuses a schedule that
    # cannot run this many stages and micro-batches, and chunks that do not fit together.
    model = doc["model"]
    entries = doc.get("chunks") or doc["stages"]
    chunks = tuple(_chunk_plan(raw, _modules(entry, tuple(raw["layers"]), model, where))
                   for raw, entry in zip(plan_chunks(doc, where), entries))
    placement = _section(doc, "placement")
    source = _section(doc, "profile")
    return PlanView(
        path=path,
        sha256=sha256,
        model=model,
        chunks=chunks,
        stages=_stage_plans(doc),
        micro_batches=doc["micro_batches"],
        micro_batch_size=doc["micro_batch_size"],
        global_batch_size=doc["global_batch_size"],
        schedule=doc["schedule"],
        virtual_stages=virtual_stages(doc),
        predicted=_prediction(_section(doc, "predicted")),
        profile_device=_section(source, "device"),
        optimizer=_text_or_none(_section(doc, "options").get("optimizer")),
        precision=precision,
        param_dtype=param_dtype,
        data_parallel=data_parallel(doc),
        gradient_sync=gradient_sync(doc),
        sync_every=sync_every(doc),
        ranks=ranks,
        devices_per_node=_int_or_none(placement.get("devices_per_node")),
        placement_order=str(placement.get("order") or "pipeline-inner"),
        nodes=int(placement.get("nodes") or 1),
        placement_reason=_text_or_none(placement.get("reason")),
        profile_path=_text_or_none(source.get("path")),
        profile_sha256=_text_or_none(source.get("sha256")),
        options=_options(_section(doc, "options"), placement),
        updates_per_step=doc.get("updates_per_step") or 1,
        optimality=_optimality(_section(doc, "optimality")),
        runners_up=tuple(_runner_up(row) for row in doc.get("runners_up") or ()),
        factorisations=tuple(_factorisation(row) for row in doc.get("factorisations") or ()),
        warnings=tuple(doc.get("warnings") or ()),
        tuning=_tuning(doc.get("tuning")),
    )


def _tuning(section: dict[str, Any] | None) -> Tuning | None:
    if not section:
        return None
    return Tuning(section["steps"], section["rounds"], section["within"], tuple(
        TunedCandidate(c["source"], c["schedule"], c["virtual_stages"], c["micro_batches"], tuple(c["balance"]),
                       c["predicted_step_s"], tuple(c["measured_step_s"]), c.get("failed"), c["chosen"])
        for c in section["candidates"]))


def _prediction(predicted: dict[str, Any]) -> Prediction:
    """The plan's ``predicted`` (every figure optional: a plan that only ``run`` reads may have none)."""
    sources = predicted.get("noise_sources")
    number = {key: json_number(predicted.get(key)) for key in (
        "step_s", "bubble_fraction", "samples_per_s", "peak_memory_bytes", "gradient_sync_s", "one_stage_step_s",
        "one_stage_peak_memory_bytes", "speedup_over_one_stage", "noise_fraction", "steady_state_period_s",
        "fill_drain_s")}
    return Prediction(**number, one_stage_compared="one_stage_fits" in predicted,
                      one_stage_fits=bool(predicted.get("one_stage_fits")),
                      noise_sources=dict(sources) if isinstance(sources, dict) else None)


def _options(options: dict[str, Any], placement: dict[str, Any]) -> PlanOptions:
    """The plan's :class:`PlanOptions`: its ``options``, and ``placement`` since format 6."""
    # The pipeline's sends: the placement's (format 6), else the link of ``options``.
    charged = placement if "pipeline_bandwidth_bytes_per_s" in placement else {
        "pipeline_bandwidth_bytes_per_s": options.get("link_bandwidth_bytes_per_s"),
        "pipeline_latency_s": options.get("link_latency_s")}
    return PlanOptions(
        memory_limit_bytes=json_number(options.get("memory_limit_bytes")),
        memory_limit_source=_text_or_none(options.get("memory_limit_source")),
        global_batch_size_source=_text_or_none(options.get("global_batch_size_source")),
        recompute=str(options.get("recompute") or "auto"),
        compute_scale=float(options.get("compute_scale") or 1.0),
        concurrent_ranks=json_number(options.get("concurrent_ranks")),
        shared_core_slowdown=float(options.get("shared_core_slowdown") or 1.0),
        shared_core_action_s=float(options.get("shared_core_action_s") or 0.0),
        per_microbatch_overhead_s=float(options.get("per_microbatch_overhead_s") or 0.0),
        fixed_costs=options.get("fixed_costs"),
        pipeline_bandwidth_bytes_per_s=json_number(charged.get("pipeline_bandwidth_bytes_per_s")),
        pipeline_latency_s=float(charged.get("pipeline_latency_s") or 0.0),
        sync_bandwidth_bytes_per_s=json_number(placement.get("sync_bandwidth_bytes_per_s")),
        sync_latency_s=float(placement.get("sync_latency_s") or 0.0),
    )


def _optimality(record: dict[str, Any]) -> Optimality | None:
    """The plan's ``optimality``; None where it has none."""
    if not record:
        return None
    return Optimality(proven=bool(record.get("proven")), method=_text_or_none(record.get("method")),
                      settings_searched=_int_or_none(record.get("settings_searched")),
                      gap=json_number(record.get("gap")))


def _runner_up(row: dict[str, Any]) -> RunnerUp:
    return RunnerUp(micro_batches=row["micro_batches"], micro_batch_size=row["micro_batch_size"],
                    schedule=row["schedule"], virtual_stages=row.get("virtual_stages") or 1,
                    fits=bool(row.get("fits")), step_s=json_number(row.get("step_s")),
                    bubble_fraction=json_number(row.get("bubble_fraction")),
                    peak_memory_bytes=json_number(row.get("peak_memory_bytes")),
                    balance=tuple(row.get("balance") or ()))


def _factorisation(row: dict[str, Any]) -> Factorisation:
    return Factorisation(stages=row["stages"], data_parallel=row["data_parallel"],
                         order=_text_or_none(row.get("order")), fits=bool(row.get("fits")),
                         step_s=json_number(row.get("step_s")), samples_per_s=json_number(row.get("samples_per_s")),
                         reason=_text_or_none(row.get("reason")))


def _chunk_plan(raw: dict[str, Any], modules: tuple[str | None, ...]) -> ChunkPlan:
    """One chunk as :func:`gpipe_plan.plan_layout.plan_chunks` gives it (every key present,
    None where the plan says nothing), with its layers' module names."""
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
        recompute_s=json_number(raw["recompute_s"]),
        send_s=json_number(raw["send_s"]),
        output_shapes=tuple(tuple(int(size) for size in shape) for shape in shapes) if shapes is not None else None,
        # plan_chunks gives a dtype per shape whenever there are shapes.
        output_dtypes=tuple(str(dtype) for dtype in raw["output_dtypes"]) if shapes is not None else None,
        output_batched=tuple(raw["output_batched"]) if raw["output_batched"] is not None else None,
        modules=modules,
        param_bytes=tuple(round(b) for b in raw["param_bytes"]) if raw["param_bytes"] is not None else None,
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
        busy_s=json_number(raw.get("busy_s")),
        optimizer_s=json_number(raw.get("optimizer_s")),
        staleness_updates=raw.get("staleness_updates", 0),
        weight_versions=raw.get("weight_versions", 1),
    ) for k, raw in enumerate(raw_stages))


def _section(doc: dict[str, Any], key: str) -> dict[str, Any]:
    """The object under ``key``, or an empty one where the plan has none (an older or hand-made plan)."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _modules(entry: dict[str, Any], layers: tuple[str, ...], model: dict[str, Any],
             where: str) -> tuple[str | None, ...]:
    """Each layer's module name: the plan's ``modules`` (format 6), else the rule for older plans."""
    modules = entry.get("modules")
    if modules is not None:
        if not isinstance(modules, list) or len(modules) != len(layers) or \
                any(m is not None and (not isinstance(m, str) or not m) for m in modules):
            raise BadInput(f"{where}: 'chunks[{entry.get('index')}].modules' must give one module name (or null) "
                           f"per layer")
        return tuple(modules)
    if model.get("source") == "import":
        return layers                    # an imported model's layers are named by their module paths
    return (None,) * len(layers)
