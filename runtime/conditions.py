"""The conditions a prediction holds for, and the warning when a run leaves them.

A profile is a measurement of this model *on a device under given conditions*; on a CPU the
condition that matters most is how many threads each layer ran with. A plan made from a
1-thread profile predicts a pipeline whose ranks run 1 thread each; run those ranks with 4
threads, or squeeze 4 ranks of 2 threads onto 2 cores, and the prediction no longer applies.
So ``run`` gives each rank the threads the profile measured with, and says so in one line when
it cannot (or was told otherwise).

No torch here.
"""

from __future__ import annotations

import os

from ..plan_view import PlanView


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def threads_per_rank(requested: int | None, plan: PlanView, local_ranks: int) -> int:
    """``--threads`` if given, else the profile's, else an equal share of this machine's cores."""
    if requested is not None:
        return requested
    if plan.profile_threads is not None:
        return plan.profile_threads
    return max(1, cpu_cores() // max(local_ranks, 1))


def condition_warnings(plan: PlanView, threads: int, local_ranks: int, device_type: str) -> list[str]:
    """One line per way this run differs from the conditions the plan's profile measured."""
    warnings = []
    profiled = plan.profile_device.get("type")
    if profiled and profiled != device_type and not (profiled == "gpu" and device_type == "cuda"):
        warnings.append(f"the plan's profile was measured on {profiled} ({plan.profile_device.get('name', '?')}), "
                        f"this run is on {device_type}: measured times will not match the prediction")
    if device_type == "cpu":
        if plan.profile_threads is not None and threads != plan.profile_threads:
            warnings.append(f"the profile measured {plan.profile_threads} thread(s) per layer, the ranks run "
                            f"{threads}: measured times will not match the prediction")
        cores = cpu_cores()
        if local_ranks * threads > cores:
            warnings.append(f"{local_ranks} ranks x {threads} thread(s) on this machine's {cores} core(s): the "
                            f"ranks will compete for cores and run slower than predicted")
    return warnings
