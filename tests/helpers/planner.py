"""Shared pieces of the planner tests: random instances and an independent reference model.

The reference functions below are written from docs/planner.md and docs/plan-format.md, not from
the planner's code, so that a test comparing the planner with them can fail when the cost
model itself is wrong (brute force shares the planner's cost model, so it cannot catch that).
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
from pathlib import Path
from typing import Any, Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from gpipe_plan.planner.costmodel import Setting
from gpipe_plan.planner.fixedcosts import FixedCosts
from gpipe_plan.planner.profile import LayerFigures
from gpipe_plan.schema import PROFILE_FORMAT, check_built

REPO = Path(__file__).resolve().parents[2]
PIPEDREAM_DIR = REPO / "data" / "pipedream-profiles"

STATE_MULT = {"adam": 2, "momentum": 1, "sgd": 0}   # docs/planner.md: Adam 2x, momentum 1x


def hyp(max_examples: int):
    """Deterministic hypothesis settings: the same examples on every run, no database."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# --------------------------------------------------------------------------- instances
def make_figures(
    forward: Sequence[float],
    backward: Sequence[float],
    activation: Sequence[float] | None = None,
    output: Sequence[float] | None = None,
    params: Sequence[float] | None = None,
    *,
    transient: Sequence[float] | None = None,
    buffers: Sequence[float] | None = None,
    optimizer: Sequence[float] | None = None,
    input_bytes: float = 0.0,
    size: float = 1.0,
    recompute_backward: Sequence[float] | None = None,
    recompute_call: float = 0.0,
    tied: Sequence[tuple[Sequence[int], float]] = (),
    issue: tuple[Sequence[float], Sequence[float]] | None = None,
) -> LayerFigures:
    L = len(forward)
    zeros = (0.0,) * L
    return LayerFigures(
        micro_batch_size=size,
        names=tuple(f"layer{i}" for i in range(L)),
        forward_s=tuple(map(float, forward)),
        backward_s=tuple(map(float, backward)),
        activation_bytes=tuple(map(float, activation)) if activation is not None else zeros,
        output_bytes=tuple(map(float, output)) if output is not None else zeros,
        transient_bytes=tuple(map(float, transient)) if transient is not None else zeros,
        param_bytes=tuple(map(float, params)) if params is not None else zeros,
        buffer_bytes=tuple(map(float, buffers)) if buffers is not None else zeros,
        optimizer_s=tuple(map(float, optimizer)) if optimizer is not None else zeros,
        input_bytes=float(input_bytes),
        recompute_backward_s=tuple(map(float, recompute_backward)) if recompute_backward is not None else None,
        recompute_call_s=float(recompute_call),
        tied=tuple((tuple(layers), float(size)) for layers, size in tied),
        issue_forward_s=tuple(map(float, issue[0])) if issue is not None else None,
        issue_backward_s=tuple(map(float, issue[1])) if issue is not None else None,
    )


# Times: a coarse grid (ties between partitions, zeros) or arbitrary floats (rounding).
_time = st.one_of(st.integers(0, 12).map(lambda x: x * 0.5e-3),
                  st.floats(0.0, 0.01, allow_nan=False, allow_infinity=False))
_bytes = st.integers(0, 1000).map(float)


