"""One setting's search: which exact solvers run, in what order, from which seeds, on what budget.

A setting (M, schedule, v, recomputation) is a cost model; its best cut comes from:

- **GPipe**: the threshold search (planner/gpipe_solver.py), exact and fast.
- **1F1B, interleaved, zb-h1, zb-v**: the branch and bound (planner/onefoneb.py, planner/chunked.py)
  first, on its share of the budget (:func:`budgets.branch_and_bound_share`): it proves the easy
  settings in moments. If it stops with a gap, an iterated local search (planner/local_search.py)
  improves its best plan on its own share (budgets.LOCAL_SEARCH_SHARE; only where the MILP's share
  would buy few nodes, budgets.LOCAL_SEARCH_BELOW_NODES), and the schedule MILP
  (planner/milp.py), warm-started from that plan, gets the rest: it proves what the branch and
  bound cannot (its bound after branching knows where the heavy layers went), or at least lifts
  the bound. Between them, the MILP's linear relaxation (one LP) bounds the setting where no
  MILP will follow (its budget cannot build the programme) or where a plan of another setting
  may already be no slower than every cut of this one and the MILP would buy few nodes
  (milp_solve.relaxation_bound). A branch
  and bound that found no plan before its share ran out hands the setting to
  the MILP all the same (found nothing is not "nothing fits"). Without pulp (the GPU image) or
  for a programme too large to build, the branch and bound gets the budget but the local
  search's share (and the relaxation's, where HiGHS can solve it).
- **pipedream, pipedream-2bw**: no flush, so the step is M times a steady-state period that
  is a min-max over the cuts: one exact dynamic programme (planner/asynchronous.py), whatever
  the solver.
- ``--solver ilp``: the CBC ILP (planner/ilp.py) for GPipe and 1F1B, the MILP alone for the
  chunked schedules.

Every search starts from the same seeds (planner/seeds.py): what the caller found for a related
setting, then the min-max cut and its neighbours.

Budgets: ``time_budget_s`` is wall time (a safety net, stretched to budgets.WALL_SAFETY times the
work budget), ``work_budget_s`` the same in deterministic work (budgets.WORK_PER_SECOND,
milp_solve.iterations_cost_s), which is what ends a search in practice, so that a plan is the
same on every run. The work a search used is in its
``stats["work_s"]``: what it leaves goes to the settings after it (budgets.SettingBudgets), and
what all of them leave to :func:`tighten`, which spends it on the setting that keeps the proof
open, and what no proof can use on the open settings' plans (the local search).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Sequence

from . import milp, milp_solve
from .budgets import (LOCAL_SEARCH_BELOW_NODES, LOCAL_SEARCH_SHARE, RELAXATION_SHARE, WALL_SAFETY,
                      WORK_PER_SECOND, branch_and_bound_share)
from .chunked import ChunkedSolver
from .costmodel import CostModel
from .gpipe_solver import GPipeSolver
from .local_search import LocalSearch, evaluation_cost_s
from .objective import Solution, proven_optimal
from .onefoneb import OneFOneBSolver
from .seeds import seed_cuts


def solve_cost_model(cm: CostModel, solver: str, time_budget_s: float, seeds: Sequence[Sequence[int]] = (),
                     cutoff_s: float = math.inf, work_budget_s: float | None = None,
                     suffix_tables: dict | None = None) -> Solution | None:
    """The best plan of one setting (None: nothing fits), by ``solver`` ("exact" or "ilp"):
    :func:`search_setting`'s plan."""
    return search_setting(cm, solver, time_budget_s, seeds, cutoff_s, work_budget_s, suffix_tables)[0]


