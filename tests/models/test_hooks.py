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
from helpers.handplan import hand_plan
from helpers.cli_process import gpipe_plan
from helpers.ranks import assert_same_parameters, run_in_one_group

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

    # A language model on the user's own token stream: (ids, next ids), as --loss lm trains on.
    def make_lm():
        return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 64))

    def lm_data(batch_size):
        while True:
            stream = torch.randint(0, 60, (batch_size, 9))
            yield stream[:, :-1], stream[:, 1:]

    def make_byte_lm():
        return nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))

    def float_targets(batch_size):
        while True:
            yield torch.randn(batch_size, 8), torch.randn(batch_size, 4)
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
    with pytest.raises(BadInput, match="--num-classes says what --loss classify scores"):
        model_spec("task:make", data="task:data", loss="task:smoothed_loss", num_classes=4)
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


@pytest.mark.parametrize("model, data, loss, shapes", [("task:make", "task:data", "task:smoothed_loss", [[8]]),
                                                     ("task:make_lm", "task:lm_data", "lm", [[8]])])
def test_profile_records_the_hooks_and_run_trains_on_them(task_dir: Path, model: str, data: str, loss: str,
                                                          shapes: list[list[int]]) -> None:
    profile = gpipe_plan("profile", model, "--data", data, "--loss", loss,
                         "--micro-batch-sizes", "2,4", "--warmup", "1", "--repeats", "2", "--contention-processes",
                         "0", "--no-recompute-timing", "--no-fixed-costs", "-o", "hooks-profile.json", "-q",
                         cwd=task_dir)
    assert profile.returncode == 0, profile.stderr
    doc = json.loads((task_dir / "hooks-profile.json").read_text())
    assert doc["model"]["data"] == data and doc["model"]["loss"] == loss
    assert doc["input"]["shapes"] == shapes
    solve = gpipe_plan("solve", "hooks-profile.json", "--stages", "1", "--global-batch-size", "16", "-o",
                       "hooks-plan.json", cwd=task_dir)
    assert solve.returncode == 0, solve.stderr
    run = gpipe_plan("run", "hooks-plan.json", "--steps", "3", "--quiet", "--report", "hooks-report.json",
                     cwd=task_dir)
    assert run.returncode == 0, run.stderr
    report = json.loads((task_dir / "hooks-report.json").read_text())
    assert f"data from '{data}'" in json.dumps(report["run"])


def test_a_factory_of_ids_and_next_ids_trains_with_the_built_in_lm_loss(task_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """--data with --loss lm (and --loss classify, the default): the built-in cross-entropy on the
    factory's own batches, the shapes checked on the first one."""
    monkeypatch.chdir(task_dir)
    model = build_model(model_spec("task:make_lm", data="task:lm_data", loss="lm"))
    model.check(2)
    assert model.input_shapes == [[8]] and model.loss_fn is None
    (ids,), targets = model.synthetic_batch(3, torch.Generator().manual_seed(0))
    logits = model.forward(ids)[0]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
    assert torch.equal(model.loss((logits,), targets), expected)
    build_model(model_spec("task:make", data="task:data")).check(2)      # classify: class ids of shape [batch]
    # Batches that do not have the loss's shapes: one line saying what the loss needs.
    with pytest.raises(BadInput, match=r"--loss lm trains on \(ids, next ids\).*inputs \[2, 8\] float32, targets "
                                       r"\[2\] int64"):
        build_model(model_spec("task:make", data="task:data", loss="lm"))
    with pytest.raises(BadInput, match=r"--loss classify \(the default\) trains on class ids.*targets \[2, 4\] "
                                       r"float32"):
        build_model(model_spec("task:make", data="task:float_targets"))
    # A vocabulary the logits do not have.
    with pytest.raises(BadInput, match=r"--loss lm needs logits \[seq, vocab\] = \[8, 80\]"):
        build_model(model_spec("task:make_lm", data="task:lm_data", loss="lm", vocab_size=80)).check(2)


@pytest.mark.parametrize("flags", [dict(input_shape="8"), dict(input_dtype="float32"), dict(num_classes=4),
                                   dict(input_shape=[8], input_dtype="float32", num_classes=4)])
def test_flags_that_agree_with_the_factorys_batches_are_accepted_and_kept(task_dir: Path, flags: dict[str, Any],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(task_dir)
    spec = model_spec("task:make", data="task:data", **flags)
    assert {k: spec[k] for k in flags} == {k: ([8] if k == "input_shape" else v) for k, v in flags.items()}
    build_model(spec).check(2)


@pytest.mark.parametrize("model, data, loss, flags, message", [
    ("task:make", "task:data", "classify", dict(input_shape="3,8"),
     r"^--input-shape 3,8 contradicts data factory 'task:data', whose samples are \[8\]"),
    ("task:make", "task:data", "classify", dict(input_dtype="float64"),
     r"^--input-dtype float64 contradicts data factory 'task:data', whose inputs are float32"),
    ("task:make", "task:data", "classify", dict(num_classes=2), r"^--num-classes 2 contradicts data factory"),
    ("task:make", "task:data", "classify", dict(vocab_size=10), r"^--vocab-size 10 is the range of integer inputs"),
    ("task:make_lm", "task:lm_data", "lm", dict(vocab_size=40), r"^--vocab-size 40 contradicts data factory "
                                                                r"'task:lm_data': its inputs hold id \d+$"),
])
def test_flags_that_contradict_the_factorys_batches_are_one_line(task_dir: Path, model: str, data: str, loss: str,
                                                                 flags: dict[str, Any], message: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(task_dir)
    with pytest.raises(BadInput, match=message) as refused:
        build_model(model_spec(model, data=data, loss=loss, **flags)).check(2)
    assert "\n" not in str(refused.value)


def test_a_language_model_on_its_own_factory_can_train_on_text(task_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """run --data FILE.txt reads bytes: it needs the vocabulary, which --vocab-size declared."""
    from gpipe_plan.runtime.data import TextBatches, batch_source

    monkeypatch.chdir(task_dir)
    text = task_dir / "text.txt"
    text.write_text("a small text to read byte by byte " * 4)
    unsized = build_model(model_spec("task:make_lm", data="task:lm_data", loss="lm"))
    with pytest.raises(BadInput, match="profiled on its data factory without --vocab-size"):
        batch_source(unsized, str(text), 4, seed=0)
    small = build_model(model_spec("task:make_lm", data="task:lm_data", loss="lm", vocab_size=64))
    with pytest.raises(BadInput, match="has a vocabulary of 64"):
        batch_source(small, str(text), 4, seed=0)
    byte_level = build_model(model_spec("task:make_byte_lm", data="task:lm_data", loss="lm", vocab_size=256))
    source = batch_source(byte_level, str(text), 4, seed=0)
    assert isinstance(source, TextBatches) and source.seq_len == 8
    (ids,), targets = source.batch(0)
    assert ids.shape == targets.shape == (4, 8) and torch.equal(ids[:, 1:], targets[:, :-1])
