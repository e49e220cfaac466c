"""PipeDream's asynchronous pipelines, run by real ranks, compute exactly what the rules say.

``pipedream`` and ``pipedream-2bw`` never flush inside a segment: a micro-batch's forward and
backward use the weights ``weight_versions.version_used`` gives (weight stashing), and the
stage updates its newest weights per micro-batch (pipedream) or once a step (2bw). The one-
process :func:`gpipe_plan.runtime.async_reference.reference_run` computes the same numbers with
no pipeline; a run must end at its parameters (1e-5). The model is a user's own (the skip net
of tests/helpers/user_models.py, whose cut after fc2 carries two tensors) with its own data and loss.

Each group of ranks costs seconds to start, so one group of two ranks runs every K = 2 (and
K = 1 x 2 replicas) case and the refusals, one group of three the K = 3 cases, and one group
of four (marked slow, as the project's other K = 4 runs) K = 4 and 2 stages x 2 replicas.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_plan.artifacts import write_json_atomic
from gpipe_plan.models import build_model, model_spec
from gpipe_plan.runtime.async_reference import reference_run
from gpipe_plan.runtime.data import batch_source
from gpipe_plan.runtime.optim import learning_rate
from gpipe_plan.runtime.options import RunOptions, async_problem
from helpers.handplan import hand_plan
from helpers.cli_process import BIN
from helpers.ranks import assert_same_parameters, run_in_one_group
from helpers.ranks import data_parallel_plan
from helpers.user_models import SKIP_NET, SKIP_NET_INPUTS, TEACHER_DATA_AND_LOSS, spec_in, user_module_dir

# The skip net with its own data (a fixed teacher's classes) and loss, as --data and --loss name them.
TASK = SKIP_NET + TEACHER_DATA_AND_LOSS + """

    # An embedding tied to the output projection: split [1, 2], two stages hold it.
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(torch.tanh(self.mid(self.emb(x))))

    def make_tied():
        return Tied()
"""
STEPS, LR, M, MICRO = 5, 0.05, 4, 2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return user_module_dir(tmp_path_factory, "asynctask", TASK)


def task_spec(workdir: Path) -> dict[str, Any]:
    return spec_in(workdir, "asynctask:make", input_shape=[SKIP_NET_INPUTS], data="asynctask:data",
                   loss="asynctask:loss")


def async_plan(workdir: Path, name: str, schedule: str, balance: list[int], replicas: int = 1,
               spec: dict[str, Any] | None = None) -> str:
    """A hand-made 1f1b plan of ``balance`` (``replicas`` of it, ddp) with its schedule changed:
    no dependency on ``solve --schedule pipedream``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        spec = spec or task_spec(workdir)
        plan = data_parallel_plan(spec, balance, replicas, M, MICRO) if replicas > 1 else \
            hand_plan(spec, balance, micro_batches=M, micro_batch_size=MICRO, schedule="1f1b")
    plan["schedule"] = schedule
    path = workdir / f"{name}.json"
    write_json_atomic(path, plan)
    return str(path)


def job(workdir: Path, name: str, plan: str, **options: Any) -> dict[str, Any]:
    return {"plan": plan, "steps": STEPS, "lr": LR, "optimizer": "sgd", "data": "asynctask:data",
            "executor": "native", "save": str(workdir / f"{name}.pt"), "report": str(workdir / f"{name}-report.json"),
            "quiet": True, **options}


