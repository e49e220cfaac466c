"""The CPU-issue bound (CUDA): a pass costs the larger of its kernels' GPU time and the CPU's time
to issue them. The measurement (profiles/issue.py) runs here against a fake device, a queue of
kernels with a clock of its own; the planner's rule against a reference; the solvers' exactness
under it is in the brute-force tests (helpers.planner.instances draws issue times).

Not validated on a GPU in this session: bench/gpu_issue.py is the check to run there.
"""

from __future__ import annotations

import json
import random

import pytest

from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.profile import Profile
from gpipe_plan.profiles.issue import IssueTiming, backlog_timings, record_issue
from gpipe_plan.profiles.measure import LayerMeasurement

from helpers.planner import make_figures, profile_doc


class FakeDevice:
    """A CPU that issues kernels and a GPU that runs them in order, each on its own clock.

    Issuing a kernel takes the CPU ``issue_s``; the kernel starts when the GPU is free and the
    kernel issued, and runs ``gpu_s``. An event fires when the GPU reaches it (mark/seconds/sync:
    profiles/clock.py's CUDA clock)."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.gpu_free = 0.0
        self.fired: dict[int, float] = {}

    def wall(self) -> float:
        return self.cpu

    def launch(self, gpu_s: float, issue_s: float) -> None:
        self.cpu += issue_s
        self.gpu_free = max(self.gpu_free, self.cpu) + gpu_s

    def mark(self) -> int:
        event = len(self.fired)
        self.fired[event] = max(self.gpu_free, self.cpu)
        return event

    def sync(self) -> None:
        self.cpu = max(self.cpu, self.gpu_free)

    def seconds(self, start: int, end: int) -> float:
        return self.fired[end] - self.fired[start]

    def backlog(self, seconds: float) -> None:
        self.launch(seconds, 0.0)


class FakeLayer:
    """``kernels`` kernels per pass, each ``gpu_s`` on the GPU and ``issue_s`` to issue."""

    def __init__(self, device: FakeDevice, kernels: int, gpu_s: float, issue_s: float) -> None:
        self.device, self.kernels, self.gpu_s, self.issue_s = device, kernels, gpu_s, issue_s

    def forward(self) -> None:
        for _ in range(self.kernels):
            self.device.launch(self.gpu_s, self.issue_s)

    def backward(self, state: object) -> None:
        for _ in range(2 * self.kernels):
            self.device.launch(self.gpu_s, self.issue_s)


@pytest.mark.parametrize("gpu_s, issue_s", [(50e-6, 10e-6), (10e-6, 50e-6)])
def test_the_backlog_separates_the_gpus_time_from_the_cpus(gpu_s: float, issue_s: float) -> None:
    """Behind a backlog the events time the kernels alone and the wall clock the issuing alone,
    whichever is longer. Timed with events alone (the queue empty), a launch-bound layer reads
    as its issue time: the GPU waited for each kernel."""
    device = FakeDevice()
    layer = FakeLayer(device, kernels=20, gpu_s=gpu_s, issue_s=issue_s)
    (timing,) = backlog_timings([layer], device, device.backlog, warmup=1, repeats=3, wall=device.wall)
    assert timing.gpu_forward_s == pytest.approx(20 * gpu_s)
    assert timing.gpu_backward_s == pytest.approx(40 * gpu_s)
    assert timing.issue_forward_s == pytest.approx(20 * issue_s)
    assert timing.issue_backward_s == pytest.approx(40 * issue_s)
    assert not timing.synchronised
    # events alone, as the rounds of profiles/measure.py time a pass: the larger of the two, about
    device.sync()
    start = device.mark()
    layer.forward()
    assert device.seconds(start, device.mark()) == pytest.approx(20 * max(gpu_s, issue_s), rel=0.1)


def test_a_backlog_too_short_for_the_issue_is_lengthened() -> None:
    device = FakeDevice()
    layer = FakeLayer(device, kernels=1000, gpu_s=1e-6, issue_s=50e-6)    # 50 ms to issue
    (timing,) = backlog_timings([layer], device, device.backlog, warmup=0, repeats=1, wall=device.wall,
                                backlog_s=0.01)
    assert timing.gpu_forward_s == pytest.approx(1000e-6)
    assert timing.issue_forward_s == pytest.approx(0.05)


def test_a_pass_that_waits_for_the_gpu_counts_its_gpu_time() -> None:
    """A layer that synchronises (``.item()``) returns after the backlog: its wall time is the
    backlog's, not its issuing; the GPU's time stands in for it."""
    device = FakeDevice()

    class Synchronising(FakeLayer):
        def forward(self) -> None:
            super().forward()
            self.device.sync()

    layer = Synchronising(device, kernels=10, gpu_s=20e-6, issue_s=5e-6)
    (timing,) = backlog_timings([layer], device, device.backlog, warmup=0, repeats=1, wall=device.wall)
    assert timing.synchronised
    assert timing.issue_forward_s == timing.gpu_forward_s == pytest.approx(200e-6)


def test_the_harness_is_taken_off_both_clocks() -> None:
    figures = [LayerMeasurement(0.0, 0.0, 0, 0, [], [])]
    record_issue(figures, [IssueTiming(3e-4, 5e-4, 7e-4, 9e-4)], IssueTiming(1e-5, 2e-5, 5e-5, 6e-5))
    f = figures[0]
    assert (f.forward_s, f.backward_s, f.issue_forward_s, f.issue_backward_s) == pytest.approx(
        (2.9e-4, 4.8e-4, 6.5e-4, 8.4e-4))


# --------------------------------------------------------------------------- the planner's rule
def test_a_pass_takes_the_larger_sum_then_its_fixed_part() -> None:
    rng = random.Random(3)
    L = 6
    gpu_f = [rng.uniform(1e-4, 1e-3) for _ in range(L)]
    gpu_b = [2 * x for x in gpu_f]
    issue_f = [rng.uniform(1e-4, 1e-3) for _ in range(L)]
    issue_b = [rng.uniform(2e-4, 2e-3) for _ in range(L)]
    fig = make_figures(gpu_f, gpu_b, issue=(issue_f, issue_b))
    cm = CostModel(fig, Setting(stages=2, micro_batches=4, schedule="1f1b", overhead_s=1e-5))
    for s in range(L):
        for e in range(s + 1, L + 1):
            assert cm.forward(s, e) == pytest.approx(max(sum(gpu_f[s:e]), sum(issue_f[s:e])) + 1e-5)
            assert cm.whole_backward(s, e, False) == pytest.approx(max(sum(gpu_b[s:e]), sum(issue_b[s:e])) + 1e-5)
            # a recomputing backward issues the forward again
            rerun = max(sum(gpu_b[s:e]) + sum(gpu_f[s:e]), sum(issue_b[s:e]) + sum(issue_f[s:e]))
            assert cm.whole_backward(s, e, True) == pytest.approx(rerun + 1e-5)
            budget = cm.forward(s, e)
            assert cm.forward_reach(s, budget) >= e and cm.forward(s, cm.forward_reach(s, budget)) <= budget
    # without issue times: the GPU's sums, as before
    plain = CostModel(make_figures(gpu_f, gpu_b), Setting(stages=2, micro_batches=4, schedule="1f1b"))
    assert plain.forward(0, L) == pytest.approx(sum(gpu_f))


def test_a_launch_bound_one_stage_plan_is_predicted_at_the_cpus_pace() -> None:
    """One stage of layers that the CPU issues twice as slowly as the GPU runs them: the step is
    the issue time's, not the GPU's."""
    fig = make_figures([1e-3] * 4, [2e-3] * 4, issue=([2e-3] * 4, [4e-3] * 4))
    from gpipe_plan.planner.objective import evaluate

    step = evaluate(CostModel(fig, Setting(stages=1, micro_batches=2, schedule="1f1b")), (0, 4)).step_s
    assert step == pytest.approx(2 * (8e-3 + 16e-3))


def test_a_profile_with_issue_times_reads_them_and_one_without_does_not() -> None:
    doc = profile_doc(L=4, batch_size=4)
    sizes = doc["micro_batch_sizes"]
    assert Profile(json.loads(json.dumps(doc))).at(sizes[0]).issue_forward_s is None
    for layer in doc["layers"]:
        layer["issue_forward_s"] = [5e-3 for _ in sizes]
        layer["issue_backward_s"] = [6e-3 for _ in sizes]
    fig = Profile(doc).at(sizes[0])
    assert fig.issue_forward_s == (5e-3,) * 4 and fig.issue_backward_s == (6e-3,) * 4
