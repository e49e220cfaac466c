"""bench/fidelity.py (`python -m bench fidelity`): the default against the fastest plan, round by round."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fidelity(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT))    # bench/ is the repository's, not the package's
    from bench import fidelity

    return fidelity


def _cell(default_runs: list[float], other_runs: list[float]) -> dict:
    plan = {"predicted_step_s": 0.05, "same_as": None, "schedule": "1f1b", "virtual_stages": 1, "micro_batches": 2,
            "balance": [3, 3]}
    plans = {name: {**plan, "same_as": name} for name in ("zb-h1", "1f1b")}
    plans["default"] = {**plan, "same_as": "1f1b"}
    plans["default without fixed costs"] = {**plan, "same_as": "zb-h1"}
    return {"measured_step_s": {"1f1b": default_runs, "zb-h1": other_runs}, "plans": plans}


def test_rounds_won_compares_the_runs_of_one_round(fidelity):
    assert fidelity.rounds_won([0.050, 0.070, 0.049], [0.051, 0.052, 0.050]) == (2, 3)
    assert fidelity.rounds_won([0.060, 0.061], [0.050, 0.052, 0.051]) == (0, 2)    # only rounds both ran


def test_the_summary_says_in_how_many_rounds_the_default_beat_the_fastest(fidelity):
    # The default's median is 16% slower, yet it won two of the three rounds: the host moved, not the plan.
    data = {"models": {"gpt": {"2": _cell([0.048, 0.058, 0.060], [0.049, 0.059, 0.050])}}}
    (d,) = fidelity.summary(data)["defaults"]
    assert d["fastest"] == "zb-h1" and d["default_won"] == (2, 3) and fidelity._won_text(d) == "2 of 3"
    data = {"models": {"gpt": {"2": _cell([0.040, 0.041, 0.042], [0.050, 0.051, 0.052])}}}
    (d,) = fidelity.summary(data)["defaults"]
    assert d["fastest"] == "1f1b" and fidelity._won_text(d) == "-"      # the default is the fastest
