"""Solving the schedule MILP (planner/milp.py) inside a search: on what, for how long, and what
its answer means.

HiGHS (``highspy``, handed the programme's arrays directly: pulp's HiGHS interface passes no
warm start and fails on a node limit's status) solves it on one thread, warm-started from the
best plan the search has, and stops after a number of branch-and-bound nodes (what its work
budget buys, :func:`nodes_within`) or once its bound reaches a cutoff: a count, unlike the clock,
gives the same plan and bound on every run and machine; the wall-clock limit is only a safety
net. A run is charged its simplex iterations (:func:`iterations_cost_s`), also a count. Without
highspy the programme goes to pulp's CBC (one thread, the same node limit; CBC through pulp
reports no bound when it stops early); without either the planner plans with its branch and
bound alone (:func:`milp.available`).

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
from . import milp
from .budgets import SOLVER_TIME_BUDGET_S
from .costmodel import CostModel
from .milp import _Model, available, build, fixed_cost_s
from .objective import Evaluation, Solution, evaluate, proven_optimal

# A gap HiGHS may close to call its plan optimal: its own tolerances (feasibility 1e-7 on
# rows scaled to a layer's time) make a tighter claim meaningless.
RELATIVE_GAP = 1e-6
# The budget in work: the solver stops after a number of branch-and-bound nodes, charged by the
# programme's size (per thousand variables and constraints, nodes_cost_s) after milp.fixed_cost_s
# for building it and its root. HiGHS's first nodes cost most (it strong-branches until its
# pseudocosts are reliable), the later ones far less, so the first EARLY_NODES are charged
# EARLY_NODE_S_PER_THOUSAND each and the rest NODE_S_PER_THOUSAND: about the CPU time they took
# on the 2-core development VM, so that a budget of 30 s takes about 30 s there, and the node
# limit binds before the wall clock (a safety net at budgets.WALL_SAFETY times the work), so a plan
# does not depend on the machine's speed (figures: docs/benchmarks/milp-charge.md, made by
# ``python -m bench milp-charge``). Charged 10 ms a node throughout (the rule before), a budget
# bought about a fifth of the later nodes it paid for and proved less (docs/benchmarks/exactness.md).
EARLY_NODES = 200
EARLY_NODE_S_PER_THOUSAND = 0.005
NODE_S_PER_THOUSAND = 0.002
# [Note: a MILP is charged what it did]
# The node limit is set before HiGHS runs, from the node charge above; what a run is charged
# after it is its simplex iterations (all of them: the root's, its cut rounds', strong
# branching's, every node's), which HiGHS on one thread counts the same on every run and which
# follow its CPU time more closely than the nodes do: a later node costs 0.8-4.6 ms per thousand
# variables and constraints from one programme to another, an iteration after the root 19-34 us
# (median 28), and CPU / charged came to 0.68-1.71 by the iterations, 0.32-2.01 by the nodes
# (docs/benchmarks/milp-charge.md, each run alone on the machine). Per thousand:
# SOLVE_S_PER_THOUSAND (building, presolve, the root's cut rounds) plus ITERATION_S_PER_THOUSAND
# per iteration, the median. A root that reaches the cutoff at once skips its cut rounds and is
# overcharged (0.7 s charged 2.6 s on a programme of 6,300); some programmes' iterations cost more
# than the median (39 us on nasnetamobile's, K = 4, M = 32, v = 3, whose search took 34 s of its 30).
# A run whose nodes came cheaper than the node charge leaves the rest to the settings after it
# (planner/solvers.py) instead of paying for nodes it was not given; one whose nodes came dearer
# pays for them. CBC through pulp reports no iterations: its runs are charged by the node charge.
SOLVE_S_PER_THOUSAND = 0.3
ITERATION_S_PER_THOUSAND = 28e-6


@dataclass
class MilpResult:
    """What the programme settled: its best cut (None if it found none), a lower bound in
    seconds, whether it proved its cut optimal, whether no cut fits at all, and its work."""

    bounds: tuple[int, ...] | None
    lower_bound_s: float
    proven: bool
    infeasible: bool                 # no cut fits at all
    solver: str
    work_s: float                    # the budget it used, in seconds of work (iterations_cost_s)
    stats: dict


def solve_milp(cm: CostModel, start: Evaluation | None = None, cutoff_s: float = math.inf,
               work_budget_s: float = SOLVER_TIME_BUDGET_S, time_limit_s: float | None = None) -> MilpResult:
    """Solve ``cm``'s programme from the warm start ``start`` within ``work_budget_s`` seconds of
    work (deterministic: the branch-and-bound nodes it buys; charged the iterations done) and
    ``time_limit_s`` of wall time (the safety net; default three times the work budget). ``cutoff_s``: a step achieved elsewhere: the
    search stops once its bound reaches it (no cut of this setting can be better)."""
    started = time.perf_counter()
    model = build(cm)
    built = time.perf_counter() - started
    solver = available()
    if model.pr.unsatisfiable:        # a constant row fails: no cut fits (milp._Programme)
        return MilpResult(None, math.inf, True, True, solver, fixed_cost_s(cm),
                          {**model.stats, "nodes": 0, "build_seconds": round(built, 3)})
    values = {}
    if start is not None:
        values = model.cuts.values(model.cuts.canonical(start.bounds))
        for r, chosen in zip(model.recompute, start.recompute):
            if not isinstance(r, bool):
                values[r] = float(chosen)
    cutoff = cutoff_s / model.unit if math.isfinite(cutoff_s) else math.inf
    wall = max(0.05, 3 * work_budget_s if time_limit_s is None else time_limit_s)
    fixed = fixed_cost_s(cm)
    nodes = nodes_within(model, work_budget_s - fixed)
    if solver == "HiGHS":
        status, lower, cut, stats = _run_highs(model, values, cutoff, nodes, wall)
    else:
        status, lower, cut, stats = _run_cbc(model, values, max(1, nodes), wall)
    if "iterations" in stats:
        work = iterations_cost_s(model, stats["iterations"])
    else:
        work = fixed + nodes_cost_s(model, min(nodes, stats["nodes"]))
    stats = {**model.stats, **stats, "node_limit": nodes, "build_seconds": round(built, 3),
             "seconds": round(time.perf_counter() - started, 3)}
    if status == "infeasible" and not math.isfinite(cutoff):
        return MilpResult(None, math.inf, True, True, solver, work, stats)
    lower_s = lower * model.unit
    if status == "infeasible" or lower >= cutoff:
        # No cut is faster than the cutoff (none at all, or none within the bound HiGHS was given):
        # the setting is settled at it, within HiGHS's tolerance as any proof. That is all it
        # shows: with nodes pruned at the cutoff, HiGHS calls its warm start "optimal" with that
        # start's objective as its bound although a cut between the cutoff and it may exist
        # (minimise x >= 2.5 over the integers from x = 7, cutoff 2: "optimal", x = 7, bound 7).
        stats["reached_cutoff"] = True
        return MilpResult(cut, cutoff_s, False, False, solver, work, stats)
    return MilpResult(cut, lower_s, status == "optimal", False, solver, work, stats)


# [Note: the linear relaxation's bound]
# The programme with its binaries relaxed to [0, 1] lets a cut fall between layers (a layer's
# time split between two chunks), so its optimum bounds every cut's step from below. It is one
# linear programme, a fraction of the MILP's root, which adds presolve, probing, cut rounds and
# strong branching (PipeDream programmes at K = 8, interleaved v = 2: 0.2-0.3 s against 0.7-3.9 s). A
# search asks for it where no MILP will run (the budget cannot build the programme and its
# root: those settings kept the branch and bound's bound, their plans 9.5-41% above it on the
# exactness bench) and where a cutoff may settle the setting at once (a plan another setting
# has is no slower than any cut of this one, whole layers or not) and the MILP would buy few
# nodes (budgets.LOCAL_SEARCH_BELOW_NODES), so that the local search's and the MILP's share go
# to the settings still open. Where the MILP buys thousands its programme is small and its
# root reaches the cutoff cheaply: asked there too, the relaxation's work cost resnext50
# (K = 4, M = 16, interleaved) its proof, v = 4 bounded 1.8% short of the plan. It is charged
# its simplex iterations as the MILP is, with RELAXATION_S_PER_THOUSAND for building and
# passing the programme in place of the MILP's root: the LPs measured took 12-26 us an
# iteration per thousand variables and constraints, under the 28 charged.
RELAXATION_S_PER_THOUSAND = 0.02


def relaxable(cm: CostModel) -> bool:
    """Whether :func:`relaxation_bound` can bound ``cm``'s setting: HiGHS is installed (CBC
    through pulp reports no bound of a relaxation) and the programme applies."""
    return available() == "HiGHS" and milp.applicable(cm)


def relaxation_bound(cm: CostModel, work_budget_s: float, time_limit_s: float) -> tuple[float | None, float]:
    """The least step of ``cm``'s programme with its cuts free to fall between layers (its linear
    relaxation, [Note: the linear relaxation's bound]): no cut of the setting is faster. None where
    HiGHS is not installed, the programme does not apply, or ``work_budget_s`` cannot pay for
    solving it (its simplex iterations are limited to what the budget buys: a count, so the
    answer is the same on every run). Returns the bound in seconds and the work used."""
    if not relaxable(cm):
        return None, 0.0
    thousands = milp.size(cm) / 1000
    if work_budget_s <= thousands * (RELAXATION_S_PER_THOUSAND + ITERATION_S_PER_THOUSAND):
        return None, 0.0
    model = build(cm)
    thousands = _thousands(model)
    built = thousands * RELAXATION_S_PER_THOUSAND
    iterations = int((work_budget_s - built) / (thousands * ITERATION_S_PER_THOUSAND))
    if model.pr.unsatisfiable or iterations < 1:
        # (no cut fits at all: the searches say so with their own words)
        return None, built
    import highspy

    h = _highs(model, {"simplex_iteration_limit": iterations, "time_limit": max(0.05, time_limit_s)},
               relaxed=True)
    h.run()
    info = h.getInfo()
    work = built + thousands * ITERATION_S_PER_THOUSAND * max(0, int(info.simplex_iteration_count))
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None, work
    return info.objective_function_value * (1 - RELATIVE_GAP) * model.unit, work


def _thousands(model: _Model) -> float:
    return (model.stats["variables"] + model.stats["constraints"]) / 1000


def nodes_cost_s(model: _Model, nodes: int) -> float:
    """What ``nodes`` branch-and-bound nodes are charged, in seconds of work: the first
    :data:`EARLY_NODES` at :data:`EARLY_NODE_S_PER_THOUSAND` per thousand variables and
    constraints, the rest at :data:`NODE_S_PER_THOUSAND` (each node re-solves the programme's
    linear relaxation; the first ones also strong-branch)."""
    return _nodes_cost_s(_thousands(model), nodes)


def _nodes_cost_s(thousands: float, nodes: int) -> float:
    early = min(nodes, EARLY_NODES)
    return thousands * (early * EARLY_NODE_S_PER_THOUSAND + (nodes - early) * NODE_S_PER_THOUSAND)


def iterations_cost_s(model: _Model, iterations: int) -> float:
    """What a HiGHS run of ``iterations`` simplex iterations is charged, in seconds of work
    ([Note: a MILP is charged what it did])."""
    return _thousands(model) * (SOLVE_S_PER_THOUSAND + ITERATION_S_PER_THOUSAND * max(0, iterations))


def nodes_within(model: _Model, work_s: float) -> int:
    """The most nodes ``work_s`` seconds of work pay for (:func:`nodes_cost_s`)."""
    return _nodes_within(_thousands(model), work_s)


def nodes_affordable(cm: CostModel, work_s: float) -> int:
    """About how many nodes a MILP of ``cm`` given ``work_s`` seconds of work would get, before
    building it (its size counted, :func:`milp.size`; its set-up and root paid first)."""
    return _nodes_within(milp.size(cm) / 1000, work_s - milp.fixed_cost_s(cm))


def _nodes_within(thousands: float, work_s: float) -> int:
    if work_s <= 0:
        return 0
    early_s = _nodes_cost_s(thousands, EARLY_NODES)
    if work_s < early_s:
        return int(work_s / (thousands * EARLY_NODE_S_PER_THOUSAND))
    return EARLY_NODES + int((work_s - early_s) / (thousands * NODE_S_PER_THOUSAND))


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


# HiGHS on one thread, deterministic; no improvement heuristics at the root (RENS, RINS and the
# feasibility jump took 4x the root's time on the PipeDream programmes, and the search brings its
# own start) and no symmetry detection (it took three quarters of the root's time, and the
# searches were no shorter with it); a gap closed to RELATIVE_GAP.
HIGHS_OPTIONS = {"output_flag": False, "threads": 1, "random_seed": 0, "mip_rel_gap": RELATIVE_GAP,
                 "mip_abs_gap": 0.0, "mip_heuristic_run_rens": False, "mip_heuristic_run_rins": False,
                 "mip_heuristic_run_feasibility_jump": False, "mip_detect_symmetry": False}


def _highs(model: _Model, options: dict, relaxed: bool = False):
    """A HiGHS solver holding ``model``'s programme (``relaxed``: every variable continuous, its
    linear relaxation) with ``options`` set on top of :data:`HIGHS_OPTIONS`."""
    import highspy
    import numpy as np

    _silence_banner()
    pr = model.pr
    h = highspy.Highs()
    for key, value in {**HIGHS_OPTIONS, **options}.items():
        h.setOptionValue(key, value)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(pr.names), len(pr.rows)
    cost = np.zeros(len(pr.names))
    for var, coef in pr.cost.items():
        cost[var] = coef
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.array(pr.low), np.array(pr.high)
    lp.row_lower_ = np.array([row[0] for row in pr.rows])
    lp.row_upper_ = np.array([row[1] for row in pr.rows])
    starts = [0]
    for row in pr.rows:
        starts.append(starts[-1] + len(row[2]))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array([v for row in pr.rows for v in row[2]], dtype=np.int32)
    lp.a_matrix_.value_ = np.array([c for row in pr.rows for c in row[3]])
    if not relaxed:
        kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
        lp.integrality_ = [kinds[b] for b in pr.binary]
    h.passModel(lp)
    return h


def _run_highs(model: _Model, values: dict, cutoff: float, nodes: int, time_limit_s: float):
    """HiGHS (highspy), warm-started from ``values``, at most ``nodes`` branch-and-bound nodes;
    a callback stops it once its bound has reached ``cutoff``. Returns (status, lower bound,
    cut or None, stats)."""
    import highspy
    import numpy as np

    h = _highs(model, {"mip_max_nodes": nodes, "time_limit": time_limit_s})
    if values:
        h.setSolution(len(values), np.array(list(values), dtype=np.int32), np.array(list(values.values())))
    if math.isfinite(cutoff):
        # Nodes whose bound passes the cutoff are pruned as if a plan that fast were known.
        h.setOptionValue("objective_bound", cutoff * (1 + RELATIVE_GAP))

        def interrupt(kind, message, data_out, data_in, user_data):
            if data_out.mip_dual_bound >= cutoff:
                data_in.user_interrupt = True

        h.setCallback(interrupt, None)
        h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
    h.run()
    info, status = h.getInfo(), h.getModelStatus()
    states = highspy.HighsModelStatus
    stats = {"nodes": max(0, int(info.mip_node_count)), "iterations": int(info.simplex_iteration_count)}
    found = info.primal_solution_status == 2
    cut = model.cuts.read(list(h.getSolution().col_value)) if found else None
    if status == states.kInfeasible:
        return "infeasible", math.inf, None, stats
    if status == states.kOptimal:
        # (a programme without binaries is a linear one: its optimum is its bound)
        return "optimal", max(info.mip_dual_bound, info.objective_function_value * (1 - RELATIVE_GAP)), cut, stats
    lower = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else 0.0
    return ("feasible" if found else "none"), lower, cut, stats


def _run_cbc(model: _Model, values: dict, nodes: int, time_limit_s: float):
    """pulp's CBC (one thread, ``nodes`` branch-and-bound nodes at most), warm-started from
    ``values``. CBC through pulp reports no bound when it stops early: then none (0)."""
    import pulp

    from .ilp import _var

    pr = model.pr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        prob = pulp.LpProblem("gpipe_plan_schedule", pulp.LpMinimize)
        columns = [_var(prob, name, low, cat="Binary" if binary else "Continuous")
                   for name, low, binary in zip(pr.names, pr.low, pr.binary)]
        for var, high, binary in zip(columns, pr.high, pr.binary):
            if not binary and math.isfinite(high):
                var.upBound = high
        prob.setObjective(pulp.LpAffineExpression({columns[v]: c for v, c in pr.cost.items()}))
        for i, (lower, upper, index, coefs) in enumerate(pr.rows):
            expr = pulp.LpAffineExpression({columns[v]: c for v, c in zip(index, coefs)})
            if lower == upper:
                prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintEQ, f"r{i}", lower))
                continue
            if math.isfinite(lower):
                prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintGE, f"r{i}", lower))
            if math.isfinite(upper):
                prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintLE, f"s{i}", upper))
        for var, value in values.items():
            columns[var].setInitialValue(value)
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(time_limit_s)), gapRel=RELATIVE_GAP, gapAbs=0,
                                   warmStart=bool(values), threads=1, options=[f"maxNodes {nodes}"])
        status = prob.solve(solver)
    stats = {"nodes": nodes}
    name = pulp.LpStatus[status]
    if name == "Infeasible":
        return "infeasible", math.inf, None, stats
    found = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    cut = model.cuts.read([var.value() or 0.0 for var in columns]) if found else None
    if name == "Optimal" and prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal", pulp.value(prob.objective), cut, stats
    return ("feasible" if found else "none"), 0.0, cut, stats


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
    found = evaluate(cm, result.bounds) if result.bounds is not None else None
    if found is not None and found.fits and (best is None or found.step_s < best.step_s):
        best = found
    if best is None:
        return None
    searched = solution.lower_bound_s if solution else 0.0
    # The programme's proof is the plan's only where its own cut is the plan it priced: a cut
    # that fits (HiGHS lets a row exceed its limit by its tolerance) at the step the programme
    # found (within its gap) on a core each. On shared cores (planner/timeshare.py) it optimises
    # the dedicated step, which bounds every plan's time-shared step from below: a bound there.
    # Unproven, its bound is its open nodes' least, within its tolerance; proven unable to beat
    # the cutoff, the cutoff.
    shared = best.dedicated_step_s is not None
    exact = (result.proven and not shared and found is not None and found.fits
             and found.step_s * (1 - 2 * RELATIVE_GAP) <= result.lower_bound_s)
    if exact:
        programme = best.step_s
    elif result.stats.get("reached_cutoff"):
        programme = min(best.step_s, cutoff_s)
    else:
        programme = min(best.step_s, result.lower_bound_s * (1 - RELATIVE_GAP))
    lower = min(best.step_s, max(searched, programme))
    milp_stats = {"solver": result.solver, "work_s": round(result.work_s, 3), **result.stats}
    return Solution(best, exact or proven_optimal(best.step_s, lower), lower,
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
