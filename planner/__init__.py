"""The planner: from a profile to the best pipeline plan. Pure Python: no torch here.

Read it in this order:

- :mod:`.profile`    a profile's per-layer figures at any micro-batch size (interpolation);
- :mod:`.costmodel`  what one chunk and one stage cost in time and memory;
- :mod:`.simulator`  how long a step takes: GPipe's closed form, and one event simulator that
                     plays out any schedule's action lists (gpipe_plan/schedules.py);
- :mod:`.objective`  what every solver minimises (a partition's step time), and when a plan is
                     proven optimal;
- :mod:`.gpipe_solver` the exact GPipe solver (thresholds, probes, branch and bound);
- :mod:`.onefoneb`   the 1F1B solver (per-stage lower bounds, branch and bound);
- :mod:`.chunked`    the solver for interleaved, zb-h1 and zb-v (branch and bound over chunk cuts);
- :mod:`.ilp`        the same problem as an integer linear programme (pulp/CBC);
- :mod:`.brute`      every cut into chunks, for the tests;
- :mod:`.search`     the search over micro-batch counts, schedules and recomputation
                     (:mod:`.budgets` its default time budgets, :mod:`.replicas` over devices);
- :mod:`.plan`       the plan document; :mod:`.render` and :mod:`.timeline` show it;
- :mod:`.pipedream`  import PipeDream's profiled graphs; :mod:`.baselines` the usual heuristics.
"""

from __future__ import annotations

from typing import Any


def solve_file(profile_path: str, plan_path: str | None = None, *, stages: int, **options: Any) -> dict[str, Any]:
    """Plan from a profile file (and write the plan to ``plan_path``); see :func:`.command.solve_file`."""
    from .command import solve_file as run

    return run(profile_path, plan_path, stages=stages, **options)


__all__ = ["solve_file"]
