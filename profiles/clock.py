"""Clocks that time work on a device honestly.

On the CPU an operation is done when the call returns, so the time around the call is its
time. With one intra-op thread, all of the work (autograd's CPU backward included) runs in
the calling thread, so that thread's CPU time measures it, and unlike wall time it does not
count the milliseconds the scheduler gives to other processes on a shared machine. With
more threads the work is spread over a pool, and wall time is the honest measure.

On a GPU a call only *launches* the work and returns at once; timing the launch would
measure Python. A CUDA clock therefore records events in the stream around the work
and reads the time between them after synchronising, which is when the GPU has done it.

All clocks have the same shape: ``mark()`` where a span starts and ends, ``seconds(a, b)``
for the span between two marks, read only after ``sync()``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Protocol

import torch


class Clock(Protocol):
    name: str

    def mark(self) -> Any: ...

    def sync(self) -> None: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class CpuClock:
    """Wall time from ``time.perf_counter``; the CPU does the work inside the call."""

    name = "perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

    def sync(self) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class ThreadTimeClock(CpuClock):
    """CPU time of the calling thread (``time.thread_time``): blind to preemption by neighbours."""

    name = "thread_time"

    def mark(self) -> float:
        return time.thread_time()


class CudaClock:
    """CUDA events recorded in the current stream; read after ``torch.cuda.synchronize``."""

    name = "cuda_events"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000.0  # elapsed_time is in milliseconds


def clock_for(device: torch.device, threads: int = 1) -> Clock:
    """The honest clock for work on ``device`` with ``threads`` CPU intra-op threads."""
    if device.type == "cuda":
        return CudaClock(device)
    return ThreadTimeClock() if threads == 1 else CpuClock()


def median(values: list[float]) -> float:
    """The median: one slow repeat (a page fault, a neighbour's burst) does not move it."""
    return float(statistics.median(values))
