"""The least memory a setting needs, and the refusal that says so when nothing fits.

When no plan fits the memory limit, a bare "out of memory" leaves the user guessing. The
refusal (:func:`explain_infeasible`) says the smallest limit that works, found by a min-max
partition of stage memory (:func:`least_memory`), and which single option (recomputation,
1F1B, another M, more stages, fsdp) would bring the need under the limit, or lowest.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from .budgets import LEAST_MEMORY_BUDGET_S
from .costmodel import CostModel, Setting
from .problem import PipelineProblem
from .profile import Profile
from .settings import settings_for
from ..units import format_bytes


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


def explain_infeasible(profile: Profile, problem: PipelineProblem) -> str:
    """One line: the limit is too small; the least that works; which option would help.

    The chunked schedules (interleaved, zb-v) share LEAST_MEMORY_BUDGET_S for their searches;
    if one of them stops there, the line gives the least limit found to work instead.
    """
    limit = problem.memory_limit_bytes or 0
    budget = MemorySearch(time.perf_counter() + LEAST_MEMORY_BUDGET_S)

    def least(relaxed: PipelineProblem) -> float:
        return min((least_memory(profile, s, size, budget)
                    for s, size in settings_for(profile, relaxed)), default=math.inf)

    need = least(problem)
    if problem.memory_limit_source == "device":
        what = (f"the usable memory of the profiled {profile.device.get('name') or 'GPU'}, {format_bytes(limit)} "
                f"(its memory less the CUDA context and headroom; --memory-limit overrides it),")
    elif problem.memory_limit_source == "host":
        what = (f"this host's share per rank, {format_bytes(limit)} (the profiled host's "
                f"{format_bytes(profile.host_memory_bytes)} less headroom, shared by the ranks on it; --memory-limit "
                f"overrides it),")
    else:
        what = f"--memory-limit {format_bytes(limit)} per device"
    line = (f"no plan fits {what} with these options: the smallest limit "
            f"{'that works' if budget.exact else 'found to work'} is {format_bytes(need, round_up=True)}")
    relaxations = []
    if problem.recompute != "auto":
        relaxations.append(("--recompute auto", {"recompute": "auto"}))
    if problem.schedule not in ("1f1b", "auto"):
        relaxations.append(("--schedule 1f1b", {"schedule": "1f1b", "virtual_stages": "auto"}))
    if problem.micro_batches != "auto":
        relaxations.append(("--micro-batches auto", {"micro_batches": "auto"}))
    sync = problem.sync
    d = sync.data_parallel
    if problem.stages < profile.num_layers:
        more = min(profile.num_layers, problem.stages * 2)
        # As one of d replicas, more stages per replica means more devices: K x d = N.
        flag = f"--stages {more}" if d == 1 else f"--devices {more * d} --stages {more}"
        relaxations.append((flag, {"stages": more}))
    helps = []
    for flag, change in relaxations:
        relaxed_need = least(replace(problem, **change))
        if relaxed_need < need:
            helps.append((relaxed_need, flag))
    if d > 1 and sync.gradient_sync != "fsdp":   # fsdp keeps 1/d of the optimizer state per rank
        sharded_need = least(replace(problem, sync=replace(sync, gradient_sync="fsdp")))
        if sharded_need < need:
            helps.append((sharded_need, "--gradient-sync fsdp"))
    helps.sort()
    fitting = [(n, flag) for n, flag in helps if n <= limit]
    if fitting:
        line += f"; {fitting[0][1]} would make it fit (it needs {format_bytes(fitting[0][0], round_up=True)})"
    elif helps:
        line += f"; {helps[0][1]} would lower it to {format_bytes(helps[0][0], round_up=True)}"
    return line
