"""Pipeline x data parallel in the planner: the ring formula, the sync charged in the cost
model, exactness kept, the search over (K, d) and placements, plan format 6, bad input.

Figures the tests expect are worked out by hand from docs/planner.md ("Data parallel"), not
read back from the planner's code.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpipe_plan.artifacts import BadInput
from gpipe_plan.plan_layout import check_replicas, data_parallel, gradient_sync, placement_ranks
from gpipe_plan.planner.brute import brute_force
from gpipe_plan.planner.command import solve_file
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.profile import Profile
from gpipe_plan.collectives import ring_allreduce_s, ring_allreduce_s_per_byte
from gpipe_plan.planner.replicas import (DATA_INNER, DATA_ONLY, PIPELINE_INNER, Topology, factorisations, placements,
                                         search_devices)
from gpipe_plan.planner.problem import SolveOptions, problem_of
from gpipe_plan.planner.search import search, search_pipeline, solve_setting
from gpipe_plan.planner.settings import ReplicaSync, pipeline_link, settings_for
from gpipe_plan.schedules import problem
from gpipe_plan.schema import FORMAT_VERSIONS, PLAN_FORMAT, validate

from helpers.planner import STATE_MULT, cli, close, hyp, instances, make_figures, profile_doc, write_json


def ring_by_hand(nbytes: float, d: int, bandwidth: float, latency: float) -> float:
    """docs/planner.md: 2(d-1)/d B / bandwidth + 2(d-1) latency; nothing to sync: 0."""
    if d == 1 or nbytes == 0:
        return 0.0
    return 2 * (d - 1) / d * nbytes / bandwidth + 2 * (d - 1) * latency


# --------------------------------------------------------------------------- the formula
def test_ring_allreduce_by_hand():
    # 1 GB over 4 replicas at 10 GB/s, 10 us a step: 6 steps of 250 MB = 1.5 GB / 10 GB/s + 60 us
    assert ring_allreduce_s(1e9, 4, 1e10, 1e-5) == pytest.approx(0.15 + 6e-5)
    # two replicas: each sends half the buffer twice = the whole buffer once, and 2 latencies
    assert ring_allreduce_s(8e6, 2, 1e9, 1e-3) == pytest.approx(8e-3 + 2e-3)
    assert ring_allreduce_s(1e9, 1, 1e10, 1.0) == 0.0           # one replica: nothing to sync
    assert ring_allreduce_s(0.0, 8, 1e10, 1.0) == 0.0           # a stage without parameters
    assert ring_allreduce_s(1e6, 3, math.inf, 0.0) == 0.0       # free communication


@pytest.mark.parametrize("held", [0.0, 1e6, 3e8])
@pytest.mark.parametrize("d", [1, 2, 8])
def test_each_byte_more_adds_at_least_the_rings_per_byte_time(held, d):
    """What a lower bound over layers not cut yet charges a stage for their bytes
    (planner/chunked.py): exactly the rate where the stage holds bytes, and less than what a
    stage that held none pays (its latency too)."""
    rate = ring_allreduce_s_per_byte(d, 1e10)
    more = ring_allreduce_s(held + 5e7, d, 1e10, 1e-5) - ring_allreduce_s(held, d, 1e10, 1e-5)
    assert more == pytest.approx(rate * 5e7) if held > 0 or d == 1 else more > rate * 5e7


def test_cost_model_charges_each_stage_its_parameters_sync_after_the_backward():
    params = [1000.0, 3000.0, 500.0, 2500.0]
    fig = make_figures([1e-3] * 4, [2e-3] * 4, params=params, optimizer=[1e-4] * 4)
    base = Setting(stages=2, micro_batches=2, schedule="1f1b")
    synced = replace(base, data_parallel=4, sync_bandwidth_bytes_per_s=1e6, sync_latency_s=1e-5)
    plain, cm = CostModel(fig, base), CostModel(fig, synced)
    bounds = (0, 1, 4)
    _, stages = cm.layout(bounds)
    _, plain_stages = plain.layout(bounds)
    for k, (s, e) in enumerate([(0, 1), (1, 4)]):
        sync = ring_by_hand(sum(params[s:e]), 4, 1e6, 1e-5)
        assert stages[k].gradient_sync_s == pytest.approx(sync)
        assert stages[k].optimizer_s == pytest.approx(plain_stages[k].optimizer_s + sync)
        assert cm.optimizer(s, e) == pytest.approx(plain.optimizer(s, e) + sync)
    # the sync only ever adds time, and the first stage's least after-the-backward term stays a bound
    assert evaluate(cm, bounds).step_s >= evaluate(plain, bounds).step_s
    assert cm.least_first_optimizer() <= min(cm.optimizer(0, e) for e in range(1, 4))


def test_a_stage_of_several_chunks_syncs_all_its_parameters_in_one_ring():
    params = [100.0, 200.0, 300.0, 400.0]
    fig = make_figures([1e-3] * 4, [2e-3] * 4, params=params)
    cm = CostModel(fig, Setting(stages=2, micro_batches=2, schedule="interleaved", virtual_stages=2,
                                data_parallel=2, sync_bandwidth_bytes_per_s=1e4, sync_latency_s=1e-3))
    _, stages = cm.layout((0, 1, 2, 3, 4))
    # interleaved: stage 0 holds chunks 0 and 2 (layers 0 and 2), stage 1 chunks 1 and 3
    assert stages[0].gradient_sync_s == pytest.approx(ring_by_hand(100 + 300, 2, 1e4, 1e-3))
    assert stages[1].gradient_sync_s == pytest.approx(ring_by_hand(200 + 400, 2, 1e4, 1e-3))


@pytest.mark.parametrize("optimizer", ["adam", "momentum", "sgd"])
def test_fsdp_memory_per_rank_shards_parameters_and_state(optimizer: str):
    P, d = 8000.0, 4
    fig = make_figures([1e-3], [2e-3], params=[P])
    mult = STATE_MULT[optimizer]
    ddp = CostModel(fig, Setting(stages=1, micro_batches=1, optimizer=optimizer, data_parallel=d))
    fsdp = CostModel(fig, Setting(stages=1, micro_batches=1, optimizer=optimizer, data_parallel=d,
                                  gradient_sync="fsdp"))
    assert ddp.static_memory(0, 1) == pytest.approx(P * (2 + mult))
    # whole parameters during the step + their 1/d shard + whole gradients + state / d
    assert fsdp.static_memory(0, 1) == pytest.approx(P + P / d + P + mult * P / d)
    st_ = fsdp.stage(0, ((0, 1),), False)
    assert (st_.params_bytes, st_.gradients_bytes, st_.optimizer_state_bytes) == pytest.approx(
        (P + P / d, P, mult * P / d))
    assert st_.memory_bytes == pytest.approx(fsdp.stage_memory(0, ((0, 1),), False))
    alone = CostModel(fig, Setting(stages=1, micro_batches=1, optimizer=optimizer, gradient_sync="fsdp"))
    assert alone.static_memory(0, 1) == pytest.approx(P * (2 + mult))      # one replica: nothing to shard


def test_fsdp_fits_where_ddp_does_not():
    profile = Profile(profile_doc(L=4, batch_size=8, param_bytes=[100_000] * 4))
    options = SolveOptions(devices=2, data_parallel=2, global_batch_size=8, recompute="never", time_budget_s=5)
    sharded = search_devices(profile, replace(options, gradient_sync="fsdp"))
    least = min(c.solution.evaluation.peak_memory_bytes for c in sharded.best.result.candidates if c.solution)
    # one stage of P = 400 kB under Adam: ddp holds 4 P, fsdp 3.5 P; activations are alike
    limited = replace(options, memory_limit_bytes=math.ceil(least))
    assert search_devices(profile, replace(limited, gradient_sync="fsdp")).best.fits
    with pytest.raises(BadInput, match="no plan fits"):
        search_devices(profile, limited)


# --------------------------------------------------------------------------- exactness kept
@st.composite
def replicated_instances(draw, schedule: str | None = None):
    fig, setting = draw(instances(schedule=schedule, max_layers=6))
    d = draw(st.sampled_from([2, 3, 4]))
    setting = replace(setting, data_parallel=d, gradient_sync=draw(st.sampled_from(["ddp", "fsdp"])),
                      sync_bandwidth_bytes_per_s=draw(st.sampled_from([1e4, 1e5, 1e6])),
                      sync_latency_s=draw(st.sampled_from([0.0, 1e-4, 1e-3])))
    return fig, setting


def _check_against_brute_force(fig, setting) -> None:
    if problem(setting.schedule, setting.stages, setting.micro_batches, setting.virtual_stages):
        return
    cm = CostModel(fig, setting)
    candidate = solve_setting(None, setting, 1, "dp", 5.0, figures=fig)   # type: ignore[arg-type]
    best = brute_force(cm)
    if best is None:
        assert candidate.solution is None
        return
    assert candidate.solution is not None and candidate.solution.proven
    ev = candidate.solution.evaluation
    assert close(ev.step_s, best.step_s, 1e-9), (ev.bounds, ev.step_s, best.bounds, best.step_s)
    assert candidate.solution.lower_bound_s <= best.step_s * (1 + 1e-9) + 1e-15
    # the sync each stage pays is the ring formula on its own parameters (by hand)
    for st_ in ev.stages:
        spans = [(c.start, c.end) for c in ev.chunks if c.stage == st_.index]
        nbytes = sum(sum(fig.param_bytes[s:e]) for s, e in spans)
        assert st_.gradient_sync_s == pytest.approx(ring_by_hand(nbytes, setting.data_parallel,
                                                                 setting.sync_bandwidth_bytes_per_s,
                                                                 setting.sync_latency_s))


@hyp(60)
@given(replicated_instances())
def test_gpipe_and_1f1b_stay_exact_with_a_gradient_sync(instance):
    _check_against_brute_force(*instance)


@hyp(15)
@given(replicated_instances(schedule="zb-h1"))
def test_zero_bubble_stays_exact_with_a_gradient_sync(instance):
    _check_against_brute_force(*instance)


def test_gpipe_without_sends_or_optimizer_still_charges_the_sync():
    """GPipe's fast path for "nothing after the backward" (gpipe_solver.py, constant_additive) must not
    take a plan whose only after-the-backward term is the sync: it once tested the optimizer
    time alone and missed the best cut in 6 of these 300 instances."""
    import random

    from gpipe_plan.planner.gpipe_solver import GPipeSolver

    rng = random.Random(1)
    for _ in range(300):
        L = rng.randint(3, 7)
        K, M = rng.randint(2, min(4, L)), rng.randint(1, 6)
        fig = make_figures([rng.random() * 1e-3 for _ in range(L)], [rng.random() * 2e-3 for _ in range(L)],
                           params=[rng.randint(0, 1000) for _ in range(L)])
        cm = CostModel(fig, Setting(stages=K, micro_batches=M, data_parallel=2,
                                    sync_bandwidth_bytes_per_s=rng.choice([1e5, 1e6, 1e7])))
        solution, best = GPipeSolver(cm).solve(), brute_force(cm)
        assert close(solution.evaluation.step_s, best.step_s, 1e-12), (solution.evaluation.bounds, best.bounds)


# --------------------------------------------------------------------------- the search over (K, d)
def _profile(**link) -> Profile:
    return Profile(profile_doc(L=8, batch_size=16, **({"link": link} if link else {})))


def test_factorisations_enumerate_every_pair_and_say_why_not():
    pairs = factorisations(8, None, "auto", batch=12, layers=6)
    assert [(K, d) for K, d, _ in pairs] == [(8, 1), (4, 2), (2, 4), (1, 8)]
    reasons = {(K, d): r for K, d, r in pairs}
    assert "8 stages" in reasons[(8, 1)] and "6" in reasons[(8, 1)]      # more stages than layers
    assert reasons[(4, 2)] == "" and reasons[(2, 4)] == ""
    assert "8 replicas do not divide the global batch of 12" in reasons[(1, 8)]
    assert [(K, d) for K, d, _ in factorisations(8, 2, "auto", 12, 6)] == [(2, 4)]
    assert [(K, d) for K, d, _ in factorisations(8, None, 2, 12, 6)] == [(4, 2)]


def test_one_replica_plans_exactly_as_before():
    profile = _profile(bandwidth_bytes_per_s=1e6, latency_s=1e-5)
    options = SolveOptions(stages=3, global_batch_size=16, time_budget_s=5)
    alone = search(profile, options)
    devices = search_devices(profile, replace(options, devices=3, data_parallel=1))
    assert len(devices.factorisations) == 1 and devices.best.data_parallel == 1
    assert devices.best.step_s == alone.best.step_s
    assert devices.best.result.best.solution.evaluation.bounds == alone.best.solution.evaluation.bounds


def test_a_factorisation_is_the_replica_search_plus_its_sync():
    link = 1e5
    profile = _profile(bandwidth_bytes_per_s=link, latency_s=1e-4)
    options = SolveOptions(devices=4, data_parallel="auto", global_batch_size=16, time_budget_s=10)
    found = search_devices(profile, options)
    two = next(f for f in found.factorisations if (f.stages, f.data_parallel) == (2, 2))
    # one node: the sync rides the link; each replica takes 16 / 2 = 8 samples a step
    replica = problem_of(options, stages=2, batch=8, link=pipeline_link(profile, options),
                         sync=ReplicaSync(2, "ddp", link, 1e-4))
    by_hand = search_pipeline(profile, replica)
    assert two.step_s == pytest.approx(by_hand.best.step_s, rel=1e-12)
    assert two.result.batch == 8
    ev = two.result.best.solution.evaluation
    params = [l["param_bytes"] for l in profile_doc(L=8)["layers"]]
    for st_ in ev.stages:
        chunks = [c for c in ev.chunks if c.stage == st_.index]
        nbytes = sum(sum(params[c.start:c.end]) for c in chunks)
        assert st_.gradient_sync_s == pytest.approx(ring_by_hand(nbytes, 2, link, 1e-4))
    # ... and the sync cost something: without it the same replica search is faster
    free = search_pipeline(profile, replace(replica, sync=ReplicaSync()))
    assert free.best.step_s < two.step_s
    assert found.proven and found.lower_bound_s <= found.best.step_s


def test_the_chosen_factorisation_is_brute_force_best_over_every_setting():
    profile = _profile(bandwidth_bytes_per_s=2e5, latency_s=1e-4)
    options = SolveOptions(devices=4, stages=2, data_parallel="auto", global_batch_size=16, time_budget_s=10)
    found = search_devices(profile, options)
    assert (found.best.stages, found.best.data_parallel) == (2, 2) and found.proven
    replica = problem_of(options, stages=2, batch=8, link=pipeline_link(profile, options),
                         sync=ReplicaSync(2, "ddp", 2e5, 1e-4))
    best = math.inf
    for setting, size in settings_for(profile, replica):
        ev = brute_force(CostModel(profile.at(size), setting))
        if ev is not None:
            best = min(best, ev.step_s)
    assert close(found.best.step_s, best, 1e-9), (found.best.step_s, best)


def _physics_profile() -> Profile:
    """Eight even layers with large parameters and small activations between them."""
    L = 8
    return Profile(profile_doc(L=L, batch_size=16, forward_per_sample=[1e-3] * L, backward_per_sample=[2e-3] * L,
                               output_per_sample=[10] * L, param_bytes=[1_000_000] * L))


@pytest.mark.parametrize("network, expect", [(1e6, (4, 1)), (1e12, (1, 4))])
def test_slow_network_means_more_pipeline_fast_network_more_replicas(network: float, expect):
    # four nodes of one device: every sync and every send crosses the network
    found = search_devices(_physics_profile(), SolveOptions(devices=4, data_parallel="auto", nodes=4,
                                                            network_bandwidth_bytes_per_s=network,
                                                            global_batch_size=16, time_budget_s=5))
    assert (found.best.stages, found.best.data_parallel) == expect
    steps = {(f.stages, f.data_parallel): f.step_s for f in found.factorisations}
    assert len(steps) == 3
    assert found.best.step_s == min(steps.values())


def test_placement_puts_the_heavier_traffic_on_the_link():
    topology = Topology(nodes=2, devices_per_node=2, link_bandwidth_bytes_per_s=1e9,
                        network_bandwidth_bytes_per_s=1e5)
    both = placements(2, 2, topology)
    assert [p.order for p in both] == [PIPELINE_INNER, DATA_INNER]
    inner, outer = both
    assert inner.ranks == ((0, 2), (1, 3)) and outer.ranks == ((0, 1), (2, 3))
    assert inner.pipeline_bandwidth_bytes_per_s == 1e9 and inner.sync_bandwidth_bytes_per_s == 1e5
    assert outer.pipeline_bandwidth_bytes_per_s == 1e5 and outer.sync_bandwidth_bytes_per_s == 1e9
    L = 4
    options = SolveOptions(devices=4, stages=2, data_parallel=2, nodes=2, link_bandwidth_bytes_per_s=1e9,
                           network_bandwidth_bytes_per_s=1e5, global_batch_size=8, time_budget_s=5)
    heavy_params = Profile(profile_doc(L=L, batch_size=8, output_per_sample=[10] * L,
                                       param_bytes=[1_000_000] * L))
    heavy_activations = Profile(profile_doc(L=L, batch_size=8, output_per_sample=[1_000_000] * L,
                                            param_bytes=[10] * L))
    assert search_devices(heavy_params, options).best.placement.order == DATA_INNER
    chosen = search_devices(heavy_activations, options).best.placement
    assert chosen.order == PIPELINE_INNER
    assert "pipeline sends" in chosen.reason and "on the link" in chosen.reason


def test_one_node_has_one_placement_and_one_replica_the_trivial_one():
    one_node = placements(2, 2, Topology(nodes=1, devices_per_node=4))
    assert [p.order for p in one_node] == [PIPELINE_INNER]
    assert one_node[0].ranks == ((0, 2), (1, 3))        # init_device_mesh(("dp", "pp")): rank = r K + k
    assert placements(3, 1, Topology(nodes=1, devices_per_node=3))[0].ranks == ((0,), (1,), (2,))


# --------------------------------------------------------------------------- plan format 6
@pytest.fixture
def profile_path(user_dir: Path) -> Path:
    return write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8,
                                                             link={"bandwidth_bytes_per_s": 1e6}))


def test_plan_v6_round_trips_through_the_schema_and_plan_layout(profile_path: Path, user_dir: Path):
    result = cli("solve", "profile.json", "--devices", "4", "--gradient-sync", "fsdp", "--out", "plan.json",
                 "--time-budget", "5")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("plan.json").read_text())
    assert plan["version"] == FORMAT_VERSIONS[PLAN_FORMAT] == 11
    validate(plan, "solved plan", "plan")
    d, K = data_parallel(plan), len(plan["stages"])
    assert gradient_sync(plan) == "fsdp" and plan["options"]["devices"] == 4 and K * d == 4
    assert plan["global_batch_size"] == 8 == d * plan["micro_batches"] * plan["micro_batch_size"]
    ranks = placement_ranks(plan, "plan")
    assert check_replicas(plan, "plan") == ranks and sorted(r for row in ranks for r in row) == [0, 1, 2, 3]
    rows = plan["factorisations"]
    assert [(r["stages"], r["data_parallel"]) for r in rows][0] == (K, d)
    assert sorted((r["stages"], r["data_parallel"]) for r in rows) == [(1, 4), (2, 2), (4, 1)]
    assert all(r["fits"] for r in rows) and rows[0]["step_s"] == plan["predicted"]["step_s"]
    assert all(rows[0]["step_s"] <= r["step_s"] for r in rows)
    assert all("data_parallel" in r for r in plan["runners_up"])
    for st_ in plan["stages"]:
        assert (st_["gradient_sync_s"] > 0) == (d > 1)
        assert st_["gradient_sync_s"] <= st_["optimizer_s"]
    assert 0 <= plan["predicted"]["gradient_sync_s"] <= max(s["gradient_sync_s"] for s in plan["stages"]) + 1e-12
    shown = cli("show", "plan.json")
    assert shown.exit_code == 0, shown.output
    assert "stages x replicas" in shown.output and "placement:" in shown.output


def test_one_pipeline_plan_has_one_replica_and_the_trivial_placement(profile_path: Path):
    assert cli("solve", "profile.json", "--stages", "3", "--out", "plan.json", "--time-budget", "5").exit_code == 0
    plan = json.loads(Path("plan.json").read_text())
    validate(plan, "solved plan", "plan")
    assert plan["data_parallel"] == 1 and plan["gradient_sync"] == "ddp"
    assert plan["placement"]["ranks"] == [[0], [1], [2]] and plan["placement"]["order"] == PIPELINE_INNER
    assert plan["predicted"]["gradient_sync_s"] == 0.0
    assert all(s["gradient_sync_s"] == 0.0 for s in plan["stages"])


def test_one_stage_of_replicas_is_data_only_in_the_plan_show_and_the_export(user_dir: Path):
    """K = 1 has no pipeline: its placement is data-only (format 7), and no export warns about
    pipeline sends, not even for a format-6 plan that called it pipeline-inner."""
    doc = profile_doc(L=6, batch_size=8, link={"bandwidth_bytes_per_s": 1e6})
    for layer in doc["layers"]:
        layer["module"] = layer["name"]                # names torchtitan can list
    write_json(user_dir / "profile.json", doc)
    topology = Topology(nodes=2, devices_per_node=4, link_bandwidth_bytes_per_s=1e9, network_bandwidth_bytes_per_s=1e6)
    (only,) = placements(1, 8, topology)
    assert only.order == DATA_ONLY and only.ranks == (tuple(range(8)),)
    result = cli("solve", "profile.json", "--devices", "8", "--data-parallel", "8", "--nodes", "2",
                 "--network-bandwidth", "1", "--out", "plan.json", "--time-budget", "5")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("plan.json").read_text())
    validate(plan, "solved plan", "plan")
    assert plan["placement"]["order"] == DATA_ONLY and plan["factorisations"][0]["order"] == DATA_ONLY
    assert plan["placement"]["reason"].startswith("data-only on 2 nodes of 4: no pipeline sends, gradient syncs")
    shown = cli("show", "plan.json")
    assert shown.exit_code == 0 and "data-only" in shown.output and "pipeline-inner" not in shown.output, shown.output
    plan["version"], plan["placement"]["order"] = 6, PIPELINE_INNER      # what format 6 wrote
    plan["factorisations"][0]["order"] = PIPELINE_INNER
    write_json(Path("v6.json"), plan)
    for path in ("plan.json", "v6.json"):
        exported = cli("export", path, "--to", "torchtitan", "--out", f"{path}.toml")
        assert exported.exit_code == 0, exported.output
        assert "orders ranks" not in exported.output and "exact: the target runs" in exported.output, exported.output


def test_an_old_version_5_plan_still_reads(profile_path: Path):
    assert cli("solve", "profile.json", "--stages", "2", "--out", "plan.json", "--time-budget", "5").exit_code == 0
    plan = json.loads(Path("plan.json").read_text())
    for key in ("data_parallel", "gradient_sync", "placement", "factorisations"):
        del plan[key]
    for st_ in plan["stages"]:
        del st_["gradient_sync_s"]
    del plan["predicted"]["gradient_sync_s"]
    plan["version"] = 5
    write_json(Path("old.json"), plan)
    validate(plan, "solved plan", "plan")
    assert data_parallel(plan) == 1 and gradient_sync(plan) == "ddp"
    assert placement_ranks(plan, "plan") == [[0], [1]]
    shown = cli("show", "old.json")
    assert shown.exit_code == 0, shown.output


def test_a_plan_whose_batch_does_not_split_over_its_replicas_is_refused(profile_path: Path):
    assert cli("solve", "profile.json", "--devices", "2", "--data-parallel", "2", "--out", "plan.json",
               "--time-budget", "5").exit_code == 0
    plan = json.loads(Path("plan.json").read_text())
    plan["global_batch_size"] = plan["micro_batches"] * plan["micro_batch_size"]   # one replica's share
    with pytest.raises(BadInput, match="data_parallel 2 x micro_batches"):
        check_replicas(plan, "plan")
    plan = json.loads(Path("plan.json").read_text())
    plan["placement"]["order"] = "sideways"
    with pytest.raises(BadInput, match="placement.order"):
        validate(plan, "solved plan", "plan")


def test_a_free_network_is_written_as_null(profile_path: Path, user_dir: Path):
    """--network-bandwidth 'inf' (what its own message offers) plans a network that costs
    nothing, written null as a free link is, not refused by the plan's schema."""
    result = cli("solve", "profile.json", "--devices", "4", "--nodes", "2", "--network-bandwidth", "inf",
                 "--out", "plan.json", "--time-budget", "2")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("plan.json").read_text())
    assert plan["options"]["nodes"] == 2 and plan["options"]["network_bandwidth_bytes_per_s"] is None


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, pattern", [
    (["--stages", "3", "--devices", "4"], r"--stages 3 does not divide --devices 4"),
    (["--stages", "2", "--devices", "4", "--data-parallel", "1"], r"--stages 2 x --data-parallel 1 is 2 devices"),
    (["--devices", "3", "--data-parallel", "3"], r"--data-parallel 3 does not divide the global batch of 8"),
    (["--devices", "4", "--nodes", "3"], r"--nodes 3 does not divide the 4 devices"),
    (["--devices", "4", "--nodes", "2"], r"--nodes 2 needs --network-bandwidth"),
    (["--devices", "8", "--stages", "8"], r"--stages 8 is more than the profile's 6 layers"),
    (["--micro-batches", "2"], r"give --stages K .* or --devices N"),
    (["--devices", "4", "--solver", "ilp"], r"--solver ilp plans one pipeline \(no replicas\) only"),
    (["--devices", "4", "--data-parallel", "0"], r"--data-parallel must be at least 1"),
    (["--devices", "4", "--network-latency", "-1"], r"--network-latency"),
    (["--devices", "4", "--nodes", "2", "--network-bandwidth", "inf", "--network-latency", "0.001"],
     r"--network-latency 0.001 counts only on a network of finite bandwidth"),
])
def test_contradictions_are_one_line_errors(profile_path: Path, user_dir: Path, args, pattern):
    result = cli("solve", "profile.json", *args, "--out", "plan.json")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    import re
    assert re.search(pattern, lines[0]), lines[0]
    assert not (user_dir / "plan.json").exists()


