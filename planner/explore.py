"""What-if tables: how stages, micro-batches and recomputation change throughput and memory.

GPipe's evaluation asks how the number of partitions K, of micro-batches M and
re-materialisation change capacity and throughput. ``explore`` answers the same from the
user's own profile, with the planner's optimal plan in every cell (not a uniform split):

* throughput: rows K, columns M, each cell the best plan's predicted samples per second,
  normalised to one device with one micro-batch (K = 1, M = 1, GPipe, no recomputation, no
  memory limit), with its bubble share and peak memory per device. Cells whose best plan
  does not fit the memory limit are marked with what they would need, not hidden;
* capacity: for a model built of a repeated block, the most blocks that fit K devices of
  the given memory, with and without recomputation, by replicating the profiled block;
* devices (``--devices N``): rows are the factorisations K x d = N, d replicas of a K-stage
  pipeline. A replica is one pipeline on the global batch / d, plus each stage's gradient
  sync over its d copies; the placement (planner/replicas.py) decides whether the sends and
  the syncs cross the fast link inside a node or the network. So more replicas trade the
  bubble for syncs, and a slow network pushes the best K x d toward the pipeline.

Work shared between cells: per-layer figures are computed once per micro-batch size, GPipe's
optimal partition seeds the other schedules' searches of the same cell (after it, every search
gets the min-max cut and its neighbours, planner/seeds.py, as ``solve`` does), and 1F1B's suffix
bounds depend on the stages left rather than on K, so one table serves every K. A cell is
searched as ``solve`` searches one setting (planner/solvers.py, ``solve_cost_model``), with
``--time-budget`` per cell in deterministic work (so a cell is the same on every run): the
branch and bound, followed by the MILP only where the cell's budget pays for building its
programme (small models and few micro-batches at the default 0.5 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..artifacts import BadInput
from ..schedules import PLANNABLE_SCHEDULES, chunks_per_stage, problem
from ..weight_versions import ASYNC_SCHEDULES
from .budgets import EXPLORE_POINT_TIME_BUDGET_S
from .costmodel import CostModel, Setting, charged_static_bytes, stage_peaks
from .gpipe_solver import GPipeSolver
from .objective import Solution
from .problem import SolveOptions, check_micro_batches, resolve_global_batch
from .profile import LayerFigures, Profile
from .settings import (ReplicaSync, cost_setting, micro_batch_counts, pipeline_link, sharded_tie_problem,
                       virtual_stage_choices)
from .solvers import solve_cost_model
from ..units import format_bytes


@dataclass
class Cell:
    stages: int
    micro_batches: int
    micro_batch_size: int
    schedule: str
    recompute: str
    step_s: float | None
    throughput_per_s: float | None
    normalized_throughput: float | None
    bubble_fraction: float | None
    peak_memory_bytes: int | None
    fits: bool
    proven: bool
    balance: list[int] = field(default_factory=list)   # layers per chunk
    note: str = ""
    virtual_stages: int = 1         # chunks per stage (interleaved: the best of 2..4; zb-v: 2)
    data_parallel: int = 1          # d: replicas of the pipeline, each on global batch / d samples
    order: str = ""                 # the replicas' placement order ("" for one replica alone)
    slowest_stage_gradient_sync_s: float | None = None   # the slowest stage's sync per step (0: one replica)

    def row(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Capacity:
    stages: int
    recompute: str
    blocks: int                     # the most copies of the block that fit (0: not even one)
    parameters: int                 # parameters of that model (elements, at 4 bytes each: bytes / 4)
    param_bytes: int
    setting: str                    # the M and schedule that fit it

    def row(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Exploration:
    global_batch_size: int
    reference_step_s: float
    cells: list[Cell]
    capacity: list[Capacity]
    block: dict[str, Any] | None    # the repeated block found in the profile, if any
    devices: int | None = None      # N of a --devices exploration (rows K x d = N), else None
    factorisations: list["FactorisationSummary"] = field(default_factory=list)   # --devices: best first


def explore(profile: Profile, stages: Sequence[int] | None, micro_batches: Sequence[int] | str = "auto",
            global_batch_size: int | None = None, memory_limit_bytes: int | None = None,
            schedules: Sequence[str] = ("gpipe", "1f1b"), recomputes: Sequence[str] = ("never", "always"),
            link_bandwidth_bytes_per_s: float | None = None, link_latency_s: float | None = None,
            optimizer: str = "adam", capacity: bool = True, time_budget_s: float = EXPLORE_POINT_TIME_BUDGET_S,
            progress=None, devices: int | None = None, nodes: int | None = None,
            network_bandwidth_bytes_per_s: float | None = None, network_latency_s: float | None = None,
            gradient_sync: str = "ddp", sync_every: int = 1) -> Exploration:
    """Every cell of the grid, each the planner's best plan for its setting.

    Without ``devices`` the rows are the pipeline depths ``stages`` (one replica). With
    ``devices`` = N the rows are the factorisations K x d = N (K among ``stages`` if given,
    else every divisor of N): d replicas of a K-stage pipeline, each replica taking the global
    batch / d samples a step, placed on ``nodes`` machines as the planner would place them
    (planner/replicas.py), each stage's gradients synchronised over its d replicas.
    ``time_budget_s`` is each cell's search's, not the whole grid's. ``sync_every``: localsgd's H
    (its averaging charged 1/H per step, as solve charges it).
    """
    # The options the planner's own solve would take: what explore asks beyond them is the grid.
    given = {k: v for k, v in dict(nodes=nodes, network_latency_s=network_latency_s).items() if v is not None}
    request = SolveOptions(stages=None, global_batch_size=global_batch_size, devices=devices,
                           data_parallel="auto" if devices is not None else 1,
                           link_bandwidth_bytes_per_s=link_bandwidth_bytes_per_s, link_latency_s=link_latency_s,
                           network_bandwidth_bytes_per_s=network_bandwidth_bytes_per_s, gradient_sync=gradient_sync,
                           sync_every=sync_every, optimizer=optimizer, **given)
    grid = _grid(profile, request, stages, micro_batches, memory_limit_bytes, schedules, recomputes, time_budget_s)
    reference_step_s = _reference_step_s(grid)
    cells = _solve_cells(grid, reference_step_s, progress)
    if cells and all(c.step_s is None for c in cells):
        # A grid of dashes is no answer: say why no cell could be planned, as solve would.
        from .replicas import MOST_REASONS

        reasons = sorted({c.note or "no plan" for c in cells})
        if len(reasons) > MOST_REASONS:       # one line, not one per cell of a large --devices
            reasons = reasons[:MOST_REASONS] + [f"and {len(reasons) - MOST_REASONS} more"]
        raise BadInput(f"no cell of the grid can be planned ({'; '.join(reasons)}): "
                       "ask for other stages, micro-batch counts or schedules")
    block = find_repeated_block(profile)
    caps = _capacity_table(grid, block) if capacity else []
    summaries = factorisation_summaries(grid.shapes, cells) if devices is not None else []
    return Exploration(grid.batch, reference_step_s, cells, caps, block, devices=devices, factorisations=summaries)


DEFAULT_STAGES = (1, 2, 4, 8)


@dataclass(frozen=True)
class _Grid:
    """An exploration's question, checked and resolved once: the request as the planner's own
    options, the global batch, the rows (``shapes``), the columns (``micro_batches``), what
    each cell varies besides, and each cell's search budget."""

    profile: Profile
    request: SolveOptions
    batch: int
    one_replica_stages: tuple[int, ...]   # the rows K without --devices (and the capacity table's)
    shapes: list[_Shape]
    micro_batches: list[int]
    schedules: Sequence[str]
    recomputes: Sequence[str]
    memory_limit_bytes: int | None
    link: tuple[float, float]              # the link as given (settings.pipeline_link): bandwidth, latency
    point_budget_s: float

    def setting(self, shape: _Shape, micro_batches: int, schedule: str, recompute: str, limit: int | None,
                virtual_stages: int = 1, micro_batch_size: float | None = None) -> Setting:
        """The cost model's setting of one cell (settings.cost_setting, as solve makes it).

        One replica alone: the link as given. Replicas: the placement says which link the
        pipeline's sends and the gradient sync cross (inside a node, or the network).
        """
        placement = shape.placement
        if placement is None:
            (pipe_bw, pipe_lat), sync = self.link, ReplicaSync()
        else:
            pipe_bw, pipe_lat = placement.pipeline_bandwidth_bytes_per_s, placement.pipeline_latency_s
            sync = placement.replica_sync(shape.data_parallel, self.request.gradient_sync, self.request.sync_every)
        return cost_setting(self.profile, stages=shape.stages, micro_batches=micro_batches, schedule=schedule,
                            virtual_stages=virtual_stages, recompute=recompute, memory_limit_bytes=limit,
                            link_bandwidth_bytes_per_s=pipe_bw, link_latency_s=pipe_lat,
                            optimizer=self.request.optimizer, sync=sync, micro_batch_size=micro_batch_size)


