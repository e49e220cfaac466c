"""Every schedule, run by real ranks, trains exactly like the unsplit model.

GPipe and 1F1B keep one chunk per stage; ``interleaved`` puts v chunks on each stage
round-robin (a micro-batch loops through the stages v times); ``zb-h1`` and ``zb-v`` split each
backward into I (input gradient) and W (weight gradient), and ``zb-v`` places two chunks per
stage in a V, so that the stage holding the first layer also holds the loss, and the two middle
chunks share the last stage (their tensors pass without a message). Whatever the order, the
gradient of every parameter is the sum over micro-batches of d(loss_m / M)/dparam: after a
few steps the parameters must equal those of one process training on whole batches.

Each group of ranks costs seconds to start (every rank imports torch), so one group of two
trains every K = 2 plan in turn, and one group of four every K = 4 plan (marked slow).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe_plan.artifacts import write_json_atomic
from gpipe_plan.models import model_spec
from helpers.handplan import hand_plan

from helpers.ranks import assert_same_parameters, run_in_one_group, unsplit_training
from helpers.schedule_runs import even_balance, GPT, SCHEDULES, STEPS

LR = 1e-3


def train_every_schedule(folder: Path, stages: int, micro_batches: int,
                         recompute: dict[str, list[bool]] | None = None,
                         then: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every schedule on ``stages`` ranks (one group), each saved, then the jobs ``then`` (whose
    ``plan`` names a schedule); returns the jobs and outcome."""
    jobs = {}
    for schedule, per_stage in SCHEDULES:
        chunks = stages * per_stage
        flags = (recompute or {}).get(schedule, [False] * chunks)
        plan = folder / f"{schedule}-k{stages}.json"
        write_json_atomic(plan, hand_plan(GPT, even_balance(chunks), micro_batches=micro_batches, micro_batch_size=1,
                                          schedule=schedule, recompute=flags))
        jobs[schedule] = {"plan": str(plan), "steps": STEPS, "lr": LR, "optimizer": "adam", "executor": "native",
                          "save": str(folder / f"{schedule}-k{stages}.pt"),
                          "report": str(folder / f"{schedule}-k{stages}-report.json"),
                          "trace": str(folder / f"{schedule}-k{stages}-trace.json"), "quiet": True}
    for name, job in (then or {}).items():
        jobs[name] = {"lr": LR, "optimizer": "adam", "executor": "native", "quiet": True,
                      **job, "plan": jobs[job["plan"]]["plan"], "save": str(folder / f"{name}.pt")}
    outcome = run_in_one_group(list(jobs.values()), folder, world_size=stages)
    return {"jobs": jobs, "outcome": outcome, "reference": unsplit_training(GPT, global_batch=micro_batches,
                                                                            steps=STEPS)}


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # Recomputation on some chunks: the checkpointed rerun must work under I and W too.
    recompute = {"zb-h1": [True, False], "zb-v": [False, True, True, False], "interleaved": [True, False, False, True]}
    folder = tmp_path_factory.mktemp("k2")
    # Saved under zb-v (stage 0 holds chunks 0 and 3), resumed under interleaved (0 and 2).
    checkpoints = str(folder / "checkpoints")
    then = {"zb-v-saves": {"plan": "zb-v", "steps": 2, "checkpoint_dir": checkpoints, "checkpoint_every": 2},
            "interleaved-resumes": {"plan": "interleaved", "steps": STEPS, "checkpoint_dir": checkpoints,
                                    "resume": True, "report": str(folder / "resumed-report.json")}}
    return train_every_schedule(folder, stages=2, micro_batches=4, recompute=recompute, then=then)


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_two_stages_train_like_one(two_stages: dict[str, Any], schedule: str) -> None:
    job = two_stages["jobs"][schedule]
    assert two_stages["outcome"][job["save"]] == "ok", two_stages["outcome"][job["save"]]
    assert_same_parameters(torch.load(job["save"]), two_stages["reference"], atol=1e-5)


def test_every_rank_learns_the_loss_from_the_stage_that_computes_it(two_stages: dict[str, Any]) -> None:
    """Under zb-v the loss is computed on stage 0 (the V's last chunk is there), elsewhere on the
    last stage: rank 0 reports the same losses, step by step, whatever the schedule."""
    losses = {schedule: json.loads(Path(two_stages["jobs"][schedule]["report"]).read_text())["loss"]["per_step"]
              for schedule, _ in SCHEDULES}
    assert min(losses["gpipe"].values()) > 1.0   # a byte-level guess among 64 tokens: about ln 64
    for schedule, per_step in losses.items():
        assert per_step.keys() == losses["gpipe"].keys()
        for step, loss in per_step.items():
            assert loss == pytest.approx(losses["gpipe"][step], abs=1e-5), (schedule, step)


