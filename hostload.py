"""How busy the host was while a run trained: the cores other processes took from it.

A step measured on a shared machine is the plan's step plus what the other processes took.
Two stages of a pipeline on a 2-core machine need both cores; a neighbour using 1.6 of them
for the run's minute makes every action slower by about as much, and a comparison with the
prediction then measures the neighbour, not the cost model. So a run counts what the host did
meanwhile, and says so: "other processes used 1.62 of this host's 2 cores".

Linux counts each CPU's time since boot in ``/proc/stat``: ``user nice system idle iowait irq
softirq steal``. Busy is ``user + nice + system + irq + softirq``; ``steal`` is time a virtual
CPU was ready to run but the hypervisor gave to another machine, which is lost to this host as
surely. Over a window, the busy and stolen time of the CPUs this process may run on (its
affinity mask, which containers and ``taskset`` narrow), less the CPU time of the run's own
processes (every thread; :func:`time.process_time`), is what the others used; over the
window's wall time, in cores.

What matters is what they took **from the run**: on 64 cores, others using 10 leave a 2-rank
run alone. The run needs its ranks x threads per rank cores on a host; the others took from it
what did not fit beside it, ``min(others, others + needed - cores)``
(:func:`contended_cores`). A host is busy when that is at least :data:`BUSY_SHARE` of what
the run needed (:func:`busy_hosts`).

Pure Python and no torch: ``run``'s ranks sample, ``show`` and ``calibrate`` read the figures
from the report, and the benchmarks (bench/common.py) count other processes with it too.
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

PROC_STAT = "/proc/stat"
# Other processes taking at least this share of the cores a run needed make its times the host's.
BUSY_SHARE = 0.1
# A measurement repeated in cycles whose ratios spread more than this (their IQR / 1.349) was
# taken while the host's own speed swung, which no other process shows (a virtual machine's
# neighbours): the profile's neighbours' slowdown is measured again then (profiles/contention.py),
# and a plan from a profile whose reading still spread says so.
STEADY_SPREAD = 0.1
# The normal distribution's interquartile range in standard deviations.
IQR_PER_SIGMA = 1.349
# A spread needs this many values at least (an IQR of fewer says nothing): 0 below.
SPREAD_VALUES = 4


def robust_spread(values: Sequence[float]) -> float:
    """How far repeated readings of one quantity disagree: their IQR / 1.349 (a standard
    deviation that a few outliers cannot inflate); 0 with fewer than :data:`SPREAD_VALUES`."""
    if len(values) < SPREAD_VALUES:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    return max(0.0, (q3 - q1) / IQR_PER_SIGMA)


def cpu_times_s(cpus: Iterable[int] | None = None, path: str = PROC_STAT) -> tuple[float, float] | None:
    """``(busy, steal)`` CPU seconds since boot of the CPUs ``cpus`` (None: all of them), from
    ``/proc/stat``; None where there is no such file (not Linux) or it does not read."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None
    wanted = {"cpu"} if cpus is None else {f"cpu{c}" for c in cpus}   # "cpu": the sum of them all
    busy = steal = 0.0
    found = False
    for line in lines:
        fields = line.split()
        if not fields or fields[0] not in wanted:
            continue
        try:
            user, nice, system, _idle, _iowait, irq, softirq, stolen = (int(x) for x in fields[1:9])
        except ValueError:
            return None
        busy += user + nice + system + irq + softirq
        steal += stolen
        found = True
    if not found:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return busy / tick, steal / tick


def host_cpu_s() -> float:
    """CPU seconds the CPUs this process may run on have been busy or stolen since boot (NaN off Linux)."""
    times = cpu_times_s(usable_cpus())
    return float("nan") if times is None else times[0] + times[1]


