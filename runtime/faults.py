"""Fault injection, for the tests that check how a pipeline fails; the one place that knows of faults.

A pipeline fails in ways a unit test cannot reach from outside: one rank raises in the middle
of a step while the others wait for it, one rank is killed, the loss turns NaN. The tests set
``GPIPE_PLAN_FAULT=kind:rank:step`` (``raise``, ``kill``, ``nan`` or ``nan-grad``; step counted
from 0): the rank named raises, or kills itself, in its first forward of that step, or its loss
of that step is NaN, or (``nan-grad``) its loss of that step is finite but its gradient NaN: the
step's update makes the weights NaN while the step's loss looks fine, as a learning rate far too
high does.

Nothing else in the runtime knows of faults: not the executors, not the chunks, not the loss.
Training calls :func:`install_from_env` once, at set-up, before it builds its executor, and
the fault installs itself from outside, on the rank named only: a forward pre-hook on the
rank's first chunk (``raise``, ``kill``), or a wrapper around the loss function (``nan``,
``nan-grad``),
each reading the step from the training loop's own counter. Unset, nothing is installed, so
a run without a fault has no check of any kind on its path.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .executor import LossFn, Tensors

ENV = "GPIPE_PLAN_FAULT"


class InjectedFault(BaseException):
    """The error a ``raise`` fault raises.

    A ``BaseException``, as ``KeyboardInterrupt`` is: it stands for a crash, so no ``except
    Exception`` between the forward and the rank's top level may catch or rewrap it (torch's
    pipelining turns an error inside a chunk into a ``RuntimeError`` of its own, whose message
    no longer names the fault). The rank's top level reports every ``BaseException``.
    """


@dataclass(frozen=True)
class Fault:
    """What ``GPIPE_PLAN_FAULT`` asks for: ``kind`` on global rank ``rank`` at step ``step``."""

    kind: str
    rank: int
    step: int

    @classmethod
    def from_env(cls) -> "Fault | None":
        text = os.environ.get(ENV)
        if not text:
            return None
        kind, rank, step = text.split(":")
        if kind not in ("raise", "kill", "nan", "nan-grad"):
            raise ValueError(f"{ENV}: unknown fault kind {kind!r}")
        return cls(kind, int(rank), int(step))

    def fire(self) -> None:
        """For ``raise`` and ``kill``: do it now (from inside the rank's first forward of the step)."""
        if self.kind == "raise":
            raise InjectedFault(f"injected fault in rank {self.rank} at step {self.step}")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


def install_from_env(rank: int, first_chunk: nn.Module, loss_fn: LossFn, current_step: Callable[[], int]) -> LossFn:
    """Install the fault ``GPIPE_PLAN_FAULT`` asks for, if it names this (global) ``rank``; return
    the loss function to train with.

    ``first_chunk``: the module of the rank's first chunk, whose forward is the rank's first of
    every step; ``current_step``: the step the training loop is in. Unset, or another rank's
    fault: nothing is installed and ``loss_fn`` comes back as it was. A malformed value is
    refused on every rank alike.
    """
    fault = Fault.from_env()
    if fault is None or fault.rank != rank:
        return loss_fn
    if fault.kind in ("nan", "nan-grad"):
        poison = (lambda loss: loss * float("nan")) if fault.kind == "nan" else _NanGradient.apply

        def poisoned_loss(outputs: Tensors, target: torch.Tensor) -> torch.Tensor:
            # Every micro-batch's loss of the step: whichever the executor reads, it is poisoned.
            loss = loss_fn(outputs, target)
            return poison(loss) if current_step() == fault.step else loss
        return poisoned_loss

    def fire_when_due(module: nn.Module, args: Any) -> None:
        if current_step() == fault.step:
            fault.fire()   # raise or kill: the rank stops in this forward, its first of the step

    # Ahead of any hook already there (fsdp's, which gathers the parameters): the fault strikes
    # before the chunk does anything.
    first_chunk.register_forward_pre_hook(fire_when_due, prepend=True)
    return loss_fn


class _NanGradient(torch.autograd.Function):
    """The identity going forward, NaN coming back: a loss that reads finite, whose backward
    gives every parameter upstream a NaN gradient (and the optimizer step NaN weights)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")