def _grid(profile: Profile, request: SolveOptions, stages: Sequence[int] | None,
          micro_batches: Sequence[int] | str, memory_limit_bytes: int | None, schedules: Sequence[str],
          recomputes: Sequence[str], point_budget_s: float) -> _Grid:
    """Check the question (one line for each thing wrong) and resolve it into a :class:`_Grid`.

    The global batch and the link are resolved as solve resolves them (the profile's own
    unless told; older profiles: their largest micro-batch). ``auto`` columns are the powers
    of two that divide the batch; a given M must be one solve would take.
    """
    batch = resolve_global_batch(profile, request)
    for K in stages or ():
        if K < 1:
            raise BadInput(f"--stages values must be at least 1, got {K}")
    one_replica_stages = tuple(stages or DEFAULT_STAGES)
    if request.devices is None:
        shapes = [_Shape(K, 1, None, "") for K in one_replica_stages]
    else:
        shapes = replica_shapes(profile, request, request.devices, stages, batch)
    if micro_batches == "auto":
        ms = [m for m in micro_batch_counts(batch) if m & (m - 1) == 0]   # the powers of two that divide B
    else:
        ms = list(micro_batches)
        for m in ms:
            check_micro_batches(m, batch)
    return _Grid(profile, request, batch, one_replica_stages, shapes, ms, schedules, recomputes, memory_limit_bytes,
                 pipeline_link(profile, request), point_budget_s)


