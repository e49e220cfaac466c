"""The planner's asynchronous schedules (``pipedream``, ``pipedream-2bw``): the steady-state step,
the exact cut, the stashed weights' memory, the plan's new keys, and every refusal.

The period is checked against two things the planner does not share with it: the slowest
stage's work on hand-made profiles (worked out here by hand), and the event simulator playing
a long segment out (its rate per micro-batch, once the fill is behind it). The solver is
checked against brute force over every cut and recompute choice.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from gpipe_plan.planner.asynchronous import AsyncSolver, steady_period_s
from gpipe_plan.planner.brute import brute_force
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.simulator import simulate_plan
from gpipe_plan.schedules import SCHEDULES
from gpipe_plan.schema import validate
from gpipe_plan.weight_versions import (ASYNC_SCHEDULES, staleness, stashed_versions, updates_per_step,
                                        weight_copies)

from helpers.planner import cli, make_figures, profile_doc, write_json

pytestmark = pytest.mark.filterwarnings("ignore:.*PuLP 4:DeprecationWarning")

# Per-sample forward and backward of 6 layers (the hand-made profile of the first test).
FORWARD = [1e-3, 1e-3, 1e-3, 1e-3, 3e-3, 3e-3]
BACKWARD = [2e-3, 2e-3, 2e-3, 2e-3, 1e-3, 1e-3]


@pytest.fixture
def profile_path(user_dir: Path) -> Path:
    return write_json(user_dir / "profile.json", profile_doc(
        L=6, sizes=(1, 2, 4), batch_size=8, forward_per_sample=FORWARD, backward_per_sample=BACKWARD))


def solve(*args: str) -> dict:
    result = cli("solve", "profile.json", "--out", "plan.json", "--quiet", *args)
    assert result.exit_code == 0, result.output
    return json.loads(Path("plan.json").read_text())


# --------------------------------------------------------------------------- the step
@pytest.mark.parametrize("schedule", ASYNC_SCHEDULES)
def test_the_step_is_m_times_the_slowest_stages_work_on_a_hand_made_profile(profile_path, schedule):
    # M = 4 micro-batches of 2 samples. Per micro-batch, layers 0-3 take 6 ms each (F + B: 2 + 4),
    # layers 4-5 8 ms each (6 + 2). K = 2: the cut after layer 2 gives 18 | 22 ms, after 3
    # 24 | 16, after 1 12 | 28: the first, a period of 22 ms, a step of 4 x 22 = 88 ms.
    plan = solve("--stages", "2", "--schedule", schedule, "--micro-batches", "4", "--link-bandwidth", "inf")
    assert plan["schedule"] == schedule and plan["balance"] == [3, 3]
    work = [c["forward_s"] + c["backward_s"] for c in plan["chunks"]]
    assert work == pytest.approx([18e-3, 22e-3], rel=1e-9)
    assert plan["predicted"]["steady_state_period_s"] == pytest.approx(22e-3, rel=1e-9)
    assert plan["predicted"]["step_s"] == pytest.approx(4 * 22e-3, rel=1e-9)
    assert plan["predicted"]["bubble_fraction"] == 0.0
    # One step alone: 1F1B's makespan of 4 micro-batches, less the 4 periods.
    alone = simulate_plan("1f1b", 2, 4, 1, [evaluate_chunk(c) for c in plan["chunks"]]).makespan_s
    assert plan["predicted"]["fill_drain_s"] == pytest.approx(max(0.0, alone - 4 * 22e-3), rel=1e-9)
    assert plan["predicted"]["fill_drain_s"] > 0
    # The synchronous 1F1B of the same cut has a bubble, so its step is longer.
    sync = solve("--stages", "2", "--schedule", "1f1b", "--micro-batches", "4", "--link-bandwidth", "inf")
    assert sync["predicted"]["step_s"] > plan["predicted"]["step_s"]
    assert plan["optimality"]["proven"] and plan["optimality"]["gap"] == pytest.approx(0.0, abs=1e-9)


def evaluate_chunk(chunk: dict):
    from gpipe_plan.planner.simulator import ChunkTimes

    return ChunkTimes(forward_s=chunk["forward_s"], backward_s=chunk["backward_s"], backward_input_s=0.0,
                      backward_weight_s=0.0, send_s=chunk["send_s"] or 0.0, recompute_s=chunk["recompute_s"] or 0.0)


def test_the_period_on_one_stage_per_micro_batch_and_the_updates_it_charges():
    # Two stages of 1 + 2 and 3 + 1 s a micro-batch, optimizer 0.5 s each: pipedream updates
    # after every micro-batch (4 + 0.5 on the slowest stage), 2bw once a step of M = 4 (4 + 0.125).
    fig = make_figures([1.0, 3.0], [2.0, 1.0], optimizer=[0.5, 0.5])
    for schedule, period in (("pipedream", 4.5), ("pipedream-2bw", 4.125)):
        ev = evaluate(CostModel(fig, Setting(2, 4, schedule)), (0, 1, 2))
        assert ev.steady_state_period_s == pytest.approx(period)
        assert ev.step_s == pytest.approx(4 * period)
        assert ev.updates_per_step == updates_per_step(schedule, 4)


def random_instance(rng: random.Random, schedule: str, limit: bool = False, links: bool = True):
    L = rng.randint(3, 7)
    K = rng.randint(1, min(4, L))
    M = rng.randint(max(1, K - 1) if schedule == "pipedream-2bw" else 1, 6)
    f = [rng.choice([rng.uniform(0.05, 2.0), 1.0]) for _ in range(L)]
    b = [rng.uniform(0.05, 3.0) for _ in range(L)]
    fig = make_figures(f, b, activation=[rng.uniform(1, 50) for _ in range(L)],
                       output=[rng.uniform(0, 8) for _ in range(L)], params=[rng.uniform(1, 30) for _ in range(L)],
                       optimizer=[rng.choice([0.0, rng.uniform(0, 0.3)]) for _ in range(L)],
                       recompute_backward=[x + rng.uniform(0.1, 2.0) for x in b], input_bytes=rng.uniform(1, 5))
    bandwidth = rng.choice([math.inf, 1.0, 4.0]) if links else math.inf
    setting = Setting(K, M, schedule, recompute=rng.choice(["never", "always", "auto"]),
                      link_bandwidth_bytes_per_s=bandwidth, link_latency_s=rng.choice([0.0, 0.2]))
    if limit:
        unlimited = CostModel(fig, setting)
        least = brute_force(CostModel(fig, Setting(**{**setting.__dict__, "recompute": "auto"})))
        peak = least.peak_memory_bytes if least else 1e9
        setting = Setting(**{**setting.__dict__, "memory_limit_bytes": peak * rng.uniform(0.9, 1.6)})
        del unlimited
    return CostModel(fig, setting)


@pytest.mark.parametrize("schedule", ASYNC_SCHEDULES)
def test_the_period_is_the_rate_a_long_segment_plays_out_at(schedule):
    """The formula against the event simulator: over a segment of 4n steps the last 3n take
    3n M periods (slow links included, where a window's round trip is what limits). Where the
    critical cycle spans many micro-batches the played-out rate settles only as 1/n (what a
    finite segment's ends add), hence the tolerance; a missing cycle is off by far more."""
    rng = random.Random(7)
    limited_by_links = 0
    for _ in range(120):
        cm = random_instance(rng, schedule)
        L, K = cm.L, cm.K
        cuts = sorted(rng.sample(range(1, L), K - 1))
        ev = evaluate(cm, (0, *cuts, L))
        times = [c.times() for c in ev.chunks]
        n = 100
        first = simulate_plan(schedule, K, cm.M, 1, times, steps=n).makespan_s
        whole = simulate_plan(schedule, K, cm.M, 1, times, steps=4 * n).makespan_s
        # (the simulator does not play the optimizer steps: compare without them)
        work = [c.forward_s + c.backward_s for c in ev.chunks]
        period = steady_period_s(work, [c.send_s for c in ev.chunks])
        assert (whole - first) / (3 * n * cm.M) == pytest.approx(period, rel=1e-3)
        limited_by_links += period > max(work) * (1 + 1e-9)
    assert limited_by_links > 5      # the instances exercise the windows, not only the slowest stage


@pytest.mark.parametrize("schedule", ASYNC_SCHEDULES)
@pytest.mark.parametrize("limit", [False, True])
def test_the_solver_agrees_with_brute_force_over_every_cut(schedule, limit):
    rng = random.Random(11 if limit else 5)
    for _ in range(60):
        cm = random_instance(rng, schedule, limit=limit)
        sol = AsyncSolver(cm).solve()
        best = brute_force(cm)
        if best is None:
            assert sol is None
            continue
        assert sol is not None and sol.proven
        assert sol.evaluation.fits
        assert sol.evaluation.step_s == pytest.approx(best.step_s, rel=1e-9)
        assert sol.lower_bound_s <= best.step_s * (1 + 1e-12)
        assert sol.lower_bound_s == pytest.approx(best.step_s, rel=1e-9)


# --------------------------------------------------------------------------- memory
@pytest.mark.parametrize("schedule", ASYNC_SCHEDULES)
def test_memory_counts_the_stashed_versions_and_k_minus_k_in_flight(schedule):
    L, K, M = 8, 4, 3                     # M < K: a synchronous step would hold min(M, K - k)
    params, act = [10.0 * (i + 1) for i in range(L)], [7.0] * L
    fig = make_figures([1.0] * L, [2.0] * L, activation=act, params=params)
    bounds = (0, 2, 4, 6, 8)
    setting = Setting(K, M if schedule == "pipedream" else K - 1, schedule, optimizer="adam")
    ev = evaluate(CostModel(fig, setting), bounds)
    sync = evaluate(CostModel(fig, Setting(K, setting.micro_batches, "1f1b", optimizer="adam")), bounds)
    for k, (st, base) in enumerate(zip(ev.stages, sync.stages)):
        p = sum(params[bounds[k]:bounds[k + 1]])
        # The live weights and a stashed copy per version in flight (the last stage's forward
        # and backward adjacent): what the executor holds (runtime/test_async_executor.py replays it).
        versions = stashed_versions(schedule, k, K) + (1 if k < K - 1 else 0)
        assert versions == weight_copies(schedule, k, K)
        assert st.params_bytes == pytest.approx(versions * p)
        assert st.gradients_bytes == pytest.approx(p) and st.optimizer_state_bytes == pytest.approx(2 * p)
        assert st.in_flight == K - k
        assert st.activations_bytes == pytest.approx((K - k) * 14.0)
        assert st.memory_bytes - base.memory_bytes == pytest.approx(
            (versions - 1) * p + (K - k - base.in_flight) * 14.0)


# --------------------------------------------------------------------------- choosing them
def test_auto_never_picks_an_asynchronous_schedule(profile_path):
    plan = solve("--stages", "3", "--micro-batches", "2")
    assert plan["schedule"] in SCHEDULES
    assert not any(r["schedule"] in ASYNC_SCHEDULES for r in plan["runners_up"])
    # ... although, asked for, one is faster here (no bubble)
    asked = solve("--stages", "3", "--micro-batches", "2", "--schedule", "pipedream")
    assert asked["predicted"]["step_s"] < plan["predicted"]["step_s"]


def test_explore_shows_them_only_when_asked(profile_path):
    def schedules(*args: str) -> set[str]:
        result = cli("explore", "profile.json", "--stages", "1,2", "--micro-batches", "2,4", "--json", "grid.json",
                     *args)
        assert result.exit_code == 0, result.output
        return {row["schedule"] for row in json.loads(Path("grid.json").read_text())["rows"]}

    assert schedules() == set(SCHEDULES)
    assert schedules("--schedule", "1f1b,pipedream,pipedream-2bw") == {"1f1b", "pipedream", "pipedream-2bw"}
    rows = json.loads(Path("grid.json").read_text())["rows"]
    pipedream = [r for r in rows if r["schedule"] == "pipedream" and r["stages"] == 2 and r["recompute"] == "never"]
    assert all("does not recompute" in r["note"] for r in rows if r["schedule"] == "pipedream" and r["recompute"] == "always")
    assert pipedream and all(r["bubble_fraction"] == 0.0 and r["proven"] for r in pipedream)


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("args, message", [
    (["--stages", "4", "--schedule", "pipedream-2bw", "--micro-batches", "2"], "at least K - 1 = 3 micro-batches"),
    (["--devices", "4", "--stages", "2", "--schedule", "pipedream", "--gradient-sync", "fsdp"], "--gradient-sync ddp"),
    (["--stages", "2", "--schedule", "pipedream", "--virtual-stages", "2"], "--virtual-stages"),
    (["--devices", "4", "--stages", "2", "--schedule", "pipedream", "--gradient-sync", "localsgd",
      "--sync-every", "2"], "localsgd with a synchronous --schedule"),
    (["--stages", "2", "--schedule", "pipedream", "--recompute", "always"], "use --recompute never"),
])
def test_the_refusals_are_one_line(profile_path, args, message):
    result = cli("solve", "profile.json", "--out", "plan.json", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output and not Path("plan.json").exists()


def test_ranks_sharing_the_hosts_cores_are_refused(user_dir):
    doc = profile_doc(L=6, batch_size=8)
    doc["version"] = 9
    doc["device"] = {**doc["device"], "cores": 2}
    write_json(user_dir / "profile.json", doc)
    result = cli("solve", "profile.json", "--out", "plan.json", "--stages", "4", "--schedule", "pipedream")
    assert result.exit_code == 2 and "not modelled" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("target", ["torch", "torchtitan", "megatron", "deepspeed", None])
def test_every_export_target_refuses_an_asynchronous_plan(profile_path, target):
    solve("--stages", "2", "--schedule", "pipedream")
    args = ["--to", target] if target else ["--schedule-csv", "schedule.csv"]
    result = cli("export", "plan.json", *args)
    assert result.exit_code == 2, result.output
    assert "synchronous pipelines only" in result.output and len(result.output.strip().splitlines()) == 1
    assert sorted(p.name for p in Path(".").iterdir()) == ["plan.json", "profile.json"]


# --------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("schedule", ASYNC_SCHEDULES)
def test_the_plan_records_staleness_and_versions_validates_and_shows(profile_path, schedule):
    plan = solve("--stages", "3", "--schedule", schedule, "--micro-batches", "4")
    validate(plan, "solved plan", "plan.json")
    K = 3
    assert plan["updates_per_step"] == updates_per_step(schedule, 4)
    for k, st in enumerate(plan["stages"]):
        assert st["staleness_updates"] == staleness(schedule, k, K)
        assert st["weight_versions"] == stashed_versions(schedule, k, K)
        assert st["in_flight"] == K - k
    result = cli("show", "plan.json", "--timeline", "show.svg")
    assert result.exit_code == 0, result.output
    assert "no flush" in result.output and "stale" in result.output
    rows = [line.split() for line in result.output.splitlines() if line.split()[:2] in (["0", "0"], ["1", "1"],
                                                                                         ["2", "2"])]
    assert [int(r[-2]) for r in rows[-3:]] == [staleness(schedule, k, K) for k in range(K)]
    assert [int(r[-1]) for r in rows[-3:]] == [stashed_versions(schedule, k, K) for k in range(K)]
    svg = Path("show.svg").read_text()
    assert "steady state: step 2 of a 3-step segment" in svg
    # The window holds micro-batches of the other steps too (no flush), numbered over the segment.
    assert "forward micro-batch 4" in svg and "micro-batch 11" not in svg.split("forward micro-batch")[0]


@pytest.mark.parametrize("schedule", ASYNC_SCHEDULES)
def test_a_pipedream_plan_says_how_many_samples_each_update_sees(profile_path, schedule):
    """Seen: pipedream, which updates after every micro-batch, planned 64 micro-batches of 1 for
    speed, so that each update saw one sample a replica, and the plan did not say so."""
    plan = solve("--stages", "2", "--schedule", schedule, "--micro-batches", "4", "--global-batch-size", "8")
    said = [w for w in plan["warnings"] if "updates a step, each of" in w]
    if schedule == "pipedream":
        assert said == ["pipedream applies each micro-batch's gradient as an update of its own: 4 updates a step, "
                        "each of 2 samples (micro-batch 2 x 1 replica), not one of the global batch; the search "
                        "chose M for speed: give -m for the batch an update should see (fewer micro-batches, "
                        "larger updates), or pipedream-2bw, which updates once a step"]
    else:        # 2BW accumulates the step's micro-batches into one update
        assert said == []


def test_the_steady_window_is_one_step_of_events_from_zero(profile_path):
    from gpipe_plan.plan_view import view_of
    from gpipe_plan.planner.render import plan_timeline

    plan = solve("--stages", "3", "--schedule", "pipedream", "--micro-batches", "4")
    timeline = plan_timeline(view_of(plan))
    assert timeline.events and min(e.start_s for e in timeline.events) == 0.0
    assert max(e.end_s for e in timeline.events) <= timeline.step_s + 1e-12
    forwards = [e for e in timeline.events if e.kind == "forward" and e.stage == 0 and e.start_s < timeline.step_s]
    assert sorted(e.micro_batch for e in forwards)[:4] == [4, 5, 6, 7]     # the middle step's own


def test_a_synchronous_plan_says_staleness_0_and_an_older_plan_still_reads(profile_path):
    plan = solve("--stages", "2", "--schedule", "1f1b")
    assert plan["updates_per_step"] == 1 and plan["predicted"]["steady_state_period_s"] is None
    assert all(st["staleness_updates"] == 0 and st["weight_versions"] == 1 for st in plan["stages"])
    older = {k: v for k, v in plan.items() if k != "updates_per_step"}
    older["version"] = 7
    older["stages"] = [{k: v for k, v in st.items() if k not in ("staleness_updates", "weight_versions")}
                       for st in plan["stages"]]
    older["predicted"] = {k: v for k, v in plan["predicted"].items()
                          if k not in ("steady_state_period_s", "fill_drain_s")}
    write_json(Path("old.json"), older)
    result = cli("show", "old.json")
    assert result.exit_code == 0, result.output
    assert "no flush" not in result.output


def test_replicas_pay_pipedreams_all_reduce_per_micro_batch_and_2bws_per_step():
    # Two stages, d = 2 replicas on a ring of 1 byte/s: each stage's all-reduce of its 4 parameter
    # bytes takes 2 (d-1)/d x 4 / 1 = 4 s. pipedream updates (and all-reduces) after every
    # micro-batch, 2bw once a step of M = 4: the slowest stage's period is 3 + 4 or 3 + 1.
    fig = make_figures([1.0, 1.0], [2.0, 1.0], params=[4.0, 4.0])
    for schedule, period in (("pipedream", 7.0), ("pipedream-2bw", 4.0)):
        cm = CostModel(fig, Setting(2, 4, schedule, data_parallel=2, sync_bandwidth_bytes_per_s=1.0))
        ev = evaluate(cm, (0, 1, 2))
        assert [st.gradient_sync_s for st in ev.stages] == pytest.approx([4.0, 4.0])
        assert ev.steady_state_period_s == pytest.approx(period)
        assert ev.busy_s(4)[0] == pytest.approx(4 * 3.0 + updates_per_step(schedule, 4) * 4.0)


def test_no_stage_recomputes_even_where_it_would_fit_only_so(profile_path):
    """The runtime reruns no asynchronous forward (it would meet the newest weights): under a
    limit that 1F1B meets only by recomputing, the asynchronous plan recomputes nothing."""
    sync = solve("--stages", "2", "--schedule", "1f1b", "--micro-batches", "4")
    peak = max(st["memory_bytes"] for st in sync["stages"])
    for schedule in ASYNC_SCHEDULES:
        plan = solve("--stages", "2", "--schedule", schedule, "--micro-batches", "4", "--recompute", "auto")
        assert not any(c["recompute"] for c in plan["chunks"])
        result = cli("solve", "profile.json", "--out", "tight.json", "--quiet", "--stages", "2", "--schedule", schedule,
                     "--micro-batches", "4", "--memory-limit", str(int(peak * 0.5)))
        if result.exit_code == 0:
            assert not any(c["recompute"] for c in json.loads(Path("tight.json").read_text())["chunks"])


def _tied_profile(user_dir: Path, layers: tuple[str, str]) -> None:
    doc = profile_doc(L=6, sizes=(1, 2, 4), batch_size=8, forward_per_sample=FORWARD, backward_per_sample=BACKWARD)
    doc["tied_parameters"] = [{"key": "w.weight", "layers": list(layers), "bytes": 4000}]
    write_json(user_dir / "profile.json", doc)


def test_the_cut_keeps_tied_layers_on_one_stage(user_dir):
    # Untied, the best cut is [3, 3] (the first test); tying layers 2 and 3 forbids it.
    _tied_profile(user_dir, ("layer2", "layer3"))
    for schedule in ASYNC_SCHEDULES:
        plan = solve("--stages", "2", "--schedule", schedule, "--micro-batches", "4", "--link-bandwidth", "inf")
        assert plan["balance"] in ([4, 2], [2, 4]), plan["balance"]


def test_a_tie_no_cut_can_keep_on_one_stage_is_one_line(user_dir):
    _tied_profile(user_dir, ("layer0", "layer5"))
    result = cli("solve", "profile.json", "--out", "plan.json", "--stages", "2", "--schedule", "pipedream",
                 "--micro-batches", "4")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "layer0 and layer5" in result.output and not Path("plan.json").exists()
    assert cli("solve", "profile.json", "--out", "plan.json", "--quiet", "--stages", "2", "--schedule", "1f1b",
               "--micro-batches", "4").exit_code == 0


def test_an_fp16_profile_is_one_line(user_dir):
    doc = profile_doc(L=6, sizes=(1, 2, 4), batch_size=8, precision="fp16")
    write_json(user_dir / "profile.json", doc)
    result = cli("solve", "profile.json", "--out", "plan.json", "--stages", "2", "--schedule", "pipedream-2bw",
                 "--micro-batches", "4")
    assert result.exit_code == 2 and "--precision bf16" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