def test_a_checkpoint_saved_by_chunks_resumes_under_other_chunks(two_stages: dict[str, Any]) -> None:
    """Checkpoints are keyed by the unsplit model's names: a stage saves its chunks' tensors
    (and their optimizer state) and loads whichever chunks the next plan gives it."""
    job = two_stages["jobs"]["interleaved-resumes"]
    assert two_stages["outcome"][job["save"]] == "ok", two_stages["outcome"][job["save"]]
    assert json.loads(Path(job["report"]).read_text())["steps_run"] == 1   # step 3 only: it resumed
    assert_same_parameters(torch.load(job["save"]), two_stages["reference"], atol=1e-5)


@pytest.mark.slow
def test_four_stages_train_like_one(tmp_path: Path) -> None:
    runs = train_every_schedule(tmp_path, stages=4, micro_batches=8)
    for schedule, job in runs["jobs"].items():
        assert runs["outcome"][job["save"]] == "ok", (schedule, runs["outcome"][job["save"]])
        assert_same_parameters(torch.load(job["save"]), runs["reference"], atol=1e-5)


def test_the_report_times_each_chunk_and_the_halves_of_a_split_backward(two_stages: dict[str, Any]) -> None:
    zbv = json.loads(Path(two_stages["jobs"]["zb-v"]["report"]).read_text())
    assert zbv["version"] == 6 and zbv["schedule"] == "zb-v" and zbv["virtual_stages"] == 2
    # a plan of a core per rank charged nothing for sharing cores, and the report says so
    assert (zbv["shared_core_slowdown"], zbv["shared_core_action_s"]) == (1.0, 0.0)
    assert [c["stage"] for c in zbv["chunks"]] == [0, 1, 1, 0]
    assert [s["chunks"] for s in zbv["stages"]] == [[0, 3], [1, 2]]
    for chunk in zbv["chunks"]:
        for key in ("measured_forward_s", "measured_backward_input_s", "measured_backward_weight_s"):
            assert chunk[key] > 0, (chunk["index"], key)
        # B of a split schedule is I + W, summed per micro-batch.
        assert chunk["measured_backward_s"] >= chunk["measured_backward_input_s"]
    one_f_one_b = json.loads(Path(two_stages["jobs"]["1f1b"]["report"]).read_text())
    for chunk in one_f_one_b["chunks"]:
        assert chunk["measured_backward_s"] > 0 and chunk["measured_backward_input_s"] is None


def test_the_trace_shows_i_and_w_apart_on_their_chunks(two_stages: dict[str, Any]) -> None:
    trace = json.loads(Path(two_stages["jobs"]["zb-v"]["trace"]).read_text())
    names = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    # Stage 0 holds chunks 0 and 3; chunk 3 (the loss) runs its I and W as two spans.
    assert {(0, "3I0"), (0, "3W0"), (0, "0F0"), (1, "1F0"), (1, "2W3")} <= names
    assert not any(name.startswith("3") for pid, name in names if pid == 1)


def test_a_tied_embedding_on_both_ends_of_the_v_is_one_parameter(tmp_path: Path) -> None:
    """GPT-2 ties its embedding to its output projection. Under zb-v stage 0 holds both (chunks
    0 and 3): one parameter, both chunks' gradients in its one .grad, counted once in the clipped
    norm. Under interleaved they are on two stages: two copies, gradients summed."""
    pytest.importorskip("transformers")
    from hf_models import SEQ, VOCAB

    gpt2 = model_spec("hf_models:make_gpt2", input_shape=[SEQ], vocab_size=VOCAB, loss="lm")
    jobs = []
    for schedule in ("zb-v", "interleaved"):
        plan = tmp_path / f"{schedule}.json"
        write_json_atomic(plan, hand_plan(gpt2, [1, 2, 2, 1], micro_batches=4, micro_batch_size=2, schedule=schedule))
        jobs.append({"plan": str(plan), "steps": STEPS, "lr": LR, "optimizer": "adam", "grad_clip": 0.05,
                     "executor": "native", "save": str(tmp_path / f"{schedule}.pt"), "quiet": True})
    outcome = run_in_one_group(jobs, tmp_path)
    reference = unsplit_training(gpt2, global_batch=8, grad_clip=0.05)
    for job in jobs:
        assert outcome[job["save"]] == "ok", outcome[job["save"]]
        saved = torch.load(job["save"])
        assert_same_parameters(saved, reference, atol=1e-5)
        assert torch.equal(saved["transformer.wte.weight"], saved["lm_head.weight"])
