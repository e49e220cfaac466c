"""The iterated local search over the cuts (planner/local_search.py) and where a search uses it
(planner/solvers.py): its moves, never a worse plan, within its budget, the same plan on every
run, and better plans for the MILP to start from."""

from __future__ import annotations

import random

import pytest

from gpipe_plan.planner import local_search, milp, milp_solve
from gpipe_plan.planner.brute import brute_force, partitions
from gpipe_plan.planner.budgets import LOCAL_SEARCH_BELOW_NODES, WORK_PER_SECOND, branch_and_bound_share
from gpipe_plan.planner.chunked import ChunkedSolver
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.local_search import LocalSearch, evaluation_cost_s, moves
from gpipe_plan.planner.objective import Solution, evaluate, proven_optimal
from gpipe_plan.planner.solvers import improve, solve_cost_model

from helpers.planner import make_figures, schedule_case


def test_a_move_shifts_a_run_of_cuts_and_every_such_shift_is_a_move():
    """Each move shifts cuts i..j by the step (one layer passes from chunk i - 1 to chunk j or
    back, the chunks between keep their sizes); every such shift that leaves no chunk empty is one."""
    L, C = 9, 4
    for bounds in partitions(L, C):
        for step in (1, 2):
            got = set(moves(bounds, step))
            assert len(got) == len(moves(bounds, step))          # no move twice
            want = set()
            for i in range(1, C):
                for j in range(i, C):
                    for d in (-step, step):
                        b = list(bounds)
                        for t in range(i, j + 1):
                            b[t] += d
                        if all(x < y for x, y in zip(b, b[1:])):
                            want.add(tuple(b))
            assert got == want
            for b in got:
                sizes = [y - x for x, y in zip(b, b[1:])]
                before = [y - x for x, y in zip(bounds, bounds[1:])]
                changed = [c for c in range(C) if sizes[c] != before[c]]
                assert len(changed) == 2 and sum(sizes) == L      # two chunks trade layers, no more


def _layered(seed: int, schedule: str = "interleaved", v: int = 2, K: int = 3, M: int = 6, L: int = 24):
    rng = random.Random(seed)
    fig = make_figures([rng.uniform(1e-4, 2e-3) for _ in range(L)], [rng.uniform(2e-4, 4e-3) for _ in range(L)])
    return CostModel(fig, Setting(K, M, schedule, "never", virtual_stages=v))


def _worst_start(cm: CostModel):
    """A poor plan: every chunk one layer but the last, which holds the rest."""
    return evaluate(cm, (*range(cm.C), cm.L))


@pytest.mark.parametrize("schedule,v", [("interleaved", 2), ("interleaved", 3), ("zb-v", 1), ("1f1b", 1)])
def test_the_search_improves_a_poor_plan_within_its_budget_and_the_same_way_twice(schedule, v):
    cm = _layered(7, schedule, v)
    start = _worst_start(cm)
    work_s = 400 * evaluation_cost_s(cm)
    first, second = LocalSearch(cm, work_s), LocalSearch(cm, work_s)
    a, b = first.run(start), second.run(start)
    assert a.bounds == b.bounds and first.evaluations == second.evaluations
    assert a.step_s < 0.8 * start.step_s
    assert first.evaluations <= 400 and first.work_s <= work_s * (1 + 1e-12)


def test_a_descent_ends_at_a_local_optimum_and_the_kicks_get_past_it():
    """The test above cannot tell the two halves apart (either alone gets 20% faster than the
    poor plan), so each is checked here: the descent stops only where no move is better (its
    budget ample), and on this instance it stops at a local optimum that the kicks leave for a
    plan 8% faster."""
    cm = _layered(7)
    start = _worst_start(cm)
    descent = LocalSearch(cm, 1e6).descend(start)
    assert local_search._better(descent, start)
    assert not any(local_search._better(evaluate(cm, bounds), descent) for bounds in moves(descent.bounds))
    best = LocalSearch(cm, 1e6).run(start)
    assert local_search._better(best, descent)


@pytest.mark.parametrize("seed", range(12))
def test_the_search_never_returns_a_worse_plan_nor_one_that_does_not_fit(seed):
    """Small random instances with every feature (memory limits, links, recomputation): from
    any start, the plan it returns fits whenever the start did, and is no slower."""
    rng = random.Random(f"local-{seed}")
    schedule, v = rng.choice([("interleaved", 2), ("zb-v", 1), ("zb-h1", 1), ("1f1b", 1)])
    fig, setting = schedule_case(rng, schedule, v)
    cm = CostModel(fig, setting)
    best = brute_force(cm)
    for bounds in list(partitions(cm.L, cm.C))[:5]:
        start = evaluate(cm, bounds)
        got = LocalSearch(cm, 200 * evaluation_cost_s(cm)).run(start)
        if start.fits:
            assert got.fits and got.step_s <= start.step_s
        if got.fits:
            assert best is not None and got.step_s >= best.step_s * (1 - 1e-12)


