"""Layers timed at the host's own speed ([Note: layers timed at the host's own speed]): a try
whose speed probes read the host slow is timed again, the least slow kept, and a plan says
when even that one was slow."""

from __future__ import annotations

import pytest

from gpipe_plan.models import model_spec
from gpipe_plan.planner.plan import build_plan
from gpipe_plan.planner.profile import Profile
from gpipe_plan.planner.problem import SolveOptions
from gpipe_plan.planner.search import search
from gpipe_plan.profiles import profiler
from gpipe_plan.profiles.profiler import ProfileRequest, profile_model
from gpipe_plan.schema import FORMAT_VERSIONS, PROFILE_FORMAT
from gpipe_plan import speedprobe
from gpipe_plan.speedprobe import LAYER_TRIES

from helpers.planner import profile_doc

TINY_GPT = model_spec("gpt", layers=1, width=16, heads=2, seq_len=8, vocab_size=32)


@pytest.fixture(autouse=True)
def layers_timed_again(monkeypatch) -> None:
    """The retakes as a profile makes them (tests/conftest.py times the layers once elsewhere)."""
    monkeypatch.setattr(speedprobe, "LAYER_TRIES", LAYER_TRIES)


def _probes(monkeypatch, readings: list[float]) -> list[float]:
    """The speed probe reads ``readings`` in turn (then the last one again); returns what is left."""
    left = list(readings)
    monkeypatch.setattr(profiler, "speed_probe_s", lambda device="cpu": left.pop(0) if len(left) > 1 else left[0])
    return left


def _tries(monkeypatch, pairs: list[tuple[float, float]], start: list[float] = (1.0,)):
    """_timed_at_speed with the probe reading ``pairs`` around each try; returns (kept answer,
    kept probes, record, tries run)."""
    _probes(monkeypatch, [p for pair in pairs for p in pair])
    ran = []

    def time_layers() -> int:
        ran.append(len(ran))
        return ran[-1]

    grown = []
    answer, probes, record = profiler._timed_at_speed(time_layers, "cpu", list(start), lambda: grown.append(1))
    assert len(grown) == len(ran) - 1          # the progress told of every try after the first
    return answer, probes, record, len(ran)


def test_a_try_at_the_hosts_speed_is_timed_once(monkeypatch) -> None:
    answer, probes, record, tries = _tries(monkeypatch, [(1.0, 1.05)])
    assert tries == 1 and answer == 0 and probes == [1.0, 1.05]
    assert record == {"fastest_probe_s": 1.0, "layer_tries": [pytest.approx(1.05)]}


def test_a_slow_try_is_timed_again_and_the_one_at_speed_kept(monkeypatch) -> None:
    answer, probes, record, tries = _tries(monkeypatch, [(1.5, 1.0), (1.0, 1.02)])
    assert tries == 2 and answer == 1 and probes == [1.0, 1.02]
    assert record["layer_tries"] == [pytest.approx(1.5), pytest.approx(1.02)]


def test_when_every_try_is_slow_the_least_slow_is_kept(monkeypatch) -> None:
    answer, probes, record, tries = _tries(monkeypatch, [(1.5, 1.6), (1.3, 1.4), (1.8, 1.9)])
    assert tries == LAYER_TRIES == 3 and answer == 1 and probes == [1.3, 1.4]
    assert [round(t, 2) for t in record["layer_tries"]] == [1.6, 1.4, 1.9]


def test_a_faster_probe_around_the_layers_is_the_hosts_own_speed(monkeypatch) -> None:
    # The readings as the profile started were all slow (1.3): the probe around the try (1.0)
    # says what the host's own speed is, and that try is at it.
    answer, probes, record, tries = _tries(monkeypatch, [(1.0, 1.04)], start=[1.3, 1.35])
    assert tries == 1 and record["fastest_probe_s"] == 1.0 and record["layer_tries"] == [pytest.approx(1.04)]


def test_a_profile_times_its_layers_again_while_the_host_ran_slow(monkeypatch) -> None:
    # Two readings as it starts (1.0), then a slow try (1.6 after it), then one at speed.
    _probes(monkeypatch, [1.0, 1.0, 1.0, 1.6, 1.0, 1.01])

    class Units:
        def __init__(self) -> None:
            self.totals, self.done = [], 0

        def begin(self, total: int) -> None:
            self.totals.append(total)

        def step(self, description: str) -> None:
            self.done += 1

    units = Units()
    doc = profile_model(ProfileRequest(spec=TINY_GPT, micro_batch_sizes=[1, 2], warmup=0, repeats=1), units)
    assert doc["version"] == FORMAT_VERSIONS[PROFILE_FORMAT] == 14
    assert doc["measurement"]["host_speed"]["layer_tries"] == [pytest.approx(1.6), pytest.approx(1.01)]
    assert doc["measurement"]["speed_probe_s"] == [1.0, 1.01]          # the kept try's
    assert len(units.totals) == 2 and units.done == units.totals[-1]    # the bar grew by the try and ends full
    assert Profile(doc).layer_slowness == pytest.approx(1.01)


def test_a_plan_says_when_the_layers_were_timed_on_a_slow_host() -> None:
    doc = {**profile_doc(L=4, batch_size=8), "version": FORMAT_VERSIONS[PROFILE_FORMAT]}
    options = SolveOptions(stages=2, global_batch_size=8, micro_batches=4, schedule="1f1b", recompute="never")

    def warnings(tries: list[float] | None) -> list[str]:
        measurement = {"host_speed": {"fastest_probe_s": 0.006, "layer_tries": tries}} if tries else {}
        profile = Profile({**doc, "measurement": measurement})
        return build_plan(profile, "p.json", "0" * 64, options, search(profile, options))["warnings"]

    said = [w for w in warnings([1.6, 1.3, 1.45]) if "slower than its own speed" in w]
    assert len(said) == 1 and "30% slower" in said[0] and "3 tries" in said[0]
    assert not any("slower than its own speed" in w for w in warnings([1.6, 1.05]))
    assert not any("slower than its own speed" in w for w in warnings(None))      # version 12: not read


def test_show_says_how_often_and_how_slow_the_layers_were_timed() -> None:
    from gpipe_plan.profiles.show import _host_speed_line

    assert _host_speed_line(None) is None and _host_speed_line({"layer_tries": [1.05]}) is None
    again = _host_speed_line({"fastest_probe_s": 0.0063, "layer_tries": [1.5, 1.02]})
    assert again.startswith("host speed") and "2 times" in again and "1.50, 1.02x" in again and "say so" not in again
    slow = _host_speed_line({"fastest_probe_s": 0.0063, "layer_tries": [1.5, 1.3, 1.4]})
    assert "slow host" in slow and "(1.30x) kept" in slow and "say so" in slow


def test_every_try_is_measured_against_the_fastest_reading_of_all(monkeypatch) -> None:
    # The second try's probe (0.8) is faster than any reading before it: the first try, 1.5x the
    # readings it had seen, was 1.875x the host's own speed.
    answer, probes, record, tries = _tries(monkeypatch, [(1.5, 1.5), (0.8, 0.82)], start=[1.0])
    assert tries == 2 and answer == 1 and probes == [0.8, 0.82]
    assert record["fastest_probe_s"] == 0.8 and [round(t, 3) for t in record["layer_tries"]] == [1.875, 1.025]
