"""The planner's solvers are exact: DP, 1F1B branch and bound and the ILP all equal brute force.

Brute force (planner.brute) tries every partition and every per-stage recompute choice, so
agreeing with it also proves the solvers' per-stage recompute rule. Brute force itself is
held to an independent reference model (tests/helpers/planner.py, written from docs/planner.md),
so a bug shared by the cost model and every solver would still show.

Also here: interpolation of a profile between micro-batch sizes, and the search over
micro-batch counts and schedules.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpipe_plan.artifacts import BadInput
from gpipe_plan.planner.baselines import min_max
from gpipe_plan.planner.brute import brute_force, partitions
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.gpipe_solver import GPipeSolver
from gpipe_plan.planner.ilp import solve_ilp
from gpipe_plan.planner.objective import evaluate, work_floor
from gpipe_plan.planner.onefoneb import OneFOneBSolver
from gpipe_plan.planner.profile import Profile, interpolate
from gpipe_plan.planner.problem import SolveOptions, one_pipeline
from gpipe_plan.planner.search import search
from gpipe_plan.planner.settings import schedule_shapes
from gpipe_plan.planner.solvers import solve_cost_model
from gpipe_plan.schedules import problem

from helpers.planner import (close, hyp, instances, make_figures, profile_doc, ref_brute, ref_evaluate,
                             schedule_case)

# planner/ilp.py uses pulp APIs that pulp deprecates for its 4.0 (thousands of warnings a run).
pytestmark = pytest.mark.filterwarnings("ignore:.*PuLP 4:DeprecationWarning")


# --------------------------------------------------------------------------- exactness
def check_exact(cm: CostModel, solution, rel: float) -> None:
    """``solution`` is an optimum: same feasibility and step as brute force, a valid partition
    that fits in memory (by the reference model too), proven, with a lower bound below it."""
    best = brute_force(cm)
    if best is None:
        assert solution is None, "brute force finds nothing that fits, the solver returned a plan"
        return
    assert solution is not None, f"the solver found no plan; brute force found {best.bounds} at {best.step_s}"
    ev = solution.evaluation
    assert close(ev.step_s, best.step_s, rel), (ev.bounds, ev.step_s, best.bounds, best.step_s)
    assert solution.proven
    assert solution.lower_bound_s <= best.step_s * (1 + rel) + 1e-15
    bounds = ev.bounds
    assert len(bounds) == cm.K + 1 and bounds[0] == 0 and bounds[-1] == cm.L
    assert all(a < b for a, b in zip(bounds, bounds[1:])), bounds
    assert ev.fits
    if cm.setting.recompute == "never":
        assert not any(ev.recompute)
    if cm.setting.recompute == "always":
        assert all(ev.recompute)
    ref = ref_evaluate(cm.figures, cm.setting, bounds, ev.recompute)
    assert ref["fits"], (bounds, ev.recompute, ref["memory"], cm.limit)
    assert close(ref["step"], ev.step_s, 1e-9), (ref["step"], ev.step_s)


@hyp(300)
@given(instances(schedule="gpipe"))
def test_gpipe_dp_equals_brute_force(instance):
    fig, setting = instance
    cm = CostModel(fig, setting)
    check_exact(cm, GPipeSolver(cm).solve(), 1e-9)


@hyp(120)
@given(instances(schedule="gpipe", max_layers=10, max_micro_batches=16))
def test_gpipe_dp_equals_brute_force_on_larger_instances(instance):
    """Up to 10 layers and 16 micro-batches: where the box search's pruning starts to matter."""
    fig, setting = instance
    cm = CostModel(fig, setting)
    check_exact(cm, GPipeSolver(cm).solve(), 1e-9)


@hyp(250)
@given(instances(schedule="1f1b"))
def test_onefoneb_branch_and_bound_equals_brute_force(instance):
    fig, setting = instance
    cm = CostModel(fig, setting)
    check_exact(cm, OneFOneBSolver(cm).solve(), 1e-9)


@hyp(200)
@given(instances())
def test_the_work_floor_is_below_every_plan(instance):
    """What a search out of time before its bounds reports: the average stage's work, the heaviest
    layer's M forwards and backwards, and stage 0's least optimizer step, never above the optimum."""
    fig, setting = instance
    cm = CostModel(fig, setting)
    best = brute_force(cm)
    if best is not None:
        assert work_floor(cm) <= best.step_s * (1 + 1e-12) + 1e-15