def test_one_pipeline_over_two_nodes_pays_the_network_on_its_cuts(profile_path: Path):
    local = solve_file(str(profile_path), None, stages=4, link_bandwidth=1.0, micro_batches=4, schedule="gpipe",
                       time_budget_s=5)
    spread = solve_file(str(profile_path), None, stages=4, link_bandwidth=1.0, micro_batches=4, schedule="gpipe",
                        nodes=2, network_bandwidth=1e-6, time_budget_s=5)
    assert spread["placement"]["nodes"] == 2 and spread["data_parallel"] == 1
    assert "on the network" in spread["placement"]["reason"]
    # 1 kB/s between nodes: every send costs what 100-400 bytes a sample take at that rate
    assert spread["predicted"]["step_s"] > local["predicted"]["step_s"] + 0.1


def test_solve_file_takes_devices_without_stages(profile_path: Path):
    plan = solve_file(str(profile_path), None, devices=2, time_budget_s=5)
    assert len(plan["stages"]) * plan["data_parallel"] == 2


@pytest.mark.parametrize("link", [None, "1"])
def test_a_plan_whose_syncs_are_free_says_so(user_dir: Path, link: str | None):
    """Without link figures (profile or --link-bandwidth) a replica's sync costs nothing, so
    more replicas always look free: the plan warns, and stops warning once a link is known."""
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    args = ["--link-bandwidth", link] if link else []
    result = cli("solve", "profile.json", "--devices", "2", "--data-parallel", "2", "--out", "plan.json",
                 "--time-budget", "5", *args)
    assert result.exit_code == 0, result.output
    warnings = json.loads(Path("plan.json").read_text())["warnings"]
    free = [w for w in warnings if "charged nothing" in w]
    assert bool(free) == (link is None), warnings


