"""The search around the solvers: micro-batch count, schedule and recomputation.

A plan is a cut of the layers into chunks (the solvers' job) under a *setting*: how many
micro-batches M, which schedule (with interleaved's chunks per stage v), what recomputation
is allowed. The best plan overall is the best of the best
plans of each setting, so this module enumerates the settings the user left open, solves
each exactly, and keeps all of them: the winner goes into the plan, the others are the
runners-up a user compares it with.

M must divide the global batch (every micro-batch has the same size); with ``auto`` every
divisor is a candidate. More micro-batches shrink the bubble (K-1)/(M+K-1) but each pays
the fixed per-micro-batch costs again, so the best M is a measured trade-off, not a rule.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from ..artifacts import BadInput
from ..schedules import PLANNABLE_SCHEDULES, SCHEDULES, chunks_per_stage, label, problem
from ..weight_versions import ASYNC_SCHEDULES
from ..weight_versions import problem as async_problem
from .budgets import LEAST_ILP_SETTING_S, LEAST_MEMORY_BUDGET_S, LEAST_SETTING_S, SOLVE_TIME_BUDGET_S
from .costmodel import CostModel, Setting, neighbour_scale
from .timeshare import concurrent_ranks_of
from .fixedcosts import FixedCosts
from .gpipe_solver import GPipeSolver
from .objective import Solution, proven_optimal
from .profile import LayerFigures, Profile, host_share_bytes
from .seeds import seed_cuts
from .solvers import solve_cost_model, tighten
from ..units import format_bytes


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


@dataclass(frozen=True)
class ReplicaSync:
    """What one pipeline pays for being one of d replicas: each stage's gradient sync over the
    ring its placement gives it (planner/replicas.py). d = 1: nothing."""

    data_parallel: int = 1
    gradient_sync: str = "ddp"
    bandwidth_bytes_per_s: float = math.inf
    latency_s: float = 0.0
    devices_per_node: int | None = None     # processes sharing a host (None: all K * d)
    sync_every: int = 1                     # localsgd: H (its averaging is charged 1/H of it per step)

    def neighbours(self, stages: int) -> int:
        """The processes computing on one host (costmodel.neighbour_scale's ``stages``)."""
        devices = stages * self.data_parallel
        return min(devices, self.devices_per_node) if self.devices_per_node else devices


@dataclass
class Candidate:
    setting: Setting
    micro_batch_size: int
    solution: Solution | None              # None: nothing fits in memory with this setting

    @property
    def step_s(self) -> float:
        return self.solution.evaluation.step_s if self.solution else math.inf

    @property
    def lower_bound_s(self) -> float:
        """No plan with this setting is faster (inf when none fits)."""
        return self.solution.lower_bound_s if self.solution else math.inf

    def sort_key(self) -> tuple:
        ev = self.solution.evaluation if self.solution else None
        return (self.step_s, ev.peak_memory_bytes if ev else math.inf,
                self.setting.micro_batches, PLANNABLE_SCHEDULES.index(self.setting.schedule),
                self.setting.virtual_stages)


@dataclass
class SearchResult:
    options: SolveOptions
    global_batch_size: int
    candidates: list[Candidate] = field(default_factory=list)   # best first

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def lower_bound_s(self) -> float:
        """No plan in the whole searched space (every setting) is faster than this."""
        return min(c.lower_bound_s for c in self.candidates)

    @property
    def proven(self) -> bool:
        """The best plan is optimal over every setting searched, not just its own."""
        return proven_optimal(self.best.step_s, self.lower_bound_s)

    @property
    def bound_by(self) -> str | None:
        """The method behind :attr:`lower_bound_s`: that of the setting with the least bound
        (the first, best first, among equals; None when no setting has a plan)."""
        solved = [c for c in self.candidates if c.solution is not None]
        return min(solved, key=lambda c: c.lower_bound_s).solution.bound_by if solved else None

    @property
    def work_s(self) -> float:
        """The deterministic work its settings used (planner/solvers.py)."""
        return sum(c.solution.stats.get("work_s", 0.0) for c in self.candidates if c.solution is not None)


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


# The most micro-batches per step the planner considers. 1F1B's step time is an event
# simulation over every micro-batch of every stage, so its time and memory grow with M (a
# prime global batch has only itself and 1 as micro-batch counts); past a few thousand
# micro-batches the bubble is gone anyway and each one only adds its fixed costs. With
# ``auto`` the divisors above it are left out (1 always remains); a larger ``--micro-batches``
# is refused up front.
MAX_MICRO_BATCHES = 4096


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, by trial division up to sqrt(n).

    O(sqrt n) time and O(number of divisors) memory: a global batch of 10^9 takes milliseconds
    (the old scan over 1..n took minutes).
    """
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def schedule_name(setting: Setting) -> str:
    """The schedule as a person reads it: ``interleaved v=2``, else its name."""
    return label(setting.schedule, setting.virtual_stages)


def micro_batch_counts(batch: int) -> list[int]:
    """The micro-batch counts ``auto`` searches: divisors of the batch, at most MAX_MICRO_BATCHES."""
    return [m for m in divisors(batch) if m <= MAX_MICRO_BATCHES]


def open_micro_batches(options: SolveOptions, batch: int) -> list[int]:
    """The micro-batch counts the options leave open: ``auto``'s (:func:`micro_batch_counts`), or the one given."""
    return micro_batch_counts(batch) if options.micro_batches == "auto" else [int(options.micro_batches)]


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


# interleaved's chunks per stage that ``--virtual-stages auto`` tries (while K v <= layers).
AUTO_VIRTUAL_STAGES = (2, 3, 4)


def schedule_shapes(options: SolveOptions, layers: int) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs the options leave open, before any M is chosen.

    ``auto`` is every schedule; on one stage only gpipe and 1f1b (the others are 1F1B there,
    with more actions). Interleaved takes ``--virtual-stages`` v, or with ``auto`` 2, 3 and 4
    while the K v chunks have a layer each; a schedule that needs more chunks than layers is
    left out (zb-v: 2 K).
    """
    K = options.stages
    schedules = list(options.schedule == "auto" and (SCHEDULES if K > 1 else ("gpipe", "1f1b"))
                     or [options.schedule])
    return [(schedule, v) for schedule in schedules
            for v in virtual_stage_choices(schedule, options.virtual_stages, K, layers)]


def virtual_stage_choices(schedule: str, virtual_stages: int | str, stages: int, layers: int) -> list[int]:
    """The virtual stages v ``schedule`` can take on ``stages`` stages: interleaved's given v, or
    with ``auto`` each of AUTO_VIRTUAL_STAGES; the other schedules 1 (zb-v's two chunks per
    stage are its own). Only those whose chunks have a layer each (K chunks_per_stage <= L)."""
    if schedule == "interleaved":
        vs = AUTO_VIRTUAL_STAGES if virtual_stages == "auto" else (int(virtual_stages),)
    else:
        vs = (1,)
    return [v for v in vs if stages * chunks_per_stage(schedule, v) <= layers]


def cost_setting(profile: Profile, *, stages: int, micro_batches: int, schedule: str, virtual_stages: int,
                 recompute: str, memory_limit_bytes: float | None, link_bandwidth_bytes_per_s: float,
                 link_latency_s: float, optimizer: str, sync: ReplicaSync = ReplicaSync()) -> Setting:
    """The cost model's :class:`Setting` for one (K, M, schedule, v) of a profile: the one place
    that says what a plan is charged besides its layers (solve and explore both call it).

    The link's latency counts only when its bandwidth does (an infinite link is free); the
    runtime's fixed costs per action and message as the profile measured them, and the cost
    between actions as planner/fixedcosts.py says (a calibrated figure replaces the profile's;
    from a profile without fixed costs, with several stages only); every layer time is scaled
    for the processes computing beside it on the host, the stages of all the replicas there
    (``sync.neighbours``), of which no more than the host's cores run at once; where the host
    has fewer cores than ranks, the ranks share them (planner/timeshare.py, ``concurrent_ranks``);
    and each stage's gradient sync as ``sync`` says.
    """
    on_host = sync.neighbours(stages)
    # The processes that compute at once on the host: its ranks, at most as many as its cores run.
    computing = on_host if profile.host_cores is None else min(
        on_host, max(1, profile.host_cores // profile.threads_per_rank))
    return Setting(
        stages=stages, micro_batches=micro_batches, schedule=schedule, recompute=recompute,
        memory_limit_bytes=memory_limit_bytes,
        link_bandwidth_bytes_per_s=link_bandwidth_bytes_per_s,
        link_latency_s=link_latency_s if math.isfinite(link_bandwidth_bytes_per_s) else 0.0,
        optimizer=optimizer,
        overhead_s=profile.per_action_overhead_s(stages),
        fixed_costs=profile.fixed_costs or FixedCosts(),
        compute_scale=neighbour_scale(profile.contention_slowdown, profile.contention_processes, computing),
        virtual_stages=virtual_stages,
        data_parallel=sync.data_parallel,
        sync_bandwidth_bytes_per_s=sync.bandwidth_bytes_per_s,
        sync_latency_s=sync.latency_s,
        gradient_sync=sync.gradient_sync,
        sync_every=sync.sync_every,
        concurrent_ranks=concurrent_ranks_of(profile.host_cores, profile.threads_per_rank, on_host, stages),
    )


def pipeline_link(profile: Profile, options: SolveOptions) -> tuple[float, float]:
    """The link between stages, (bandwidth, latency): the options' figures where given, else
    the profile's measured link, else a free one (infinite bandwidth, whose latency then does
    not count: :func:`cost_setting`)."""
    bandwidth = options.link_bandwidth_bytes_per_s
    if bandwidth is None:
        bandwidth = profile.link_bandwidth_bytes_per_s or math.inf
    latency = options.link_latency_s if options.link_latency_s is not None else profile.link_latency_s
    return bandwidth, latency


def settings_for(profile: Profile, options: SolveOptions, batch: int,
                 sync: ReplicaSync = ReplicaSync()) -> list[tuple[Setting, int]]:
    """Every setting the options leave open, with its micro-batch size (settings that
    schedules.problem rejects, such as interleaved with M not a multiple of its rounds, are
    left out: :func:`no_settings_reason` says why when none is left)."""
    bandwidth, latency = pipeline_link(profile, options)
    ms = open_micro_batches(options, batch)
    out = []
    for m in ms:
        for schedule, v in schedule_shapes(options, profile.num_layers):
            if problem(schedule, options.stages, m, v) or sharded_tie_problem(profile, schedule, v, sync):
                continue
            setting = cost_setting(profile, stages=options.stages, micro_batches=m, schedule=schedule,
                                   virtual_stages=v, recompute=options.recompute,
                                   memory_limit_bytes=options.memory_limit_bytes,
                                   link_bandwidth_bytes_per_s=bandwidth, link_latency_s=latency,
                                   optimizer=options.optimizer, sync=sync)
            if setting.time_shared and schedule in ASYNC_SCHEDULES:
                raise BadInput(f"{schedule} on ranks that share the host's cores (it runs "
                               f"{setting.concurrent_ranks:g} of the {options.stages} stages at once) is not "
                               "modelled: use fewer stages or a synchronous --schedule")
            out.append((setting, batch // m))
    return out


def sharded_tie_problem(profile: Profile, schedule: str, virtual_stages: int, sync: ReplicaSync) -> str:
    """Why FSDP cannot run ``schedule`` for this model ("" if it can): a weight tied across
    layers may land in two chunks of one stage (zb-v puts the first and the last chunk on stage
    0), and FSDP2 cannot shard one parameter in two modules (runtime/fsdp.py). With ties, fsdp
    runs the schedules of one chunk per stage."""
    if sync.gradient_sync != "fsdp" or sync.data_parallel <= 1 or not profile.tied:
        return ""
    if chunks_per_stage(schedule, virtual_stages) == 1:
        return ""
    return (f"--gradient-sync fsdp cannot run {schedule}: the model ties weights across layers, which it may "
            f"place in two chunks of one stage; use a schedule of one chunk per stage, or --gradient-sync ddp")


def no_settings_reason(profile: Profile, options: SolveOptions, batch: int,
                       sync: ReplicaSync = ReplicaSync()) -> str:
    """One line: why the options leave no setting to solve, and what to do."""
    shapes = schedule_shapes(options, profile.num_layers)
    if not shapes:
        return (f"--schedule {options.schedule} with --stages {options.stages} needs more chunks than the "
                f"profile's {profile.num_layers} layers: use fewer stages, or another schedule")
    ms = open_micro_batches(options, batch)
    schedule, v = shapes[0]
    reason = (problem(schedule, options.stages, ms[0], v) or sharded_tie_problem(profile, schedule, v, sync)
              or "no setting is left")
    return f"{reason}: use --micro-batches auto, another count, or another --schedule"


def solve_setting(profile: Profile, setting: Setting, micro_batch_size: int, solver: str,
                  time_budget_s: float, seeds: list[tuple[int, ...]] = (), cutoff_s: float = math.inf,
                  figures: LayerFigures | None = None, work_budget_s: float | None = None) -> Candidate:
    """The best plan of one setting (planner/solvers.py). ``figures``: ``profile.at(micro_batch_size)``
    if already made. ``work_budget_s``: the budget in deterministic work, which, unlike the
    clock, gives the same plan on every run."""
    cm = CostModel(figures if figures is not None else profile.at(micro_batch_size), setting)
    solution = solve_cost_model(cm, solver, time_budget_s, seeds, cutoff_s, work_budget_s)
    return Candidate(setting, micro_batch_size, solution)


def share_of_budget(budget_s: float, started: float, settings_left: int, least_s: float = LEAST_SETTING_S) -> float:
    """The seconds the next setting may search: what is left of the budget, shared evenly.

    Once the budget is spent each remaining setting gets only a moment, ``least_s`` (its
    solver then returns the best plan it has, with its gap), so a solve overruns its budget by
    little more than the fixed work around the searches (reading the profile, the first cheap
    pass).
    """
    left = budget_s - (time.perf_counter() - started)
    return max(least_s, left / max(1, settings_left))


@dataclass
class SettingBudgets:
    """How one search shares its time budget among its settings: the one place each share is made.

    ``time_s``: the wall time the next setting may search (:func:`share_of_budget`).
    ``work_s``: its budget in deterministic work (planner/solvers.py): an even share of what the
    settings before it left (each reports the work it used, :meth:`spend`). Unlike what the clock
    leaves, that is the same on every run, so the same request gets the same plan.
    """

    budget_s: float
    settings: int
    started: float
    least_s: float = LEAST_SETTING_S
    work_budget_s: float | None = None   # the work to share (default budget_s)
    spent_s: float = 0.0                 # work the settings solved so far used

    def time_s(self, settings_left: int) -> float:
        return share_of_budget(self.budget_s, self.started, settings_left, self.least_s)

    def work_s(self, settings_left: int) -> float:
        total = self.budget_s if self.work_budget_s is None else self.work_budget_s
        return max(self.least_s, (total - self.spent_s) / max(1, settings_left))

    def spend(self, candidate: "Candidate") -> None:
        if candidate.solution is not None:
            self.spent_s += candidate.solution.stats.get("work_s", 0.0)


def search(profile: Profile, options: SolveOptions, progress=None, explain: bool = True,
           sync: ReplicaSync = ReplicaSync(), work_budget_s: float | None = None,
           cutoff_s: float = math.inf) -> SearchResult:
    """Solve every open setting; the result's candidates are sorted best first.

    GPipe settings are solved first (their solver is fast and exact); each one's optimal
    partition seeds the 1F1B and ZB-H1 searches of the same M (and the best cut into 2K
    chunks found seeds the next setting of as many chunks), and the best step found so far is
    the cutoff below which a later search must go to matter: settings that cannot beat it are
    settled by their lower bound alone. ``progress``, if given, is called with
    (done, total, description) as settings finish.

    One pipeline: ``options.global_batch_size`` is its batch. As one of d replicas
    (planner/replicas.py calls it so), the options carry the replica's share of the batch and
    ``sync`` the gradient sync every stage then pays. ``work_budget_s``: the work its settings
    share (default ``options.time_budget_s``; replicas.py gives each placement a share of its
    own, deterministic where the clock left by the placements before would not be).
    ``cutoff_s``: a step already achieved elsewhere (another placement): a setting that cannot
    beat it stops once that is proven.
    """
    batch = check_options(profile, options)
    settings = settings_for(profile, options, batch, sync)
    if not settings:
        raise BadInput(no_settings_reason(profile, options, batch, sync))
    result = SearchResult(options, batch)
    budgets = SettingBudgets(options.time_budget_s, len(settings), time.perf_counter(),
                             LEAST_ILP_SETTING_S if options.solver == "ilp" else LEAST_SETTING_S, work_budget_s)
    done = 0
    # Each micro-batch size's figures, made once for all its settings (O(L) each: with many
    # layers, making them per setting took longer than the searches).
    figures: dict[int, LayerFigures] = {}

    def at(size: int) -> LayerFigures:
        if size not in figures:
            figures[size] = profile.at(size)
        return figures[size]

    def run(setting: Setting, size: int, seeds: list, cutoff: float) -> Candidate:
        nonlocal done
        left = len(settings) - done
        candidate = solve_setting(profile, setting, size, options.solver, budgets.time_s(left),
                                  seeds, cutoff, at(size), work_budget_s=budgets.work_s(left))
        budgets.spend(candidate)
        done += 1
        if progress:
            progress(done, len(settings), f"M={setting.micro_batches} {schedule_name(setting)}")
        return candidate

    gpipe = [(s, size) for s, size in settings if s.schedule == "gpipe"]
    others = [(s, size) for s, size in settings if s.schedule != "gpipe"]
    best_so_far = cutoff_s
    gpipe_best: dict[int, Candidate] = {}
    if options.solver != "ilp":
        # A first, cheap pass (the staircase: a good plan and a lower bound per setting) orders
        # the exact searches best first, so that each can stop at what is already achieved.
        solvers = {}
        for s, size in gpipe:
            cm = CostModel(at(size), s)
            solvers[s] = GPipeSolver(cm, seeds=seed_cuts(cm))
        quick: dict[Setting, Candidate] = {}
        for i, (s, size) in enumerate(gpipe):
            solvers[s].time_budget_s = budgets.time_s(len(settings) - i)
            quick[s] = Candidate(s, size, solvers[s].solve(cutoff_s=0.0))
        best_so_far = min([cutoff_s, *(c.step_s for c in quick.values())])
        for setting, size in sorted(gpipe, key=lambda item: quick[item[0]].step_s):
            candidate = quick[setting]
            if candidate.solution is not None and not proven_optimal(best_so_far, candidate.lower_bound_s):
                solvers[setting].time_budget_s = budgets.time_s(len(settings) - done)
                candidate = Candidate(setting, size, solvers[setting].solve(cutoff_s=best_so_far))
            done += 1
            if progress:
                progress(done, len(settings), f"M={setting.micro_batches} gpipe")
            gpipe_best[setting.micro_batches] = candidate
            best_so_far = min(best_so_far, candidate.step_s)
            result.candidates.append(candidate)
    else:
        for setting, size in gpipe:
            candidate = run(setting, size, [], best_so_far)
            gpipe_best[setting.micro_batches] = candidate
            best_so_far = min(best_so_far, candidate.step_s)
            result.candidates.append(candidate)
    # 1F1B, then the others: seeded with the best partition of the same M and chunk count found
    # so far (GPipe's for 1F1B and ZB-H1), most promising first.
    found: dict[tuple[int, int], Candidate] = {(m, 1): c for m, c in gpipe_best.items()}
    order = {"1f1b": 0, "zb-h1": 1, "interleaved": 2, "zb-v": 2, "pipedream": 3, "pipedream-2bw": 3}
    for setting, size in sorted(others, key=lambda item: (order[item[0].schedule],
                                                         gpipe_best[item[0].micro_batches].step_s
                                                         if item[0].micro_batches in gpipe_best else 0.0)):
        chunks = setting.virtual_stages * (2 if setting.schedule == "zb-v" else 1)
        seed = found.get((setting.micro_batches, chunks))
        seeds = [seed.solution.evaluation.bounds] if seed and seed.solution else []
        candidate = run(setting, size, seeds, best_so_far)
        best_so_far = min(best_so_far, candidate.step_s)
        result.candidates.append(candidate)
        if candidate.solution and (seed is None or candidate.step_s < seed.step_s):
            found[(setting.micro_batches, chunks)] = candidate
    if options.solver != "ilp":
        # What the settings left of the budget goes where the proof is still open.
        total = options.time_budget_s if work_budget_s is None else work_budget_s
        tighten(result.candidates, lambda c: CostModel(at(c.micro_batch_size), c.setting), cutoff_s,
                total - budgets.spent_s, options.time_budget_s - (time.perf_counter() - budgets.started))
    result.candidates.sort(key=Candidate.sort_key)
    if result.best.solution is None:
        # The explanation solves the memory problem again for each option that might help: worth
        # it for the user's request, not for the one-device comparison, which only needs to know.
        raise BadInput(explain_infeasible(profile, options, batch, sync) if explain else "no plan fits in memory")
    return result


def first_pass_step(profile: Profile, options: SolveOptions, sync: ReplicaSync = ReplicaSync()) -> float:
    """The best step GPipe's first, cheap pass (its staircase) finds over the micro-batch counts
    the options leave open: how replicas.py ranks the placements it searches, best first (inf:
    nothing fits, or the options cannot run)."""
    try:
        batch = check_options(profile, options)
    except BadInput:
        return math.inf
    best = math.inf
    for setting, size in settings_for(profile, replace(options, schedule="gpipe", virtual_stages="auto"), batch, sync):
        solution = GPipeSolver(CostModel(profile.at(size), setting), time_budget_s=LEAST_SETTING_S).solve(cutoff_s=0.0)
        if solution is not None:
            best = min(best, solution.evaluation.step_s)
    return best


# --------------------------------------------------------------------------- one device
@dataclass
class OneStage:
    """The best plan on one device for the same global batch: what a pipeline must beat.

    A pipeline pays for its stages with a bubble, sends and, on one host, neighbours that slow
    each other down; for a small or unbalanced model one device can be as fast. ``result`` is
    the best one-stage plan (None when no setting fits one device's memory), and then
    ``least_memory_bytes`` is the smallest memory one device would need.
    """

    result: SearchResult | None
    least_memory_bytes: float | None = None

    @property
    def step_s(self) -> float | None:
        return self.result.best.step_s if self.result is not None else None

    @property
    def peak_memory_bytes(self) -> float | None:
        if self.result is None:
            return self.least_memory_bytes
        return self.result.best.solution.evaluation.peak_memory_bytes


def one_stage_baseline(profile: Profile, options: SolveOptions) -> OneStage:
    """Solve the same request on one stage of one device (no replicas), with the same solver and options.

    Only the micro-batch count is left open ("auto"): a fixed M is a choice made for the
    pipeline (it is what fills it), while one device should be judged at its own best M;
    the global batch stays the same, so the two plans train alike.
    """
    single = replace(options, stages=1, devices=None, data_parallel=1, micro_batches="auto", virtual_stages="auto",
                     schedule=options.schedule if options.schedule in ("gpipe", "1f1b") else "auto")
    try:
        return OneStage(search(profile, single, explain=False))
    except BadInput:
        # Nothing fits one device: say how much memory it would take (search raised only that,
        # since the other checks passed for the pipeline's own options).
        batch = check_options(profile, single)
        need = min(least_memory(profile, s, size) for s, size in settings_for(profile, single, batch))
        return OneStage(None, need)


# --------------------------------------------------------------------------- memory
@dataclass
class MemorySearch:
    """The time the chunked least-memory searches share, and whether each of them finished."""

    deadline: float
    exact: bool = True


def least_memory(profile: Profile, setting: Setting, micro_batch_size: int,
                 budget: MemorySearch | None = None) -> float:
    """The smallest per-device memory limit under which ``setting`` has a plan at all.

    A min-max partition of stage memory: bisection on the limit, each probe a reachability
    sweep over cut positions (with recomputation chosen wherever it saves memory). Several
    chunks per stage: :func:`_least_chunked_memory`, within ``budget``.
    """
    cm = CostModel(profile.at(micro_batch_size), Setting(**{**setting.__dict__, "memory_limit_bytes": None}))
    L, K = cm.L, cm.K
    options = cm.allowed_recompute
    if cm.chunks_per_stage > 1:
        return _least_chunked_memory(cm, budget or MemorySearch(time.perf_counter() + LEAST_MEMORY_BUDGET_S))

    def stage_memory(s: int, e: int, k: int) -> float:
        return min(cm.memory(s, e, k, r) for r in options)

    if K == 1:
        return stage_memory(0, L, 0)           # one stage holds every layer: nothing to search

    def feasible(limit: float) -> bool:
        current = {0}
        for k in range(K):
            nxt = set()
            for s in current:
                if k == K - 1:
                    if stage_memory(s, L, k) <= limit:
                        nxt.add(L)
                    continue
                for e in range(s + 1, L - (K - 1 - k) + 1):
                    if stage_memory(s, e, k) > limit:
                        break            # for a fixed start, memory grows with the stage
                    nxt.add(e)
            current = nxt
            if not current:
                return False
        return L in current

    lo, hi = 0.0, max(stage_memory(k * L // K, (k + 1) * L // K, k) for k in range(K))
    while hi - lo > max(1.0, hi * 1e-9):
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _least_chunked_memory(cm: CostModel, budget: MemorySearch) -> float:
    """:func:`least_memory` for several chunks per stage: a stage's memory depends on all its
    chunks, spread through the model, so the cut is searched directly: depth first over the
    chunk ends, dropping a prefix once a stage's memory from the chunks cut so far (the rest
    add to it) reaches the least maximum found. Exact when it finishes before
    ``budget.deadline``; else the least found, and ``budget.exact`` becomes False."""
    L, C, K = cm.L, cm.C, cm.K
    deadline = budget.deadline

    def partial(k: int, cuts: list[int]) -> float:
        spans = [(cuts[c], cuts[c + 1]) if c + 1 < len(cuts) else None for c in cm.peaks[k].chunks]
        return min(cm.stage_memory(k, spans, r) for r in cm.allowed_recompute)

    even = [j * L // C for j in range(C + 1)]
    best = max(partial(k, even) for k in range(K))

    def dfs(cuts: list[int]) -> None:
        nonlocal best
        j = len(cuts) - 1
        if time.perf_counter() > deadline:
            budget.exact = False
            return
        for e in ([L] if j == C - 1 else range(cuts[-1] + 1, L - (C - 1 - j) + 1)):
            child = cuts + [e]
            worst = max(partial(k, child) for k in range(K))
            if worst >= best:
                continue
            if j == C - 1:
                best = worst
            else:
                dfs(child)

    dfs([0])
    return best


def explain_infeasible(profile: Profile, options: SolveOptions, batch: int, sync: ReplicaSync = ReplicaSync()) -> str:
    """One line: the limit is too small; the least that works; which option would help.

    The chunked schedules (interleaved, zb-v) share LEAST_MEMORY_BUDGET_S for their searches;
    if one of them stops there, the line gives the least limit found to work instead.
    """
    limit = options.memory_limit_bytes or 0
    budget = MemorySearch(time.perf_counter() + LEAST_MEMORY_BUDGET_S)

    def least(opts: SolveOptions, replica_sync: ReplicaSync = sync) -> float:
        return min((least_memory(profile, s, size, budget)
                    for s, size in settings_for(profile, opts, batch, replica_sync)), default=math.inf)

    need = least(options)
    if options.memory_limit_source == "device":
        what = (f"the usable memory of the profiled {profile.device.get('name') or 'GPU'}, {format_bytes(limit)} "
                f"(its memory less the CUDA context and headroom; --memory-limit overrides it),")
    elif options.memory_limit_source == "host":
        what = (f"this host's share per rank, {format_bytes(limit)} (the profiled host's "
                f"{format_bytes(profile.host_memory_bytes)} less headroom, shared by the ranks on it; --memory-limit "
                f"overrides it),")
    else:
        what = f"--memory-limit {format_bytes(limit)} per device"
    line = (f"no plan fits {what} with these options: the smallest limit "
            f"{'that works' if budget.exact else 'found to work'} is {format_bytes(need, round_up=True)}")
    relaxations = []
    if options.recompute != "auto":
        relaxations.append(("--recompute auto", {"recompute": "auto"}))
    if options.schedule not in ("1f1b", "auto"):
        relaxations.append(("--schedule 1f1b", {"schedule": "1f1b", "virtual_stages": "auto"}))
    if options.micro_batches != "auto":
        relaxations.append(("--micro-batches auto", {"micro_batches": "auto"}))
    d = sync.data_parallel
    if options.stages < profile.num_layers:
        more = min(profile.num_layers, options.stages * 2)
        # As one of d replicas, more stages per replica means more devices: K x d = N.
        flag = f"--stages {more}" if d == 1 else f"--devices {more * d} --stages {more}"
        relaxations.append((flag, {"stages": more}))
    helps = []
    for flag, change in relaxations:
        relaxed = SolveOptions(**{**options.__dict__, **change})
        relaxed_need = least(relaxed)
        if relaxed_need < need:
            helps.append((relaxed_need, flag))
    if d > 1 and sync.gradient_sync != "fsdp":   # fsdp keeps 1/d of the optimizer state per rank
        sharded_need = least(options, replace(sync, gradient_sync="fsdp"))
        if sharded_need < need:
            helps.append((sharded_need, "--gradient-sync fsdp"))
    helps.sort()
    fitting = [(n, flag) for n, flag in helps if n <= limit]
    if fitting:
        line += f"; {fitting[0][1]} would make it fit (it needs {format_bytes(fitting[0][0], round_up=True)})"
    elif helps:
        line += f"; {helps[0][1]} would lower it to {format_bytes(helps[0][0], round_up=True)}"
    return line
