"""Asynchronous pipelines against synchronous SGD and LocalSGD: loss per update and per predicted second.

    python -m bench async                       # the three tasks (docs/benchmarks.md: how long it took)
    python -m bench async --quick --tasks quadratic   # seconds: a smoke run (the test's)
    python -m bench async --from-json docs/benchmarks/data/async.json   # re-render, no training

The seed comparison of "Randomized PipeDream" (arXiv:2606.03498; its code is
vectozavr/randomized-pipedream) on this package's own references. It found no universal
winner: PipeDream beats LocalSGD on a quadratic and on a small language model, LocalSGD wins
on logistic regression as the number of stages S grows, and PipeDream's steady-state delay
grows like S^2. This part asks whether the ordering holds here.

Tasks, each cut into S = 2, 4, 8 stages of ``nn.Module``\\ s:

- ``quadratic``: 0.5 * mean (x . w - y)^2, d = 100, y = x . w* without noise (the paper's
  ``QuadraticObjective.synthetic``); ``logistic``: binary cross-entropy, d = 512, labels drawn
  from sigmoid(x . w*), L2 1e-4 (``LogisticRegressionObjective``). The paper's pipeline: the
  parameter vector cut into S contiguous blocks (its ``make_stage_slices``), stage k adding
  ``x[:, block k] . w_k`` to the running sum it receives (:class:`BlockStage`); weights start
  at zero. Micro-batches of 10 rows, as the paper's.
- ``lm``: the package's built-in ``gpt`` (6 blocks, width 64, 4 heads, 32 tokens: the paper's
  character LM at S = 8, one embedding, S - 2 blocks and a head) on the text the package ships
  (runtime/texts/), its 8 layers cut into S contiguous equal stages. Micro-batches of 4 rows
  (the paper's 16, cut for time).

Methods, all on the same batches (step s: the same B = M x rows for everyone) from the same
initial weights, plain SGD, each over the same learning-rate grid, the best lr (lowest mean
loss over the last 20% of steps, the paper's ``stable_tail_frac``) reported:

- ``1f1b``: the synchronous schedules train exactly mini-batch SGD on the step's mean gradient,
  whatever K (the runtime's equivalence tests), so one run serves every S; S changes its time.
- ``pipedream`` and ``pipedream-2bw``: :func:`gpipe_plan.runtime.async_reference.reference_run`,
  M = 8 micro-batches per step. pipedream-2bw's gradients are one update stale on every stage
  whatever K, so it too trains once (at the most stages) for every S (:func:`configurations`).
- ``localsgd``: 8 workers, each the whole model on its B/8 rows (one micro-batch), averaged
  every H = 5 steps (the paper's ``local_steps``):
  :func:`gpipe_plan.runtime.async_reference.localsgd_reference`.

The references compute what a real run computes (tests check runs against them at 1e-5), so
this part starts no processes. Two comparisons:

- per step: every method's first ``--steps`` steps, the same data for all (loss against
  updates: pipedream makes M per step, the others one);
- at a fixed predicted time, the paper's: the time axis is the planner's prediction for each
  configuration's step (:func:`predicted_step_s`) from the stages' measured forward, backward
  and optimizer times (the LM's from ``gpipe-plan``'s profiler, profile_model; the block
  stages' timed here, the fastest of repeats, one thread), the budget ``--steps`` steps of
  pipedream at the most stages, and each configuration runs as many of its steps as fit
  (:func:`steps_needed`), its best lr chosen for that budget (:func:`fixed_time`).
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .common import (COLOURS, _esc, _lin_ticks, _log_ticks, measured_or_saved, publish, table,
                     write_svg)

TASKS = ("quadratic", "logistic", "lm")
METHODS = ("1f1b", "pipedream", "pipedream-2bw", "localsgd")
STAGES = (2, 4, 8)
MICRO_BATCHES = 8           # per step, every pipeline method
WORKERS = 8                 # LocalSGD's replicas: one micro-batch of rows each
SYNC_EVERY = 5              # LocalSGD's H, the paper's local_steps
TAIL = 0.2                  # the share of the last steps whose mean loss is a run's final loss
# The paper's grids: the LM's "pow2:-4:2" (2^-4 .. 2^1, llm_pd_vs_sgd.py), here 2^-6 .. 2^0: a
# first run found pipedream's and 2bw's best at 2^-4, the grid's edge, and every method diverged
# at 2^1; for the quadratic and logistic regression multiples of 1/L (L the smoothness
# constant; main.py's 0.5/L, 0.8/L and comparison.yaml's 0.05/L lie inside).
LM_GRID = tuple(2.0 ** e for e in range(-6, 1))
CONVEX_GRID = tuple(2.0 ** e for e in range(-6, 2))     # times 1/L
QUICK_STEPS = 12
# Steps per run: the noise-free quadratic reaches float32's floor (1e-12) within 200 steps at
# most rates, which would leave nothing to compare; 25 keeps every method short of it.
DEFAULT_STEPS = {"quadratic": 25, "logistic": 150, "lm": 80}


# --------------------------------------------------------------------------------------------
# Tasks.

def _torch():
    import torch

    torch.set_num_threads(1)
    return torch


@functools.lru_cache(maxsize=1)
def _modules():
    """The stage modules (torch imported only when a part measures, not for --from-json)."""
    torch = _torch()
    from torch import nn

    class BlockStage(nn.Module):
        """The paper's pipelined linear model: stage k holds block k of w and adds x[:, block] . w_k
        to the running sum; inputs (x, sum so far) -> (x, new sum); stage 0 starts the sum."""

        def __init__(self, columns: slice, first: bool) -> None:
            super().__init__()
            self.columns, self.first = columns, first
            self.weight = nn.Parameter(torch.zeros(columns.stop - columns.start))

        def forward(self, x, running=None):
            part = x[:, self.columns] @ self.weight
            return x, part if self.first else running + part

    class Layers(nn.Module):
        """Layers in order, each taking the previous one's outputs (tuples spread)."""

        def __init__(self, layers) -> None:
            super().__init__()
            self.layers = nn.ModuleList(layers)

        def forward(self, *xs):
            for layer in self.layers:
                out = layer(*xs)
                xs = out if isinstance(out, tuple) else (out,)
            return xs

    return torch, nn, BlockStage, Layers


