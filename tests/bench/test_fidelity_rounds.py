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


class _Readings:
    """A speed probe that reads the given values in turn, and a clock that only counts its sleeps."""

    def __init__(self, values: list[float]) -> None:
        self.values, self.slept = list(values), 0.0

    def read(self) -> float:
        return self.values.pop(0)

    def sleep(self, seconds: float) -> None:
        self.slept += seconds


def test_the_bench_waits_until_the_probe_reads_at_the_hosts_own_speed(fidelity):
    probe = _Readings([0.0062, 0.0090, 0.0085, 0.0066])
    host = fidelity.HostSpeed(probe.read, probe.sleep)
    assert host.read() == 0.0062                    # the host's own speed: the fastest reading
    assert host.wait() == 0.0066                    # 45% and 37% slow: read again; 6% slow: at speed
    assert probe.slept == 2 * fidelity.WAIT_STEP_S and host.waited_s == probe.slept
    slow = _Readings([0.0100] * 100)
    host = fidelity.HostSpeed(slow.read, slow.sleep)
    host.note(0.0060)                               # a profile's reading counts towards the host's speed
    assert host.wait() == 0.0100 and slow.slept == fidelity.WAIT_FOR_SPEED_S    # it gives up, bounded


def _round(probes: list[float], steps: dict[str, float]) -> dict:
    return {"probes_s": probes, "measured_step_s": steps, "others_cores": [0.0] * len(steps)}


def test_a_round_the_probe_read_slow_is_measured_again_at_most_a_few_times(fidelity):
    host = fidelity.HostSpeed(lambda: 0.0060)
    host.read()
    plans = ["zb-h1", "1f1b"]
    # round 0 at speed; then a slow one (a reading 30% slow), measured again at speed; round 2 at speed
    script = [_round([0.0060, 0.0061, 0.0062], {"zb-h1": 0.050, "1f1b": 0.052}),
              _round([0.0061, 0.0078, 0.0062], {"zb-h1": 0.070, "1f1b": 0.060}),
              _round([0.0060, 0.0062, 0.0061], {"zb-h1": 0.051, "1f1b": 0.053}),
              _round([0.0062, 0.0060, 0.0061], {"zb-h1": 0.049, "1f1b": 0.054})]
    orders = []

    def attempt(index: int, order: list[str]) -> dict:
        orders.append(list(order))
        return script[index]

    cell = fidelity.measure_rounds(plans, 3, host, attempt)
    assert cell["measured_step_s"] == {"zb-h1": [0.050, 0.051, 0.049], "1f1b": [0.052, 0.053, 0.054]}
    assert [r["measured_step_s"] for r in cell["rounds_again"]] == [{"zb-h1": 0.070, "1f1b": 0.060}]
    assert len(cell["round_probes_s"]) == 3 and len(cell["others_cores"]) == 6
    # the order alternates over the rounds kept, so a round measured again keeps its order
    assert orders == [plans, plans[::-1], plans[::-1], plans]
    # a host slow throughout: measured again ROUNDS_AGAIN times, then kept as it is
    slow = [_round([0.0060, 0.0090], {"zb-h1": 0.07, "1f1b": 0.07})] * 10
    cell = fidelity.measure_rounds(plans, 2, host, lambda index, order: slow[index])
    assert len(cell["rounds_again"]) == fidelity.ROUNDS_AGAIN and len(cell["measured_step_s"]["zb-h1"]) == 2