def test_the_work_floor_counts_the_heaviest_layer():
    """One layer holding most of the work: no cut can spread it, so the floor is its M passes."""
    fig = make_figures([1e-3] + [1e-5] * 7, [2e-3] + [1e-5] * 7)
    cm = CostModel(fig, Setting(stages=4, micro_batches=8, schedule="1f1b"))
    assert work_floor(cm) >= 8 * 3e-3


@hyp(60)
@given(instances(schedule="gpipe"))
def test_ilp_gpipe_equals_brute_force(instance):
    fig, setting = instance
    cm = CostModel(fig, setting)
    check_exact(cm, solve_ilp(cm), 1e-7)


@hyp(40)
@given(instances(schedule="1f1b", max_layers=7, max_micro_batches=6))
def test_ilp_1f1b_equals_brute_force(instance):
    fig, setting = instance
    cm = CostModel(fig, setting)
    check_exact(cm, solve_ilp(cm), 1e-7)


@hyp(80)
@given(instances(tied=True))
def test_every_exact_solver_charges_tied_weights_as_brute_force(instance):
    """Tied weights: a stage holding some of a tie's layers pays an exchange of its gradient;
    the DP, the branch and bound and the ILP find the plan brute force finds."""
    fig, setting = instance
    cm = CostModel(fig, setting)
    solver = GPipeSolver if setting.schedule == "gpipe" else OneFOneBSolver
    check_exact(cm, solver(cm).solve(), 1e-9)
    if fig.num_layers <= 7 and setting.micro_batches <= 6:
        check_exact(cm, solve_ilp(cm), 1e-7)


def test_a_split_tie_costs_one_exchange_per_holding_stage():
    fig = make_figures([1.0] * 4, [1.0] * 4, optimizer=[0.0] * 4, tied=[((0, 3), 1000.0)])
    cm = CostModel(fig, Setting(stages=2, micro_batches=1, link_bandwidth_bytes_per_s=1e4, link_latency_s=0.01))
    assert cm.optimizer(0, 2) == pytest.approx(0.11) and cm.optimizer(2, 4) == pytest.approx(0.11)
    assert cm.optimizer(0, 4) == 0.0  # one stage holds both uses: nothing to exchange
    free = CostModel(fig, Setting(stages=2, micro_batches=1))
    assert free.optimizer(0, 2) == 0.0  # communication free: so is the exchange


@hyp(60)
@given(instances(max_layers=6, max_stages=3, max_micro_batches=5))
def test_brute_force_equals_reference_brute_force(instance):
    """The reference: a second brute force over the independent cost model and simulator."""
    fig, setting = instance
    best = brute_force(CostModel(fig, setting))
    ref = ref_brute(fig, setting)
    assert (best is None) == (ref is None)
    if best is not None:
        assert close(best.step_s, ref["step"], 1e-9), (best.bounds, best.step_s, ref["bounds"], ref["step"])


_CUTOFF_FACTORS = [0.0, 0.5, 0.9, 1.0, 1.001, 1.1, math.inf]


def check_cutoff(fig, setting, factor: float) -> None:
    """``cutoff_s`` is a step already achieved by another setting (planner.search). Below it the
    solver must still find the optimum; at or above it, it may stop with the best plan found so
    far, but its lower bound must stay a true bound, reach the cutoff unless it is proven, and
    `proven` must mean optimal."""
    cm = CostModel(fig, setting)
    best = brute_force(cm)
    optimum = best.step_s if best else math.inf
    cutoff = 0.0 if factor == 0 else (optimum * factor if math.isfinite(optimum) else math.inf)
    if setting.schedule == "gpipe":
        sol = GPipeSolver(cm).solve(cutoff_s=cutoff)
    else:
        sol = OneFOneBSolver(cm, cutoff_s=cutoff).solve()
    if best is None:
        assert sol is None
        return
    assert sol is not None and sol.evaluation.fits
    step = sol.evaluation.step_s
    assert step >= optimum * (1 - 1e-9)
    assert sol.lower_bound_s <= optimum * (1 + 1e-9) + 1e-15
    if optimum < cutoff * (1 - 1e-9):
        assert close(step, optimum, 1e-9) and sol.proven
    elif sol.proven:
        assert close(step, optimum, 1e-9), (step, optimum)
    else:
        assert sol.lower_bound_s >= min(step, cutoff) * (1 - 1e-9)


@hyp(200)
@given(instances(schedule="gpipe"), st.sampled_from(_CUTOFF_FACTORS))
def test_gpipe_cutoff_keeps_the_solver_exact_below_it(instance, factor):
    check_cutoff(*instance, factor)


