"""A fixed reference workload that says how fast this machine is right now.

A profile measures one machine at one moment. Virtual machines and laptops do not run at one
speed: noisy neighbours, shared caches and clocks make the same code take 15% longer one
minute and 40% longer another. A prediction made from a profile holds only at the speed the
profile saw. So the profiler times this probe before and after it measures the layers, and
every rank of a run times it again before and after training, with the threads it trains
with and while the other ranks do the same. The ratio of the two is the run's speed relative
to the profile's: `run` warns when it is far from 1, and the report shows the prediction
scaled by it next to the raw one, so that a user can tell a wrong model from a slow machine.

The work is a small slice of a transformer layer (a matrix product, GELU, layer norm), sized
to take a few milliseconds per repeat on one CPU core. On a GPU the same slice that small
would time kernel launches, not the device, so there it is wide enough (2048) for each matrix
product to keep the GPU busy for tens of microseconds. Only ``profile`` and ``run`` use it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

REPEATS = 9


def workload(device_type: str) -> tuple[int, int]:
    """The probe's (rows, width) on a device type; profiles record it next to the probe's time."""
    return (64, 256) if device_type == "cpu" else (4096, 2048)


def profile_probe_s(device: dict[str, Any]) -> float | None:
    """A profile's probe time, if it timed the workload this code times; else None.

    Profiles before version 5 did not record the workload: on a CPU it has not changed; on a
    GPU it was the CPU's, too small to measure the device, so there is nothing to compare with.
    """
    probe = device.get("speed_probe_s")
    if not isinstance(probe, (int, float)) or isinstance(probe, bool) or not probe > 0:
        return None
    kind = "cpu" if device.get("type") == "cpu" else "cuda"
    recorded = device.get("speed_probe_workload")
    if recorded is None:
        return float(probe) if kind == "cpu" else None
    return float(probe) if list(recorded) == list(workload(kind)) else None


def speed_probe_s(device: str = "cpu", repeats: int = REPEATS) -> float:
    """Median seconds of one repeat of the reference workload on ``device``."""
    return speed_probe(device, repeats)[0]


def speed_probe(device: str = "cpu", repeats: int = REPEATS) -> tuple[float, float]:
    """``(median, spread)`` of one repeat of the reference workload on ``device``: the median
    seconds and the repeats' relative spread (:func:`repeat_spread`), which says whether the
    machine held one speed while it was timed."""
    import torch

    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows, width = workload(dev.type)
    x = torch.randn(rows, width, generator=gen).to(dev)
    w = torch.randn(width, width, generator=gen).to(dev) / width ** 0.5
    norm = torch.nn.LayerNorm(width).to(dev)

    def once() -> None:
        y = x
        for _ in range(8):
            y = norm(torch.nn.functional.gelu(y @ w))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with torch.no_grad():
        once()                                   # first touch: allocations, kernels
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(10):
                once()
            times.append(time.perf_counter() - started)
    return statistics.median(times), repeat_spread(times)


def repeat_spread(times: list[float]) -> float:
    """The repeats' interquartile range over their median: 0 for a machine at one speed; a
    neighbour that comes and goes while the probe runs spreads it."""
    if len(times) < 4:
        return 0.0
    q1, median, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / median if median > 0 else 0.0


# The probe tells the run's speed only when it held still: each reading's repeats within this
# spread (interquartile range over median), and the readings before and after training (every
# rank) within it of each other (half their range over their mean). Beyond it the machine changed
# speed while it was measured, and a ratio from it would move the prediction by its noise: the
# headline then compares with the plan's own prediction alone. On the 2-core development VM,
# quiet, readings spread by 2-10%; beside two busy loops by 19-150% (docs/runtime.md).
STEADY = 0.10
# A speed ratio this close to 1 is the profile's speed: no adjusted prediction is worth printing.
SAME_SPEED = 0.05
# One machine drifts by tens of percent (docs/runtime.md, "The machine's speed"), not by this
# factor: a ratio beyond it says one of the two probes was disturbed, or the run is on another machine.
DRIFT_LIMIT = 1.5


# [Note: layers timed at the host's own speed]
# A virtual machine can run the same code 25-70% slower for stretches of seconds to minutes
# that no load counter shows (no other process, no steal; a thread's CPU time slows as much as
# its wall time): on the 2-core development VM this probe read 6.2-6.6 ms at speed and 7.5-13 ms
# in such stretches. A profile whose layers were timed in one mispredicts every plan of the
# model by as much: one resnet profile's probes read 9.2 and 9.7 ms, and each of its plans then
# ran 0.73-0.80 of its prediction. Probes before and after the layers that agree do not show it:
# both were slow. So a profile also reads the probe as it starts (before it builds the model and
# after it checks it: seconds apart on a real model, and seconds before the layers, in and out of
# one stretch), takes the fastest reading, those around the layers included, as the host's own
# speed (a stretch only slows the host), and times its layers again while either probe around
# them read more than STEADY slower than that, at most LAYER_TRIES times in all, keeping the try
# whose probes read least slow (profile format 13: measurement.host_speed).
LAYER_TRIES = 3


def probe_doubt(readings_s: list[float], spreads: list[float], profile_drift: float | None,
                ratio: float | None = None) -> str | None:
    """Why the run's speed ratio cannot be trusted, in words; None when it can.

    ``readings_s``: every probe of the run (each rank, before and after training); ``spreads``:
    their repeats' spreads (:func:`repeat_spread`; none in reports before version 5);
    ``profile_drift``: how far the profile's own two probes were apart (half their difference
    over their mean; None: not recorded); ``ratio``: the run's probe over the profile's.
    """
    if len(readings_s) < 2:
        return "it has fewer than two readings"
    drift = (max(readings_s) - min(readings_s)) / (max(readings_s) + min(readings_s))
    if drift > STEADY:
        return f"its readings before and after training differ by ±{drift:.0%}"
    if spreads and max(spreads) > STEADY:
        return f"its repeats spread by {max(spreads):.0%} within one reading"
    if profile_drift is not None and profile_drift > STEADY:
        return f"the profile's own two readings differ by ±{profile_drift:.0%}"
    if ratio is not None and not 1 / DRIFT_LIMIT <= ratio <= DRIFT_LIMIT:
        return (f"it reads {ratio:.2f}x the profile's time, more than one machine drifts (a disturbed reading, "
                "or another machine: profile here)")
    return None


# A run headline's ``speed_left_out`` when there was no probe to compare (runtime/report.py).
NO_SPEED_PROBE = "no speed probe"


def distrusted_probe(head: dict[str, Any]) -> str | None:
    """Why a run's headline (runtime/report.py, ``headline``) left its speed-adjusted prediction
    out because the probe could not be trusted (:func:`probe_doubt`'s words); None: trusted, or
    no probe. Then the run cannot tell the machine's drift from a miss of the cost model: the
    step line and calibrate say so rather than blame either."""
    left_out = head.get("speed_left_out")
    return left_out if left_out and left_out != NO_SPEED_PROBE else None


def speed_ratio(run_probe_s: float | None, profile_probe_s: float | None) -> float | None:
    """How much slower (> 1) or faster (< 1) the run's machine is than the profile's."""
    if not run_probe_s or not profile_probe_s:
        return None
    return run_probe_s / profile_probe_s
