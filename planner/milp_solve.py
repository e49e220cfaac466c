"""Solving the schedule MILP (planner/milp.py) inside a search: on what, for how long, and what
its answer means.

HiGHS (``highspy``) solves it through pulp on one thread, warm-started from the best plan the
search has (pulp passes no start to HiGHS: :func:`_run_highs` gives it), and stops after a
number of simplex iterations (:data:`WORK_PER_SECOND`, scaled by the programme's size, per
second of budget) or once its bound reaches a cutoff: a count, unlike the clock, gives the same
plan and bound on every run and machine; the wall-clock limit is only a safety net. Without
highspy the programme goes to pulp's CBC (one thread, a node limit; CBC through pulp reports no
bound when it stops early); without pulp the planner plans with its branch and bound alone
(:func:`milp.available`).

The answer is read back as a cut and evaluated by the cost model (:func:`objective.evaluate`),
so a plan's step is the simulator's to the last bit; the lower bound is HiGHS's (the least bound
of its open nodes, less :data:`RELATIVE_GAP` for its tolerances), and "proven" means HiGHS
closed the gap to :data:`RELATIVE_GAP`.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

from ..artifacts import BadInput
from .budgets import SOLVER_TIME_BUDGET_S
from .costmodel import CostModel
from .milp import _Model, available, build, fixed_cost_s
from .objective import Evaluation, Solution, evaluate, proven_optimal

# A gap HiGHS may close to call its plan optimal: its own tolerances (feasibility 1e-7 on
# rows scaled to a layer's time) make a tighter claim meaningless.
RELATIVE_GAP = 1e-6
# The budget in work: WORK_PER_SECOND units per second of budget, a unit being one simplex
# iteration on a thousand rows and columns (solve_milp). On the 2-core development VM, loaded,
# HiGHS did 20,000-50,000 such units a second on the PipeDream programmes: the work limit binds
# well before the wall clock, so a plan does not depend on the machine's speed.
WORK_PER_SECOND = 10000
# CBC's budget in branch-and-bound nodes per second of budget, for the same reason.
CBC_NODES_PER_SECOND = 20


@dataclass
class MilpResult:
    """What the programme settled: its best cut (None if it found none), a lower bound in
    seconds, whether it proved its cut optimal, whether no cut fits at all, and its work."""

    bounds: tuple[int, ...] | None
    lower_bound_s: float
    proven: bool
    infeasible: bool
    solver: str
    work_s: float                    # the budget it used, in seconds of work (WORK_PER_SECOND)
    stats: dict


def solve_milp(cm: CostModel, start: Evaluation | None = None, cutoff_s: float = math.inf,
               work_budget_s: float = SOLVER_TIME_BUDGET_S, time_limit_s: float | None = None) -> MilpResult:
    """Solve ``cm``'s programme from the warm start ``start`` within ``work_budget_s`` seconds of
    work (deterministic) and ``time_limit_s`` of wall time (the safety net; default three times
    the work budget). ``cutoff_s``: a step achieved elsewhere: the search stops once its bound
    reaches it (no cut of this setting can be better)."""
    started = time.perf_counter()
    fixed = fixed_cost_s(cm)
    work_budget_s = max(0.0, work_budget_s - fixed)
    model = build(cm)
    built = time.perf_counter() - started
    solver = available()
    values = {}
    if start is not None:
        values = model.cuts.values(start.bounds)
        for r, chosen in zip(model.recompute, start.recompute):
            if not isinstance(r, bool):
                values[r] = float(chosen)
    cutoff = cutoff_s / model.unit if math.isfinite(cutoff_s) else math.inf
    wall = 3 * work_budget_s if time_limit_s is None else time_limit_s
    # One unit of work: a simplex iteration on a thousand rows and columns (an iteration costs
    # about in proportion to the programme's size).
    size = (model.stats["variables"] + model.stats["constraints"]) / 1000
    units = max(1.0, work_budget_s * WORK_PER_SECOND)
    if solver == "HiGHS":
        status, lower, stats = _run_highs(model, values, cutoff, max(1, int(units / size)), max(0.05, wall))
        work = fixed + stats["iterations"] * size / WORK_PER_SECOND
    else:
        nodes = max(1, int(work_budget_s * CBC_NODES_PER_SECOND))
        status, lower, stats = _run_cbc(model, values, nodes, max(1.0, wall))
        work = fixed + work_budget_s       # (CBC through pulp does not say how much it did)
    stats = {**model.stats, **stats, "build_seconds": round(built, 3),
             "seconds": round(time.perf_counter() - started, 3)}
    if status == "infeasible":
        return MilpResult(None, math.inf, True, True, solver, work, stats)
    bounds = model.cuts.read() if status in ("optimal", "feasible") else None
    return MilpResult(bounds, lower * model.unit, status == "optimal", False, solver, work, stats)


_banner_silenced = False


def _silence_banner() -> None:
    """HiGHS prints its banner on stdout when the process makes its first solver, past Python's
    sys.stdout: make that first one with the descriptor pointed at /dev/null (a plan's output is
    the planner's own)."""
    global _banner_silenced
    if _banner_silenced:
        return
    import os
    import sys

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _banner_silenced = True


def _run_highs(model: _Model, values: dict, cutoff: float, iterations: int, time_limit_s: float):
    """HiGHS through pulp on one thread, warm-started from ``values``; a callback stops it once
    it has run ``iterations`` simplex iterations or its bound has reached ``cutoff``."""
    import highspy
    import numpy as np
    import pulp

    _silence_banner()

    def interrupt(kind, message, data_out, data_in, user_data):
        if data_out.simplex_iteration_count >= iterations or data_out.mip_dual_bound >= cutoff:
            data_in.user_interrupt = True

    class WarmStarted(pulp.HiGHS):
        """pulp's HiGHS, given the start before it runs (pulp passes none to HiGHS)."""

        def callSolver(self, lp):
            if values:
                h = lp.solverModel
                index = np.array([v.index for v in values], dtype=np.int32)
                h.setSolution(len(index), index, np.array(list(values.values()), dtype=np.float64))
            lp.solverModel.run()

    solver = WarmStarted(msg=False, threads=1, timeLimit=time_limit_s, gapRel=RELATIVE_GAP, gapAbs=0.0,
                         callbackTuple=(interrupt, None),
                         callbacksToActivate=[highspy.cb.HighsCallbackType.kCallbackMipInterrupt],
                         random_seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model.pr.prob.solve(solver)
    h = model.pr.prob.solverModel
    info = h.getInfo()
    status = h.getModelStatus()
    states = highspy.HighsModelStatus
    stats = {"iterations": int(info.simplex_iteration_count), "nodes": max(0, int(info.mip_node_count))}
    if status == states.kInfeasible:
        return "infeasible", math.inf, stats
    if status == states.kOptimal:
        # (a programme without binaries is a linear one: its optimum is its bound)
        return "optimal", max(info.mip_dual_bound, info.objective_function_value * (1 - RELATIVE_GAP)), stats
    lower = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else 0.0
    return ("feasible" if info.primal_solution_status == 2 else "none"), lower, stats


def _run_cbc(model: _Model, values: dict, nodes: int, time_limit_s: float):
    """pulp's CBC (one thread, ``nodes`` branch-and-bound nodes at most). CBC through pulp
    reports no bound when it stops early: its lower bound is then none (0)."""
    import pulp

    for var, value in values.items():
        var.setInitialValue(value)
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(time_limit_s)), gapRel=RELATIVE_GAP, gapAbs=0,
                               warmStart=bool(values), threads=1, options=[f"maxNodes {nodes}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        status = model.pr.prob.solve(solver)
    name = pulp.LpStatus[status]
    if name == "Infeasible":
        return "infeasible", math.inf, {}
    if name == "Optimal" and model.pr.prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal", pulp.value(model.pr.prob.objective), {}
    found = model.pr.prob.sol_status == pulp.LpSolutionIntegerFeasible
    return ("feasible" if found else "none"), 0.0, {}


# --------------------------------------------------------------------------- in a search
def refine(cm: CostModel, solution: Solution | None, cutoff_s: float = math.inf,
           work_budget_s: float = SOLVER_TIME_BUDGET_S, time_limit_s: float | None = None) -> Solution | None:
    """``solution`` (a branch and bound's, or None when it found no plan) improved by the
    programme warm-started from it: the better plan, the higher lower bound, and the method
    that gave it. ``cutoff_s``: as :func:`solve_milp`."""
    result = solve_milp(cm, solution.evaluation if solution else None, cutoff_s, work_budget_s, time_limit_s)
    if result.infeasible:
        # No cut fits (a plan the search found fits only within the programme's tolerance: keep it).
        return solution
    best = solution.evaluation if solution else None
    if result.bounds is not None:
        ev = evaluate(cm, result.bounds)
        if ev.fits and (best is None or ev.step_s < best.step_s):
            best = ev
    if best is None:
        return None
    searched = solution.lower_bound_s if solution else 0.0
    # Unproven, the programme's bound is its open nodes' least, within its tolerance.
    programme = best.step_s if result.proven else result.lower_bound_s * (1 - RELATIVE_GAP)
    lower = min(best.step_s, max(searched, programme))
    milp_stats = {"solver": result.solver, "work_s": round(result.work_s, 3), **result.stats}
    return Solution(best, result.proven or proven_optimal(best.step_s, lower), lower,
                    (f"{solution.method}; " if solution and solution.method else "")
                    + f"MILP over the cuts ({result.solver}), warm-started from the best plan found",
                    {**(solution.stats if solution else {}), "milp": milp_stats},
                    bound_by="milp" if programme >= searched else solution.bound_by)


def solve(cm: CostModel, seeds: Sequence[Sequence[int]] = (), cutoff_s: float = math.inf,
          work_budget_s: float = SOLVER_TIME_BUDGET_S, time_limit_s: float | None = None) -> Solution | None:
    """The programme alone (``--solver ilp`` for the chunked schedules), warm-started from the
    best of ``seeds`` that fits."""
    if available() is None:
        raise BadInput("--solver ilp needs the pulp package, which is not installed here: pip install pulp, "
                       "or use --solver exact")
    start = None
    for bounds in seeds:
        ev = evaluate(cm, bounds)
        if ev.fits and (start is None or ev.step_s < start.step_s):
            start = ev
    seeded = Solution(start, False, 0.0, "", {}, bound_by="milp") if start else None
    return refine(cm, seeded, cutoff_s, work_budget_s, time_limit_s)