def _reference_step_s(grid: _Grid) -> float:
    """The step every throughput is normalised to: one device, one micro-batch, GPipe, no
    recomputation, no memory limit."""
    one_device = _Shape(1, 1, None, "")
    reference = GPipeSolver(CostModel(grid.profile.at(grid.batch),
                                      grid.setting(one_device, 1, "gpipe", "never", None,
                                                   micro_batch_size=grid.batch))).solve()
    assert reference is not None
    return reference.evaluation.step_s


def _solve_cells(grid: _Grid, reference_step_s: float, progress) -> list[Cell]:
    """Every cell of the grid, in the grid's order (rows, then M, schedule, recompute).

    The largest K goes first, to fill the 1F1B tables its smaller K share; a factorisation's
    placements follow each other, and :func:`_merge` keeps each cell's best placement. Within
    a (K, M, recompute), GPipe goes first: its optimal partition seeds the other schedules.
    """
    profile, batch = grid.profile, grid.batch
    tables: dict[tuple, dict[int, list[float]]] = {}
    cells: list[Cell] = []
    done = 0
    total = (len({(s.stages, s.data_parallel) for s in grid.shapes}) * len(grid.micro_batches)
             * len(grid.schedules) * len(grid.recomputes))

    def advance(shape: _Shape, M: int, schedule: str, recompute: str) -> None:
        """One more cell done (a second placement of the same K x d counts once)."""
        nonlocal done
        if shape.later_placement:
            return
        done += 1
        if progress:
            progress(done, total, f"K={shape.stages} d={shape.data_parallel} M={M} {schedule} {recompute}"
                     if grid.request.devices is not None else f"K={shape.stages} M={M} {schedule} {recompute}")

    for shape in sorted(grid.shapes, key=lambda s: (-s.stages, s.data_parallel)):
        K, d = shape.stages, shape.data_parallel
        replica_batch = batch // d
        for M in grid.micro_batches:
            size = replica_batch // M if replica_batch % M == 0 else 0
            for recompute in grid.recomputes:
                gpipe_partition = None
                for schedule in sorted(grid.schedules, key=lambda s: s != "gpipe"):
                    skipped = _skip_reason(grid, shape, M, size, replica_batch, schedule, recompute)
                    if skipped:   # a cell that cannot run is noted
                        cells.append(_note(K, M, size, schedule, recompute, skipped, d, shape.order))
                        advance(shape, M, schedule, recompute)
                        continue
                    sol, fits, v = _solve_point(grid, shape, M, size, schedule, recompute, gpipe_partition, tables)
                    if sol is None and not _runs(schedule, K, M, profile.num_layers):
                        cells.append(_note(K, M, size, schedule, recompute,
                                           _why_not(schedule, K, M, profile.num_layers), d, shape.order))
                    else:
                        cells.append(_cell(K, M, size, schedule, recompute, sol, fits, batch, reference_step_s, v,
                                           data_parallel=d, order=shape.order))
                        if schedule == "gpipe" and sol is not None and fits:
                            gpipe_partition = sol.evaluation.bounds
                    advance(shape, M, schedule, recompute)
    return _in_grid_order(grid, _merge(cells))