def test_without_budget_it_returns_its_start():
    cm = _layered(3)
    start = _worst_start(cm)
    search = LocalSearch(cm, 0.0)
    assert search.run(start) is start and search.evaluations == 0


def test_kicks_that_find_nothing_end_the_search_before_its_budget(monkeypatch):
    monkeypatch.setattr(local_search, "STALL_KICKS", 3)
    cm = _layered(5, K=2, M=4, L=6)
    search = LocalSearch(cm, 1e6)
    search.run(_worst_start(cm))
    assert 0 < search.evaluations < search.budget


def test_a_setting_left_open_gets_the_local_search_and_keeps_its_bound():
    """improve: a better plan from a poor one, the bound (of every plan of the setting) kept,
    the work counted, and proven only where that bound reaches the better plan: not with the
    branch and bound's root bound (a true one, well below), yes with a bound at the plan found.
    A search whose branch and bound stops open records the local search; where that finds a
    better plan (a budget of 0.2 s), the plan is still called proven only as its bound says."""
    cm = _layered(11)
    start = _worst_start(cm)
    root = ChunkedSolver(cm).bound((0,), [None] * cm.K)        # no cut decided: below every plan
    open_ = Solution(start, False, root, "branch and bound", {"nodes": 1})
    better, work_s = improve(cm, open_, 300 * evaluation_cost_s(cm))
    assert better.evaluation.step_s < start.step_s and better.lower_bound_s == root
    assert root < better.evaluation.step_s and not better.proven
    assert better.stats["local_search"]["evaluations"] > 0 and work_s > 0
    assert "local search" in better.method and better.stats["nodes"] == 1
    at_bound, _ = improve(cm, Solution(start, False, better.evaluation.step_s, "branch and bound", {}),
                          300 * evaluation_cost_s(cm))
    assert at_bound.evaluation.step_s == better.evaluation.step_s and at_bound.proven
    for budget in (0.02, 0.2):
        found = solve_cost_model(cm, "exact", time_budget_s=budget, seeds=[start.bounds], work_budget_s=budget)
        assert found is not None and "local_search" in found.stats
        assert found.stats["work_s"] >= found.stats["local_search"]["work_s"]
        assert found.proven == proven_optimal(found.evaluation.step_s, found.lower_bound_s)
        assert found.lower_bound_s <= found.evaluation.step_s
    assert "local search" in found.method and not found.proven      # (0.2 s: a better plan, still open)


def test_the_local_search_runs_only_where_the_milp_would_buy_few_nodes():
    """Where the MILP's share buys many nodes HiGHS finds the good plans itself, and the local
    search would only take work from its proof (budgets.LOCAL_SEARCH_BELOW_NODES).
    milp_solve.nodes_affordable estimates those nodes before the programme is built: what
    nodes_within gives for the built one (its size counted, milp.size, within 2% of the built
    programme's, which moves the nodes up to about twice as much). The rule, at its real
    threshold: a budget whose MILP share buys fewer nodes gets the local search, one whose
    share buys more does not (budgets 30% either side of the one whose share buys the
    threshold), and the MILP follows both."""
    if milp.available() is None:
        pytest.skip("no MILP solver here: the local search always runs")
    cm = _layered(13)
    model = milp.build(cm)
    built = model.stats["variables"] + model.stats["constraints"]
    assert milp.size(cm) == pytest.approx(built, rel=0.02)
    for work_s in (0.5, 1.0, 3.0, 30.0):
        want = milp_solve.nodes_within(model, work_s - milp.fixed_cost_s(cm))
        assert want > 0 and milp_solve.nodes_affordable(cm, work_s) == pytest.approx(want, rel=0.05)
    threshold_s = ((milp.fixed_cost_s(cm) + milp_solve.nodes_cost_s(model, LOCAL_SEARCH_BELOW_NODES))
                   / (1 - branch_and_bound_share(cm.schedule)))
    seeds = [_worst_start(cm).bounds]
    for budget, below in ((threshold_s / 1.3, True), (threshold_s * 1.3, False)):
        found = solve_cost_model(cm, "exact", time_budget_s=budget, seeds=seeds, work_budget_s=budget)
        used = found.stats["work"] / WORK_PER_SECOND                   # the branch and bound's
        nodes = milp_solve.nodes_within(model, budget - used - milp.fixed_cost_s(cm))
        assert (nodes < LOCAL_SEARCH_BELOW_NODES) == below               # (the budget is on that side)
        assert ("local_search" in found.stats) == below and "milp" in found.stats
