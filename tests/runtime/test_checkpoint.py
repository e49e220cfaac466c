"""Checkpoints keyed like the unsplit model: resume under another plan, and ``--init-from``.

The runs go through the command line, as a user's would. One module-scoped fixture trains the
uninterrupted references (which also leave the checkpoints to resume from); each test then
resumes a copy of a checkpoint folder under another plan and compares the final parameters
(``--save``) with the uninterrupted run of *that* plan. A resumed run that restarted from
scratch would show in its report (it ran all N steps); one that lost Adam's state would land
about 1e-3 away (``test_the_comparison_sees_a_lost_optimizer_state``), far outside 1e-5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.cli_process import gpipe_plan
from gpipe_plan.artifacts import BadInput, write_json_atomic
from gpipe_plan.models import build_model, model_spec
from gpipe_plan.runtime import checkpoint, init_from
from gpipe_plan.runtime.data import step_generator
from helpers.handplan import hand_plan
from gpipe_plan.runtime.options import RunOptions, check_options
from gpipe_plan.runtime.plan import load_plan
from gpipe_plan.runtime.stage import build_chunk

GPT = model_spec("gpt", layers=2, width=16, heads=2, seq_len=8, vocab_size=256)   # 4 layers
SAVED_AT, STEPS = 3, 6   # checkpoints of step 3 are resumed up to step 6
LR = 1e-3                # adam's default, which the runs use
ATOL = 1e-5
PLANS = {  # name: (balance, micro-batches, micro-batch size); the global batch is 4 in each
    "a": ([2, 2], 2, 2),
    "b": ([1, 3], 4, 1),
    "one": ([4], 1, 4),
}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), "keys or their order differ"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def resumable_copy(source: Path, target: Path, step: int = SAVED_AT) -> Path:
    """A copy of ``source``'s checkpoints whose newest complete step is ``step``."""
    shutil.copytree(source, target)
    for child in target.iterdir():
        if child.name != checkpoint.step_folder(target, step).name:
            shutil.rmtree(child)
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Uninterrupted STEPS-step runs under each plan, with --save; a and one also checkpoint step 3."""
    folder = tmp_path_factory.mktemp("reshard")
    for name in PLANS:
        plan_file(folder, name)
        extra = ["--checkpoint-dir", f"ckpt-{name}", "--checkpoint-every", str(SAVED_AT)] if name != "b" else []
        result = gpipe_plan("run", f"{name}.json", "--steps", str(STEPS), "--save", f"{name}-full.pt", "-q", *extra,
                            cwd=folder)
        assert result.returncode == 0, result.stderr
    return folder


def resume(runs: Path, saved_under: str, plan: str, *extra: str, unfinished: int | None = None) -> dict[str, Any]:
    """Resume ``saved_under``'s step-3 checkpoint under ``plan`` up to STEPS; return what it did.

    ``unfinished``: also leave a newer step's ``.partial`` folder, as a rank killed while saving would.
    """
    ckpt = resumable_copy(runs / f"ckpt-{saved_under}", runs / f"ckpt-{saved_under}-to-{plan}")
    if unfinished is not None:
        shutil.copytree(checkpoint.step_folder(ckpt, SAVED_AT), checkpoint.partial_folder(ckpt, unfinished))
    out = f"{saved_under}-to-{plan}"
    result = gpipe_plan("run", f"{plan}.json", "--steps", str(STEPS), "--checkpoint-dir", ckpt.name, "--resume",
                        "--save", f"{out}.pt", "--report", f"{out}.json", *extra, cwd=runs)
    assert result.returncode == 0, result.stderr
    assert f"resumed at step {SAVED_AT}" in result.stdout
    report = json.loads((runs / f"{out}.json").read_text())
    assert report["steps_run"] == STEPS - SAVED_AT, "the resumed run did not start at the checkpoint"
    # Rich wraps long lines at the terminal's width: compare words, not lines.
    return {"stdout": " ".join(result.stdout.split()), "model": torch.load(runs / f"{out}.pt"), "folder": ckpt}


# ---------------------------------------------------------------------- resume under another plan
def test_resume_under_another_balance_ends_like_an_uninterrupted_run(runs: Path) -> None:
    """Saved by 2 stages holding [2, 2] layers (M = 2), resumed by 2 holding [1, 3] (M = 4)."""
    resumed = resume(runs, "a", "b")
    assert "saved by 2 stage(s) holding [2, 2] layers" in resumed["stdout"]
    assert max_difference(resumed["model"], torch.load(runs / "b-full.pt")) <= ATOL
    # It trained on: the last checkpoint is of step 6, and step 3's is still kept (--keep-checkpoints 2).
    assert sorted(p.name for p in resumed["folder"].iterdir()) == ["step-00000003", "step-00000006"]


def test_resume_from_two_stages_on_one(runs: Path) -> None:
    """K = 2 -> K = 1; with --init-from too, which the checkpoint overrides. A step a killed run
    never finished (a .partial folder) is not resumed."""
    resumed = resume(runs, "a", "one", "--init-from", "b-full.pt", unfinished=5)
    assert "random generators reseeded" in resumed["stdout"] and "--init-from ignored" in resumed["stdout"]
    assert max_difference(resumed["model"], torch.load(runs / "one-full.pt")) <= ATOL


@pytest.mark.slow
def test_resume_from_one_stage_on_two(runs: Path) -> None:
    resumed = resume(runs, "one", "a")
    assert "saved by 1 stage(s) holding [4] layers" in resumed["stdout"]
    assert max_difference(resumed["model"], torch.load(runs / "a-full.pt")) <= ATOL


def unsplit_adam(start: dict[str, torch.Tensor] | None, steps: int, reset_at: int | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the whole model, whole batches of 4, Adam; ``reset_at``: a fresh Adam there."""
    torch.manual_seed(0)
    model = build_model(GPT, seed=0)
    if start is not None:
        model.module.load_state_dict(start)
    optimizer = torch.optim.Adam(model.module.parameters(), lr=LR)
    for step in range(steps):
        if step == reset_at:
            optimizer = torch.optim.Adam(model.module.parameters(), lr=LR)
        inputs, targets = model.synthetic_batch(4, step_generator(0, step))
        model.loss(model.forward(*inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.module.state_dict()


def test_the_comparison_sees_a_lost_optimizer_state(runs: Path) -> None:
    """The tests above would fail if a resume dropped Adam's state: that lands far outside ATOL."""
    uninterrupted = unsplit_adam(None, STEPS)
    assert max_difference(torch.load(runs / "a-full.pt"), uninterrupted) <= ATOL
    assert max_difference(unsplit_adam(None, STEPS, reset_at=SAVED_AT), uninterrupted) > 100 * ATOL


# ---------------------------------------------------------------------- the checkpoint itself
def plan_file(folder: Path, name: str) -> Path:
    balance, micro_batches, size = PLANS[name]
    write_json_atomic(folder / f"{name}.json", hand_plan(GPT, balance, micro_batches, size))
    return folder / f"{name}.json"


def test_optimizer_state_is_keyed_by_the_unsplit_parameter_names(tmp_path: Path) -> None:
    """In one process: a stage's Adam state and the RNG round-trip (Adam's under
    ``optim/<unsplit key>/<name>``), the identity must match, and a version 1 folder is refused."""
    plan = load_plan(plan_file(tmp_path, "one"))
    stage = build_chunk(build_model(GPT, seed=0), plan, 0)
    optimizer = torch.optim.Adam(stage.parameters(), lr=LR)
    model = build_model(GPT, seed=0)
    inputs, targets = model.synthetic_batch(4, step_generator(0, 0))
    model.loss(stage.module(*inputs), targets).backward()
    optimizer.step()
    identity = {"model": plan.model, "optimizer": "adam"}
    saved = checkpoint.save(tmp_path / "ckpt", 1, stage, optimizer, identity, {"ranks": 1})
    after_save = torch.rand(4)  # what the generator draws next, as saved
    reader = checkpoint.safe_reader(saved)
    keys = set(reader.metadata().state_dict_metadata)
    assert {"optim/embed.tokens.weight/exp_avg", "optim/embed.tokens.weight/step"} <= keys
    assert {f"model/{k}" for k in model.module.state_dict()} <= keys

    fresh = build_chunk(build_model(GPT, seed=1), plan, 0)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=LR)
    with pytest.raises(BadInput, match="was made with optimizer = 'adam', this run has 'sgd'"):
        checkpoint.load(tmp_path / "ckpt", 1, fresh, fresh_optimizer, identity | {"optimizer": "sgd"}, seed=0)
    meta = checkpoint.load(tmp_path / "ckpt", 1, fresh, fresh_optimizer, identity, seed=0)
    assert meta["step"] == 1 and meta["rng"] == "restored" and torch.equal(torch.rand(4), after_save)
    for (_, p), (_, q) in zip(stage.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][name], fresh_optimizer.state[q][name])

    old = tmp_path / "v1" / "step-00000004"
    old.mkdir(parents=True)
    (old / "stage-0-of-2.pt").write_bytes(b"")
    with pytest.raises(BadInput, match="of version 1 .* start again with a new --checkpoint-dir"):
        checkpoint.newest_complete_step(tmp_path / "v1")


