"""Spans: what each stage did, when, measured on its own clock.

Every forward and backward (or its two halves: ``backward_input``, the gradient of the
chunk's input, and ``backward_weight``, of its weights) of every chunk and micro-batch is one
:class:`Span` on the rank that ran it. The spans are the raw material of the report
(per-chunk forward/backward time, per-stage busy time and so the measured bubble) and of
the Chrome trace (the timeline).

Clocks: ranks share no clock, so each measures ``time.perf_counter()`` from its own origin,
taken right after a barrier that all ranks leave together; the origins then agree to within
the barrier's latency (tens of microseconds on one machine), which is enough to draw one
timeline.

On CUDA the work is asynchronous: a call returns when the kernel is queued, not done. Waiting
for the device around every span (``torch.cuda.synchronize``) would time it, but would also
stop the CPU from queueing the next kernel and serialise compute with the NCCL transfers that
should overlap it, inflating the very step being measured. So a span's marks are CUDA events
recorded in the stream, and they are read once per step, after the step's last operation
(:meth:`SpanRecorder.end_step`), as times since an origin event recorded with the origin.
Step boundaries (:meth:`SpanRecorder.now`) do wait for the device: once per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Span:
    """One operation of one stage: forward, backward, backward_input, backward_weight, optimizer,
    wait (for a neighbour), data, sync."""

    stage: int
    step: int
    kind: str
    micro_batch: int          # -1 for whole-step spans (optimizer, data, sync)
    start_s: float            # seconds since the rank's origin
    end_s: float
    chunk: int = -1           # the chunk it ran (or waited) for; -1 for whole-step spans

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


Mark = Any   # seconds since the origin (CPU) or a torch.cuda.Event (CUDA)


@dataclass
class SpanRecorder:
    """Collects one rank's spans, on a clock that starts at :meth:`start_clock`."""

    stage: int
    device: torch.device
    origin: float = 0.0
    step: int = 0
    spans: list[Span] = field(default_factory=list)
    _origin_event: Any = None
    _pending: list[tuple[str, int, int, Any, Any, int]] = field(default_factory=list)

    @property
    def _events(self) -> bool:
        return self.device.type == "cuda"

    def start_clock(self) -> None:
        if self._events:
            torch.cuda.synchronize(self.device)
            self._origin_event = torch.cuda.Event(enable_timing=True)
            self._origin_event.record()
        self.origin = time.perf_counter()

    def now(self) -> float:
        """Seconds since the origin, once the device has done all the work queued so far."""
        if self._events:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.origin

    def mark(self) -> Mark:
        """A point in this rank's stream of work, to start or end a span (no waiting)."""
        if not self._events:
            return time.perf_counter() - self.origin
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, kind: str, micro_batch: int, start: Mark, end: Mark, chunk: int = -1) -> None:
        if self._events:
            self._pending.append((kind, micro_batch, self.step, start, end, chunk))
        else:
            self.spans.append(Span(self.stage, self.step, kind, micro_batch, start, end, chunk))

    def end_step(self) -> None:
        """Turn the step's event pairs into spans; call after :meth:`now` (the device is done)."""
        for kind, micro_batch, step, start, end, chunk in self._pending:
            start_s = self._origin_event.elapsed_time(start) / 1000.0   # elapsed_time is in ms
            end_s = self._origin_event.elapsed_time(end) / 1000.0
            self.spans.append(Span(self.stage, step, kind, micro_batch, start_s, end_s, chunk))
        self._pending = []