def search_setting(cm: CostModel, solver: str, time_budget_s: float, seeds: Sequence[Sequence[int]] = (),
                   cutoff_s: float = math.inf, work_budget_s: float | None = None,
                   suffix_tables: dict | None = None) -> tuple[Solution | None, float]:
    """The best plan of one setting (None: nothing fits), by ``solver`` ("exact" or "ilp"), and
    the deterministic work it used (also in the plan's ``stats["work_s"]``; a search that found
    nothing used work too, which the settings after it must not get again).

    solve (planner/search.py) and explore's cells (planner/explore.py) both come here.
    ``suffix_tables``: 1F1B's suffix bounds, shared by the caller between settings alike but
    for K (planner/onefoneb.py); left alone for the other schedules."""
    started = time.perf_counter()
    work_s = time_budget_s if work_budget_s is None else work_budget_s
    seeds = seed_cuts(cm, seeds)
    if cm.asynchronous:
        # Whatever the solver asked: the asynchronous schedules' period is a min-max over the
        # cuts, which one dynamic programme settles exactly (planner/asynchronous.py).
        from .asynchronous import AsyncSolver

        return _used(AsyncSolver(cm, seeds).solve(), 0.0)
    if solver == "ilp":
        if cm.schedule in ("gpipe", "1f1b"):
            from .ilp import solve_ilp  # pulp loads lazily: the exact path never pays for it

            return _used(solve_ilp(cm, time_limit_s=time_budget_s), 0.0)
        if milp.applicable(cm):
            return _used(milp_solve.solve(cm, seeds, cutoff_s, work_s, time_budget_s), None)
        # (under the CPU-issue bound the programme does not apply: the branch and bound plans it)
    if cm.schedule == "gpipe" and not cm.setting.time_shared:
        return _used(GPipeSolver(cm, time_budget_s=time_budget_s, seeds=seeds).solve(cutoff_s), 0.0)
    # (GPipe on shared cores has no closed form: the 1F1B branch and bound over cuts plays each
    # plan out, work-budgeted as below, so that its plan is the same on every run.)
    # For the work-budgeted searches the wall clock is a safety net: past the setting's share only
    # where the work is far from done (GPipe's search and the ILP keep the clock as their budget).
    time_budget_s = max(time_budget_s, WALL_SAFETY * work_s)
    share = branch_and_bound_share(cm.schedule)
    follow = (milp.available() is not None and milp.applicable(cm)
              and work_s * (1 - share) >= 1.5 * milp.fixed_cost_s(cm))
    relaxable = milp_solve.relaxable(cm)
    share = share if follow else 1.0 - LOCAL_SEARCH_SHARE - (RELAXATION_SHARE if relaxable else 0.0)
    if cm.schedule in ("gpipe", "1f1b"):
        search = OneFOneBSolver(cm, seeds=seeds, time_budget_s=time_budget_s * share, cutoff_s=cutoff_s,
                                work_budget_s=work_s * share,
                                suffix_tables=suffix_tables if cm.schedule == "1f1b" else None)
    else:
        search = ChunkedSolver(cm, seeds=seeds, time_budget_s=time_budget_s * share, cutoff_s=cutoff_s,
                               work_budget_s=work_s * share)
    solution = search.solve()
    used = search.work_done / WORK_PER_SECOND
    if solution is None and follow and search.stopped_early:
        # Found nothing in time, which is not "nothing fits" (a memory limit that one cut in
        # thousands meets): the programme looks at every cut at once.
        wall_left = max(0.05, time_budget_s - (time.perf_counter() - started))
        refined = milp_solve.refine(cm, None, cutoff_s, max(0.0, work_s - used), wall_left)
        return _used(refined, used + _milp_work(refined))
    if solution is None or settled(solution, cutoff_s):
        return _used(solution, used)
    # Few nodes: the MILP (if any) would buy few branch-and-bound nodes, its programme large.
    few_nodes = not follow or milp_solve.nodes_affordable(cm, work_s - used) < LOCAL_SEARCH_BELOW_NODES
    if relaxable and few_nodes and (not follow or math.isfinite(cutoff_s)):
        # The linear relaxation's bound, where no MILP will lift the bound or a cutoff may
        # settle the setting at once ([Note: the linear relaxation's bound]).
        wall_left = max(0.05, time_budget_s - (time.perf_counter() - started))
        solution, more = relax(cm, solution, min(work_s - used, work_s * RELAXATION_SHARE), wall_left)
        used += more
        if settled(solution, cutoff_s):
            return _used(solution, used)
    if few_nodes:
        solution, more = improve(cm, solution, work_s * LOCAL_SEARCH_SHARE)
        used += more
    if not follow or settled(solution, cutoff_s):
        return _used(solution, used)
    wall_left = max(0.05, time_budget_s - (time.perf_counter() - started))
    refined = milp_solve.refine(cm, solution, cutoff_s, max(0.0, work_s - used), wall_left)
    return _used(refined, used + _milp_work(refined))


