"""What a profile records of its host (profile format 9): the cores its plans' ranks share, and
what other processes took from it while it measured (issue 26: a profile measured on a busy host
misleads every plan made from it, so the plans say so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpipe_plan.hostload import CpuSample, busy_phases, window_load
from gpipe_plan.models import model_spec
from gpipe_plan.profiles.profiler import ProfileRequest, profile_model
from gpipe_plan.schema import validate

from helpers.planner import cli, profile_doc


def _sample(wall: float, busy: float, own: float, steal: float = 0.0, cores: int = 2) -> CpuSample:
    return CpuSample(wall, busy, steal, own, 1, "vm", cores)


def test_a_window_is_what_others_used_beside_what_the_work_needed() -> None:
    # 10 s on 2 cores: the host was busy 26 s and 1 s stolen; the profiler used 9 s and needed 1 core
    entry = window_load(_sample(0.0, 100.0, 5.0, steal=2.0), _sample(10.0, 126.0, 14.0, steal=3.0), 1)
    assert entry["cores"] == 2 and entry["needed_cores"] == 1 and entry["window_s"] == pytest.approx(10.0)
    assert entry["run_cores"] == pytest.approx(0.9) and entry["steal_cores"] == pytest.approx(0.1)
    assert entry["other_cores"] == pytest.approx((26 - 9) / 10 + 0.1)
    assert entry["contended_cores"] == pytest.approx(1.8 + 1 - 2)     # what did not fit beside its 1 core
    assert window_load(_sample(0.0, None, 0.0), _sample(1.0, None, 0.0), 1) is None      # not Linux
    calm = {**entry, "contended_cores": 0.05}                         # under a tenth of what it needed
    assert busy_phases({"phases": [{"phase": "layers", **entry}, {"phase": "contention", **calm}]}) == [
        {"phase": "layers", **entry}]
    assert busy_phases(None) == [] and busy_phases({"phases": [{"phase": "layers", **calm}]}) == []


def _spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _tiny_profile() -> dict:
    request = ProfileRequest(spec=model_spec("gpt", layers=1, width=16, heads=2, seq_len=8, vocab_size=32),
                             micro_batch_sizes=[1, 2], device=torch.device("cpu"), warmup=1, repeats=20,
                             contention_processes=0, recompute=False, split_backward=False)
    return profile_model(request)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads the host's load from /proc/stat (Linux)")
def test_a_profile_records_its_cores_and_a_busy_host_beside_it() -> None:
    # The "quiet" profile is measured beside whatever else runs (the other pytest worker's ranks,
    # say), so it need not have its core to itself: it uses at most the one core it needs, and
    # more of it than the busy profile below gets, whose host has as many busy loops added as cores.
    quiet = _tiny_profile()
    validate(quiet, "profile", "quiet")
    assert quiet["device"]["cores"] == len(os.sched_getaffinity(0))
    [alone] = quiet["host_load"]["phases"]
    assert alone["phase"] == "layers" and alone["needed_cores"] == 1 and 0 < alone["run_cores"] <= 1.2, alone
    # As many busy loops as the host has cores: the profiler's one core is taken from it, in part.
    cores = len(os.sched_getaffinity(0))
    spinning = _spinners(cores)
    try:
        time.sleep(0.2)
        busy = _tiny_profile()
    finally:
        for process in spinning:
            process.kill()
            process.wait()
    [layers] = busy["host_load"]["phases"]
    assert layers["other_cores"] > 0.5 * cores and busy_phases(busy["host_load"]) == [layers], layers
    assert layers["run_cores"] < alone["run_cores"], (alone, layers)     # the loops took part of its core


def test_a_plan_and_show_say_the_profile_was_measured_on_a_busy_host(user_dir: Path) -> None:
    window = {"cores": 2, "needed_cores": 1, "run_cores": 0.6, "other_cores": 1.4, "steal_cores": 0.0,
              "window_s": 3.0}
    busy = profile_doc(host_load={"phases": [{"phase": "layers", **window, "contended_cores": 0.4},
                                             {"phase": "contention", **window, "needed_cores": 2,
                                              "contended_cores": 0.05}]})
    quiet = profile_doc(host_load={"phases": [{"phase": "layers", **window, "contended_cores": 0.05}]})
    for name, doc in (("busy.json", busy), ("quiet.json", quiet)):
        Path(name).write_text(json.dumps(doc))
    result = cli("solve", "busy.json", "--stages", "2", "--out", "busy-plan.json")
    assert result.exit_code == 0, result.output
    [said] = [w for w in json.loads(Path("busy-plan.json").read_text())["warnings"] if "busy host" in w]
    assert "other processes took 0.40 of the 1 core it needed while it timed the layers" in said, said
    assert "side by side" not in said          # that phase's 0.05 of 2 cores took nothing it needed
    assert cli("solve", "quiet.json", "--stages", "2", "--out", "quiet-plan.json").exit_code == 0
    assert not [w for w in json.loads(Path("quiet-plan.json").read_text())["warnings"] if "busy host" in w]
    shown = cli("show", "busy.json")
    assert shown.exit_code == 0 and "busy host" in shown.output, shown.output
    assert "busy host" not in cli("show", "quiet.json").output