# ---------------------------------------------------------------------- --init-from
@pytest.fixture(scope="module")
def initial_weights(runs: Path) -> dict[str, Path]:
    """Trained weights of the unsplit model (a's 6 steps) as .pt and as .safetensors."""
    from safetensors.torch import save_file

    state = torch.load(runs / "a-full.pt")
    save_file({k: v.contiguous() for k, v in state.items()}, str(runs / "a-full.safetensors"))
    return {"pt": runs / "a-full.pt", "safetensors": runs / "a-full.safetensors"}


@pytest.mark.parametrize("kind, plan", [("pt", "one"), ("safetensors", "b")])
def test_init_from_trains_on_from_those_weights(runs: Path, initial_weights: dict[str, Path], kind: str,
                                                plan: str) -> None:
    """The pipeline starts from the file's weights (fresh Adam, steps 0..2) as the unsplit model does."""
    out = runs / f"init-{kind}.pt"
    result = gpipe_plan("run", f"{plan}.json", "--steps", "3", "--init-from", str(initial_weights[kind]),
                        "--save", out.name, cwd=runs)
    assert result.returncode == 0, result.stderr
    assert "initial weights from" in result.stdout
    reference = unsplit_adam(torch.load(initial_weights["pt"]), steps=3)
    assert max_difference(torch.load(out), reference) <= ATOL