def improve(cm: CostModel, solution: Solution, work_s: float) -> tuple[Solution, float]:
    """``solution`` with a better plan where the local search finds one within ``work_s``
    seconds of work (its bound stays: it bounds every plan of the setting); and the work used."""
    search = LocalSearch(cm, work_s)
    found = search.run(solution.evaluation)
    # (step_s: the plan it left, from which another search would only retrace its steps)
    stats = {**solution.stats, "local_search": {"evaluations": search.evaluations,
                                                "work_s": round(search.work_s, 3),
                                                "step_s": min(found.step_s, solution.evaluation.step_s)}}
    if found.step_s >= solution.evaluation.step_s:
        return replace(solution, stats=stats), search.work_s
    return replace(solution, evaluation=found, proven=proven_optimal(found.step_s, solution.lower_bound_s),
                   method=f"{solution.method}; iterated local search from its best plan",
                   stats=stats), search.work_s


def relax(cm: CostModel, solution: Solution, work_s: float, time_limit_s: float) -> tuple[Solution, float]:
    """``solution`` with the bound of the programme's linear relaxation where that is higher
    (milp_solve.relaxation_bound, within ``work_s`` seconds of work); and the work used."""
    bound, work = milp_solve.relaxation_bound(cm, work_s, time_limit_s)
    if bound is None:
        return solution, work
    stats = {**solution.stats, "relaxation": {"lower_bound_s": bound, "work_s": round(work, 3)}}
    step = solution.evaluation.step_s
    if bound <= solution.lower_bound_s:
        return replace(solution, stats=stats), work
    lower = min(step, bound)
    return replace(solution, lower_bound_s=lower, proven=proven_optimal(step, lower), stats=stats,
                   method=f"{solution.method}; bounded by the MILP's linear relaxation",
                   bound_by="milp"), work


def settled(solution: Solution | None, cutoff_s: float) -> bool:
    """Whether a search's answer needs no more work: proven optimal, or proven unable to beat
    ``cutoff_s`` (a plan another setting has). None (nothing fits) is not settled: the branch and
    bound cannot tell "nothing fits" from "found nothing in time"."""
    if solution is None:
        return False
    bound = solution.lower_bound_s
    return proven_optimal(solution.evaluation.step_s, bound) or proven_optimal(cutoff_s, bound)


def _milp_work(refined: Solution | None) -> float:
    """The work the MILP of :func:`milp_solve.refine` used (0 where it returned no plan, as
    refine reports none: a programme with no cut that fits, which presolve mostly settles)."""
    return refined.stats["milp"]["work_s"] if refined is not None and "milp" in refined.stats else 0.0


def _used(solution: Solution | None, work_s: float | None) -> tuple[Solution | None, float]:
    """``solution`` with the work it used in ``stats["work_s"]`` (None: the MILP's own count),
    and that work."""
    if work_s is None:
        work_s = solution.stats.get("milp", {}).get("work_s", 0.0) if solution is not None else 0.0
    if solution is not None:
        solution.stats["work_s"] = round(work_s, 6)
    return solution, work_s


