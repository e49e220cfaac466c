"""What-if tables: how stages, micro-batches and recomputation change throughput and memory.

GPipe's evaluation asks how the number of partitions K, of micro-batches M and
re-materialisation change capacity and throughput. ``explore`` answers the same from the
user's own profile, with the planner's optimal plan in every cell (not a uniform split):

* throughput: rows K, columns M, each cell the best plan's predicted samples per second,
  normalised to one device with one micro-batch (K = 1, M = 1, GPipe, no recomputation, no
  memory limit), with its bubble share and peak memory per device. Cells whose best plan
  does not fit the memory limit are marked with what they would need, not hidden;
* capacity: for a model built of a repeated block, the most blocks that fit K devices of
  the given memory, with and without recomputation, by replicating the profiled block.

Work shared between cells: per-layer figures are computed once per micro-batch size, GPipe's
optimal partition seeds the 1F1B search of the same cell, and 1F1B's suffix bounds depend on
the stages left rather than on K, so one table serves every K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..artifacts import BadInput
from ..schedules import chunks_per_stage, problem
from .chunked import ChunkedSolver
from .costmodel import OPTIMIZER_STATE_MULTIPLIER, CostModel, Setting, neighbour_scale, stage_peaks
from .dp import GPipeSolver, Solution
from .onefoneb import OneFOneBSolver
from .profile import LayerFigures, Profile
from .search import AUTO_VIRTUAL_STAGES, MAX_MICRO_BATCHES, micro_batch_counts, profile_global_batch


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


def explore(profile: Profile, stages: Sequence[int], micro_batches: Sequence[int] | str = "auto",
            global_batch_size: int | None = None, memory_limit_bytes: int | None = None,
            schedules: Sequence[str] = ("gpipe", "1f1b"), recomputes: Sequence[str] = ("never", "always"),
            link_bandwidth_bytes_per_s: float | None = None, link_latency_s: float | None = None,
            optimizer: str = "adam", capacity: bool = True, time_budget_s: float = 5.0,
            progress=None) -> Exploration:
    # The profile's own global batch unless told (older profiles: their largest micro-batch).
    batch = global_batch_size if global_batch_size is not None else profile_global_batch(profile)[0]
    if batch < 1:
        raise BadInput(f"--global-batch-size must be at least 1, got {batch}")
    for K in stages:
        if K < 1:
            raise BadInput(f"--stages values must be at least 1, got {K}")
    if micro_batches == "auto":
        ms = [m for m in micro_batch_counts(batch) if m & (m - 1) == 0]   # the powers of two that divide B
    else:
        ms = list(micro_batches)
        bad = [m for m in ms if m < 1 or batch % m or m > MAX_MICRO_BATCHES]
        if bad:
            raise BadInput(f"--micro-batches {bad[0]} does not divide the global batch of {batch}: "
                           f"use divisors of {batch}, at most {MAX_MICRO_BATCHES}, or 'auto'")
    bandwidth = link_bandwidth_bytes_per_s if link_bandwidth_bytes_per_s is not None else (
        profile.link_bandwidth_bytes_per_s or math.inf)
    latency = link_latency_s if link_latency_s is not None else profile.link_latency_s

    def setting(K: int, M: int, schedule: str, recompute: str, limit: int | None, virtual_stages: int = 1) -> Setting:
        return Setting(stages=K, micro_batches=M, schedule=schedule, recompute=recompute, virtual_stages=virtual_stages,
                       memory_limit_bytes=limit, link_bandwidth_bytes_per_s=bandwidth,
                       link_latency_s=latency if math.isfinite(bandwidth) else 0.0, optimizer=optimizer,
                       overhead_s=profile.per_microbatch_overhead_s if K > 1 else 0.0,
                       compute_scale=neighbour_scale(profile.contention_slowdown, profile.contention_processes, K))

    reference = GPipeSolver(CostModel(profile.at(batch), setting(1, 1, "gpipe", "never", None))).solve()
    assert reference is not None
    ref_step = reference.evaluation.step_s
    tables: dict[tuple, dict[int, list[float]]] = {}
    cells: list[Cell] = []
    total = len(stages) * len(ms) * len(schedules) * len(recomputes)
    for K in sorted(stages, reverse=True):       # the largest K fills the shared 1F1B tables
        for M in ms:
            size = batch // M
            for recompute in recomputes:
                gpipe_partition = None
                for schedule in sorted(schedules, key=lambda s: s != "gpipe"):
                    if K > profile.num_layers:
                        cells.append(Cell(K, M, size, schedule, recompute, None, None, None, None, None, False,
                                          False, note=f"more stages than the {profile.num_layers} layers"))
                        continue
                    sol, fits, v = None, True, 1
                    for limit in ([memory_limit_bytes, None] if memory_limit_bytes else [None]):
                        if schedule in ("gpipe", "1f1b"):
                            cm = CostModel(profile.at(size), setting(K, M, schedule, recompute, limit))
                            if schedule == "gpipe":
                                sol = GPipeSolver(cm, time_budget_s=time_budget_s).solve()
                            else:
                                # Tables depend on the layer times: share them only at one scale.
                                key = (M, recompute, limit, cm.setting.compute_scale)
                                sol = OneFOneBSolver(cm, seeds=[gpipe_partition] if gpipe_partition else [],
                                                     time_budget_s=time_budget_s,
                                                     suffix_tables=tables.setdefault(key, {})).solve()
                        else:
                            sol, v = _chunked(profile.at(size), K, M, schedule, profile.num_layers, time_budget_s,
                                              lambda vs: setting(K, M, schedule, recompute, limit, vs),
                                              [gpipe_partition] if gpipe_partition else [])
                        if sol is not None:
                            break
                        fits = False
                    if sol is None and not _runs(schedule, K, M, profile.num_layers):
                        cells.append(Cell(K, M, size, schedule, recompute, None, None, None, None, None, False,
                                          False, note=_why_not(schedule, K, M, profile.num_layers)))
                        if progress:
                            progress(len(cells), total, f"K={K} M={M} {schedule} {recompute}")
                        continue
                    cells.append(_cell(K, M, size, schedule, recompute, sol, fits, batch, ref_step, v))
                    if schedule == "gpipe" and sol is not None and fits:
                        gpipe_partition = sol.evaluation.bounds
                    if progress:
                        progress(len(cells), total, f"K={K} M={M} {schedule} {recompute}")
    order = {(K, M, s, r): i for i, (K, M, s, r) in enumerate(
        (K, M, s, r) for K in stages for M in ms for s in schedules for r in recomputes)}
    cells.sort(key=lambda c: order[(c.stages, c.micro_batches, c.schedule, c.recompute)])
    block = find_repeated_block(profile)
    caps: list[Capacity] = []
    # Capacity counts one chunk per stage with a whole backward (gpipe, 1f1b): the greedy fill
    # below cuts stages, not chunks spread through the model.
    capacity_schedules = [s for s in schedules if s in ("gpipe", "1f1b")]
    if capacity and block and memory_limit_bytes and capacity_schedules:
        for K in stages:
            for recompute in recomputes:
                caps.append(block_capacity(profile, block, K, ms, batch, capacity_schedules, recompute,
                                           memory_limit_bytes, lambda K, M, s, r, lim: setting(K, M, s, r, lim)))
    return Exploration(batch, ref_step, cells, caps, block)


def _cell(K, M, size, schedule, recompute, sol: Solution | None, fits: bool, batch: int, ref_step: float,
          virtual_stages: int = 1) -> Cell:
    if sol is None:
        return Cell(K, M, size, schedule, recompute, None, None, None, None, None, False, False,
                    note="nothing fits even without a memory limit")
    ev = sol.evaluation
    return Cell(K, M, size, schedule, recompute, ev.step_s, batch / ev.step_s, ref_step / ev.step_s,
                ev.bubble_fraction(M), int(math.ceil(ev.peak_memory_bytes)), fits, sol.proven,
                ev.balance,
                note="" if fits else "exceeds the memory limit (shown: the best plan without it)",
                virtual_stages=chunks_per_stage(schedule, virtual_stages))


def _shapes(schedule: str, K: int, M: int, layers: int) -> list[int]:
    """The virtual stages a chunked schedule can take here (interleaved: 2..4; others: 1)."""
    vs = AUTO_VIRTUAL_STAGES if schedule == "interleaved" else (1,)
    return [v for v in vs if K * chunks_per_stage(schedule, v) <= layers and not problem(schedule, K, M, v)]


def _runs(schedule: str, K: int, M: int, layers: int) -> bool:
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
        cm = CostModel(fig, make_setting(v))
        sol = ChunkedSolver(cm, seeds=seeds if cm.C == K else [], time_budget_s=time_budget_s).solve()
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
        self.head_end, self.tail_start = a, a + p * n
        self.L = a + p * blocks + (fig.num_layers - self.tail_start)
        self.setting = setting
        self.per_param = 2 + OPTIMIZER_STATE_MULTIPLIER[setting.optimizer]
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
