"""The user's data and loss (--data pkg.module:factory, --loss pkg.module:fn): a model of one's
own learns a real task from them, and two stages train it exactly as one."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe_plan.artifacts import BadInput, write_json_atomic
from gpipe_plan.models import build_model, model_spec
from gpipe_plan.models.hooks import DataStream
from handplan import hand_plan
from test_runtime_multiproc import assert_same_parameters, gpipe_plan, run_in_one_group

# A teacher the model must learn: 4 classes, the argmax of a fixed random linear map of x.
TASK = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    def make():
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def data(batch_size):
        teacher = torch.randn(8, 4)          # drawn on the stream's own generator: every rank agrees
        while True:
            x = torch.randn(batch_size, 8)
            yield x, (x @ teacher).argmax(dim=1)

    def smoothed_loss(outputs, targets):
        return F.cross_entropy(outputs, targets, label_smoothing=0.05)

    def vector_loss(outputs, targets):
        return F.cross_entropy(outputs, targets, reduction="none")

    def short_data(batch_size):
        return [(torch.randn(batch_size, 8), torch.zeros(batch_size, dtype=torch.long))] * 2
"""
STEPS, LR = 60, 1e-2


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hooks")
    (folder / "task.py").write_text(textwrap.dedent(TASK))
    return folder


@pytest.fixture
def spec(task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.chdir(task_dir)
    return model_spec("task:make", data="task:data", loss="task:smoothed_loss")


def unsplit(spec: dict[str, Any], batch: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference: the whole model on the factory's mini-batches, plain PyTorch."""
    from gpipe_plan.models.user import find_factory

    model = build_model(spec, seed=0)
    stream = DataStream(find_factory("task:data"), "task:data", batch, seed=0)
    optimizer = torch.optim.Adam(model.module.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        inputs, targets = stream.next()
        loss = model.loss(model.forward(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return model.module.state_dict(), losses


def test_the_stream_is_the_same_on_every_rank_and_leaves_torch_rng_alone(spec: dict[str, Any]) -> None:
    from gpipe_plan.models.user import find_factory

    factory = find_factory("task:data")
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = DataStream(factory, "task:data", 4, seed=7), DataStream(factory, "task:data", 4, seed=7)
    for _ in range(3):
        (xa,), ya = a.next()
        (xb,), yb = b.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(torch.get_rng_state(), before)
    (xc,), _ = DataStream(factory, "task:data", 4, seed=8).next()
    assert not torch.equal(xc, xa)


def test_two_stages_learn_the_task_exactly_like_the_unsplit_model(spec: dict[str, Any], task_dir: Path) -> None:
    plan = task_dir / "plan.json"
    write_json_atomic(plan, hand_plan(spec, [3, 2], micro_batches=4, micro_batch_size=8))
    job = {"plan": str(plan), "steps": STEPS, "lr": LR, "optimizer": "adam", "save": str(task_dir / "model.pt"),
           "report": str(task_dir / "report.json"), "quiet": True}
    outcome = run_in_one_group([job], task_dir)
    assert outcome[job["save"]] == "ok", outcome[job["save"]]
    reference, losses = unsplit(spec, batch=32)
    assert_same_parameters(torch.load(job["save"]), reference, atol=1e-5)
    report = json.loads((task_dir / "report.json").read_text())
    # It learns: from about chance, ln 4 = 1.39, to well below it.
    assert report["loss"]["first"] == pytest.approx(losses[0], abs=1e-5)
    assert report["loss"]["first"] > 1.0 and report["loss"]["last"] < 0.5 * math.log(4)


def test_bad_hooks_are_one_line_errors(task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(task_dir)
    with pytest.raises(BadInput, match="needs --data pkg.module:factory"):
        model_spec("task:make", input_shape=[8], loss="task:smoothed_loss")
    with pytest.raises(BadInput, match="--input-shape does not apply with --data"):
        model_spec("task:make", data="task:data", loss="task:smoothed_loss", input_shape=[8])
    with pytest.raises(BadInput, match="data factory 'task:nothing'|module 'task' has no 'nothing'"):
        model_spec("task:make", data="task:nothing", loss="task:smoothed_loss")
    model = build_model(model_spec("task:make", data="task:data", loss="task:vector_loss"))
    with pytest.raises(BadInput, match=r"loss 'task:vector_loss' returns \[2\]; it must return a scalar"):
        model.check(2)
    from gpipe_plan.models.user import find_factory

    stream = DataStream(find_factory("task:short_data"), "task:short_data", 4, seed=0)
    stream.next(), stream.next()
    with pytest.raises(BadInput, match="ran out after 2 mini-batches"):
        stream.next()


def test_profile_records_the_hooks_and_run_trains_on_them(task_dir: Path) -> None:
    profile = gpipe_plan("profile", "task:make", "--data", "task:data", "--loss", "task:smoothed_loss",
                         "--micro-batch-sizes", "2,4", "--warmup", "1", "--repeats", "2", "--contention-processes",
                         "0", "--no-recompute-timing", "-o", "hooks-profile.json", "-q", cwd=task_dir)
    assert profile.returncode == 0, profile.stderr
    doc = json.loads((task_dir / "hooks-profile.json").read_text())
    assert doc["model"]["data"] == "task:data" and doc["model"]["loss"] == "task:smoothed_loss"
    assert doc["input"]["shapes"] == [[8]]
    solve = gpipe_plan("solve", "hooks-profile.json", "--stages", "1", "--global-batch-size", "16", "-o",
                       "hooks-plan.json", cwd=task_dir)
    assert solve.returncode == 0, solve.stderr
    run = gpipe_plan("run", "hooks-plan.json", "--steps", "3", "--quiet", "--report", "hooks-report.json",
                     cwd=task_dir)
    assert run.returncode == 0, run.stderr
    report = json.loads((task_dir / "hooks-report.json").read_text())
    assert "data from 'task:data'" in json.dumps(report["run"])
