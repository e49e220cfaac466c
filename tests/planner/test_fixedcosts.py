"""The runtime's fixed costs per action and message (planner/fixedcosts.py), as the planner charges them.

The solvers' exactness with fixed costs is checked against brute force where the solvers are
(tests/planner/test_solvers.py, tests/planner/test_chunked.py draw them); here: the rule itself,
against a reference written from docs/planner.md, on every schedule; that more chunks per stage
pay for their actions; what a plan records and warns; and how the calibrated overhead relates.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpipe_plan.cli import main
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.export.setting import plan_setting
from gpipe_plan.plan_view import read_plan
from gpipe_plan.planner.fixedcosts import FIGURES, FixedCosts, between_actions_s, figures_at, probe_misfit
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.profile import Profile
from gpipe_plan.planner.problem import SolveOptions
from gpipe_plan.planner.search import search
from gpipe_plan.schedules import SPLIT_BACKWARD, chunks_per_stage, problem, stage_of_chunk

from hypothesis import given

from helpers.planner import hyp, instances, make_figures, profile_doc

FIXED = FixedCosts(forward_s=1e-4, backward_s=2e-4, backward_input_s=3e-4, backward_weight_s=5e-5,
                   send_s=7e-4, receive_s=4e-4)
SHAPES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("zb-v", 1)]


def reference_fixed(schedule: str, K: int, v: int, c: int, overhead: float, f: FixedCosts) -> dict[str, float]:
    """Chunk c's fixed part per action, straight from docs/planner.md ("Fixed costs"): each kind its
    own plus the overhead between actions; a message to or from a chunk on another stage costs
    the sender ``send_s`` and the receiver ``receive_s`` (a zb-v stage's own pair: nothing);
    chunk 0's I under a split backward computes nothing (its messages and the overhead only)."""
    C = K * chunks_per_stage(schedule, v)
    where = [stage_of_chunk(schedule, x, K) for x in range(C)]
    up = c < C - 1 and where[c + 1] != where[c]       # F sends, B/I receives
    down = c > 0 and where[c - 1] != where[c]         # F receives, B/I sends
    backward_messages = f.send_s * down + f.receive_s * up
    out = {"F": overhead + f.forward_s + f.send_s * up + f.receive_s * down,
           "B": overhead + f.backward_s + backward_messages,
           "I": overhead + f.backward_input_s + backward_messages,
           "W": overhead + f.backward_weight_s}
    if schedule in SPLIT_BACKWARD and c == 0:
        out["I"] = overhead + backward_messages
    return out


@pytest.mark.parametrize("schedule,v", SHAPES)
def test_every_action_pays_its_kind_and_its_messages(schedule: str, v: int) -> None:
    rng = random.Random(schedule + str(v))
    for K in (1, 2, 3, 4):
        C = K * chunks_per_stage(schedule, v)
        L = C + 3
        if problem(schedule, K, 4 * K, v):
            continue
        fig = make_figures([rng.uniform(1e-3, 3e-3) for _ in range(L)], [rng.uniform(2e-3, 5e-3) for _ in range(L)])
        overhead = 1e-5
        cm = CostModel(fig, Setting(stages=K, micro_batches=4 * K, schedule=schedule, virtual_stages=v,
                                    overhead_s=overhead, fixed_costs=FIXED))
        bare = CostModel(fig, Setting(stages=K, micro_batches=4 * K, schedule=schedule, virtual_stages=v))
        bounds = sorted(rng.sample(range(1, L), C - 1))
        bounds = (0, *bounds, L)
        for c in range(C):
            s, e = bounds[c], bounds[c + 1]
            want = reference_fixed(schedule, K, v, c, overhead, FIXED)
            got = dict(zip("FBIW", cm.chunk_times(c, s, e, False)))
            plain = dict(zip("FBIW", bare.chunk_times(c, s, e, False)))
            for kind in ("F", "I", "W") if schedule in SPLIT_BACKWARD else ("F", "B"):
                assert got[kind] - plain[kind] == pytest.approx(want[kind], abs=1e-15), (schedule, K, c, kind)
                assert cm.chunk_fixed(kind, c) == pytest.approx(want[kind], abs=1e-15)
            if schedule in SPLIT_BACKWARD:
                assert got["B"] == pytest.approx(got["I"] + got["W"], rel=1e-15)
            # what the plan shows and the simulator plays is the same figure
            chunk = cm.chunk(c, s, e, False)
            assert chunk.forward_s == got["F"] and chunk.backward_s == got["B"]


@hyp(250)
@given(instances(schedule="gpipe", max_layers=9, max_stages=5, fixed=True))
def test_gpipe_dp_equals_brute_force_whatever_each_stage_pays(instance) -> None:
    """The DP's greedy probe cuts each stage with its own class's fixed part (the ends exchange
    fewer messages): always on here, so that every way it hands over to the exact sweep runs."""
    from gpipe_plan.planner.brute import brute_force
    from gpipe_plan.planner.gpipe_solver import GPipeSolver

    fig, setting = instance
    cm = CostModel(fig, setting)
    best, got = brute_force(cm), GPipeSolver(cm).solve()
    if best is None:
        assert got is None
        return
    assert got is not None and got.proven and got.evaluation.fits
    assert got.evaluation.step_s == pytest.approx(best.step_s, rel=1e-9)


def test_zb_v_hands_its_own_pair_over_without_a_message() -> None:
    """The bottom of the V (chunks K-1 and K, both on the last stage) pays no message; the
    chunks on either side of a cut between stages do."""
    fig = make_figures([1e-3] * 8, [2e-3] * 8)
    cm = CostModel(fig, Setting(stages=2, micro_batches=4, schedule="zb-v", fixed_costs=FixedCosts(send_s=1.0)))
    # chunk: 0 (stage 0) -> 1 (stage 1) -> 2 (stage 1) -> 3 (stage 0)
    assert [cm.forward_messages[c] for c in range(4)] == [1.0, 0.0, 1.0, 0.0]
    assert [cm.backward_messages[c] for c in range(4)] == [0.0, 1.0, 0.0, 1.0]


def test_more_chunks_per_stage_pay_for_their_actions() -> None:
    """Interleaving halves the bubble but runs v times the actions: with no fixed costs the
    planner finds v = 3 faster than 1F1B; with fixed costs of the size the runtime pays on a CPU
    (docs/benchmarks/fidelity.md) per action and message, 1F1B wins, as it does when both run."""
    fig = make_figures([1e-4] + [1.6e-3] * 4 + [5e-4], [1.6e-4] + [2.6e-3] * 4 + [7e-4])
    fixed = FixedCosts(forward_s=3e-4, backward_s=3e-4, send_s=1e-4, receive_s=1e-4)

    def best(schedule: str, v: int, costs: FixedCosts) -> float:
        from gpipe_plan.planner.brute import brute_force

        return brute_force(CostModel(fig, Setting(stages=2, micro_batches=4, schedule=schedule, virtual_stages=v,
                                                  fixed_costs=costs))).step_s

    assert best("interleaved", 3, FixedCosts()) < best("1f1b", 1, FixedCosts())
    assert best("interleaved", 3, fixed) > best("1f1b", 1, fixed)
    # each F and B of each chunk, and each message, counted once per micro-batch
    ev = evaluate(CostModel(fig, Setting(stages=2, micro_batches=4, schedule="interleaved", virtual_stages=3,
                                         fixed_costs=fixed)), (0, 1, 2, 3, 4, 5, 6))
    bare = evaluate(CostModel(fig, Setting(stages=2, micro_batches=4, schedule="interleaved", virtual_stages=3)),
                    (0, 1, 2, 3, 4, 5, 6))
    busy, busy0 = ev.busy_s(4), bare.busy_s(4)
    # stage 0 runs chunks 0, 2, 4: 3 F and 3 B per micro-batch, 5 sends and 5 receives among them
    assert busy[0] - busy0[0] == pytest.approx(4 * (3 * 3e-4 + 3 * 3e-4 + 5 * 1e-4 + 5 * 1e-4))


def test_the_calibrated_overhead_replaces_the_profiled_one_never_adds() -> None:
    assert between_actions_s(None, 2e-5, 2) == 2e-5
    assert between_actions_s(5e-5, 2e-5, 2) == 5e-5       # a run's own measurement wins
    assert between_actions_s(5e-5, 2e-5, 1) == 5e-5       # profile-time costs: every K
    assert between_actions_s(5e-5, None, 1) == 0.0        # an older profile: several stages only,
    assert between_actions_s(5e-5, None, 3) == 5e-5       # as it always was
    assert between_actions_s(None, None, 3) == 0.0


def test_the_figures_at_a_size_are_interpolated_between_the_sizes_measured() -> None:
    """Profile version 11: each figure piecewise-linear in the micro-batch size through the sizes
    the probe ran, extended linearly past them and never below zero; without sizes (or one, or
    no size asked) the record's own figures."""
    def entry(size: int, scale: float) -> dict:
        return {"micro_batch_size": size, **{key: scale * (i + 1) * 1e-4 for i, key in enumerate(FIGURES)}}

    record = {**entry(4, 2.0), "per_micro_batch_size": [entry(8, 5.0), entry(2, 1.0), entry(4, 2.0)]}
    assert figures_at(None, 4) is None
    assert figures_at(record, None) == {key: record[key] for key in FIGURES}
    assert figures_at(record, 2)["send_s"] == pytest.approx(5e-4)
    assert figures_at(record, 3)["send_s"] == pytest.approx(7.5e-4)       # between 2 and 4
    assert figures_at(record, 6)["forward_s"] == pytest.approx(3.5e-4)    # between 4 and 8 (2e-4, 5e-4)
    assert figures_at(record, 16)["forward_s"] == pytest.approx(11e-4)    # past 8, on the line through 4 and 8
    assert figures_at(record, 1)["forward_s"] == pytest.approx(0.5e-4)    # before 2, on the line through 2 and 4
    falling = {**entry(4, 2.0), "per_micro_batch_size": [entry(2, 4.0), entry(4, 1.0)]}
    assert figures_at(falling, 8)["forward_s"] == 0.0                      # never below zero
    alone = {**entry(4, 2.0), "per_micro_batch_size": [entry(4, 2.0)]}
    assert figures_at(alone, 16) == figures_at(alone, None)                # one size: its figures
    older = entry(4, 2.0)                                                  # version 10: one size
    assert figures_at(older, 16) == {key: older[key] for key in FIGURES}


def test_a_plan_is_charged_the_fixed_costs_at_its_own_micro_batch_size(tmp_path: Path) -> None:
    """The same profile solved at M = 8 and M = 2 (micro-batches of 1 and 4): each plan charges,
    and records, the figures at its size, and its prediction is the cost model's with them."""
    per_size = [{"micro_batch_size": b, **{key: value * b for key, value in FIXED_RECORD.items()}} for b in (1, 2, 4)]
    profile = _profile_with_fixed_costs(tmp_path, {**per_size[1], "per_micro_batch_size": per_size})
    for M, b in ((8, 1), (2, 4)):
        out = tmp_path / f"plan{M}.json"
        result = CliRunner().invoke(main, ["solve", str(profile), "--stages", "2", "--micro-batches", str(M),
                                           "--schedule", "1f1b", "--out", str(out), "-q"])
        assert result.exit_code == 0, result.output
        plan = json.loads(out.read_text())
        assert plan["micro_batch_size"] == b
        assert plan["options"]["fixed_costs"] == pytest.approx(
            {key: value * b for key, value in FIXED_RECORD.items() if key != "between_actions_s"})
        assert plan["options"]["per_microbatch_overhead_s"] == pytest.approx(FIXED_RECORD["between_actions_s"] * b)
        setting = plan_setting(read_plan(str(out)))
        cm = CostModel(Profile(json.loads(profile.read_text())).at(b), setting)
        bounds = [0]
        for n in plan["balance"]:
            bounds.append(bounds[-1] + n)
        assert evaluate(cm, bounds).step_s == pytest.approx(plan["predicted"]["step_s"], rel=1e-12)


def _probed(size: int, interleaved_v3: float) -> dict:
    """One size's fixed costs whose probe ran 1F1B as fitted and interleaved v=3 at ``interleaved_v3``."""
    runs = [{"schedule": "1f1b", "virtual_stages": 1, "chunks": 2, "micro_batches": 4,
             "measured_step_s": 0.01, "predicted_step_s": 0.01},
            {"schedule": "interleaved", "virtual_stages": 3, "chunks": 6, "micro_batches": 4,
             "measured_step_s": 0.02 * interleaved_v3, "predicted_step_s": 0.02}]
    return {"micro_batch_size": size, **FIXED_RECORD, "configurations": runs}


def test_probe_misfit_reads_the_shape_at_the_nearest_size() -> None:
    record = {**_probed(2, 1.0), "per_micro_batch_size": [_probed(1, 1.2), _probed(2, 1.0), _probed(4, 1.1)]}
    assert probe_misfit(record, "interleaved", 3, 4) == (pytest.approx(1.1), 4)
    assert probe_misfit(record, "interleaved", 3, 1) == (pytest.approx(1.2), 1)
    assert probe_misfit(record, "interleaved", 3, 3) == (pytest.approx(1.0), 2)    # ties: the smaller size
    assert probe_misfit(record, "interleaved", 3, None) == (pytest.approx(1.0), 2)
    assert probe_misfit(record, "1f1b", 1, 4) == (pytest.approx(1.0), 4)
    assert probe_misfit(record, "interleaved", 4, 4) is None                       # not probed
    assert probe_misfit(record, "gpipe", 1, 4) is None
    assert probe_misfit(None, "1f1b", 1, 4) is None


@pytest.mark.parametrize("ratio,warned", [(1.12, True), (1.02, False)])
def test_a_plan_of_a_shape_the_probe_ran_slower_than_fitted_says_so(tmp_path: Path, ratio: float,
                                                                     warned: bool) -> None:
    """The probe measured interleaved v=3 at ``ratio`` of its fitted step at the plan's size: a plan
    of that shape warns that it is likely to run slower than predicted (above 5%), naming the ratio."""
    per_size = [_probed(1, 1.0), _probed(2, ratio), _probed(4, 1.0)]
    profile = _profile_with_fixed_costs(tmp_path, {**per_size[1], "per_micro_batch_size": per_size})
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["solve", str(profile), "--stages", "2", "--micro-batches", "4",
                                       "--schedule", "interleaved", "--virtual-stages", "3", "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["micro_batch_size"] == 2
    said = [w for w in plan["warnings"] if "the profile's probe ran interleaved v=3" in w]
    assert bool(said) == warned
    if warned:
        assert f"{ratio:.2f}x" in said[0] and "micro-batch 2" in said[0]


def _profile_with_fixed_costs(tmp_path: Path, fixed: dict | None, calibrated: float | None = None) -> Path:
    doc = profile_doc(L=6, batch_size=8)
    if fixed is not None:
        doc["fixed_costs"] = fixed
    if calibrated is not None:
        doc["overhead"] = {"per_microbatch_s": calibrated}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    return path


FIXED_RECORD = {"forward_s": 3e-4, "backward_s": 3e-4, "backward_input_s": 4e-4, "backward_weight_s": 1e-4,
                "send_s": 1e-4, "receive_s": 2e-4, "between_actions_s": 2e-5}


def test_a_plan_records_what_it_charged_and_export_rebuilds_it(tmp_path: Path) -> None:
    profile = _profile_with_fixed_costs(tmp_path, FIXED_RECORD, calibrated=5e-5)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["solve", str(profile), "--stages", "2", "--micro-batches", "4",
                                       "--schedule", "interleaved", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    charged = plan["options"]["fixed_costs"]
    assert charged == {k: v for k, v in FIXED_RECORD.items() if k != "between_actions_s"}
    assert plan["options"]["per_microbatch_overhead_s"] == 5e-5     # the calibrated figure, not 2e-5
    assert not any("fixed costs" in w for w in plan["warnings"])
    setting = plan_setting(read_plan(str(out)))
    assert setting.fixed_costs == FixedCosts.from_record(FIXED_RECORD) and setting.overhead_s == 5e-5
    # the rebuilt cost model predicts the plan's own step
    cm = CostModel(Profile(json.loads(profile.read_text())).at(plan["micro_batch_size"]), setting)
    bounds = [0]
    for n in plan["balance"]:
        bounds.append(bounds[-1] + n)
    recompute = [plan["chunks"][stage["chunks"][0]]["recompute"] for stage in plan["stages"]]
    assert evaluate(cm, bounds, recompute).step_s == pytest.approx(plan["predicted"]["step_s"], rel=1e-12)


def test_a_plan_charges_the_optimizer_step_as_the_probe_measured_it(tmp_path: Path) -> None:
    """A profile whose probe timed the optimizer 1.5x the layers' figures (version 14): every
    stage's optimizer step is charged 1.5x, in the plan and in the cost model export rebuilds;
    without the figure, as profiled."""
    plain = json.loads(_profile_with_fixed_costs(tmp_path, FIXED_RECORD).read_text())
    for i, layer in enumerate(plain["layers"]):
        layer["optimizer_s"] = 1e-3 * (i + 1)
    assert Profile(plain).optimizer_scale == 1.0
    scaled = {**plain, "fixed_costs": {**FIXED_RECORD, "optimizer_scale": 1.5, "optimizer_scale_spread": 0.1}}
    assert Profile(scaled).at(2).optimizer_s == pytest.approx([1.5 * t for t in Profile(plain).at(2).optimizer_s])
    plans = {}
    for name, doc in (("plain", plain), ("scaled", scaled)):
        path = tmp_path / f"{name}.profile.json"
        path.write_text(json.dumps(doc))
        out = tmp_path / f"{name}.plan.json"
        result = CliRunner().invoke(main, ["solve", str(path), "--stages", "2", "--micro-batches", "4",
                                           "--schedule", "1f1b", "--out", str(out), "-q"])
        assert result.exit_code == 0, result.output
        plans[name] = json.loads(out.read_text())
    layers = [layer["optimizer_s"] for layer in plain["layers"]]
    start = 0
    for stage, n in zip(plans["scaled"]["stages"], plans["scaled"]["balance"]):
        assert stage["optimizer_s"] == pytest.approx(1.5 * sum(layers[start:start + n]))
        start += n
    assert plans["scaled"]["predicted"]["step_s"] > plans["plain"]["predicted"]["step_s"]


def test_the_probe_measures_the_optimizer_step_against_the_layers_figures() -> None:
    """Each rank's optimizer steps over the layers its chunks hold: their median over the layers'
    profiled figures, the median of those over every run and rank."""
    from gpipe_plan.profiles.fixedcosts import ProbeRun, fit_optimizer_scale, probes, window

    doc = profile_doc(L=6, batch_size=4)
    for i, layer in enumerate(doc["layers"]):
        layer["optimizer_s"] = 1e-4 * (i + 1)
    first, end = window(doc, 1)
    runs = []
    for probe in probes(end - first):
        per_rank = []
        for rank in range(2):
            held = sum(doc["layers"][first + i]["optimizer_s"] for c in range(probe.chunks)
                       if stage_of_chunk(probe.schedule, c, 2) == rank
                       for i in range(probe.bounds[c], probe.bounds[c + 1]))
            per_rank.append([held * 1.4, held * 1.5, held * 9.0])      # one step disturbed: the median holds
        runs.append(ProbeRun(probe, [[0.01] * 3] * 2, [[], []], per_rank))
    scale, ratios = fit_optimizer_scale(doc, (first, end), runs)
    assert scale == pytest.approx(1.5) and len(ratios) == 2 * len(runs)
    # runs that timed no optimizer step (back to back, or before version 14): no figure
    assert fit_optimizer_scale(doc, (first, end), [ProbeRun(r.probe, r.step_s, r.spans) for r in runs]) == (None, [])


def test_a_profile_without_fixed_costs_plans_as_before_and_the_plan_says_so(tmp_path: Path) -> None:
    profile = _profile_with_fixed_costs(tmp_path, None)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["solve", str(profile), "--stages", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["options"]["fixed_costs"] is None
    assert any("measured no fixed costs" in w for w in plan["warnings"])


def test_fixed_costs_change_the_choice_the_search_makes() -> None:
    """The same profile, with and without fixed costs: the search's best interleaved v and its
    predicted step move the way the actions count says."""
    doc = profile_doc(L=8, batch_size=8)
    plain = search(Profile(doc), SolveOptions(stages=2, micro_batches=4, schedule="interleaved", time_budget_s=10))
    doc["fixed_costs"] = {**FIXED_RECORD, "forward_s": 5e-3, "backward_s": 5e-3}
    costly = search(Profile(doc), SolveOptions(stages=2, micro_batches=4, schedule="interleaved", time_budget_s=10))
    assert costly.best.step_s > plain.best.step_s
    assert costly.best.setting.virtual_stages <= plain.best.setting.virtual_stages
    assert costly.best.setting.virtual_stages == 2          # the fewest chunks interleaving allows
    assert math.isfinite(costly.best.step_s)


# --------------------------------------------------------------------------- calibration
@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_calibrate_scales_the_layers_by_what_is_left_of_both_times(tmp_path: Path, schedule: str) -> None:
    """A plan's chunk times include every fixed cost it charged; a run's spans include the kind's
    own and the sends, not the receives or the time between actions. A run whose layers took
    ``factor`` times their profiled time is calibrated to exactly that factor: the fixed costs
    are taken off both sides, never rescaled as if they were layers."""
    from gpipe_plan.planner.command import solve_file
    from gpipe_plan.plan_layout import plan_chunks
    from gpipe_plan.profiles.overhead import fixed_in_times

    from helpers.calibration import profile_doc as calibrate_profile, report_doc

    doc = calibrate_profile()
    doc["fixed_costs"] = {"forward_s": 1e-3, "backward_s": 2e-3, "backward_input_s": 1.5e-3, "backward_weight_s": 5e-4,
                          "send_s": 5e-4, "receive_s": 3e-4, "between_actions_s": 1e-4}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc))
    plan = solve_file(str(profile), str(tmp_path / "plan.json"), stages=2, micro_batches=4, schedule=schedule)
    factors = [1.3, 0.8]
    report = report_doc(plan, [1.0, 1.0], [1.0, 1.0], None)
    report.update(schedule=schedule, num_stages=2, micro_batches=4)
    fixed = fixed_in_times(doc, report)
    for chunk, stage, factor in zip(plan_chunks(plan, "plan"), report["stages"], factors):
        for kind in ("forward", "backward"):
            in_prediction, in_span = fixed.of(chunk["index"], kind)
            layers = chunk[f"{kind}_s"] - in_prediction
            assert layers > 0
            stage[f"measured_{kind}_s"] = layers * factor + in_span
    (tmp_path / "report.json").write_text(json.dumps(report))
    result = CliRunner().invoke(main, ["calibrate", str(tmp_path / "report.json"), "--profile", str(profile)])
    assert result.exit_code == 0, result.output
    rounds = json.loads((tmp_path / "profile.calibrated.json").read_text())["calibration"][-1]["chunks"]
    assert [c["forward_scale"] for c in rounds] == pytest.approx(factors)
    assert [c["backward_scale"] for c in rounds] == pytest.approx(factors)
    # the sends are in the span (the sender's chunk), the receives are not
    assert fixed.of(0, "forward")[1] == pytest.approx(1e-3 + 5e-4)
    assert fixed.of(1, "forward") == pytest.approx((1e-4 + 1e-3 + 3e-4, 1e-3))


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_calibrate_on_shared_cores_takes_off_what_the_plan_charged_for_sharing(tmp_path: Path, schedule: str) -> None:
    """Two ranks on one core: the plan charged every action ``slowdown`` times its time on a core
    of its own plus ``added``. A run whose layers took ``factor`` times their profiled time there
    (its spans: the layers and the fixed costs they hold, all ``slowdown`` times slower) is
    calibrated to exactly that factor, and the cost between actions it measured is taken back to a
    core of its own."""
    from gpipe_plan.plan_layout import plan_chunks

    from helpers.calibration import profile_doc as calibrate_profile, report_doc

    slowdown, added, between = 1.3, 2e-4, 1e-4
    fixed = {"forward_s": 1e-3, "backward_s": 2e-3, "backward_input_s": 1.5e-3, "backward_weight_s": 5e-4,
             "send_s": 5e-4, "receive_s": 3e-4, "between_actions_s": between}
    doc = calibrate_profile()
    doc["device"] = {**doc["device"], "cores": 1}
    doc["fixed_costs"] = {**fixed, "shared_cores": {"slowdown": slowdown, "per_action_s": added, "processes": 2,
                                                    "concurrent_ranks": 1}}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc))
    plan_path = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["solve", str(profile), "-k", "2", "-m", "4", "--schedule", schedule,
                                       "--out", str(plan_path), "-q"])
    assert result.exit_code == 0, result.output
    plan = json.loads(plan_path.read_text())
    assert plan["options"]["shared_core_slowdown"] == slowdown and plan["options"]["concurrent_ranks"] == 1
    size = doc["micro_batch_sizes"].index(plan["micro_batch_size"])
    factors = [1.3, 0.8]
    report = report_doc(plan, [1.0, 1.0], [1.0, 1.0], None)
    report.update(schedule=schedule, num_stages=2, micro_batches=4, concurrent_ranks=1,
                  shared_core_slowdown=slowdown, shared_core_action_s=added)
    layer = {name: i for i, name in enumerate(l["name"] for l in doc["layers"])}
    for chunk, stage, factor in zip(plan_chunks(plan, "plan"), report["stages"], factors):
        c = chunk["index"]
        # 2 stages: chunk 0 sends its forward's output and receives its gradient; chunk 1 the reverse
        own = {"forward": fixed["forward_s"] + (fixed["send_s"] if c == 0 else 0.0),
               "backward": (fixed["backward_s"] if schedule == "gpipe" else
                            fixed["backward_weight_s"] + (fixed["backward_input_s"] if c else 0.0))
                           + (fixed["send_s"] if c == 1 else 0.0)}
        for kind in ("forward", "backward"):
            layers_s = sum(doc["layers"][layer[n]][f"{kind}_s"][size] for n in chunk["layers"])
            stage[f"measured_{kind}_s"] = slowdown * (layers_s * factor + own[kind])
    # the cost between actions: each stage's step less its spans and waits, per action
    actions = 16 if schedule == "gpipe" else 24
    true_between = 3e-4
    for stage in report["stages"]:
        stage.update(measured_busy_s=0.05, measured_wait_s=0.01)
    report["measured_step_s"] = 0.06 + actions / 2 * (slowdown * true_between + added)
    (tmp_path / "report.json").write_text(json.dumps(report))
    # Its spans hold the waits for a core: refused in one line, and nothing written ...
    result = CliRunner().invoke(main, ["calibrate", str(tmp_path / "report.json"), "--profile", str(profile)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "2 ranks shared the host's cores (1 of each pipeline's 2 ran at once)" in result.output
    assert "--force" in result.output and not (tmp_path / "profile.calibrated.json").exists()
    # ... unless forced: then what the plan charged for sharing comes off both sides.
    result = CliRunner().invoke(main, ["calibrate", str(tmp_path / "report.json"), "--profile", str(profile),
                                       "--force"])
    assert result.exit_code == 0, result.output
    calibrated = json.loads((tmp_path / "profile.calibrated.json").read_text())
    assert "shared the host's cores" in calibrated["calibration"][-1]["forced"][0]
    rounds = calibrated["calibration"][-1]["chunks"]
    assert [c["forward_scale"] for c in rounds] == pytest.approx(factors)
    assert [c["backward_scale"] for c in rounds] == pytest.approx(factors)
    assert calibrated["overhead"]["per_microbatch_s"] == pytest.approx(true_between)
    # A version-5 report does not say: the plan it names does, where it is at hand; else a core each.
    from gpipe_plan.artifacts import file_sha256
    from gpipe_plan.profiles.calibrate import PlanSharing, plan_sharing

    assert plan_sharing(report, str(tmp_path / "report.json")) == PlanSharing(1, slowdown, added)
    older = {k: v for k, v in report.items() if k not in ("concurrent_ranks", "shared_core_slowdown",
                                                           "shared_core_action_s")}
    older["version"] = 5
    assert plan_sharing(older, str(tmp_path / "report.json")) == PlanSharing()
    older["plan"] = {"path": str(plan_path), "sha256": file_sha256(str(plan_path))}
    assert plan_sharing(older, str(tmp_path / "report.json")) == PlanSharing(1, slowdown, added)


# --------------------------------------------------------------------------- the probe's runs
def test_probe_runs_are_cut_so_that_the_busiest_stage_does_least() -> None:
    """A window like a small Llama's (a cheap embedding, four alike blocks, a cheap head): every
    configuration's stages get two blocks each, where chunks of equal layer counts gave
    interleaved v = 2 and zb-v one stage three blocks and the other one ([Note: probe runs are
    balanced]); the cut is recorded with the run."""
    from gpipe_plan.profiles.fixedcosts import balanced_bounds, probes

    work = [0.1, 5.0, 5.0, 5.0, 5.0, 0.3]
    for probe in probes(len(work), work=work):
        load = [0.0, 0.0]
        for c in range(probe.chunks):
            load[stage_of_chunk(probe.schedule, c, 2)] += sum(work[probe.bounds[c]:probe.bounds[c + 1]])
        assert max(load) < 10.5, (probe.schedule, probe.virtual_stages, probe.bounds)
        assert probe.bounds[0] == 0 and probe.bounds[-1] == len(work) and len(set(probe.bounds)) == len(probe.bounds)
    # Alike layers, or no times: chunks of (nearly) equal layer counts, as before.
    assert balanced_bounds("interleaved", 2, 2, 8, [1.0] * 8) == (0, 2, 4, 6, 8)
    assert balanced_bounds("interleaved", 2, 2, 6, None) == (0, 1, 3, 4, 6)
    assert balanced_bounds("1f1b", 1, 4, 6, [1.0] * 6) == (0, 1, 3, 4, 6)


# --------------------------------------------------------------------------- the measurement's fit
def _synthetic_runs(doc: dict, truth: FixedCosts, between: float, jitter: float = 0.0):
    """What the probe would record if the runtime cost exactly ``truth`` beyond the profile's layers:
    each action's span its layers' time plus its kind's cost and its sends, the step the planner's
    own simulation with every figure (profiles/fixedcosts.py's model of the probe)."""
    from gpipe_plan.profiles.fixedcosts import KINDS, MEASURED_STEPS, ProbeRun, _ProbeModel, probes, window

    rng = random.Random(0)
    first, end = window(doc, 1)
    runs = []
    for probe in probes(end - first):
        model = _ProbeModel(doc, (first, end), 1, probe)
        step = model.step_s(truth, between)
        spans: list[list] = [[], []]
        for step_index in range(MEASURED_STEPS):
            clocks = [0.0, 0.0]                   # each rank's, its spans one after the other
            for c in range(probe.chunks):
                rank = model.bare.stage_of_chunk[c]
                for kind in KINDS:
                    if (kind in ("backward_input", "backward_weight")) != model.bare.split:
                        continue
                    own = {"forward": truth.forward_s, "backward": truth.backward_s,
                           "backward_input": truth.backward_input_s, "backward_weight": truth.backward_weight_s}[kind]
                    if kind == "backward_input" and c == 0:
                        own = 0.0
                    duration = model.layers_s(kind, c) + own + truth.send_s * model.sends(kind, c)
                    duration *= 1 + rng.uniform(-jitter, jitter)
                    start = clocks[rank]
                    spans[rank].append((step_index, kind, c, start, start + duration))
                    clocks[rank] = start + duration + between
        runs.append(ProbeRun(probe, [[step] * MEASURED_STEPS, [step * 0.99] * MEASURED_STEPS], spans))
    return (first, end), runs


def test_the_fit_recovers_the_costs_that_made_the_runs() -> None:
    """Spans and steps made from known fixed costs (on a profile's own layers and cuts): the fit
    gives them back, and predicts each run's step as measured."""
    from gpipe_plan.profiles.fixedcosts import fit_fixed_costs

    doc = profile_doc(L=6, batch_size=4)
    truth = FixedCosts(forward_s=3e-4, backward_s=4e-4, backward_input_s=2.5e-4, backward_weight_s=1e-4,
                       send_s=1.5e-4, receive_s=2e-4)
    layers, runs = _synthetic_runs(doc, truth, between=2e-5)
    fit = fit_fixed_costs(doc, layers, 1, runs)
    for key in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "send_s"):
        assert fit[key] == pytest.approx(getattr(truth, key), rel=1e-6, abs=1e-9), key
    assert fit["receive_s"] == pytest.approx(2e-4, rel=0.02)
    assert fit["between_actions_s"] == pytest.approx(2e-5, rel=1e-6)
    assert {(c["schedule"], c["virtual_stages"]) for c in fit["configurations"]} == {
        ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 1), ("interleaved", 3)}
    for c, run in zip(fit["configurations"], runs):
        assert c["measured_step_s"] == pytest.approx(c["predicted_step_s"], rel=0.02)
        assert c["bounds"] == list(run.probe.bounds)                                # the cut it ran (version 12)
    assert all(v == pytest.approx(0.0, abs=1e-9) for v in fit["spread"].values())    # every step alike


