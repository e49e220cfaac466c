"""What the host's other processes took from a run (gpipe_plan/hostload.py; issue 26, item 4 and
issue 31, item 1): read from /proc/stat, the run's own processes taken out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpipe_plan import hostload
from gpipe_plan.hostload import CpuSample, busy_hosts, contended_cores, cpu_times_s, host_load, load_text

STAT = """cpu  1000 200 300 5000 40 0 60 70 0 0
cpu0 400 100 100 2500 20 0 30 30 0 0
cpu1 600 100 200 2500 20 0 30 40 0 0
intr 12345
"""


def test_busy_and_stolen_time_are_read_per_cpu_from_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    tick = os.sysconf("SC_CLK_TCK")
    # busy = user + nice + system + irq + softirq; idle and iowait are not; steal apart
    assert cpu_times_s(None, str(stat)) == pytest.approx(((1000 + 200 + 300 + 60) / tick, 70 / tick))
    assert cpu_times_s([1], str(stat)) == pytest.approx(((600 + 100 + 200 + 30) / tick, 40 / tick))
    assert cpu_times_s([0, 1], str(stat)) == pytest.approx(((1560) / tick, 70 / tick))
    assert cpu_times_s(None, str(tmp_path / "absent")) is None          # not Linux
    assert cpu_times_s([7], str(stat)) is None                            # no such CPU


def sample(wall: float, busy: float, own: float, pid: int = 1, host: str = "vm", steal: float = 0.0,
           cores: int = 2) -> CpuSample:
    return CpuSample(wall, busy, steal, own, pid, host, cores)


def test_the_runs_own_processes_are_taken_out_of_the_hosts_busy_time() -> None:
    # two ranks on one host over 10 s: the host was busy 34 s (and 2 s stolen), the ranks used 9 + 9
    windows = [(0, sample(0.0, 100.0, 1.0, pid=11, steal=5.0), sample(10.0, 134.0, 10.0, pid=11, steal=7.0)),
               (1, sample(0.1, 100.5, 2.0, pid=12), sample(10.1, 134.6, 11.0, pid=12))]
    load = host_load(windows, threads_per_rank=1)
    [host] = load["hosts"]
    assert host["ranks"] == [0, 1] and host["needed_cores"] == 2 and host["run_cores"] == pytest.approx(1.8)
    assert host["steal_cores"] == pytest.approx(0.2)
    assert host["other_cores"] == pytest.approx((34 - 18) / 10 + 0.2)     # the host's, less the run's, plus steal
    assert host["contended_cores"] == pytest.approx(1.8)                   # 2 needed of 2 cores: all of it
    assert load["other_cores"] == host["other_cores"] and busy_hosts(load) == [host]
    assert load_text(host) == ("other processes used 1.80 of the 2 cores during the run, 0.20 of them stolen by "
                               "the hypervisor (the run needed 2)")


def test_a_process_counted_once_and_hosts_apart() -> None:
    # ranks 0 and 1 in one process (one pid): its CPU time counts once; rank 2 on another host
    windows = [(0, sample(0.0, 0.0, 0.0, pid=5), sample(10.0, 10.0, 9.0, pid=5)),
               (1, sample(0.0, 0.0, 0.0, pid=5), sample(10.0, 10.0, 9.0, pid=5)),
               (2, sample(0.0, 0.0, 0.0, pid=5, host="b", cores=64), sample(10.0, 400.0, 10.0, pid=5, host="b", cores=64))]
    load = host_load(windows, threads_per_rank=1)
    first, second = load["hosts"]
    assert first["host"] == "vm" and first["other_cores"] == pytest.approx(0.1)
    assert second["host"] == "b" and second["other_cores"] == pytest.approx(39.0)
    assert second["contended_cores"] == 0.0          # 39 of 64 cores leave room for the one it needed
    assert busy_hosts(load) == []                    # 0.1 of 2 needed cores is under BUSY_SHARE
    assert host_load([(0, sample(0.0, None, 0.0), sample(1.0, None, 1.0))], 1) is None   # not Linux


def test_contended_cores_are_what_did_not_fit_beside_the_run() -> None:
    assert contended_cores(1.6, 2, 2) == pytest.approx(1.6)
    assert contended_cores(1.6, 1, 2) == pytest.approx(0.6)
    assert contended_cores(10.0, 2, 64) == 0.0
    assert contended_cores(0.0, 4, 2) == 0.0         # oversubscribed by the run itself: not the others'


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux only")
def test_a_busy_neighbour_is_seen_and_this_process_is_not() -> None:
    """A child process that spins for one CPU-second is another process: at least that much of
    others' time is seen over the window (more where others share the machine), and this
    process, which waited, used little."""
    before = hostload.sample()
    spin = "import time\nwhile time.process_time() < 1.0: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    after = hostload.sample()
    [host] = host_load([(0, before, after)], threads_per_rank=1)["hosts"]
    assert host["other_cores"] * host["window_s"] >= 0.9          # the child's second, less a tick or so
    assert host["run_cores"] * host["window_s"] < 0.5             # this process's own time is not others'
