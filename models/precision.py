"""Mixed precision: the dtype the layers compute in, and the dtype the parameters are kept in.

On a GPU, matrix products in bf16 or fp16 run on tensor cores, many times faster than in fp32,
and the tensors a layer saves for backward and sends to the next stage take half the bytes. So
a plan made from an fp32 profile is wrong for a bf16 run in time *and* in memory, and
``profile`` and ``run`` take the same two settings and record them (docs/runtime.md,
"Precision"; docs/benchmarks.md, "GPU", has the figures):

- ``precision`` (``fp32``, ``bf16``, ``fp16``): the layers' forward runs under
  ``torch.autocast`` in that dtype, which computes matrix products and convolutions in it and
  keeps precision-sensitive operations (softmax, losses, norms on CUDA) in fp32. The backward
  runs outside autocast, in the dtypes the forward chose. The loss is computed under autocast
  too, as PyTorch's recipe does.
- ``param_dtype`` (``fp32`` or the precision's own dtype): what the parameters, their
  gradients and the optimizer's state are stored in. ``fp32`` is the usual "fp32 master
  weights": autocast casts each weight to bf16 where it is used, and that copy is saved for
  backward, so every micro-batch in flight holds one (the profiler counts it in the layer's
  activation bytes, as the constant part of their line).

fp16 has a narrow range: small gradients underflow to zero. It trains with a loss scale
(runtime/loss_scale.py); bf16 has fp32's range and needs none.

The model is always built in fp32 from its seed, then cast, so every rank and the profiler
start from the same values rounded the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..artifacts import check_precision

if TYPE_CHECKING:
    from .layered import LayeredModel

# A context factory every forward runs in: ``with autocast(): ...``.
Autocast = Callable[[], contextlib.AbstractContextManager[object]]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """How a model computes (``compute``) and stores its parameters (``params``); names as in PRECISIONS."""

    compute: str = "fp32"
    params: str = "fp32"

    def __post_init__(self) -> None:
        check_precision(self.compute, self.params)

    @property
    def mixed(self) -> bool:
        """Whether the forward runs under autocast."""
        return self.compute != "fp32"

    @property
    def loss_scaling(self) -> bool:
        """fp16 gradients underflow without a loss scale; bf16 has fp32's exponent range."""
        return self.compute == "fp16"

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.params]

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[object]:
        """The context every forward (and loss) runs in; a no-op in fp32."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=DTYPES[self.compute])

    def cast(self, model: "LayeredModel") -> None:
        """Store the model's floating parameters and buffers in ``param_dtype``, in place.

        ``Module.to(dtype)`` swaps each tensor's data and keeps the Parameter objects, so the
        layers still share them with the whole model. The layers are cast too, because a traced
        layer may hold its own reference to a buffer or a constant.
        """
        if self.params != "fp32":
            for module in (model.module, *(layer for _, layer in model.layers)):
                module.to(self.param_dtype)

    def with_autocast(self, fn: Callable[..., torch.Tensor], device_type: str) -> Callable[..., torch.Tensor]:
        """``fn`` (a loss) computed under this precision's autocast."""
        if not self.mixed:
            return fn

        def under_autocast(*args: object) -> torch.Tensor:
            with self.autocast(device_type):
                return fn(*args)
        return under_autocast


def no_autocast() -> contextlib.AbstractContextManager[object]:
    """fp32: forwards run as they are."""
    return contextlib.nullcontext()