def _skip_reason(grid: _Grid, shape: _Shape, M: int, size: int, replica_batch: int, schedule: str,
                 recompute: str) -> str:
    """Why a cell is not solved at all ("" when it is): its K x d cannot run, M does not divide
    a replica's batch, more stages than layers, or fsdp would shard a tied weight twice."""
    K, layers, gradient_sync = shape.stages, grid.profile.num_layers, grid.request.gradient_sync
    if shape.reason:
        return shape.reason
    if size == 0:
        return f"M = {M} does not divide a replica's batch of {replica_batch}"
    if K > layers:
        return f"more stages than the {layers} layers"
    if shape.placement is not None and sharded_tie_problem(
            grid.profile, schedule, 2,     # interleaved's least v: several chunks per stage, as zb-v
            shape.placement.replica_sync(shape.data_parallel, gradient_sync)):
        return f"{gradient_sync} cannot shard a tied weight twice on one stage"
    if schedule in ASYNC_SCHEDULES and size and not problem(schedule, K, M):
        if gradient_sync == "fsdp" and shape.data_parallel > 1:
            return f"{schedule} keeps whole weight versions: fsdp does not run it"
        if gradient_sync == "localsgd" and shape.data_parallel > 1:
            return f"{schedule} with localsgd is not defined"
        if recompute == "always":
            return f"{schedule} does not recompute (a rerun would meet the newest weights, not the stashed ones)"
        if grid.setting(shape, M, schedule, "never", None).time_shared:
            return f"{schedule} on ranks sharing the host's cores is not modelled"
    return ""


def _solve_point(grid: _Grid, shape: _Shape, M: int, size: int, schedule: str, recompute: str,
                 gpipe_partition: tuple[int, ...] | None,
                 tables: dict[tuple, dict[int, list[float]]]) -> tuple[Solution | None, bool, int]:
    """The best plan of one cell, as (solution, fits, virtual stages): within the memory limit,
    else the best without it (``fits`` False), to show what the cell would need.

    ``gpipe_partition`` seeds the searches of the other schedules; ``tables`` are 1F1B's
    suffix bounds, shared by the cells whose layer times and links are alike.
    """
    K, profile, budget_s = shape.stages, grid.profile, grid.point_budget_s
    seeds = [gpipe_partition] if gpipe_partition else []
    sol, fits, v = None, True, 1
    for limit in ([grid.memory_limit_bytes, None] if grid.memory_limit_bytes else [None]):
        if schedule in ("gpipe", "1f1b") or (schedule in ASYNC_SCHEDULES and not problem(schedule, K, M)):
            cm = CostModel(profile.at(size), grid.setting(shape, M, schedule, recompute, limit, micro_batch_size=size))
            suffix_tables = None
            if schedule == "1f1b":
                # Its tables depend on the layer times and links: shared only alike.
                st = cm.setting
                key = (M, size, recompute, limit, st.compute_scale, st.link_bandwidth_bytes_per_s,
                       st.link_latency_s, st.data_parallel, st.sync_bandwidth_bytes_per_s,
                       st.sync_latency_s, st.gradient_sync, st.sync_every, st.overhead_s, st.fixed_costs,
                       st.action_slowdown, st.action_added_s)
                suffix_tables = tables.setdefault(key, {})
            sol = solve_cost_model(cm, "exact", budget_s, seeds, suffix_tables=suffix_tables)
        elif schedule not in ASYNC_SCHEDULES:
            sol, v = _chunked(profile.at(size), K, M, schedule, profile.num_layers, budget_s,
                              lambda vs: grid.setting(shape, M, schedule, recompute, limit, vs, size), seeds)
        if sol is not None:
            break
        fits = False
    return sol, fits, v


