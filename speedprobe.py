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
    return statistics.median(times)


def speed_ratio(run_probe_s: float | None, profile_probe_s: float | None) -> float | None:
    """How much slower (> 1) or faster (< 1) the run's machine is than the profile's."""
    if not run_probe_s or not profile_probe_s:
        return None
    return run_probe_s / profile_probe_s
