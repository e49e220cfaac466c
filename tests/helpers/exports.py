"""Pieces the export tests share: the model the exports are checked on, and Llama's spec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpipe_plan.models import model_spec

GPT = model_spec("gpt", layers=4, width=32, heads=2, seq_len=8, vocab_size=64)


def _llama() -> dict[str, Any]:
    pytest.importorskip("transformers")
    from hf_models import SEQ, VOCAB

    return model_spec("hf_models:make_llama_4", input_shape=[SEQ], vocab_size=VOCAB, loss="lm")


def write(path: Path, doc: dict[str, Any]) -> str:
    path.write_text(json.dumps(doc))
    return path.name