@hyp(150)
@given(instances(schedule="1f1b"), st.sampled_from(_CUTOFF_FACTORS))
def test_onefoneb_cutoff_keeps_the_solver_exact_below_it(instance, factor):
    check_cutoff(*instance, factor)


def test_partitions_are_all_compositions():
    """C(L-1, K-1) distinct partitions into non-empty contiguous stages."""
    for L in range(1, 8):
        for K in range(1, L + 1):
            found = list(partitions(L, K))
            assert len(found) == len(set(found)) == math.comb(L - 1, K - 1)
            assert all(b[0] == 0 and b[-1] == L and all(x < y for x, y in zip(b, b[1:])) for b in found)


def test_gpipe_objective_is_not_min_max_of_forward_plus_backward():
    """Layers (F, B) in ms: (4, 0), (0, 4), (1, 1); K = 2, M = 4. By hand:
    [a | b c]: max F = 4, max B = 5, step = 10 + 3 * 9 = 37 ms (min-max of F+B picks this: 6 < 8);
    [a b | c]: max F = 4, max B = 4, step = 10 + 3 * 8 = 34 ms (the true optimum)."""
    fig = make_figures([4e-3, 0.0, 1e-3], [0.0, 4e-3, 1e-3])
    cm = CostModel(fig, Setting(stages=2, micro_batches=4))
    sol = GPipeSolver(cm).solve()
    assert sol.evaluation.bounds == (0, 2, 3)
    assert sol.evaluation.step_s == pytest.approx(34e-3, rel=1e-12)
    assert min_max([f + b for f, b in zip(fig.forward_s, fig.backward_s)], 2) == (0, 1, 3)
    assert evaluate(cm, (0, 1, 3)).step_s == pytest.approx(37e-3, rel=1e-12)


def test_gpipe_cuts_where_the_link_is_free():
    """Six layers, K = 4, M = 2; only layers 3 and 4 take time (0.5 ms of backward each); the cuts
    before layers 2 and 4 send 1 byte over a 1e5 B/s link (10 us), the others send nothing.
    Layers 3 and 4 must be apart (else a stage's backward is 1 ms), so the cut before 4 is paid;
    the two other cuts are free ones (before 1, 3 or 5). By hand, the closed form gives
    forward 0 + 10 us + 1 x 10 us, backward 1 ms + 10 us + 1 x 0.5 ms: 1.53 ms in all."""
    fig = make_figures([0.0] * 6, [0.0, 0.0, 0.0, 5e-4, 5e-4, 0.0], output=[0, 1, 0, 1, 0, 0])
    cm = CostModel(fig, Setting(stages=4, micro_batches=2, link_bandwidth_bytes_per_s=1e5))
    sol = GPipeSolver(cm).solve()
    assert sol.proven and sol.evaluation.step_s == pytest.approx(1.53e-3, rel=1e-12)
    assert 4 in sol.evaluation.bounds and 2 not in sol.evaluation.bounds
    assert close(solve_ilp(cm).evaluation.step_s, 1.53e-3, 1e-7)


def test_recompute_only_where_memory_needs_it():
    """Two equal layers, 100 activation bytes each, input 10 bytes, K = 2, M = 4, no params.
    Without recompute a stage holds 4 * 100 = 400 B. Recomputing, it holds the inputs of the
    other 3 micro-batches in flight and one micro-batch's activations (which include its input):
    stage 0: 3 * 10 + 100 = 130 B, stage 1: 3 * out[0] + 100 = 3 * 20 + 100 = 160 B.
    A 300 B or a 160 B limit makes both recompute; 400 B needs none; 159 B, or 300 B with
    recomputation ruled out, fits nothing."""
    fig = make_figures([1e-3, 1e-3], [2e-3, 2e-3], activation=[100, 100], output=[20, 20], input_bytes=10)

    def solve(limit, recompute):
        cm = CostModel(fig, Setting(stages=2, micro_batches=4, recompute=recompute, memory_limit_bytes=limit))
        return GPipeSolver(cm).solve()

    sol = solve(300, "auto")
    assert sol.evaluation.recompute == (True, True)
    assert [s.memory_bytes for s in sol.evaluation.stages] == [130, 160]
    # backward 2 ms + recomputed forward 1 ms; step = (1 + 1 + 3 * 1) + (3 + 3 + 3 * 3) = 20 ms
    assert sol.evaluation.step_s == pytest.approx(20e-3, rel=1e-12)
    assert solve(160, "auto").evaluation.recompute == (True, True)
    assert solve(400, "auto").evaluation.recompute == (False, False)
    assert solve(300, "never") is None
    assert solve(159, "auto") is None
    assert solve(159, "always") is None