def contiguous(n: int, parts: int) -> list[slice]:
    """n items cut into ``parts`` contiguous runs, the first ``n % parts`` one longer (the paper's
    make_stage_slices)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        out.append(slice(start, end))
        start = end
    return out


@dataclass
class Task:
    name: str
    what: str
    rows: int                                  # per micro-batch
    lr_grid: tuple[float, ...]
    lr_unit: str                               # how the grid is written ("1/L", or "")
    make_stages: Callable[[int], list]         # S -> S fresh stage modules, the same initial weights every call
    loss_fn: Callable[[Any, Any], Any]
    batch: Callable[[int], tuple]              # step -> (inputs, targets), B = M x rows
    weight_decay: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def whole(self):
        """The whole model as one module (one stage): what the synchronous and LocalSGD runs train."""
        _, _, _, Layers = _modules()
        return Layers(self.make_stages(1))


def convex_task(name: str, seed: int = 0) -> Task:
    """The paper's quadratic (d = 100) or logistic regression (d = 512), cut as the paper cuts it:
    S contiguous blocks of the parameter vector, one per stage (its make_stage_slices)."""
    torch, nn, BlockStage, _ = _modules()
    d, examples = (100, 4000) if name == "quadratic" else (512, 4000)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(examples, d, generator=g)
    w_true = torch.randn(d, generator=g)
    if name == "quadratic":
        y = X @ w_true
        L = float(torch.linalg.eigvalsh(X.T @ X / examples).max())
        loss_fn = lambda out, t: 0.5 * ((out[-1] - t) ** 2).mean()   # noqa: E731
        l2 = 0.0
    else:
        y = torch.bernoulli(torch.sigmoid(X @ w_true), generator=g)
        l2 = 1e-4
        L = 0.25 * float(torch.linalg.eigvalsh(X.T @ X / examples).max()) + l2
        loss_fn = lambda out, t: nn.functional.binary_cross_entropy_with_logits(out[-1], t)   # noqa: E731
    rows = 10
    B = rows * MICRO_BATCHES
    per_epoch = examples // B

    def make_stages(S: int) -> list:
        return [BlockStage(cols, first=(k == 0)) for k, cols in enumerate(contiguous(d, S))]

    def batch(step: int) -> tuple:
        # The paper's order: consecutive batches, no shuffling, epoch after epoch.
        start = (step % per_epoch) * B
        return (X[start:start + B],), y[start:start + B]

    what = ("quadratic 0.5 mean (x.w - y)^2, d = 100, 4,000 examples, no noise" if name == "quadratic" else
            "logistic regression, d = 512, 4,000 examples, labels ~ sigmoid(x.w*), L2 1e-4")
    return Task(name, what, rows, tuple(c / L for c in CONVEX_GRID), "1/L", make_stages, loss_fn, batch,
                weight_decay=l2, notes={"smoothness_L": L, "grid_times_L": list(CONVEX_GRID), "dimension": d})


LM_OPTIONS = {"layers": 6, "width": 64, "heads": 4, "seq_len": 32}


def lm_task(seed: int = 0) -> Task:
    _torch()
    from gpipe_plan.demo import DEMO_TEXT
    from gpipe_plan.models import build_model, model_spec
    from gpipe_plan.runtime.data import TextBatches

    spec = model_spec("gpt", **LM_OPTIONS)
    probe = build_model(spec, seed=seed)
    rows = 4   # the paper's are 16: 4 keeps the part within minutes on a 2-core CPU
    data = TextBatches(str(DEMO_TEXT), spec["options"]["seq_len"], rows * MICRO_BATCHES, seed=seed)

    def make_stages(S: int) -> list:
        _, _, _, Layers = _modules()
        layers = [layer for _, layer in build_model(spec, seed=seed).layers]
        return [Layers(layers[cut]) for cut in contiguous(len(layers), S)]

    return Task("lm", f"gpt {LM_OPTIONS} on {DEMO_TEXT.name} (character level: bytes)", rows, LM_GRID, "",
                make_stages, probe.loss, data.batch, notes={"spec": spec})


def make_task(name: str) -> Task:
    return lm_task() if name == "lm" else convex_task(name)


# --------------------------------------------------------------------------------------------
# Training: every method through the package's references.

def train(task: Task, method: str, S: int, lr: float, steps: int) -> list[float]:
    """Each step's loss (the references' own: the mean over micro-batches, or over workers)."""
    torch = _torch()
    from gpipe_plan.runtime.async_reference import localsgd_reference, reference_run

    def sgd(params):
        return torch.optim.SGD(params, lr=lr, weight_decay=task.weight_decay)

    batches = (task.batch(s) for s in range(steps))
    if method == "1f1b":
        # Synchronous: one worker on the whole batch, averaged every step = mini-batch SGD.
        return localsgd_reference([task.whole()], task.loss_fn, batches, 1, sgd)
    if method == "localsgd":
        first = task.whole()
        replicas = [first] + [copy.deepcopy(first) for _ in range(WORKERS - 1)]
        return localsgd_reference(replicas, task.loss_fn, batches, SYNC_EVERY, sgd)
    return reference_run(task.make_stages(S), task.loss_fn, batches, method, MICRO_BATCHES, sgd)


def final_loss(losses: list[float]) -> float:
    tail = losses[-max(1, math.ceil(TAIL * len(losses))):]
    value = statistics.fmean(tail)
    return value if math.isfinite(value) else math.inf


def configurations(stages: tuple[int, ...]) -> list[tuple[str, int]]:
    """(method, S) to train; S = 0: one run serves every S. The synchronous schedules train
    mini-batch SGD whatever K; LocalSGD's workers hold the whole model; and under pipedream-2bw
    every stage's gradient is one update stale whatever K (weight_versions: W(t+1) = W(t) -
    lr grad f(W(t-1))), so its run, at the most stages, serves every S (the test checks it)."""
    return [("1f1b", 0), ("localsgd", 0), ("pipedream-2bw", 0)] + [("pipedream", S) for S in stages]


def run_key(method: str, S: int) -> str:
    """The key of the run that serves ``method`` at S stages."""
    return f"{method}@{S if method == 'pipedream' else 0}"


# --------------------------------------------------------------------------------------------
# Time: what the planner predicts for each configuration's step.

@dataclass(frozen=True)
class StageCost:
    """One stage's seconds per micro-batch (forward, backward) and per update (optimizer)."""

    forward_s: float
    backward_s: float
    optimizer_s: float


