"""Runtime with real ranks: equivalence with the unsplit model, faults, resume, torchrun.

Each multi-process start costs seconds (every rank imports torch), so the equivalence cases
share one group of two ranks (:func:`_ranks_main` trains one plan after another), and the
fault and resume tests go through the real command line, as a user would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.cli_process import BIN, gpipe_plan
from gpipe_plan.artifacts import write_json_atomic
from gpipe_plan.models import model_spec
from helpers.handplan import hand_plan
from gpipe_plan.schema import REPORT_FORMAT

from helpers.ranks import GPT, LR, STEPS, assert_same_parameters, run_in_one_group, unsplit_training
from helpers.user_models import SKIP_NET, SKIP_NET_CLASSES, SKIP_NET_INPUTS, spec_in, user_module_dir

RESNET = model_spec("resnet", blocks=[1, 1], width=8, image_size=8, num_classes=5)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the user's model module in it; ranks start there (and import from it)."""
    return user_module_dir(tmp_path_factory, "skipnet", SKIP_NET)


def user_spec(workdir: Path) -> dict[str, Any]:
    return spec_in(workdir, "skipnet:make", input_shape=[SKIP_NET_INPUTS], num_classes=SKIP_NET_CLASSES)


CASES = [  # model, schedule, executor, recompute per stage
    ("gpt", "gpipe", "native", [False, False]),
    ("gpt", "1f1b", "native", [False, False]),
    ("resnet", "gpipe", "native", [False, False]),
    ("resnet", "1f1b", "native", [True, False]),
    ("user", "gpipe", "native", [False, False]),
    ("user", "1f1b", "native", [False, True]),
    ("gpt", "1f1b", "torch", [False, False]),
    ("resnet", "gpipe", "torch", [False, True]),
]


@pytest.fixture(scope="module")
def gpt_plan(workdir: Path) -> Path:
    path = workdir / "gpt-plan.json"
    write_json_atomic(path, hand_plan(GPT, [2, 2], micro_batches=2, micro_batch_size=2))
    return path


@pytest.fixture(scope="module")
def group_runs(workdir: Path, gpt_plan: Path) -> dict[str, Any]:
    """Every run that needs two ranks but no launcher, in one group of two ranks."""
    specs = {"gpt": GPT, "resnet": RESNET, "user": user_spec(workdir)}
    jobs = []
    for i, (name, schedule, executor, recompute) in enumerate(CASES):
        plan = workdir / f"plan-{i}.json"
        write_json_atomic(plan, hand_plan(specs[name], [2, 2], micro_batches=4, micro_batch_size=2,
                                          schedule=schedule, recompute=recompute))
        jobs.append({"plan": str(plan), "steps": STEPS, "lr": LR, "optimizer": "adam", "executor": executor,
                     "save": str(workdir / f"model-{i}.pt"), "report": str(workdir / f"report-{i}.json"),
                     "quiet": True})
    three = workdir / "three-stages.json"
    write_json_atomic(three, hand_plan(GPT, [2, 1, 1], micro_batches=2, micro_batch_size=2))
    extra = {
        "wrong_world": {"plan": str(three), "steps": 1, "save": str(workdir / "wrong-world.pt"), "quiet": True},
        # The uninterrupted run the kill-and-resume test compares with, with every output.
        "full": {"plan": str(gpt_plan), "steps": 6, "save": str(workdir / "full.pt"), "quiet": True,
                 "report": str(workdir / "full-report.json"), "trace": str(workdir / "full-trace.json")},
        # Last: the loss of stage 1 turns NaN at step 3 (index 2); every rank stops there.
        "nan": {"plan": str(gpt_plan), "steps": 4, "save": str(workdir / "nan.pt"), "quiet": True, "fault": "nan:1:2"},
    }
    outcome = run_in_one_group(jobs + list(extra.values()), workdir)
    return {"specs": specs, "jobs": jobs, "outcome": outcome, **{k: v["save"] for k, v in extra.items()}}


def test_two_stages_train_exactly_like_the_unsplit_model(group_runs: dict[str, Any]) -> None:
    """K = 2, M = 4 gives the unsplit model's parameters within 1e-5: gpt, resnet, a user's model,
    GPipe and 1F1B, both executors, with and without recomputation."""
    specs, jobs, outcome = group_runs["specs"], group_runs["jobs"], group_runs["outcome"]
    references = {name: unsplit_training(spec, global_batch=8) for name, spec in specs.items()}
    for job, (name, schedule, executor, recompute) in zip(jobs, CASES):
        assert outcome[job["save"]] == "ok", (name, schedule, executor, outcome[job["save"]])
        assert_same_parameters(torch.load(job["save"]), references[name], atol=1e-5)


