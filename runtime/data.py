"""Training data: one global batch per step, the same on every rank, from the seed and the step.

Every rank draws step s's batch from a generator seeded with (seed, s). Stage 0 uses the
inputs, the last stage the targets; nothing is sent. Because a batch depends only on the
step number, a resumed run sees exactly the batches the uninterrupted run would have seen
with no data-loader state to save, and a run with any K and M sees the same batches as the
unsplit model: the equivalence tests rely on it.

Two sources:

- :class:`SyntheticBatches` (default): the model's own synthetic data (random tokens, images).
- :class:`TextBatches` (``--data FILE.txt``, for ``gpt``): byte-level language modelling on a
  real text. Each sample is a random window of ``seq_len + 1`` bytes; the model reads the
  first ``seq_len`` and predicts each next byte. The loss starts near ln(256) = 5.5 and
  falls as the model learns the text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..artifacts import BadInput
from ..models import LayeredModel

Tensors = tuple[torch.Tensor, ...]


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator step ``step``'s batch is drawn from: a function of (seed, step) only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class BatchSource(Protocol):
    def batch(self, step: int) -> tuple[Tensors, torch.Tensor]:
        """``(inputs, targets)`` of step ``step``: the whole global batch, on the CPU."""
        ...

    def samples_text(self) -> str: ...


class SyntheticBatches:
    def __init__(self, model: LayeredModel, batch_size: int, seed: int) -> None:
        self.model, self.batch_size, self.seed = model, batch_size, seed

    def batch(self, step: int) -> tuple[Tensors, torch.Tensor]:
        return self.model.synthetic_batch(self.batch_size, step_generator(self.seed, step))

    def samples_text(self) -> str:
        return "synthetic data"


class TextBatches:
    def __init__(self, path: str, seq_len: int, batch_size: int, seed: int) -> None:
        raw = Path(path).read_bytes()
        if len(raw) < seq_len + 2:
            raise BadInput(f"--data '{path}' has {len(raw)} bytes; the model reads windows of {seq_len + 1}")
        self.path = path
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.window = torch.arange(seq_len + 1)

    def batch(self, step: int) -> tuple[Tensors, torch.Tensor]:
        g = step_generator(self.seed, step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size, 1), generator=g)
        windows = self.tokens[starts + self.window]   # (batch, seq_len + 1)
        return (windows[:, :-1].contiguous(),), windows[:, 1:].contiguous()

    def samples_text(self) -> str:
        return f"'{Path(self.path).name}' ({len(self.tokens):,} bytes)"


def batch_source(model: LayeredModel, data: str | None, batch_size: int, seed: int) -> BatchSource:
    """The data of a run: ``--data`` text for a byte-level ``gpt``, else synthetic."""
    if data is None:
        return SyntheticBatches(model, batch_size, seed)
    spec = model.spec
    if spec.get("source") != "builtin" or spec.get("name") != "gpt":
        name = spec.get("name") or spec.get("factory")
        raise BadInput(f"--data FILE.txt trains the built-in gpt on bytes; the plan's model is '{name}'")
    options = spec["options"]
    if options["vocab_size"] < 256:
        raise BadInput(f"--data is byte-level (256 symbols) but the plan's gpt has vocab_size "
                       f"{options['vocab_size']}: profile it with --vocab-size 256")
    return TextBatches(data, options["seq_len"], batch_size, seed)
