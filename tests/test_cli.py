"""Issue 17, reliability: every solve ends, outputs are all-or-nothing, helpers die with the
profiler, and the small things a careful user runs into (one-line usage errors, a memory limit
rounded the safe way, file modes that follow the umask, flags checked before the work).

Each test can fail: it runs the behaviour the issue found broken and checks the promise.
"""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gpipe_plan.artifacts import BadInput, check_output_paths, write_json_atomic
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.gpipe_solver import GPipeSolver
from gpipe_plan.planner.onefoneb import OneFOneBSolver
from gpipe_plan.planner.settings import MAX_MICRO_BATCHES, divisors
from gpipe_plan.units import format_bytes, parse_size

from helpers.planner import cli, make_figures, profile_doc, write_json
from helpers.cli_process import leftover_processes

BIN = Path(sys.executable).parent


def error_lines(result) -> list[str]:
    """The non-empty lines a CliRunner result printed (stderr is mixed into output)."""
    return [line for line in result.output.splitlines() if line.strip()]


@pytest.fixture
def profile_path(user_dir: Path) -> Path:
    return write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))


def run_in_subprocess(code: str, timeout: float) -> tuple[float, float, str]:
    """Run Python ``code`` in a fresh interpreter: (wall seconds, peak RSS in MiB, its stdout)."""
    # VmHWM, the peak of this process's own memory: getrusage's ru_maxrss survives exec, so a
    # child forked from a big pytest process would report the parent's peak.
    wrapped = code + ("\nprint('RSS', next(int(line.split()[1]) for line in open('/proc/self/status') "
                      "if line.startswith('VmHWM:')))\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    rss_kib = int(done.stdout.split("RSS")[-1])
    return seconds, rss_kib / 1024, done.stdout


# --------------------------------------------------------------------------- every solve ends
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("bandwidth", [math.inf, 1e3])
def test_negative_and_nan_costs_do_not_make_the_solvers_loop(schedule: str, bandwidth: float) -> None:
    # The schema refuses such profiles; the solvers must end on any numbers regardless (a
    # bisection over thresholds must not walk forever when a cost is negative or NaN).
    figures = make_figures([1e-3, -2e-3, 3e-3, math.nan, 2e-3, 3e-3], [2e-3, 4e-3, -6e-3, 2e-3, 2e-3, 2e-3],
                           recompute_call=-1.0)
    for M in (1, 4):
        cm = CostModel(figures, Setting(stages=2, micro_batches=M, schedule=schedule, overhead_s=-0.01,
                                        link_bandwidth_bytes_per_s=bandwidth, link_latency_s=-1.0))
        started = time.monotonic()
        for solution in (GPipeSolver(cm, time_budget_s=2).solve() if schedule == "gpipe" else None,
                         OneFOneBSolver(cm, time_budget_s=2).solve()):
            if solution is not None:
                assert math.isfinite(solution.evaluation.step_s) and solution.evaluation.step_s >= 0
        assert time.monotonic() - started < 5


def test_divisors_are_found_without_scanning_up_to_the_batch() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1] and divisors(49) == [1, 7, 49]
    started = time.monotonic()
    assert divisors(1_000_000_007) == [1, 1_000_000_007]     # a prime: the old scan took minutes
    assert time.monotonic() - started < 1


