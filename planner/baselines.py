"""The partitions users get today, to compare our plans with.

- ``uniform``: the same number of layers per stage (Megatron-LM, DeepSpeed ``uniform``).
- ``parameters``: stages with balanced parameter counts (DeepSpeed ``parameters``): the
  partition minimising the largest stage's parameter bytes.
- ``block``: a time-balancing heuristic in the spirit of torchgpipe's ``balance_by_time``:
  cut where the running forward+backward time crosses each k/K of the total (choosing the
  nearer side of the crossing), then move single layers across a boundary while that lowers
  the slowest stage. Written here from that description, not copied.

Each returns boundaries ``0 = b0 < ... < bK = L``; evaluate them with the same cost model as
the planner's own plans.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Sequence


def uniform(L: int, K: int) -> tuple[int, ...]:
    base, extra = divmod(L, K)
    bounds = [0]
    for k in range(K):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return tuple(bounds)


def min_max(weights: Sequence[float], K: int) -> tuple[int, ...]:
    """The partition into K non-empty stages with the smallest largest stage sum (exact)."""
    prefix = [0.0, *accumulate(weights)]
    L = len(weights)

    def cuts(limit: float) -> list[int] | None:
        bounds, s = [0], 0
        while s < L:
            e = bisect.bisect_right(prefix, prefix[s] + limit) - 1
            if e <= s:
                return None
            bounds.append(e)
            s = e
        return bounds if len(bounds) - 1 <= K else None

    lo, hi = max(weights) if weights else 0.0, prefix[-1]
    for _ in range(200):
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        if cuts(mid) is None:
            lo = mid
        else:
            hi = mid
    bounds = cuts(hi) or list(uniform(L, K))
    return _fill(bounds, L, K)


def parameters(param_bytes: Sequence[float], K: int) -> tuple[int, ...]:
    return min_max(param_bytes, K)


def block(times: Sequence[float], K: int) -> tuple[int, ...]:
    L = len(times)
    prefix = [0.0, *accumulate(times)]
    total = prefix[-1]
    bounds = [0]
    for k in range(1, K):
        target = total * k / K
        e = bisect.bisect_left(prefix, target)
        if e > 0 and e < len(prefix) and abs(prefix[e - 1] - target) < abs(prefix[e] - target):
            e -= 1
        e = max(e, bounds[-1] + 1)
        e = min(e, L - (K - k))
        bounds.append(e)
    bounds.append(L)
    # Local improvement: shift one layer across a boundary while the slowest stage gets faster.
    def slowest(b: list[int]) -> float:
        return max(prefix[b[i + 1]] - prefix[b[i]] for i in range(K))

    improved = True
    while improved:
        improved = False
        current = slowest(bounds)
        for i in range(1, K):
            for step in (-1, 1):
                moved = bounds[i] + step
                if bounds[i - 1] < moved < bounds[i + 1]:
                    trial = bounds[:i] + [moved] + bounds[i + 1:]
                    if slowest(trial) < current:
                        bounds, current, improved = trial, slowest(trial), True
    return tuple(bounds)


def _fill(bounds: list[int], L: int, K: int) -> tuple[int, ...]:
    """Add cuts (splitting the longest stages) until there are exactly K stages."""
    bounds = list(bounds)
    while len(bounds) - 1 < K:
        widths = [(bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1)]
        width, i = max(widths)
        bounds.insert(i + 1, bounds[i] + width // 2)
    return tuple(bounds)