# --------------------------------------------------------------------------- interpolation
def test_interpolate_between_sizes():
    assert interpolate([1, 2, 4], [10.0, 20.0, 60.0], 3) == pytest.approx(40.0)
    assert interpolate([1, 2, 4], [10.0, 20.0, 60.0], 1.5) == pytest.approx(15.0)
    for x, y in zip([1, 2, 4], [10.0, 20.0, 60.0]):
        assert interpolate([1, 2, 4], [10.0, 20.0, 60.0], x) == y


def test_interpolate_extrapolates_linearly_and_clamps_at_zero():
    # above: the line through the last two points, (2, 1) and (4, 5): slope 2
    assert interpolate([1, 2, 4], [3.0, 1.0, 5.0], 8) == pytest.approx(13.0)
    # below: the line through the first two, (2, 1) and (4, 5): 1 - 2 * 0.5 = 0 at 1.5, -1 at 1
    assert interpolate([2, 4], [1.0, 5.0], 1.5) == pytest.approx(0.0, abs=1e-15)
    assert interpolate([2, 4], [1.0, 5.0], 1) == 0.0
    # decreasing past the end: (1, 10), (2, 4): at 4 the line gives -8, clamped
    assert interpolate([1, 2], [10.0, 4.0], 4) == 0.0
    assert interpolate([1, 2], [10.0, 4.0], 1.5) == pytest.approx(7.0)


def test_interpolate_single_size_scales_through_zero():
    assert interpolate([4], [8.0], 2) == pytest.approx(4.0)
    assert interpolate([4], [8.0], 8) == pytest.approx(16.0)
    assert interpolate([4], [8.0], 1) == pytest.approx(2.0)
    assert interpolate([4], [8.0], 0) == 0.0


@hyp(200)
@given(st.lists(st.integers(1, 64), min_size=2, max_size=6, unique=True).map(sorted),
       st.data())
def test_interpolate_matches_the_segment_line(xs, data):
    ys = data.draw(st.lists(st.floats(0, 100), min_size=len(xs), max_size=len(xs)))
    x = data.draw(st.floats(0.5, 128))
    # the segment: the two measured sizes around x, or the two nearest ones outside the range
    i = 0 if x <= xs[0] else (len(xs) - 2 if x >= xs[-1] else max(j for j in range(len(xs) - 1) if xs[j] <= x))
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    expected = max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    assert interpolate(xs, ys, x) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_profile_at_interpolates_every_per_size_field():
    doc = profile_doc(L=2, sizes=(2, 4))
    doc["input_bytes"] = [60, 120]
    doc["layers"][0]["peak_transient_bytes"] = [10, 30]
    fig = Profile(doc).at(3)
    layer = doc["layers"][0]
    mid = lambda series: (series[0] + series[1]) / 2      # noqa: E731 - 3 is half-way from 2 to 4
    assert fig.forward_s[0] == pytest.approx(mid(layer["forward_s"]))
    assert fig.backward_s[0] == pytest.approx(mid(layer["backward_s"]))
    assert fig.activation_bytes[0] == pytest.approx(mid(layer["activation_bytes"]))
    assert fig.output_bytes[0] == pytest.approx(mid(layer["output_bytes"]))
    assert fig.transient_bytes == (pytest.approx(20.0), 0.0)
    assert fig.input_bytes == pytest.approx(90.0)
    assert fig.param_bytes[0] == layer["param_bytes"]       # parameters do not scale with b


# --------------------------------------------------------------------------- search
_SEARCH_SIZES = (1, 2, 4)


