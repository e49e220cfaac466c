"""Fault injection, for the tests that check how a pipeline fails.

A pipeline fails in ways a unit test cannot reach from outside: one rank raises in the middle
of a step while the others wait for it, one rank is killed, the loss turns NaN. The tests set
``GPIPE_PLAN_FAULT=kind:rank:step`` (``raise``, ``kill`` or ``nan``; step counted from 0) and
the rank named does that in its first forward of that step. Unset, this costs one dict lookup
per step.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

ENV = "GPIPE_PLAN_FAULT"


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault raises."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    @classmethod
    def from_env(cls) -> "Fault | None":
        text = os.environ.get(ENV)
        if not text:
            return None
        kind, rank, step = text.split(":")
        if kind not in ("raise", "kill", "nan"):
            raise ValueError(f"{ENV}: unknown fault kind {kind!r}")
        return cls(kind, int(rank), int(step))

    def due(self, rank: int, step: int) -> bool:
        return rank == self.rank and step == self.step

    def fire(self, rank: int, step: int) -> None:
        """For ``raise`` and ``kill``: do it now (called inside a forward)."""
        if self.kind == "raise":
            raise InjectedFault(f"injected fault in rank {rank} at step {step}")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    def poison(self, loss: torch.Tensor) -> torch.Tensor:
        """For ``nan``: what the loss becomes."""
        return loss * float("nan") if self.kind == "nan" else loss
