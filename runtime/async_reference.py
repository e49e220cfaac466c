"""The asynchronous pipelines' mathematics in one process: what a run must compute, exactly.

A pipelined run of ``pipedream`` or ``pipedream-2bw`` overlaps K stages on K devices; this
module computes the same thing with no pipeline at all, one micro-batch after the other, so
that a test can check a run against it (1e-5) and a benchmark can draw its loss curves
without starting processes. The rules are :mod:`gpipe_plan.weight_versions`'; here they are
applied to K stage modules in order:

- keep, per stage, every weight version some later micro-batch will still meet;
- run micro-batch i through the stages, stage k on its version ``version_used(..., i)`` (with
  ``torch.func.functional_call``, the module's own parameters untouched), and backpropagate:
  each stage's gradient is then the one its pipelined backward computes, with the weights its
  forward used (weight stashing);
- hand the gradient to the stage's optimizer, which applies it to the newest weights:
  per micro-batch under ``pipedream``, once per step (the mean over its M micro-batches)
  under ``pipedream-2bw``.

Stages are any ``nn.Module``\\ s taking the previous stage's outputs (a tensor or a tuple) as
positional arguments; ``loss_fn(outputs, targets)`` is each micro-batch's mean loss. Buffers
are not versioned (they are the stage's own, as in the pipelined run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..weight_versions import problem, version_used

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def reference_run(stages: Sequence[nn.Module], loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                  batches: Iterable[Batch], schedule: str, micro_batches: int,
                  make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                  lr_of_step: Callable[[int], float] | None = None,
                  drain_every: int | None = None) -> list[float]:
    """Train ``stages`` in place on ``batches`` (one per step, cut into ``micro_batches`` rows-wise
    in order); return each step's loss, the mean of its micro-batches' losses.

    ``drain_every``: the run drains after every that many steps (a checkpoint's cadence), and the
    rules start again from the newest weights. ``lr_of_step``: each step's learning rate, set on
    every optimizer before the step's first update.
    """
    K, M = len(stages), micro_batches
    reason = problem(schedule, K, M)
    if reason:
        raise ValueError(reason)
    optimizers = [make_optimizer(list(stage.parameters())) for stage in stages]
    names = [[name for name, _ in stage.named_parameters()] for stage in stages]
    versions: list[dict[int, list[torch.Tensor]]] = []   # per stage: updates since the segment's start -> weights
    updates = [0] * K                                      # per stage, since the segment's start
    segment_start, losses = 0, []
    for step, (inputs, targets) in enumerate(batches):
        if step == 0 or (drain_every and step % drain_every == 0):
            segment_start, updates = step, [0] * K
            versions = [{0: _snapshot(stage)} for stage in stages]
        if lr_of_step is not None:
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = lr_of_step(step)
        micro_inputs = list(zip(*(x.chunk(M) for x in inputs)))
        micro_targets = list(targets.chunk(M))
        step_losses, accumulated = [], [None] * K
        for m in range(M):
            i = (step - segment_start) * M + m
            used = [version_used(schedule, k, K, M, i) for k in range(K)]
            weights = [[w.detach().requires_grad_(w.requires_grad) for w in versions[k][used[k]]] for k in range(K)]
            outputs: Any = micro_inputs[m]
            for k, stage in enumerate(stages):
                args = outputs if isinstance(outputs, tuple) else (outputs,)
                outputs = torch.func.functional_call(stage, dict(zip(names[k], weights[k])), args, strict=False)
            loss = loss_fn(outputs, micro_targets[m])
            step_losses.append(float(loss.detach()))
            scaled = loss if schedule == "pipedream" else loss / M
            wanted = [w for ws in weights for w in ws if w.requires_grad]
            grads = iter(torch.autograd.grad(scaled, wanted, allow_unused=True))
            per_stage = [[next(grads) if w.requires_grad else None for w in ws] for ws in weights]
            for k in range(K):
                if schedule == "pipedream":
                    _apply(stages[k], optimizers[k], per_stage[k])
                    updates[k] += 1
                    versions[k][updates[k]] = _snapshot(stages[k])
                else:
                    accumulated[k] = per_stage[k] if accumulated[k] is None else [
                        a if g is None else g if a is None else a + g for a, g in zip(accumulated[k], per_stage[k])]
        if schedule == "pipedream-2bw":
            for k in range(K):
                _apply(stages[k], optimizers[k], accumulated[k])
                updates[k] += 1
                versions[k][updates[k]] = _snapshot(stages[k])
        # Forget the versions no later micro-batch of the segment meets (they only grow older).
        i_next = (step + 1 - segment_start) * M
        for k in range(K):
            oldest = version_used(schedule, k, K, M, i_next)
            for v in [v for v in versions[k] if v < oldest]:
                del versions[k][v]
        losses.append(sum(step_losses) / M)
    return losses


def _snapshot(stage: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_(p.requires_grad) for p in stage.parameters()]


def _apply(stage: nn.Module, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor | None]) -> None:
    """Step ``optimizer`` with ``grads`` as the gradients of the stage's (newest) parameters."""
    for p, g in zip(stage.parameters(), grads):
        p.grad = None if g is None else g.detach().clone()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def localsgd_reference(replicas: Sequence[nn.Module], loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                       batches: Iterable[Batch], sync_every: int,
                       make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                       lr_of_step: Callable[[int], float] | None = None) -> list[float]:
    """LocalSGD in one process: train the d ``replicas`` (equal at the start) in place; return each
    step's loss, the mean over the replicas of their own mean loss.

    Replica r steps its own optimizer on its rows of each batch, ``[r B/d, (r+1) B/d)`` (as
    ``runtime.train.replica_rows`` cuts them), with no gradient exchange; after steps H, 2H, ...
    (``sync_every`` = H; counted from 1) the replicas' parameters are replaced by their mean,
    which is what torch's ``PeriodicModelAverager(period=H)`` does when its ``step`` counts the
    steps done. With H = 1 and SGD this is synchronous data parallelism: the mean of the d
    updated weights is the weights updated by the mean gradient.
    """
    if sync_every < 1:
        raise ValueError(f"sync_every must be at least 1, got {sync_every}")
    d = len(replicas)
    optimizers = [make_optimizer(list(replica.parameters())) for replica in replicas]
    losses = []
    for step, (inputs, targets) in enumerate(batches):
        rows = targets.shape[0] // d
        step_losses = []
        for r, (replica, optimizer) in enumerate(zip(replicas, optimizers)):
            if lr_of_step is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr_of_step(step)
            part = slice(r * rows, (r + 1) * rows)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(replica(*(x[part] for x in inputs)), targets[part])
            loss.backward()
            optimizer.step()
            step_losses.append(float(loss.detach()))
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                for group in zip(*(replica.parameters() for replica in replicas)):
                    mean = torch.stack([p for p in group]).mean(dim=0)
                    for p in group:
                        p.copy_(mean)
        losses.append(sum(step_losses) / d)
    return losses
