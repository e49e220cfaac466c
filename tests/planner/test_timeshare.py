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
    return replace(setting, concurrent_ranks=rng.choice([1, 1.5, setting.stages - 0.5]),
                   shared_core_slowdown=rng.choice([1.0, 1.3]), shared_core_action_s=rng.choice([0.0, 2e-4]))


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
@given(instances(schedule="1f1b", max_stages=3, max_layers=7), st.sampled_from([1.0, 1.5, 2.5]),
       st.sampled_from([1.0, 1.4]))
def test_1f1b_equals_brute_force_on_shared_cores(instance, concurrent, slowdown) -> None:
    fig, setting = instance
    cm = CostModel(fig, replace(setting, concurrent_ranks=concurrent, shared_core_slowdown=slowdown))
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


def test_ranks_that_share_cores_pay_the_measured_slowdown_on_every_action() -> None:
    """Every layer, fixed cost and optimizer step takes the slowdown where the ranks share cores
    (a message on a link does not: it is no rank's work); nowhere else."""
    from gpipe_plan.planner.fixedcosts import FixedCosts

    rng = random.Random("slowdown")
    fig = make_figures([rng.uniform(1e-3, 3e-3) for _ in range(8)], [rng.uniform(1e-3, 5e-3) for _ in range(8)])
    base = Setting(stages=4, micro_batches=4, schedule="zb-h1", overhead_s=2e-5, compute_scale=1.1,
                   fixed_costs=FixedCosts(3e-4, 2e-4, 1e-4, 1e-4, 5e-5, 6e-5), link_bandwidth_bytes_per_s=1e9,
                   concurrent_ranks=2)
    bounds = (0, 2, 4, 6, 8)
    plain = evaluate(CostModel(fig, base), bounds)
    slow = evaluate(CostModel(fig, replace(base, shared_core_slowdown=1.5)), bounds)
    for a, b in zip(plain.chunks, slow.chunks):
        for key in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s"):
            assert getattr(b, key) == pytest.approx(1.5 * getattr(a, key), rel=1e-12), key
        assert b.send_s == a.send_s
    for a, b in zip(plain.stages, slow.stages):
        assert b.optimizer_s == pytest.approx(1.5 * a.optimizer_s, rel=1e-12)
    assert slow.step_s > plain.step_s * 1.3
    # ... and the cost added to every action, on top
    added = evaluate(CostModel(fig, replace(base, shared_core_slowdown=1.5, shared_core_action_s=1e-4)), bounds)
    for a, b in zip(slow.chunks, added.chunks):
        for key in ("forward_s", "backward_input_s", "backward_weight_s"):
            assert getattr(b, key) == pytest.approx(getattr(a, key) + 1e-4, rel=1e-12), key
        assert b.backward_s == pytest.approx(a.backward_s + 2e-4, rel=1e-12)     # I and W
    # with a core per rank the figure is not charged, nor below 1 where it is
    dedicated = replace(base, concurrent_ranks=math.inf)
    assert evaluate(CostModel(fig, replace(dedicated, shared_core_slowdown=1.5, shared_core_action_s=1e-4)),
                    bounds).step_s == evaluate(CostModel(fig, dedicated), bounds).step_s
    assert evaluate(CostModel(fig, replace(base, shared_core_slowdown=0.5)), bounds).step_s == plain.step_s


# ------------------------------------------------------------------ plans and profiles
def _cpu_profile(cores: int | None, shared_slowdown: float | None = None) -> dict:
    device = {"type": "cpu", "name": "synthetic", "threads": 1, **({"cores": cores} if cores else {})}
    extra = {} if shared_slowdown is None else {"fixed_costs": {
        **dict.fromkeys(("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "send_s", "receive_s",
                         "between_actions_s"), 1e-5),
        "shared_cores": {"slowdown": shared_slowdown, "per_action_s": 1e-4, "processes": 4, "concurrent_ranks": 2}}}
    return profile_doc(L=8, batch_size=8, version=9 if shared_slowdown is None else 10, device=device,
                       contention={"processes": 2, "slowdown": 1.2}, **extra)


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


def test_profile_refuses_more_threads_than_the_host_has_cores(user_dir: Path) -> None:
    # (a profile of 1000 threads on 2 cores was taken, and every rank of a run started 1000)
    import os

    cores = len(os.sched_getaffinity(0))
    result = cli("profile", "gpt", "--layers", "1", "--threads", str(cores + 1), "-o", "p.json")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"--threads {cores + 1} is more than the {cores} cores this host lets us use" in result.output
    assert not Path("p.json").exists()


def test_a_plan_charges_the_slowdown_the_profile_measured_on_shared_cores(user_dir: Path) -> None:
    """A version-10 profile's ``fixed_costs.shared_cores``: a plan of more ranks than cores charges
    its slowdown on every action, records it, says so, and export rebuilds the same step; a plan
    of as many ranks as cores charges nothing of it."""
    from gpipe_plan.planner.export.setting import plan_setting
    from gpipe_plan.planner.profile import Profile

    Path("measured.json").write_text(json.dumps(_cpu_profile(2, shared_slowdown=1.3)))
    Path("no-slower.json").write_text(json.dumps(_cpu_profile(2, shared_slowdown=1.0)))
    for profile in ("measured", "no-slower"):
        for k in (2, 4):
            result = cli("solve", f"{profile}.json", "-k", str(k), "--schedule", "1f1b", "-m", "4",
                         "--out", f"{profile}-{k}.json")
            assert result.exit_code == 0, result.output
    plans = {(p, k): json.loads(Path(f"{p}-{k}.json").read_text()) for p in ("measured", "no-slower") for k in (2, 4)}
    four = plans["measured", 4]
    assert four["options"]["shared_core_slowdown"] == 1.3 and four["options"]["shared_core_action_s"] == 1e-4
    assert plans["measured", 2]["options"]["shared_core_slowdown"] is None
    assert [w for w in four["warnings"] if "1.30x slower than on a core of its own" in w], four["warnings"]
    assert plans["measured", 2]["predicted"]["step_s"] == plans["no-slower", 2]["predicted"]["step_s"]
    assert four["predicted"]["step_s"] > plans["no-slower", 4]["predicted"]["step_s"] * 1.2
    setting = plan_setting(view_of(four))
    assert setting.shared_core_slowdown == 1.3 and setting.shared_core_action_s == 1e-4
    cm = CostModel(Profile(json.loads(Path("measured.json").read_text())).at(four["micro_batch_size"]), setting)
    bounds = [0]
    for n in four["balance"]:
        bounds.append(bounds[-1] + n)
    assert evaluate(cm, bounds).step_s == pytest.approx(four["predicted"]["step_s"], rel=1e-12)
    shown = cli("show", "measured-4.json")
    assert shown.exit_code == 0 and "every action x1.300" in shown.output, shown.output
    # a profile that did not measure it (before version 10): the plan says what it leaves out
    Path("older.json").write_text(json.dumps(_cpu_profile(2)))
    assert cli("solve", "older.json", "-k", "4", "--out", "older-4.json").exit_code == 0
    older = json.loads(Path("older-4.json").read_text())
    assert older["options"]["shared_core_slowdown"] == 1.0 and older["options"]["shared_core_action_s"] == 0.0
    assert [w for w in older["warnings"] if "did not measure how much slower ranks run there" in w], older["warnings"]
