"""The optimizer of a stage, the learning-rate schedule, and gradient clipping across stages.

Each stage steps an ordinary optimizer over its own parameters. Adam, SGD and momentum are
per-parameter rules, so K optimizers over K disjoint sets of parameters do exactly what one
optimizer over all of them would. Gradient clipping is the exception: it scales every
gradient by ``max_norm / ||g||`` where ``||g||`` is the norm over *all* parameters, so the
stages add up their squared norms (one all-reduce) before any of them clips.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .memory import local_tensor
from .options import RunOptions


def make_optimizer(params: list[nn.Parameter], name: str, options: RunOptions) -> torch.optim.Optimizer:
    lr = options.learning_rate(name)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=options.weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=options.weight_decay)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=options.momentum_factor, weight_decay=options.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=options.weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


def learning_rate(step: int, base: float, options: RunOptions) -> float:
    """Linear warm-up over ``--warmup-steps``, then constant or cosine down to base / 10."""
    if step < options.warmup_steps:
        return base * (step + 1) / options.warmup_steps
    if options.lr_schedule == "constant":
        return base
    span = max(options.steps - options.warmup_steps, 1)
    progress = min((step - options.warmup_steps) / span, 1.0)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def squared_grad_norm(params: list[nn.Parameter]) -> float:
    """This stage's share of the global gradient norm, squared: the sum of squares of what this
    rank holds of each gradient (under fsdp its shard, :func:`.memory.local_tensor`)."""
    grads = [local_tensor(p.grad.detach()).float() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(sum((g * g).sum() for g in grads))


def clip_gradients(params: list[nn.Parameter], global_norm: float, max_norm: float) -> None:
    """Scale the gradients so that the global norm is at most ``max_norm`` (as clip_grad_norm_)."""
    scale = max_norm / (global_norm + 1e-6)
    if scale < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(scale)
