"""On a GPU, two clocks per layer: the GPU's time and the CPU's time to issue the work.

A CUDA call returns once its kernel is queued; the GPU runs the queue while the CPU goes on.
A layer then costs the GPU its kernels' time and the CPU the time to issue them (Python,
dispatch, autograd, the launches). Whichever is longer sets the pace of a pass: at small
micro-batches in bf16 the CPU issues a block's kernels slower than the GPU runs them, and the
GPU waits (launch-bound: one-stage plans measured 0.75-0.80x their prediction on an H200 when
only one figure was kept, docs/benchmarks.md "GPU").

So each is measured on its own (:func:`backlog_timings`):

- the GPU's time *behind a backlog*: a sleep kernel (``torch.cuda._sleep``) is queued first,
  long enough that the CPU issues the whole pass before the GPU reaches it; events recorded
  around the pass then time its kernels back to back, with no launch gap in between;
- the CPU's issue time: the wall time of the same call, which returns without waiting (the
  GPU is still busy with the backlog).

The planner charges a pass over layers [s, e) the larger of the two sums (planner/costmodel.py,
"The CPU-issue bound"). A pass whose call does wait for the GPU (a layer that synchronises,
``.item()`` say) returns only after the backlog: its issue time says nothing and is taken as
its GPU time (the GPU's then sets the pace), which :attr:`IssueTiming.synchronised` records.

The clocks are passed in, so that the method runs against a fake device in the tests (no GPU
needed) exactly as it runs on CUDA.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The backlog queued before each timed pass; doubled (up to MAX_BACKLOG_S) while a pass takes
# the CPU more than half of it to issue.
BACKLOG_S = 0.02
MAX_BACKLOG_S = 1.0


@dataclass(frozen=True)
class IssueTiming:
    """One runner's medians: the GPU's time behind a backlog and the CPU's issue time, per pass."""

    gpu_forward_s: float
    gpu_backward_s: float
    issue_forward_s: float
    issue_backward_s: float
    synchronised: bool = False     # a pass waited for the GPU: its issue time is its GPU time


def backlog_timings(runners: Sequence[Any], clock: Any, backlog: Callable[[float], None],
                    warmup: int, repeats: int, wall: Callable[[], float] = time.perf_counter,
                    backlog_s: float = BACKLOG_S) -> list[IssueTiming]:
    """Per runner (``forward()``, ``backward(state)``): see the module docstring.

    ``clock``: a CUDA clock (``mark``, ``sync``, ``seconds``: profiles/clock.py); ``backlog(s)``
    queues about ``s`` seconds of GPU work; ``wall``: the CPU's clock."""
    while True:
        samples: list[list[tuple[float, float, float, float]]] = [[] for _ in runners]
        for r in range(warmup + repeats):
            for i, runner in enumerate(runners):
                clock.sync()
                backlog(backlog_s)
                t0, e0 = wall(), clock.mark()
                state = runner.forward()
                e1, t1 = clock.mark(), wall()
                clock.sync()
                backlog(backlog_s)
                t2, e2 = wall(), clock.mark()
                runner.backward(state)
                e3, t3 = clock.mark(), wall()
                clock.sync()
                if r >= warmup:
                    samples[i].append((clock.seconds(e0, e1), clock.seconds(e2, e3), t1 - t0, t3 - t2))
        longest = max((s[2] for mine in samples for s in mine), default=0.0)
        longest = max(longest, max((s[3] for mine in samples for s in mine), default=0.0))
        if longest <= backlog_s / 2 or backlog_s >= MAX_BACKLOG_S:
            break
        backlog_s *= 2       # the CPU issued for longer than the backlog hid: time again, longer
    out = []
    for mine in samples:
        gpu_f, gpu_b, issue_f, issue_b = (statistics.median(x) for x in zip(*mine))
        waited = issue_f >= backlog_s * 0.9 or issue_b >= backlog_s * 0.9
        if issue_f >= backlog_s * 0.9:
            issue_f = gpu_f
        if issue_b >= backlog_s * 0.9:
            issue_b = gpu_b
        out.append(IssueTiming(gpu_f, gpu_b, issue_f, issue_b, waited))
    return out


def cuda_backlog(device: Any) -> Callable[[float], None]:
    """``backlog(seconds)`` on ``device``: a sleep kernel of about that long (its cycles per
    second measured once)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda.synchronize(device)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    per_second = cycles / max(1e-6, start.elapsed_time(end) / 1000.0)

    def backlog(seconds: float) -> None:
        torch.cuda._sleep(int(per_second * seconds))

    return backlog


def record_issue(figures: Sequence[Any], timings: Sequence[IssueTiming], harness: IssueTiming) -> None:
    """Set each layer's GPU times (behind the backlog) and issue times, less the harness's, as
    the profiler takes the harness off every layer (a stage pays it once per action)."""
    for weighed, timing in zip(figures, timings):
        weighed.forward_s = max(0.0, timing.gpu_forward_s - harness.gpu_forward_s)
        weighed.backward_s = max(0.0, timing.gpu_backward_s - harness.gpu_backward_s)
        weighed.issue_forward_s = max(0.0, timing.issue_forward_s - harness.issue_forward_s)
        weighed.issue_backward_s = max(0.0, timing.issue_backward_s - harness.issue_backward_s)
