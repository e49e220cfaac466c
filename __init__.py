"""gpipe-plan: measure a model, compute the best pipeline-parallel plan, and run it.

Three packages, one artifact each, coupled only through versioned JSON files:

- ``profiles``: model -> profile JSON (per-layer time and memory, measured);
- ``planner``:  profile -> plan JSON (stage boundaries, micro-batches, schedule, recompute);
- ``runtime``:  plan -> trained model, report of measured vs predicted, trace.

``artifacts`` holds what all three share: reading and writing those files safely.
Importing this package must stay cheap: no torch here.
"""

__version__ = "0.1.0"
