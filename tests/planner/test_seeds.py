"""Every search starts from the min-max cut and its neighbours (planner/seeds.py): whatever its
budget, a setting's plan is never slower than the plain min-max partition of F + B, the plan the
usual partitioners (torch's proposed ``partition_model_layers``, PipeDream's, torchgpipe's) stop
at. Written with the search's entry points only (solve_setting, search), as a user reaches them."""

from __future__ import annotations

import random

import pytest

from gpipe_plan.planner.baselines import min_max
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.pipedream import import_pipedream
from gpipe_plan.planner.profile import Profile
from gpipe_plan.planner.search import solve_setting
from gpipe_plan.schedules import chunks_per_stage, problem

from helpers.planner import PIPEDREAM_DIR, make_figures

pytestmark = pytest.mark.filterwarnings("ignore:.*PuLP 4:DeprecationWarning")

SHAPES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1)]


def min_max_step(cm: CostModel) -> float:
    work = [f + b for f, b in zip(cm.figures.forward_s, cm.figures.backward_s)]
    ev = evaluate(cm, min_max(work, cm.C))
    return ev.step_s if ev.fits else float("inf")


@pytest.mark.parametrize("schedule,v", SHAPES)
@pytest.mark.parametrize("seed", range(10))
def test_a_search_out_of_budget_is_no_slower_than_the_min_max_cut(schedule, v, seed):
    """A budget too small to search (a millisecond): the plan is still at least the min-max cut's."""
    rng = random.Random(f"minmax-{schedule}-{seed}")
    K = rng.choice([4, 6, 8])
    L = rng.randint(K * chunks_per_stage(schedule, v) + 4, 60)
    M = rng.choice([m for m in (4, 8, 16) if not problem(schedule, K, m, v)])
    # A few heavy layers among light ones, as in the PipeDream profiles.
    fig = make_figures([rng.choice([1e-5, 1e-5, 4e-4, 2e-3]) for _ in range(L)],
                       [rng.choice([1e-5, 1e-5, 8e-4, 4e-3]) for _ in range(L)],
                       output=[rng.randint(0, 10**6) for _ in range(L)],
                       optimizer=[rng.uniform(0, 1e-4) for _ in range(L)] if rng.random() < 0.5 else None)
    setting = Setting(stages=K, micro_batches=M, schedule=schedule, recompute="never", virtual_stages=v,
                      link_bandwidth_bytes_per_s=rng.choice([float("inf"), 1e9]), overhead_s=rng.choice([0.0, 1e-5]))
    cm = CostModel(fig, setting)
    got = solve_setting(None, setting, 1, "exact", 1e-3, figures=fig, work_budget_s=1e-3)   # type: ignore[arg-type]
    assert got.solution is not None
    assert got.solution.evaluation.step_s <= min_max_step(cm) * (1 + 1e-12)


@pytest.mark.parametrize("schedule,v", SHAPES)
@pytest.mark.parametrize("name", ["gnmt", "vgg16", "alexnet"])
def test_pipedream_plans_are_no_slower_than_the_min_max_cut(schedule, v, name):
    """K = 8, M = 8 on three PipeDream profiles, a tenth of a second: never behind the min-max cut
    (gnmt's 1f1b plan once was, 27.966 ms against 27.436 ms)."""
    batch = {"gnmt": 64}.get(name)
    profile = Profile(import_pipedream(str(PIPEDREAM_DIR / f"{name}.graph.txt"), batch_size=batch), where=name)
    size = profile.sizes[0] // 8
    fig = profile.at(size)
    setting = Setting(stages=8, micro_batches=8, schedule=schedule, recompute="never", virtual_stages=v)
    if problem(schedule, 8, 8, v) or 8 * chunks_per_stage(schedule, v) > fig.num_layers:
        pytest.skip("the schedule cannot run here")
    cm = CostModel(fig, setting)
    got = solve_setting(profile, setting, size, "exact", 0.1, figures=fig, work_budget_s=0.1)
    assert got.solution.evaluation.step_s <= min_max_step(cm) * (1 + 1e-12)
