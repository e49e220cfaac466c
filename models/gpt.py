"""Built-in ``gpt``: a small decoder-only transformer language model (GPT-2 shaped).

Layers: ``embed`` (token + position embedding), ``block0`` ... ``block{N-1}`` (pre-norm
causal self-attention and MLP, each with a residual), ``head`` (final LayerNorm + projection
to the vocabulary). Every block costs the same, which is the case where a uniform split is
already good; compare ``resnet``.

Deliberately absent: dropout, because a pipeline must compute exactly what the unsplit model
does and its random masks would depend on how the batch is split into micro-batches. No weight
tying between the embedding and the head either, which keeps the layers' figures independent
(tied models such as GPT-2 are supported: runtime/tied.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .data import NextToken
from .layered import AsTuple, LayeredModel

DEFAULTS: dict[str, int] = {"layers": 4, "width": 128, "heads": 4, "seq_len": 64, "vocab_size": 256}


class Embedding(nn.Module):
    """Token ids (batch, seq) -> vectors (batch, seq, width): token plus learned position."""

    def __init__(self, vocab_size: int, seq_len: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(seq_len, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Positions 0..seq-1 are the first rows of the table: a slice, not a lookup, so that
        # autograd keeps no index tensor and the layer's saved bytes are proportional to batch.
        return self.tokens(ids) + self.positions.weight[: ids.shape[1]]


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t sees positions <= t only."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, width / heads)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    """One transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final LayerNorm, then logits over the vocabulary."""

    def __init__(self, width: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class GPT(nn.Module):
    """The whole language model: token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, layers: int, width: int, heads: int, seq_len: int, vocab_size: int) -> None:
        super().__init__()
        self.embed = Embedding(vocab_size, seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = Head(width, vocab_size)
        self.apply(_init_weights)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def _init_weights(self, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters as this model does (Hugging Face's convention).

        ``build_model`` builds the model on the meta device and calls this per module, seeded
        from the module's path, to give each layer its values (models/materialize.py).
        """
        _init_weights(module)


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: small normal weights, zero biases. PyTorch's default (Kaiming
    # uniform) also works; this one keeps the initial loss near ln(vocab_size). LayerNorms keep
    # their reset_parameters() (ones and zeros).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def check_options(options: dict[str, Any]) -> None:
    """Raise ValueError with a user-facing reason if the options cannot make a model."""
    for key, value in options.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if options["width"] % options["heads"]:
        raise ValueError(f"width {options['width']} is not divisible by heads {options['heads']}")
    if options["vocab_size"] < 2:
        raise ValueError("vocab_size must be at least 2")


def layer_count(options: dict[str, Any]) -> int:
    """The layers :func:`build` makes: the embedding, the blocks, the head."""
    return options["layers"] + 2


def build(spec: dict[str, Any]) -> LayeredModel:
    o = spec["options"]
    model = GPT(o["layers"], o["width"], o["heads"], o["seq_len"], o["vocab_size"])
    layers = [("embed", AsTuple(model.embed, spread=True))]
    layers += [(f"block{i}", AsTuple(block, spread=True)) for i, block in enumerate(model.blocks)]
    layers.append(("head", AsTuple(model.head, spread=True)))
    return LayeredModel(spec, model, layers, NextToken(seq_len=o["seq_len"], vocab_size=o["vocab_size"]))
