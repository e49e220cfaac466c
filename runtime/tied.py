"""Tied weights across stages: one parameter, a copy on each stage that uses it, gradients summed.

GPT-2 uses one matrix twice: the input embedding looks tokens up in it, the output projection
multiplies by it. A pipeline puts the two uses in the first and the last stage. Merging every
layer between them into one stage would leave nothing to pipeline, so (as Megatron-LM does)
each stage that uses the parameter holds its own copy, and every step, after the backward and
before the optimizer, those stages all-reduce (sum) the copies' gradients. Every copy then sees
the gradient of the unsplit model (the sum of both uses' contributions), the same optimizer
step follows from the same state, and the copies stay equal without ever being sent.

The global gradient norm (clipping, fp16 overflow) counts a tied parameter once: only the
first stage that holds it adds it to its share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..models import LayeredModel
from .memory import local_tensor
from ..plan_view import PlanView


@dataclass(frozen=True)
class Tie:
    """A parameter that the layers of several stages use."""

    key: str                 # its first key in the whole model's state_dict
    stages: tuple[int, ...]  # the stages holding a copy, ascending
    param_id: int            # id() of the Parameter object in the rebuilt model


def find_ties(model: LayeredModel, plan: PlanView) -> list[Tie]:
    """Every parameter used by layers of more than one stage, in the model's parameter order."""
    stage_of = {name: cp.stage for cp in plan.chunks for name in cp.layers}
    ties = []
    for tied in model.tied_parameters():
        stages = tuple(sorted({stage_of[name] for name in tied["layers"]}))
        if len(stages) > 1:
            ties.append(Tie(tied["key"], stages, id(model.module.get_parameter(tied["key"]))))
    return ties


class TiedGradients:
    """Sums the gradients of tied copies across their stages (call :meth:`all_reduce` each step).

    Creating it is collective: every rank must create it with the same ties, since each tie
    gets its own process group of the stages that hold it. With d replicas (data parallel) a
    tie's copies are summed inside each replica, over the ranks of its stages there
    (``pipelines[r][k]``: the rank of stage k in replica r): one group per tie and replica.
    The replicas' sums then meet in the gradient sync, like any other gradient.
    """

    def __init__(self, ties: list[Tie], stage_index: int, params: dict[int, nn.Parameter],
                 pipelines: list[list[int]] | None = None, replica: int = 0) -> None:
        self.mine: list[tuple[nn.Parameter, Any]] = []
        self.not_counted: set[int] = set()  # ids of copies another stage counts in the norm
        # params: the model's parameter id -> the Parameter this stage holds for it now
        # (fsdp replaces the objects when it shards them).
        groups: dict[tuple[tuple[int, ...], int], Any] = {}
        # Each replica's pipeline (rank of stage k); None: one replica, stage k on rank k.
        replicas: list[list[int] | None] = list(pipelines) if pipelines is not None else [None]
        for tie in ties:
            for r, pipeline in enumerate(replicas):
                if (tie.stages, r) not in groups:  # collective: every rank, same order
                    ranks = [pipeline[k] for k in tie.stages] if pipeline is not None else list(tie.stages)
                    groups[(tie.stages, r)] = dist.new_group(ranks) if dist.is_initialized() else None
            if stage_index in tie.stages:
                self.mine.append((params[tie.param_id], groups[(tie.stages, replica)]))
                if stage_index != tie.stages[0]:
                    self.not_counted.add(id(params[tie.param_id]))   # the object this stage holds now

    def all_reduce(self) -> None:
        for param, group in self.mine:
            if param.grad is None:  # this stage's use got no gradient (all micro-batches skipped)
                param.grad = torch.zeros_like(param)
            # Under fsdp the gradient is a DTensor: its local shard, sharded alike on each stage.
            dist.all_reduce(local_tensor(param.grad), op=dist.ReduceOp.SUM, group=group)

    def counted(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` without the tied copies that another stage counts in the global norm."""
        return [p for p in params if id(p) not in self.not_counted]