@st.composite
def instances(draw, schedule: str | None = None, max_layers: int = 8, max_stages: int = 4,
              max_micro_batches: int = 8, features: bool = True, tied: bool = False,
              fixed: bool | None = None):
    """(LayerFigures, Setting) of a small random planning problem.

    Each feature (memory limit, communication, overhead, optimizer time, transient memory)
    is switched on or off by its own draw, so that the solvers' special cases (no comm, no
    optimizer time, a fixed recompute choice) and their general cases are all exercised;
    ``fixed``: fixed costs per action and message always (True), never (False) or drawn (None).
    """
    L = draw(st.sampled_from([1] + 4 * list(range(2, max_layers + 1))))
    # K = 1 (and L = 1) are edge cases, not the point: give K >= 2 most of the draws.
    K = draw(st.sampled_from([1] + 3 * list(range(2, min(max_stages, L) + 1))))
    M = draw(st.integers(1, max_micro_batches))
    fwd = draw(st.lists(_time, min_size=L, max_size=L))
    bwd = draw(st.lists(_time, min_size=L, max_size=L))
    act = draw(st.lists(_bytes, min_size=L, max_size=L))
    out = draw(st.lists(_bytes, min_size=L, max_size=L))
    par = draw(st.lists(_bytes, min_size=L, max_size=L))
    use = (lambda: draw(st.booleans())) if features else (lambda: False)
    transient = draw(st.lists(_bytes, min_size=L, max_size=L)) if use() else None
    buffers = draw(st.lists(st.integers(0, 100).map(float), min_size=L, max_size=L)) if use() else None
    optimizer = draw(st.lists(st.floats(0.0, 0.003), min_size=L, max_size=L)) if use() else None
    input_bytes = float(draw(st.integers(0, 1000)))
    # Measured recomputation: a rerun of 0.5-2x the forward (now and then below the plain
    # backward, which the planner must clamp) and a fixed cost per checkpoint call.
    recompute_backward, recompute_call = None, 0.0
    if use():
        factors = draw(st.lists(st.sampled_from([-0.5, 0.5, 1.0, 1.5, 2.0]), min_size=L, max_size=L))
        recompute_backward = [max(0.0, b + x * f) for b, f, x in zip(bwd, fwd, factors)]
        recompute_call = draw(st.sampled_from([0.0, 2e-4, 1e-3]))
    ties = []
    if tied and L >= 2:  # tied weights: 1-2 parameters, each used by 2-3 layers
        for _ in range(draw(st.integers(1, 2))):
            layers = draw(st.lists(st.integers(0, L - 1), min_size=2, max_size=3, unique=True))
            ties.append((sorted(layers), float(draw(st.integers(1, 2000)))))
    # The CPU-issue bound (CUDA profiles): each layer's issue time, below or above its GPU time.
    issue = None
    if use():
        issue = (draw(st.lists(_time, min_size=L, max_size=L)), draw(st.lists(_time, min_size=L, max_size=L)))
    fig = make_figures(fwd, bwd, act, out, par, transient=transient, buffers=buffers,
                       optimizer=optimizer, input_bytes=input_bytes,
                       recompute_backward=recompute_backward, recompute_call=recompute_call, tied=ties, issue=issue)
    sched = schedule or draw(st.sampled_from(["gpipe", "1f1b"]))
    recompute = draw(st.sampled_from(["never", "always", "auto"]))
    opt_name = draw(st.sampled_from(["adam", "momentum", "sgd"]))
    limit = None
    if use():
        # Between the least memory any partition needs and the median one without
        # recomputation needs: the limit binds most of the time, and now and then nothing fits at all.
        lo, hi = _memory_range(fig, K, M, sched, recompute, opt_name)
        q = draw(st.integers(-2, 14)) / 20
        limit = float(int(lo * (1 + q) if q < 0 else lo + q * (hi - lo)))
    bandwidth, latency = math.inf, 0.0
    if use() or tied:
        bandwidth = draw(st.sampled_from([2e4, 1e5, 5e5, 3e6]))
        latency = draw(st.sampled_from([0.0, 1e-4, 1e-3]))
    overhead = draw(st.sampled_from([1e-4, 1e-3])) if use() else 0.0
    fixed = draw(fixed_costs()) if (use() if fixed is None else fixed) else FixedCosts()
    setting = Setting(stages=K, micro_batches=M, schedule=sched, recompute=recompute,
                      memory_limit_bytes=limit, link_bandwidth_bytes_per_s=bandwidth,
                      link_latency_s=latency, optimizer=opt_name, overhead_s=overhead, fixed_costs=fixed)
    return fig, setting


