"""How a search shares its budget among its settings (planner/budgets.py): each setting's work is
an even share of what the settings before it left, counted from the work each reports
(SettingBudgets), so that the same request gets the same plan on every run; each one's wall
time is an even share of what the clock leaves (share_of_budget); and once a budget is spent,
each setting gets only a moment. A whole search spends its budget about once."""

from __future__ import annotations

import time

import pytest

from gpipe_plan.planner.budgets import LEAST_SETTING_S, SettingBudgets, share_of_budget
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.objective import Solution, evaluate
from gpipe_plan.planner.pipedream import import_pipedream
from gpipe_plan.planner.problem import SolveOptions
from gpipe_plan.planner.profile import Profile
from gpipe_plan.planner.search import Candidate, search

from helpers.planner import PIPEDREAM_DIR, make_figures

SETTING = Setting(2, 4)


def _solved(work_s: float) -> Candidate:
    """A setting solved with ``work_s`` seconds of work, as solvers.search_setting reports it."""
    cm = CostModel(make_figures([1e-3] * 4, [2e-3] * 4), SETTING)
    return Candidate(SETTING, 1, Solution(evaluate(cm, (0, 2, 4)), True, 0.0, "test", {"work_s": work_s}), work_s)


def test_a_setting_that_found_no_plan_counts_its_work_too():
    # (it was skipped: the settings after it got work already spent, 17% over a budget where five
    # of 21 settings found nothing under a memory limit)
    budgets = SettingBudgets(budget_s=10.0, settings=4, started=time.perf_counter())
    budgets.spend(Candidate(SETTING, 1, None, 4.0))
    assert budgets.spent_s == 4.0 and budgets.work_s(3) == pytest.approx(2.0)


def test_each_setting_gets_an_even_share_of_the_work_the_settings_before_it_left():
    budgets = SettingBudgets(budget_s=10.0, settings=4, started=time.perf_counter())
    assert budgets.work_s(4) == 2.5
    budgets.spend(_solved(4.0))                       # more than its share: the others get less
    assert budgets.spent_s == 4.0
    assert budgets.work_s(3) == pytest.approx(2.0)
    budgets.spend(_solved(0.5))                       # less: they get more
    assert budgets.work_s(2) == pytest.approx(2.75)
    budgets.spend(_solved(2.75))
    assert budgets.work_s(1) == pytest.approx(2.75)
    assert budgets.spent_s == pytest.approx(7.25)


def test_the_work_shared_is_the_work_budget_where_one_is_given():
    """replicas.py gives each placement a work budget of its own, the wall-clock budget aside."""
    budgets = SettingBudgets(budget_s=10.0, settings=2, started=time.perf_counter(), work_budget_s=3.0)
    assert budgets.work_s(2) == 1.5
    budgets.spend(_solved(1.0))
    assert budgets.work_s(1) == pytest.approx(2.0)


def test_once_the_work_is_spent_each_setting_gets_the_least():
    """A setting that overran leaves nothing: the ones after it still get a moment (least_s),
    enough to evaluate their seed plan, never a negative budget."""
    budgets = SettingBudgets(budget_s=1.0, settings=3, started=time.perf_counter())
    budgets.spend(_solved(1.5))
    assert budgets.work_s(2) == LEAST_SETTING_S
    ilp = SettingBudgets(budget_s=1.0, settings=3, started=time.perf_counter(), least_s=0.5)
    ilp.spend(_solved(0.9))
    assert ilp.work_s(2) == 0.5


def test_the_wall_time_share_is_what_the_clock_leaves_shared_evenly():
    """Bracketed by the clock read before and after, so that no speed is assumed."""
    started = time.perf_counter() - 2.0               # 2 s of an 8 s budget gone
    budgets = SettingBudgets(budget_s=8.0, settings=3, started=started)
    before = time.perf_counter()
    share = budgets.time_s(3)
    after = time.perf_counter()
    assert (8.0 - (after - started)) / 3 <= share <= (8.0 - (before - started)) / 3
    spent = SettingBudgets(budget_s=8.0, settings=3, started=time.perf_counter() - 9.0)
    assert spent.time_s(3) == LEAST_SETTING_S
    assert share_of_budget(8.0, time.perf_counter() - 9.0, 3, least_s=0.5) == 0.5


def test_a_search_spends_its_budget_once():
    """gnmt on 4 stages, interleaved: 21 settings on half a second of work. The work they report
    in all, tighten's included, stays within the budget plus the moment each setting gets at
    least (budgets.LEAST_SETTING_S); were each setting's share not what the others left, the
    later ones would get the whole budget again (1.8 s in all)."""
    profile = Profile(import_pipedream(str(PIPEDREAM_DIR / "gnmt.graph.txt"), batch_size=64), where="gnmt")
    budget = 0.5
    result = search(profile, SolveOptions(stages=4, schedule="interleaved", global_batch_size=64,
                                          time_budget_s=budget))
    solved = [c for c in result.candidates if c.solution is not None]
    assert len(solved) == len(result.candidates) > 10
    work = [c.solution.stats["work_s"] for c in solved]
    assert all(w > 0 for w in work)
    assert sum(work) <= budget + len(solved) * LEAST_SETTING_S