def predicted_step_s(method: str, stages: list[StageCost], micro_batches: int, worker: StageCost) -> float:
    """The predicted seconds of one step (one batch of M micro-batches) of ``method``, by the
    planner's own formulas:

    - ``1f1b``: the planner's event simulator (planner/simulator.simulate_plan) over the
      stages' times, the optimizer steps after the flush;
    - ``pipedream``/``pipedream-2bw``: M times the steady state's period
      (planner/asynchronous.steady_period_s) of each stage's work per micro-batch, its F + B
      and its share of the updates (weight_versions.updates_per_step / M), as `solve` charges it;
    - ``localsgd``: one worker's single-device step on its rows (the whole model's forward,
      backward, optimizer: ``worker``); the parameter averaging every H steps, which `solve`
      charges as a ring all-reduce / H over the network, is not priced (the 8 workers would
      share this host, with no link to price).

    Sends between stages are not priced (the stages would share one host here).
    """
    from gpipe_plan.planner.asynchronous import steady_period_s
    from gpipe_plan.planner.simulator import ChunkTimes, simulate_plan
    from gpipe_plan.weight_versions import ASYNC_SCHEDULES, updates_per_step

    M, K = micro_batches, len(stages)
    if method == "1f1b":
        chunks = [ChunkTimes(c.forward_s, c.backward_s, c.backward_s / 2, c.backward_s / 2, 0.0) for c in stages]
        return simulate_plan("1f1b", K, M, 1, chunks, [c.optimizer_s for c in stages]).step_s
    if method in ASYNC_SCHEDULES:
        share = updates_per_step(method, M) / M
        work = [c.forward_s + c.backward_s + share * c.optimizer_s for c in stages]
        return M * steady_period_s(work, [0.0] * K)
    if method == "localsgd":
        return worker.forward_s + worker.backward_s + worker.optimizer_s
    raise ValueError(f"no time model for {method!r}")


def lm_stage_costs(task: Task, stages: tuple[int, ...], repeats: int) -> dict[int, list[StageCost]]:
    """Per stage, for S = 1 (a LocalSGD worker) and each S: the layers' figures at the task's
    micro-batch rows from gpipe-plan's profiler (one thread), summed over each stage's layers."""
    torch = _torch()
    from gpipe_plan.planner.profile import Profile
    from gpipe_plan.profiles.profiler import ProfileRequest, profile_model

    request = ProfileRequest(spec=task.notes["spec"], micro_batch_sizes=[task.rows], device=torch.device("cpu"),
                             threads=1, warmup=2, repeats=repeats, recompute=False, split_backward=False)
    figures = Profile(profile_model(request)).at(task.rows)
    layers = list(zip(figures.forward_s, figures.backward_s, figures.optimizer_s))
    return {S: [StageCost(*(sum(x[i] for x in layers[cut]) for i in range(3))) for cut in contiguous(len(layers), S)]
            for S in (1, *stages)}


def timed_stage_costs(task: Task, stages: tuple[int, ...], repeats: int) -> dict[int, list[StageCost]]:
    """Per block stage, for S = 1 and each S: forward, backward and an SGD step at the task's
    micro-batch rows, timed here (the fastest of ``repeats`` after two warm-ups, one thread: these
    stages take tens of microseconds, mostly fixed per-call cost, and the fastest is the figure a
    busy neighbour moves least)."""
    torch = _torch()
    (x,), _ = task.batch(0)
    x = x[:task.rows]
    running = torch.zeros(task.rows)
    out: dict[int, list[StageCost]] = {}
    for S in (1, *stages):
        out[S] = []
        for stage in task.make_stages(S):
            optimizer = torch.optim.SGD(stage.parameters(), lr=1e-3)
            f, b, o = [], [], []
            for i in range(repeats + 2):
                inp = running.clone().requires_grad_(True)
                t0 = time.perf_counter()
                _, y = stage(x, None if stage.first else inp)
                t1 = time.perf_counter()
                y.backward(torch.ones_like(y))
                t2 = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                t3 = time.perf_counter()
                if i >= 2:
                    f.append(t1 - t0), b.append(t2 - t1), o.append(t3 - t2)
            out[S].append(StageCost(min(f), min(b), min(o)))
    return out


