"""How long the planner searches by default, in wall-clock seconds: one home for the defaults.

Every solver is an anytime search: when its budget runs out it returns the best plan found,
with its gap to a proven lower bound, so a budget trades planning time for proven optimality:
a plan always comes back. ``solve --time-budget`` is shared by all the settings (stages x micro-batches x
schedules) one solve tries; ``explore --time-budget`` is per cell of its grid, which holds
many; a solver built without a budget (tests, benchmarks) gets its own.

Nothing is imported here, so the command line can show these defaults without loading the
planner.
"""

SOLVE_TIME_BUDGET_S = 30.0
EXPLORE_POINT_TIME_BUDGET_S = 0.5
SOLVER_TIME_BUDGET_S = 10.0

# The least share of a budget that is spent (search.share_of_budget): a search gets at least
# this, so that it can return some plan, and a solve overruns its budget by little.
LEAST_SETTING_S = 0.02          # one setting: enough to evaluate its seed plan, no more
LEAST_ILP_SETTING_S = 0.5       # one setting under --solver ilp: CBC needs a moment to return anything
LEAST_PLACEMENT_S = 0.05        # one (stages, replicas, placement) of --devices: its settings share it
LEAST_ONE_DEVICE_S = 0.1        # the one-device plan every solve is compared with

# How long the searches for the least memory of chunked schedules (the hint of an
# out-of-memory refusal) may take in all, before each settles for the least it found (then a
# limit that works, not the least).
LEAST_MEMORY_BUDGET_S = 2.0
