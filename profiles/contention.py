"""Neighbours: how much slower the model computes while other stages compute beside it.

The profiler times each layer in one process, alone on the machine. In a pipeline on one CPU
host, K stage processes compute at the same moment and share what cores do not own: the
last-level cache, the memory bandwidth and, on a virtual machine, whatever the host shares
between its virtual cores. So each rank of a pipeline can compute its operations markedly slower
(in CPU time, so not waiting) than one process alone (docs/benchmarks.md, "Cost-model accuracy").
A generic probe cannot stand in for that: a small compute-bound loop hardly feels it. So it is
measured on the model itself.

We start ``processes`` worker processes with the profile's threads each, all building the
model from its spec, and time training steps (forward, backward) of one layer at one
micro-batch size, in cycles: worker 0 alone for a moment, then all of them at once. The
layer is the one that takes longest, which the profiler passes on (without it: the layer with
the most parameters); each worker builds the model on the meta device and makes only that
layer real, having run the batch up to it one layer at a time (models/materialize.py), so
that this measurement, like the profile, needs memory for one layer per process and not the
whole model. The
machine's speed drifts over seconds, so each cycle compares a shared phase with the alone
phase right before it, and ``slowdown`` is the median of the cycles' ratios. Short phases
and many cycles (9 of 0.4 s each way) keep a slow spell inside one cycle's pair and leave
the median to outvote it; fewer, longer cycles let one slow spell move a single profile's
figure.

Each cycle's ratio is the *slowest* process's step over the step alone, not a typical
one's. A pipeline goes at the pace of its slowest stage, and processes need not slow down
alike: where virtual cores are unequal at times, one process can run as fast beside a
neighbour as alone while another runs markedly slower. A typical process (with two, the mean)
would then understate the slowdown the pipeline feels, and the plan would predict too short a
step (figures: docs/benchmarks/notes.md). The planner scales stage
times by ``slowdown`` (planner/costmodel.py, ``neighbour_scale``).

On a GPU each stage owns its device, so this is measured on CPU only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..hostload import STEADY_SPREAD, robust_spread, usable_cores
from ..models.precision import Precision
from .spawn import SPAWN, run_workers

# Ratios this close to 1 (or below: the machine sped up) are noise: no slowdown is recorded.
NOISE = 1.02
# A reading whose cycles spread more than hostload.STEADY_SPREAD was taken while the host's speed
# swung, which the median of its cycles does not outvote when most of them felt it (figures:
# docs/profile-format.md, ``contention``): it is taken again, at most READINGS times in all, and
# the steadiest is kept.
READINGS = 3


def most_processes(threads: int) -> int:
    """How many processes of ``threads`` each this host runs at once: its usable cores over the
    threads. More than that do not compute side by side but take turns on the cores, which the
    planner models itself (planner/timeshare.py): measured here, it would be charged twice."""
    return usable_cores() // max(1, threads)


def default_processes(threads: int) -> int:
    """As many stage processes as this host runs at ``threads`` each, at most 8; 0 (none
    measured) where that is fewer than 2: on one core nothing computes beside anything."""
    most = min(8, most_processes(threads))
    return most if most >= 2 else 0


def measure_contention(spec: dict[str, Any], micro_batch_size: int, threads: int = 1, processes: int = 2,
                       seconds: float = 0.4, cycles: int = 9, seed: int = 0,
                       timeout_s: float = 300.0, precision: Precision | None = None,
                       layer: int | None = None) -> dict[str, Any]:
    """The profile's ``contention`` object: steps of ``layer`` alone and with ``processes - 1``
    neighbours; a reading whose cycles spread more than :data:`STEADY_SPREAD` taken again, at most
    :data:`READINGS` in all, the steadiest kept (``readings``: how many were taken, ``spread``:
    the kept one's)."""
    readings = []
    for _ in range(READINGS):
        readings.append(_reading(spec, micro_batch_size, threads, processes, seconds, cycles, seed, timeout_s,
                                 precision, layer))
        if readings[-1]["spread"] <= STEADY_SPREAD:
            break
    return {**min(readings, key=lambda r: r["spread"]), "readings": len(readings)}


def _reading(spec: dict[str, Any], micro_batch_size: int, threads: int, processes: int, seconds: float,
             cycles: int, seed: int, timeout_s: float, precision: Precision | None,
             layer: int | None) -> dict[str, Any]:
    """One reading: ``cycles`` cycles of the layer alone, then beside its neighbours."""
    barrier = SPAWN.Barrier(processes)
    returned = run_workers(_worker, processes, (spec, seed, micro_batch_size, threads, seconds, cycles, barrier,
                                                precision or Precision(), layer), timeout_s,
                           "timing the model side by side")
    phases: dict[int, dict[str, list[float]]] = {rank: mine for rank, mine, _ in returned}
    timed = next((name for _, _, name in returned), None)
    if len(phases) != processes:
        raise RuntimeError(f"{processes - len(phases)} of the {processes} processes timing the model side by "
                           "side returned nothing")
    ratios = cycle_ratios(phases)
    return {
        "processes": processes,
        "threads_per_process": threads,
        "micro_batch_size": micro_batch_size,
        "layer": timed,
        "alone_step_s": statistics.median(phases[0]["alone"]),
        "together_step_s": statistics.median(statistics.median(phases[r]["together"]) for r in phases),
        "slowest_step_s": max(statistics.median(phases[r]["together"]) for r in phases),
        "cycle_ratios": ratios,
        "slowdown": recorded_slowdown(ratios),
        "spread": robust_spread(ratios),        # how far the cycles disagree
    }


def recorded_slowdown(ratios: list[float]) -> float:
    """The slowdown a profile records: the median cycle's ratio (one slow spell cannot move it),
    or exactly 1 when that is within :data:`NOISE` of 1 or below it."""
    ratio = statistics.median(ratios)
    return ratio if ratio >= NOISE else 1.0


def cycle_ratios(phases: dict[int, dict[str, list[float]]]) -> list[float]:
    """Per cycle: the slowest process's step together over process 0's step alone just before."""
    alone = phases[0]["alone"]
    return [max(phases[r]["together"][c] for r in phases) / alone[c] for c in range(len(alone))]


def median_time_s(run: Callable[[], object], seconds: float, at_least: int) -> float:
    """Median wall time of ``run()``, called back to back for ``seconds`` and ``at_least`` times."""
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(times) < at_least:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, spec: dict[str, Any], seed: int, size: int, threads: int, seconds: float, cycles: int,
            barrier: Any, precision: Precision, layer: int | None, results: Any) -> None:
    from ..models import build_model, forward_streamed, layer_materialized
    from .measure import prepare_layer

    torch.set_num_threads(threads)
    model = build_model(spec, seed=seed, materialize=())
    precision.cast(model)
    index = layer if layer is not None else _most_parameters(model)
    inputs, targets = model.synthetic_batch(size, torch.Generator().manual_seed(seed))
    with torch.no_grad(), precision.autocast("cpu"):
        xs = forward_streamed(model, inputs, range(index))
    last = index == len(model.layers) - 1
    with layer_materialized(model, index) as real:
        loss = (lambda outputs: model.loss(outputs, targets)) if last else None
        _, runner = prepare_layer(model.layers[index][0], real, xs, first=index == 0, loss=loss,
                                  autocast=lambda: precision.autocast("cpu"))

        def train_step() -> None:
            runner.backward(runner.forward())

        def median_step(duration: float) -> float:
            step = median_time_s(train_step, duration, 3)
            real.zero_grad(set_to_none=True)
            return step

        median_step(min(0.5, seconds))          # warm-up: allocator, caches, lazy initialisation
        mine: dict[str, list[float]] = {"alone": [], "together": []}
        # If a worker dies, the others give up at the barrier after this wait (and exit with an
        # error) rather than hanging until the parent's timeout.
        wait_s = 60 + 3 * seconds
        for _ in range(cycles):
            barrier.wait(wait_s)
            if rank == 0:
                mine["alone"].append(median_step(seconds))
            barrier.wait(wait_s)
            mine["together"].append(median_step(seconds))
    results.put((rank, mine, model.layers[index][0]))


def _most_parameters(model: Any) -> int:
    """The index of the layer with the most parameter elements (their shapes are known on meta)."""
    sizes = [sum(p.numel() for p in layer.parameters()) for _, layer in model.layers]
    return sizes.index(max(sizes))
