"""Dynamic loss scaling for fp16, kept identical on every stage of the pipeline.

fp16 represents numbers down to about 6e-8; many gradients are smaller and would become zero.
Multiplying the loss by a scale S before the backward multiplies every gradient by S and lifts
them into range; dividing the gradients by S before the optimizer step undoes it. Too large an
S overflows instead (an inf or a NaN in some gradient): that step is skipped and S halved; after
``growth_interval`` clean steps in a row S doubles again. This is what
``torch.amp.GradScaler`` does, with one difference that a pipeline needs: the decision to skip
must be the same on every stage, or the stages' parameters drift apart. So the overflow test is
on the *global* gradient norm, which the once-a-step exchange (:mod:`.loss_exchange`) already sums over
all stages, and every rank updates S from the same number in the same way.

bf16 has fp32's exponent range and trains without a scale: the scaler is then disabled and S
stays 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class LossScaler:
    """The loss scale S, its update rule, and the unscaling of gradients."""

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, grad_norm: float) -> bool:
        """Update S from this step's global gradient norm (of the scaled gradients).

        Returns whether the optimizer may step: False when some gradient overflowed, which
        every stage learns from the same norm.
        """
        if not self.enabled:
            return True
        if not math.isfinite(grad_norm):
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return True

    def unscale_(self, params: list[torch.nn.Parameter], scale: float) -> None:
        """Divide the gradients by ``scale`` (the S they were computed with), in place."""
        if self.enabled and scale != 1.0:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / scale)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