@st.composite
def linear_profiles(draw):
    """A profile whose times are exactly affine in the micro-batch size (so that interpolating
    and extrapolating are exact), no communication, and sometimes an optimizer step per layer
    and a per-micro-batch overhead (which make the GPipe search more than a staircase walk)."""
    L = draw(st.integers(2, 7))
    K = draw(st.integers(1, min(4, L)))
    grid = st.integers(0, 8).map(lambda x: x * 0.25e-3)
    coeff = {
        "forward_per_sample": draw(st.lists(grid, min_size=L, max_size=L)),
        "backward_per_sample": draw(st.lists(grid, min_size=L, max_size=L)),
        "forward_fixed": draw(st.lists(grid, min_size=L, max_size=L)),
        "backward_fixed": draw(st.lists(grid, min_size=L, max_size=L)),
        "activation_per_sample": draw(st.lists(st.integers(1, 500), min_size=L, max_size=L)),
        "output_per_sample": draw(st.lists(st.integers(1, 500), min_size=L, max_size=L)),
        "param_bytes": draw(st.lists(st.integers(0, 5000), min_size=L, max_size=L)),
    }
    optimizer = draw(st.none() | st.lists(st.integers(0, 8).map(lambda x: x * 0.5e-3), min_size=L, max_size=L))
    overhead = draw(st.sampled_from([0.0, 0.0, 0.5e-3, 2e-3]))
    batch = draw(st.sampled_from([4, 6, 8, 12]))
    recompute = draw(st.sampled_from(["never", "auto"]))
    limit = draw(st.sampled_from([None, 12000, 20000, 40000]))
    return L, K, batch, recompute, limit, coeff, optimizer, overhead


def exact_figures(coeff: dict, b: int, optimizer):
    """The figures at size b straight from the coefficients (no interpolation)."""
    L = len(coeff["forward_per_sample"])
    return make_figures(
        [coeff["forward_fixed"][i] + coeff["forward_per_sample"][i] * b for i in range(L)],
        [coeff["backward_fixed"][i] + coeff["backward_per_sample"][i] * b for i in range(L)],
        [coeff["activation_per_sample"][i] * b for i in range(L)],
        [coeff["output_per_sample"][i] * b for i in range(L)],
        coeff["param_bytes"], optimizer=optimizer, size=b)


def linear_profile_doc(L, batch, coeff, optimizer, overhead) -> dict:
    doc = profile_doc(L=L, sizes=_SEARCH_SIZES, batch_size=batch, **coeff)
    if optimizer is not None:
        for layer, t in zip(doc["layers"], optimizer):
            layer["optimizer_s"] = t
    if overhead:
        doc["overhead"] = {"per_microbatch_s": overhead}
    return doc


