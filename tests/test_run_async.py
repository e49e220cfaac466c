"""PipeDream's asynchronous pipelines, run by real ranks, compute exactly what the rules say.

``pipedream`` and ``pipedream-2bw`` never flush inside a segment: a micro-batch's forward and
backward use the weights ``weight_versions.version_used`` gives (weight stashing), and the
stage updates its newest weights per micro-batch (pipedream) or once a step (2bw). The one-
process :func:`gpipe_plan.runtime.async_reference.reference_run` computes the same numbers with
no pipeline; a run must end at its parameters (1e-5). The model is a user's own (the skip net
of tests/user_models.py, whose cut after fc2 carries two tensors) with its own data and loss.

Each group of ranks costs seconds to start, so one group of two ranks runs every K = 2 (and
K = 1 x 2 replicas) case and the refusals, one group of three the K = 3 cases, and one group
of four (marked slow, as the project's other K = 4 runs) K = 4 and 2 stages x 2 replicas.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_plan.artifacts import write_json_atomic
from gpipe_plan.models import build_model, model_spec
from gpipe_plan.runtime.async_reference import reference_run
from gpipe_plan.runtime.data import batch_source
from gpipe_plan.runtime.options import RunOptions, async_problem
from handplan import hand_plan
from test_runtime_multiproc import assert_same_parameters, run_in_one_group
from user_models import SKIP_NET, SKIP_NET_INPUTS

# The skip net with its own data (a fixed teacher's classes) and loss, as --data and --loss name them.
TASK = SKIP_NET + """
    import torch.nn.functional as F

    def data(batch_size):
        teacher = torch.randn(8, 4)
        while True:
            x = torch.randn(batch_size, 8)
            yield x, (x @ teacher).argmax(dim=1)

    def loss(outputs, targets):
        return F.cross_entropy(outputs, targets, label_smoothing=0.1)
"""
STEPS, LR, M, MICRO = 5, 0.05, 4, 2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("async")
    (folder / "asynctask.py").write_text(textwrap.dedent(TASK))
    return folder


def task_spec(workdir: Path) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        return model_spec("asynctask:make", input_shape=[SKIP_NET_INPUTS], data="asynctask:data",
                          loss="asynctask:loss")


def async_plan(workdir: Path, name: str, schedule: str, balance: list[int], data_parallel: int = 1) -> str:
    """A hand-made 1f1b plan of ``balance`` with its schedule changed (the split is the same)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        plan = hand_plan(task_spec(workdir), balance, micro_batches=M, micro_batch_size=MICRO, schedule="1f1b")
    plan["schedule"] = schedule
    if data_parallel > 1:
        plan["data_parallel"] = data_parallel
        plan["global_batch_size"] *= data_parallel
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
              drain_every: int | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The parameters and losses ``reference_run`` gives for the run's stages, data and SGD.

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
    losses = reference_run(stages, model.loss, ordered, schedule, M, lambda ps: torch.optim.SGD(ps, lr=LR),
                           drain_every=drain_every)
    return model.module.state_dict(), losses


def report_losses(path: str) -> list[float]:
    per_step = json.loads(Path(path).read_text())["loss"]["per_step"]
    return [per_step[k] for k in sorted(per_step, key=int)]


def check_run(outcome: dict[str, str], job_: dict[str, Any], expected: tuple[dict[str, torch.Tensor], list[float]]):
    assert outcome[job_["save"]] == "ok", outcome[job_["save"]]
    assert_same_parameters(torch.load(job_["save"]), expected[0], atol=1e-5)
    assert report_losses(job_["report"]) == pytest.approx(expected[1], abs=1e-5)
