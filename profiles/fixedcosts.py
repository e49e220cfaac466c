"""The runtime's fixed costs, measured with a short real pipeline: the profile's ``fixed_costs``.

The planner charges every action a fixed cost of its kind and every message between stages
one more (planner/fixedcosts.py says what they are and where they are charged). They are the
runtime's own work, so they are measured by running it: two processes, the backend and the
executor ``run`` uses (gloo and the native executor on a CPU; NCCL and torch's executor on
CUDA), the model's own layers, and the very action lists the planner simulates, at several
chunk counts:

    1f1b and zb-h1 (2 chunks), interleaved v=2 and zb-v (4 chunks), interleaved v=3 (6 chunks)

on K = 2 stages with M = 4 micro-batches, at each of the profile's micro-batch sizes in turn
(the processes start once). With a few layers (the whole model when it has at most
:data:`MAX_LAYERS`, else the cheapest run of that many at the middle size), these runs differ
in how many actions and messages the same work is cut into, which is what separates the fixed
costs from the layers' own time. Each run is cut as evenly in work as its stages allow, as a
plan is ([Note: probe runs are balanced]).

Why every size: these costs are fixed in the number of layers, not in the micro-batch size.
A message's bytes grow with it (gloo copies them on the cores that compute), and so does what
an action costs in a pipeline beyond its layers timed alone. On the development VM the built-in
gpt's forward and backward figures about doubled from micro-batch 4 to 8 (0.13 to 0.28 ms and
0.15 to 0.32 ms; docs/benchmarks/fidelity.md), so a plan of micro-batches of 8 charged the
figures of 4 was charged half of them. The planner charges a plan the figures at its own size
(interpolated between the measured ones: planner/fixedcosts.py, ``figures_at``). The runtime times every
action as a span (runtime/timing.py: wall time on a CPU, CUDA events on a GPU), here as in a
run, since what the planner predicts is the run's wall-clock step: a send that makes its
sender wait for the socket, a wake-up after a receive, land in these figures as they land in a
run (timed on the thread's CPU time instead, as the profile times the layers, they came out
near zero on the development VM while a run's spans took 0.5 ms more per block than profiled;
docs/benchmarks/fidelity.md). The fit (:func:`fit_fixed_costs`) is:

- per action kind and sending, by least squares over every (run, chunk, kind): the span's
  median less what the profile says its layers take (scaled by the neighbours' slowdown,
  ``contention``, which is charged on layer times already and so not counted twice):
  ``span - layers = kind's fixed cost + sends x send_s``, never below 0;
- between actions: the time a step's spans leave uncovered (the executor's loop, Python's
  own cost per call) per interval between two actions, the median over steps;
- per receive: what is left of each run's step, fitted by the planner's own simulator
  (the planner's cost model on these layers and cuts, with the figures above): the one value
  that makes the predicted steps of all runs match the measured ones best (least squares in
  the logarithm of their ratio), since a receive's cost (waiting on a message that has landed,
  posting the next) shows on the critical path, not in a span of its own.

The spread of each figure is that of the same fit on each measured step alone (its IQR /
1.349), and each run's measured / predicted step is recorded (``configurations``): how well
the fitted model explains the very runs it came from.

It takes seconds: the processes start once and run every configuration in turn.

[Note: the optimizer timed where it runs]
The profile times each layer's optimizer step alone, Adam over copies of its parameters in a
warm loop. A run steps its stage's optimizer right after the step's backwards, and there it took
1.3-1.5 times as long (the median per model over every run of two fidelity benches on the
development VM: gpt 1.50, the small Llama 1.47, resnet 1.32; 1.26-1.67 per plan), on every plan
alike: what the step's activations left in the caches, not the schedule. So each probe rank steps
Adam over its chunks' parameters after every step (outside the step's own time, before the next
step's barrier), and the record's ``optimizer_scale`` is the median, over every run and rank at
every size, of that step's time over its layers' profiled figures; plans charge the layers'
``optimizer_s`` times it (planner/profile.py).

Ranks that share cores (:func:`measure_shared_cores`, the profile's ``fixed_costs.shared_cores``).
A plan of more ranks than its host runs at once is played out on shared cores
(planner/timeshare.py), and the runs are slower still than that sharing: a rank's caches are
cold when it gets its core back, and the kernel hands cores over in slices. So on a CPU host
that runs at most half of :data:`MAX_SHARED_PROCESSES` ranks at once, the same probe runs again
on twice as many processes as it runs at once (one chunk each: 1F1B, zb-h1, GPipe; its steps
back to back, as a run takes them, since a rank that is done with a step competes for the
cores with the ranks still in it), and
:func:`fit_shared_slowdown` finds what every action costs there beyond its time on a core of
its own (layers and fixed costs as a core of its own measured them): that time times a factor,
plus a cost of its own, the pair that makes the planner's time-shared steps of those runs
match the measured ones. Plans of more ranks than cores charge both.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..hostload import SPREAD_VALUES, robust_spread
from ..models.precision import Precision
from ..schedules import all_actions, chunks_per_stage, stage_of_chunk
from .measure import distinct_parameters
from .spawn import run_workers

# What the probe pipeline runs: K = 2 stages, M = 4 micro-batches (interleaved needs M to be a
# multiple of its rounds of K), at most MAX_LAYERS of the model's layers, these schedules.
STAGES = 2
MICRO_BATCHES = 4
MAX_LAYERS = 6
CONFIGURATIONS = (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 1), ("interleaved", 3))
WARMUP_STEPS = 3
MEASURED_STEPS = 8
# The receive figure is searched in [0, this]: far above what a message costs on any machine.
MAX_RECEIVE_S = 0.05
# Ranks that share cores (measure_shared_cores): twice as many processes as the host runs at
# once, on hosts that run at most half this many (more would take longer than the figure is
# worth: a plan of more stages than such a host's cores is rare); these schedules (one chunk per
# stage: a window of a few layers cut into twice the host's cores); the slowdown searched in
# [1, MAX_SHARED_SLOWDOWN], the cost added to each action in [0, MAX_SHARED_ACTION_S].
MAX_SHARED_PROCESSES = 8
SHARED_CONFIGURATIONS = (("1f1b", 1), ("zb-h1", 1), ("gpipe", 1))
MAX_SHARED_SLOWDOWN = 4.0
MAX_SHARED_ACTION_S = 0.005
# Steps back to back vary more than steps after a barrier: twice as many measured.
SHARED_MEASURED_STEPS = 16
KINDS = ("forward", "backward", "backward_input", "backward_weight")


@dataclass(frozen=True)
class Probe:
    """One run of the probe pipeline: a schedule and the cut of the window into its chunks."""

    schedule: str
    virtual_stages: int
    bounds: tuple[int, ...]        # chunk boundaries within the window: 0 = b0 < ... < bC = layers
    stages: int = STAGES
    # Steps back to back, as `run` takes them (no barrier between two: a rank starts its next
    # step once it is done with this one), rather than each after a barrier.
    back_to_back: bool = False
    measured_steps: int = MEASURED_STEPS

    @property
    def chunks(self) -> int:
        return len(self.bounds) - 1


def probes(layers: int, stages: int = STAGES, configurations=CONFIGURATIONS, back_to_back: bool = False,
           measured_steps: int = MEASURED_STEPS, work: Sequence[float] | None = None) -> list[Probe]:
    """The runs for a window of ``layers`` layers on ``stages`` processes: each configuration
    whose chunks have a layer each, cut as :func:`balanced_bounds` cuts it."""
    out = []
    for schedule, v in configurations:
        C = stages * chunks_per_stage(schedule, v)
        if C <= layers:
            out.append(Probe(schedule, v, balanced_bounds(schedule, v, stages, layers, work), stages, back_to_back,
                             measured_steps))
    return out


def balanced_bounds(schedule: str, virtual_stages: int, stages: int, layers: int,
                    work: Sequence[float] | None) -> tuple[int, ...]:
    """The cut of a window of ``layers`` layers into the configuration's chunks whose busiest
    stage has the least ``work`` (each layer's forward and backward), as the planner cuts a plan;
    among equals, and without ``work``, the chunks of the most nearly equal layer counts. Every
    cut is tried: a probe's window has a few layers (at most MAX_LAYERS, or one per process).

    [Note: probe runs are balanced]
    A message costs CPU time on the host (gloo's I/O threads), and a stage that idles leaves its
    core to it: a run with one stage far busier than the other hides messages that a balanced
    plan pays for, and one set of figures fitted to both kinds of run fits neither. Cut by layer
    counts (6 layers into 4 chunks: 1, 2, 1, 2), interleaved v = 2 and zb-v put three of a
    model's four blocks on one stage; measured: docs/planner.md, "Fixed costs"."""
    C = stages * chunks_per_stage(schedule, virtual_stages)
    even = tuple(c * layers // C for c in range(C + 1))
    if work is None or len(work) != layers:
        return even
    where = [stage_of_chunk(schedule, c, stages) for c in range(C)]

    def busiest(bounds: tuple[int, ...]) -> float:
        load = [0.0] * stages
        for c in range(C):
            load[where[c]] += sum(work[bounds[c]:bounds[c + 1]])
        return max(load)

    def unevenness(bounds: tuple[int, ...]) -> int:
        return sum(abs(a - b) for a, b in zip(bounds, even))

    cuts = ((0, *inner, layers) for inner in itertools.combinations(range(1, layers), C - 1))
    return min(cuts, key=lambda b: (busiest(b), unevenness(b), b))


def window(doc: dict[str, Any], size_index: int, layers: int = MAX_LAYERS) -> tuple[int, int]:
    """The layers [first, end) the probe runs: the whole model when it has at most ``layers``
    layers, else the run of that many whose forward and backward take least (the cheapest:
    the probe stays short whatever the model; the first layer's inputs are then activations,
    made by running the layers before it once)."""
    L = len(doc["layers"])
    n = min(L, layers)
    work = layer_work(doc, (0, L), size_index)
    first = min(range(L - n + 1), key=lambda a: (sum(work[a:a + n]), a))
    return first, first + n


def layer_work(doc: dict[str, Any], layers: tuple[int, int], size_index: int) -> list[float]:
    """Each layer's forward and backward, of the layers [first, end) ``layers``, at the profile's
    ``size_index``-th micro-batch size."""
    first, end = layers
    return [layer["forward_s"][size_index] + layer["backward_s"][size_index] for layer in doc["layers"][first:end]]


def measure_fixed_costs(spec: dict[str, Any], doc: dict[str, Any], threads: int = 1, seed: int = 0,
                        precision: Precision | None = None, device: torch.device | None = None,
                        timeout_s: float = 300.0) -> dict[str, Any]:
    """The profile's ``fixed_costs``: the probe pipeline run at every micro-batch size of the
    profile, and :func:`fit_fixed_costs` on each size's runs.

    ``doc`` is the profile measured so far (its layers' times, ``contention``, ``link``). The
    record's own figures are those of the middle size (what a reader of version 10 finds);
    ``per_micro_batch_size`` holds every size's, which the planner charges at a plan's size
    (planner/fixedcosts.py, :func:`~gpipe_plan.planner.fixedcosts.figures_at`)."""
    started = time.perf_counter()
    device = device or torch.device("cpu")
    middle = len(doc["micro_batch_sizes"]) // 2
    first, end = window(doc, middle)
    runs = probes(end - first, work=layer_work(doc, (first, end), middle))
    backend = "nccl" if device.type == "cuda" else "gloo"
    executor = "torch" if device.type == "cuda" else "native"
    size_indices = list(range(len(doc["micro_batch_sizes"])))
    measured = _run_probes(spec, doc, (first, end), size_indices, runs, threads, seed, precision, backend, executor,
                           device.index or 0, timeout_s, "timing the runtime's fixed costs in a 2-process pipeline",
                           "timing the fixed costs")
    per_size = [{"micro_batch_size": doc["micro_batch_sizes"][i], **fit_fixed_costs(doc, (first, end), i, runs_at)}
                for i, runs_at in zip(size_indices, measured)]
    fixed = {key: value for key, value in per_size[middle].items() if key != "micro_batch_size"}
    scale, ratios = fit_optimizer_scale(doc, (first, end), [run for runs_at in measured for run in runs_at])
    if scale is not None:
        fixed.update(optimizer_scale=scale, optimizer_scale_spread=robust_spread(ratios))
    fixed.update(executor=executor, backend=backend, **_what_ran(doc, (first, end), middle, STAGES, threads, started))
    fixed["per_micro_batch_size"] = [{key: value for key, value in entry.items() if key != "compute_scale"}
                                     for entry in per_size]
    return fixed


def _run_probes(spec: dict[str, Any], doc: dict[str, Any], layers: tuple[int, int], size_indices: list[int],
                runs: list[Probe], threads: int, seed: int, precision: Precision | None, backend: str, executor: str,
                gpu: int, timeout_s: float, what: str, doing: str) -> list[list[ProbeRun]]:
    """``runs`` (each on as many processes as its ``stages``) on the window ``layers`` at each
    of the profile's ``size_indices``-th micro-batch sizes, one process per stage (started
    once for all of them): what each measured, per size."""
    processes = runs[0].stages
    sizes = [doc["micro_batch_sizes"][i] for i in size_indices]
    returned = run_workers(_worker, processes, (_free_port(), spec, seed, precision or Precision(), threads, layers,
                                                sizes, runs, backend, executor, gpu),
                           timeout_s, what)
    if len(returned) != processes:
        raise RuntimeError(f"{processes - len(returned)} of the {processes} processes {doing} returned nothing")
    by_rank = [r[1] for r in sorted(returned, key=lambda r: r[0])]
    return [[ProbeRun.merge(p, [mine[s][i] for mine in by_rank]) for i, p in enumerate(runs)]
            for s in range(len(sizes))]


def _what_ran(doc: dict[str, Any], layers: tuple[int, int], size_index: int, processes: int, threads: int,
              started: float) -> dict[str, Any]:
    """The record's keys that say what a probe measurement ran, and how long it took."""
    first, end = layers
    return {"processes": processes, "threads_per_process": threads,
            "micro_batch_size": doc["micro_batch_sizes"][size_index],
            "layers": [layer["name"] for layer in doc["layers"][first:end]], "seconds": time.perf_counter() - started}


def shared_processes(cores: int | None, threads: int, layers: int) -> int:
    """How many processes :func:`measure_shared_cores` runs on a host of ``cores`` (each process
    ``threads`` threads) for a model of ``layers`` layers: twice as many as the host runs at
    once; 0 where it measures nothing (cores not known, more than :data:`MAX_SHARED_PROCESSES`
    needed, or fewer layers than processes: each process holds one chunk of a layer or more)."""
    if not cores:
        return 0
    processes = 2 * max(1, cores // max(1, threads))
    return processes if processes <= MAX_SHARED_PROCESSES and processes <= layers else 0


def measure_shared_cores(spec: dict[str, Any], doc: dict[str, Any], processes: int, threads: int = 1,
                         seed: int = 0, precision: Precision | None = None, timeout_s: float = 300.0
                         ) -> dict[str, Any]:
    """The profile's ``fixed_costs.shared_cores``: the probe pipeline on ``processes`` processes,
    twice as many as the host runs at once (:func:`shared_processes`), and
    :func:`fit_shared_slowdown` on it; after :func:`measure_fixed_costs` (``doc["fixed_costs"]``
    is what a core of its own costs, and this measures what sharing adds). CPU only (gloo, the
    native executor): a GPU per rank shares nothing."""
    started = time.perf_counter()
    size_index = len(doc["micro_batch_sizes"]) // 2
    first, end = window(doc, size_index, max(MAX_LAYERS, processes))
    runs = probes(end - first, processes, SHARED_CONFIGURATIONS, back_to_back=True, measured_steps=SHARED_MEASURED_STEPS,
                  work=layer_work(doc, (first, end), size_index))
    if not runs:
        raise ValueError(f"a window of {end - first} layers cannot be cut for {processes} processes")
    measured = _run_probes(spec, doc, (first, end), [size_index], runs, threads, seed, precision, "gloo", "native",
                           0, timeout_s, f"timing ranks that share cores in a {processes}-process pipeline",
                           "timing shared cores")[0]
    shared = fit_shared_slowdown(doc, (first, end), size_index, measured)
    shared.update(**_what_ran(doc, (first, end), size_index, processes, threads, started))
    return shared


@dataclass
class ProbeRun:
    """What one probe run measured: per measured step, each rank's step time and its spans
    ``(step, kind, chunk, start_s, end_s)``."""

    probe: Probe
    step_s: list[list[float]]                       # [rank][step]
    spans: list[list[tuple[int, str, int, float, float]]]   # [rank][...]
    optimizer_s: list[list[float]] = field(default_factory=list)   # [rank][step]: Adam after the step

    @classmethod
    def merge(cls, probe: Probe, per_rank: list[dict[str, Any]]) -> "ProbeRun":
        return cls(probe, [r["step_s"] for r in per_rank], [[tuple(s) for s in r["spans"]] for r in per_rank],
                   [r.get("optimizer_s") or [] for r in per_rank])

    def steps(self) -> list[int]:
        return sorted({s[0] for spans in self.spans for s in spans})

    def measured_step_s(self, step: int | None = None) -> float:
        """The step as the slowest rank saw it (the median over steps, or one step's)."""
        per_step = [max(times[i] for times in self.step_s) for i in range(len(self.step_s[0]))]
        return statistics.median(per_step) if step is None else per_step[step]


# ---------------------------------------------------------------------------- the fit
def fit_fixed_costs(doc: dict[str, Any], layers: tuple[int, int], size_index: int,
                    runs: Sequence[ProbeRun]) -> dict[str, Any]:
    """The fixed costs that explain ``runs`` (see the module docstring), with their spread."""
    from ..planner.fixedcosts import FixedCosts

    models = [_ProbeModel(doc, layers, size_index, run.probe) for run in runs]
    whole = _fit(models, runs, None)
    per_step = [_fit(models, runs, step) for step in runs[0].steps()]
    spread = {key: robust_spread([fit[key] for fit in per_step]) for key in whole}
    charged = FixedCosts(**{k: v for k, v in whole.items() if k != "between_actions_s"})
    configurations = [_configuration(run, model.step_s(charged, whole["between_actions_s"]))
                      for model, run in zip(models, runs)]
    return {**whole, "spread": spread, "compute_scale": models[0].scale, "configurations": configurations}


def fit_optimizer_scale(doc: dict[str, Any], layers: tuple[int, int],
                        runs: Sequence[ProbeRun]) -> tuple[float | None, list[float]]:
    """How much longer an optimizer step takes in the pipeline than the profile's figures for
    the same layers ([Note: the optimizer timed where it runs]): per run and rank, the median of
    its measured steps over the sum of its chunks' layers' ``optimizer_s``; the median of those
    ratios, and the ratios (None, [] where no run timed one or the layers have no figure)."""
    first, _ = layers
    figures = [float(layer.get("optimizer_s") or 0.0) for layer in doc["layers"]]
    ratios = []
    for run in runs:
        probe = run.probe
        for rank, measured in enumerate(run.optimizer_s):
            profiled = sum(figures[first + i] for c in range(probe.chunks)
                           if stage_of_chunk(probe.schedule, c, probe.stages) == rank
                           for i in range(probe.bounds[c], probe.bounds[c + 1]))
            if measured and profiled > 0:
                ratios.append(statistics.median(measured) / profiled)
    return (statistics.median(ratios) if ratios else None), ratios


def fit_shared_slowdown(doc: dict[str, Any], layers: tuple[int, int], size_index: int,
                        runs: Sequence[ProbeRun]) -> dict[str, Any]:
    """What every action costs on shared cores beyond its time on a core of its own (its layers
    and its fixed costs, ``doc["fixed_costs"]`` as a core of its own measured them): that time
    times ``slowdown`` (never below 1: a cache a rank finds cold, bandwidth it shares), plus
    ``per_action_s`` (never below 0: the core handed back to a rank that blocked at the end of
    an action). The pair that makes the planner's time-shared steps of ``runs``
    (planner/timeshare.py) match their measured steps best, in the least squares of the
    logarithm of their ratio; with its spread (the same fit on each measured step alone) and
    each run's measured and predicted step at that pair. The runs tell the two apart by their
    actions: zb-h1 cuts the same work into three actions per micro-batch where 1F1B and GPipe
    cut it into two."""
    from ..planner.fixedcosts import FixedCosts

    record = doc.get("fixed_costs") or {}
    fixed = FixedCosts.from_record(record)
    between = float(record.get("between_actions_s") or 0.0)
    models = [_ProbeModel(doc, layers, size_index, run.probe) for run in runs]

    def fit(step: int | None) -> tuple[float, float]:
        def misfit(slowdown: float, added: float) -> float:
            return sum(math.log(model.step_s(fixed, between, slowdown, added) / run.measured_step_s(step)) ** 2
                       for model, run in zip(models, runs) if run.measured_step_s(step) > 0)

        def best_slowdown(added: float) -> float:
            return _golden_minimum(lambda x: misfit(x, added), 1.0, MAX_SHARED_SLOWDOWN, iterations=14)

        added = _golden_minimum(lambda a: misfit(best_slowdown(a), a), 0.0, MAX_SHARED_ACTION_S, iterations=14)
        return best_slowdown(added), added

    slowdown, added = fit(None)
    steps = runs[0].steps()
    per_step = [fit(step) for step in steps] if len(steps) >= SPREAD_VALUES else []
    configurations = [_configuration(run, model.step_s(fixed, between, slowdown, added))
                      for model, run in zip(models, runs)]
    return {"concurrent_ranks": models[0].concurrent_ranks, "slowdown": slowdown, "per_action_s": added,
            "spread": {"slowdown": robust_spread([f[0] for f in per_step]), "per_action_s": robust_spread([f[1] for f in per_step])},
            "configurations": configurations}


def _configuration(run: ProbeRun, predicted_step_s: float) -> dict[str, Any]:
    """A probe run as the profile records it (``configurations``): what ran, its cut of the
    window (``bounds``, profile version 12), its measured step and the fitted model's."""
    return {"schedule": run.probe.schedule, "virtual_stages": run.probe.virtual_stages, "chunks": run.probe.chunks,
            "bounds": list(run.probe.bounds), "micro_batches": MICRO_BATCHES,
            "measured_step_s": run.measured_step_s(), "predicted_step_s": predicted_step_s}


def _fit(models: Sequence["_ProbeModel"], runs: Sequence[ProbeRun], step: int | None) -> dict[str, float]:
    """The figures from every run's spans (of one measured step, or all of them)."""
    from ..planner.fixedcosts import FixedCosts

    rows: list[tuple[list[float], float, float]] = []      # (regressors, residual, weight)
    gaps: list[float] = []
    for model, run in zip(models, runs):
        for rank, spans in enumerate(run.spans):
            mine = [s for s in spans if step is None or s[0] == step]
            gaps.extend(_gaps_per_action(mine))
            by_action: dict[tuple[str, int], list[float]] = {}
            for _, kind, chunk, start, end in mine:
                if kind in KINDS:
                    by_action.setdefault((kind, chunk), []).append(end - start)
            for (kind, chunk), durations in by_action.items():
                if kind == "backward_input" and chunk == 0:
                    continue           # chunk 0's I does nothing (torch runs none there)
                regressors = [float(kind == k) for k in KINDS] + [float(model.sends(kind, chunk))]
                rows.append((regressors, statistics.median(durations) - model.layers_s(kind, chunk), len(durations)))
    kinds = _nonnegative_least_squares(rows, len(KINDS) + 1)
    between = statistics.median(gaps) if gaps else 0.0
    partial = FixedCosts(*kinds)

    def misfit(receive: float) -> float:
        costs = FixedCosts(*kinds[:5], receive_s=receive)
        return sum(math.log(model.step_s(costs, between) / run.measured_step_s(step)) ** 2
                   for model, run in zip(models, runs) if run.measured_step_s(step) > 0)

    receive = _golden_minimum(misfit, 0.0, MAX_RECEIVE_S)
    return {"forward_s": partial.forward_s, "backward_s": partial.backward_s,
            "backward_input_s": partial.backward_input_s, "backward_weight_s": partial.backward_weight_s,
            "send_s": partial.send_s, "receive_s": receive, "between_actions_s": between}


def _gaps_per_action(spans: Sequence[tuple[int, str, int, float, float]]) -> list[float]:
    """Per step: the time between its first and last span that no span covers, per interval
    between two actions (n actions leave n - 1 of them between the first and the last)."""
    out = []
    for step in sorted({s[0] for s in spans}):
        mine = sorted((s for s in spans if s[0] == step), key=lambda s: s[3])
        actions = sum(1 for s in mine if s[1] in KINDS)
        if actions < 2:
            continue
        uncovered, reached = 0.0, mine[0][3]
        for s in mine:
            if s[3] > reached:
                uncovered += s[3] - reached
            reached = max(reached, s[4])
        out.append(uncovered / (actions - 1))
    return out


def _nonnegative_least_squares(rows: list[tuple[list[float], float, float]], n: int) -> list[float]:
    """Weighted least squares with every coefficient >= 0 (an unknown the data do not reach is 0):
    solve, pin the most negative coefficient at 0, solve again, until none is negative."""
    free = list(range(n))
    while True:
        coefficients = [0.0] * n
        used = [j for j in free if any(r[0][j] for r in rows)]
        if used:
            a = torch.tensor([[r[0][j] * math.sqrt(r[2]) for j in used] for r in rows], dtype=torch.float64)
            b = torch.tensor([[r[1] * math.sqrt(r[2])] for r in rows], dtype=torch.float64)
            solution = torch.linalg.lstsq(a, b).solution.flatten().tolist()
            for j, value in zip(used, solution):
                coefficients[j] = value
        worst = min(free, key=lambda j: coefficients[j], default=None)
        if worst is None or coefficients[worst] >= 0:
            return [max(0.0, c) for c in coefficients]
        free.remove(worst)


def _golden_minimum(f, lo: float, hi: float, iterations: int = 60) -> float:
    """The argmin of a unimodal ``f`` on [lo, hi], by golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    best = min((a, f(a)), (b, f(b)), ((a + b) / 2, f((a + b) / 2)), key=lambda p: p[1])
    return best[0] if f(lo) > best[1] else lo


class _ProbeModel:
    """The planner's cost model of one probe run: its window's layers as a profile of their own,
    cut as the run cut them, on K = 2 stages with the profile's neighbour slowdown and link."""

    def __init__(self, doc: dict[str, Any], layers: tuple[int, int], size_index: int, probe: Probe) -> None:
        from dataclasses import replace

        from ..planner.costmodel import CostModel
        from ..planner.profile import Profile
        from ..planner.settings import cost_setting

        first, end = layers
        sub = {key: value for key, value in doc.items()
               if key not in ("tied_parameters", "overhead", "fixed_costs", "calibration")}
        sub["layers"] = doc["layers"][first:end]
        if first > 0:
            sub["input_bytes"] = doc["layers"][first - 1]["output_bytes"]
        self.profile = Profile(sub, "the probe's layers")
        self.probe = probe
        self.size = doc["micro_batch_sizes"][size_index]
        link = self.profile.link_bandwidth_bytes_per_s
        # What a plan of this run would be charged besides its layers (the neighbours' slowdown,
        # the link, shared cores on a host of one), with the fixed costs being fitted.
        charged = cost_setting(self.profile, stages=probe.stages, micro_batches=MICRO_BATCHES, schedule=probe.schedule,
                               virtual_stages=probe.virtual_stages, recompute="never", memory_limit_bytes=None,
                               link_bandwidth_bytes_per_s=link or math.inf,
                               link_latency_s=self.profile.link_latency_s if link else 0.0, optimizer="adam",
                               micro_batch_size=self.size)
        self.scale = charged.compute_scale
        self.concurrent_ranks = charged.concurrent_ranks
        self._setting = lambda fixed, overhead, slowdown=1.0, added=0.0: replace(
            charged, overhead_s=overhead, fixed_costs=fixed, shared_core_slowdown=slowdown, shared_core_action_s=added)
        self._cost_model = CostModel
        self.bare = CostModel(self.profile.at(self.size), self._setting(_zero(), 0.0))
        self._layer_times = {c: self.bare.chunk_times(c, probe.bounds[c], probe.bounds[c + 1], False)
                             for c in range(probe.chunks)}

    def layers_s(self, kind: str, chunk: int) -> float:
        """What chunk's ``kind`` action takes by the profile's layers (scaled for the neighbour)."""
        f, b, i, w = self._layer_times[chunk]
        return {"forward": f, "backward": b, "backward_input": i, "backward_weight": w}[kind]

    def sends(self, kind: str, chunk: int) -> bool:
        """Whether that action sends a message to another stage."""
        m = self.bare.messages[chunk]
        return bool(m.forward_sends if kind == "forward" else m.backward_sends if kind != "backward_weight" else 0)

    def step_s(self, fixed: Any, between_s: float, shared_slowdown: float = 1.0, shared_added_s: float = 0.0) -> float:
        """The planner's makespan of this run with these fixed costs (the probe runs no optimizer),
        every action ``shared_slowdown`` times slower and ``shared_added_s`` longer where its
        processes share cores."""
        from ..planner.objective import evaluate

        cm = self._cost_model(self.profile.at(self.size),
                              self._setting(fixed, between_s, shared_slowdown, shared_added_s))
        return evaluate(cm, self.probe.bounds, [False] * self.probe.stages).makespan_s


def _zero():
    from ..planner.fixedcosts import FixedCosts

    return FixedCosts()


# ---------------------------------------------------------------------------- the processes
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, spec: dict[str, Any], seed: int, precision: Precision, threads: int,
            layers: tuple[int, int], sizes: list[int], runs: list[Probe], backend: str, executor: str, gpu: int,
            results: Any) -> None:
    """One stage of the probe pipeline: every run in turn at each micro-batch size in turn, its
    spans and step times to ``results`` (per size, per run)."""
    import torch.distributed as dist

    from ..models import build_model, forward_streamed, materialize_layers
    from ..runtime.stage import Chunk, ChunkModule, TensorMeta
    from ..runtime.timing import SpanRecorder

    torch.set_num_threads(threads)
    if backend == "gloo" and "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")    # this machine: loopback, as `run` talks
    device = torch.device("cuda", (gpu + rank) % max(1, torch.cuda.device_count())) if backend == "nccl" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=runs[0].stages)
    try:
        model = build_model(spec, seed=seed, materialize=())
        precision.cast(model)
        first, end = layers
        materialize_layers(model, range(first, end))
        for _, layer in model.layers[first:end]:
            layer.to(device)
        last = end == len(model.layers)
        loss_fn = model.loss if last else _synthetic_loss
        # The window's inputs at the largest size, once (the model's, or activations from the layers
        # before it, which streaming makes real one at a time); each size runs on the first rows.
        batch, all_targets = model.synthetic_batch(MICRO_BATCHES * max(sizes), torch.Generator().manual_seed(seed))
        with torch.no_grad(), precision.autocast("cpu"):
            batch = tuple(x.to(device) for x in forward_streamed(model, batch, range(first)))
        all_targets = all_targets.to(device)
        out = []
        for size in sizes:
            inputs = tuple(x[:MICRO_BATCHES * size] for x in batch)
            targets = all_targets[:MICRO_BATCHES * size]
            metas = _cut_metas(model, (first, end), tuple(x[:size] for x in inputs), precision, device, TensorMeta)
            out.append([_run(rank, probe, model, first, metas, inputs, targets, loss_fn, precision, device, executor,
                             Chunk, ChunkModule, SpanRecorder) for probe in runs])
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def _synthetic_loss(outputs: tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
    """A window that stops before the model's end: the mean of its floating outputs, as a loss."""
    return sum(o.float().mean() for o in outputs if o.is_floating_point())


def _cut_metas(model: Any, layers: tuple[int, int], xs: tuple[torch.Tensor, ...], precision: Precision,
               device: torch.device, meta_type: Any) -> list[tuple[Any, ...]]:
    """The tensors entering each layer of the window at one micro-batch (the last: its output)."""
    first, end = layers
    metas = []
    with torch.no_grad(), precision.autocast(device.type):
        for i in range(first, end):
            metas.append(tuple(meta_type(tuple(x.shape), x.dtype) for x in xs))
            xs = model.layers[i][1](*xs)
    metas.append(tuple(meta_type(tuple(x.shape), x.dtype) for x in xs))
    return metas


def _run(rank: int, probe: Probe, model: Any, first: int, metas: list, inputs: tuple[torch.Tensor, ...],
         targets: torch.Tensor, loss_fn: Any, precision: Precision, device: torch.device, executor: str,
         Chunk: Any, ChunkModule: Any, SpanRecorder: Any) -> dict[str, Any]:
    """One probe run on this rank: warm-up steps, then measured steps, each after a barrier (or,
    ``back_to_back``, one after the other, each timed from the end of the one before on this rank)."""
    import torch.distributed as dist

    C = probe.chunks
    chunks = []
    for c in range(C):
        if stage_of_chunk(probe.schedule, c, probe.stages) != rank:
            continue
        s, e = probe.bounds[c], probe.bounds[c + 1]
        layers = [model.layers[first + i] for i in range(s, e)]
        module = ChunkModule(layers, autocast=lambda: precision.autocast(device.type))
        chunks.append(Chunk(index=c, num_chunks=C, stage=rank, module=module, input_meta=metas[s],
                            output_meta=metas[e], global_to_local={}, unowned={}))
    actions = all_actions(probe.schedule, probe.stages, MICRO_BATCHES, probe.virtual_stages)
    recorder = SpanRecorder(rank, device)
    run = _executor(executor, chunks, actions, rank, probe.stages, loss_fn, device, recorder)
    holds_first = any(c.is_first for c in chunks)
    holds_last = any(c.is_last for c in chunks)
    # [Note: the optimizer timed where it runs]: a run's optimizer steps right after the step's
    # backwards; steps back to back (shared cores) take none, as the shared fit models none.
    params = distinct_parameters(p for chunk in chunks for p in chunk.module.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-3) if params and not probe.back_to_back else None
    step_s: list[float] = []
    optimizer_s: list[float] = []
    dist.barrier()
    recorder.start_clock()
    for step in range(WARMUP_STEPS + probe.measured_steps):
        measured = step - WARMUP_STEPS
        recorder.step = measured
        if not probe.back_to_back or step == 0:
            dist.barrier()
        start = recorder.now()
        run.step(inputs if holds_first else None, targets if holds_last else None)
        step_s.append(recorder.now() - start)
        recorder.end_step()
        if optimizer is not None:
            start = recorder.now()
            optimizer.step()
            optimizer_s.append(recorder.now() - start)
        for chunk in chunks:
            chunk.module.zero_grad(set_to_none=True)
    spans = [(s.step, s.kind, s.chunk, s.start_s, s.end_s) for s in recorder.spans if s.step >= 0]
    return {"step_s": step_s[WARMUP_STEPS:], "spans": spans, "optimizer_s": optimizer_s[WARMUP_STEPS:]}


def _executor(name: str, chunks: list, actions: list, rank: int, stages: int, loss_fn: Any, device: torch.device,
              recorder: Any) -> Any:
    """The executor ``run`` would use here (runtime/train.py: native on gloo, torch's on CUDA)."""
    if name == "torch":
        from ..runtime.torch_executor import TorchExecutor

        return TorchExecutor(chunks, actions, rank, MICRO_BATCHES, loss_fn, device, recorder)
    from ..runtime.executor import NativeExecutor
    from ..runtime.p2p import Neighbours

    return NativeExecutor(chunks, actions, rank, MICRO_BATCHES, loss_fn, Neighbours(rank, stages, device, 120.0),
                          recorder)

