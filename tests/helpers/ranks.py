"""Training on real ranks, for the tests that check a pipeline against the unsplit model.

:func:`unsplit_training` is the reference (the whole model, whole batches, plain PyTorch),
:func:`assert_same_parameters` the comparison, :func:`run_in_one_group` trains a list of jobs
on a group of ranks that the session keeps (helpers/rank_pool.py), and :func:`data_parallel_plan`
writes a hand plan run by several replicas.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from gpipe_plan.artifacts import BadInput, RunFailure
from gpipe_plan.models import build_model, model_spec
from gpipe_plan.planner.replicas import rank_grid
from gpipe_plan.runtime.data import step_generator

from helpers.handplan import hand_plan
from helpers.rank_pool import discard, run_on_ranks

GPT = model_spec("gpt", layers=2, width=16, heads=2, seq_len=8, vocab_size=256)
STEPS = 3
LR = 1e-3


def unsplit_training(spec: dict[str, Any], global_batch: int, steps: int = STEPS, seed: int = 0,
                     optimizer: str = "adam", lr: float = LR, grad_clip: float | None = None,
                     norms: list[float] | None = None) -> dict[str, torch.Tensor]:
    """The reference: the whole model, whole batches, plain PyTorch (K = 1, M = 1). ``norms``, if
    given, gets each step's squared gradient norm (before clipping)."""
    torch.set_num_threads(1)
    model = build_model(spec, seed=seed)
    kind = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
    optimizer_ = kind(model.module.parameters(), lr=lr)
    for step in range(steps):
        inputs, targets = model.synthetic_batch(global_batch, step_generator(seed, step))
        model.loss(model.forward(*inputs), targets).backward()
        if norms is not None:
            norms.append(float(sum((p.grad * p.grad).sum() for p in model.module.parameters())))
        if grad_clip is not None:  # module.parameters() holds a tied parameter once
            torch.nn.utils.clip_grad_norm_(model.module.parameters(), grad_clip)
        optimizer_.step()
        optimizer_.zero_grad()
    return model.module.state_dict()


def assert_same_parameters(saved: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], atol: float) -> None:
    assert list(saved) == list(reference), "keys or their order differ from the unsplit model's"
    worst = max(float((saved[k].float() - reference[k].float()).abs().max()) for k in reference)
    assert worst <= atol, f"largest difference {worst:.3g} > {atol:g}"


# ---------------------------------------------------------------------- one group, many runs
def _train_jobs(rank: int, world_size: int, jobs: list[dict[str, Any]], outcome: str, cwd: str) -> None:
    """One rank of the session's group (helpers/rank_pool.py): train every job in turn."""
    from gpipe_plan.runtime.distributed import World
    from gpipe_plan.runtime.options import RunOptions, check_options
    from gpipe_plan.runtime.train import train

    os.chdir(cwd)
    world = World(rank, world_size, rank, world_size, "test")
    results = {}
    for job in jobs:
        job = dict(job)
        fault = job.pop("fault", None)
        if fault:
            os.environ["GPIPE_PLAN_FAULT"] = fault
        try:
            train(check_options(RunOptions(**job)), world)
            results[job["save"]] = "ok"
        except (BadInput, RunFailure) as exc:
            results[job["save"]] = f"{type(exc).__name__}: {exc}"
        finally:
            os.environ.pop("GPIPE_PLAN_FAULT", None)
    if rank == 0:
        Path(outcome).write_text(json.dumps(results))


def run_in_one_group(jobs: list[dict[str, Any]], cwd: Path, world_size: int = 2) -> dict[str, str]:
    """Train ``jobs`` one after another on ``world_size`` ranks that are already in one group
    (started once per world size for the session: helpers/rank_pool.py); each job's outcome by
    its ``save``: "ok" or the one line that stopped it. A job refused or stopped half-way may
    leave messages in flight: then the group is not reused (the next call starts a fresh one)."""
    outcome = cwd / f"outcome-{uuid.uuid4().hex[:6]}.json"
    try:
        run_on_ranks(_train_jobs, (jobs, str(outcome), str(cwd)), world_size)
    finally:
        results = json.loads(outcome.read_text()) if outcome.exists() else None
        if results is None or any(said != "ok" for said in results.values()):
            discard(world_size)
    return results


def data_parallel_plan(spec: dict[str, Any], balance: Sequence[int], replicas: int, micro_batches: int,
                       micro_batch_size: int, schedule: str = "1f1b", order: str = "pipeline-inner",
                       gradient_sync: str = "ddp", ranks: list[list[int]] | None = None) -> dict[str, Any]:
    """A hand plan of K = len(balance) stages run by ``replicas`` replicas (plan format 6's keys).

    ``order``: ``pipeline-inner`` puts stage k of replica r on rank r·K + k, ``data-inner`` on
    k·d + r; ``ranks`` (ranks[k][r]) overrides both.
    """
    doc = hand_plan(spec, balance, micro_batches=micro_batches, micro_batch_size=micro_batch_size, schedule=schedule)
    K, d = len(doc["stages"]), replicas
    if ranks is None:
        ranks = [list(row) for row in rank_grid(K, d, order)]
    doc["data_parallel"] = d
    doc["gradient_sync"] = gradient_sync
    doc["global_batch_size"] = d * micro_batches * micro_batch_size
    doc["placement"] = {"nodes": 1, "devices_per_node": K * d, "order": order, "ranks": ranks,
                        "reason": "written by hand for a test"}
    return doc
