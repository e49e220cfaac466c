"""LocalSGD (``--gradient-sync localsgd --sync-every H``): the d replicas of each stage step on
their own rows with no gradient exchange, and their parameters are averaged every H steps.

The runs are checked against :func:`gpipe_plan.runtime.async_reference.localsgd_reference`, the
one-process reference (1e-5); H = 1 with SGD against ddp; a resumed run against an uninterrupted
one (bit for bit); the planner's charge against the ring all-reduce of
:func:`gpipe_plan.collectives.ring_allreduce_s` / H; and the refusals, one line each.
Process launches are few: every 2-rank training shares one group, the 4-rank one another.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe_plan.artifacts import BadInput
from gpipe_plan.collectives import ring_allreduce_s
from gpipe_plan.models import build_model, model_spec
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.replicas import factorisations

from helpers.planner import cli, make_figures, profile_doc, write_json
from helpers.ranks import run_in_one_group
from helpers.ranks import data_parallel_plan
from helpers.user_models import TEACHER_DATA_AND_LOSS, spec_in, user_module_dir

LR = 0.05
# The user's model, data and loss (--data, --loss): 4 classes of a fixed random linear map of x.
TASK = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    def make():
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

""" + TEACHER_DATA_AND_LOSS


# ---------------------------------------------------------------------- the planner
def test_the_averaging_is_charged_one_ring_all_reduce_of_the_parameters_per_h_steps() -> None:
    fig = make_figures([1e-3] * 4, [2e-3] * 4, params=[1000, 2000, 3000, 4000])
    bandwidth, latency = 1e6, 1e-4
    base = dict(stages=2, micro_batches=2, data_parallel=4, sync_bandwidth_bytes_per_s=bandwidth,
                sync_latency_s=latency, optimizer="adam")
    ddp = CostModel(fig, Setting(**base))
    for H in (1, 3, 8):
        local = CostModel(fig, Setting(**base, gradient_sync="localsgd", sync_every=H))
        for spans in (((0, 1),), ((1, 4),), ((0, 2), (3, 4))):
            nbytes = sum(sum(fig.param_bytes[s:e]) for s, e in spans)
            assert local.gradient_sync_s(spans) == pytest.approx(ring_allreduce_s(nbytes, 4, bandwidth, latency) / H)
            assert ddp.gradient_sync_s(spans) == pytest.approx(ring_allreduce_s(nbytes, 4, bandwidth, latency))
            # memory as ddp: whole parameters, gradients and optimizer state on every replica
            assert local.stage(1, spans, False).memory_bytes == pytest.approx(ddp.stage(1, spans, False).memory_bytes)
        assert local.static_memory(0, 4) == ddp.static_memory(0, 4)


def test_solve_records_h_and_charges_each_stage_its_averaging_over_h(tmp_path: Path) -> None:
    link = {"bandwidth_bytes_per_s": 1e6, "latency_s": 1e-4}
    profile = write_json(tmp_path / "profile.json", profile_doc(L=4, batch_size=8, link=link))
    plans = {}
    for name, extra in (("ddp", ()), ("local", ("--gradient-sync", "localsgd", "--sync-every", "4"))):
        out = tmp_path / f"{name}.json"
        result = cli("solve", str(profile), "--devices", "2", "--data-parallel", "2", "-b", "8",
                     "--time-budget", "2", "-q", "-o", str(out), *extra)
        assert result.exit_code == 0, result.output
        plans[name] = json.loads(out.read_text())
    ddp, local = plans["ddp"], plans["local"]
    assert (local["gradient_sync"], local["sync_every"], local["options"]["sync_every"]) == ("localsgd", 4, 4)
    assert "sync_every" not in ddp and "sync_every" not in ddp["options"]
    # one stage of every parameter over 2 replicas: ring_allreduce_s of all of them, over H
    params = sum(layer["param_bytes"] for layer in profile_doc(L=4)["layers"])
    assert [st["gradient_sync_s"] for st in local["stages"]] == pytest.approx(
        [ring_allreduce_s(params, 2, 1e6, 1e-4) / 4])
    assert [st["gradient_sync_s"] for st in ddp["stages"]] == pytest.approx([ring_allreduce_s(params, 2, 1e6, 1e-4)])
    assert local["predicted"]["step_s"] < ddp["predicted"]["step_s"]
    static = [{k: v for k, v in plan["stages"][0]["memory"].items() if k != "activations_bytes"} for plan in (local, ddp)]
    assert static[0] == static[1]       # as ddp: whole parameters, gradients and state
    from gpipe_plan.runtime.plan import load_plan

    run_plan = load_plan(tmp_path / "local.json")
    assert (run_plan.gradient_sync, run_plan.sync_every) == ("localsgd", 4)
    assert load_plan(tmp_path / "ddp.json").sync_every == 1
    shown = cli("show", str(tmp_path / "local.json"))
    assert shown.exit_code == 0 and "gradient sync (localsgd) over 2 replicas: no gradient all-reduce; the " \
        "parameters averaged every 4 steps, charged 1/4 of it per step" in " ".join(shown.output.split()), shown.output
    # No export target's data parallel says localsgd: refused, not exported as ddp.
    from gpipe_plan.planner.export import export_plan

    with pytest.raises(BadInput, match="trains with localsgd .* averaged every 4 steps.* cannot say"):
        export_plan(str(tmp_path / "local.json"), "torchtitan", str(tmp_path / "t.toml"))
    assert not (tmp_path / "t.toml").exists()


