"""Training data: one global batch per step, the same on every rank, from the seed and the step.

Every rank draws step s's batch from a generator seeded with (seed, s). Stage 0 uses the
inputs, the last stage the targets; nothing is sent. Because a batch depends only on the
step number, a resumed run sees exactly the batches the uninterrupted run would have seen
with no data-loader state to save, and a run with any K and M sees the same batches as the
unsplit model: the equivalence tests rely on it.

Two sources:

- :class:`SyntheticBatches` (default): the model's own synthetic data (random tokens, images).
- :class:`FactoryBatches` (``--data pkg.module:factory``): the user's own data (models.hooks);
  step s is the factory's s-th mini-batch, drawn on an RNG seeded from the seed.
- :class:`TextBatches` (``--data FILE.txt``, for a language model): byte-level language modelling on a
  real text. Each sample is a random window of ``seq_len + 1`` bytes; the model reads the
  first ``seq_len`` and predicts each next byte. The loss starts near ln(256) = 5.5 and
  falls as the model learns the text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..artifacts import BadInput
from ..models import LayeredModel, is_language_model
from ..models.hooks import DataStream
from ..models.user import find_factory
from .options import is_data_factory

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
            raise BadInput(f"--data '{path}' has {len(raw)} bytes; the model reads windows of {seq_len + 1}: give a "
                           f"text of at least {seq_len + 2} bytes")
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


class FactoryBatches:
    """The user's ``--data pkg.module:factory`` (models.hooks): step s is its s-th mini-batch."""

    def __init__(self, path: str, batch_size: int, seed: int) -> None:
        self.path, self.batch_size, self.seed = path, batch_size, seed
        self.factory = find_factory(path, "data factory")
        self.stream = DataStream(self.factory, path, batch_size, seed)

    def batch(self, step: int) -> tuple[Tensors, torch.Tensor]:
        if step < self.stream.position:  # only going back needs a fresh stream
            self.stream = DataStream(self.factory, self.path, self.batch_size, self.seed)
        while self.stream.position < step:  # a resumed run skips the steps done
            self.stream.next()
        return self.stream.next()

    def samples_text(self) -> str:
        return f"data from '{self.path}'"


def batch_source(model: LayeredModel, data: str | None, batch_size: int, seed: int) -> BatchSource:
    """The data of a run: ``--data`` text for a byte-level language model, else synthetic.

    A language model is the built-in ``gpt`` or a model of one's own trained with ``--loss lm``;
    bytes are its tokens, so its vocabulary must hold 256 symbols.
    """
    spec = model.spec
    if data is None and spec.get("data"):
        data = spec["data"]  # the profile's data factory
    if data is None:
        return SyntheticBatches(model, batch_size, seed)
    if is_data_factory(data):
        if spec.get("source") != "import":
            raise BadInput(f"--data {data} feeds a model of your own; the built-in '{spec.get('name')}' has its "
                           f"own data (gpt: --data FILE.txt)")
        return FactoryBatches(data, batch_size, seed)
    name = spec.get("name") or spec.get("factory")
    if not is_language_model(spec):
        raise BadInput(f"--data FILE.txt trains a language model on bytes (the built-in gpt, or your model "
                       f"with --loss lm); the plan's model '{name}' is not one")
    if spec.get("source") == "builtin":   # gpt: its options say its vocabulary and sequence
        vocab_size, seq_len = spec["options"]["vocab_size"], spec["options"]["seq_len"]
    else:
        vocab_size, seq_len = spec.get("vocab_size"), model.input_shapes[0][0]
        if vocab_size is None:   # profiled on its own data factory, which said no vocabulary
            raise BadInput(f"--data FILE.txt is byte-level (256 symbols), and the plan's model '{name}' was profiled "
                           f"on its data factory without --vocab-size: profile it with --vocab-size (its logits' "
                           f"last dimension) to train it on text")
    if vocab_size < 256:
        raise BadInput(f"--data is byte-level (256 symbols) but the plan's model '{name}' has a vocabulary of "
                       f"{vocab_size}: profile it with --vocab-size 256 or more")
    return TextBatches(data, seq_len, batch_size, seed)
