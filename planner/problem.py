"""What one search is asked, and the one-line refusals of what no plan can honour.

:class:`SolveOptions` are the search's fields, parsed (planner/request.py makes them from the
command line); :func:`check_options` refuses, in one line each, what no setting could plan
(more stages than layers, a micro-batch count that does not divide the batch, what the
asynchronous schedules do not define) before any search starts, and settles the global batch:
``--global-batch-size``, else the one the profile was measured for. :func:`device_memory_limit`
fills in the memory limit a plan must fit when none is given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..artifacts import BadInput
from ..schedules import PLANNABLE_SCHEDULES
from ..weight_versions import ASYNC_SCHEDULES
from ..weight_versions import problem as async_problem
from .budgets import SOLVE_TIME_BUDGET_S
from .profile import Profile, host_share_bytes
from .settings import MAX_MICRO_BATCHES, micro_batch_counts


@dataclass(frozen=True)
class SolveOptions:
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
        if options.global_batch_size < 1:
            raise BadInput(f"--global-batch-size must be at least 1, got {options.global_batch_size}")
        return options.global_batch_size
    return profile_global_batch(profile)[0]


def global_batch_source(profile: Profile, options: SolveOptions) -> str:
    """Where the plan's global batch came from: "option", "profile" or "largest micro-batch"."""
    return "option" if options.global_batch_size is not None else profile_global_batch(profile)[1]


def whose_batch(options: SolveOptions) -> str:
    """What the search's batch is: the global batch, or one replica's (planner/replicas.py
    searches each of d replicas with its share of it)."""
    d = options.data_parallel
    return "a replica's batch" if isinstance(d, int) and d > 1 else "the global batch"


def check_options(profile: Profile, options: SolveOptions) -> int:
    """Refuse impossible requests with one line each; returns the global batch size."""
    L = profile.num_layers
    if options.stages < 1:
        raise too_few_stages(options.stages)
    if options.stages > L:
        raise too_many_stages(options.stages, L)
    batch = resolve_global_batch(profile, options)
    if options.schedule != "auto" and options.schedule not in PLANNABLE_SCHEDULES:
        raise BadInput(f"--schedule {options.schedule!r} is not one of {', '.join(PLANNABLE_SCHEDULES)} or auto")
    if options.schedule in ASYNC_SCHEDULES:
        check_asynchronous(profile, options)
    v = options.virtual_stages
    if v != "auto":
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:
            raise BadInput(f"--virtual-stages must be an integer of at least 2 or 'auto', got {v!r}")
        if options.schedule not in ("interleaved", "auto"):
            raise BadInput(f"--virtual-stages is interleaved's chunks per stage; {options.schedule} does not take it "
                           "(zb-v always holds 2): drop it, or use --schedule interleaved")
        if options.stages * v > L:
            raise BadInput(f"--virtual-stages {v} with --stages {options.stages} cuts {options.stages * v} chunks, "
                           f"more than the profile's {L} layers: use fewer virtual stages or stages")
    if options.micro_batches != "auto":
        check_micro_batches(options.micro_batches, batch, whose_batch(options))
    return batch


def check_asynchronous(profile: Profile, options: SolveOptions) -> None:
    """Refuse, in one line, what the asynchronous schedules' model does not cover: FSDP (a stage
    would gather its shards for every stashed version). More ranks than the host's cores is
    refused where the setting is made (:func:`settings_for`)."""
    schedule = options.schedule
    if options.gradient_sync == "fsdp":
        raise BadInput(f"{schedule} keeps whole weight versions on every replica: --gradient-sync fsdp does not "
                       "run it; use --gradient-sync ddp, or a synchronous --schedule")
    if options.gradient_sync == "localsgd":
        # Two asynchronies at once (stale gradients inside a replica, drifting replicas) that no
        # reference defines (weight_versions.py, runtime/async_reference.py): refused, not guessed.
        raise BadInput(f"{schedule} with --gradient-sync localsgd is not defined (each update is stale inside the "
                       "pipeline and the replicas drift between averagings): use --gradient-sync ddp with "
                       f"{schedule}, or localsgd with a synchronous --schedule")
    if options.recompute == "always":
        raise BadInput(f"{schedule} does not recompute (the rerun would meet the newest weights, not the stashed "
                       "ones): use --recompute never (or auto, which then never recomputes)")
    if profile.precision == "fp16":
        raise BadInput(f"{schedule} is not defined with fp16 loss scaling (an overflow must skip one step on every "
                       "stage at once): profile with --precision bf16 (or fp32)")
    if profile.tied and isinstance(options.stages, int) and options.stages > 1:
        split = {c for layers, _ in profile.tied for c in range(min(layers) + 1, max(layers) + 1)}
        if profile.num_layers - 1 - len(split) < options.stages - 1:
            names = ", ".join(" and ".join(profile.names[i] for i in (min(layers), max(layers)))
                              for layers, _ in profile.tied)
            raise BadInput(f"{schedule} cannot cut the model into {options.stages} stages without splitting weights "
                           f"tied between {names}, which it does not define (each stage updates its own weights "
                           "on its own clock): untie them, use fewer --stages, or a synchronous --schedule")
    if options.micro_batches != "auto":
        reason = async_problem(schedule, options.stages, int(options.micro_batches))
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
    ``whose``: what the batch is, as the message names it (:func:`whose_batch`)."""
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