def test_with_devices_localsgd_searches_only_factorisations_of_two_replicas_or_more() -> None:
    reasons = {(K, d): why for K, d, why in factorisations(4, None, "auto", 8, 6, "localsgd")}
    assert "2 replicas or more" in reasons[(4, 1)] and reasons[(2, 2)] == reasons[(1, 4)] == ""
    assert factorisations(4, None, "auto", 8, 6)[0][2] == ""   # ddp keeps d = 1


@pytest.mark.parametrize("args, message", [
    (("--stages", "2", "--sync-every", "2"),
     "--sync-every sets how often localsgd averages the replicas' parameters; --gradient-sync ddp syncs every step"),
    (("--devices", "2", "--gradient-sync", "fsdp", "--sync-every", "2"), "--gradient-sync fsdp syncs every step"),
    (("--devices", "2", "--gradient-sync", "localsgd", "--sync-every", "0"),
     "--sync-every must be a whole number of steps, at least 1, got 0"),
    (("--stages", "2", "--gradient-sync", "localsgd"), "averages the parameters of d >= 2 replicas"),
    (("--devices", "2", "--stages", "2", "--gradient-sync", "localsgd"), "averages the parameters of d >= 2"),
    (("--devices", "2", "--data-parallel", "1", "--gradient-sync", "localsgd"), "d >= 2 replicas"),
])
def test_solve_refuses_what_localsgd_cannot_plan_in_one_line(tmp_path: Path, args: tuple[str, ...],
                                                            message: str) -> None:
    profile = write_json(tmp_path / "profile.json", profile_doc(L=4, batch_size=8))
    result = cli("solve", str(profile), "-b", "8", "--time-budget", "1", "-q", "-o", str(tmp_path / "p.json"), *args)
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "p.json").exists()


def test_explore_takes_sync_every_with_devices_and_localsgd_only(tmp_path: Path) -> None:
    profile = write_json(tmp_path / "profile.json", profile_doc(L=4, batch_size=8))
    alone = cli("explore", str(profile), "--sync-every", "2")
    assert alone.exit_code != 0 and "give --devices too" in alone.output, alone.output
    ddp = cli("explore", str(profile), "--devices", "2", "--sync-every", "2")
    assert ddp.exit_code != 0 and "give --gradient-sync localsgd" in ddp.output, ddp.output
    rows = {}
    for name, extra in (("ddp", ()), ("local", ("--gradient-sync", "localsgd", "--sync-every", "2"))):
        out = tmp_path / f"{name}.json"
        ok = cli("explore", str(profile), "--devices", "2", "-m", "1", "--schedule", "gpipe", "--recompute", "never",
                 "--link-bandwidth", "0.001", "--time-budget", "1", "--json", str(out), *extra)
        assert ok.exit_code == 0, ok.output
        rows[name] = {(r["stages"], r["data_parallel"]): r for r in json.loads(out.read_text())["factorisations"]}
    # one stage of 2 replicas: the same cell, its averaging charged half of ddp's all-reduce
    one_stage = [rows[name][(1, 2)]["slowest_stage_gradient_sync_s"] for name in ("ddp", "local")]
    assert one_stage[0] > 0 and one_stage[1] == pytest.approx(one_stage[0] / 2)
    assert rows["ddp"][(2, 1)]["reason"] == "" and "2 replicas or more" in rows["local"][(2, 1)]["reason"]


# ---------------------------------------------------------------------- the runtime
@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Not "task": models/test_hooks.py's own, kept in the pytest process, has no `loss` (user_module_dir).
    return user_module_dir(tmp_path_factory, "localsgd_task", TASK)


