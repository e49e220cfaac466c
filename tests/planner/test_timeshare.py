"""More ranks than cores (planner/timeshare.py): the step played out on shared cores, what
the solvers make of it, and what a plan and a profile say about it."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from gpipe_plan.plan_view import view_of
from gpipe_plan.planner.brute import brute_force
from gpipe_plan.planner.chunked import ChunkedSolver
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.gpipe_solver import GPipeSolver
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.onefoneb import OneFOneBSolver
from gpipe_plan.planner.render import plan_timeline
from gpipe_plan.planner.simulator import ChunkTimes, simulate_plan
from gpipe_plan.planner.timeshare import concurrent_ranks_of, time_shared_makespan
from gpipe_plan.schedules import chunks_per_stage, problem

from helpers.planner import cli, hyp, instances, make_figures, profile_doc
from helpers.planner import CHUNKED, random_case

SHAPES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("zb-v", 1)]


def random_chunks(rng: random.Random, schedule: str, K: int, v: int) -> list[ChunkTimes]:
    return [ChunkTimes(rng.uniform(0, 3), rng.uniform(0, 5), rng.uniform(0, 3), rng.uniform(0, 2),
                       rng.choice([0.0, rng.uniform(0, 1)])) for _ in range(K * chunks_per_stage(schedule, v))]


def cases():
    rng = random.Random("timeshare")
    for schedule, v in SHAPES:
        for K in (2, 3, 4):
            for M in (1, 2, 3, 4, 8):
                if not problem(schedule, K, M, v):
                    yield schedule, K, M, v, random_chunks(rng, schedule, K, v)


def test_with_cores_for_every_rank_it_is_the_dedicated_simulator() -> None:
    for schedule, K, M, v, chunks in cases():
        dedicated = simulate_plan(schedule, K, M, v, chunks).makespan_s
        for enough in (K, K + 0.5, 64):
            shared, _ = time_shared_makespan(schedule, K, M, v, chunks, enough)
            assert shared == pytest.approx(dedicated, rel=1e-12, abs=1e-12), (schedule, K, M, enough)


def test_shared_cores_slow_a_step_down_within_what_sharing_can_do() -> None:
    """Never below the dedicated step, nor below the work the cores must do; never above the
    dedicated step with every action stretched by K / n (the slowest any rank ever runs)."""
    for schedule, K, M, v, chunks in cases():
        split = schedule in ("zb-h1", "zb-v")
        work = M * sum(c.forward_s + (c.backward_input_s + c.backward_weight_s if split else c.backward_s)
                       for c in chunks)
        dedicated = simulate_plan(schedule, K, M, v, chunks).makespan_s
        for n in (1, 1.5, 2, K - 0.5):
            shared, _ = time_shared_makespan(schedule, K, M, v, chunks, n)
            stretch = K / n
            slowest = simulate_plan(schedule, K, M, v, [ChunkTimes(c.forward_s * stretch, c.backward_s * stretch,
                                                                   c.backward_input_s * stretch,
                                                                   c.backward_weight_s * stretch, c.send_s)
                                                        for c in chunks]).makespan_s
            assert dedicated * (1 - 1e-12) <= shared <= slowest * (1 + 1e-12), (schedule, K, M, n)
            assert shared >= work / n * (1 - 1e-12), (schedule, K, M, n)


def test_two_ranks_on_one_core_take_turns_as_worked_out_by_hand() -> None:
    # GPipe, 2 stages, M = 2, every action 1 s, one core: F0(0) alone [0, 1]; F0(1) and F1(0)
    # share the core [1, 3]; F1(1) alone [3, 4]; B1(0) alone [4, 5]; B1(1) and B0(0) share [5, 7];
    # B0(1) alone [7, 8]. A core each: the closed form's 1 + 1 + 1 + 1 + 1 + 1 = 6.
    chunks = [ChunkTimes(1.0, 1.0, 0.5, 0.5, 0.0)] * 2
    shared, events = time_shared_makespan("gpipe", 2, 2, 1, chunks, 1, record=True)
    assert shared == pytest.approx(8.0) and simulate_plan("gpipe", 2, 2, 1, chunks).makespan_s == pytest.approx(6.0)
    spans = sorted((e.stage, e.kind, e.micro_batch, round(e.start_s, 9), round(e.end_s, 9)) for e in events)
    assert spans == [(0, "backward", 0, 5.0, 7.0), (0, "backward", 1, 7.0, 8.0), (0, "forward", 0, 0.0, 1.0),
                     (0, "forward", 1, 1.0, 3.0), (1, "backward", 0, 4.0, 5.0), (1, "backward", 1, 5.0, 7.0),
                     (1, "forward", 0, 1.0, 3.0), (1, "forward", 1, 3.0, 4.0)]


def test_the_ranks_a_host_runs_at_once() -> None:
    assert concurrent_ranks_of(2, 1, 4, 4) == 2            # 4 ranks, 2 cores
    assert concurrent_ranks_of(2, 1, 2, 2) == math.inf     # a core each
    assert concurrent_ranks_of(8, 2, 8, 4) == 2            # 2 replicas of 4 stages, 2 threads each, 8 cores
    assert concurrent_ranks_of(3, 1, 4, 4) == 3
    assert concurrent_ranks_of(None, 1, 4, 4) == math.inf  # not recorded: a core each, as before


# ------------------------------------------------------------------ the solvers stay exact
def time_shared(setting, rng: random.Random):
    return replace(setting, concurrent_ranks=rng.choice([1, 1.5, setting.stages - 0.5]))


@pytest.mark.parametrize("schedule,v", CHUNKED)
@pytest.mark.parametrize("seed", range(8))
def test_the_chunked_search_equals_brute_force_on_shared_cores(schedule, v, seed) -> None:
    rng = random.Random(f"shared-{schedule}-{seed}")
    fig, setting = random_case(rng, schedule, v)
    cm = CostModel(fig, time_shared(setting, rng))
    want = brute_force(cm)
    got = ChunkedSolver(cm, time_budget_s=60).solve()
    if want is None:
        assert got is None
        return
    assert got is not None and got.proven and got.evaluation.fits
    assert got.evaluation.step_s == pytest.approx(want.step_s, rel=1e-12, abs=1e-15)


@hyp(60)
@given(instances(schedule="1f1b", max_stages=3, max_layers=7), st.sampled_from([1.0, 1.5, 2.5]))
def test_1f1b_equals_brute_force_on_shared_cores(instance, concurrent) -> None:
    fig, setting = instance
    cm = CostModel(fig, replace(setting, concurrent_ranks=concurrent))
    want = brute_force(cm)
    got = OneFOneBSolver(cm, time_budget_s=60).solve()
    assert (got is None) == (want is None)
    if want is not None:
        assert got.proven and got.evaluation.step_s == pytest.approx(want.step_s, rel=1e-12, abs=1e-15)


@hyp(60)
@given(instances(schedule="gpipe", max_stages=3, max_layers=7), st.sampled_from([1.0, 1.5, 2.5]))
def test_gpipe_equals_brute_force_on_shared_cores(instance, concurrent) -> None:
    """The DP's closed form does not hold on shared cores: it hands over to the branch and bound."""
    fig, setting = instance
    cm = CostModel(fig, replace(setting, concurrent_ranks=concurrent))
    want = brute_force(cm)
    got = GPipeSolver(cm, time_budget_s=60).solve()
    assert (got is None) == (want is None)
    if want is not None:
        assert got.proven and got.evaluation.step_s == pytest.approx(want.step_s, rel=1e-12, abs=1e-15)
        if setting.stages > concurrent:
            assert got.evaluation.dedicated_step_s <= got.evaluation.step_s * (1 + 1e-12)