def test_the_fit_never_goes_below_zero_and_says_how_much_it_spreads() -> None:
    """A kind the runtime costs nothing for is 0, not a negative figure; noisy spans give a spread."""
    from gpipe_plan.profiles.fixedcosts import fit_fixed_costs

    doc = profile_doc(L=6, batch_size=4)
    truth = FixedCosts(forward_s=0.0, backward_s=5e-4, send_s=0.0, receive_s=0.0)
    layers, runs = _synthetic_runs(doc, truth, between=0.0, jitter=0.05)
    fit = fit_fixed_costs(doc, layers, 1, runs)
    assert all(fit[key] >= 0 for key in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s",
                                        "send_s", "receive_s"))
    assert fit["backward_s"] == pytest.approx(5e-4, rel=0.5)
    assert fit["spread"]["forward_s"] > 0 or fit["spread"]["backward_s"] > 0


def test_the_shared_fit_recovers_the_costs_that_made_the_runs() -> None:
    """Runs on 4 processes of a 2-core host whose steps are the planner's own time-shared steps
    with every action 1.35x slower, or 1.2x slower and 0.4 ms longer: the fit gives them back
    (zb-h1's three actions per micro-batch against two tell the two figures apart); runs faster
    than sharing alone can explain give 1 and 0, never less."""
    from gpipe_plan.profiles.fixedcosts import (MEASURED_STEPS, SHARED_CONFIGURATIONS, ProbeRun, _ProbeModel,
                                                fit_shared_slowdown, probes, shared_processes, window)

    doc = profile_doc(L=6, batch_size=4, device={"type": "cpu", "name": "synthetic", "threads": 1, "cores": 2},
                      fixed_costs=FIXED_RECORD)
    assert shared_processes(2, 1, 6) == 4 and shared_processes(2, 2, 6) == 2
    assert shared_processes(8, 1, 64) == 0 and shared_processes(2, 1, 3) == 0 and shared_processes(None, 1, 6) == 0
    first, end = window(doc, 1, 6)
    fixed = FixedCosts.from_record(FIXED_RECORD)
    for slowdown, added, scale, want in ((1.35, 0.0, 1.0, (1.35, 0.0)), (1.2, 4e-4, 1.0, (1.2, 4e-4)),
                                         (1.0, 0.0, 0.8, (1.0, 0.0))):
        runs = []
        for probe in probes(end - first, 4, SHARED_CONFIGURATIONS):
            model = _ProbeModel(doc, (first, end), 1, probe)
            step = model.step_s(fixed, FIXED_RECORD["between_actions_s"], slowdown, added)
            # one step's spans: too few for a spread, which the fit then leaves at 0 unmeasured
            runs.append(ProbeRun(probe, [[step * scale] * MEASURED_STEPS] * 4, [[(0, "forward", 0, 0.0, 0.0)]] * 4))
        assert [r.probe.schedule for r in runs] == ["1f1b", "zb-h1", "gpipe"]
        fit = fit_shared_slowdown(doc, (first, end), 1, runs)
        assert fit["concurrent_ranks"] == 2
        assert fit["slowdown"] == pytest.approx(want[0], rel=0.01), fit
        assert fit["per_action_s"] == pytest.approx(want[1], abs=2e-5), fit
        assert fit["spread"] == pytest.approx({"slowdown": 0.0, "per_action_s": 0.0}, abs=1e-6)
        for c in fit["configurations"]:
            assert c["measured_step_s"] == pytest.approx(c["predicted_step_s"] * scale, rel=2e-3)


