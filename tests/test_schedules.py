"""Schedules as data (gpipe_plan/schedules.py) and the planner's one event simulator over them.

Pure Python except the comparison with torch's own orders, which skips without torch. The
replay below is written from the dependency rules in docs/planner.md ("Schedules"), not from
planner/simulator.py: a different algorithm (a global clock: always start, among the actions
whose predecessors are done, the one that can start first) that must reach the same step.
"""

from __future__ import annotations

import math
import random
import types

import pytest

from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.simulator import ChunkTimes, simulate_plan
from gpipe_plan.schedules import (SCHEDULES, SPLIT_BACKWARD, all_actions, check_actions, chunks_per_stage, problem,
                                  stage_of_chunk)

from helpers.planner import make_figures, ref_evaluate

SHAPES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("zb-v", 1)]


# --------------------------------------------------------------------------- the lists
@pytest.mark.parametrize("schedule,v", SHAPES)
def test_every_schedule_is_a_complete_valid_list(schedule, v):
    """Every chunk runs F and B (or I then W) once per micro-batch, on its own stage, in order."""
    runnable = 0
    for K in range(1, 6):
        for M in range(1, 13):
            if problem(schedule, K, M, v):
                continue
            runnable += 1
            actions = all_actions(schedule, K, M, v)
            assert len(actions) == K
            check_actions(schedule, K, M, v, actions)
            kinds_per_chunk = 3 if schedule in SPLIT_BACKWARD else 2
            assert sum(map(len, actions)) == K * chunks_per_stage(schedule, v) * M * kinds_per_chunk
    assert runnable >= 20      # problem() leaves most shapes runnable


def test_interleaved_refuses_micro_batches_that_are_not_whole_rounds():
    assert problem("interleaved", 4, 9, 2)          # 9 // 4 = 2 rounds; 9 is not a multiple of 2
    assert problem("interleaved", 4, 8, 2) is None
    assert problem("interleaved", 2, 4, 1)          # one chunk per stage is 1f1b
    assert problem("1f1b", 2, 4, 2)                 # only interleaved takes virtual stages


# --------------------------------------------------------------------------- an independent replay
def replay(schedule: str, K: int, M: int, v: int, chunks: list[ChunkTimes]) -> float:
    """The makespan, by a global clock: repeatedly start the action that can start earliest
    among each stage's next actions whose predecessors are done. Messages between chunks on
    different stages go over a link per (from, to, direction), one at a time, in the order
    they were produced (each link has one sender, which produces them in time order)."""
    C = len(chunks)
    lists = all_actions(schedule, K, M, v)
    where = [stage_of_chunk(schedule, c, K) for c in range(C)]
    end: dict[tuple[str, int, int], float] = {}
    arrival: dict[tuple[str, int, int], float] = {}     # ("act"|"grad", chunk receiving, m)
    link_free: dict[tuple[int, int, str], float] = {}
    stage_free = [0.0] * K
    nxt = [0] * K

    def ready(a) -> float | None:
        if a.kind == "F":
            return 0.0 if a.chunk == 0 else arrival.get(("act", a.chunk, a.micro_batch))
        if a.kind in ("B", "I"):
            if a.chunk == C - 1:
                return end.get(("F", a.chunk, a.micro_batch))
            return arrival.get(("grad", a.chunk, a.micro_batch))
        return end.get(("I", a.chunk, a.micro_batch))

    def duration(a) -> float:
        ch = chunks[a.chunk]
        return {"F": ch.forward_s, "B": ch.backward_s, "I": ch.backward_input_s, "W": ch.backward_weight_s}[a.kind]

    def deliver(kind: str, src: int, dst: int, m: int, at: float, send_s: float) -> None:
        if where[src] == where[dst]:
            arrival[(kind, dst, m)] = at
            return
        key = (where[src], where[dst], kind)
        start = max(at, link_free.get(key, 0.0))
        link_free[key] = start + send_s
        arrival[(kind, dst, m)] = start + send_s

    total = sum(map(len, lists))
    while total:
        options = []
        for k in range(K):
            if nxt[k] < len(lists[k]):
                r = ready(lists[k][nxt[k]])
                if r is not None:
                    options.append((max(r, stage_free[k]), k))
        assert options, "deadlock"
        start, k = min(options)
        a = lists[k][nxt[k]]
        nxt[k] += 1
        total -= 1
        finish = start + duration(a)
        stage_free[k] = finish
        end[(a.kind, a.chunk, a.micro_batch)] = finish
        if a.kind == "F" and a.chunk < C - 1:
            deliver("act", a.chunk, a.chunk + 1, a.micro_batch, finish, chunks[a.chunk].send_s)
        if a.kind in ("B", "I") and a.chunk > 0:
            deliver("grad", a.chunk, a.chunk - 1, a.micro_batch, finish, chunks[a.chunk - 1].send_s)
    return max(stage_free)


