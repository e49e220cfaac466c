"""The asynchronous schedules checked against numbers worked out by hand, not by their own rules.

- The weights each micro-batch meets, on a two-stage scalar model (y = b * a * x) whose
  gradients are written out: pipedream's stage 0 one update stale and stage 1 none (PipeDream,
  SOSP 2019: stage k of K is K - 1 - k updates behind), 2bw's W(t+1) = W(t) - lr * grad f_t(W(t-1))
  with f_t the mean over step t's micro-batches (PipeDream-2BW, ICML 2021). The versions are a
  table here, not ``weight_versions.version_used``.
- The planner's one-time fill and drain on a profile whose stages pay for their updates: the
  step played alone must pay them too, else the updates in the period cancel the fill.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from gpipe_plan.runtime.async_reference import reference_run

LR = 0.1
X = [0.5, -1.0, 2.0, 1.5, -0.5, 1.0]      # one row per micro-batch, in run order
T = [1.0, 0.5, -1.0, 2.0, 0.25, -0.75]
A0, B0 = 0.8, -0.6


class _Scale(nn.Module):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


def _half_square(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((y - t) ** 2).mean()


def _grads(a: float, b: float, x: float, t: float) -> tuple[float, float]:
    """d/da and d/db of 0.5 (b a x - t)^2."""
    r = b * a * x - t
    return r * b * x, r * a * x


def _run(schedule: str, steps: int, M: int) -> tuple[float, float, list[float]]:
    stages = [_Scale(A0), _Scale(B0)]
    batches = [((torch.tensor([[x] for x in X[s * M:(s + 1) * M]], dtype=torch.float64),),
                torch.tensor([[t] for t in T[s * M:(s + 1) * M]], dtype=torch.float64)) for s in range(steps)]
    losses = reference_run(stages, _half_square, batches, schedule, M, lambda ps: torch.optim.SGD(ps, lr=LR))
    return float(stages[0].w.detach()), float(stages[1].w.detach()), losses


def test_pipedream_stage_0_is_one_update_stale_and_stage_1_none_by_hand() -> None:
    # K = 2, M = 2, 3 steps: micro-batches 0..5. Stage 0 runs F0 F1 B0 F2 B1 F3 ...: micro-batch
    # i's forward (and backward) meets a after max(0, i - 1) of its updates; stage 1 runs
    # F0 B0 F1 B1 ...: micro-batch i meets b after i updates. Each backward updates the newest.
    a, b = [A0], [B0]
    meets = [(0, 0), (0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]   # (a's version, b's version) per micro-batch
    losses = []
    for i, (va, vb) in enumerate(meets):
        ga, gb = _grads(a[va], b[vb], X[i], T[i])
        losses.append(0.5 * (b[vb] * a[va] * X[i] - T[i]) ** 2)
        a.append(a[-1] - LR * ga)
        b.append(b[-1] - LR * gb)
    got_a, got_b, got_losses = _run("pipedream", steps=3, M=2)
    assert (got_a, got_b) == pytest.approx((a[-1], b[-1]), abs=1e-5)
    assert got_losses == pytest.approx([(losses[2 * s] + losses[2 * s + 1]) / 2 for s in range(3)], abs=1e-5)
    # The staleness is real: plain SGD per micro-batch ends elsewhere.
    sa, sb = A0, B0
    for x, t in zip(X, T):
        ga, gb = _grads(sa, sb, x, t)
        sa, sb = sa - LR * ga, sb - LR * gb
    assert abs(sa - a[-1]) + abs(sb - b[-1]) > 1e-3


def test_2bw_updates_with_the_mean_gradient_one_update_old_by_hand() -> None:
    # K = 2, M = 2 (>= K - 1), 3 steps. Step t's micro-batches meet W(max(0, t - 1)) on both
    # stages; one update a step, of the mean gradient over the step's two micro-batches, applied
    # to the newest: W1 = W0 - lr g0(W0), W2 = W1 - lr g1(W0), W3 = W2 - lr g2(W1).
    W = [(A0, B0)]
    losses = []
    for t in range(3):
        va, vb = W[max(0, t - 1)]
        grads = [_grads(va, vb, X[2 * t + m], T[2 * t + m]) for m in range(2)]
        losses.append(sum(0.5 * (vb * va * X[2 * t + m] - T[2 * t + m]) ** 2 for m in range(2)) / 2)
        a, b = W[-1]
        W.append((a - LR * (grads[0][0] + grads[1][0]) / 2, b - LR * (grads[0][1] + grads[1][1]) / 2))
    got_a, got_b, got_losses = _run("pipedream-2bw", steps=3, M=2)
    assert (got_a, got_b) == pytest.approx(W[-1], abs=1e-5)
    assert got_losses == pytest.approx(losses, abs=1e-5)


# ---------------------------------------------------------------------------- the planner
@pytest.mark.parametrize("schedule, optimizer_s, period", [
    ("pipedream", 3.0, 6.0),          # 1 + 2 of F + B, and an update (3) after every micro-batch
    ("pipedream", 0.5, 3.5),
    ("pipedream-2bw", 3.0, 3.75),     # one update a step of M = 4: 3 / 4 a micro-batch
])
def test_the_fill_and_drain_pays_the_updates_the_period_charges(schedule: str, optimizer_s: float,
                                                                 period: float) -> None:
    """Two equal stages (F = 1, B = 2 a micro-batch) that each pay ``optimizer_s`` an update.
    One step alone with each backward followed by its share of the update is 1F1B's
    (M + K - 1) periods, so the one-time fill and drain is one period (K - 1 = 1), what a long
    segment played out in the event simulator pays beyond its periods. Before the fix the step
    alone was played without the updates: 1 (not 3.5) at 0.5, 0 (not 6) at 3."""
    from helpers.planner import make_figures

    from gpipe_plan.planner.costmodel import CostModel, Setting
    from gpipe_plan.planner.objective import evaluate
    from gpipe_plan.planner.asynchronous import update_share
    from gpipe_plan.planner.simulator import simulate_plan

    K, M = 2, 4
    cm = CostModel(make_figures([1.0, 1.0], [2.0, 2.0], optimizer=[optimizer_s] * 2), Setting(K, M, schedule))
    ev = evaluate(cm, (0, 1, 2))
    assert ev.steady_state_period_s == pytest.approx(period)
    assert ev.step_s == pytest.approx(M * period)
    assert ev.fill_drain_s == pytest.approx((K - 1) * period)
    folded = [dataclasses.replace(c.times(), backward_s=c.backward_s + update_share(cm) * st.optimizer_s)
              for c, st in zip(ev.chunks, ev.stages)]
    steps = 30
    played = simulate_plan(schedule, K, M, 1, folded, steps=steps).makespan_s
    assert played - steps * M * period == pytest.approx(ev.fill_drain_s)