def test_report_compares_measured_with_predicted(group_runs: dict[str, Any]) -> None:
    jobs = group_runs["jobs"]
    gpipe, one_f_one_b = (json.loads(Path(jobs[i]["report"]).read_text()) for i in (0, 1))
    assert gpipe["format"] == REPORT_FORMAT and gpipe["version"] == 6
    assert gpipe["steps_measured"] == STEPS - 1 and gpipe["measured_step_s"] > 0
    assert [(c["index"], c["stage"]) for c in gpipe["chunks"]] == [(0, 0), (1, 1)]
    for chunk in gpipe["chunks"]:
        for key in ("measured_forward_s", "measured_backward_s"):
            assert chunk[key] > 0, key
        assert chunk["measured_backward_input_s"] is None   # GPipe runs whole backwards
    for stage in gpipe["stages"]:
        for key in ("measured_peak_memory_bytes", "measured_idle_fraction"):
            assert stage[key] > 0, key
    assert 0 <= gpipe["measured_bubble_fraction"] < 1
    # version 5: the host's load over the steps, one host with both ranks (its figures: tests/test_hostload.py)
    [host] = gpipe["host_load"]["hosts"]
    assert host["ranks"] == [0, 1] and host["needed_cores"] >= 2 and host["run_cores"] > 0
    assert gpipe["headline"]["host_busy"] in (True, False)
    assert all(len(spreads) == 2 for spreads in gpipe["speed"]["per_rank_probe_spread"].values())
    # 1F1B keeps fewer micro-batches in flight on stage 0 (2 instead of 4): less activation memory.
    assert (one_f_one_b["stages"][0]["measured_memory"]["activations_bytes"]
            < gpipe["stages"][0]["measured_memory"]["activations_bytes"])


def test_a_plan_with_other_than_world_size_stages_is_refused(group_runs: dict[str, Any]) -> None:
    assert "has 3 stages but 2 processes" in group_runs["outcome"][group_runs["wrong_world"]]