def task_spec(task_dir: Path) -> dict[str, Any]:
    return spec_in(task_dir, "localsgd_task:make", data="localsgd_task:data", loss="localsgd_task:loss")


def reference(task_dir: Path, replicas: int, global_batch: int, steps: int, H: int,
              optimizer: str = "sgd") -> list[dict[str, torch.Tensor]]:
    """localsgd_reference on the user's model and data: every replica's parameters at the end."""
    import os

    from gpipe_plan.models.hooks import DataStream
    from gpipe_plan.models.user import find_factory
    from gpipe_plan.runtime.async_reference import localsgd_reference

    old = os.getcwd()
    os.chdir(task_dir)
    try:
        torch.set_num_threads(1)
        model = build_model(task_spec(task_dir), seed=0)
        stream = DataStream(find_factory("localsgd_task:data"), "localsgd_task:data", global_batch, seed=0)
        batches = [stream.next() for _ in range(steps)]
        copies = [copy.deepcopy(model.module) for _ in range(replicas)]
        kind = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer]
        localsgd_reference(copies, lambda out, t: model.loss((out,) if isinstance(out, torch.Tensor) else out, t),
                           batches, H, lambda params: kind(params, lr=LR))
    finally:
        os.chdir(old)
    return [replica.state_dict() for replica in copies]


def mean_of(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in states]).mean(dim=0) for k in states[0]}


def close_to(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-5) -> float:
    assert list(saved) == list(expected)
    worst = max(float((saved[k] - expected[k]).abs().max()) for k in expected)
    assert worst <= atol, f"largest difference {worst:.3g} > {atol:g}"
    return worst


