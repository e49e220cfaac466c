"""What a target can cut: the nearest split it can express, when it cannot express the plan's.

A trainer cuts a model only between the parts it knows: torchtitan between modules it can
name, Megatron between its embedding, decoder layers and output, DeepSpeed by a rule
(``uniform``: equal layer counts). A plan cuts between *layers*, which may be finer (a layer
that is half a decoder layer) or placed where the rule would not. Each target then exports
the *nearest expressible split*: every cut the target cannot make moves to the closest
position it can (the earlier one on a tie), keeping every chunk non-empty, and the export
says which chunks changed and what the planner predicts for the split it exported
(:mod:`.cost`).
"""

from __future__ import annotations

from collections.abc import Sequence


def bounds_of(balance: Sequence[int]) -> list[int]:
    """Layers per chunk as chunk boundaries: ``[2, 3]`` -> ``[0, 2, 5]`` (chunk c holds layers
    ``bounds[c]`` to ``bounds[c + 1] - 1``)."""
    bounds = [0]
    for count in balance:
        bounds.append(bounds[-1] + count)
    return bounds


def cuts_of(balance: Sequence[int]) -> list[int]:
    """The layer index each chunk after the first starts at: ``[4, 2]`` cuts at ``[4]``."""
    return bounds_of(balance)[1:-1]


def balance_of(cuts: Sequence[int], layers: int) -> list[int]:
    """Layers per chunk from the cut positions (the inverse of :func:`cuts_of`)."""
    edges = [0, *cuts, layers]
    return [b - a for a, b in zip(edges, edges[1:])]


def nearest_split(balance: Sequence[int], allowed: Sequence[int]) -> list[int] | None:
    """The balance whose cuts are the allowed positions nearest to ``balance``'s cuts.

    ``allowed``: the layer indices a chunk may start at (besides 0). Each cut moves to its
    closest allowed position (the earlier on a tie); when two cuts land on one position, the
    later moves on to the next allowed position (the earlier one back if none is left).
    None when no split into ``len(balance)`` non-empty chunks uses only allowed cuts.
    """
    layers = sum(balance)
    positions = sorted({a for a in allowed if 0 < a < layers})
    wanted = cuts_of(balance)
    if len(positions) < len(wanted):
        return None
    chosen: list[int] = []
    for i, cut in enumerate(wanted):
        left_needed = len(wanted) - i - 1                 # cuts still to place after this one
        candidates = [p for j, p in enumerate(positions)
                      if (not chosen or p > chosen[-1]) and len(positions) - j - 1 >= left_needed]
        if not candidates:
            return None
        chosen.append(min(candidates, key=lambda p: (abs(p - cut), p)))
    return balance_of(chosen, layers)
