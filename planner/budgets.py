"""How long the planner searches by default, in wall-clock seconds: one home for the defaults.

Every solver is an anytime search: when its budget runs out it returns the best plan found,
with its gap to a proven lower bound, so a budget trades planning time for proven optimality:
a plan always comes back. ``solve --time-budget`` is shared by all the settings (stages x micro-batches x
schedules) one solve tries; ``explore --time-budget`` is per cell of its grid, which holds
many; a solver built without a budget (tests, benchmarks) gets its own.

Only the standard library is imported here, so the command line can show these defaults without
loading the planner. How one search shares its budget among its settings is here too
(:class:`SettingBudgets`).
"""

import time
from dataclasses import dataclass

SOLVE_TIME_BUDGET_S = 30.0

# The branch-and-bound searches are budgeted in work, not in wall time, so that a plan is the
# same on every run: this many units per second of budget (a bound of a chunked prefix is one
# unit, a 1F1B stage end scanned 1/16, a simulation one per 64 actions it plays out). The
# 2-core development VM did 19,500-52,600 units per CPU second (five K = 4 and 8 chunked
# settings of the PipeDream profiles); charged at about its slowest, the wall-time safety net
# (WALL_SAFETY) binds first only on a machine three times slower, and the plan does not depend on
# the machine's speed or load. (At 10,000 the searches used a median 13 s of CPU of a 30 s
# budget where they stopped unproven. The MILP's own unit is in planner/milp_solve.py.)
WORK_PER_SECOND = 20000
EXPLORE_POINT_TIME_BUDGET_S = 0.5
SOLVER_TIME_BUDGET_S = 10.0

# The wall clock is only a safety net for the work-budgeted searches (planner/solvers.py): a
# setting may run past its share of the wall time up to this many times its work budget, so that
# on a loaded or slower machine the search still stops where its work says, later, and gives the
# same plan (a solve then takes longer than --time-budget, at most about this many times).
WALL_SAFETY = 3.0

# With the schedule MILP to follow (planner/milp.py), a setting's branch and bound gets this
# share of the setting's budget first: what it proves quickly (most 1F1B and zb-h1 settings of
# few stages) it proves, and its best plan warm-starts the MILP, which gets the rest.
BRANCH_AND_BOUND_SHARE = 0.25
# The schedules of several chunks per stage: their branch and bound proves little of its own
# (interleaved 8 of 42 settings at K = 2, none at K = 4 or 8; zb-v none at K = 8, on the exactness
# bench, docs/benchmarks/exactness.md); their proofs and better plans come from the MILP, so the
# branch and bound gets the seeds' evaluation and little more.
BRANCH_AND_BOUND_SHARES = {"interleaved": 0.02, "zb-v": 0.02}
# A setting the branch and bound leaves open gets an iterated local search (planner/local_search.py)
# on this share of its budget before the MILP: a better plan to start from and stop at. It stops
# sooner when its kicks stop finding better plans; what it leaves goes to the MILP. It runs only
# where the MILP's share would buy fewer than LOCAL_SEARCH_BELOW_NODES branch-and-bound nodes (or
# no MILP follows): with thousands HiGHS finds the good plans itself, and every share the local
# search takes is work its proof lacks. On the exactness bench (docs/benchmarks/exactness.md) this
# made 32 plans faster (up to 5.4%, K = 8 most) and kept every proof at K = 4; on every open
# setting it lost three there (K = 4, M = 8 and 16: 2,400-4,800 nodes), and on a fifth, more.
LOCAL_SEARCH_SHARE = 0.1
LOCAL_SEARCH_BELOW_NODES = 2000
# The most of what a setting has left that the linear relaxation's bound may take
# (milp_solve.relaxation_bound): it needs a fraction of it, and the MILP after it the rest.
RELAXATION_SHARE = 0.25


def branch_and_bound_share(schedule: str) -> float:
    """The share of a setting's budget its branch and bound gets before the MILP."""
    return BRANCH_AND_BOUND_SHARES.get(schedule, BRANCH_AND_BOUND_SHARE)

# The least share of a budget that is spent (:func:`share_of_budget` below): a search gets at least
# this, so that it can return some plan, and a solve overruns its budget by little.
LEAST_SETTING_S = 0.02          # one setting: enough to evaluate its seed plan, no more
LEAST_ILP_SETTING_S = 0.5       # one setting under --solver ilp: CBC needs a moment to return anything
LEAST_PLACEMENT_S = 0.05        # one (stages, replicas, placement) of --devices: its settings share it
LEAST_ONE_DEVICE_S = 0.1        # the one-device plan every solve is compared with

# How long the searches for the least memory of chunked schedules (the hint of an
# out-of-memory refusal) may take in all, before each settles for the least it found (then a
# limit that works, not the least).
LEAST_MEMORY_BUDGET_S = 2.0


def share_of_budget(budget_s: float, started: float, settings_left: int, least_s: float = LEAST_SETTING_S) -> float:
    """The seconds the next setting may search: what is left of the budget, shared evenly.

    Once the budget is spent each remaining setting gets only a moment, ``least_s`` (its
    solver then returns the best plan it has, with its gap), so a solve overruns its budget by
    little more than the fixed work around the searches (reading the profile, the first cheap
    pass).
    """
    left = budget_s - (time.perf_counter() - started)
    return max(least_s, left / max(1, settings_left))


@dataclass
class SettingBudgets:
    """How one search shares its time budget among its settings: the one place each share is made.

    ``time_s``: the wall time the next setting may search (:func:`share_of_budget`).
    ``work_s``: its budget in deterministic work (planner/solvers.py): an even share of what the
    settings before it left (each reports the work it used, :meth:`spend`). Unlike what the clock
    leaves, that is the same on every run, so the same request gets the same plan.
    """

    budget_s: float
    settings: int
    started: float
    least_s: float = LEAST_SETTING_S
    work_budget_s: float | None = None   # the work to share (default budget_s)
    spent_s: float = 0.0                 # work the settings solved so far used

    def time_s(self, settings_left: int) -> float:
        return share_of_budget(self.budget_s, self.started, settings_left, self.least_s)

    def work_s(self, settings_left: int) -> float:
        total = self.budget_s if self.work_budget_s is None else self.work_budget_s
        return max(self.least_s, (total - self.spent_s) / max(1, settings_left))

    def spend(self, candidate) -> None:
        """Count the work a solved setting used (a search.Candidate; one that found no plan
        used work too)."""
        self.spent_s += candidate.work_s