def test_the_dedicated_optimum_is_not_always_the_time_shared_one() -> None:
    """Why the DP hands over: among 300 plain GPipe instances (2-3 stages, 2-8 micro-batches, one
    core or one and a half) its own optimum loses to another cut on shared cores in some."""
    lost = 0
    for seed in range(300):
        rng = random.Random(seed)
        L, K, M = rng.randint(3, 7), rng.randint(2, 3), rng.randint(2, 8)
        fig = make_figures([rng.uniform(0, 3e-3) for _ in range(L)], [rng.uniform(0, 5e-3) for _ in range(L)])
        cm = CostModel(fig, Setting(stages=K, micro_batches=M, schedule="gpipe",
                                    concurrent_ranks=rng.choice([1, 1.5])))
        want = brute_force(cm)
        got = GPipeSolver(cm).solve()
        assert got.proven and got.evaluation.step_s == pytest.approx(want.step_s, rel=1e-12), seed
        dedicated = GPipeSolver(CostModel(fig, replace(cm.setting, concurrent_ranks=math.inf))).solve()
        lost += evaluate(cm, dedicated.evaluation.bounds).step_s > want.step_s * (1 + 1e-9)
    assert lost > 0


# ------------------------------------------------------------------ plans and profiles
def _cpu_profile(cores: int | None) -> dict:
    device = {"type": "cpu", "name": "synthetic", "threads": 1, **({"cores": cores} if cores else {})}
    return profile_doc(L=8, batch_size=8, version=9, device=device,
                       contention={"processes": 2, "slowdown": 1.2})