@hyp(40)
@given(linear_profiles())
def test_search_picks_the_best_setting(case):
    """The plan's choice is the least brute-force optimum over every setting (M, schedule) at
    its exact figures, and never worse than a runner-up. A runner-up is that setting's optimum
    when it says proven; otherwise the search stopped it early because it could not beat the
    chosen plan (docs/plan-format.md), which brute force must confirm."""
    L, K, batch, recompute, limit, coeff, optimizer, overhead = case
    profile = Profile(linear_profile_doc(L, batch, coeff, optimizer, overhead))
    options = SolveOptions(stages=K, recompute=recompute, memory_limit_bytes=limit, time_budget_s=60)
    expected = {}
    for m in [d for d in range(1, batch + 1) if batch % d == 0]:
        for schedule, v in schedule_shapes(one_pipeline(profile, options), L):
            if problem(schedule, K, m, v):
                continue
            # the per-micro-batch overhead is charged only when there is a pipeline (K > 1)
            setting = Setting(stages=K, micro_batches=m, schedule=schedule, recompute=recompute,
                              memory_limit_bytes=limit, overhead_s=overhead if K > 1 else 0.0, virtual_stages=v)
            best = brute_force(CostModel(exact_figures(coeff, batch // m, optimizer), setting))
            expected[(m, schedule, v)] = best.step_s if best else math.inf
    if all(v == math.inf for v in expected.values()):
        with pytest.raises(BadInput, match="no plan fits"):
            search(profile, options)
        return
    result = search(profile, options)
    assert {(c.setting.micro_batches, c.setting.schedule, c.setting.virtual_stages)
            for c in result.candidates} == set(expected)
    chosen = result.best
    assert chosen.solution is not None
    assert close(chosen.step_s, min(expected.values()), 1e-9), (chosen.setting, chosen.step_s, expected)
    assert result.proven and result.lower_bound_s <= chosen.step_s * (1 + 1e-9)
    for c in result.candidates:
        want = expected[(c.setting.micro_batches, c.setting.schedule, c.setting.virtual_stages)]
        assert (c.solution is None) == (want == math.inf)
        if c.solution is None:
            continue
        assert c.micro_batch_size * c.setting.micro_batches == batch
        assert c.step_s >= want * (1 - 1e-9)            # a real plan of that setting
        assert c.lower_bound_s <= want * (1 + 1e-9)     # a true lower bound
        if c.solution.proven:
            assert close(c.step_s, want, 1e-9), (c.setting, c.step_s, want)
        else:
            assert want >= chosen.step_s * (1 - 1e-9)
    for runner_up in result.candidates[1:]:
        assert chosen.step_s <= runner_up.step_s


def test_search_fixed_micro_batches_must_divide_the_batch():
    profile = Profile(profile_doc(L=4, batch_size=8))
    with pytest.raises(BadInput, match=r"--micro-batches 3 does not divide the global batch of 8.*1, 2, 4, 8"):
        search(profile, SolveOptions(stages=2, micro_batches=3))
    with pytest.raises(BadInput, match="does not divide"):
        search(profile, SolveOptions(stages=2, micro_batches=5, global_batch_size=12))
    result = search(profile, SolveOptions(stages=2, micro_batches=4))
    assert {c.setting.micro_batches for c in result.candidates} == {4}
    assert result.best.micro_batch_size == 2
    result = search(profile, SolveOptions(stages=2, micro_batches=3, global_batch_size=12))
    assert result.best.micro_batch_size == 4


def test_ilp_with_zero_forward_times():
    cm = CostModel(make_figures([0.0, 0.0], [1e-3, 2e-3]), Setting(stages=2, micro_batches=2, recompute="auto"))
    check_exact(cm, solve_ilp(cm), 1e-7)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("seed", range(8))
def test_on_shared_cores_the_ilp_bounds_and_proves_only_what_it_reaches(schedule: str, seed: int) -> None:
    """More ranks than cores (planner/timeshare.py), ``--solver ilp`` for GPipe and 1F1B (the CBC
    ILP): it optimises the dedicated step, a bound on every time-shared plan; its plan is called
    proven only where the plan's time-shared step meets that bound. One pipeline
    (data_parallel = 1): the ILP models no replicas, and the command line refuses ``--solver ilp``
    with them (planner/replicas.py)."""
    fig, setting = schedule_case(random.Random(f"shared-ilp-{schedule}-{seed}"), schedule, 1)
    cm = CostModel(fig, replace(setting, concurrent_ranks=1.0, data_parallel=1))
    assert cm.setting.time_shared
    want = brute_force(cm)
    got = solve_cost_model(cm, "ilp", 60, work_budget_s=60)
    if want is None:
        assert got is None
        return
    assert got.evaluation.fits and got.evaluation.step_s >= want.step_s * (1 - 1e-12)
    assert got.lower_bound_s <= want.step_s * (1 + 1e-9) + 1e-15
    if got.proven:
        assert got.evaluation.step_s == pytest.approx(want.step_s, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_ilp_solves_layers_far_cheaper_than_their_exchange(schedule: str) -> None:
    """Layers of 1e-257 s beside a 0.15 s tied exchange: scaled by the layers alone, the
    exchange's coefficient was 1e253 and CBC returned no plan."""
    fig = make_figures([1e-257, 2e-257], [1e-257, 3e-257], tied=[((0, 1), 1000.0)])
    cm = CostModel(fig, Setting(stages=2, micro_batches=2, schedule=schedule, link_bandwidth_bytes_per_s=1e4,
                                link_latency_s=0.01))
    check_exact(cm, solve_ilp(cm), 1e-7)


def test_a_setting_the_branch_and_bound_finds_no_plan_for_in_time_goes_to_the_milp():
    """One cut in 1,287 fits the memory limit: the branch and bound, out of its share, found none,
    and the setting read as "nothing fits" although the MILP, which looks at every cut at once,
    had the budget to find and prove it."""
    from gpipe_plan.planner import milp

    if milp.available() is None:
        pytest.skip("no MILP solver installed")
    rng = random.Random(2)
    L = 14
    fig = make_figures([rng.uniform(1e-4, 2e-3) for _ in range(L)], [rng.uniform(2e-4, 4e-3) for _ in range(L)],
                       activation=[rng.randint(10, 400) for _ in range(L)], params=[rng.randint(10, 400) for _ in range(L)])
    base = Setting(2, 6, "interleaved", "never", virtual_stages=3)
    free = CostModel(fig, base)
    least = min(evaluate(free, b).peak_memory_bytes for b in partitions(L, free.C))
    cm = CostModel(fig, replace(base, memory_limit_bytes=least + 1))
    assert sum(evaluate(cm, b).fits for b in partitions(L, cm.C)) == 1
    want = brute_force(cm)
    got = solve_cost_model(cm, "exact", 1.0)
    assert got is not None and got.proven and "milp" in got.stats
    assert got.evaluation.step_s == pytest.approx(want.step_s, rel=1e-12)
