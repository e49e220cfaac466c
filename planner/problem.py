"""What one search is asked, and the one-line refusals of what no plan can honour.

Two things, kept apart. :class:`SolveOptions` is the user's request, parsed (planner/request.py
makes it from the command line): it is read, never rewritten. A :class:`PipelineProblem` is the
work order of one pipeline's search (planner/search.py): K stages, that pipeline's own batch and
link, and what it pays as one of d replicas. The request's own pipeline is :func:`one_pipeline`;
with ``--devices``, planner/replicas.py makes one problem per K x d and placement, on the global
batch / d.

:func:`check_problem` refuses, in one line each, what no setting could plan (more stages than
layers, a micro-batch count that does not divide the batch, what the asynchronous schedules do
not define) before any search starts. :func:`resolve_global_batch` settles the global batch:
``--global-batch-size``, else the one the profile was measured for. :func:`device_memory_limit`
fills in the memory limit a plan must fit when none is given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..artifacts import BadInput
from ..schema import check_global_batch_size
from ..schedules import PLANNABLE_SCHEDULES
from ..weight_versions import ASYNC_SCHEDULES
from ..weight_versions import problem as async_problem
from .budgets import SOLVE_TIME_BUDGET_S
from .profile import Profile, host_share_bytes
from .settings import MAX_MICRO_BATCHES, ReplicaSync, micro_batch_counts, pipeline_link


@dataclass(frozen=True)
class SolveOptions:
    """The user's request, parsed (planner/request.py ``SolveRequest.solve_options``): what solve
    was asked, read by every step and recorded in the plan's ``options``, never rewritten;
    :func:`device_memory_limit` only fills in the memory limit the user left to the device."""

    stages: int | None = None     # pipeline stages K; None: any K with K * d = devices
    global_batch_size: int | None = None   # samples per step over all replicas
    micro_batches: int | str = "auto"
    schedule: str = "auto"
    virtual_stages: int | str = "auto"     # interleaved's chunks per stage; auto tries 2..4
    recompute: str = "auto"
    memory_limit_bytes: int | None = None
    # Where the limit came from: "option" (--memory-limit), "device" (a CUDA profile's card),
    # "host" (a CPU profile's host, shared by its ranks: see device_memory_limit), or None (no limit).
    memory_limit_source: str | None = None
    link_bandwidth_bytes_per_s: float | None = None   # None: the profile's link, else free
    link_latency_s: float | None = None
    optimizer: str = "adam"
    solver: str = "exact"      # exact (gpipe_solver.py, onefoneb.py, chunked.py) or ilp
    time_budget_s: float = SOLVE_TIME_BUDGET_S
    # Data parallel (planner/replicas.py): N devices as K stages x d replicas.
    devices: int | None = None              # N; None: K * d (one pipeline when d = 1)
    data_parallel: int | str = 1            # d, or "auto": every d dividing N
    nodes: int = 1                          # machines; devices_per_node = N / nodes
    network_bandwidth_bytes_per_s: float | None = None   # between nodes (required when nodes > 1)
    network_latency_s: float = 0.0
    gradient_sync: str = "ddp"              # "ddp" | "fsdp" | "localsgd"
    sync_every: int = 1                     # localsgd: H, the steps between two parameter averagings


@dataclass(frozen=True)
class PipelineProblem:
    """One pipeline's search: the work order planner/search.py takes (module docstring).

    ``batch`` is this pipeline's samples per step: the global batch, or one replica's share of
    it (global / d) when ``sync`` says the pipeline is one of d replicas, whose gradient sync
    each stage then pays. The link is resolved: the request's, the profile's, or a placement's
    (planner/replicas.py); an infinite bandwidth is a free link. The other fields are the
    request's, as given.
    """

    stages: int
    batch: int
    micro_batches: int | str          # a count, or "auto": every divisor of ``batch``
    schedule: str
    virtual_stages: int | str
    recompute: str
    memory_limit_bytes: int | None
    memory_limit_source: str | None   # SolveOptions.memory_limit_source
    link_bandwidth_bytes_per_s: float
    link_latency_s: float | None
    optimizer: str
    solver: str
    time_budget_s: float
    gradient_sync: str                # the request's (the asynchronous schedules refuse fsdp and localsgd)
    sync: ReplicaSync = ReplicaSync()

    @property
    def batch_name(self) -> str:
        """The batch as a refusal names it."""
        return "a replica's batch" if self.sync.data_parallel > 1 else "the global batch"


def one_pipeline(profile: Profile, options: SolveOptions) -> PipelineProblem:
    """The request's own pipeline: ``options.stages`` stages on the global batch, alone (no
    replicas), on the request's link or else the profile's. Refuses, in one line, a
    ``--stages`` no pipeline has, then a global batch below 1."""
    check_stages(options.stages, profile.num_layers)
    bandwidth, latency = pipeline_link(profile, options)
    return problem_of(options, stages=options.stages, batch=resolve_global_batch(profile, options),
                      link=(bandwidth, latency), sync=ReplicaSync())


def problem_of(options: SolveOptions, *, stages: int, batch: int, link: tuple[float, float | None],
               sync: ReplicaSync, time_budget_s: float | None = None) -> PipelineProblem:
    """The problem of a pipeline of ``stages`` on ``batch`` and ``link`` that pays ``sync``, with
    the request's other fields (its time budget unless another share is given)."""
    return PipelineProblem(
        stages=stages, batch=batch, micro_batches=options.micro_batches, schedule=options.schedule,
        virtual_stages=options.virtual_stages, recompute=options.recompute,
        memory_limit_bytes=options.memory_limit_bytes, memory_limit_source=options.memory_limit_source,
        link_bandwidth_bytes_per_s=link[0], link_latency_s=link[1], optimizer=options.optimizer,
        solver=options.solver, time_budget_s=options.time_budget_s if time_budget_s is None else time_budget_s,
        gradient_sync=options.gradient_sync, sync=sync)


