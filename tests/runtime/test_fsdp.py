"""FSDP2 gradient sync (runtime/fsdp.py): d = 2 replicas of one stage train like one unsharded process.

Two gloo processes each hold the same stage (the built-in gpt cut into two chunks, both on
stage 0, as ``zb-v`` and ``interleaved`` place them with K = 1), sharded over the two
replicas. Each replica runs M = 2 micro-batches of its half of every batch, by hand with
backwards whole or split in an input and a weight half, and with each executor (native and
torch's runtime; with recomputation), then ``finish()`` and one Adam step on the shards. The
reference is one process training the unsplit model on the whole batch: same parameters,
same squared gradient norm (the two ranks' shares summed), same saved state.

At the end, ``gpipe-plan run``'s own training (4 gloo ranks: K = 2 stages x d = 2 replicas)
with ``gradient_sync: "fsdp"``: the unsplit model's parameters, its memory report against
ddp's, and a weight tied across stages (GPT-2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gpipe_plan.artifacts import BadInput, write_json_atomic
from gpipe_plan.models import build_model, model_spec
from gpipe_plan.runtime.data import step_generator
from helpers.handplan import hand_plan
from gpipe_plan.runtime.loss_scale import LossScaler
from gpipe_plan.runtime.plan import load_plan
from gpipe_plan.runtime.stage import StageChunks, build_stage_chunks
from helpers.rank_pool import run_on_ranks
from helpers.ranks import GPT, LR, assert_same_parameters, run_in_one_group, unsplit_training

REPLICAS = 2
MICRO_BATCHES = 2
GLOBAL_BATCH = 8          # 4 samples per replica, 2 per micro-batch
STEPS = 2                 # the second step starts from after_optimizer's early gather
STYLES = ("whole", "split")
# The runtime's own executors on the same stage: (executor, schedule, recompute); zb-v splits
# every backward into I and W, interleaved runs them whole; recompute reruns each chunk's forward
# inside its backward (on the parameters still gathered).
EXECUTORS = (("native", "zb-v", False), ("native", "interleaved", False), ("native", "interleaved", True),
             ("torch", "zb-v", False), ("torch", "interleaved", False))


def run_name(executor: str, schedule: str, recompute: bool) -> str:
    return f"{executor}-{schedule}" + ("-recompute" if recompute else "")


def plan_file(folder: Path, schedule: str = "zb-v", recompute: bool = False) -> Path:
    return folder / f"one-stage-{schedule}{'-recompute' if recompute else ''}.json"


def one_stage_plan(folder: Path, schedule: str = "zb-v", recompute: bool = False) -> Path:
    """The gpt's 4 layers in two chunks on one stage (zb-v or interleaved with K = 1)."""
    path = plan_file(folder, schedule, recompute)
    write_json_atomic(path, hand_plan(GPT, [2, 2], micro_batches=MICRO_BATCHES, schedule=schedule, recompute=recompute,
                                      micro_batch_size=GLOBAL_BATCH // (REPLICAS * MICRO_BATCHES)))
    return path


def build_stage(plan_path: Path) -> tuple[StageChunks, Any]:
    """The stage's chunks, from the seed (every replica's alike), and the model's loss."""
    plan = load_plan(plan_path)
    model = build_model(plan.model, seed=0, materialize=())
    return build_stage_chunks(model, plan, 0), model.loss


def run_micro_batch(stage: StageChunks, loss_fn: Any, ids: torch.Tensor, targets: torch.Tensor, style: str) -> bool:
    """Forward and backward of one micro-batch through the stage's two chunks, as the executor
    runs them: chunk 1 (the last) backward whole, or split in input and weight halves with torch's
    own functions; chunk 0 backward whole (its split runs the whole backward at W).

    Returns whether chunk 0's parameters were still whole (gathered) after its forward: they
    stay so for every micro-batch of the step (one all-gather per step).
    """
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.distributed.tensor import DTensor

    first, last = stage.chunks
    hidden = first.module(ids)
    gathered = not any(isinstance(p, DTensor) for p in first.module.parameters())
    received = tuple(h.detach().requires_grad_() for h in hidden)   # as if it had travelled
    loss = loss_fn(last.module(*received), targets) / MICRO_BATCHES
    if style == "whole":
        torch.autograd.backward([loss], [torch.ones_like(loss)])
        input_grads = [h.grad for h in received]
    else:
        input_grads, param_groups = stage_backward_input([loss], [torch.ones_like(loss)], list(received),
                                                         last.module.parameters())
        stage_backward_weight(last.module.parameters(), param_groups)
    torch.autograd.backward(list(hidden), list(input_grads))
    return gathered


def make_executor(name: str, stage: StageChunks, plan_path: Path, loss_fn: Any, pipeline_group: Any) -> Any:
    """The runtime's executor ``name`` for the stage (K = 1: both chunks here, no messages)."""
    from gpipe_plan.runtime.executor import NativeExecutor
    from gpipe_plan.runtime.p2p import Neighbours
    from gpipe_plan.runtime.timing import SpanRecorder
    from gpipe_plan.runtime.torch_executor import TorchExecutor

    plan, device = load_plan(plan_path), torch.device("cpu")
    recorder = SpanRecorder(0, device)
    if name == "native":
        links = Neighbours(dist.get_rank(), dist.get_world_size(), device, 60.0, stage_ranks=[dist.get_rank()])
        return NativeExecutor(stage.chunks, plan.actions(), 0, MICRO_BATCHES, loss_fn, links, recorder)
    return TorchExecutor(stage.chunks, plan.actions(), 0, MICRO_BATCHES, loss_fn, device, recorder,
                         group=pipeline_group, group_ranks=[0])


def train_replica(sync: Any, stage: StageChunks, rank: int, run_step: Any) -> dict[str, Any]:
    """STEPS steps of one replica on its half of each batch: ``run_step(ids, targets)`` runs the
    M micro-batches' forwards and backwards; then the sync and one Adam step on the shards."""
    from torch.distributed.tensor import DTensor

    optimizer = torch.optim.Adam(stage.parameters(), lr=LR)
    shards = list(optimizer.param_groups[0]["params"])
    shares, reduced_early, sharded_after_finish = [], False, True
    for step in range(STEPS):
        (ids,), targets = build_model(GPT, seed=0).synthetic_batch(GLOBAL_BATCH, step_generator(0, step))
        mine = slice(rank * GLOBAL_BATCH // REPLICAS, (rank + 1) * GLOBAL_BATCH // REPLICAS)
        run_step(ids[mine], targets[mine])
        reduced_early |= any(p.grad is not None for p in shards)   # a reduction inside a backward
        sync.finish()
        sharded_after_finish &= all(isinstance(p, DTensor) for p in stage.parameters())
        # fp16's unscaling works on the shards' gradients: x2 then /2 (exact: powers of two).
        for scale in (0.5, 2.0):
            LossScaler(enabled=True).unscale_(stage.parameters(), scale)
        shares.append(sync.squared_norm_share(stage.parameters()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync.after_optimizer()
    from gpipe_plan.runtime.memory import local_bytes, static_bytes
    from gpipe_plan.tensor_memory import element_bytes

    whole_bytes, shard_bytes = sum(element_bytes(p) for p in shards), sum(local_bytes(p) for p in shards)
    held = shard_bytes / whole_bytes
    counted = static_bytes(stage.module, optimizer, sharded=True)
    # The planner's terms: P whole during the step + the P/d shard, gradients P, Adam's 2 moments of the shard.
    assert counted["params_bytes"] == whole_bytes + shard_bytes
    assert counted["gradients_bytes"] == whole_bytes
    assert counted["optimizer_state_bytes"] == 2 * shard_bytes
    state = {k: v.detach().clone() for k, v in sync.full_state_dict(stage).items()}
    return {"shares": shares, "state": state, "reduced_early": reduced_early, "held_fraction": held,
            "sharded_after_finish": sharded_after_finish}


def _replica_main(rank: int, world_size: int, folder: str) -> None:
    """One replica, a rank of the session's group of REPLICAS (tests/helpers/rank_pool.py): shard the
    stage, train on its half of each batch, save what it saw."""
    from torch.distributed.device_mesh import init_device_mesh

    from gpipe_plan.runtime.fsdp import FsdpSync

    assert world_size == REPLICAS
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (REPLICAS,), mesh_dim_names=("dp",))
    # Each replica's pipeline is this rank alone (K = 1); every rank creates every group.
    pipeline_group = [dist.new_group([r]) for r in range(REPLICAS)][rank]
    results: dict[str, Any] = {}
    for style in STYLES:
        stage, loss_fn = build_stage(Path(folder) / "one-stage-zb-v.json")
        sync = FsdpSync(REPLICAS, mesh)
        sync.prepare(stage)

        gathered: list[bool] = []

        def by_hand(ids: torch.Tensor, targets: torch.Tensor) -> None:
            for micro_ids, micro_targets in zip(ids.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES)):
                gathered.append(run_micro_batch(stage, loss_fn, micro_ids, micro_targets, style))
        results[style] = train_replica(sync, stage, rank, by_hand) | {"gathered_after_forward": gathered}
    for name, schedule, recompute in EXECUTORS:
        plan_path = plan_file(Path(folder), schedule, recompute)
        stage, loss_fn = build_stage(plan_path)
        sync = FsdpSync(REPLICAS, mesh)
        sync.prepare(stage)
        executor = make_executor(name, stage, plan_path, loss_fn, pipeline_group)
        results[run_name(name, schedule, recompute)] = train_replica(
            sync, stage, rank, lambda ids, targets: executor.step((ids,), targets))
    torch.save(results, Path(folder) / f"replica{rank}.pt")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("fsdp")
    for _, schedule, recompute in (("", "zb-v", False), *EXECUTORS):
        one_stage_plan(folder, schedule, recompute)
    run_on_ranks(_replica_main, (str(folder),), REPLICAS)
    return [torch.load(folder / f"replica{r}.pt") for r in range(REPLICAS)]


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference: the whole model, whole batches, one process; its state and squared grad norms."""
    norms: list[float] = []
    return unsplit_training(GPT, global_batch=GLOBAL_BATCH, steps=STEPS, norms=norms), norms


RUNS = (*STYLES, *(run_name(*run) for run in EXECUTORS))


@pytest.mark.parametrize("style", RUNS)
def test_sharded_replicas_train_like_one_unsharded_process(replicas: list[dict[str, Any]],
                                                          reference: tuple[dict[str, torch.Tensor], list[float]],
                                                          style: str) -> None:
    whole, _ = reference
    for replica in replicas:
        state = replica[style]["state"]
        assert sorted(state) == sorted(whole)
        worst = max(float((state[k].float() - whole[k].float()).abs().max()) for k in whole)
        assert worst <= 1e-5, f"largest difference {worst:.3g}"
    # Training moved the parameters (the comparison is not of initial values).
    initial = build_model(GPT, seed=0).module.state_dict()
    assert max(float((whole[k] - initial[k]).abs().max()) for k in whole) > 1e-4


@pytest.mark.parametrize("style", RUNS)
def test_squared_norm_shares_sum_to_the_unsharded_norm(replicas: list[dict[str, Any]],
                                                       reference: tuple[dict[str, torch.Tensor], list[float]],
                                                       style: str) -> None:
    _, norms = reference
    summed = [sum(shares) for shares in zip(*(replica[style]["shares"] for replica in replicas))]
    assert summed == pytest.approx(norms, rel=1e-5)
    # Each rank holds a real part of it, not the whole (that would double it).
    assert all(0 < replica[style]["shares"][0] < norms[0] for replica in replicas)


@pytest.mark.parametrize("style", RUNS)
def test_gradients_are_reduced_once_a_step_and_each_rank_holds_half(replicas: list[dict[str, Any]], style: str) -> None:
    for replica in replicas:
        # No shard had a gradient before finish(): no backward reduced (they only accumulate).
        # torch's runtime reduces by itself, in its REDUCE_GRAD action after the stage's last
        # backward (what finish() does; finish() then finds nothing left to reduce).
        assert replica[style]["reduced_early"] == style.startswith("torch")
        # Between steps a rank holds its 1/d of the parameters (rows split unevenly: about half).
        assert 0.3 < replica[style]["held_fraction"] < 0.7
        assert replica[style]["sharded_after_finish"]
        if style in STYLES:  # driven by hand: looked at after each forward
            # Gathered once a step: still whole after every micro-batch's forward.
            assert replica[style]["gathered_after_forward"] == [True] * (STEPS * MICRO_BATCHES)


Reference = tuple[dict[str, torch.Tensor], list[float]]


def test_full_state_dict_is_whole_tensors_on_every_replica(replicas: list[dict[str, Any]],
                                                           reference: Reference) -> None:
    whole, _ = reference
    for replica in replicas:
        state = replica["whole"]["state"]
        assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in whole.items()}
        assert all(type(v) is torch.Tensor for v in state.values())


def test_parameters_shared_by_two_chunks_of_a_stage_are_refused(tmp_path: Path) -> None:
    from gpipe_plan.runtime.fsdp import FsdpSync

    stage, _ = build_stage(one_stage_plan(tmp_path))
    first, last = stage.chunks
    # Tie the head's weight to a parameter of chunk 0 of the same shape (as GPT-2 ties its embedding).
    head = last.module.layers[-1]
    name, param = next((n, p) for n, p in head.named_parameters() if p.dim() == 2)
    donor = next(p for p in first.module.parameters() if p.shape == param.shape)
    setattr(head.get_submodule(name.rpartition(".")[0]) if "." in name else head, name.rpartition(".")[2], donor)
    with pytest.raises(BadInput, match="share it"):
        FsdpSync(REPLICAS, mesh=None).prepare(stage)


# ---------------------------------------------------------------------- end to end: gpipe-plan run
E2E_CASES = [  # schedule, executor, order, grad_clip, gradient_sync
    ("1f1b", "native", "pipeline-inner", 0.05, "fsdp"),
    ("zb-h1", "torch", "data-inner", None, "fsdp"),
    ("1f1b", "native", "pipeline-inner", 0.05, "ddp"),   # the first's ddp twin: memory compared
]
E2E_STEPS = 3


def tied_gpt2() -> dict[str, Any]:
    """GPT-2 (transformers), whose embedding is tied to its output projection."""
    from hf_models import SEQ, VOCAB

    return model_spec("hf_models:make_gpt2", input_shape=[SEQ], vocab_size=VOCAB, loss="lm")


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """K = 2 stages x d = 2 replicas with gradient_sync fsdp, 4 gloo ranks in one group."""
    from helpers.ranks import data_parallel_plan

    folder = tmp_path_factory.mktemp("fsdp-run")
    jobs = []
    for i, (schedule, executor, order, clip, mode) in enumerate(E2E_CASES):
        path = folder / f"plan-{i}.json"
        write_json_atomic(path, data_parallel_plan(GPT, [2, 2], 2, 2, 2, schedule=schedule, order=order,
                                                   gradient_sync=mode))
        jobs.append({"plan": str(path), "steps": E2E_STEPS, "lr": LR, "optimizer": "adam", "executor": executor,
                     "grad_clip": clip, "save": str(folder / f"model-{i}.pt"),
                     "report": str(folder / f"report-{i}.json"), "quiet": True})
    # GPT-2 (when transformers is there): cut in two, the tied embedding has a copy on each
    # stage, sharded on each; whole on one stage (K = 1, d = 4), both uses are in one chunk.
    tied: list[dict[str, Any]] = []
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        layers = len(build_model(tied_gpt2(), seed=0).layers)
        halves = [layers // 2, layers - layers // 2]
        for name, balance, replicas, micro_batch_size in (("tied-two-stages", halves, 2, 2),
                                                          ("tied-one-stage", [layers], 4, 1)):
            path = folder / f"{name}.json"
            write_json_atomic(path, data_parallel_plan(tied_gpt2(), balance, replicas, 2, micro_batch_size,
                                                       gradient_sync="fsdp"))
            tied.append({"plan": str(path), "steps": E2E_STEPS, "lr": LR, "optimizer": "adam",
                         "executor": "native", "grad_clip": 0.05, "save": str(folder / f"{name}.pt"), "quiet": True})
    outcome = run_in_one_group(jobs + tied, folder, world_size=4)
    return {"jobs": jobs, "tied": tied, "outcome": outcome}


@pytest.mark.slow
def test_fsdp_replicas_of_a_pipeline_train_like_the_unsplit_model(fsdp_runs: dict[str, Any]) -> None:
    """Both executors and placements, with clipping by the global norm (the shards' norm shares)."""
    for job, (schedule, executor, order, clip, mode) in zip(fsdp_runs["jobs"], E2E_CASES):
        assert fsdp_runs["outcome"][job["save"]] == "ok", (schedule, executor, order, fsdp_runs["outcome"])
        reference = unsplit_training(GPT, global_batch=8, steps=E2E_STEPS, grad_clip=clip)
        assert_same_parameters(torch.load(job["save"]), reference, atol=1e-5)


@pytest.mark.slow
def test_fsdp_memory_report_counts_shards_and_the_gathered_parameters(fsdp_runs: dict[str, Any]) -> None:
    """Per rank, against the same plan under ddp: the same activations (the gathered parameters
    are not activations), parameters P whole during the step plus the P/d shard, gradients P,
    optimizer state for the shard only (the planner's memory model, docs/planner.md)."""
    fsdp, ddp = (json.loads(Path(fsdp_runs["jobs"][i]["report"]).read_text()) for i in (0, 2))
    for sharded, whole in zip(fsdp["stages"], ddp["stages"]):
        got, ref = sharded["measured_memory"], whole["measured_memory"]
        assert got["activations_bytes"] == ref["activations_bytes"]
        assert got["gradients_bytes"] == ref["gradients_bytes"]
        assert got["params_bytes"] == pytest.approx(1.5 * ref["params_bytes"], rel=0.02)
        assert got["optimizer_state_bytes"] == pytest.approx(ref["optimizer_state_bytes"] / REPLICAS, rel=0.05)


@pytest.mark.slow
def test_fsdp_shards_tied_weights(fsdp_runs: dict[str, Any]) -> None:
    """Across two stages, each stage's copy of GPT-2's tied embedding is sharded alike over the
    replicas: the shard gradients summed across the stages give the unsplit model's, and the
    copies stay equal. On one stage, the one parameter both layers use is sharded once."""
    if not fsdp_runs["tied"]:
        pytest.skip("needs transformers")
    reference = unsplit_training(tied_gpt2(), global_batch=8, steps=E2E_STEPS, grad_clip=0.05)
    for job in fsdp_runs["tied"]:
        assert fsdp_runs["outcome"][job["save"]] == "ok", (job["plan"], fsdp_runs["outcome"][job["save"]])
        saved = torch.load(job["save"])
        assert_same_parameters(saved, reference, atol=1e-5)
        assert torch.equal(saved["transformer.wte.weight"], saved["lm_head.weight"])