def _in_grid_order(grid: _Grid, cells: list[Cell]) -> list[Cell]:
    """The cells in the order the grid lists them: rows, then M, schedule and recompute."""
    order = {key: i for i, key in enumerate(
        (s.stages, s.data_parallel, M, sc, r)
        for s in grid.shapes for M in grid.micro_batches for sc in grid.schedules for r in grid.recomputes)}
    return sorted(cells, key=lambda c: order[(c.stages, c.data_parallel, c.micro_batches, c.schedule, c.recompute)])


def _capacity_table(grid: _Grid, block: dict[str, Any] | None) -> list[Capacity]:
    """The most blocks that fit each K, per recompute (needs a repeated block and a memory limit).

    Capacity counts one chunk per stage with a whole backward (gpipe, 1f1b): the greedy fill
    cuts stages, not chunks spread through the model. It is a one-replica question (how deep
    a pipeline a model needs), so a --devices exploration leaves it out.
    """
    capacity_schedules = [s for s in grid.schedules if s in ("gpipe", "1f1b")]
    if grid.request.devices is not None or not block or not grid.memory_limit_bytes or not capacity_schedules:
        return []
    return [block_capacity(grid.profile, block, K, grid.micro_batches, grid.batch, capacity_schedules, recompute,
                           grid.memory_limit_bytes,
                           lambda K, M, s, r, lim: grid.setting(_Shape(K, 1, None, ""), M, s, r, lim,
                                                                micro_batch_size=grid.batch // M))
            for K in grid.one_replica_stages for recompute in grid.recomputes]


@dataclass(frozen=True)
class _Shape:
    """One way to lay out the devices: d replicas of a K-stage pipeline, and where they go."""

    stages: int
    data_parallel: int
    placement: Any                  # planner.replicas.Placement, or None: one replica, the link as given
    reason: str                     # why this K x d cannot run ("" if it can)
    later_placement: bool = False   # a second placement of the same K x d (progress counts the first)

    @property
    def order(self) -> str:
        return getattr(self.placement, "order", "") if self.placement is not None else ""


def replica_shapes(profile: Profile, request: SolveOptions, devices: int, stages: Sequence[int] | None,
                   batch: int) -> list[_Shape]:
    """Every K x d = ``devices`` to explore, with each placement the planner would consider.

    The factorisations, the machines' topology (from ``request``, the exploration's options)
    and the placements are the planner's own (planner/replicas.py), so that a row of the grid
    is a plan ``solve --devices`` could make.
    """
    from .replicas import factorisations, placements, topology_for

    if devices < 1:
        raise BadInput(f"--devices must be at least 1, got {devices}")
    topology = topology_for(profile, request, devices)
    pairs = factorisations(devices, None, "auto", batch, profile.num_layers, request.gradient_sync)
    if stages:
        unknown = [K for K in stages if devices % K]
        if len(unknown) == len(list(stages)):
            raise BadInput(f"--stages {','.join(map(str, stages))}: none divides --devices {devices}; a pipeline of "
                           f"K stages runs devices / K replicas, so K must divide {devices}")
        pairs = [(K, d, why) for K, d, why in pairs if K in stages]
    shapes: list[_Shape] = []
    for K, d, why in pairs:
        if why:
            shapes.append(_Shape(K, d, None, why))
            continue
        for i, placement in enumerate(placements(K, d, topology)):
            shapes.append(_Shape(K, d, placement, "", later_placement=i > 0))
    return shapes


def _merge(cells: list[Cell]) -> list[Cell]:
    """One cell per (K, d, M, schedule, recompute): of a factorisation's placements, the best plan
    (one that fits before one that does not, then the faster)."""
    best: dict[tuple, Cell] = {}
    for c in cells:
        key = (c.stages, c.data_parallel, c.micro_batches, c.schedule, c.recompute)
        if key not in best or _better(c, best[key]):
            best[key] = c
    return list(best.values())


def _better(a: Cell, b: Cell) -> bool:
    if (a.step_s is None) != (b.step_s is None):
        return a.step_s is not None
    if a.step_s is None:
        return False
    if a.fits != b.fits:
        return a.fits
    return a.step_s < b.step_s


@dataclass
class FactorisationSummary:
    """One K x d of a ``--devices`` exploration: its best cell and the cells that fit."""

    stages: int
    data_parallel: int
    best: Cell | None               # the fastest cell that fits (None: none does)
    fitting_cells: int
    cells: int
    reason: str                     # why none fits, or why it cannot run ("" when one fits)

    def row(self) -> dict[str, Any]:
        best = self.best
        return {"stages": self.stages, "data_parallel": self.data_parallel, "fits": best is not None,
                "order": best.order if best else None, "step_s": best.step_s if best else None,
                "samples_per_s": best.throughput_per_s if best else None,
                "micro_batches": best.micro_batches if best else None, "schedule": best.schedule if best else None,
                "virtual_stages": best.virtual_stages if best else None, "recompute": best.recompute if best else None,
                "slowest_stage_gradient_sync_s": best.slowest_stage_gradient_sync_s if best else None,
                "proven": best.proven if best else False,
                "fitting_cells": self.fitting_cells, "cells": self.cells, "reason": self.reason}


def _rank(c: Cell) -> tuple:
    """Ties broken as the planner's search breaks them (search.Candidate.sort_key): the faster,
    then the one needing less memory, fewer micro-batches, the earlier schedule."""
    return (c.step_s, c.peak_memory_bytes, c.micro_batches, PLANNABLE_SCHEDULES.index(c.schedule), c.virtual_stages)


def factorisation_summaries(shapes: Sequence[_Shape], cells: Sequence[Cell]) -> list[FactorisationSummary]:
    """Per K x d, best first (those with no fitting cell last): what the grid says of it."""
    out = []
    for K, d in dict.fromkeys((s.stages, s.data_parallel) for s in shapes):
        mine = [c for c in cells if (c.stages, c.data_parallel) == (K, d)]
        fitting = [c for c in mine if c.fits and c.step_s is not None]
        best = min(fitting, key=_rank) if fitting else None
        reason = ""
        if best is None:
            why = next((s.reason for s in shapes if (s.stages, s.data_parallel) == (K, d) and s.reason), "")
            over = [c for c in mine if c.step_s is not None]
            reason = why or ((f"over the memory limit at every M (needs "
                              f"{format_bytes(min(c.peak_memory_bytes for c in over))})") if over
                             else next((c.note for c in mine if c.note), "no plan"))
        out.append(FactorisationSummary(K, d, best, len(fitting), len(mine), reason))
    out.sort(key=lambda f: (f.best is None, f.best.step_s if f.best else 0.0, f.stages))
    return out


def _note(K: int, M: int, size: int, schedule: str, recompute: str, text: str, data_parallel: int,
          order: str) -> Cell:
    """A cell with no plan, only why."""
    return Cell(K, M, size, schedule, recompute, None, None, None, None, None, False, False,
                note=text, data_parallel=data_parallel, order=order)


def _cell(K, M, size, schedule, recompute, sol: Solution | None, fits: bool, batch: int, ref_step: float,
          virtual_stages: int = 1, data_parallel: int = 1, order: str = "") -> Cell:
    if sol is None:
        return Cell(K, M, size, schedule, recompute, None, None, None, None, None, False, False,
                    note="nothing fits even without a memory limit", data_parallel=data_parallel, order=order)
    ev = sol.evaluation
    return Cell(K, M, size, schedule, recompute, ev.step_s, batch / ev.step_s, ref_step / ev.step_s,
                ev.bubble_fraction(M), int(math.ceil(ev.peak_memory_bytes)), fits, sol.proven,
                ev.balance,
                note="" if fits else "exceeds the memory limit (shown: the best plan without it)",
                virtual_stages=chunks_per_stage(schedule, virtual_stages), data_parallel=data_parallel, order=order,
                slowest_stage_gradient_sync_s=max((st.gradient_sync_s for st in ev.stages),
                                                  default=0.0))


def _shapes(schedule: str, K: int, M: int, layers: int) -> list[int]:
    """The virtual stages a chunked schedule can take here (interleaved: 2..4; others: 1)."""
    return [v for v in virtual_stage_choices(schedule, "auto", K, layers) if not problem(schedule, K, M, v)]


def _runs(schedule: str, K: int, M: int, layers: int) -> bool:
    if schedule in ASYNC_SCHEDULES:
        return not problem(schedule, K, M)
    return schedule in ("gpipe", "1f1b") or bool(_shapes(schedule, K, M, layers))


def _why_not(schedule: str, K: int, M: int, layers: int) -> str:
    v = 2 if schedule == "interleaved" else 1
    if K * chunks_per_stage(schedule, v) > layers:
        return f"{schedule} needs {K * chunks_per_stage(schedule, v)} chunks, more than the {layers} layers"
    return problem(schedule, K, M, v) or "does not run here"


def _chunked(fig: LayerFigures, K: int, M: int, schedule: str, layers: int, time_budget_s: float, make_setting,
             seeds: list) -> tuple[Solution | None, int]:
    """The best plan of a chunked or split-backward schedule (interleaved: over its virtual stages)."""
    best, best_v = None, 1
    for v in _shapes(schedule, K, M, layers):
        sol = solve_cost_model(CostModel(fig, make_setting(v)), "exact", time_budget_s, seeds)
        if sol is not None and (best is None or sol.evaluation.step_s < best.evaluation.step_s):
            best, best_v = sol, v
    return best, best_v


# --------------------------------------------------------------------------- capacity
def find_repeated_block(profile: Profile) -> dict[str, Any] | None:
    """The longest run of a layer pattern repeated back to back (e.g. a transformer's blocks).

    Layers match when their parameter, activation and output bytes are equal at every size
    and their times are within 25%: repeats of the same block measure a little differently.
    """
    layers = profile.layers
    L = len(layers)

    def same(i: int, j: int) -> bool:
        a, b = layers[i], layers[j]
        if a["param_bytes"] != b["param_bytes"] or a["activation_bytes"] != b["activation_bytes"] \
                or a["output_bytes"] != b["output_bytes"]:
            return False
        return all(abs(x - y) <= 0.25 * max(x, y, 1e-12) for key in ("forward_s", "backward_s")
                   for x, y in zip(a[key], b[key]))

    best = None
    for period in range(1, L // 2 + 1):
        start = 0
        while start + 2 * period <= L:
            repeats = 1
            while start + (repeats + 1) * period <= L and all(
                    same(start + i, start + repeats * period + i) for i in range(period)):
                repeats += 1
            if repeats >= 2 and (best is None or repeats * period > best[2] * best[1]
                                 or (repeats * period == best[2] * best[1] and period < best[1])):
                best = (start, period, repeats)
            start += 1
    if best is None:
        return None
    start, period, repeats = best
    return {"first_layer": start, "layers_per_block": period, "blocks": repeats,
            "names": [layers[start + i]["name"] for i in range(period)]}


class _Replicated:
    """A profile's per-layer memory figures with its repeated block copied ``blocks`` times,
    without building the long lists: prefix sums over a periodic sequence are arithmetic."""

    def __init__(self, fig: LayerFigures, block: dict[str, Any], blocks: int, setting: Setting):
        a, p, n = block["first_layer"], block["layers_per_block"], block["blocks"]
        self.a, self.p, self.blocks = a, p, blocks
        self.tail_start = a + p * n
        self.L = a + p * blocks + (fig.num_layers - self.tail_start)
        self.setting = setting
        # parameters + gradients + optimizer state per parameter byte, as CostModel.static_memory
        self.per_param = sum(charged_static_bytes(1.0, setting.optimizer, setting.data_parallel, setting.gradient_sync))
        weights = [pb * self.per_param + bb for pb, bb in zip(fig.param_bytes, fig.buffer_bytes)]
        self.static = self._series(fig, weights, block)
        self.act = self._series(fig, list(fig.activation_bytes), block)
        outputs = self._unit(list(fig.output_bytes), block)
        self.out_head, self.out_unit, self.out_tail = outputs
        trans = self._unit(list(fig.transient_bytes), block)
        self.trans_max = max(max(trans[0], default=0.0), max(trans[1], default=0.0), max(trans[2], default=0.0))
        self.input_bytes = fig.input_bytes

    @staticmethod
    def _unit(values: list[float], block: dict[str, Any]):
        a, p, n = block["first_layer"], block["layers_per_block"], block["blocks"]
        unit = [sum(values[a + r * p + i] for r in range(n)) / n for i in range(p)]
        return values[:a], unit, values[a + p * n:]

    def _series(self, fig, values: list[float], block):
        head, unit, tail = self._unit(values, block)
        head_prefix = [0.0]
        for v in head:
            head_prefix.append(head_prefix[-1] + v)
        unit_prefix = [0.0]
        for v in unit:
            unit_prefix.append(unit_prefix[-1] + v)
        tail_prefix = [0.0]
        for v in tail:
            tail_prefix.append(tail_prefix[-1] + v)
        return head_prefix, unit_prefix, tail_prefix

    def prefix(self, series, i: int) -> float:
        head, unit, tail = series
        if i <= self.a:
            return head[i]
        body_end = self.a + self.p * self.blocks
        if i <= body_end:
            full, part = divmod(i - self.a, self.p)
            return head[-1] + full * unit[-1] + unit[part]
        return head[-1] + self.blocks * unit[-1] + tail[i - body_end]

    def output(self, i: int) -> float:
        """Bytes crossing the cut after layer i."""
        if i < self.a:
            return self.out_head[i]
        body_end = self.a + self.p * self.blocks
        if i < body_end:
            return self.out_unit[(i - self.a) % self.p]
        return self.out_tail[i - body_end]

    def memory(self, s: int, e: int, k: int, recompute: bool) -> float:
        st = self.setting
        n = stage_peaks(st.schedule, st.stages, st.micro_batches, 1)[k].in_flight
        act = self.prefix(self.act, e) - self.prefix(self.act, s)
        inp = self.input_bytes if s == 0 else self.output(s - 1)
        held = (n - 1) * inp + max(act, inp) if recompute else n * act
        # the largest transient peak anywhere: a safe (high) stand-in for the stage's own
        return self.prefix(self.static, e) - self.prefix(self.static, s) + held + self.trans_max

    def fits(self) -> bool:
        """Greedy fill: each stage takes layers while it fits. Exact when a stage's memory grows
        with its length and does not depend on where it starts, as inside a run of blocks."""
        limit, L, K = self.setting.memory_limit_bytes, self.L, self.setting.stages
        choices = {"never": (False,), "always": (True,), "auto": (False, True)}[self.setting.recompute]
        s = 0
        for k in range(K):
            if s == L:
                return True
            best = s
            for r in choices:
                lo, hi = s, L          # lo fits (or is s)
                if self.memory(s, hi, k, r) <= limit:
                    lo = hi
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if self.memory(s, mid, k, r) <= limit:
                        lo = mid
                    else:
                        hi = mid
                best = max(best, lo)
            if best == s:
                return False
            s = best
        return s == L


MAX_BLOCKS = 1 << 30


def block_capacity(profile: Profile, block: dict[str, Any], K: int, ms: Sequence[int], batch: int,
                   schedules: Sequence[str], recompute: str, limit: int, make_setting) -> Capacity:
    best_blocks, best_setting = 0, "-"
    for M in ms:
        fig = profile.at(batch // M)
        for schedule in schedules:
            st = make_setting(K, M, schedule, recompute, limit)

            def fits(blocks: int) -> bool:
                return _Replicated(fig, block, blocks, st).fits()

            if not fits(1):
                continue
            lo, hi = 1, 2
            while hi <= MAX_BLOCKS and fits(hi):
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
            if lo > best_blocks:
                best_blocks, best_setting = lo, f"M={M} {schedule}"
    fig = profile.at(batch)
    a, p, n = block["first_layer"], block["layers_per_block"], block["blocks"]
    fixed = sum(fig.param_bytes[:a]) + sum(fig.param_bytes[a + p * n:])
    per_block = sum(fig.param_bytes[a:a + p * n]) / n
    param_bytes = int(fixed + per_block * best_blocks)
    return Capacity(K, recompute, best_blocks, param_bytes // 4, param_bytes, best_setting)