# --------------------------------------------------------------------------- profile, for real
TINY = ["gpt", "--layers", "2", "--width", "16", "--heads", "2", "--seq-len", "8", "--micro-batch-sizes", "1,2",
        "--repeats", "2", "--warmup", "1", "--contention-processes", "0", "--no-recompute-timing"]


def test_profile_measures_the_fixed_costs_with_a_real_pipeline(tmp_path: Path) -> None:
    """Two processes, the native executor on gloo, the model's own 4 layers at every chunk count
    they allow (2 and 4: interleaved v=3 needs 6); a plan made from it charges what it measured."""
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["profile", *TINY, "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    fixed = json.loads(out.read_text())["fixed_costs"]
    assert (fixed["executor"], fixed["backend"], fixed["processes"]) == ("native", "gloo", 2)
    assert fixed["layers"] == ["embed", "block0", "block1", "head"] and fixed["micro_batch_size"] == 2
    for key in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "send_s", "receive_s",
                "between_actions_s"):
        assert 0.0 <= fixed[key] < 0.05, (key, fixed[key])
        assert fixed["spread"][key] >= 0.0
    assert [(c["schedule"], c["chunks"]) for c in fixed["configurations"]] == [
        ("1f1b", 2), ("zb-h1", 2), ("interleaved", 4), ("zb-v", 4)]
    assert all(c["measured_step_s"] > 0 and c["predicted_step_s"] > 0 for c in fixed["configurations"])
    assert 0 < fixed["seconds"] < 300
    assert 0 < fixed["optimizer_scale"] < 50 and fixed["optimizer_scale_spread"] >= 0   # Adam timed in the pipeline
    # ... and again on twice the processes this host runs at once, where it runs at most 4
    from gpipe_plan.hostload import usable_cores
    from gpipe_plan.profiles.fixedcosts import shared_processes

    processes = shared_processes(usable_cores(), 1, 4)
    shared = fixed.get("shared_cores")
    if processes:
        assert shared["processes"] == processes and shared["concurrent_ranks"] == processes / 2
        assert 1.0 <= shared["slowdown"] <= 4.0 and 0.0 <= shared["per_action_s"] <= 0.005
        assert set(shared["spread"]) == {"slowdown", "per_action_s"} and min(shared["spread"].values()) >= 0.0
        assert [c["schedule"] for c in shared["configurations"]] == ["1f1b", "zb-h1", "gpipe"]
        assert all(c["measured_step_s"] > 0 and c["predicted_step_s"] > 0 for c in shared["configurations"])
    else:
        assert shared is None
    # every profiled size measured; the record's own figures are the middle size's
    sizes = [entry["micro_batch_size"] for entry in fixed["per_micro_batch_size"]]
    assert sizes == [1, 2]
    middle = fixed["per_micro_batch_size"][1]
    assert all(middle[key] == fixed[key] for key in FIGURES)
    assert all(len(entry["configurations"]) == 4 for entry in fixed["per_micro_batch_size"])
    for M in (2, 1):    # micro-batches of 1 and of 2 (the profile's batch is 2)
        plan = tmp_path / f"plan{M}.json"
        assert CliRunner().invoke(main, ["solve", str(out), "-k", "2", "-m", str(M), "--out", str(plan),
                                         "-q"]).exit_code == 0
        doc = json.loads(plan.read_text())
        at = fixed["per_micro_batch_size"][sizes.index(doc["micro_batch_size"])]
        charged = doc["options"]
        assert charged["fixed_costs"]["send_s"] == at["send_s"]
        assert charged["per_microbatch_overhead_s"] == at["between_actions_s"]


def test_no_fixed_costs_leaves_them_out_and_the_plan_says_so(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["profile", *TINY, "--no-fixed-costs", "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert "fixed_costs" not in doc and doc["version"] == 14
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(main, ["solve", str(out), "-k", "2", "--out", str(plan), "-q"]).exit_code == 0
    assert any("measured no fixed costs" in w for w in json.loads(plan.read_text())["warnings"])