def step_times(costs: dict[int, list[StageCost]], stages: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Predicted seconds per step, per method and S (keys strings, for JSON)."""
    worker = costs[1][0]
    return {m: {str(S): predicted_step_s(m, costs[S], MICRO_BATCHES, worker) for S in stages} for m in METHODS}


# --------------------------------------------------------------------------------------------
# The paper's delay: k - j_k^(s) on a unit-time 1F1B timeline.

def paper_delays(S: int, micro_batches_per_stage: int = 10) -> dict[str, float]:
    """The paper's steady-state delay statistics (main.py, build_pipedream_exact_delays_from_timeline):
    a 1F1B timeline over 10 S micro-batches with forward = backward = 1 time unit (here from the
    planner's simulator), every stage's backwards counted in one global sequence k = 0, 1, ...; for
    the k-th backward (of micro-batch m), and every stage s, the delay is k minus the number of
    backwards finished before stage s's forward of m. Mean and max over the second half of the
    backwards, as the paper's. Also this package's own notion: each stage's gradient is
    ``weight_versions.staleness`` of its own updates old."""
    from gpipe_plan.planner.simulator import ChunkTimes, simulate_plan
    from gpipe_plan.weight_versions import staleness

    M = micro_batches_per_stage * S
    timeline = simulate_plan("1f1b", S, M, 1, [ChunkTimes(1.0, 1.0, 0.5, 0.5, 0.0)] * S, record=True)
    forwards = {(e.stage, e.micro_batch): e.start_s for e in timeline.events if e.kind == "forward"}
    backwards = sorted((e.end_s, e.stage, e.micro_batch) for e in timeline.events if e.kind == "backward")
    ends = [end for end, _, _ in backwards]
    import bisect

    delays = []
    for k, (_, _, m) in enumerate(backwards[len(backwards) // 2:], start=len(backwards) // 2):
        for s in range(S):
            delays.append(k - bisect.bisect_right(ends, forwards[(s, m)]))
    own = [staleness("pipedream", k, S) for k in range(S)]
    return {"mean": statistics.fmean(delays), "max": float(max(delays)), "S2_minus_S_over_2": S * S - S / 2,
            "own_staleness_per_stage": own, "own_staleness_mean": statistics.fmean(own)}


# --------------------------------------------------------------------------------------------
# Measuring.

def steps_needed(step_s: dict[str, dict[str, float]], method: str, S: int, steps: int, budget_s: float) -> int:
    """A run's length: ``steps`` (the per-step comparison), or more where the run must fill the
    time budget at some S it serves (the fixed-time comparison); at most MAX_STRETCH x steps."""
    served = [str(S)] if S else list(step_s[method])
    need = max(math.ceil(budget_s / step_s[method][s] - 1e-9) for s in served)
    return min(max(steps, need), MAX_STRETCH * steps)


MAX_STRETCH = 12


def measure(args: argparse.Namespace) -> dict[str, Any]:
    stages = tuple(args.stages)
    out: dict[str, Any] = {"stages": list(stages), "micro_batches": MICRO_BATCHES, "workers": WORKERS,
                           "sync_every": SYNC_EVERY, "tail": TAIL, "tasks": {}}
    for name in args.tasks:
        started = time.monotonic()
        task = make_task(name)
        steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS[name])
        grid = task.lr_grid[2:5] if args.quick else task.lr_grid
        repeats = 3 if args.quick else (10 if name == "lm" else 50)
        costs = (lm_stage_costs if name == "lm" else timed_stage_costs)(task, stages, repeats)
        step_s = step_times(costs, stages)
        # The fixed-time budget (the paper's comparison): what `steps` steps of pipedream at the
        # most stages take; every configuration runs as many of its steps as fit in it.
        budget_s = steps * step_s["pipedream"][str(max(stages))]
        doc = out["tasks"][name] = {
            "what": task.what, "rows_per_micro_batch": task.rows, "steps": steps, "budget_s": budget_s,
            "lr_grid": list(grid), "lr_unit": task.lr_unit,
            "notes": {k: v for k, v in task.notes.items() if k != "spec"},
            "stage_costs": {str(S): [vars(c) for c in cs] for S, cs in costs.items()},
            "time_source": "gpipe-plan profiler (profile_model)" if name == "lm" else "timed here per block stage",
            "step_s": step_s, "runs": {}}
        for method, S in configurations(stages):
            n = steps_needed(step_s, method, S, steps, budget_s)
            curves = {}
            for lr in grid:
                curves[repr(lr)] = [float(f"{v:.6g}") for v in train(task, method, S or max(stages), lr, n)]
                print(f"  {name} {method} S={S or '-'} lr={lr:.4g}: {n} steps, loss at step {steps} "
                      f"{final_loss(curves[repr(lr)][:steps]):.4g}", flush=True)
            doc["runs"][f"{method}@{S}"] = {"method": method, "S": S, "steps_run": n, "curves": curves}
        doc["took_s"] = time.monotonic() - started
    out["delays"] = {str(S): paper_delays(S) for S in stages}
    return out


def per_step(task: dict[str, Any], key: str) -> dict[str, Any]:
    """A run's best lr over its first ``steps`` steps (the same data for every method)."""
    curves, steps = task["runs"][key]["curves"], task["steps"]
    finals = {lr: final_loss(c[:steps]) for lr, c in curves.items()}
    best = min(finals, key=finals.get)
    return {"best_lr": float(best), "final": finals[best], "losses": curves[best][:steps], "grid_final": finals}


def fixed_time(task: dict[str, Any], key: str, S: int) -> dict[str, Any]:
    """A run's best lr within the time budget at S stages: the steps whose predicted end fits."""
    run = task["runs"][key]
    step = task["step_s"][run["method"]][str(S)]
    n = max(1, min(run["steps_run"], math.floor(task["budget_s"] / step + 1e-9)))
    finals = {lr: final_loss(c[:n]) for lr, c in run["curves"].items()}
    best = min(finals, key=finals.get)
    return {"best_lr": float(best), "final": finals[best], "losses": run["curves"][best][:n], "steps": n,
            "step_s": step}


# --------------------------------------------------------------------------------------------
# Pictures and the section.

# Colour: the method; dashes: S; solid: a run that serves every S (module docstring).
DASHES = {0: "", 1: "", 2: "8,3", 4: "4,3", 8: "1.5,2.5"}


def series(doc: dict[str, Any], name: str) -> tuple[list, list]:
    """(label, colour, dash, [(updates, loss)]) per run at its per-step best lr, and
    (label, colour, dash, [(predicted seconds, loss)]) per method and S at its fixed-time best lr."""
    from gpipe_plan.weight_versions import updates_per_step

    task = doc["tasks"][name]
    by_updates, by_time = [], []
    for key, run in task["runs"].items():
        method, S = run["method"], run["S"]
        colour = COLOURS[METHODS.index(method)]
        per = updates_per_step(method, doc["micro_batches"]) if method in ("pipedream", "pipedream-2bw") else 1
        label = f"{method} (every S)" if not S else f"{method} S={S}"
        by_updates.append((label, colour, DASHES[S],
                           [((i + 1) * per, v) for i, v in enumerate(per_step(task, key)["losses"])]))
        for S_time in ([S] if S else doc["stages"]):
            if method == "localsgd" and S_time != doc["stages"][-1]:
                continue      # 8 workers whatever S: one line (the largest S's best lr)
            best = fixed_time(task, key, S_time)
            lab = f"{method} S={S_time}" if method != "localsgd" else "localsgd (every S)"
            by_time.append((lab, colour, DASHES[S_time] if method != "localsgd" else "",
                            [((i + 1) * best["step_s"], v) for i, v in enumerate(best["losses"])]))
    return by_updates, by_time


def _smooth(points: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """A running mean over ``window`` steps (the step losses are per mini-batch: noisy)."""
    out = []
    for i in range(len(points)):
        part = points[max(0, i - window + 1):i + 1]
        out.append((points[i][0], statistics.fmean(y for _, y in part)))
    return out


def y_ticks(lo: float, hi: float) -> list[float]:
    """Ticks for a log axis: at most about 8 powers of ten over many decades, 1-2-5 over a
    few, evenly spaced values over less than one."""
    decades = list(range(math.ceil(math.log10(lo)), math.floor(math.log10(hi)) + 1))
    if len(decades) >= 3:
        return [10.0 ** e for e in decades[::math.ceil(len(decades) / 8)]]
    ticks = _log_ticks(lo, hi)
    return ticks if len(ticks) >= 3 else [t for t in _lin_ticks(lo, hi, 5) if t > 0]


def line_chart(title: str, panels: list[tuple[str, list]], ylabel: str, log_x: tuple[bool, ...] = ()) -> str:
    """Side-by-side panels of lines on a log y axis (and a log x axis where ``log_x`` says);
    one legend, on the right."""
    pw, ph, left, gap, up, legend = 330, 300, 60, 50, 40, 190
    width = left + len(panels) * (pw + gap) + legend
    height = up + ph + 50
    ys = [y for _, lines in panels for _, _, _, pts in lines for _, y in pts if math.isfinite(y) and y > 0]
    lo, hi = min(ys), max(ys)
    lo, hi = lo / 1.1, hi * 1.1
    a, b = math.log10(lo), math.log10(hi)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13" font-weight="bold">{_esc(title)}</text>']
    for p, (xlabel, lines) in enumerate(panels):
        x0 = left + p * (pw + gap)
        xmax = max(x for _, _, _, pts in lines for x, _ in pts) or 1.0

        logx = p < len(log_x) and log_x[p]

        def px(v: float) -> float:
            if logx:
                return x0 + math.log10(max(v, 1.0)) / math.log10(max(xmax, 10.0)) * pw
            return x0 + v / xmax * pw

        def py(v: float) -> float:
            v = min(max(v, lo), hi)
            return up + ph - (math.log10(v) - a) / (b - a) * ph

        out.append(f'<rect x="{x0}" y="{up}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        yt = y_ticks(lo, hi)
        for t in yt:
            out.append(f'<line x1="{x0}" y1="{py(t):.1f}" x2="{x0 + pw}" y2="{py(t):.1f}" stroke="#eee"/>')
            out.append(f'<text x="{x0 - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{t:.3g}</text>')
        for t in (_log_ticks(1.0, xmax) if logx else _lin_ticks(0, xmax, 5)):
            out.append(f'<line x1="{px(t):.1f}" y1="{up}" x2="{px(t):.1f}" y2="{up + ph}" stroke="#eee"/>')
            out.append(f'<text x="{px(t):.1f}" y="{up + ph + 14}" text-anchor="middle">{t:g}</text>')
        for _, colour, dash, pts in lines:
            good = [(x, y) for x, y in _smooth(pts, 5) if math.isfinite(y)]
            if good:
                coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in good)
                style = f' stroke-dasharray="{dash}"' if dash else ""
                out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.4"{style}/>')
        out.append(f'<text x="{x0 + pw / 2}" y="{height - 14}" text-anchor="middle">{_esc(xlabel)}</text>')
    out.append(f'<text x="14" y="{up + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {up + ph / 2})">'
               f'{_esc(ylabel)}</text>')
    lx = left + len(panels) * (pw + gap) - gap + 16
    colours = {}
    for _, lines in panels:
        for label, colour, _, _ in lines:
            colours.setdefault(label.split(" ")[0], colour)
    keys = [(m, c, "") for m, c in colours.items()]
    keys += [("(every S): one run serves all", "#555", "")]
    keys += [(f"S = {S}", "#555", DASHES[S]) for S in sorted({int(label.split("S=")[1]) for _, lines in panels
                                                              for label, _, _, _ in lines if "S=" in label})]
    for i, (label, colour, dash) in enumerate(keys):
        y = up + 4 + 16 * i
        style = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{lx}" y1="{y}" x2="{lx + 24}" y2="{y}" stroke="{colour}" stroke-width="2"{style}/>')
        out.append(f'<text x="{lx + 29}" y="{y + 4}">{_esc(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def ordering(finals: dict[str, float]) -> str:
    return " < ".join(f"{m} {finals[m]:.3g}" for m in sorted(finals, key=finals.get))


def lr_text(task: dict[str, Any], lr: float) -> str:
    unit = task["lr_unit"]
    scale = task["notes"].get("smoothness_L", 1.0) if unit else 1.0
    edge = " (grid edge)" if lr in (task["lr_grid"][0], task["lr_grid"][-1]) else ""
    return f"{lr * scale:.3g}{' / L' if unit else ''}{edge}"


def render(doc: dict[str, Any], args: argparse.Namespace) -> str:
    rows, pictures, order_rows = [], [], []
    for name, task in doc["tasks"].items():
        by_updates, by_time = series(doc, name)
        svg = line_chart(f"{name}: training loss (running mean of 5 steps), best lr per method",
                         [(f"updates (log), {task['steps']} steps (pipedream: M = {doc['micro_batches']} per step)",
                           by_updates),
                          ("predicted seconds (planner's model, this CPU), best lr within the budget", by_time)],
                         "loss", log_x=(True, False))
        write_svg(f"async-{name}.svg", svg)
        pictures.append(f"![{name}](benchmarks/async-{name}.svg)")
        for S in doc["stages"]:
            step_finals, time_finals = {}, {}
            for method in METHODS:
                key = run_key(method, S)
                ps, ft = per_step(task, key), fixed_time(task, key, S)
                step_finals[method], time_finals[method] = ps["final"], ft["final"]
                rows.append([name, method, S, f"{ft['step_s'] * 1e3:.2f}", f"{ps['final']:.4g}",
                             lr_text(task, ps["best_lr"]), ft["steps"], f"{ft['final']:.4g}",
                             lr_text(task, ft["best_lr"])])
            order_rows.append([name, S, ordering(step_finals), ordering(time_finals)])
    grids = []
    for name, task in doc["tasks"].items():
        unit = task["lr_unit"]
        scale = task["notes"].get("smoothness_L", 1.0) if unit else 1.0
        vals = ", ".join(f"{lr * scale:.3g}" for lr in task["lr_grid"])
        grids.append(f"{name}: {vals}{' (times 1/L, L = ' + format(scale, '.3g') + ')' if unit else ''}, "
                     f"per step {task['steps']} steps of {task['rows_per_micro_batch'] * doc['micro_batches']} rows")
    delay_rows = [[S, f"{d['mean']:.1f}", f"{d['max']:.0f}", f"{d['S2_minus_S_over_2']:.1f}",
                   " ".join(map(str, d["own_staleness_per_stage"])), f"{d['own_staleness_mean']:.1f}"]
                  for S, d in doc["delays"].items()]
    text = "\n".join([
        "## Asynchronous pipelines against SGD and LocalSGD (the Randomized PipeDream comparison)",
        "",
        f"Machine: {doc.get('machine', 'unknown')}; revision {doc.get('revision', 'unknown')}. "
        f"{doc.get('ledger', '')}",
        "",
        "The seed comparison of Randomized PipeDream (arXiv:2606.03498, code vectozavr/randomized-pipedream) "
        "on this package's references: `runtime/async_reference.reference_run` for pipedream and pipedream-2bw, "
        "`localsgd_reference` for LocalSGD and for synchronous SGD (one worker, averaged every step). Those "
        "compute what a real run computes (tests/runtime/test_async_reference.py, tests of the runs at 1e-5), so this "
        "part trains in one process and starts none. Synchronous 1F1B trains mini-batch SGD on the step's mean "
        "gradient whatever K, so its one run serves every S, which changes only its time; so does pipedream-2bw's "
        "(every stage one update stale whatever K: W(t+1) = W(t) - lr grad f(W(t-1)); trained at the most stages, "
        "the test checks S = 2 and 4 agree at 1e-5); LocalSGD runs "
        f"{doc['workers']} workers, each the whole model on its B/{doc['workers']} rows, averaged every "
        f"H = {doc['sync_every']} steps, whatever S. M = {doc['micro_batches']} micro-batches per step; all "
        "methods see the same batches from the same initial weights, plain SGD. Loss: the references' training "
        f"loss per step (pipedream's at the stale weights each micro-batch met); final = the mean over the last "
        f"{doc['tail']:.0%} of steps (the paper's stable tail), which also picks each method's best lr.",
        "",
        "Time axis: the predicted seconds per step of each configuration, from the stages' measured forward, "
        "backward and optimizer times on this CPU (one thread; the LM's from gpipe-plan's profiler, the block "
        "stages' timed by this part, the fastest of repeated timings): 1F1B through the planner's event "
        "simulator, pipedream and 2bw as `solve` prices them, M x the steady state's period "
        "(planner/asynchronous.steady_period_s: the slowest stage's F + B and its share of the updates, no "
        "bubble), LocalSGD one worker's single-device step (its averaging, which `solve --gradient-sync "
        "localsgd` charges as an all-reduce / H over a link, not priced: the workers share this host). "
        "bench/async_pipelines.predicted_step_s holds these. Pipelines use S devices, LocalSGD 8: equal at "
        "S = 8. The stage times were "
        "measured while other work shared the cores (the load averages above), so the time axis moves with "
        "the load; the per-step comparison does not depend on it.",
        "",
        "Learning-rate grids (powers of 2 for the LM, multiples of 1/L for the convex tasks, as the paper's):",
        "",
        *[f"- {g}" for g in grids],
        "",
        *pictures,
        "",
        "Per step: the mean loss of the last 20% of the first `steps` steps, every method on the same data, "
        "best lr for it. Fixed time: the same over the steps whose predicted end lies within the task's budget "
        "(`steps` steps of pipedream at the most stages: " + ", ".join(
            f"{n} {t['budget_s'] * 1e3:.3g} ms" for n, t in doc["tasks"].items()) + "), best lr for that; "
        "the paper compares at a fixed simulated time.",
        "",
        table(["task", "method", "S", "predicted ms/step", "per step: final", "best lr", "fixed time: steps",
               "final", "best lr"], rows),
        "",
        "Orderings, best first:",
        "",
        table(["task", "S", "per step", "at fixed predicted time"], order_rows),
        "",
        "### The delay",
        "",
        "The paper's delay is k - j_k^(s): every stage's backwards counted in one global sequence, for the "
        "k-th backward (of micro-batch m) and every stage s, k minus the backwards done before stage s's "
        "forward of m, on a unit-time 1F1B timeline (F = B = 1) over 10 S micro-batches, second half only "
        "(its main.py). Computed here on the planner's simulator's 1F1B timeline, counting a backward when it "
        "ends at or before the forward starts (the paper's code also counts one in the same time slot at a "
        "lower stage, a difference of under one slot). This package's own notion is per stage: stage k's "
        "gradient is K - 1 - k of its own updates old (weight_versions.staleness).",
        "",
        table(["S", "paper's delay, mean", "max", "S^2 - S/2", "own staleness per stage", "its mean"], delay_rows),
        "",
        "The largest delay is S^2 - S/2 at " + (
            "every S here" if all(d["max"] == d["S2_minus_S_over_2"] for d in doc["delays"].values())
            else "S = " + ", ".join(S for S, d in doc["delays"].items() if d["max"] == d["S2_minus_S_over_2"]))
        + "; the mean is "
        + ", ".join(f"{d['mean'] / int(S) ** 2:.2f} S^2 at S = {S}" for S, d in doc["delays"].items())
        + ". In the package's own per-stage count the same pipeline's gradients are 0 to S - 1 updates old: "
        "the global count multiplies by about the S stages that update in between.",
        "",
        "### Does the ordering match the paper's?",
        "",
        verdict(doc),
        "",
        "### Where this follows the paper's code and where it does not",
        "",
        "- Followed: the objectives and their generators (QuadraticObjective, LogisticRegressionObjective: "
        "x ~ N(0, I), w* ~ N(0, I), no noise, labels ~ Bernoulli(sigmoid(x.w*)), L2 1e-4, d = 100 and 512), "
        "their S-stage pipeline (S contiguous blocks of w, make_stage_slices; each stage adds its block's "
        "x.w_k to the running sum), zero initial weights, consecutive unshuffled batches, micro-batches of 10 "
        "rows, plain SGD, lr grids as multiples of 1/L (L their smoothness constants) and the LM's powers of 2 "
        "(its 2^-4..2^1 moved to 2^-6..2^0: a first run found the pipelines' best at 2^-4 and every method "
        "diverging at 2^1), "
        "best lr by the tail mean of the loss (tail 20%), LocalSGD's H = 5 local steps, the LM's shape "
        "(embedding, blocks, head; width 64, 4 heads, 32 characters) and its one-layer-per-stage cut at S = 8.",
        "- Not followed: the paper's LM grows with S (S - 2 blocks; S >= 3); here one model (its S = 8 one) "
        "is cut into S contiguous stages, so that every S trains the same model, and S = 2 exists. The LM's "
        "micro-batches are 4 rows, not 16 (time), on this package's shipped text, not the paper's toy text or "
        "Tiny Shakespeare, and the vocabulary is bytes (256). The paper's datasets are tiny (its README: 120 "
        "examples for 5 epochs); here 4,000 examples, so that N > d. The paper's LocalSGD runs its workers "
        "interleaved through the same S-stage pipeline (IndependentLocalSGDScheduler, a drain at every sync), "
        "so its time depends on S; here LocalSGD is 8 data-parallel workers, each the whole model, priced as one "
        "device's step (runtime/async_reference.localsgd_reference, what `--gradient-sync localsgd` runs). The "
        "paper's time axis is a unit-time timeline (every F and B one slot); here it is the planner's "
        "prediction from times measured on this CPU, where the convex tasks' stages are so small that a "
        "stage's time is mostly fixed per-call cost (so their predicted step barely shrinks with S). The "
        "paper applies L2 at the stashed weights; here it is SGD's weight decay, at the newest. Its "
        "RPD/GPD method (randomized stale block updates) is not run: it is no schedule of this package.",
    ]) + "\n"
    return text


CLAIMS = {"quadratic": "pipedream beats LocalSGD", "lm": "pipedream beats LocalSGD",
          "logistic": "LocalSGD beats pipedream, more so as S grows"}


def verdict(doc: dict[str, Any]) -> str:
    """The paper's claims against these runs, per step and at fixed predicted time (computed)."""
    lines = []
    for name, task in doc["tasks"].items():
        ratios = {"per step": [], "at fixed time": []}
        for S in doc["stages"]:
            pd, local = (per_step(task, run_key(m, S))["final"] for m in ("pipedream", "localsgd"))
            ratios["per step"].append(pd / local if local > 0 else math.inf)
            pd, local = (fixed_time(task, run_key(m, S), S)["final"] for m in ("pipedream", "localsgd"))
            ratios["at fixed time"].append(pd / local if local > 0 else math.inf)
        parts = []
        for how, rs in ratios.items():
            ahead = [S for S, r in zip(doc["stages"], rs) if r < 1]
            growing = all(b >= a for a, b in zip(rs, rs[1:]))
            parts.append(f"{how}, pipedream's final loss / LocalSGD's is {' / '.join(f'{r:.3g}' for r in rs)} at "
                         f"S = {'/'.join(map(str, doc['stages']))} (pipedream ahead at "
                         f"{'S = ' + ', '.join(map(str, ahead)) if ahead else 'no S'}; the ratio "
                         f"{'grows' if growing else 'does not grow'} with S)")
        floor = [S for S in doc["stages"] if min(fixed_time(task, run_key(m, S), S)["final"] for m in METHODS) < 1e-9]
        S_max = max(doc["stages"])
        pd_run, local_run = (fixed_time(task, run_key(m, S_max), S_max) for m in ("pipedream", "localsgd"))
        parts.append(f"in the budget LocalSGD ran {local_run['steps']} steps, pipedream at S = {S_max} "
                     f"{pd_run['steps']} (predicted {local_run['step_s'] * 1e3:.3g} against "
                     f"{pd_run['step_s'] * 1e3:.3g} ms a step)")
        lines.append(f"- {name}, the paper: {CLAIMS[name]}. Here, " + "; ".join(parts) + "."
                     + (f" At fixed time (S = {', '.join(map(str, floor))}) some losses are under 1e-9, float32's "
                        "floor for this loss: those methods have all converged, and their ratios say only who got "
                        "there first." if floor else ""))
    lines += [
        "",
        "How to read it: per step every method sees the same rows, so the comparison is of the updates "
        "alone: pipedream makes M = 8 small updates a step where the others make one. At fixed time the "
        "planner's step decides: a LocalSGD worker runs one micro-batch through the whole model a step, a "
        "pipeline M micro-batches through its slowest stage. Where a stage's time is mostly fixed per-call "
        "cost (the convex tasks' stages here take tens of microseconds whatever their share of w), a pipeline "
        "step costs about M worker steps at every S and LocalSGD runs that many more steps in the budget; "
        "where it is compute (the LM), the pipeline's step shrinks with S toward the worker's, and the "
        "updates decide. The paper's time is a unit-time timeline in which LocalSGD's workers share the same "
        "S-stage pipeline, a different price list: where the orderings differ from the paper's, the price "
        "list is the first suspect.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench async", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS),
                        help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--steps", type=int, default=None, help="steps per run, every task (default: "
                        + ", ".join(f"{t} {n}" for t, n in DEFAULT_STEPS.items()) + ")")
    parser.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=list(STAGES))
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps, 3 learning rates, few timing repeats: a smoke run, figures "
                             "not worth publishing (written under --out, by default a temporary folder)")
    parser.add_argument("--out", type=Path, default=None, help="write the section, pictures and JSON here instead "
                                                               "of docs/benchmarks")
    parser.add_argument("--from-json", type=Path, default=None, help="re-render from saved figures, no training")
    args = parser.parse_args(argv)
    bad = [t for t in args.tasks if t not in TASKS]
    if bad:
        parser.error(f"unknown task {bad[0]!r}: choose from {', '.join(TASKS)}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.from_json is not None and not args.from_json.is_file():
        parser.error(f"--from-json {args.from_json}: no such file (a full run writes docs/benchmarks/data/async.json)")
    if any(S < 1 or S > max(STAGES) or max(STAGES) % S for S in args.stages):
        parser.error(f"--stages must divide {max(STAGES)} (the layers every task has)")
    if args.quick and args.out is None:
        import tempfile

        args.out = Path(tempfile.gettempdir()) / "bench-async-quick"
    if args.out is not None:
        _redirect(args.out)
    doc = measured_or_saved("async", args, lambda ledger: measure(args))
    publish("async", render(doc, args))


def _redirect(folder: Path) -> None:
    """Send every file this part writes to ``folder`` (the test's, and --quick's)."""
    from . import common

    folder.mkdir(parents=True, exist_ok=True)
    common.RESULTS = folder
