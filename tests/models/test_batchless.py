"""Tensors without a batch dimension that cross a cut: a rotary-like table of shape (1, T, d)
handed along an nn.Sequential, or made inside a captured model. With three stages the middle
one must receive the table in its own shape (not as if it were per sample), and the pipeline
must train exactly as the unsplit model."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe_plan.artifacts import BadInput, write_json_atomic
from gpipe_plan.models import build_model, model_spec
from helpers.handplan import hand_plan
from helpers.ranks import assert_same_parameters, run_in_one_group, unsplit_training

TABLES = """
    import torch
    from torch import nn

    SEQ, WIDTH = 8, 16

    class Embed(nn.Module):
        \"\"\"ids -> (hidden, table): the table is the same for every sample, shape (1, SEQ, WIDTH).\"\"\"
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(50, WIDTH)
            position = torch.arange(SEQ, dtype=torch.float32)[:, None] / (1 + torch.arange(WIDTH))
            self.register_buffer("table", torch.cos(position)[None])
        def forward(self, ids):
            return self.tokens(ids), self.table

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(WIDTH, WIDTH)
        def forward(self, xs):
            hidden, table = xs
            return hidden + torch.tanh(self.fc(hidden * table)), table

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(WIDTH, 4)
        def forward(self, xs):
            hidden, _ = xs
            return self.fc(hidden.mean(dim=1))

    def sequential():
        return nn.Sequential(Embed(), Block(), Block(), Block(), Head())

    class Tower(nn.Module):
        \"\"\"The same model written as one forward: captured with torch.export.\"\"\"
        def __init__(self):
            super().__init__()
            self.embed = Embed()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = Head()
        def forward(self, ids):
            xs = self.embed(ids)
            for block in self.blocks:
                xs = block(xs)
            return self.head(xs)

    def tower():
        return Tower()

    class SequenceFirst(nn.Module):
        \"\"\"Hands on a (seq, batch, width) tensor: its batch is not the first dimension.\"\"\"
        def forward(self, xs):
            hidden, _ = xs
            return hidden.transpose(0, 1)

    class BatchFirstHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(WIDTH, 4)
        def forward(self, hidden):
            return self.fc(hidden.transpose(0, 1).mean(dim=1))

    def sequence_first():
        return nn.Sequential(Embed(), SequenceFirst(), BatchFirstHead())
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batchless")
    (path / "tables.py").write_text(textwrap.dedent(TABLES))
    return path


def spec_of(folder: Path, factory: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.chdir(folder)
    return model_spec(f"tables:{factory}", input_shape=[8], input_dtype="int64", vocab_size=50, num_classes=4)


def test_a_plan_records_the_table_whole_and_the_hidden_state_per_sample(folder: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    plan = hand_plan(spec_of(folder, "sequential", monkeypatch), [2, 1, 2], micro_batches=2, micro_batch_size=2)
    first = plan["chunks"][0]
    assert first["output_shapes"] == [[8, 16], [1, 8, 16]] and first["output_batched"] == [True, False]
    assert "output_batched" not in plan["chunks"][2]  # the logits: per sample, as every plan had it


def test_three_stages_train_a_table_passing_model_exactly_like_one(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 3 equals the unsplit model: the table crosses two cuts in the Sequential; the captured
    tower makes it again in each layer (it depends on no input) instead of sending it."""
    specs = {name: spec_of(folder, name, monkeypatch) for name in ("sequential", "tower")}
    captured = build_model(specs["tower"], seed=0)
    assert [n for n, _ in captured.layers] == ["embed.tokens", "blocks.0", "blocks.1", "blocks.2", "head.fc"]
    jobs = []
    for name, spec in specs.items():
        plan = folder / f"{name}-plan.json"
        write_json_atomic(plan, hand_plan(spec, [2, 1, 2], micro_batches=4, micro_batch_size=2))
        jobs.append({"plan": str(plan), "steps": 3, "lr": 1e-3, "optimizer": "adam",
                     "save": str(folder / f"{name}.pt"), "quiet": True})
    outcome = run_in_one_group(jobs, folder, world_size=3)
    for job, spec in zip(jobs, specs.values()):
        assert outcome[job["save"]] == "ok", outcome[job["save"]]
        assert_same_parameters(torch.load(job["save"]), unsplit_training(spec, global_batch=8), atol=1e-5)


def test_a_tensor_with_its_batch_elsewhere_is_refused_in_one_line(folder: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_of(folder, "sequence_first", monkeypatch)
    with pytest.raises(BadInput, match=r"layer '1' passes on a tensor of shape \[8, 2, 16\] at micro-batch 2 .*"
                                        r"put the batch first"):
        hand_plan(spec, [2, 1], micro_batches=2, micro_batch_size=2)


def test_the_profile_records_which_outputs_carry_the_batch(folder: Path) -> None:
    from helpers.cli_process import gpipe_plan

    result = gpipe_plan("profile", "tables:sequential", "--input-shape", "8", "--input-dtype", "int64",
                        "--vocab-size", "50", "--num-classes", "4", "--micro-batch-sizes", "1,2", "--warmup", "1",
                        "--repeats", "2", "--contention-processes", "0", "--no-recompute-timing", "--no-fixed-costs",
                        "-q", "-o", "tables-profile.json", cwd=folder)
    assert result.returncode == 0, result.stderr
    layers = json.loads((folder / "tables-profile.json").read_text())["layers"]
    assert layers[0]["output_shapes"] == [[8, 16], [1, 8, 16]] and layers[0]["output_batched"] == [True, False]
    assert "output_batched" not in layers[-1]
