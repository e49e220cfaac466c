"""What a model eats: input shapes and dtypes, targets, and synthetic batches of both.

Profiling and pipelined training run on synthetic data by default, drawn from a seeded
``torch.Generator`` on the CPU: the same seed gives the same batch on every rank and every
run, so a pipelined run can be compared with an unsplit one number for number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensors = tuple[torch.Tensor, ...]


class SyntheticData:
    """Describes a model's inputs and draws ``(inputs, targets)`` batches."""

    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[torch.dtype, ...]

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensors, torch.Tensor]:
        raise NotImplementedError


@dataclass(frozen=True)
class NextToken(SyntheticData):
    """A language model's data: ``seq_len`` random tokens in, the same shifted by one as targets."""

    seq_len: int
    vocab_size: int

    @property
    def input_shapes(self) -> tuple[tuple[int, ...], ...]:  # type: ignore[override]
        return ((self.seq_len,),)

    @property
    def input_dtypes(self) -> tuple[torch.dtype, ...]:  # type: ignore[override]
        return (torch.int64,)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensors, torch.Tensor]:
        # One stream of seq_len + 1 tokens per sample: the target of token t is token t + 1.
        # Copies, not views: a view would keep the whole stream alive, and the profiler
        # counts the storage a saved tensor keeps.
        stream = torch.randint(0, self.vocab_size, (batch_size, self.seq_len + 1), generator=generator)
        return (stream[:, :-1].clone(),), stream[:, 1:].clone()


@dataclass(frozen=True)
class Classification(SyntheticData):
    """One input of a fixed per-sample shape, one integer class per sample as the target.

    Floating inputs are standard normal; integer inputs (token ids) are uniform in
    ``[0, token_range)``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    num_classes: int
    token_range: int | None = None

    @property
    def input_shapes(self) -> tuple[tuple[int, ...], ...]:  # type: ignore[override]
        return (self.shape,)

    @property
    def input_dtypes(self) -> tuple[torch.dtype, ...]:  # type: ignore[override]
        return (self.dtype,)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensors, torch.Tensor]:
        size = (batch_size, *self.shape)
        if self.dtype.is_floating_point:
            x = torch.randn(size, generator=generator).to(self.dtype)
        elif self.dtype == torch.bool:
            x = torch.randint(0, 2, size, generator=generator).bool()
        else:
            x = torch.randint(0, self.token_range or 2, size, generator=generator).to(self.dtype)
        targets = torch.randint(0, self.num_classes, (batch_size,), generator=generator)
        return (x,), targets
