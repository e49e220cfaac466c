"""bench/async_pipelines.py (`python -m bench async`): its quick run's output, and the rules it leans on."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def part(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT))    # bench/ is the repository's, not the package's
    from bench import async_pipelines

    return async_pipelines


def test_quick_run_writes_every_method_and_the_synchronous_loss_falls(part, tmp_path: Path) -> None:
    part.main(["--quick", "--tasks", "quadratic", "--stages", "2,4", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "data" / "async.json").read_text())
    task = doc["tasks"]["quadratic"]
    assert set(task["runs"]) == {"1f1b@0", "localsgd@0", "pipedream-2bw@0", "pipedream@2", "pipedream@4"}
    for key, run in task["runs"].items():
        assert set(run["curves"]) == {repr(lr) for lr in task["lr_grid"]}
        assert all(len(c) == run["steps_run"] >= task["steps"] == part.QUICK_STEPS for c in run["curves"].values())
        best = part.per_step(task, key)
        assert best["best_lr"] in task["lr_grid"] and best["final"] == min(best["grid_final"].values())
    for method in part.METHODS:
        assert set(task["step_s"][method]) == {"2", "4"}
        assert all(v > 0 for v in task["step_s"][method].values())
        for S in (2, 4):
            # The fixed-time comparison: as many steps as fit in the budget (within the stretch cap).
            run = task["runs"][part.run_key(method, S)]
            within = part.fixed_time(task, part.run_key(method, S), S)
            fits = within["steps"] * within["step_s"] <= task["budget_s"] * (1 + 1e-9)
            assert fits or within["steps"] == 1
            assert within["steps"] == run["steps_run"] or (within["steps"] + 1) * within["step_s"] > task["budget_s"]
    sync = part.per_step(task, "1f1b@0")["losses"]
    assert sync[-1] < 0.5 * sync[0] and all(math.isfinite(v) for v in sync)
    text = (tmp_path / "async.md").read_text()
    assert "| quadratic | pipedream | 4 |" in text and "Does the ordering match" in text
    ET.parse(tmp_path / "async-quadratic.svg")       # well-formed


def test_2bw_trains_the_same_whatever_the_stages(part) -> None:
    """The part trains pipedream-2bw once for every S: the delay is one update on every stage."""
    task = part.make_task("quadratic")
    lr = task.lr_grid[3]
    two, four = (part.train(task, "pipedream-2bw", S, lr, 6) for S in (2, 4))
    assert two == pytest.approx(four, rel=1e-5)
    # ... which pipedream's is not (its stale gradients depend on K).
    assert part.train(task, "pipedream", 2, lr, 6) != pytest.approx(part.train(task, "pipedream", 4, lr, 6), rel=1e-5)


def test_predicted_step_has_a_bubble_only_for_the_synchronous_schedule(part) -> None:
    K, M = 4, 8
    stages = [part.StageCost(1.0, 2.0, 0.0)] * K
    worker = part.StageCost(4.0, 8.0, 0.5)
    assert part.predicted_step_s("1f1b", stages, M, worker) == pytest.approx((M + K - 1) * 3.0)
    assert part.predicted_step_s("pipedream", stages, M, worker) == pytest.approx(M * 3.0)
    assert part.predicted_step_s("localsgd", stages, M, worker) == pytest.approx(12.5)


@pytest.mark.parametrize("S", [2, 4, 8])
def test_the_papers_largest_delay_is_s_squared_less_half_s(part, S: int) -> None:
    delays = part.paper_delays(S)
    assert delays["max"] == S * S - S / 2
    assert delays["own_staleness_per_stage"] == list(range(S - 1, -1, -1))
