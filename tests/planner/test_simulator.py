"""The schedules: GPipe's closed form, the event simulator, operation orders, bubble, memory,
and the 1F1B lower bound. The reference model in helpers.planner is written from docs/planner.md."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.onefoneb import OneFOneBSolver
from gpipe_plan.planner.simulator import ChunkTimes, Timeline, gpipe_makespan, simulate_plan
from gpipe_plan.schedules import all_actions

from helpers.planner import (bounds_strategy, close, hyp, instances, make_figures, ref_evaluate,
                             ref_gpipe_closed_form, ref_makespan, ref_stage)

_t = st.floats(0.0, 0.01, allow_nan=False)


def simulate_times(schedule: str, forward_s: Sequence[float], backward_s: Sequence[float], send_s: Sequence[float],
                   M: int, optimizer_s: Sequence[float] | None = None, recompute_s: Sequence[float] | None = None,
                   record: bool = False) -> Timeline:
    """:func:`simulate_plan` of gpipe or 1f1b (one chunk per stage) from per-stage lists, as the
    tests below state their cases: ``send_s`` has one entry per cut (K-1)."""
    K = len(forward_s)
    chunks = [ChunkTimes(forward_s[k], backward_s[k], 0.0, 0.0, send_s[k] if k < K - 1 else 0.0,
                         recompute_s[k] if recompute_s else 0.0) for k in range(K)]
    return simulate_plan(schedule, K, M, 1, chunks, optimizer_s, record)


@st.composite
def pipelines(draw, max_stages: int = 6, max_micro_batches: int = 10, sends: bool = True):
    """Per-stage times F, B (one per stage), link times C (one per cut), and M."""
    K = draw(st.integers(1, max_stages))
    M = draw(st.integers(1, max_micro_batches))
    F = draw(st.lists(_t, min_size=K, max_size=K))
    B = draw(st.lists(_t, min_size=K, max_size=K))
    C = draw(st.lists(_t, min_size=K - 1, max_size=K - 1)) if sends and draw(st.booleans()) else [0.0] * (K - 1)
    return F, B, C, M


# --------------------------------------------------------------------------- simulator vs closed form
@hyp(300)
@given(pipelines())
def test_simulator_agrees_with_gpipe_closed_form(case):
    F, B, C, M = case
    simulated = simulate_times("gpipe", F, B, C, M).makespan_s
    closed = gpipe_makespan(F, B, C, M)
    assert close(simulated, closed, 1e-9), (simulated, closed)
    assert close(closed, ref_gpipe_closed_form(F, B, C, M), 1e-9)
    assert close(simulated, ref_makespan("gpipe", F, B, C, M), 1e-9)


@hyp(300)
@given(pipelines())
def test_simulator_1f1b_agrees_with_reference_recursion(case):
    F, B, C, M = case
    assert close(simulate_times("1f1b", F, B, C, M).makespan_s, ref_makespan("1f1b", F, B, C, M), 1e-9)


@hyp(150)
@given(pipelines(max_stages=5, max_micro_batches=6), st.sampled_from(["gpipe", "1f1b"]), st.data())
def test_recorded_timeline_respects_dependencies(case, schedule, data):
    """What the SVG draws: each stage runs M forwards and M backwards one at a time; a forward
    starts after its input arrived, a backward after its gradient arrived (last stage: after
    its own forward); the recomputed forward is the first part of a backward."""
    F, B, C, M = case
    K = len(F)
    R = [data.draw(st.floats(0.0, 1.0)) * b for b in B]       # recompute part of each backward
    opt = data.draw(st.lists(_t, min_size=K, max_size=K))
    tl = simulate_times(schedule, F, B, C, M, optimizer_s=opt, recompute_s=R, record=True)
    eps = 1e-12
    at = {(e.kind, e.stage, e.micro_batch): e for e in tl.events if e.kind in ("forward", "backward")}
    assert len(at) == 2 * K * M
    for k in range(K):
        ops = sorted((e for e in tl.events if e.stage == k and e.kind in ("forward", "backward", "recompute")),
                     key=lambda e: (e.start_s, e.end_s))
        for a, b in zip(ops, ops[1:]):
            assert b.start_s >= a.end_s - eps, (k, a, b)           # one operation at a time
        for m in range(M):
            f, b = at[("forward", k, m)], at[("backward", k, m)]
            assert f.end_s - f.start_s == pytest.approx(F[k], abs=1e-15)
            if k > 0:
                assert f.start_s >= at[("forward", k - 1, m)].end_s + C[k - 1] - eps
            if k < K - 1:
                assert b.start_s >= at[("backward", k + 1, m)].end_s + C[k] + R[k] - eps
            else:
                assert b.start_s >= f.end_s + R[k] - eps
            if R[k] > 0:
                rc = [e for e in tl.events if e.kind == "recompute" and e.stage == k and e.micro_batch == m]
                assert len(rc) == 1 and rc[0].end_s == pytest.approx(b.start_s, abs=1e-15)
                assert rc[0].end_s - rc[0].start_s == pytest.approx(R[k], abs=1e-15)
    assert tl.makespan_s == pytest.approx(max(e.end_s for e in at.values()), abs=1e-15)
    assert tl.busy_s == pytest.approx([M * (F[k] + B[k]) + opt[k] for k in range(K)])


# --------------------------------------------------------------------------- bubble
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("K,M", [(1, 1), (1, 7), (2, 1), (2, 4), (3, 3), (4, 8), (4, 16), (6, 5), (8, 32)])
def test_balanced_stages_have_bubble_k_minus_1_over_m_plus_k_minus_1(schedule, K, M):
    """K equal stages of two layers each, no communication: the step is (M + K - 1)(F + B),
    of which every stage is busy M (F + B), so the idle share is (K - 1) / (M + K - 1)."""
    layers = 2 * K
    fig = make_figures([0.5e-3] * layers, [1.25e-3] * layers, activation=[10] * layers)
    cm = CostModel(fig, Setting(stages=K, micro_batches=M, schedule=schedule))
    ev = evaluate(cm, tuple(range(0, layers + 1, 2)))
    assert ev.step_s == pytest.approx((M + K - 1) * 2 * (0.5e-3 + 1.25e-3), rel=1e-12)
    assert ev.bubble_fraction(M) == pytest.approx((K - 1) / (M + K - 1), rel=1e-12, abs=1e-15)


# --------------------------------------------------------------------------- memory of 1F1B vs GPipe
@hyp(200)
@given(instances(schedule="gpipe", max_micro_batches=8), st.data())
def test_1f1b_holds_less_memory_than_gpipe(instance, data):
    """Same partition, M > K, non-zero activations: stage k holds min(M, K-k) < M micro-batches,
    so it saves (M - (K - k)) of them: act_k each without recomputation, the stage input with it."""
    fig, setting = instance
    K, M = setting.stages, setting.micro_batches
    assume(M > K)
    bounds = data.draw(bounds_strategy(fig.num_layers, K))
    recompute = data.draw(st.lists(st.booleans(), min_size=K, max_size=K))
    gpipe = CostModel(fig, setting).layout(bounds, recompute)[1]
    onefoneb = CostModel(fig, Setting(**{**setting.__dict__, "schedule": "1f1b"})).layout(bounds, recompute)[1]
    for k in range(K):
        s, e = bounds[k], bounds[k + 1]
        saved_per_microbatch = ((fig.input_bytes if s == 0 else fig.output_bytes[s - 1]) if recompute[k]
                                else sum(fig.activation_bytes[s:e]))
        assert gpipe[k].in_flight == M and onefoneb[k].in_flight == K - k
        assert gpipe[k].memory_bytes - onefoneb[k].memory_bytes == pytest.approx(
            (M - (K - k)) * saved_per_microbatch, abs=1e-6)
        if saved_per_microbatch > 0:
            assert onefoneb[k].memory_bytes < gpipe[k].memory_bytes
    if all(r is False for r in recompute) and all(a > 0 for a in fig.activation_bytes):
        assert max(s.memory_bytes for s in onefoneb) < max(s.memory_bytes for s in gpipe)


@hyp(200)
@given(instances(), st.data())
def test_cost_model_matches_the_reference(instance, data):
    """Per-stage times, sends, memory and the step of any partition and recompute choice."""
    fig, setting = instance
    cm = CostModel(fig, setting)
    bounds = data.draw(bounds_strategy(fig.num_layers, setting.stages))
    recompute = data.draw(st.lists(st.booleans(), min_size=setting.stages, max_size=setting.stages))
    ev = evaluate(cm, bounds, recompute)
    ref = ref_evaluate(fig, setting, bounds, recompute)
    for k, (chunk, stage) in enumerate(zip(ev.chunks, ev.stages)):
        want = ref["stages"][k]
        assert chunk.stage == stage.index == k and stage.chunks == (k,)
        assert chunk.forward_s == pytest.approx(want["F"], rel=1e-9, abs=1e-15)
        assert chunk.backward_s == pytest.approx(want["B"], rel=1e-9, abs=1e-15)
        assert chunk.send_s == pytest.approx(want["C"], rel=1e-9, abs=1e-15)
        assert stage.memory_bytes == pytest.approx(want["memory"], rel=1e-12)
        assert stage.in_flight == want["in_flight"]
    assert close(ev.step_s, ref["step"], 1e-9)
    assert ev.fits == ref["fits"]
    # With recompute left to the cost model, a stage recomputes exactly when it must.
    if setting.recompute == "auto" and setting.memory_limit_bytes is not None:
        for k, stage in enumerate(cm.layout(bounds)[1]):
            plain_fits = ref_stage(fig, setting, bounds, k, False)["memory"] <= setting.memory_limit_bytes
            assert stage.recompute == (not plain_fits)


# --------------------------------------------------------------------------- operation orders
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_operation_order_runs_each_micro_batch_forward_then_backward(schedule):
    for K in range(1, 8):
        for M in range(1, 13):
            for k, actions in enumerate(all_actions(schedule, K, M)):
                order = [(a.kind, a.micro_batch) for a in actions]
                assert {a.chunk for a in actions} == {k}
                assert Counter(order) == Counter([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
                where = {op: i for i, op in enumerate(order)}
                assert all(where[("B", m)] > where[("F", m)] for m in range(M)), (K, M, k, order)
                # micro-batches enter and leave in order (links are FIFO)
                assert [m for kind, m in order if kind == "F"] == list(range(M))
                assert [m for kind, m in order if kind == "B"] == list(range(M))
                # what the memory model counts: micro-batches in flight at once
                in_flight, most = 0, 0
                for kind, _ in order:
                    in_flight += 1 if kind == "F" else -1
                    most = max(most, in_flight)
                expected = M if schedule == "gpipe" else min(M, K - k)
                assert most == expected
                cm = CostModel(make_figures([1.0] * K, [1.0] * K), Setting(stages=K, micro_batches=M, schedule=schedule))
                assert cm.in_flight(k) == expected


def test_1f1b_order_by_hand():
    """K = 3, M = 4, stage 0: three warm-up forwards, then one backward one forward, then drain."""
    order = [[(a.kind, a.micro_batch) for a in actions] for actions in all_actions("1f1b", 3, 4)]
    assert order[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert order[2] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]


# --------------------------------------------------------------------------- the 1F1B lower bound
# The bound must never exceed the simulated step (else the search would prune the best plan);
# it need not equal it, and with K >= 2 stages it sometimes falls below, so only the first is asserted.
# How often it is tight on these instances: docs/benchmarks/notes.md.
@hyp(300)
@given(instances(schedule="1f1b"), st.data())
def test_1f1b_partition_bound_never_exceeds_the_simulated_step(instance, data):
    fig, setting = instance
    cm = CostModel(fig, setting)
    bounds = data.draw(bounds_strategy(fig.num_layers, setting.stages))
    bound = OneFOneBSolver(cm).partition_bound(bounds)
    ev = evaluate(cm, bounds)
    if bound == float("inf"):
        assert not ev.fits                  # inf means: no recompute choice fits
        return
    assert bound <= ev.step_s * (1 + 1e-12) + 1e-15, (bounds, bound, ev.step_s)


# --------------------------------------------------------------------------- the optimizer step
def test_step_waits_for_a_later_stage_optimizer_step():
    # K=2, M=1, F=B=[1,1] ms, optimizer [0, 10] ms: the backwards end at 4 ms; stage 1 steps its
    # optimizer until 14 ms, and the next step reaches stage 1 only 1 ms (stage 0's forward)
    # after it begins, so it can begin no earlier than 13 ms: the step is 13 ms.
    tl = simulate_times("gpipe", [1e-3, 1e-3], [1e-3, 1e-3], [0.0], 1, optimizer_s=[0.0, 10e-3], record=True)
    last_optimizer_end = max(e.end_s for e in tl.events if e.kind == "optimizer")
    assert tl.makespan_s == pytest.approx(4e-3)
    assert last_optimizer_end == pytest.approx(14e-3)
    assert tl.step_s == pytest.approx(13e-3)
    # and stage 0's optimizer step counts in full when it is the longer one
    tl = simulate_times("gpipe", [1e-3, 1e-3], [1e-3, 1e-3], [0.0], 1, optimizer_s=[3e-3, 1e-3])
    assert tl.step_s == pytest.approx(7e-3)