def apart(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def two_rank_runs(task_dir: Path) -> dict[str, Any]:
    """Every K = 1, d = 2 training, in one group of 2 ranks."""
    spec = task_spec(task_dir)

    def plan(name: str, sync: str, H: int | None = None) -> str:
        doc = data_parallel_plan(spec, [5], 2, 2, 4, schedule="gpipe", gradient_sync=sync)   # B = 2 x 2 x 4 = 16
        if H is not None:
            doc["sync_every"] = H
        return str(write_json(task_dir / f"{name}.json", doc))

    def job(name: str, plan_path: str, steps: int, optimizer: str = "sgd", **more: Any) -> dict[str, Any]:
        return {"plan": plan_path, "steps": steps, "lr": LR, "optimizer": optimizer,
                "save": str(task_dir / f"{name}.pt"), "quiet": True, **more}

    h2, h1, ddp = plan("h2", "localsgd", 2), plan("h1", "localsgd", 1), plan("ddp", "ddp")
    folder = str(task_dir / "ckpt")
    jobs = {
        "h2": job("h2", h2, 5, report=str(task_dir / "h2-report.json")),  # 5 steps: the last 1 not averaged
        "h1": job("h1", h1, 3),
        "ddp": job("ddp", ddp, 3),
        "adam": job("adam", h2, 5, "adam"),
        # 3 steps (the third not yet averaged: the replicas differ), then resumed to 5
        "adam-first": job("adam-first", h2, 3, "adam", checkpoint_dir=folder),
        "adam-resumed": job("adam-resumed", h2, 5, "adam", checkpoint_dir=folder, resume=True),
        "clip": job("clip", h2, 1, grad_clip=1.0),
    }
    outcome = run_in_one_group(list(jobs.values()), task_dir, world_size=2)
    return {"jobs": jobs, "outcome": outcome, "folder": Path(folder)}


def _ok(runs: dict[str, Any], *names: str) -> None:
    for name in names:
        assert runs["outcome"][runs["jobs"][name]["save"]] == "ok", (name, runs["outcome"])


@pytest.mark.slow
def test_two_replicas_reach_the_references_parameters_and_save_their_mean(two_rank_runs: dict[str, Any],
                                                                          task_dir: Path) -> None:
    """K = 1, d = 2, H = 2, SGD, 5 steps: --save holds the mean of the replicas' parameters, the
    reference's within 1e-5; after step 5 (not averaged) the replicas differ, so the mean is no
    replica's own, and a run that never averaged would be elsewhere."""
    _ok(two_rank_runs, "h2")
    ends = reference(task_dir, 2, 16, 5, 2)
    saved = torch.load(two_rank_runs["jobs"]["h2"]["save"])
    close_to(saved, mean_of(ends))
    assert apart(ends[0], ends[1]) > 1e-4      # the replicas really drifted since step 4
    assert apart(saved, mean_of(reference(task_dir, 2, 16, 5, 1000))) > 1e-4   # and averaging mattered
    report = json.loads(Path(two_rank_runs["jobs"]["h2"]["report"]).read_text())
    assert report["gradient_sync"] == "localsgd" and report["data_parallel"] == 2


@pytest.mark.slow
def test_h_1_with_sgd_is_ddp(two_rank_runs: dict[str, Any], task_dir: Path) -> None:
    _ok(two_rank_runs, "h1", "ddp")
    every_step = torch.load(two_rank_runs["jobs"]["h1"]["save"])
    close_to(every_step, torch.load(two_rank_runs["jobs"]["ddp"]["save"]))
    close_to(every_step, mean_of(reference(task_dir, 2, 16, 3, 1)))


@pytest.mark.slow
def test_a_resumed_run_ends_bit_equal_to_an_uninterrupted_one(two_rank_runs: dict[str, Any], task_dir: Path) -> None:
    """Adam, checkpointed after step 3, when the replicas hold their own weights and moments
    (replica 1 under ``replica-1/``), resumed to step 5: the same tensors as 5 steps at once."""
    _ok(two_rank_runs, "adam", "adam-first", "adam-resumed")
    full = torch.load(two_rank_runs["jobs"]["adam"]["save"])
    again = torch.load(two_rank_runs["jobs"]["adam-resumed"]["save"])
    assert list(full) == list(again) and all(torch.equal(full[k], again[k]) for k in full)
    close_to(full, mean_of(reference(task_dir, 2, 16, 5, 2, "adam")))
    from gpipe_plan.runtime.checkpoint import safe_reader

    keys = set(safe_reader(two_rank_runs["folder"] / "step-00000003").metadata().state_dict_metadata)
    assert {"model/0.weight", "replica-1/model/0.weight", "optim/0.weight/exp_avg",
            "replica-1/optim/0.weight/exp_avg"} <= keys


@pytest.mark.slow
def test_grad_clip_is_refused_under_localsgd(two_rank_runs: dict[str, Any]) -> None:
    assert two_rank_runs["outcome"][two_rank_runs["jobs"]["clip"]["save"]].startswith(
        "BadInput: --grad-clip clips by the global gradient norm, but under the plan's localsgd")


@pytest.mark.slow
def test_two_stages_of_two_replicas_reach_the_reference(task_dir: Path) -> None:
    """K = 2, d = 2 on 4 ranks, H = 3, SGD, 4 steps, both executors: each stage's replicas average
    on their own ``dp`` group; the saved model is the reference's mean within 1e-5."""
    spec = task_spec(task_dir)
    plan = write_json(task_dir / "k2.json", {**data_parallel_plan(spec, [3, 2], 2, 2, 4, schedule="1f1b",
                                                                   gradient_sync="localsgd", order="data-inner"),
                                             "sync_every": 3})
    jobs = [{"plan": str(plan), "steps": 4, "lr": LR, "optimizer": "sgd", "save": str(task_dir / f"k2-{executor}.pt"),
             "executor": executor, "quiet": True} for executor in ("native", "torch")]
    outcome = run_in_one_group(jobs, task_dir, world_size=4)
    expected = mean_of(reference(task_dir, 2, 16, 4, 3))
    for job in jobs:
        assert outcome[job["save"]] == "ok", outcome
        close_to(torch.load(job["save"]), expected)


def test_a_plan_with_localsgd_and_sync_every_passes_the_schema(tmp_path: Path) -> None:
    from gpipe_plan.runtime.plan import load_plan

    spec = model_spec("gpt", layers=2, width=16, heads=2, seq_len=8, vocab_size=256)
    doc = {**data_parallel_plan(spec, [4], 2, 1, 2, gradient_sync="localsgd"), "sync_every": 0}
    with pytest.raises(BadInput, match="sync_every"):
        load_plan(write_json(tmp_path / "bad.json", doc))
    assert load_plan(write_json(tmp_path / "ok.json", {**doc, "sync_every": 7})).sync_every == 7


def test_run_refuses_grad_clip_under_localsgd_in_one_line(tmp_path: Path) -> None:
    spec = model_spec("gpt", layers=2, width=16, heads=2, seq_len=8, vocab_size=256)
    plan = write_json(tmp_path / "p.json", {**data_parallel_plan(spec, [4], 2, 1, 2, gradient_sync="localsgd"),
                                            "sync_every": 2})
    result = cli("run", str(plan), "--steps", "1", "--grad-clip", "1.0")
    assert result.exit_code != 0 and "--grad-clip clips by the global gradient norm" in result.output, result.output
    assert "Traceback" not in result.output
