"""The first plans every search starts from: the min-max partition of the work, and its neighbours.

A branch and bound prunes with its best plan so far, and a MILP starts from it, so a good first
plan is worth more than its one evaluation: it is what a search that stops at its budget keeps.
The plan most partitioners stop at (torch's proposed ``partition_model_layers``, PipeDream's
and torchgpipe's balancing) is the *min-max* partition: contiguous chunks whose largest
``Σ (forward + backward)`` is the least possible. It is not the optimum of any schedule's step
(the bubble, the sends and the optimizer tail weigh in), but it is often close, and a search
that does not see it can end with a worse plan than a simple partitioner's. So every search,
for every schedule and every number of chunks C = K v, gets it and its neighbours (each cut
moved one layer either way), whatever other settings are open, after the seeds the search
already had (the best plan of a related setting).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .baselines import min_max
from .costmodel import CostModel


def min_max_cut(cm: CostModel) -> tuple[int, ...]:
    """The contiguous cut of ``cm``'s layers into its C chunks with the least largest
    ``Σ (forward + backward)`` (plain times, as the cost model charges them per layer)."""
    work = [cm.pf[i + 1] - cm.pf[i] + cm.pg[i + 1] - cm.pg[i] for i in range(cm.L)]
    return min_max(work, cm.C)


def neighbours(bounds: Sequence[int]) -> list[tuple[int, ...]]:
    """The cuts one layer away: each inner boundary moved by -1 or +1 where chunks stay non-empty."""
    out = []
    for j in range(1, len(bounds) - 1):
        for move in (-1, 1):
            b = bounds[j] + move
            if bounds[j - 1] < b < bounds[j + 1]:
                out.append((*bounds[:j], b, *bounds[j + 1:]))
    return out


def seed_cuts(cm: CostModel, given: Iterable[Sequence[int]] = ()) -> list[tuple[int, ...]]:
    """The seeds of a search of ``cm``: ``given`` (those of C chunks), then the min-max cut and
    its neighbours, each once, in that order."""
    out: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    C, L = cm.C, cm.L
    if C > L:
        return out
    balanced = min_max_cut(cm)
    for bounds in [*given, balanced, *neighbours(balanced)]:
        bounds = tuple(bounds)
        if (len(bounds) == C + 1 and bounds[0] == 0 and bounds[-1] == L
                and all(a < b for a, b in zip(bounds, bounds[1:])) and bounds not in seen):
            seen.add(bounds)
            out.append(bounds)
    return out