def test_each_rank_reads_only_its_stage_tensors(runs: Path, initial_weights: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    original = init_from._SafetensorsFile.tensor
    monkeypatch.setattr(init_from._SafetensorsFile, "tensor", lambda self, key: read.append(key) or original(self, key))
    model = build_model(GPT, seed=1)
    stage = build_chunk(model, load_plan(runs / "b.json"), 1)
    assert init_from.load_initial_weights(str(initial_weights["safetensors"]), stage, model.module) == len(read)
    assert sorted(read) == sorted(stage.state_dict()) and not any(key.startswith("embed.") for key in read)
    saved = torch.load(initial_weights["pt"])
    assert all(torch.equal(tensor, saved[key]) for key, tensor in stage.state_dict().items())


def test_init_from_a_file_of_another_model_is_one_line(runs: Path) -> None:
    """Keys of another model: exit 2, one line naming the counts and the first keys either way."""
    state = torch.load(runs / "a-full.pt")
    renamed = {("module." + k if i < 5 else k): v for i, (k, v) in enumerate(state.items())}
    renamed.pop("head.proj.weight")
    torch.save(renamed, runs / "renamed.pt")
    result = gpipe_plan("run", "one.json", "--steps", "1", "--init-from", "renamed.pt", cwd=runs)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    line = result.stderr.strip()
    assert "does not match the model: 6 of the model's" in line and "5 of the file's" in line, line
    assert "'embed.tokens.weight'" in line and "'module.blocks.0.attn.qkv.weight'" in line, line



def test_init_from_a_tensor_of_another_shape_is_one_line(tmp_path: Path) -> None:
    """In one process (the command line turns every BadInput into one line and exit 2, above)."""
    state = build_model(GPT, seed=0).module.state_dict()
    state["blocks.0.attn.qkv.weight"] = torch.zeros(3, 5)
    torch.save(state, tmp_path / "reshaped.pt")
    model = build_model(GPT, seed=0)
    stage = build_chunk(model, load_plan(plan_file(tmp_path, "b")), 1)
    with pytest.raises(BadInput, match=r"'blocks.0.attn.qkv.weight' is \[3, 5\] in the file but \[48, 16\] in the model"):
        init_from.load_initial_weights(str(tmp_path / "reshaped.pt"), stage, model.module)


@pytest.mark.parametrize("content", [b"x" * 800, b"{\"format\": \"gpipe-plan.plan\"}"])
def test_init_from_a_file_torch_never_wrote_says_what_to_give(tmp_path: Path, content: bytes) -> None:
    # (torch's own line spoke of mmap and _use_new_zipfile_serialization)
    (tmp_path / "junk.pt").write_bytes(content)
    with pytest.raises(BadInput, match=r"--init-from '.*junk.pt' is neither a file torch.save writes \(a zip "
                                       r"archive\) nor a .safetensors file: give weights saved with torch.save"):
        init_from.open_weights(str(tmp_path / "junk.pt")).__enter__()


def test_init_from_is_checked_before_the_ranks_start(tmp_path: Path) -> None:
    plan = plan_file(tmp_path, "one")
    with pytest.raises(BadInput, match="--init-from '.*missing.pt' is not a file"):
        check_options(RunOptions(plan=str(plan), init_from=str(tmp_path / "missing.pt")))