def schedule_case(rng, schedule: str, v: int, *, stages: Sequence[int] = (2, 2, 3), max_extra_layers: int = 4,
                  every_feature: bool = True, issue: bool = False) -> tuple[LayerFigures, Setting]:
    """A small instance of any schedule: L <= 9 layers (at most ``max_extra_layers`` more than its
    chunks), K from ``stages``, M one the schedule can run; times on a coarse grid (ties, zeros) or
    arbitrary; a memory limit, a finite link, optimizer time, measured recomputation and a fixed
    cost per action now and then. ``every_feature`` adds, each drawn on or off, the link's latency,
    transient memory, the checkpoint call's cost, a tied weight, and two replicas with a gradient sync.
    Fixed costs per action kind and message half the time (planner/fixedcosts.py); ``issue``: the
    CPU-issue bound now and then."""
    from gpipe_plan.schedules import problem

    K = rng.choice(list(stages))
    C = K * (v if schedule == "interleaved" else 2 if schedule == "zb-v" else 1)
    L = rng.randint(C, min(C + max_extra_layers, 9))
    M = rng.choice([m for m in range(1, 7 if every_feature else 9) if not problem(schedule, K, m, v)])
    t = lambda: rng.choice([0.0, rng.uniform(0, 2e-3), 1e-3])      # noqa: E731 - ties and zeros too
    fig = make_figures([t() for _ in range(L)], [t() for _ in range(L)],
                       activation=[rng.randint(0, 200) for _ in range(L)],
                       output=[rng.randint(0, 200) for _ in range(L)],
                       params=[rng.randint(0, 200) for _ in range(L)],
                       transient=[rng.randint(0, 300) for _ in range(L)] if every_feature and rng.random() < 0.3 else None,
                       optimizer=[rng.uniform(0, 3e-4) for _ in range(L)] if rng.random() < 0.5 else None,
                       input_bytes=rng.randint(0, 200),
                       recompute_backward=[rng.uniform(1e-3, 4e-3) for _ in range(L)] if rng.random() < 0.5 else None,
                       recompute_call=rng.choice([0.0, 2e-4]) if every_feature else 0.0,
                       tied=[((0, L - 1), 500.0)] if every_feature and rng.random() < 0.3 else (),
                       # the CPU-issue bound now and then (CUDA profiles): issue times about the GPU's
                       issue=([t() for _ in range(L)], [t() for _ in range(L)]) if issue and rng.random() < 0.3 else None)
    extra = {}
    if every_feature:
        extra = dict(link_latency_s=rng.choice([0.0, 1e-4]), data_parallel=rng.choice([1, 1, 2]),
                     sync_bandwidth_bytes_per_s=rng.choice([math.inf, 1e5]), sync_latency_s=rng.choice([0.0, 1e-4]))
    setting = Setting(stages=K, micro_batches=M, schedule=schedule, recompute=rng.choice(["never", "always", "auto"]),
                      memory_limit_bytes=rng.choice([None, None, 3000, 5000]),
                      link_bandwidth_bytes_per_s=rng.choice([math.inf, 2e5]),
                      overhead_s=rng.choice([0.0, 1e-4, 1e-4] if every_feature else [0.0, 1e-4]), virtual_stages=v,
                      fixed_costs=random_fixed_costs(rng),
                      **extra)
    return fig, setting


def random_fixed_costs(rng) -> FixedCosts:
    """None half the time; else each kind's and each message's own (a send and a receive that
    differ, so that a chunk's place in the pipeline changes what it pays)."""
    if rng.random() < 0.5:
        return FixedCosts()
    one = lambda: rng.choice([0.0, 1e-4, 5e-4, 1e-3])      # noqa: E731
    return FixedCosts(forward_s=one(), backward_s=one(), backward_input_s=one(), backward_weight_s=one(),
                      send_s=rng.choice([2e-4, 6e-4]), receive_s=rng.choice([0.0, 3e-4, 9e-4]))


@st.composite
def fixed_costs(draw):
    """Fixed costs per action kind and per message (planner/fixedcosts.py): each kind its own,
    a send and a receive that differ, so that the first, middle and last stages all differ."""
    def one():
        return draw(st.sampled_from([0.0, 1e-4, 4e-4, 1e-3]))

    return FixedCosts(forward_s=one(), backward_s=one(), backward_input_s=one(), backward_weight_s=one(),
                      send_s=draw(st.sampled_from([0.0, 2e-4, 7e-4])), receive_s=draw(st.sampled_from([0.0, 3e-4, 1e-3])))


