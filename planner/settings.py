"""The settings a solve request leaves open, and what each is charged besides its layers.

A plan is a cut of the layers into chunks (the solvers' job) under a *setting*: how many
micro-batches M, which schedule (with interleaved's chunks per stage v), what recomputation
is allowed. This module enumerates the settings the user's options leave open
(:func:`settings_for`) and makes each one's cost model :class:`Setting` (:func:`cost_setting`,
the one place that says what a plan is charged: links, fixed costs, neighbours on the host,
each stage's gradient sync as one of d replicas). solve (planner/search.py) and explore both
enumerate through it.

M must divide the global batch (every micro-batch has the same size); with ``auto`` every
divisor is a candidate. More micro-batches shrink the bubble (K-1)/(M+K-1) but each pays
the fixed per-micro-batch costs again, so the best M is a measured trade-off, not a rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..schedules import SCHEDULES, chunks_per_stage, label
from ..schedules import problem as schedule_problem
from ..weight_versions import ASYNC_SCHEDULES
from ..artifacts import BadInput
from .costmodel import Setting, neighbour_scale
from .fixedcosts import FixedCosts
from .profile import Profile
from .timeshare import concurrent_ranks_of

if TYPE_CHECKING:
    from .problem import PipelineProblem, SolveOptions


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


def micro_batch_counts(batch: int) -> list[int]:
    """The micro-batch counts ``auto`` searches: divisors of the batch, at most MAX_MICRO_BATCHES."""
    return [m for m in divisors(batch) if m <= MAX_MICRO_BATCHES]


def open_micro_batches(problem: PipelineProblem) -> list[int]:
    """The micro-batch counts a problem leaves open: ``auto``'s (:func:`micro_batch_counts` of its
    batch), or the one given."""
    if problem.micro_batches == "auto":
        return micro_batch_counts(problem.batch)
    return [int(problem.micro_batches)]


def schedule_name(setting: Setting) -> str:
    """The schedule as a person reads it: ``interleaved v=2``, else its name."""
    return label(setting.schedule, setting.virtual_stages)


# interleaved's chunks per stage that ``--virtual-stages auto`` tries (while K v <= layers).
AUTO_VIRTUAL_STAGES = (2, 3, 4)


def schedule_shapes(problem: PipelineProblem, layers: int) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs a problem leaves open, before any M is chosen.

    ``auto`` is every schedule; on one stage only gpipe and 1f1b (the others are 1F1B there,
    with more actions). Interleaved takes ``--virtual-stages`` v, or with ``auto`` 2, 3 and 4
    while the K v chunks have a layer each; a schedule that needs more chunks than layers is
    left out (zb-v: 2 K).
    """
    K = problem.stages
    schedules = list(problem.schedule == "auto" and (SCHEDULES if K > 1 else ("gpipe", "1f1b"))
                     or [problem.schedule])
    return [(schedule, v) for schedule in schedules
            for v in virtual_stage_choices(schedule, problem.virtual_stages, K, layers)]


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
                 link_latency_s: float, optimizer: str, sync: ReplicaSync = ReplicaSync(),
                 micro_batch_size: float | None = None) -> Setting:
    """The cost model's :class:`Setting` for one (K, M, schedule, v) of a profile: the one place
    that says what a plan is charged besides its layers (solve and explore both call it).

    The link's latency counts only when its bandwidth does (an infinite link is free); the
    runtime's fixed costs per action and message as the profile measured them at the plan's
    ``micro_batch_size`` (None: the profile's own figures, those of its middle size), and the cost
    between actions as planner/fixedcosts.py says (a calibrated figure replaces the profile's;
    from a profile without fixed costs, with several stages only); every layer time is scaled
    for the processes computing beside it on the host, the stages of all the replicas there
    (``sync.neighbours``), of which no more than the host's cores run at once; where the host
    has fewer cores than ranks, the ranks share them (planner/timeshare.py, ``concurrent_ranks``)
    and every action runs as much slower as the profile measured there (``shared_core_slowdown``,
    ``shared_core_action_s``);
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
        **size_charges(profile, stages, micro_batch_size),
        compute_scale=neighbour_scale(profile.contention_slowdown, profile.contention_processes, computing),
        virtual_stages=virtual_stages,
        data_parallel=sync.data_parallel,
        sync_bandwidth_bytes_per_s=sync.bandwidth_bytes_per_s,
        sync_latency_s=sync.latency_s,
        gradient_sync=sync.gradient_sync,
        sync_every=sync.sync_every,
        concurrent_ranks=concurrent_ranks_of(profile.host_cores, profile.threads_per_rank, on_host, stages),
        shared_core_slowdown=profile.shared_core_slowdown or 1.0,
        shared_core_action_s=profile.shared_core_action_s,
    )


def size_charges(profile: Profile, stages: int, micro_batch_size: float | None) -> dict[str, Any]:
    """What a setting is charged that depends on its micro-batch size, as :class:`Setting`
    fields: the runtime's fixed costs per action and message and the cost between actions, which
    the profile measured per size (planner/fixedcosts.py, ``figures_at``)."""
    return {"overhead_s": profile.per_action_overhead_s(stages, micro_batch_size),
            "fixed_costs": profile.fixed_costs_at(micro_batch_size) or FixedCosts()}


def pipeline_link(profile: Profile, options: SolveOptions) -> tuple[float, float]:
    """The link between stages, (bandwidth, latency): the request's figures where given, else
    the profile's measured link, else a free one (infinite bandwidth, whose latency then does
    not count: :func:`cost_setting`). A ``--link-latency`` on a free link is refused: it would
    be dropped without a word, and the plan would not be the one asked for."""
    bandwidth = options.link_bandwidth_bytes_per_s
    if bandwidth is None:
        bandwidth = profile.link_bandwidth_bytes_per_s or math.inf
    if options.link_latency_s and not math.isfinite(bandwidth):
        raise BadInput(f"--link-latency {options.link_latency_s:g} counts only on a link of finite bandwidth, and "
                       "this one is free (no --link-bandwidth, and the profile measured no link): give "
                       "--link-bandwidth GB/s too, or profile with --measure-link")
    latency = options.link_latency_s if options.link_latency_s is not None else profile.link_latency_s
    return bandwidth, latency


def settings_for(profile: Profile, problem: PipelineProblem) -> list[tuple[Setting, int]]:
    """Every setting a problem leaves open, with its micro-batch size (settings that
    schedules.problem rejects, such as interleaved with M not a multiple of its rounds, are
    left out: :func:`no_settings_reason` says why when none is left)."""
    sync = problem.sync
    out = []
    for m in open_micro_batches(problem):
        for schedule, v in schedule_shapes(problem, profile.num_layers):
            if schedule_problem(schedule, problem.stages, m, v) or sharded_tie_problem(profile, schedule, v, sync):
                continue
            setting = cost_setting(profile, stages=problem.stages, micro_batches=m, schedule=schedule,
                                   virtual_stages=v, recompute=problem.recompute,
                                   memory_limit_bytes=problem.memory_limit_bytes,
                                   link_bandwidth_bytes_per_s=problem.link_bandwidth_bytes_per_s,
                                   link_latency_s=problem.link_latency_s, optimizer=problem.optimizer, sync=sync,
                                   micro_batch_size=problem.batch // m)
            if setting.time_shared and schedule in ASYNC_SCHEDULES:
                raise BadInput(f"{schedule} on ranks that share the host's cores (it runs "
                               f"{setting.concurrent_ranks:g} of the {problem.stages} stages at once) is not "
                               "modelled: use fewer stages or a synchronous --schedule")
            out.append((setting, problem.batch // m))
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


def no_settings_reason(profile: Profile, problem: PipelineProblem) -> str:
    """One line: why a problem leaves no setting to solve, and what to do."""
    shapes = schedule_shapes(problem, profile.num_layers)
    if not shapes:
        return (f"--schedule {problem.schedule} with --stages {problem.stages} needs more chunks than the "
                f"profile's {profile.num_layers} layers: use fewer stages, or another schedule")
    schedule, v = shapes[0]
    reason = (schedule_problem(schedule, problem.stages, open_micro_batches(problem)[0], v)
              or sharded_tie_problem(profile, schedule, v, problem.sync) or "no setting is left")
    return f"{reason}: use --micro-batches auto, another count, or another --schedule"
