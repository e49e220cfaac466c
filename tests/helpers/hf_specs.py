"""The specs of the small Hugging Face models (helpers/user_modules/hf_models.py), by import path."""

from __future__ import annotations

from gpipe_plan.models import model_spec
from hf_models import SEQ, VOCAB

GPT2 = model_spec("hf_models:make_gpt2", input_shape=[SEQ], vocab_size=VOCAB, loss="lm")
LLAMA = model_spec("hf_models:make_llama", input_shape=[SEQ], vocab_size=VOCAB, loss="lm")
