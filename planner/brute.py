"""Brute force: try every partition and every recompute choice. The reference for the tests.

Exponential (C(L-1, K-1) partitions times 2^K recompute choices), so only for small instances;
it exists to prove that the fast solvers are exact, not to plan.
"""

from __future__ import annotations

import itertools
from typing import Iterator

from .costmodel import CostModel
from .objective import Evaluation, evaluate


def partitions(L: int, K: int) -> Iterator[tuple[int, ...]]:
    """Every way to cut L layers into K non-empty contiguous stages, as boundaries."""
    for cuts in itertools.combinations(range(1, L), K - 1):
        yield (0, *cuts, L)


def brute_force(cm: CostModel) -> Evaluation | None:
    """The fastest plan that fits, trying every cut into the schedule's chunks and every
    recompute choice the setting allows per stage."""
    best: Evaluation | None = None
    for bounds in partitions(cm.L, cm.C):
        for recompute in itertools.product(cm.allowed_recompute, repeat=cm.K):
            ev = evaluate(cm, bounds, recompute)
            if ev.fits and (best is None or ev.step_s < best.step_s):
                best = ev
    return best