def _memory_range(fig: LayerFigures, K: int, M: int, schedule: str, recompute: str,
                  optimizer: str) -> tuple[float, float]:
    import itertools

    L = fig.num_layers
    probe = Setting(stages=K, micro_batches=M, schedule=schedule, optimizer=optimizer)
    choices = {"never": (False,), "always": (True,), "auto": (False, True)}[recompute]
    least, needs = math.inf, []
    for cuts in itertools.combinations(range(1, L), K - 1):
        bounds = (0, *cuts, L)
        need = max(min(ref_stage(fig, probe, bounds, k, r)["memory"] for r in choices) for k in range(K))
        least = min(least, need)
        needs.append(max(ref_stage(fig, probe, bounds, k, choices[0])["memory"] for k in range(K)))
    return least, max(sorted(needs)[len(needs) // 2], least)


def bounds_strategy(L: int, K: int):
    """Boundaries 0 = b0 < b1 < ... < bK = L of a random partition."""
    if K == 1:
        return st.just((0, L))
    return st.lists(st.integers(1, L - 1), min_size=K - 1, max_size=K - 1, unique=True).map(
        lambda cuts: (0, *sorted(cuts), L))


# --------------------------------------------------------------------------- reference model
def ref_stage(fig: LayerFigures, setting: Setting, bounds: Sequence[int], k: int, recompute: bool) -> dict:
    """One stage's figures, straight from docs/planner.md's cost model."""
    L, K, M = fig.num_layers, setting.stages, setting.micro_batches
    s, e = bounds[k], bounds[k + 1]
    fwd = math.fsum(fig.forward_s[s:e])
    # Fixed costs (docs/planner.md): each action its kind's and the overhead between actions, and
    # each message to or from another stage: a forward sends on unless last and receives unless
    # first; a backward the other way round.
    fixed = setting.fixed_costs
    sends_on, receives = (k < K - 1), (k > 0)
    f = fwd + setting.overhead_s + fixed.forward_s + fixed.send_s * sends_on + fixed.receive_s * receives
    b_fixed = setting.overhead_s + fixed.backward_s + fixed.send_s * receives + fixed.receive_s * sends_on
    if not recompute:
        gpu_b, extra = math.fsum(fig.backward_s[s:e]), 0.0
    elif fig.recompute_backward_s is None:      # the textbook figure: one more forward
        gpu_b, extra = math.fsum(fig.backward_s[s:e]) + fwd, 0.0
    else:                                       # measured, never below the plain backward
        gpu_b = math.fsum(max(r, g) for r, g in zip(fig.recompute_backward_s[s:e], fig.backward_s[s:e]))
        extra = fig.recompute_call_s
    b = gpu_b + b_fixed + extra
    if fig.issue_forward_s is not None:
        # The CPU-issue bound: each pass the larger of its GPU sum and its issue sum (a
        # recomputing backward issues the forward again), then its fixed part.
        issue_f = math.fsum(fig.issue_forward_s[s:e])
        issue_b = math.fsum(fig.issue_backward_s[s:e]) + (issue_f if recompute else 0.0)
        f = max(fwd, issue_f) + (f - fwd)
        b = max(gpu_b, issue_b) + b_fixed + extra
    comm_on = math.isfinite(setting.link_bandwidth_bytes_per_s)
    c = setting.link_latency_s + fig.output_bytes[e - 1] / setting.link_bandwidth_bytes_per_s \
        if (comm_on and e < L) else 0.0
    n = M if setting.schedule == "gpipe" else min(M, K - k)
    params = math.fsum(fig.param_bytes[s:e])
    act = math.fsum(fig.activation_bytes[s:e])
    stage_input = fig.input_bytes if s == 0 else fig.output_bytes[s - 1]
    # Recomputing: the inputs of the micro-batches in flight, and while one is recomputed its
    # activations, which already hold its input (the first layer saves it), hence the max:
    # (n - 1) inputs + max(activations, input), as docs/planner.md states.
    activations = (n - 1) * stage_input + max(act, stage_input) if recompute else n * act
    memory = (params * (2 + STATE_MULT[setting.optimizer]) + math.fsum(fig.buffer_bytes[s:e])
              + activations + max(fig.transient_bytes[s:e]))
    # A stage holding some, not all, layers of a tied parameter exchanges its gradient once a step.
    exchange = math.fsum(setting.link_latency_s + size / setting.link_bandwidth_bytes_per_s
                         for layers, size in fig.tied if comm_on and 0 < sum(s <= i < e for i in layers) < len(layers))
    return {"F": f, "B": b, "C": c, "memory": memory, "in_flight": n,
            "optimizer": math.fsum(fig.optimizer_s[s:e]) + exchange}


def ref_order(schedule: str, K: int, M: int, k: int) -> list[tuple[str, int]]:
    """Operation order of stage k: GPipe all F then all B; 1F1B warm-up, 1B1F, cool-down."""
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    w = min(M, K - k)
    order = [("F", m) for m in range(w)]
    for m in range(M):
        order.append(("B", m))
        if w + m < M:
            order.append(("F", w + m))
    return order


def ref_makespan(schedule: str, F: Sequence[float], B: Sequence[float], C: Sequence[float], M: int) -> float:
    """End of the last operation, by recursion over the dependencies (not an event loop).

    An operation ends at max(previous op on its stage, its input's arrival) + its time; a send
    leaves when its producer ended and the previous send on that link (same direction) is done.
    """
    K = len(F)
    orders = [ref_order(schedule, K, M, k) for k in range(K)]
    index = [{op: i for i, op in enumerate(o)} for o in orders]

    @functools.lru_cache(maxsize=None)
    def end(k: int, i: int) -> float:
        kind, m = orders[k][i]
        prev = end(k, i - 1) if i > 0 else 0.0
        if kind == "F":
            ready = 0.0 if k == 0 else arrive_fwd(k - 1, m)
            return max(prev, ready) + F[k]
        ready = end(k, index[k][("F", m)]) if k == K - 1 else arrive_bwd(k, m)
        return max(prev, ready) + B[k]

    @functools.lru_cache(maxsize=None)
    def arrive_fwd(link: int, m: int) -> float:     # stage link -> link+1
        leave = end(link, index[link][("F", m)])
        if m > 0:
            leave = max(leave, arrive_fwd(link, m - 1))
        return leave + C[link]

    @functools.lru_cache(maxsize=None)
    def arrive_bwd(link: int, m: int) -> float:     # stage link+1 -> link
        leave = end(link + 1, index[link + 1][("B", m)])
        if m > 0:
            leave = max(leave, arrive_bwd(link, m - 1))
        return leave + C[link]

    return max(end(k, len(orders[k]) - 1) for k in range(K))


def ref_gpipe_closed_form(F, B, C, M) -> float:
    """docs/planner.md: sum F + sum C + (M-1) max(F, C) + sum B + sum C + (M-1) max(B, C)."""
    return (sum(F) + sum(C) + (M - 1) * max(list(F) + list(C))
            + sum(B) + sum(C) + (M - 1) * max(list(B) + list(C)))


def ref_evaluate(fig: LayerFigures, setting: Setting, bounds: Sequence[int],
                 recompute: Sequence[bool]) -> dict:
    """Step time, per-stage memory and whether it fits, all from the reference model.

    The step is the makespan plus the optimizer tail of docs/planner.md: every stage steps its
    optimizer after the last backward, and stage k is needed again only once the next step's
    first micro-batch has passed the stages (and links) before it."""
    K = setting.stages
    stages = [ref_stage(fig, setting, bounds, k, recompute[k]) for k in range(K)]
    F = [s["F"] for s in stages]
    B = [s["B"] for s in stages]
    C = [s["C"] for s in stages[:-1]]
    makespan = ref_makespan(setting.schedule, F, B, C, setting.micro_batches)
    fill = [sum(F[:k]) + sum(C[:k]) for k in range(K)]
    tail = max(s["optimizer"] - fill[k] for k, s in enumerate(stages))
    limit = setting.memory_limit_bytes
    return {
        "stages": stages,
        "makespan": makespan,
        "step": makespan + tail,
        "fits": limit is None or all(s["memory"] <= limit * (1 + 1e-12) for s in stages),
        "memory": [s["memory"] for s in stages],
    }


def close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-15)


# --------------------------------------------------------------------------- profile documents
def profile_doc(
    L: int = 6,
    sizes: Sequence[int] = (1, 2, 4),
    *,
    batch_size: int | None = 8,
    forward_per_sample: Sequence[float] | None = None,
    backward_per_sample: Sequence[float] | None = None,
    activation_per_sample: Sequence[int] | None = None,
    output_per_sample: Sequence[int] | None = None,
    param_bytes: Sequence[int] | None = None,
    forward_fixed: Sequence[float] | None = None,
    backward_fixed: Sequence[float] | None = None,
    **extra: Any,
) -> dict:
    """A synthetic profile (docs/profile-format.md) whose figures are linear in the size b:
    time = fixed + per_sample * b, bytes = per_sample * b.

    Checked against the profile schema as it is made (``extra`` included), so that a fixture
    drifting from the format fails here rather than passing a profile no writer makes. A test
    that needs a bad profile breaks this one after it is made."""
    fwd = forward_per_sample or [1e-3 * (1 + i % 3) for i in range(L)]
    bwd = backward_per_sample or [2e-3 * (1 + (i * 2) % 5) for i in range(L)]
    act = activation_per_sample or [1000 * (1 + i % 2) for i in range(L)]
    out = output_per_sample or [100 * (1 + i % 4) for i in range(L)]
    par = param_bytes or [4000 + 1000 * (i % 3) for i in range(L)]
    f0 = forward_fixed or [0.0] * L
    b0 = backward_fixed or [0.0] * L
    doc = {
        "format": PROFILE_FORMAT,
        "version": 1,
        "model": {"source": "builtin", "name": "gpt", "options": {"layers": L}},
        "device": {"type": "cpu", "name": "synthetic", "threads": 1},
        "micro_batch_sizes": list(sizes),
        "layers": [
            {
                "name": f"layer{i}",
                "forward_s": [f0[i] + fwd[i] * b for b in sizes],
                "backward_s": [b0[i] + bwd[i] * b for b in sizes],
                "activation_bytes": [act[i] * b for b in sizes],
                "output_bytes": [out[i] * b for b in sizes],
                "param_bytes": par[i],
            }
            for i in range(L)
        ],
    }
    if batch_size is not None:
        doc["batch_size"] = batch_size
    doc.update(extra)
    check_built(doc, "profile", "profile_doc")
    return doc


def write_json(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc, indent=1))
    return path


