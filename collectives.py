"""What a collective costs: the ring all-reduce, in one formula that measuring and planning share.

``profile --measure-link`` times real all-reduces and fits this model's two figures (latency
per step, bus bandwidth: profiles/link.py); the planner charges each stage's gradient sync with
it (planner/replicas.py). Both read the formula here, so a fit and a plan cannot disagree on what
the figures mean. Pure Python: the planner imports it.
"""

from __future__ import annotations


def ring_allreduce_s(nbytes: float, replicas: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """One ring all-reduce of ``nbytes`` over ``replicas`` devices, in seconds.

    The ring cuts the buffer into d pieces and takes 2(d-1) steps (d-1 to reduce-scatter,
    d-1 to all-gather); in each, every device sends one piece, B/d bytes, to its neighbour. So::

        2 (d - 1) / d * B / bandwidth + 2 (d - 1) * latency

    with ``bandwidth`` the slowest hop's (a ring goes at its slowest link's pace) and
    ``latency`` per step. FSDP's reduce-scatter plus all-gather are the same 2(d-1) steps of
    the same pieces, so the same time. Nothing to sync (one replica, no bytes): 0.
    """
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (replicas - 1)
    return steps / replicas * nbytes / bandwidth_bytes_per_s + steps * latency_s


def ring_allreduce_s_per_byte(replicas: int, bandwidth_bytes_per_s: float) -> float:
    """What each byte more adds to :func:`ring_allreduce_s` of a buffer that already holds some:
    ``2 (d - 1) / d / bandwidth``. A buffer that held none pays the latency too, so this is the
    least it adds, whatever the buffer held (what a lower bound over undecided layers may charge)."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) / replicas / bandwidth_bytes_per_s