def test_fsdp_with_tied_weights_plans_one_chunk_per_stage(user_dir: Path):
    """FSDP2 cannot shard one parameter in two modules: with a tie, zb-v (first and last chunk
    on stage 0) is refused for fsdp in one line, and auto leaves the many-chunk schedules out."""
    doc = profile_doc(L=6, batch_size=8, link={"bandwidth_bytes_per_s": 1e9})
    doc["tied_parameters"] = [{"key": "wte.weight", "layers": ["layer0", "layer5"], "bytes": 4000}]
    write_json(user_dir / "profile.json", doc)
    common = ["--devices", "4", "--data-parallel", "2", "--time-budget", "5", "--out", "plan.json"]
    refused = cli("solve", "profile.json", *common, "--gradient-sync", "fsdp", "--schedule", "zb-v")
    assert refused.exit_code == 2 and "cannot run zb-v" in refused.output and not Path("plan.json").exists()
    assert cli("solve", "profile.json", *common, "--gradient-sync", "ddp", "--schedule", "zb-v").exit_code == 0
    auto = cli("solve", "profile.json", *common, "--gradient-sync", "fsdp")
    assert auto.exit_code == 0, auto.output
    plan = json.loads(Path("plan.json").read_text())
    assert plan["virtual_stages"] == 1 and all(r["virtual_stages"] == 1 for r in plan["runners_up"])