# ---------------------------------------------------------------------- the command line
def test_killed_run_resumes_to_the_same_parameters(workdir: Path, gpt_plan: Path, group_runs: dict[str, Any]) -> None:
    """A rank killed at step 5 of 6; resumed from the step-4 checkpoint, the run ends where an
    uninterrupted one does, bit for bit. The killed rank stops the others (exit 1)."""
    folder = workdir / "resume"
    folder.mkdir()
    killed = gpipe_plan("run", str(gpt_plan), "--steps", "6", "--checkpoint-dir", "ckpt", "--checkpoint-every", "2",
                        "--save", "never.pt", cwd=folder, fault="kill:1:4")
    assert killed.returncode == 1
    assert "error: rank 1 was killed by SIGKILL" in killed.stderr
    assert not (folder / "never.pt").exists()
    assert sorted(p.name for p in (folder / "ckpt").iterdir()) == ["step-00000002", "step-00000004"]
    # every rank's tensor files, checksummed for the resume to check
    saved = folder / "ckpt" / "step-00000004"
    assert set(json.loads((saved / "checkpoint.json").read_text())["files_crc32"]) == \
        {p.name for p in saved.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}

    resumed = gpipe_plan("run", str(gpt_plan), "--steps", "6", "--checkpoint-dir", "ckpt", "--resume",
                         "--save", "resumed.pt", cwd=folder)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 4" in resumed.stdout and "measured vs predicted" in resumed.stdout
    assert group_runs["outcome"][group_runs["full"]] == "ok"
    a, b = torch.load(group_runs["full"]), torch.load(folder / "resumed.pt")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_trace_shows_every_stage_every_micro_batch(workdir: Path, group_runs: dict[str, Any]) -> None:
    trace = json.loads((workdir / "full-trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for stage in (0, 1):   # named as the schedule's CSV names the actions: chunk, kind, micro-batch
        for name in (f"{stage}F0", f"{stage}F1", f"{stage}B0", f"{stage}B1"):
            assert sum(e["name"] == name and e["pid"] == stage for e in spans) == 6  # each step
    report = json.loads((workdir / "full-report.json").read_text())
    assert report["steps_run"] == 6 and len(report["stages"]) == 2


@pytest.mark.parametrize("executor", ["native", "torch"])
def test_a_raising_stage_stops_every_rank_with_its_error(workdir: Path, gpt_plan: Path, executor: str) -> None:
    # The fault fires inside the chunk's forward; torch's pipelining must not wrap it either.
    # Rank 0 must be stopped (by the launcher, or by the broken link to rank 1), not left to its
    # own --timeout: at an hour, a rank 0 left waiting would outlive the hang guard (timeout).
    result = gpipe_plan("run", str(gpt_plan), "--steps", "4", "--executor", executor, "--timeout", "3600",
                        cwd=workdir, fault="raise:1:1", timeout=180)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 failed: InjectedFault: injected fault in rank 1 at step 1"), result.stderr
    assert "Traceback" in result.stderr  # the original one, rank 1's


def test_a_nan_loss_stops_the_run(group_runs: dict[str, Any]) -> None:
    outcome = group_runs["outcome"][group_runs["nan"]]
    assert outcome.startswith("RunFailure: the loss is nan at step 3: training diverged"), outcome
    assert not Path(group_runs["nan"]).exists()


def test_a_burst_of_ctrl_c_stops_the_run_once_with_exit_130(workdir: Path, gpt_plan: Path) -> None:
    """Seen: SIGINTs a fraction of a millisecond apart cut the launcher's stop short ("aborted",
    exit 1) or printed tracebacks of interrupted clean-ups. The first one stops the ranks; the
    rest are ignored."""
    import signal
    import time
    import uuid

    from helpers.cli_process import leftover_processes

    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "GPIPE_PLAN_TEST_MARK": mark}
    env.pop("GPIPE_PLAN_FAULT", None)
    proc = subprocess.Popen([str(BIN / "gpipe-plan"), "run", str(gpt_plan), "--steps", "100000", "--log-every", "1"],
                            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:            # training has begun: the ranks are up
            if line.startswith("step 3/"):
                break
        for _ in range(6):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.0003)
        out, err = proc.communicate(timeout=60)    # a hang guard only
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in err, err
    assert "Exception ignored" not in err, err
    assert leftover_processes(mark) == []


def test_a_nan_loss_is_one_line_without_a_traceback(workdir: Path, gpt_plan: Path) -> None:
    """The loss's own failure says all there is; a traceback of the training loop above it buried it."""
    result = gpipe_plan("run", str(gpt_plan), "--steps", "4", cwd=workdir, fault="nan:1:2", timeout=180)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    # every rank sees the loss (it is shared), so either may be the one the launcher names
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(r"error: rank [01] failed: the loss is nan at step 3: training diverged", last), last


def test_a_plan_for_another_model_is_refused_before_training(workdir: Path) -> None:
    doc = hand_plan(GPT, [2, 2], micro_batches=2, micro_batch_size=2)
    doc["chunks"][0]["layers"][1] = "blockzero"
    write_json_atomic(workdir / "renamed.json", doc)
    result = gpipe_plan("run", "renamed.json", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: plan '{workdir / 'renamed.json'}' does not match its model: layer 1 is 'blockzero' in the plan but "
        f"'block0' in the rebuilt model; re-run `gpipe-plan profile` and `solve`"]
    assert "training" not in result.stdout


def test_a_plan_for_a_changed_model_is_refused_before_training(workdir: Path) -> None:
    # The same layer names, another width: the bytes of layer 1 as if the model had changed since
    # its profile. Every rank refuses in one line, before a step (the first forward would fail in a rank).
    doc = hand_plan(GPT, [2, 2], micro_batches=2, micro_batch_size=2)
    profiled = doc["chunks"][0]["param_bytes"][1]
    doc["chunks"][0]["param_bytes"][1] = profiled + 512
    write_json_atomic(workdir / "resized.json", doc)
    result = gpipe_plan("run", "resized.json", "--report", "resized-report.json", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: plan '{workdir / 'resized.json'}' does not match its model: layer 1 ('block0') has {profiled:,} bytes "
        f"of parameters in the rebuilt model but {profiled + 512:,} in the profile the plan was solved from: the "
        f"model's code or configuration changed since; re-run `gpipe-plan profile` and `solve`"]
    assert "training" not in result.stdout and not (workdir / "resized-report.json").exists()


def test_torchrun_standalone_on_cpu(workdir: Path, gpt_plan: Path) -> None:
    folder = workdir / "torchrun"
    folder.mkdir()
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    result = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "gpipe_plan.cli",
                             "run", str(gpt_plan), "--steps", str(STEPS), "--lr", str(LR), "--save", "model.pt", "-q"],
                            cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert_same_parameters(torch.load(folder / "model.pt"), unsplit_training(GPT, global_batch=4), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_single_stage_matches_the_unsplit_model(workdir: Path) -> None:  # pragma: no cover
    """One GPU: one stage on cuda:0 (NCCL refuses two ranks on one GPU), M = 2."""
    folder = workdir / "cuda1"
    folder.mkdir()
    write_json_atomic(folder / "plan.json", hand_plan(GPT, [4], micro_batches=2, micro_batch_size=2))
    result = gpipe_plan("run", "plan.json", "--steps", str(STEPS), "--lr", str(LR), "--device", "cuda",
                        "--save", "model.pt", "--report", "report.json", "-q", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert_same_parameters(torch.load(folder / "model.pt"), unsplit_training(GPT, global_batch=4), atol=1e-4)
    report = json.loads((folder / "report.json").read_text())
    assert report["run"]["backend"] == "nccl" and report["stages"][0]["measured_peak_memory_bytes"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_nccl_matches_the_unsplit_model(workdir: Path, gpt_plan: Path) -> None:  # pragma: no cover
    folder = workdir / "cuda"
    folder.mkdir()
    result = gpipe_plan("run", str(gpt_plan), "--steps", str(STEPS), "--lr", str(LR), "--device", "cuda",
                        "--save", "model.pt", "-q", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert_same_parameters(torch.load(folder / "model.pt"), unsplit_training(GPT, global_batch=4), atol=1e-4)