def test_a_plan_of_more_ranks_than_cores_is_played_out_on_them_and_says_so(user_dir: Path) -> None:
    Path("two-cores.json").write_text(json.dumps(_cpu_profile(2)))
    Path("unknown.json").write_text(json.dumps(_cpu_profile(None)))
    for args, name in ((("-k", "4"), "four"), (("-k", "2"), "two"), (("-k", "4", "--schedule", "gpipe", "-m", "8"),
                                                                     "gpipe")):
        result = cli("solve", "two-cores.json", *args, "--out", f"{name}.json")
        assert result.exit_code == 0, result.output
    four, two, gpipe = (json.loads(Path(f"{n}.json").read_text()) for n in ("four", "two", "gpipe"))
    assert four["options"]["concurrent_ranks"] == 2 and two["options"]["concurrent_ranks"] is None
    # the neighbours' slowdown is the two processes' that compute at once, as for 2 stages
    assert four["options"]["compute_scale"] == pytest.approx(1.2) == two["options"]["compute_scale"]
    said = [w for w in four["warnings"] if "ranks share 2 cores" in w]
    assert len(said) == 1 and not [w for w in two["warnings"] if "ranks share" in w], four["warnings"]
    # GPipe with M = 8 keeps all four ranks busy at once in its fill: sharing lengthens its step
    pred = gpipe["predicted"]
    assert pred["dedicated_step_s"] < pred["step_s"] * (1 - 1e-3), pred
    assert plan_timeline(view_of(gpipe)).step_s == pytest.approx(pred["step_s"], rel=1e-12)
    assert two["predicted"]["dedicated_step_s"] is None
    # an older profile, or one whose host is not known: a core each, as before
    assert cli("solve", "unknown.json", "-k", "4", "--out", "old.json").exit_code == 0
    old = json.loads(Path("old.json").read_text())
    assert old["options"]["concurrent_ranks"] is None and not [w for w in old["warnings"] if "ranks share" in w]


def test_profile_refuses_more_contention_processes_than_the_host_runs_at_once(user_dir: Path) -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    result = cli("profile", "gpt", "--layers", "1", "--contention-processes", str(cores + 1), "-o", "p.json")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"needs {cores + 1} cores and this host has {cores}" in result.output and not Path("p.json").exists()