def test_a_huge_global_batch_solves_in_bounded_time_and_memory(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    code = (f"from gpipe_plan.planner.command import solve_file\n"
            f"plan = solve_file({str(user_dir / 'profile.json')!r}, None, stages=2, global_batch_size=1000000007)\n"
            f"print('M', plan['micro_batches'])\n")
    seconds, rss_mib, out = run_in_subprocess(code, timeout=60)
    # The micro-batch count is capped: a batch of a billion must not search (or allocate) per micro-batch.
    assert int(out.split("M")[1].split()[0]) <= MAX_MICRO_BATCHES
    assert rss_mib < 300, f"peak RSS {rss_mib:.0f} MiB"
    assert seconds < 30


def test_too_many_micro_batches_are_refused_in_one_line(profile_path: Path) -> None:
    result = cli("solve", "profile.json", "-k", "2", "-b", str(2 * MAX_MICRO_BATCHES), "-m",
                 str(2 * MAX_MICRO_BATCHES))
    assert result.exit_code == 2 and len(error_lines(result)) == 1, result.output
    assert "more than the planner considers" in result.output and not Path("plan.json").exists()


@pytest.mark.parametrize("options", [
    ["-k", "2"],                                       # the greedy probes; 1F1B's O(K L^2) tables time out
    ["-k", "8", "--memory-limit", "300MiB"],           # per-stage recompute under a limit: the general DP
])
def test_sixty_thousand_layers_end_within_the_time_budget(user_dir: Path, options: list[str]) -> None:
    write_json(user_dir / "big.json", profile_doc(L=60_000, sizes=(1,), batch_size=2))
    started = time.monotonic()
    result = subprocess.run([str(BIN / "gpipe-plan"), "solve", "big.json", *options, "--time-budget", "2",
                             "-o", "plan.json", "-q"], cwd=user_dir, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    plan = json.loads((user_dir / "plan.json").read_text())
    assert sum(plan["balance"]) == 60_000
    # 2 s of search, the one-stage baseline's share, and reading and writing 60,000 layers.
    assert seconds < 25, f"{seconds:.1f} s"


def test_show_refuses_a_timeline_of_what_is_not_a_plan(profile_path: Path) -> None:
    # (it printed the profile and drew nothing, without a word)
    result = cli("show", "profile.json", "--timeline", "t.svg")
    assert result.exit_code == 2 and not Path("t.svg").exists(), result.output
    assert "--timeline draws a plan's schedule, and 'profile.json' is a profile: give it the plan" in result.output


def test_time_budget_must_be_positive(profile_path: Path) -> None:
    result = cli("solve", "profile.json", "-k", "2", "--time-budget", "0")
    assert result.exit_code == 2 and "--time-budget" in result.output and not Path("plan.json").exists()


# --------------------------------------------------------------------------- all-or-nothing outputs
def test_solve_with_an_unwritable_timeline_leaves_the_plan_untouched(profile_path: Path) -> None:
    Path("plan.json").write_text("old")
    result = cli("solve", "profile.json", "-k", "2", "--out", "plan.json", "--timeline", "missing-dir/t.svg")
    assert result.exit_code == 2 and len(error_lines(result)) == 1, result.output
    assert "--timeline" in result.output and "does not exist" in result.output
    assert Path("plan.json").read_text() == "old"


@pytest.mark.parametrize("args", [
    ["solve", "profile.json", "-k", "2", "--out", "a-folder"],
    ["explore", "profile.json", "--json", "missing/x.json"],
    ["explore", "profile.json", "--chart", "a-folder"],
    ["calibrate", "report.json", "--out", "missing/x.json"],
    ["import-pipedream", "graph.txt", "--out", "missing/x.json"],
    ["show", "plan.json", "--timeline", "missing/t.svg"],
    ["run", "plan.json", "--report", "missing/r.json"],
    ["run", "plan.json", "--trace", "a-folder"],
    ["run", "plan.json", "--save", "plain-file/model.pt"],
    ["profile", "gpt", "--out", "missing/p.json"],
    ["demo", "--out-dir", "plain-file"],
])
def test_every_command_checks_its_outputs_before_any_work(profile_path: Path, args: list[str]) -> None:
    Path("a-folder").mkdir()
    Path("plain-file").write_text("x")
    before = sorted(p.name for p in Path(".").iterdir())
    started = time.monotonic()
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert len(error_lines(result)) == 1 and result.output.startswith("error: "), result.output
    assert args[-2] in result.output, result.output                       # it names the output's flag
    assert sorted(p.name for p in Path(".").iterdir()) == before        # no file written
    assert time.monotonic() - started < 5                                # refused before any work


def test_check_output_paths_names_the_flag_and_the_reason(user_dir: Path) -> None:
    check_output_paths({"--out": "fine.json", "--timeline": None})
    Path("sub").mkdir()
    with pytest.raises(BadInput, match="--out 'sub': it is a folder"):
        check_output_paths({"--out": "sub"})
    with pytest.raises(BadInput, match="--report 'nope/r.json': folder 'nope' does not exist"):
        check_output_paths({"--report": "nope/r.json"})
    if os.geteuid() != 0:    # root may write anywhere: the check cannot fail for it
        Path("sub").chmod(0o555)
        try:
            with pytest.raises(BadInput, match="is not writable"):
                check_output_paths({"--out": "sub/x.json"})
        finally:
            Path("sub").chmod(0o755)


# --------------------------------------------------------------------------- file modes
def test_outputs_follow_the_umask_and_keep_an_existing_files_mode(user_dir: Path) -> None:
    previous = os.umask(0o022)
    try:
        write_json_atomic("new.json", {"a": 1})
        assert stat.S_IMODE(Path("new.json").stat().st_mode) == 0o644
        os.umask(0o077)
        write_json_atomic("private.json", {"a": 1})
        assert stat.S_IMODE(Path("private.json").stat().st_mode) == 0o600
        Path("shared.json").write_text("{}")
        Path("shared.json").chmod(0o664)
        write_json_atomic("shared.json", {"a": 2})     # overwritten: keeps 0664, not mkstemp's 0600
        assert stat.S_IMODE(Path("shared.json").stat().st_mode) == 0o664
        assert json.loads(Path("shared.json").read_text()) == {"a": 2}
    finally:
        os.umask(previous)


# --------------------------------------------------------------------------- small things
@pytest.mark.parametrize("args, help_of", [
    (["solve", "profile.json", "-k", "2", "--bogus"], "main solve"),    # (click's test runner calls it main)
    (["solve"], "main solve"),
    (["solve", "profile.json", "-k", "2", "--schedule", "nope"], "main solve"),
    (["solve", "profile.json", "-k", "two"], "main solve"),
    (["solve", "profile.json", "-k"], "main solve"),     # (click gives this one no context)
    (["no-such-command"], "main"),
])
def test_click_usage_errors_are_one_line_and_exit_2(profile_path: Path, args: list[str], help_of: str) -> None:
    result = cli(*args)
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert lines[0].endswith(f"(see '{help_of} --help')"), result.output


def test_help_and_version_still_exit_0() -> None:
    assert cli("--help").exit_code == 0 and cli("solve", "--help").exit_code == 0
    assert cli("--version").exit_code == 0


def test_the_smallest_memory_limit_is_rounded_up(profile_path: Path) -> None:
    result = cli("solve", "profile.json", "-k", "2", "--memory-limit", "1KiB")
    assert result.exit_code == 2, result.output
    need = result.output.split("the smallest limit that works is ")[1].split(";")[0].strip()
    assert cli("solve", "profile.json", "-k", "2", "--memory-limit", need.replace(" ", "")).exit_code == 0
    assert format_bytes(4.161 * 2**20, round_up=True) == "4.17 MiB"
    assert parse_size("4.17MiB") >= 4.161 * 2**20


def test_demo_refuses_bad_flags_before_profiling(user_dir: Path) -> None:
    started = time.monotonic()
    result = cli("demo", "--steps", "0")
    assert result.exit_code == 2 and "--steps" in result.output and len(error_lines(result)) == 1
    assert time.monotonic() - started < 2      # refused before any profiling (which takes many seconds)


# --------------------------------------------------------------------------- orphans
def children_of(pid: int) -> list[int]:
    """The direct children of ``pid``, from /proc (every thread's list)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_contention_helpers_die_with_a_killed_profiler(user_dir: Path, how: signal.Signals) -> None:
    mark = uuid.uuid4().hex
    env = dict(os.environ, GPIPE_PLAN_TEST_MARK=mark, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([str(BIN / "gpipe-plan"), "profile", "gpt", "--layers", "1", "--width", "32",
                             "--heads", "2", "--seq-len", "8", "--micro-batch-sizes", "1", "--warmup", "0",
                             "--repeats", "1", "--no-recompute-timing", "--contention-processes", "2",
                             "--no-fixed-costs", "--out", "p.json", "-q"], cwd=user_dir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        helpers: list[int] = []
        while time.monotonic() < deadline and proc.poll() is None:
            helpers = [c for c in children_of(proc.pid)
                       if "multiprocessing" in _cmdline(c)]
            workers = [c for c in helpers if "spawn_main" in _cmdline(c)]
            if len(workers) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None and len(workers) >= 2, "the profiler never started its helpers"
        time.sleep(0.5)                       # let them get into their imports and timing
        proc.send_signal(how)
        proc.wait(10)
        time.sleep(1.0)
        assert leftover_processes(mark) == [], "helpers outlived the profiler"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in leftover_processes(mark):
            os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