def random_chunks(rng: random.Random, schedule: str, K: int, v: int, sends: bool) -> list[ChunkTimes]:
    C = K * chunks_per_stage(schedule, v)
    out = []
    for c in range(C):
        i, w = rng.uniform(0.1, 2.0), rng.uniform(0.1, 2.0)
        crosses = c < C - 1 and stage_of_chunk(schedule, c, K) != stage_of_chunk(schedule, c + 1, K)
        out.append(ChunkTimes(rng.uniform(0.1, 2.0), i + w, i, w,
                              rng.uniform(0.0, 1.5) if sends and crosses else 0.0))
    return out


@pytest.mark.parametrize("schedule,v", SHAPES)
def test_simulator_equals_a_brute_force_replay(schedule, v):
    rng = random.Random(f"{schedule}{v}")
    checked = 0
    for _ in range(60):
        K, M = rng.randint(1, 5), rng.randint(1, 12)
        if problem(schedule, K, M, v):
            continue
        chunks = random_chunks(rng, schedule, K, v, sends=rng.random() < 0.7)
        got = simulate_plan(schedule, K, M, v, chunks).makespan_s
        assert got == pytest.approx(replay(schedule, K, M, v, chunks), rel=1e-12), (K, M, chunks)
        checked += 1
    assert checked >= 20


def test_recorded_events_are_the_actions_and_respect_each_stage():
    rng = random.Random(3)
    for schedule, v in SHAPES:
        K, M = 3, 6
        chunks = random_chunks(rng, schedule, K, v, sends=True)
        chunks = [ChunkTimes(c.forward_s, c.backward_s, c.backward_input_s, c.backward_weight_s, c.send_s,
                             recompute_s=0.05) for c in chunks]
        tl = simulate_plan(schedule, K, M, v, chunks, optimizer_s=[0.1] * K, record=True)
        work = [e for e in tl.events if e.kind in ("forward", "backward", "backward_input", "backward_weight")]
        assert len(work) == sum(map(len, all_actions(schedule, K, M, v)))
        for e in work:
            assert stage_of_chunk(schedule, e.chunk, K) == e.stage
        for k in range(K):
            mine = sorted((e for e in tl.events if e.stage == k and e.kind not in ("send", "optimizer")),
                          key=lambda e: e.start_s)
            assert all(b.start_s >= a.end_s - 1e-12 for a, b in zip(mine, mine[1:]))
        split_kinds = {e.kind for e in work} & {"backward_input", "backward_weight"}
        assert bool(split_kinds) == (schedule in SPLIT_BACKWARD)
        assert [e.chunk for e in tl.events if e.kind == "optimizer"] == [-1] * K
        assert tl.step_s >= tl.makespan_s + 0.1 - 1e-12


# --------------------------------------------------------------------------- bubbles
def balanced(K: int, M: int, schedule: str, v: int = 1) -> float:
    """The predicted bubble of K stages of equal layers, F = I = W = B / 2 per layer, no sends."""
    C = K * chunks_per_stage(schedule, v)
    L = 2 * C
    fig = make_figures([1e-3] * L, [2e-3] * L, activation=[10.0] * L)
    cm = CostModel(fig, Setting(stages=K, micro_batches=M, schedule=schedule, virtual_stages=v))
    return evaluate(cm, tuple(range(0, L + 1, 2))).bubble_fraction(M)


@pytest.mark.parametrize("K", [2, 3, 4, 8])
@pytest.mark.parametrize("per_stage", [2, 4, 8])
def test_zero_bubble_and_interleaving_shrink_the_bubble(K, per_stage):
    """The issue's claims, at M = 2K and more (at M = K interleaving keeps 0.64 of it: inherent)."""
    M = per_stage * K
    one = balanced(K, M, "1f1b")
    assert one == pytest.approx((K - 1) / (M + K - 1), rel=1e-9)
    assert balanced(K, M, "zb-h1") <= one / 2
    assert balanced(K, M, "interleaved", 2) <= 0.6 * one
    assert balanced(K, M, "zb-v") <= balanced(K, M, "zb-h1")