def ref_brute(fig: LayerFigures, setting: Setting) -> dict | None:
    """The least reference step over every partition and per-stage recompute choice that fits."""
    import itertools

    L, K = fig.num_layers, setting.stages
    choices = {"never": (False,), "always": (True,), "auto": (False, True)}[setting.recompute]
    best = None
    for cuts in itertools.combinations(range(1, L), K - 1):
        bounds = (0, *cuts, L)
        for rc in itertools.product(choices, repeat=K):
            ev = ref_evaluate(fig, setting, bounds, rc)
            if ev["fits"] and (best is None or ev["step"] < best["step"]):
                best = {**ev, "bounds": bounds, "recompute": rc}
    return best


def cli(*args: str):
    """Run ``gpipe-plan ARGS`` in this process, as click's test runner does (stderr mixed in)."""
    from click.testing import CliRunner

    from gpipe_plan.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=True)


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the rows of the table whose heading line starts with ``heading`` (a regular
    expression, matched at the line's start): the lines
    below its rule up to the first that is blank or prose (its columns are two or more spaces
    apart: gpipe_plan/tables.py; prose has single spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(heading, line)) + 2   # below the rule
    rows = []
    for line in lines[start:]:
        if not re.search(r"\S\s{2,}\S", line):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


CHUNKED = [("interleaved", 2), ("zb-h1", 1), ("zb-v", 1)]


def random_case(rng: random.Random, schedule: str, v: int):
    """A small random instance: L <= 8 layers, K = 2, a memory limit now and then."""
    return schedule_case(rng, schedule, v, stages=(2,), max_extra_layers=6, every_feature=False, issue=True)
