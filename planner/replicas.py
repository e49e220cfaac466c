"""Pipeline x data parallel: how to use N devices as K stages times d replicas (K * d = N).

Each of the d replicas is a whole pipeline of K stages that trains on global_batch / d samples
a step; once a step every stage averages its gradients over its d copies (the *gradient
sync*; under ``localsgd`` its parameters, once every H steps: docs/planner.md, "LocalSGD").
So a factorisation (K, d) is planned as one pipeline of K stages with the replica's
batch (a planner.problem.PipelineProblem per placement; the user's request is never rewritten),
plus each stage's sync, which :class:`planner.costmodel.CostModel` charges after the
stage's last backward next to its optimizer step (docs/planner.md, "Data parallel"). Which
ranks run which (stage, replica) is the *placement*: it decides which traffic stays on the fast
link inside a node and which crosses the network.

Interface (others code against these; the fields are stable):

- ``ring_allreduce_s(nbytes, replicas, bandwidth_bytes_per_s, latency_s) -> float``: in
  ``gpipe_plan/collectives.py``, which profiling shares
- ``Topology(nodes, devices_per_node, link_bandwidth_bytes_per_s, link_latency_s,
  network_bandwidth_bytes_per_s, network_latency_s, allreduce_bandwidth_bytes_per_s,
  allreduce_latency_s)``; ``topology_for(profile, options, devices) -> Topology``
- ``Placement(order, nodes, devices_per_node, ranks, pipeline_bandwidth_bytes_per_s,
  pipeline_latency_s, sync_bandwidth_bytes_per_s, sync_latency_s, reason)``;
  ``placements(stages, data_parallel, topology) -> list[Placement]``
- ``factorisations(devices, stages, data_parallel, batch, layers) -> list[tuple[int, int, str]]``
- ``Factorisation(stages, data_parallel, placement, result, reason, lower_bound_s)`` with
  ``fits``, ``step_s`` (inf when none fits), ``samples_per_s(global_batch)``, ``proven``
- ``DevicesResult(options, global_batch_size, devices, topology, factorisations)``, best
  first, with ``best``, ``lower_bound_s``, ``proven``
- ``search_devices(profile, options, progress=None) -> DevicesResult``

Pure Python, no torch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from ..artifacts import BadInput
from ..plan_layout import GRADIENT_SYNCS, PLACEMENT_ORDERS, gradient_sync_problem
from ..units import format_bytes
from .budgets import LEAST_PLACEMENT_S
from .costmodel import CostModel
from .objective import proven_optimal
from .budgets import share_of_budget
from .problem import (PipelineProblem, SolveOptions, problem_of, resolve_global_batch, too_few_stages,
                      too_many_stages)
from .search import SearchResult, first_pass_step, search_pipeline
from .settings import ReplicaSync, divisors, pipeline_link
from .solvers import tighten

if TYPE_CHECKING:
    from .profile import Profile

Progress = Callable[[int, int, str], None]

PIPELINE_INNER, DATA_INNER, DATA_ONLY = PLACEMENT_ORDERS
# A refusal of --devices N names at most this many of its factorisations' reasons (1,000,000
# devices have 49 factorisations: their reasons made a line of 3,000 characters).
MOST_REASONS = 4


@dataclass(frozen=True)
class Topology:
    """The machines: ``nodes`` of ``devices_per_node`` each; ranks are numbered node-major.

    ``link_*``: between devices of one node; ``network_*``: between nodes (inf bandwidth and
    0 latency: free). ``allreduce_*``: a profile's measured all-reduce between a node's
    devices (bus bandwidth and latency per ring step), used for syncs inside a node.
    """

    nodes: int = 1
    devices_per_node: int = 1
    link_bandwidth_bytes_per_s: float = math.inf
    link_latency_s: float = 0.0
    network_bandwidth_bytes_per_s: float = math.inf
    network_latency_s: float = 0.0
    allreduce_bandwidth_bytes_per_s: float | None = None
    allreduce_latency_s: float | None = None

    def link_sync(self) -> tuple[float, float]:
        """(bandwidth, latency) of a ring inside one node: measured all-reduce figures if any."""
        if self.allreduce_bandwidth_bytes_per_s is not None:
            latency = self.allreduce_latency_s if self.allreduce_latency_s is not None else self.link_latency_s
            return self.allreduce_bandwidth_bytes_per_s, latency
        return self.link_bandwidth_bytes_per_s, self.link_latency_s


@dataclass(frozen=True)
class Placement:
    """Which rank runs stage k of replica r (``ranks[k][r]``), and what each traffic pays.

    ``pipeline_*``: what every pipeline send (a cut between stages) is charged; ``sync_*``:
    what every stage's gradient sync ring is charged. ``reason``: one line for the plan.
    """

    order: str
    nodes: int
    devices_per_node: int
    ranks: tuple[tuple[int, ...], ...]
    pipeline_bandwidth_bytes_per_s: float
    pipeline_latency_s: float
    sync_bandwidth_bytes_per_s: float
    sync_latency_s: float
    reason: str

    @property
    def pipeline_on_link(self) -> bool:
        return self.nodes == 1 or all(len({r // self.devices_per_node for r in col}) == 1
                                      for col in zip(*self.ranks))

    def replica_sync(self, data_parallel: int, gradient_sync: str, sync_every: int = 1) -> "ReplicaSync":
        """What each of the ``data_parallel`` pipelines placed so pays for its gradient syncs, and
        how many processes share a host with it (the search's :class:`ReplicaSync`);
        ``sync_every``: localsgd's H."""

        return ReplicaSync(data_parallel, gradient_sync, self.sync_bandwidth_bytes_per_s, self.sync_latency_s,
                           self.devices_per_node, sync_every)

    @property
    def sync_on_link(self) -> bool:
        return self.nodes == 1 or all(len({r // self.devices_per_node for r in row}) == 1 for row in self.ranks)


def rank_grid(stages: int, data_parallel: int, order: str) -> tuple[tuple[int, ...], ...]:
    """``ranks[k][r]`` for an order: ``pipeline-inner`` rank = r K + k (one replica's stages
    on consecutive ranks), ``data-inner`` rank = k d + r (one stage's replicas consecutive);
    ``data-only`` (K = 1) rank = r, what both give with one stage."""
    if order == PIPELINE_INNER:
        return tuple(tuple(r * stages + k for r in range(data_parallel)) for k in range(stages))
    return tuple(tuple(k * data_parallel + r for r in range(data_parallel)) for k in range(stages))


def placements(stages: int, data_parallel: int, topology: Topology) -> list[Placement]:
    """The candidate placements of K stages x d replicas on the topology (one or two).

    The rule: a ring goes at its slowest hop's pace, so a stage's sync pays the link only when
    all its replicas share a node, else the network. A replica's pipeline pays the link when
    every cut of every replica stays inside a node, else the network for *every* cut
    (conservative: one plan serves all replicas, and the solver charges one figure per send).
    With one node both orders are alike: ``pipeline-inner``, the layout of
    ``init_device_mesh(("dp", "pp"))``. Two orders that give the same ranks or charge alike
    keep the first. One stage of d > 1 replicas has no pipeline, and both orders give rank r
    to replica r: that is ``data-only``.
    """
    link = (topology.link_bandwidth_bytes_per_s, topology.link_latency_s)
    network = (topology.network_bandwidth_bytes_per_s, topology.network_latency_s)
    found: list[Placement] = []
    orders = (DATA_ONLY,) if stages == 1 and data_parallel > 1 else (PIPELINE_INNER, DATA_INNER)
    for order in orders:
        ranks = rank_grid(stages, data_parallel, order)
        probe = Placement(order, topology.nodes, topology.devices_per_node, ranks, 0.0, 0.0, 0.0, 0.0, "")
        pipe = link if probe.pipeline_on_link else network
        sync = topology.link_sync() if probe.sync_on_link else network
        if stages == 1:
            pipe = link                       # one stage: no pipeline sends at all
        if data_parallel == 1:
            sync = link
        placement = replace(probe, pipeline_bandwidth_bytes_per_s=pipe[0], pipeline_latency_s=pipe[1],
                            sync_bandwidth_bytes_per_s=sync[0], sync_latency_s=sync[1])
        if any(p.ranks == ranks or (p.pipeline_on_link, p.sync_on_link) == (placement.pipeline_on_link,
                                                                             placement.sync_on_link)
               for p in found):
            continue
        found.append(replace(placement, reason=placement_reason(placement, stages, data_parallel)))
    return found


def placement_reason(placement: Placement, stages: int, data_parallel: int,
                     pipeline_bytes: float | None = None, sync_bytes: float | None = None) -> str:
    """One line: the order, and which traffic takes the link and which the network (with the
    bytes each moves per step, once a plan is known)."""
    where = f"{placement.nodes} node{'s' if placement.nodes != 1 else ''} of {placement.devices_per_node}"

    def traffic(name: str, on_link: bool, nbytes: float | None, none: bool) -> str:
        if none:
            return f"no {name}"
        amount = f" ({format_bytes(nbytes)}/step)" if nbytes is not None else ""
        return f"{name}{amount} on the {'link' if on_link else 'network'}"

    pipe = traffic("pipeline sends", placement.pipeline_on_link, pipeline_bytes, stages == 1)
    sync = traffic("gradient syncs", placement.sync_on_link, sync_bytes, data_parallel == 1)
    line = f"{placement.order} on {where}: {pipe}, {sync}"
    if placement.nodes == 1 and placement.order != DATA_ONLY:
        line += " (one node: both orders alike)"
    elif not placement.pipeline_on_link and stages > 1:
        line += " (every cut charged the network: conservative)"
    return line


def factorisations(devices: int, stages: int | None, data_parallel: int | str | None, batch: int,
                   layers: int, gradient_sync: str = "ddp") -> list[tuple[int, int, str]]:
    """Every (K, d) with K d = ``devices`` that the options allow (``stages`` / ``data_parallel``
    None or "auto": any), smallest d first, each with
    "" or one line saying why it cannot run (d must divide the batch: every replica takes the
    same share; a stage needs a layer: K <= layers; localsgd averages two replicas or more)."""
    out = []
    for d in divisors(devices):       # O(sqrt N): a mistyped --devices 99999999999 answers at once
        K = devices // d
        if stages is not None and K != stages:
            continue
        if data_parallel not in ("auto", None) and d != data_parallel:
            continue
        reason = ""
        if K > layers:
            reason = f"{K} stages need {K} layers; the profile has {layers}"
        elif batch % d:
            reason = f"{d} replicas do not divide the global batch of {batch}"
        elif d == 1 and gradient_sync == "localsgd":
            reason = "localsgd averages the parameters of 2 replicas or more"
        out.append((K, d, reason))
    return out


@dataclass
class Factorisation:
    """The best plan of one (K, d): ``result`` is its pipeline's search (batch global / d) on
    ``placement``; None, with ``reason``, when it cannot run or nothing fits."""

    stages: int
    data_parallel: int
    placement: Placement | None
    result: SearchResult | None
    reason: str = ""
    lower_bound_s: float = math.inf     # no plan of this (K, d), on any placement, is faster
    bound_by: str | None = None         # the method behind lower_bound_s (SearchResult.bound_by)

    @property
    def fits(self) -> bool:
        return self.result is not None

    @property
    def step_s(self) -> float:
        return self.result.best.step_s if self.result is not None else math.inf

    def samples_per_s(self, global_batch_size: int) -> float | None:
        return global_batch_size / self.step_s if self.fits and self.step_s > 0 else None

    @property
    def proven(self) -> bool:
        """Optimal among this (K, d)'s settings and placements."""
        return self.fits and proven_optimal(self.step_s, self.lower_bound_s)

    def sort_key(self) -> tuple:
        return (self.step_s, self.data_parallel, self.stages)


@dataclass
class DevicesResult:
    """Every factorisation searched, best first (those that fit, then the rest)."""

    options: SolveOptions
    global_batch_size: int
    devices: int
    topology: Topology
    factorisations: list[Factorisation] = field(default_factory=list)

    @property
    def best(self) -> Factorisation:
        return self.factorisations[0]

    @property
    def lower_bound_s(self) -> float:
        """No plan on these devices (any K, d, placement, setting) is faster than this."""
        return min(f.lower_bound_s for f in self.factorisations)

    @property
    def proven(self) -> bool:
        return self.best.fits and proven_optimal(self.best.step_s, self.lower_bound_s)

    @property
    def bound_by(self) -> str | None:
        """The method behind :attr:`lower_bound_s` (the factorisation's, first among equals)."""
        return min(self.factorisations, key=lambda f: f.lower_bound_s).bound_by


def topology_for(profile: Profile, options: SolveOptions, devices: int) -> Topology:
    """The topology the options describe, with the profile's link figures as defaults."""
    nodes = options.nodes
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise BadInput(f"--nodes must be a positive integer, got {nodes!r}")
    if devices % nodes:
        raise BadInput(f"--nodes {nodes} does not divide the {devices} devices: every node holds as many")
    network = options.network_bandwidth_bytes_per_s
    if nodes > 1 and network is None:
        raise BadInput(f"--nodes {nodes} needs --network-bandwidth (GB/s between nodes): the planner cannot "
                       "guess what crossing the network costs")
    # As on the link between stages (settings.pipeline_link): a network of infinite bandwidth is
    # free, and a latency given with it would be charged on a network said to cost nothing.
    if network is not None and not math.isfinite(network) and options.network_latency_s:
        raise BadInput(f"--network-latency {options.network_latency_s:g} counts only on a network of finite "
                       "bandwidth, and --network-bandwidth inf says it is free: give its GB/s, or leave "
                       "--network-latency out")
    link, link_latency = pipeline_link(profile, options)
    return Topology(
        nodes=nodes, devices_per_node=devices // nodes,
        link_bandwidth_bytes_per_s=link, link_latency_s=link_latency if math.isfinite(link) else 0.0,
        network_bandwidth_bytes_per_s=network if network is not None else math.inf,
        network_latency_s=options.network_latency_s if network is not None else 0.0,
        # a measured all-reduce stands for the link only when the user did not set the link
        allreduce_bandwidth_bytes_per_s=(profile.allreduce_bandwidth_bytes_per_s
                                         if options.link_bandwidth_bytes_per_s is None else None),
        allreduce_latency_s=profile.allreduce_latency_s if options.link_bandwidth_bytes_per_s is None else None,
    )


def check_devices(profile: Profile, options: SolveOptions) -> tuple[int, int]:
    """(devices N, global batch); one line for each contradiction in the options."""

    d, K, N = options.data_parallel, options.stages, options.devices
    if options.gradient_sync not in GRADIENT_SYNCS:
        raise BadInput(f"--gradient-sync must be one of {', '.join(GRADIENT_SYNCS)}, got {options.gradient_sync!r}")
    if d != "auto" and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
        raise BadInput(f"--data-parallel must be a positive integer or 'auto', got {d!r}")
    if K is not None and (not isinstance(K, int) or K < 1):
        raise too_few_stages(K)
    if N is None:
        if K is None or d == "auto":
            raise BadInput("give --devices N, or --stages K (with a fixed --data-parallel d)")
        N = K * d
    elif not isinstance(N, int) or isinstance(N, bool) or N < 1:
        raise BadInput(f"--devices must be a positive integer, got {N!r}")
    if K is not None and d != "auto" and K * d != N:
        raise BadInput(f"--stages {K} x --data-parallel {d} is {K * d} devices, not --devices {N}")
    if K is not None and N % K:
        raise BadInput(f"--stages {K} does not divide --devices {N}: each replica needs K devices")
    if d != "auto" and N % d:
        raise BadInput(f"--data-parallel {d} does not divide --devices {N}")
    if K is not None and K > profile.num_layers:
        raise too_many_stages(K, profile.num_layers)
    # localsgd or fsdp with one replica, however the options fix d at 1 (d itself, or K = N).
    one = 1 if d == 1 or (K is not None and K == N) else None
    reason = gradient_sync_problem(options.gradient_sync,
                              options.sync_every if options.gradient_sync == "localsgd" else None, one)
    if reason:
        raise BadInput(reason)
    batch = resolve_global_batch(profile, options)
    if d != "auto" and batch % d:
        raise BadInput(f"--data-parallel {d} does not divide the global batch of {batch}: every replica takes "
                       "as many samples; use a d that divides it, or another --global-batch-size")
    # The ILP plans one pipeline: refused only where a d > 1 is left to search.
    most_replicas = N // K if K is not None else (N if d == "auto" else d)
    if options.solver == "ilp" and most_replicas > 1:
        raise BadInput(f"--solver ilp plans one pipeline (no replicas) only: use --solver exact (the default), "
                       f"or --stages {N} for one pipeline of {N} devices")
    return N, batch


def _keep_best(entry: Factorisation, searched: list[tuple[tuple[int, int], Placement, SearchResult]]) -> None:
    """``entry`` (one K x d) from the searches of its placements so far: the best plan's, and the
    least lower bound of them all (made again after :func:`tighten` raised bounds)."""
    mine = [(placement, found) for pair, placement, found in searched if pair == (entry.stages, entry.data_parallel)]
    if not mine:
        return
    placement, found = min(mine, key=lambda item: item[1].best.step_s)
    entry.result, entry.placement, entry.reason = found, placement, ""
    weakest = min(mine, key=lambda item: item[1].lower_bound_s)[1]
    entry.lower_bound_s, entry.bound_by = weakest.lower_bound_s, weakest.bound_by


def _replica_problem(options: SolveOptions, batch: int, K: int, d: int, placement: Placement,
                     time_budget_s: float) -> PipelineProblem:
    """The search of one replica's pipeline: K stages on the global batch / d, the placement's
    pipeline link, each stage's gradient sync over the d replicas as the placement gives it."""
    return problem_of(options, stages=K, batch=batch // d,
                      link=(placement.pipeline_bandwidth_bytes_per_s, placement.pipeline_latency_s),
                      sync=placement.replica_sync(d, options.gradient_sync, options.sync_every),
                      time_budget_s=time_budget_s)


def search_devices(profile: Profile, options: SolveOptions, progress: Progress | None = None) -> DevicesResult:
    """The best plan over every (K, d) with K d = N the options allow, and every placement.

    Each (K, d, placement) is :func:`planner.search.search` of one pipeline of K stages with
    the replica's batch (global / d), its pipeline sends charged the placement's figures and
    each stage its sync; they share the time budget evenly. A factorisation keeps its best
    placement; ``lower_bound_s`` is the least lower bound over all of them, so ``proven``
    says the best plan is optimal over the whole space searched.
    """

    devices, batch = check_devices(profile, options)
    topology = topology_for(profile, options, devices)
    pairs = factorisations(devices, options.stages, options.data_parallel, batch, profile.num_layers,
                           options.gradient_sync)
    if not pairs:
        raise BadInput(f"no (stages, data parallel) pair multiplies to --devices {devices} with these options")
    jobs = [(K, d, p) for K, d, reason in pairs if not reason for p in placements(K, d, topology)]
    # Best first, by GPipe's cheap first pass, so that the placements searched later stop as soon
    # as they are proven unable to beat the best plan found (the cutoff below).
    if len(jobs) > 1:
        first = [first_pass_step(profile, _replica_problem(options, batch, K, d, p, options.time_budget_s))
                 for K, d, p in jobs]
        jobs = [job for _, _, job in sorted(zip(first, range(len(jobs)), jobs), key=lambda item: item[:2])]
    result = DevicesResult(options, batch, devices, topology)
    alone = len(jobs) == 1 and len(pairs) == 1
    started = time.perf_counter()
    done = 0
    by_pair: dict[tuple[int, int], Factorisation] = {}
    for K, d, reason in pairs:
        by_pair[(K, d)] = Factorisation(K, d, None, None, reason)
    work_spent = 0.0     # the deterministic work the placements searched so far used (solvers.py)
    searched: list[tuple[tuple[int, int], Placement, SearchResult]] = []
    for K, d, placement in jobs:
        share = share_of_budget(options.time_budget_s, started, len(jobs) - done, least_s=LEAST_PLACEMENT_S)
        work_share = max(LEAST_PLACEMENT_S, (options.time_budget_s - work_spent) / (len(jobs) - done))
        replica = _replica_problem(options, batch, K, d, placement, share)
        label = f"{K}x{d} {placement.order}"

        def inner(i: int, n: int, what: str, label: str = label) -> None:
            if progress:
                progress(done, len(jobs), f"{label} {what}")

        entry = by_pair[(K, d)]
        best_step = min((found.best.step_s for _, _, found in searched), default=math.inf)
        if alone:    # the user's one request: its own errors, and why nothing fits, as they are
            found = search_pipeline(profile, replica, progress=inner, explain=True, work_budget_s=work_share)
        else:
            try:
                found = search_pipeline(profile, replica, progress=inner, explain=False, work_budget_s=work_share,
                                        cutoff_s=best_step)
            except BadInput as error:
                if entry.result is None and not entry.reason:
                    entry.reason = str(error)
                found = None
        if found is not None:
            work_spent += found.work_s
            searched.append(((K, d), placement, found))
        _keep_best(entry, searched)
        done += 1
        if progress:
            progress(done, len(jobs), label)
    if len(searched) > 1 and options.solver != "ilp":
        # What the placements left of the budget goes where the proof is still open, with the
        # best plan of all of them as the cutoff (a placement searched early had a weaker one).
        figures: dict[int, object] = {}

        def cost_model(c):
            if c.micro_batch_size not in figures:
                figures[c.micro_batch_size] = profile.at(c.micro_batch_size)
            return CostModel(figures[c.micro_batch_size], c.setting)

        tighten([c for _, _, found in searched for c in found.candidates], cost_model, math.inf,
                options.time_budget_s - work_spent, options.time_budget_s - (time.perf_counter() - started))
        for _, _, found in searched:
            found.candidates.sort(key=lambda c: c.sort_key())
        for entry in by_pair.values():
            _keep_best(entry, searched)
    result.factorisations = sorted(by_pair.values(), key=Factorisation.sort_key)
    if not result.best.fits:
        reasons = [f"{f.stages}x{f.data_parallel}: {f.reason}" for f in result.factorisations]
        if len(reasons) > MOST_REASONS:       # one line, not one per divisor of a large --devices
            reasons = reasons[:MOST_REASONS] + [f"and {len(reasons) - MOST_REASONS} more"]
        raise BadInput(f"no factorisation of {devices} devices gives a plan: {'; '.join(reasons)}")
    for f in result.factorisations:
        if f.placement is not None and f.result is not None:
            f.placement = replace(f.placement, reason=placement_reason(
                f.placement, f.stages, f.data_parallel, *traffic_bytes(profile, f)))
    return result


def traffic_bytes(profile: Profile, f: Factorisation) -> tuple[float, float]:
    """(pipeline, sync) bytes one step moves over all devices for a factorisation's plan.

    Pipeline: every cut between two stages sends each micro-batch's activations forward and
    their gradients back, in each of the d replicas. Sync: in a ring all-reduce each of the d
    ranks sends 2 (d-1)/d of the stage's parameter bytes, so 2 (d-1) B per stage; localsgd's
    averaging moves as much once every H steps, 1/H of it per step.
    """
    assert f.result is not None and f.result.best.solution is not None
    best = f.result.best
    ev = best.solution.evaluation
    output_bytes = profile.at(best.micro_batch_size).output_bytes
    d = f.data_parallel
    cuts = sum(output_bytes[c.end - 1] for c, after in zip(ev.chunks, ev.chunks[1:]) if c.stage != after.stage)
    pipeline = 2 * best.setting.micro_batches * d * cuts
    sync = 2 * (d - 1) * sum(s.gradients_bytes for s in ev.stages) / best.setting.sync_every
    return float(pipeline), float(sync)