class _Layers(nn.Module):
    """A run of the model's layers as one stage module (each layer maps a tuple to a tuple)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *xs: torch.Tensor) -> Any:
        for layer in self.layers:
            xs = layer(*xs)
        return xs


def reference(workdir: Path, schedule: str, balance: list[int], steps: int = STEPS, replicas: int = 1,
              drain_every: int | None = None, options: RunOptions | None = None
              ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The parameters and losses ``reference_run`` gives for the run's stages, data and SGD
    (at each step the learning rate ``options`` give it, when given).

    With d replicas (ddp) each update's gradient is the mean over the replicas of their
    micro-batch's: the gradient of micro-batch m of every replica's rows at once, so the
    reference's micro-batch m is the union of the replicas' (their mean losses have equal weight).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        spec = task_spec(workdir)
        model = build_model(spec, seed=0)
        source = batch_source(model, "asynctask:data", M * MICRO * replicas, 0)
        batches = [source.batch(step) for step in range(steps)]
    layers = [layer for _, layer in model.layers]
    stages, first = [], 0
    for count in balance:
        stages.append(_Layers(layers[first:first + count]))
        first += count

    def interleave(t: torch.Tensor) -> torch.Tensor:   # replica r's micro-batch m -> the reference's m
        parts = [p.chunk(M) for p in t.chunk(replicas)]
        return torch.cat([parts[r][m] for m in range(M) for r in range(replicas)])

    ordered = [(tuple(interleave(x) for x in inputs), interleave(targets)) for inputs, targets in batches]
    lr_of_step = (lambda step: learning_rate(step, LR, options)) if options is not None else None
    losses = reference_run(stages, model.loss, ordered, schedule, M, lambda ps: torch.optim.SGD(ps, lr=LR),
                           lr_of_step=lr_of_step, drain_every=drain_every)
    return model.module.state_dict(), losses


def report_losses(path: str) -> list[float]:
    per_step = json.loads(Path(path).read_text())["loss"]["per_step"]
    return [per_step[k] for k in sorted(per_step, key=int)]


def check_run(outcome: dict[str, str], job_: dict[str, Any], expected: tuple[dict[str, torch.Tensor], list[float]]):
    assert outcome[job_["save"]] == "ok", outcome[job_["save"]]
    assert_same_parameters(torch.load(job_["save"]), expected[0], atol=1e-5)
    assert report_losses(job_["report"]) == pytest.approx(expected[1], abs=1e-5)


def sgd_per_micro_batch(workdir: Path, replicas: int) -> dict[str, torch.Tensor]:
    """Plain SGD on the unsplit model, one update per micro-batch of the mean loss over every
    replica's rows of it (what pipedream at K = 1 is: no stage, no staleness)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        model = build_model(task_spec(workdir), seed=0)
        source = batch_source(model, "asynctask:data", M * MICRO * replicas, 0)
        batches = [source.batch(step) for step in range(STEPS)]
    optimizer = torch.optim.SGD(model.module.parameters(), lr=LR)
    for inputs, targets in batches:
        for m in range(M):
            rows = torch.cat([torch.arange(r * M * MICRO + m * MICRO, r * M * MICRO + (m + 1) * MICRO)
                              for r in range(replicas)])
            model.loss(model.forward(*(x[rows] for x in inputs)), targets[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.module.state_dict()


# ---------------------------------------------------------------------- two ranks
REFUSED = {  # job options -> the start of the one line that refuses them
    "torch-executor": ({"executor": "torch"}, "--executor torch runs torch.distributed.pipelining"),
    "grad-clip": ({"grad_clip": 1.0}, "--grad-clip is not defined for pipedream"),
}


@pytest.fixture(scope="module")
def two_ranks(workdir: Path) -> dict[str, Any]:
    """Every two-rank case in one group: K = 2, K = 1 x 2 replicas, a resume, the refusals."""
    pd2 = async_plan(workdir, "pd2", "pipedream", [2, 2])
    uninterrupted, first = str(workdir / "every-2"), str(workdir / "stopped-at-4")
    jobs = {
        "pd2": job(workdir, "pd2", pd2),
        "k1x2": job(workdir, "k1x2", async_plan(workdir, "k1x2", "pipedream", [4], replicas=2)),
        # Drains after steps 2 and 4 (checkpoints) and 5 (the end); the run stopped at step 4 and
        # resumed drains at the same steps.
        "uninterrupted": job(workdir, "uninterrupted", pd2, checkpoint_dir=uninterrupted, checkpoint_every=2),
        "stopped": job(workdir, "stopped", pd2, steps=4, checkpoint_dir=first, checkpoint_every=2),
        "resumed": job(workdir, "resumed", pd2, checkpoint_dir=first, checkpoint_every=2, resume=True),
    }
    for name, (options, _) in REFUSED.items():
        jobs[name] = job(workdir, name, pd2, **options)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        tied = model_spec("asynctask:make_tied", input_shape=[4], vocab_size=16, loss="lm")
    jobs["tied"] = {**job(workdir, "tied", async_plan(workdir, "tied", "pipedream", [1, 2], spec=tied)), "data": None}
    return {"jobs": jobs, "outcome": run_in_one_group(list(jobs.values()), workdir, world_size=2)}


def test_pipedream_on_two_stages_computes_the_reference(workdir: Path, two_ranks: dict[str, Any]) -> None:
    run = two_ranks["jobs"]["pd2"]
    check_run(two_ranks["outcome"], run, reference(workdir, "pipedream", [2, 2]))
    # The report times the steps and every chunk's forwards and backwards, flush or not.
    report = json.loads(Path(run["report"]).read_text())
    assert report["schedule"] == "pipedream" and report["measured_step_s"] > 0
    assert len(report["measured_step_s_per_step"]) == STEPS
    for chunk in report["chunks"]:
        assert chunk["measured_forward_s"] > 0 and chunk["measured_backward_s"] > 0


def test_pipedream_on_one_stage_is_sgd_per_micro_batch_and_replicas_average_each_update(
        workdir: Path, two_ranks: dict[str, Any]) -> None:
    """K = 1: no version is ever stale, every micro-batch one SGD step; with 2 replicas (ddp)
    each update's gradient is averaged over them, so the step is of both replicas' rows."""
    run = two_ranks["jobs"]["k1x2"]
    assert two_ranks["outcome"][run["save"]] == "ok", two_ranks["outcome"][run["save"]]
    assert_same_parameters(torch.load(run["save"]), sgd_per_micro_batch(workdir, replicas=2), atol=1e-5)


def test_a_resumed_run_ends_bit_equal_to_an_uninterrupted_one(workdir: Path, two_ranks: dict[str, Any]) -> None:
    """A checkpoint comes after a drain: the newest weights and the optimizer state are all there
    is, so the run resumed at step 4 ends exactly where the run that never stopped does, and
    both where the reference draining every 2 steps does."""
    jobs, outcome = two_ranks["jobs"], two_ranks["outcome"]
    for name in ("uninterrupted", "stopped", "resumed"):
        assert outcome[jobs[name]["save"]] == "ok", (name, outcome[jobs[name]["save"]])
    assert json.loads(Path(jobs["resumed"]["report"]).read_text())["steps_run"] == 1
    resumed, whole = torch.load(jobs["resumed"]["save"]), torch.load(jobs["uninterrupted"]["save"])
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    expected = reference(workdir, "pipedream", [2, 2], drain_every=2)
    assert_same_parameters(whole, expected[0], atol=1e-5)
    assert report_losses(jobs["uninterrupted"]["report"]) == pytest.approx(expected[1], abs=1e-5)
    # A drain is not nothing: without it the run would have ended elsewhere.
    no_drain = reference(workdir, "pipedream", [2, 2])[0]
    assert max(float((no_drain[k] - whole[k]).abs().max()) for k in whole) > 1e-4


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_the_rules_do_not_define_is_refused_in_one_line(two_ranks: dict[str, Any], name: str) -> None:
    said = two_ranks["outcome"][two_ranks["jobs"][name]["save"]]
    assert said.startswith("BadInput: " + REFUSED[name][1]) and "\n" not in said, said


def test_weights_tied_across_stages_are_refused(two_ranks: dict[str, Any]) -> None:
    said = two_ranks["outcome"][two_ranks["jobs"]["tied"]["save"]]
    assert said.startswith("BadInput: pipedream does not define weights tied across stages") and "'emb.weight'" in said


@pytest.mark.parametrize("plan_change, precision, message", [
    ({"gradient_sync": "fsdp"}, "fp32", "--gradient-sync fsdp is not supported with pipedream-2bw"),
    ({"recompute": True}, "fp32", "recomputation is not supported with pipedream-2bw"),
    ({"gradient_sync": "localsgd"}, "fp32", "--gradient-sync localsgd is not defined with pipedream-2bw"),
    ({}, "fp16", "fp16 loss scaling is not defined for pipedream-2bw"),
    ({"schedule": "1f1b"}, "fp16", None),
])
def test_async_problem_names_each_unsupported_combination(plan_change: dict[str, Any], precision: str,
                                                          message: str | None) -> None:
    said = async_problem(RunOptions(plan="p.json"), plan_change.get("schedule", "pipedream-2bw"), precision,
                         plan_change.get("gradient_sync", "ddp"), plan_change.get("recompute", False))
    assert (said is None) if message is None else said.startswith(message)


def test_an_async_plan_on_cuda_is_refused_whatever_the_executor() -> None:
    """On CUDA ``auto`` would pick torch's executor, which is synchronous, and the native one is
    gloo's: the run is refused in one line rather than run as another schedule."""
    from gpipe_plan.artifacts import BadInput
    from gpipe_plan.runtime.train import _executor_name

    for requested in ("auto", "native"):
        with pytest.raises(BadInput, match="^pipedream runs on the native executor, which is CPU"):
            _executor_name(requested, torch.device("cuda"), "pipedream")
    assert _executor_name("auto", torch.device("cuda"), "1f1b") == "torch"


def test_the_command_refuses_the_torch_executor_before_starting_ranks(workdir: Path) -> None:
    plan = async_plan(workdir, "cli", "pipedream-2bw", [2, 2])
    result = subprocess.run([str(BIN / "gpipe-plan"), "run", plan, "--executor", "torch", "--steps", "1"],
                            capture_output=True, text=True, timeout=120, cwd=workdir)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--executor torch runs torch.distributed.pipelining" in lines[0], result.stderr


# ---------------------------------------------------------------------- three and four ranks
def test_three_stages_compute_the_reference_under_both_schedules(workdir: Path) -> None:
    """Under a learning-rate schedule (warm-up, then cosine): every update of step s, the M of
    pipedream's as 2bw's one, is at step s's rate, though a stage's step also runs forwards of the next."""
    schedule_lr = {"lr_schedule": "cosine", "warmup_steps": 2}
    jobs = {s: job(workdir, f"{s}-k3", async_plan(workdir, f"{s}-k3", s, [2, 1, 1]), **schedule_lr)
            for s in ("pipedream", "pipedream-2bw")}
    outcome = run_in_one_group(list(jobs.values()), workdir, world_size=3)
    options = RunOptions(plan="p.json", steps=STEPS, **schedule_lr)
    expected = {s: reference(workdir, s, [2, 1, 1], options=options) for s in jobs}
    for schedule, run in jobs.items():
        check_run(outcome, run, expected[schedule])
    # The two rules lead to other weights, and pipedream's staleness to others than plain SGD's:
    # a run that ignored the versions would miss by far more than the tolerance.
    plain = sgd_per_micro_batch(workdir, replicas=1)
    constant_lr = reference(workdir, "pipedream", [2, 1, 1])[0]
    for other in (expected["pipedream-2bw"][0], plain, constant_lr):
        assert max(float((expected["pipedream"][0][k] - other[k]).abs().max()) for k in plain) > 1e-4


@pytest.mark.slow
def test_four_ranks_compute_the_reference(workdir: Path) -> None:
    """K = 4 (one layer per stage), and 2 stages x 2 replicas (ddp) under both schedules."""
    jobs = {"pd4": job(workdir, "pd4", async_plan(workdir, "pd4", "pipedream", [1, 1, 1, 1]))}
    for s in ("pipedream", "pipedream-2bw"):
        jobs[f"{s}-x2"] = job(workdir, f"{s}-x2", async_plan(workdir, f"{s}-x2", s, [2, 2], replicas=2))
    outcome = run_in_one_group(list(jobs.values()), workdir, world_size=4)
    check_run(outcome, jobs["pd4"], reference(workdir, "pipedream", [1, 1, 1, 1]))
    for s in ("pipedream", "pipedream-2bw"):
        check_run(outcome, jobs[f"{s}-x2"], reference(workdir, s, [2, 2], replicas=2))


@pytest.mark.parametrize("schedule, K, M", [("pipedream", 4, 4), ("pipedream", 3, 1), ("pipedream", 1, 2),
                                            ("pipedream-2bw", 4, 4), ("pipedream-2bw", 3, 8), ("pipedream-2bw", 1, 2)])
def test_the_stash_meets_the_rules_and_holds_what_the_plan_charges(schedule: str, K: int, M: int) -> None:
    """The executor's stash bookkeeping replayed on one number per version (its update count):
    every forward and backward meets weight_versions.version_used's version, and the copies
    alive at once (live, stashed, in flight) peak at weight_copies, what the planner charges."""
    from gpipe_plan.runtime.async_executor import AsyncExecutor, _Segment
    from gpipe_plan.schedules import segment_actions
    from gpipe_plan.weight_versions import updates_per_step, version_used, weight_copies

    for k in range(K):
        executor = AsyncExecutor.__new__(AsyncExecutor)   # no chunk, no links: the bookkeeping alone
        executor.schedule, executor.stage, executor.stages, executor.micro_batches = schedule, k, K, M
        executor.update_every_micro_batch = updates_per_step(schedule, M) == M
        live = torch.nn.Parameter(torch.zeros(1))
        executor.live = [live]
        executor.apply_update = lambda: live.data.add_(1)
        steps = max(4, -(-3 * K // M))   # long enough for the steady state (past the warm-up's shared versions)
        actions = segment_actions(k, K, M, steps)
        segment = _Segment(0, steps, actions, executor._updates_at_backward(actions), {})
        peak = 0
        for a in actions:
            if a.kind == "F":
                weights = executor._weights_for(segment, a.micro_batch)
                segment.in_flight[a.micro_batch] = weights
                segment.forwards_done += 1
            else:
                weights = segment.in_flight.pop(a.micro_batch)
            assert float(weights[0]) == version_used(schedule, k, K, M, a.micro_batch), (k, str(a))
            if a.kind == "B" and executor._updates_after(a.micro_batch):
                executor._update(segment)
            held = ({id(live)} | {id(w[0]) for w in segment.versions.values()}
                    | {id(w[0]) for w in segment.in_flight.values()})
            peak = max(peak, len(held))
        assert peak == weight_copies(schedule, k, K), (k, peak)
