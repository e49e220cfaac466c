"""Small Hugging Face causal LMs built from configs (no downloads), for the tests.

Dropout is off: a pipeline computes the unsplit model's function exactly only without random
masks (their draws would depend on how a batch is cut into micro-batches).
"""

from __future__ import annotations

from typing import Any

VOCAB = 96
SEQ = 16


def make_gpt2(layers: int = 2) -> Any:
    """GPT-2: learned positions, a Conv1D MLP, and the embedding tied to the output projection."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def make_llama(layers: int = 2) -> Any:
    """Llama: rotary positions (a (1, seq, dim) table every block uses), RMSNorm, SwiGLU, GQA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def make_gpt2_4() -> Any:
    return make_gpt2(4)


def make_llama_4() -> Any:
    return make_llama(4)
