"""Hugging Face causal LMs (GPT-2, Llama, from small configs): captured with torch.export, cut at
their blocks, trained with the language-model loss, tied weights kept equal across stages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from gpipe_plan.artifacts import BadInput, write_json_atomic  # noqa: E402
from gpipe_plan.models import build_model, model_spec  # noqa: E402
from helpers.handplan import hand_plan  # noqa: E402
from hf_models import SEQ, VOCAB  # noqa: E402
from helpers.cli_process import BIN, gpipe_plan  # noqa: E402
from helpers.ranks import LR, assert_same_parameters, run_in_one_group, unsplit_training  # noqa: E402
from helpers.hf_specs import GPT2, LLAMA  # noqa: E402

STEPS = 3


def test_gpt2_and_llama_are_cut_at_their_blocks_and_compute_the_model() -> None:
    expected = {
        "gpt2": (GPT2, ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                        "transformer.ln_f", "lm_head"]),
        "llama": (LLAMA, ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]),
    }
    for name, (spec, names) in expected.items():
        model = build_model(spec, seed=0)
        assert [n for n, _ in model.layers] == names, name
        ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
        xs: tuple[torch.Tensor, ...] = (ids,)
        for layer_name, layer in model.layers:
            xs = layer(*xs)
            # Only the hidden states cross a cut: rotary tables, masks and sizes are made again
            # in each layer (they have no batch dimension, or none of their own).
            assert all(isinstance(x, torch.Tensor) and x.shape[0] == 3 for x in xs), (name, layer_name)
        reference = model.module(ids).logits
        assert xs[0].shape == (3, SEQ, VOCAB)
        assert torch.equal(xs[0], reference), name


def test_gpt2_tied_embedding_is_one_parameter_in_two_layers_not_a_merged_run() -> None:
    model = build_model(GPT2, seed=0)
    tied = model.tied_parameters()
    assert [t["layers"] for t in tied] == [["transformer.wte", "lm_head"]]
    assert tied[0]["key"] == "transformer.wte.weight" and tied[0]["bytes"] == VOCAB * 32 * 4
    assert build_model(LLAMA, seed=0).tied_parameters() == []


def test_lm_loss_options_are_checked_in_one_line() -> None:
    assert model_spec("gpt", loss="lm") == model_spec("gpt")
    with pytest.raises(BadInput, match="trains with --loss lm"):
        model_spec("gpt", loss="classify")
    with pytest.raises(BadInput, match="needs --vocab-size"):
        model_spec("hf_models:make_gpt2", input_shape=[SEQ], loss="lm")
    with pytest.raises(BadInput, match="--num-classes does not apply"):
        model_spec("hf_models:make_gpt2", input_shape=[SEQ], vocab_size=VOCAB, loss="lm", num_classes=3)
    with pytest.raises(BadInput, match="not a regular expression"):
        model_spec("hf_models:make_gpt2", input_shape=[SEQ], vocab_size=VOCAB, loss="lm", cut_at="(")


def test_lm_model_whose_output_is_not_batch_seq_vocab_is_refused(user_module: Any) -> None:
    name = user_module("""
        import torch
        from torch import nn
        class LastToken(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(50, 8)
                self.head = nn.Linear(8, 50)
            def forward(self, ids):
                return self.head(self.embed(ids))[:, -1]     # (batch, vocab): not an LM's logits
        def make():
            return LastToken()
    """)
    model = build_model(model_spec(f"{name}:make", input_shape=[6], vocab_size=50, loss="lm"))
    with pytest.raises(BadInput, match=r"returns shape \[50\] per sample; --loss lm needs logits \[seq, vocab\]"):
        model.check(2)


def test_text_data_needs_a_byte_vocabulary() -> None:
    from gpipe_plan.runtime.data import batch_source

    with pytest.raises(BadInput, match="has a vocabulary of 96: profile it with --vocab-size 256"):
        batch_source(build_model(GPT2, seed=0), "corpus.txt", 4, 0)


def test_cut_at_chooses_the_layers() -> None:
    spec = model_spec("hf_models:make_llama", input_shape=[SEQ], vocab_size=VOCAB, loss="lm",
                      cut_at=r"model\.layers\.\d+\.(self_attn|mlp)|model\.embed_tokens|lm_head")
    names = [n for n, _ in build_model(spec, seed=0).layers]
    # The matches are layers; other modules with weights (the norms) stay layers of their own.
    assert names[:5] == ["model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.self_attn",
                         "model.layers.0.post_attention_layernorm", "model.layers.0.mlp"]
    assert "model.layers.0" not in names and names[-1] == "lm_head"


# ---------------------------------------------------------------------- training
def test_two_stages_train_gpt2_and_llama_exactly_like_the_unsplit_model(tmp_path: Path) -> None:
    """K = 2, M = 4 equals K = 1 within 1e-5: GPT-2 with its tied embedding in both stages (and a
    clipped gradient norm that counts the tie once; and under torch.distributed.pipelining),
    Llama with rotary tables in every block."""
    cases = [(GPT2, [3, 3], "gpipe", "native", 0.05), (LLAMA, [2, 3], "1f1b", "native", None),
             (GPT2, [2, 4], "1f1b", "torch", None)]
    jobs = []
    for i, (spec, balance, schedule, executor, clip) in enumerate(cases):
        plan = tmp_path / f"plan-{i}.json"
        write_json_atomic(plan, hand_plan(spec, balance, micro_batches=4, micro_batch_size=2, schedule=schedule))
        jobs.append({"plan": str(plan), "steps": STEPS, "lr": LR, "optimizer": "adam", "grad_clip": clip,
                     "executor": executor, "save": str(tmp_path / f"model-{i}.pt"), "quiet": True})
    outcome = run_in_one_group(jobs, tmp_path)
    for job, (spec, _, _, _, clip) in zip(jobs, cases):
        assert outcome[job["save"]] == "ok", outcome[job["save"]]
        saved = torch.load(job["save"])
        assert_same_parameters(saved, unsplit_training(spec, global_batch=8, steps=STEPS, grad_clip=clip), atol=1e-5)
        if spec is GPT2:  # the two copies of the tied matrix ended equal
            assert torch.equal(saved["transformer.wte.weight"], saved["lm_head.weight"])


def test_profile_solve_run_a_hugging_face_model_from_the_command_line(tmp_path: Path) -> None:
    """As a user would: the factory by import path, --loss lm; the tie is in the profile."""
    (tmp_path / "hf_models.py").write_text((Path(__file__).parents[1] / "helpers" / "user_modules" / "hf_models.py").read_text())
    profile = gpipe_plan("profile", "hf_models:make_gpt2", "--input-shape", str(SEQ), "--vocab-size", str(VOCAB),
                         "--loss", "lm", "--micro-batch-sizes", "1,2", "--warmup", "1", "--repeats", "2",
                         "--contention-processes", "0", "--no-recompute-timing", "--no-fixed-costs", "-o", "profile.json", "-q",
                         cwd=tmp_path)
    assert profile.returncode == 0, profile.stderr
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert doc["model"]["loss"] == "lm"
    assert doc["tied_parameters"][0]["layers"] == ["transformer.wte", "lm_head"]
    solve = gpipe_plan("solve", "profile.json", "--stages", "2", "--global-batch-size", "4", "-o", "plan.json",
                       cwd=tmp_path)
    assert solve.returncode == 0, solve.stderr
    run = gpipe_plan("run", "plan.json", "--steps", "2", "--quiet", "--save", "model.pt", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    saved = torch.load(tmp_path / "model.pt")
    assert torch.equal(saved["transformer.wte.weight"], saved["lm_head.weight"])
    assert BIN.exists()
