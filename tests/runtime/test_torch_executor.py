"""The torch executor runs every schedule from the planner's own action lists.

``--executor torch`` hands each rank's list of actions (gpipe_plan.schedules) to
``torch.distributed.pipelining``'s ``_PipelineScheduleRuntime``, which adds the sends and
receives itself. Two things can go wrong that the native executor's tests cannot see: torch
may read our lists differently from how we wrote them, or fail to place their messages; and
its own bookkeeping (dividing gradients by M per chunk, handing tensors between two chunks of
one rank) may not give the gradient of the mean. The first is checked on the lists alone, the
second by training: after a few steps every schedule must reach the parameters of one process
training on whole batches, as the native executor does (tests/runtime/test_executor.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from gpipe_plan.artifacts import write_json_atomic
from helpers.handplan import hand_plan
from gpipe_plan.runtime.torch_executor import torch_actions
from gpipe_plan.schedules import SCHEDULES, all_actions, chunks_per_stage, problem, stage_of_chunk

from helpers.schedule_runs import GPT, STEPS, even_balance
from helpers.schedule_runs import SCHEDULES as PLANNED   # (schedule, chunks per stage)
from helpers.ranks import assert_same_parameters, run_in_one_group
from helpers.ranks import unsplit_training as unsplit_reference

# Plain SGD: Adam divides each gradient by its own size, so it would not see gradients that
# are all M times too large (or small); SGD moves by the gradient itself.
LR = 0.1


# ---------------------------------------------------------------------- the lists, as torch reads them
def shapes() -> list[tuple[str, int, int, int]]:
    """Every schedule at K = 1..4 and M = 1..9 that can run (interleaved with v = 2 and 3)."""
    out = []
    for schedule in SCHEDULES:
        for v in ((2, 3) if schedule == "interleaved" else (chunks_per_stage(schedule),)):
            for K in range(1, 5):
                for M in range(1, 10):
                    if problem(schedule, K, M, v) is None:
                        out.append((schedule, K, M, v))
    return out


def test_torch_reads_every_list_as_we_wrote_it_and_can_place_its_messages() -> None:
    """For each list: torch's validator accepts it and places each chunk on our stage; its
    lowering adds a receive for every send (instead of stopping with "Malformed compute
    schedule", which a run would raise) and keeps each rank's computations in our order."""
    for schedule, K, M, v in shapes():
        actions = all_actions(schedule, K, M, v)
        order = torch_actions(actions)
        assert [[str(a) for a in order[k]] for k in range(K)] == [[str(a) for a in row] for row in actions]
        chunks = K * chunks_per_stage(schedule, v)
        placed = torch_schedules._validate_schedule(order, K, chunks, M)
        assert placed == {c: stage_of_chunk(schedule, c, K) for c in range(chunks)}, (schedule, K, M, v)
        lowered = torch_schedules._add_send_recv({k: list(row) for k, row in order.items()},
                                                 stage_to_rank=placed.__getitem__, num_stages=chunks)
        for k in range(K):
            assert [a for a in lowered[k] if a.is_compute_op] == order[k], (schedule, K, M, v, k)
        kinds = [a.computation_type.value for row in lowered.values() for a in row]
        assert kinds.count("SEND_F") == kinds.count("RECV_F") and kinds.count("SEND_B") == kinds.count("RECV_B")
        # A message for every cut between two stages (none between two chunks of one stage).
        cuts = sum(placed[c] != placed[c + 1] for c in range(chunks - 1))
        assert kinds.count("SEND_F") == kinds.count("SEND_B") == cuts * M, (schedule, K, M, v)


# ---------------------------------------------------------------------- training
def unsplit_training(spec: dict[str, Any], global_batch: int) -> dict[str, torch.Tensor]:
    """The reference: the whole model, whole batches, plain SGD (Adam would hide a gradient-scale bug)."""
    return unsplit_reference(spec, global_batch, steps=STEPS, optimizer="sgd", lr=LR)


def torch_jobs(folder: Path, stages: int, cases: list[tuple[str, dict[str, Any], int, int, Any]]) -> dict[str, Any]:
    """Train each case (name, spec, M, micro-batch size, plan options) with --executor torch in
    one group of ``stages`` ranks; return each job and the outcome."""
    jobs = {}
    for name, spec, micro_batches, micro_batch_size, options in cases:
        plan = folder / f"{name}-k{stages}.json"
        write_json_atomic(plan, hand_plan(spec, micro_batches=micro_batches, micro_batch_size=micro_batch_size,
                                          **options))
        jobs[name] = {"plan": str(plan), "steps": STEPS, "lr": LR, "optimizer": "sgd", "executor": "torch",
                      "save": str(folder / f"{name}-k{stages}.pt"), "quiet": True}
    return {"jobs": jobs, "outcome": run_in_one_group(list(jobs.values()), folder, world_size=stages)}


def every_schedule(stages: int, micro_batches: int, recompute: dict[str, list[bool]] | None = None
                   ) -> list[tuple[str, dict[str, Any], int, int, Any]]:
    cases = []
    for schedule, per_stage in PLANNED:
        chunks = stages * per_stage
        flags = (recompute or {}).get(schedule, [False] * chunks)
        cases.append((schedule, GPT, micro_batches, 1,
                      {"balance": even_balance(chunks), "schedule": schedule, "recompute": flags}))
    return cases


def assert_every_job_trains_like_one(runs: dict[str, Any], reference: dict[str, torch.Tensor]) -> None:
    for name, job in runs["jobs"].items():
        assert runs["outcome"][job["save"]] == "ok", (name, runs["outcome"][job["save"]])
        assert_same_parameters(torch.load(job["save"]), reference, atol=1e-5)


def test_two_stages_train_every_schedule_like_one(tmp_path: Path) -> None:
    """K = 2, M = 4: every schedule, recomputation on some chunks (the rerun under I and W)."""
    recompute = {"zb-h1": [True, False], "zb-v": [False, True, True, False], "interleaved": [True, False, False, True]}
    runs = torch_jobs(tmp_path, 2, every_schedule(2, 4, recompute))
    assert_every_job_trains_like_one(runs, unsplit_training(GPT, global_batch=4))


def test_a_parameter_two_chunks_of_one_stage_share_is_counted_once(tmp_path: Path) -> None:
    """GPT-2's embedding is tied to its output projection: under zb-v both ends of the V are on
    stage 0, so the one Parameter gets both chunks' gradients. torch divides each chunk's
    gradients by M after its last backward, which would divide this one twice; the executor
    starts each backward from loss / M instead."""
    pytest.importorskip("transformers")
    from helpers.hf_specs import GPT2

    runs = torch_jobs(tmp_path, 2, [("gpt2-zb-v", GPT2, 4, 2, {"balance": [2, 1, 1, 2], "schedule": "zb-v"})])
    assert_every_job_trains_like_one(runs, unsplit_training(GPT2, global_batch=8))
    saved = torch.load(runs["jobs"]["gpt2-zb-v"]["save"])
    assert torch.equal(saved["transformer.wte.weight"], saved["lm_head.weight"])


@pytest.mark.slow
def test_four_stages_train_every_schedule_like_one(tmp_path: Path) -> None:
    """K = 4, M = 8, and 1F1B with fewer micro-batches than stages (M = 2: torch's own
    Schedule1F1B refuses that; the runtime running our list does not)."""
    cases = every_schedule(4, 8)
    cases.append(("1f1b-m2", GPT, 2, 4, {"balance": even_balance(4), "schedule": "1f1b"}))
    runs = torch_jobs(tmp_path, 4, cases)
    assert_every_job_trains_like_one(runs, unsplit_training(GPT, global_batch=8))
