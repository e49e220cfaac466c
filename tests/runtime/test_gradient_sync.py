"""Data parallel around the pipeline: K = 2 stages x d = 2 replicas on 4 gloo ranks.

A plan of format 6 with ``data_parallel`` d runs d copies of its pipeline; replica r trains on
its 1/d of each step's batch and the replicas of each stage average their gradients (ddp) before
the optimizer. The result must be the unsplit model's training on the whole batch: the tests
compare with :func:`helpers.ranks.unsplit_training`, the one reference.
:func:`data_parallel_plan` adds the version-6 keys to a hand plan, so that no test here depends
on what ``solve`` chooses.
4-process runs are slow on 2 cores: the models are tiny, the steps few, and the trainings
that need no launcher share one group of 4 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe_plan.artifacts import BadInput
from gpipe_plan.runtime.plan import load_plan

from helpers.handplan import hand_plan
from helpers.planner import write_json

from helpers.cli_process import gpipe_plan
from helpers.ranks import GPT, LR, assert_same_parameters, run_in_one_group, unsplit_training
from helpers.ranks import data_parallel_plan

STEPS = 3


# ---------------------------------------------------------------------- reading the plan
def test_a_data_parallel_plan_reads_its_placement(tmp_path: Path) -> None:
    plan = load_plan(write_json(tmp_path / "p.json", data_parallel_plan(GPT, [2, 2], 2, 2, 2, order="data-inner")))
    assert (plan.data_parallel, plan.world_size, plan.replica_batch_size) == (2, 4, 4)
    assert plan.stage_ranks(0) == [0, 1] and plan.replica_ranks(1) == [1, 3]
    assert plan.position_of(3) == (1, 1) and plan.position_of(2) == (1, 0)


def test_a_batch_that_does_not_split_over_the_replicas_is_refused(tmp_path: Path) -> None:
    doc = data_parallel_plan(GPT, [2, 2], 2, 2, 2)
    doc["global_batch_size"] = 4   # one replica's worth: 2 replicas x 2 x 2 need 8
    with pytest.raises(BadInput, match="data_parallel 2 x micro_batches 2 x micro_batch_size 2 must equal"):
        load_plan(write_json(tmp_path / "p.json", doc))


def test_world_size_must_be_stages_times_replicas(tmp_path: Path) -> None:
    from gpipe_plan.runtime.distributed import World, check_world

    plan = load_plan(write_json(tmp_path / "p.json", data_parallel_plan(GPT, [2, 2], 2, 2, 2)))
    assert check_world(World(0, 4, 0, 4, "gpipe-plan"), plan) == []
    with pytest.raises(BadInput, match=r"2 stages x 2 replicas = 4 ranks but 2 processes.*x\*y = 4"):
        check_world(World(0, 2, 0, 2, "torchrun"), plan)
    warned = check_world(World(0, 4, 0, 2, "torchrun"), plan)
    assert len(warned) == 1 and "--nproc-per-node 4" in warned[0]


def test_replica_rows_split_the_batch_into_contiguous_parts() -> None:
    from gpipe_plan.runtime.train import replica_rows

    inputs, targets = (torch.arange(12).view(6, 2),), torch.arange(6)
    parts = [replica_rows((inputs, targets), r, 3) for r in range(3)]
    assert [p[1].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert torch.equal(torch.cat([p[0][0] for p in parts]), inputs[0])


def test_ddp_buckets_hold_about_the_bucket_size_in_order_one_dtype_each() -> None:
    from gpipe_plan.runtime.gradient_sync import DdpSync

    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in
              ((10, torch.float32), (10, torch.float32), (30, torch.float32), (5, torch.float64), (5, torch.float32))]
    sync = DdpSync(2, None, bucket_bytes=80)   # 20 float32 per bucket
    sync.parameters = params
    sizes = [[p.numel() for p in bucket] for bucket in sync.buckets()]
    assert sizes == [[10, 10], [30], [5], [5]]   # a tensor over the size is a bucket of its own
    assert [p for bucket in sync.buckets() for p in bucket] == params


def test_one_replica_makes_no_mesh_and_syncs_nothing(tmp_path: Path) -> None:
    from gpipe_plan.runtime.distributed import replicas_of
    from gpipe_plan.runtime.gradient_sync import NoSync, make_gradient_sync

    plan = load_plan(write_json(tmp_path / "p.json", hand_plan(GPT, [2, 2], micro_batches=2, micro_batch_size=2)))
    one = replicas_of(plan, 1, torch.device("cpu"))   # no process group needed: nothing is built
    assert (one.stage, one.replica, one.pp_ranks, one.dp_ranks, one.mesh) == (1, 0, (0, 1), (1,), None)
    assert isinstance(make_gradient_sync("ddp", 1, None, None), NoSync)


# ---------------------------------------------------------------------- 4 ranks, one group
# Any placement runs: here stage 0 of replica 0 on rank 3, its stage 1 on rank 1 (so in that
# replica's pipeline group stage 0 is group rank 1), replica 1 on ranks 0 and 2.
SCRAMBLED = [[3, 0], [1, 2]]
CASES = [  # schedule, executor, order (or ranks[k][r]), grad_clip
    ("1f1b", "native", "pipeline-inner", None),
    ("gpipe", "native", "data-inner", 0.05),
    ("1f1b", "torch", "data-inner", None),
    ("1f1b", "torch", SCRAMBLED, None),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture(scope="module")
def group_runs(workdir: Path) -> dict[str, Any]:
    """Every 4-rank training that needs no launcher, in one group of 4 ranks."""
    jobs = []
    for i, (schedule, executor, order, clip) in enumerate(CASES):
        placement = {"ranks": order, "order": "pipeline-inner"} if isinstance(order, list) else {"order": order}
        plan = write_json(workdir / f"plan-{i}.json", data_parallel_plan(GPT, [2, 2], 2, 2, 2, schedule=schedule,
                                                                        **placement))
        jobs.append({"plan": str(plan), "steps": STEPS, "lr": LR, "optimizer": "adam", "executor": executor,
                     "grad_clip": clip, "save": str(workdir / f"model-{i}.pt"),
                     "report": str(workdir / f"report-{i}.json"), "quiet": True})
    # The uninterrupted run the kill-and-resume test compares with, bit for bit.
    full = {"plan": str(write_json(workdir / "full.json", data_parallel_plan(GPT, [2, 2], 2, 2, 2))),
            "steps": 4, "save": str(workdir / "full.pt"), "quiet": True}
    # fsdp: 2 steps checkpointed, then resumed to 4 (parameters and Adam's moments are DTensor
    # shards: DCP saves and loads them shard by shard).
    sharded = str(write_json(workdir / "fsdp.json", data_parallel_plan(GPT, [2, 2], 2, 2, 2, gradient_sync="fsdp")))
    folder = str(workdir / "fsdp-ckpt")
    fsdp_jobs = [{"plan": sharded, "steps": 2, "checkpoint_dir": folder, "save": str(workdir / "fsdp-half.pt"),
                  "quiet": True},
                 {"plan": sharded, "steps": 4, "checkpoint_dir": folder, "resume": True,
                  "save": str(workdir / "fsdp-resumed.pt"), "quiet": True}]
    outcome = run_in_one_group(jobs + [full] + fsdp_jobs, workdir, world_size=4)
    return {"jobs": jobs, "outcome": outcome, "full": full["save"], "full_plan": full["plan"],
            "fsdp_resumed": fsdp_jobs[1]["save"]}


@pytest.mark.slow
def test_two_replicas_train_exactly_like_the_unsplit_model(group_runs: dict[str, Any]) -> None:
    """K = 2, d = 2, M = 2 per replica: the unsplit model on the global batch of 8, within 1e-5,
    both placements and a scrambled one, both executors, with clipping by the global norm."""
    for job, (schedule, executor, order, clip) in zip(group_runs["jobs"], CASES):
        assert group_runs["outcome"][job["save"]] == "ok", (schedule, executor, order, group_runs["outcome"])
        reference = unsplit_training(GPT, global_batch=8, steps=STEPS, grad_clip=clip)
        assert_same_parameters(torch.load(job["save"]), reference, atol=1e-5)


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_exactly(group_runs: dict[str, Any]) -> None:
    assert group_runs["outcome"][group_runs["fsdp_resumed"]] == "ok", group_runs["outcome"]
    reference = unsplit_training(GPT, global_batch=8, steps=4)
    assert_same_parameters(torch.load(group_runs["fsdp_resumed"]), reference, atol=1e-5)


@pytest.mark.slow
def test_report_measures_each_stages_gradient_sync(group_runs: dict[str, Any]) -> None:
    report = json.loads(Path(group_runs["jobs"][0]["report"]).read_text())
    assert report["version"] == 6 and report["data_parallel"] == 2 and report["gradient_sync"] == "ddp"
    assert report["global_batch_size"] == 8 and report["run"]["ranks"] == 4
    assert sorted(r["rank"] for s in report["stages"] for r in s["replicas"]) == [0, 1, 2, 3]
    for stage in report["stages"]:
        assert stage["measured_gradient_sync_s"] > 0
        assert [r["replica"] for r in stage["replicas"]] == [0, 1]
        # The native executor times its waits; the loss and norm exchange is the step's other time.
        assert stage["measured_wait_s"] is not None and stage["measured_other_s"] > 0
    # The slowest stage's sync, predicted beside measured; what the syncs add apart from it.
    predicted = [s["predicted_gradient_sync_s"] for s in report["stages"] if s["predicted_gradient_sync_s"] is not None]
    assert report["predicted_gradient_sync_s"] == (max(predicted) if predicted else None)  # a hand plan predicts none
    assert "predicted_exposed_gradient_sync_s" in report
    # The torch executor's spans cover computation only: its waits are unknown, not zero.
    by_torch = json.loads(Path(group_runs["jobs"][2]["report"]).read_text())
    assert by_torch["run"]["executor"] == "torch"
    assert all(s["measured_wait_s"] is None and s["measured_gradient_sync_s"] > 0 for s in by_torch["stages"])


# ---------------------------------------------------------------------- the command line, 4 ranks
@pytest.mark.slow
def test_a_killed_rank_stops_all_four_and_the_resumed_run_is_exact(workdir: Path,
                                                                    group_runs: dict[str, Any]) -> None:
    """``gpipe-plan run`` starts K·d = 4 ranks; rank 3 (stage 1 of replica 1) killed at step 4 of
    4 stops the other three, in one line; resumed from the step-2 checkpoint (every
    replica saved the same tensors: DCP keeps one copy), the run ends exactly where the
    uninterrupted one does."""
    folder = workdir / "resume"
    folder.mkdir()
    plan = group_runs["full_plan"]
    # The three must be stopped (by the launcher, or by their broken links to rank 3), not left to
    # their own --timeout: at an hour, ranks left waiting would outlive the hang guard (timeout).
    killed = gpipe_plan("run", plan, "--steps", "4", "--checkpoint-dir", "ckpt", "--checkpoint-every", "2",
                        "--save", "never.pt", "--timeout", "3600", cwd=folder, fault="kill:3:3", timeout=180)
    assert killed.returncode == 1
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 3 was killed by SIGKILL" in errors[0], killed.stderr
    assert not (folder / "never.pt").exists()
    assert sorted(p.name for p in (folder / "ckpt").iterdir()) == ["step-00000002"]

    resumed = gpipe_plan("run", plan, "--steps", "4", "--checkpoint-dir", "ckpt", "--resume", "--save", "resumed.pt",
                         cwd=folder, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 2" in resumed.stdout and "2 replicas" in resumed.stdout
    assert group_runs["outcome"][group_runs["full"]] == "ok"
    full, again = torch.load(group_runs["full"]), torch.load(folder / "resumed.pt")
    assert list(full) == list(again) and all(torch.equal(full[k], again[k]) for k in full)