def device_memory_limit(profile: Profile, options: SolveOptions, ranks_per_host: int | None = None) -> SolveOptions:
    """The options with the device's usable memory as the limit when none was given.

    A plan from a CUDA profile must fit the card it was measured on, with room for the CUDA
    context and the allocator (planner/profile.py, ``usable_memory_bytes``); a plan from a CPU
    profile that recorded its host's memory (version 9) must fit that host, which its ranks
    share: each gets its share (``host_share_bytes``) of the N / nodes ranks on one host
    (``ranks_per_host`` overrides that: 1 for the one-device baseline). ``--memory-limit``
    overrides both; older CPU profiles and imported ones give no default.
    """
    if options.memory_limit_bytes is not None:
        return replace(options, memory_limit_source="option")
    if profile.usable_memory_bytes is not None:
        return replace(options, memory_limit_bytes=profile.usable_memory_bytes, memory_limit_source="device")
    if profile.host_memory_bytes is not None:
        if ranks_per_host is None:
            devices = options.devices or (options.stages or 1) * (
                options.data_parallel if isinstance(options.data_parallel, int) else 1)
            ranks_per_host = max(1, devices // max(1, options.nodes))
        return replace(options, memory_limit_bytes=host_share_bytes(profile.host_memory_bytes, ranks_per_host),
                       memory_limit_source="host")
    return options


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def profile_global_batch(profile: Profile) -> tuple[int, str]:
    """The global batch a profile was measured for, and where that figure comes from.

    A version-6 profile records the batch its user means to train with (``global_batch_size``,
    ``profile --global-batch-size``); older ones only say which micro-batch sizes they
    measured, so the largest of those stands in for it, as it always did.
    """
    intended = profile.doc.get("global_batch_size")
    if _positive_int(intended):
        return int(intended), "profile"
    batch = profile.doc.get("batch_size")
    return (int(batch) if _positive_int(batch) else int(profile.sizes[-1])), "largest micro-batch"


def resolve_global_batch(profile: Profile, options: SolveOptions) -> int:
    """``--global-batch-size`` if given, else the profile's (:func:`profile_global_batch`)."""
    if options.global_batch_size is not None:
        check_global_batch_size(options.global_batch_size)
        return options.global_batch_size
    return profile_global_batch(profile)[0]


def global_batch_source(profile: Profile, options: SolveOptions) -> str:
    """Where the plan's global batch came from: "option", "profile" or "largest micro-batch"."""
    return "option" if options.global_batch_size is not None else profile_global_batch(profile)[1]


def check_stages(stages: object, layers: int) -> None:
    """Refuse a ``--stages`` no pipeline of ``layers`` layers has (each stage needs a layer)."""
    if stages < 1:
        raise too_few_stages(stages)
    if stages > layers:
        raise too_many_stages(stages, layers)


def check_problem(profile: Profile, problem: PipelineProblem) -> None:
    """Refuse, with one line each, what no setting of ``problem`` could plan."""
    L = profile.num_layers
    check_stages(problem.stages, L)
    if problem.schedule != "auto" and problem.schedule not in PLANNABLE_SCHEDULES:
        raise BadInput(f"--schedule {problem.schedule!r} is not one of {', '.join(PLANNABLE_SCHEDULES)} or auto")
    if problem.schedule in ASYNC_SCHEDULES:
        check_asynchronous(profile, problem)
    v = problem.virtual_stages
    if v != "auto":
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:
            raise BadInput(f"--virtual-stages must be an integer of at least 2 or 'auto', got {v!r}")
        if problem.schedule not in ("interleaved", "auto"):
            raise BadInput(f"--virtual-stages is interleaved's chunks per stage; {problem.schedule} does not take it "
                           "(zb-v always holds 2): drop it, or use --schedule interleaved")
        if problem.stages * v > L:
            raise BadInput(f"--virtual-stages {v} with --stages {problem.stages} cuts {problem.stages * v} chunks, "
                           f"more than the profile's {L} layers: use fewer virtual stages or stages")
    if problem.micro_batches != "auto":
        check_micro_batches(problem.micro_batches, problem.batch, problem.batch_name)


def check_asynchronous(profile: Profile, problem: PipelineProblem) -> None:
    """Refuse, in one line, what the asynchronous schedules' model does not cover: FSDP (a stage
    would gather its shards for every stashed version). More ranks than the host's cores is
    refused where the setting is made (settings.settings_for)."""
    schedule = problem.schedule
    if problem.gradient_sync == "fsdp":
        raise BadInput(f"{schedule} keeps whole weight versions on every replica: --gradient-sync fsdp does not "
                       "run it; use --gradient-sync ddp, or a synchronous --schedule")
    if problem.gradient_sync == "localsgd":
        # Two asynchronies at once (stale gradients inside a replica, drifting replicas) that no
        # reference defines (weight_versions.py, runtime/async_reference.py): refused, not guessed.
        raise BadInput(f"{schedule} with --gradient-sync localsgd is not defined (each update is stale inside the "
                       "pipeline and the replicas drift between averagings): use --gradient-sync ddp with "
                       f"{schedule}, or localsgd with a synchronous --schedule")
    if problem.recompute == "always":
        raise BadInput(f"{schedule} does not recompute (the rerun would meet the newest weights, not the stashed "
                       "ones): use --recompute never (or auto, which then never recomputes)")
    if profile.precision == "fp16":
        raise BadInput(f"{schedule} is not defined with fp16 loss scaling (an overflow must skip one step on every "
                       "stage at once): profile with --precision bf16 (or fp32)")
    if profile.tied and isinstance(problem.stages, int) and problem.stages > 1:
        split = {c for layers, _ in profile.tied for c in range(min(layers) + 1, max(layers) + 1)}
        if profile.num_layers - 1 - len(split) < problem.stages - 1:
            names = ", ".join(" and ".join(profile.names[i] for i in (min(layers), max(layers)))
                              for layers, _ in profile.tied)
            raise BadInput(f"{schedule} cannot cut the model into {problem.stages} stages without splitting weights "
                           f"tied between {names}, which it does not define (each stage updates its own weights "
                           "on its own clock): untie them, use fewer --stages, or a synchronous --schedule")
    if problem.micro_batches != "auto":
        reason = async_problem(schedule, problem.stages, int(problem.micro_batches))
        if reason:
            raise BadInput(reason)


def too_few_stages(stages: object) -> BadInput:
    """The refusal of a ``--stages`` that is not at least 1 (here and in planner/replicas.py)."""
    return BadInput(f"--stages must be at least 1, got {stages}")


def too_many_stages(stages: int, layers: int) -> BadInput:
    """The refusal of more stages than the profile has layers (each stage needs one)."""
    return BadInput(f"--stages {stages} is more than the profile's {layers} layers: "
                    f"use at most {layers} stages (each stage needs a layer), or profile a finer model")


def check_micro_batches(m: object, batch: int, whose: str = "the global batch") -> None:
    """Refuse a fixed micro-batch count that is not a positive integer, is more than the
    planner considers, or does not divide ``batch`` (every micro-batch has the same size);
    ``whose``: what the batch is, as the message names it (:attr:`PipelineProblem.batch_name`)."""
    if not isinstance(m, int) or m < 1:
        raise BadInput(f"--micro-batches must be a positive integer or 'auto', got {m!r}")
    if m > MAX_MICRO_BATCHES:
        raise BadInput(f"--micro-batches {m} is more than the planner considers ({MAX_MICRO_BATCHES}): "
                       "use fewer, larger micro-batches")
    if batch % m:
        usable = micro_batch_counts(batch)
        choices = ", ".join(map(str, usable[:12]))
        raise BadInput(
            f"--micro-batches {m} does not divide {whose} of {batch}: "
            f"use one of {choices}{', ...' if len(usable) > 12 else ''} or 'auto'")