# --------------------------------------------------------------------------- gpipe and 1f1b against the reference
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("recompute", ["never", "always"])
@pytest.mark.parametrize("bandwidth", [math.inf, 1e5])
def test_gpipe_and_1f1b_predictions_match_the_reference_model(schedule, M, recompute, bandwidth):
    """Step, makespan and per-stage memory of a fixed instance (3 stages of 2 layers, with sends,
    an optimizer tail, recomputation) as helpers.planner.ref_evaluate computes them: a separate
    model written from docs/planner.md (a recursion over each stage's operation order, not an
    event simulation over schedules.py). In-flight micro-batches by hand: GPipe holds all M on
    every stage, 1F1B holds min(K - k, M) on stage k."""
    fig = make_figures([1e-3, 2e-3, 1.5e-3, 3e-3, 0.5e-3, 2.5e-3], [2e-3, 3.5e-3, 3e-3, 5e-3, 1e-3, 4e-3],
                       activation=[100, 200, 150, 300, 50, 250], output=[40, 80, 60, 120, 20, 100],
                       params=[1000, 2000, 1500, 3000, 500, 2500], optimizer=[1e-4, 2e-4, 1e-4, 3e-4, 1e-4, 2e-4],
                       input_bytes=30, recompute_backward=[3e-3, 5e-3, 4e-3, 7e-3, 1.5e-3, 6e-3], recompute_call=1e-4)
    K, bounds = 3, (0, 2, 4, 6)
    setting = Setting(K, M, schedule, recompute, None, bandwidth, 1e-5 if bandwidth < math.inf else 0.0,
                      "adam", 2e-5)
    ev = evaluate(CostModel(fig, setting), bounds)
    want = ref_evaluate(fig, setting, bounds, [recompute == "always"] * K)
    assert ev.step_s == pytest.approx(want["step"], rel=1e-12)
    assert ev.makespan_s == pytest.approx(want["makespan"], rel=1e-12)
    assert [st.memory_bytes for st in ev.stages] == want["memory"]
    assert [st.in_flight for st in ev.stages] == [M if schedule == "gpipe" else min(K - k, M) for k in range(K)]


# --------------------------------------------------------------------------- memory from the lists
@pytest.mark.parametrize("schedule,v", SHAPES)
def test_stage_memory_is_the_replayed_peak(schedule, v):
    """The cost model's activation peak per stage equals schedules.peak_bytes over its list."""
    from gpipe_plan.schedules import peak_bytes

    rng = random.Random(schedule)
    for _ in range(10):
        K, M = rng.randint(1, 4), rng.randint(1, 10)
        if problem(schedule, K, M, v):
            continue
        C = K * chunks_per_stage(schedule, v)
        L = C + rng.randint(0, 4)
        fig = make_figures([1e-3] * L, [2e-3] * L, activation=[rng.randint(0, 500) for _ in range(L)],
                           output=[rng.randint(0, 500) for _ in range(L)], input_bytes=rng.randint(0, 500))
        cm = CostModel(fig, Setting(stages=K, micro_batches=M, schedule=schedule, virtual_stages=v))
        cuts = sorted(rng.sample(range(1, L), C - 1))
        bounds = (0, *cuts, L)
        recompute = [rng.random() < 0.5 for _ in range(K)]
        _, stages = cm.layout(bounds, recompute)
        actions = all_actions(schedule, K, M, v)
        for k, stage in enumerate(stages):
            held, extra, kept = {}, {}, {}
            for c in stage.chunks:
                s, e = bounds[c], bounds[c + 1]
                act = sum(fig.activation_bytes[s:e])
                inp = fig.input_bytes if s == 0 else fig.output_bytes[s - 1]
                held[c] = inp if recompute[k] else act
                extra[c] = max(act - inp, 0.0) if recompute[k] else 0.0
                # The estimate: W keeps all it saved and its outputs' gradients.
                kept[c] = act + sum(fig.output_bytes[s:e]) if schedule in SPLIT_BACKWARD else 0.0
                if s == 0 and schedule in SPLIT_BACKWARD:
                    # Chunk 0's I frees nothing; its rerun happens in W.
                    extra[c], kept[c] = 0.0, max(act, inp) if recompute[k] else act
            assert stage.activations_bytes == pytest.approx(peak_bytes(actions[k], held, extra, kept)), (k, stage)


# --------------------------------------------------------------------------- torch's own orders
def torch_orders(schedule: str, K: int, M: int) -> list[list[str]]:
    """torch.distributed.pipelining's per-rank order for the same schedule, without its padding."""
    from torch.distributed.pipelining import schedules   # ships with every torch gpipe-plan supports
    if schedule == "zb-v":
        cls = schedules.ScheduleZBVZeroBubble
        fake = types.SimpleNamespace(n_local_stages=2, pp_group_size=K, _n_microbatches=M, num_stages=2 * K)
    else:
        cls = (schedules.ScheduleInterleaved1F1B if schedule == "interleaved"
               else schedules.ScheduleInterleavedZeroBubble)
        v = 2 if schedule == "interleaved" else 1
        rounds = max(1, M // K)
        fake = types.SimpleNamespace(n_local_stages=v, pp_group_size=K, _n_microbatches=M,
                                     microbatches_per_round=M // rounds, num_stages=K * v)
    return [[str(a) for a in cls._calculate_single_rank_operations(fake, rank) if a is not None]
            for rank in range(K)]


@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1", "zb-v"])
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("M", [2, 4, 6, 8, 12])
def test_orders_are_torchs(schedule, K, M):
    v = 2 if schedule == "interleaved" else 1
    if problem(schedule, K, M, v):
        pytest.skip(problem(schedule, K, M, v))
    ours = [[str(a) for a in actions] for actions in all_actions(schedule, K, M, v)]
    assert ours == torch_orders(schedule, K, M)


def test_schedules_cover_the_five():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