def tighten(candidates: Sequence, cost_model, cutoff_s: float, work_budget_s: float,
            time_budget_s: float) -> float:
    """Spend what is left of a budget where it proves most; returns the work it used.

    The plan is proven optimal once every setting is settled (:func:`settled`): proven optimal,
    or proven unable to beat the best plan found. The least lower bound among the unsettled
    settings is the one that keeps the proof open, so that setting gets the MILP, warm-started
    from its best plan, with all the work left; then the next, until all are settled or the work
    is spent. A setting is tried again only when more work is left than its MILP last had: HiGHS
    starts over each time, so a retry pays for its first nodes again and proves more only with
    the nodes beyond them (when it needed twice as much, inception_v3 at K = 8, M = 32 stopped
    with 15 s of its 30 s budget unspent). What no MILP run can use then goes to the local search
    of the open settings' plans ([Note: what no proof can use]). ``candidates``: search.Candidate,
    updated in place; ``cost_model(candidate)``: its CostModel.
    """
    started = time.perf_counter()
    best = min([cutoff_s, *(c.step_s for c in candidates)])
    spent = 0.0
    tried: set[int] = set()
    wall_limit = max(time_budget_s, WALL_SAFETY * work_budget_s)
    while True:
        left = work_budget_s - spent
        wall = wall_limit - (time.perf_counter() - started)
        open_ = [c for c in candidates if c.solution is not None and id(c) not in tried
                 and not settled(c.solution, best)]
        if not open_ or left <= 0 or wall <= 0 or milp.available() is None:
            break
        weakest = min(open_, key=lambda c: c.lower_bound_s)
        tried.add(id(weakest))
        cm = cost_model(weakest)
        before = weakest.solution.stats.get("milp", {}).get("work_s", 0.0)
        if left < 1.5 * milp.fixed_cost_s(cm) or left <= before or not milp.applicable(cm):
            continue
        refined = milp_solve.refine(cm, weakest.solution, best, left, wall)
        if refined is None:
            continue
        spent += refined.stats["milp"]["work_s"]
        refined.stats["work_s"] = weakest.solution.stats.get("work_s", 0.0) + refined.stats["milp"]["work_s"]
        weakest.solution = refined
        weakest.work_s += refined.stats["milp"]["work_s"]
        best = min(best, refined.evaluation.step_s)
    return spent + _polish(candidates, cost_model, best, work_budget_s - spent,
                           wall_limit - (time.perf_counter() - started))


# [Note: what no proof can use]
# What tighten cannot spend on a MILP run (a retry would start HiGHS over and pay again for the
# nodes its last run had, so it is made only with more work than that) was left unspent: up to a
# third of the budget where the proofs stay open (docs/planner.md, "Where the search stops"). A
# plan is still worth finding there: the iterated local search from the open settings' plans,
# the fastest first, spends it (planner/local_search.py; seeded and counted in evaluations, so
# the plan is the same on every run). It proves nothing, but a faster plan is the user's, and it
# is the cutoff that may settle other settings.
def _polish(candidates: Sequence, cost_model, best: float, work_s: float, wall_s: float) -> float:
    """Spend ``work_s`` on the local search of the open settings' plans, the fastest plan first
    ([Note: what no proof can use]); returns the work used. A plan the local search already
    left is skipped: from it, the search would retrace its own steps."""
    started = time.perf_counter()
    spent = 0.0
    for c in sorted((c for c in candidates if c.solution is not None), key=lambda c: c.step_s):
        left = work_s - spent
        if left <= 0 or time.perf_counter() - started >= wall_s:
            break
        if settled(c.solution, best) or c.solution.stats.get("local_search", {}).get("step_s") == c.step_s:
            continue
        cm = cost_model(c)
        if cm.asynchronous or left < evaluation_cost_s(cm):
            continue
        polished, used = improve(cm, c.solution, left)
        polished.stats["work_s"] = c.solution.stats.get("work_s", 0.0) + used
        c.solution = polished
        c.work_s += used
        spent += used
        best = min(best, polished.evaluation.step_s)
    return spent