def test_bad_network_bandwidth_names_its_own_flag(user_dir: Path):
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    result = cli("solve", "profile.json", "--devices", "4", "--nodes", "2", "--network-bandwidth", "-1")
    assert result.exit_code == 2 and "--network-bandwidth must be a positive number" in result.output


def test_a_replicas_micro_batches_are_checked_against_its_own_batch(user_dir: Path):
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    result = cli("solve", "profile.json", "--devices", "4", "--data-parallel", "4", "-b", "8", "-m", "4")
    assert result.exit_code == 2 and "does not divide a replica's batch of 2" in result.output, result.output


def test_out_of_memory_with_replicas_suggests_what_keeps_k_times_d(user_dir: Path):
    """More stages per replica means more devices: the hint says --devices with --stages."""
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    result = cli("solve", "profile.json", "--devices", "4", "--data-parallel", "2", "--memory-limit", "10KB")
    assert result.exit_code == 2 and "no plan fits" in result.output, result.output
    assert "--devices 8 --stages 4" in result.output or "--gradient-sync fsdp" in result.output, result.output
    assert " --stages 4 would" not in result.output.replace("--devices 8 --stages 4", "")


def test_a_refusal_of_many_devices_names_a_few_factorisations_in_one_short_line(user_dir: Path):
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    result = cli("solve", "profile.json", "--devices", str(10 ** 6), "--global-batch-size", "8")
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and len(line) < 400, line
    assert line.startswith("error: no factorisation of 1000000 devices gives a plan: 1000000x1: 1000000 stages need "
                           "1000000 layers; the profile has 6;") and line.endswith(" more"), line
