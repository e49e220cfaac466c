"""Spans: what each stage did, when, measured on its own clock.

Every forward and backward of every micro-batch is one :class:`Span` on the rank that ran it.
The spans are the raw material of the report (per-stage forward/backward time, busy time and
so the measured bubble) and of the Chrome trace (the timeline).

Clocks: ranks share no clock, so each measures ``time.perf_counter()`` from its own origin,
taken right after a barrier that all ranks leave together; the origins then agree to within
the barrier's latency (tens of microseconds on one machine), which is enough to draw one
timeline. On CUDA the work is asynchronous, so a span ends only once the device has
finished it (``torch.cuda.synchronize``): accurate spans, at the price of a sync per
operation, which the report and trace are worth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Span:
    """One operation of one stage: forward, backward, optimizer, wait (for a neighbour), data, sync."""

    stage: int
    step: int
    kind: str
    micro_batch: int          # -1 for whole-step spans (optimizer, data, sync)
    start_s: float            # seconds since the rank's origin
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class SpanRecorder:
    """Collects one rank's spans, on a clock that starts at :meth:`start_clock`."""

    stage: int
    device: torch.device
    origin: float = 0.0
    step: int = 0
    spans: list[Span] = field(default_factory=list)

    def start_clock(self) -> None:
        self.origin = time.perf_counter()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.origin

    def add(self, kind: str, micro_batch: int, start_s: float, end_s: float) -> None:
        self.spans.append(Span(self.stage, self.step, kind, micro_batch, start_s, end_s))

    def of_step(self, step: int) -> list[Span]:
        return [s for s in self.spans if s.step == step]