def usable_cpus() -> list[int] | None:
    """The CPUs this process may run on (its affinity mask); None where that is not known."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # pragma: no cover - not Linux
        return None


@dataclass(frozen=True)
class CpuSample:
    """One process's reading of the host at one moment (a run's rank takes one before its first
    step and one after its last)."""

    wall_s: float                # time.monotonic()
    busy_s: float | None         # the usable CPUs' busy time since boot (None: not Linux)
    steal_s: float | None        # ... and their stolen time
    own_s: float                 # this process's CPU time, every thread
    pid: int
    host: str
    cores: int                   # the CPUs it may run on


def sample(children: bool = False) -> CpuSample:
    """This process's reading of the host now; ``children``: its own CPU time counts that of
    its finished (waited-for) child processes too (the profiler's helpers, timed with it)."""
    cpus = usable_cpus()
    times = cpu_times_s(cpus)
    own = time.process_time()
    if children:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        own += kids.ru_utime + kids.ru_stime
    return CpuSample(time.monotonic(), times[0] if times else None, times[1] if times else None, own,
                     os.getpid(), socket.gethostname(), usable_cores(cpus))


def usable_cores(cpus: list[int] | None = None) -> int:
    """How many CPUs this process may run on (its affinity mask; all of them where it is not known)."""
    cpus = usable_cpus() if cpus is None else cpus
    return len(cpus) if cpus else (os.cpu_count() or 1)


def contended_cores(others: float, needed: float, cores: float) -> float:
    """The cores other processes took that the run could have used: what of theirs did not fit
    beside the run's ``needed`` on ``cores`` (0 when both fit)."""
    return max(0.0, min(others, others + needed - cores))


def host_load(windows: Sequence[tuple[int, CpuSample, CpuSample]], threads_per_rank: int) -> dict[str, Any] | None:
    """The report's ``host_load``: per host, over the run's steps, the cores its other processes
    used and what of it they took from the run (docs/report-format.md).

    ``windows``: per rank, its samples before the first step and after the last. A host's busy
    time and wall time are its lowest rank's; the run's own CPU time is the sum over its ranks'
    processes (each once). None when no host could be read (not Linux).
    """
    by_host: dict[str, list[tuple[int, CpuSample, CpuSample]]] = {}
    for rank, start, end in windows:
        by_host.setdefault(start.host, []).append((rank, start, end))
    hosts = []
    for host, ranks in sorted(by_host.items(), key=lambda item: min(r for r, _, _ in item[1])):
        _, start, end = min(ranks, key=lambda w: w[0])
        own = sum({s.pid: e.own_s - s.own_s for _, s, e in ranks}.values())
        entry = window_load(start, end, len(ranks) * threads_per_rank, own)
        if entry is not None:
            hosts.append({"host": host, "ranks": sorted(r for r, _, _ in ranks), **entry})
    if not hosts:
        return None
    return {"window_s": max(h["window_s"] for h in hosts), "other_cores": max(h["other_cores"] for h in hosts),
            "contended_cores": max(h["contended_cores"] for h in hosts), "hosts": hosts}


def window_load(start: CpuSample, end: CpuSample, needed: int, own_s: float | None = None) -> dict[str, Any] | None:
    """One host over one window, from two readings of it: its ``cores``, the ``needed_cores``
    the work being measured needed, the cores that work used (``run_cores``; ``own_s``: its CPU
    seconds, else the readings' own), what other processes used (``other_cores``, the stolen
    ``steal_cores`` among them) and took from it (``contended_cores``), over ``window_s``.
    None when the host could not be read (not Linux) or the window is empty."""
    wall = end.wall_s - start.wall_s
    if start.busy_s is None or end.busy_s is None or start.steal_s is None or end.steal_s is None or wall <= 0:
        return None
    own = end.own_s - start.own_s if own_s is None else own_s
    steal = max(0.0, end.steal_s - start.steal_s) / wall
    others = max(0.0, end.busy_s - start.busy_s - own) / wall + steal
    return {"cores": start.cores, "needed_cores": needed, "run_cores": own / wall, "other_cores": others,
            "steal_cores": steal, "contended_cores": contended_cores(others, needed, start.cores), "window_s": wall}


def busy_hosts(load: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The hosts of a report's ``host_load`` whose other processes took at least
    :data:`BUSY_SHARE` of the cores the run needed there (none: a quiet run, or not measured)."""
    return [h for h in (load or {}).get("hosts") or []
            if (h.get("contended_cores") or 0.0) >= BUSY_SHARE * max(h.get("needed_cores") or 1, 1)]


# What each phase of a profile's measurement was doing, as a sentence says it (profiles/profiler.py).
PROFILE_PHASES = {"layers": "while it timed the layers", "contention": "while it timed its processes side by side",
                  "fixed_costs": "while it timed the fixed costs' pipeline",
                  "shared_cores": "while it timed ranks sharing its cores"}


def busy_phases(load: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The phases of a profile's ``host_load`` during which other processes took at least
    :data:`BUSY_SHARE` of the cores the phase needed (none: a quiet host, or not recorded)."""
    return [p for p in (load or {}).get("phases") or []
            if (p.get("contended_cores") or 0.0) >= BUSY_SHARE * max(p.get("needed_cores") or 1, 1)]


def busy_profile_text(phases: list[dict[str, Any]]) -> str:
    """``other processes took 0.40 of the 2 cores it needed while it timed ...; ...``: one clause per busy phase."""
    return "; ".join(f"other processes took {p['contended_cores']:.2f} of the {p['needed_cores']} "
                     f"core{'s' if p['needed_cores'] != 1 else ''} it needed "
                     f"{PROFILE_PHASES.get(p.get('phase'), 'while it measured ' + str(p.get('phase')))}"
                     for p in phases)


def load_text(host: dict[str, Any], named: bool = False) -> str:
    """``other processes used 1.62 of the 2 cores during the run (the run needed 2)``; ``named``:
    of which host (a run over several)."""
    steal = host.get("steal_cores") or 0.0
    stolen = f", {steal:.2f} of them stolen by the hypervisor" if steal >= 0.01 else ""
    where = f" of {host.get('host')}" if named else ""
    return (f"other processes used {host['other_cores']:.2f} of the {host['cores']} cores{where} during the run"
            f"{stolen} (the run needed {host['needed_cores']})")
