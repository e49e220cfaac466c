"""Issue 17, reliability: every solve ends, outputs are all-or-nothing, helpers die with the
profiler, and the small things a careful user runs into (one-line usage errors, a memory limit
rounded the safe way, file modes that follow the umask, flags checked before the work).

Each test can fail: it runs the behaviour the issue found broken and checks the promise.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gpipe_plan.artifacts import BadInput, check_output_paths, write_json_atomic
from gpipe_plan.planner.budgets import LEAST_SETTING_S
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


def run_in_subprocess(code: str, timeout: float) -> tuple[float, str]:
    """Run Python ``code`` in a fresh interpreter: (peak RSS in MiB, its stdout). ``timeout``
    (seconds) only bounds a hang."""
    # VmHWM, the peak of this process's own memory: getrusage's ru_maxrss survives exec, so a
    # child forked from a big pytest process would report the parent's peak.
    wrapped = code + ("\nprint('RSS', next(int(line.split()[1]) for line in open('/proc/self/status') "
                      "if line.startswith('VmHWM:')))\n")
    done = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-2000:]
    rss_kib = int(done.stdout.split("RSS")[-1])
    return rss_kib / 1024, done.stdout


# --------------------------------------------------------------------------- every solve ends
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("bandwidth", [math.inf, 1e3])
def test_negative_and_nan_costs_do_not_make_the_solvers_loop(schedule: str, bandwidth: float) -> None:
    # The schema refuses such profiles; the solvers must end on any numbers regardless (a
    # bisection over thresholds must not walk forever when a cost is negative or NaN).
    figures = make_figures([1e-3, -2e-3, 3e-3, math.nan, 2e-3, 3e-3], [2e-3, 4e-3, -6e-3, 2e-3, 2e-3, 2e-3],
                           recompute_call=-1.0)
    # A solver that walks ends only at its time budget, with an open gap (or, bounded by its step
    # cap, after hundreds of probes): each must instead finish its search, proven, after a few
    # probes or nodes. A bisection over a double's 64 bits that converges takes at most 64.
    for M in (1, 4):
        cm = CostModel(figures, Setting(stages=2, micro_batches=M, schedule=schedule, overhead_s=-0.01,
                                        link_bandwidth_bytes_per_s=bandwidth, link_latency_s=-1.0))
        solvers = [GPipeSolver(cm, time_budget_s=2)] if schedule == "gpipe" else []
        for solver in [*solvers, OneFOneBSolver(cm, time_budget_s=2)]:
            solution = solver.solve()
            assert solution is not None
            assert math.isfinite(solution.evaluation.step_s) and solution.evaluation.step_s >= 0
            assert solution.proven and "out of time" not in solution.method, (M, solution.method)
            assert solution.stats.get("probes", 0) <= 64 and solution.stats.get("nodes", 0) <= 64, solution.stats


class CountedInt(int):
    """An int that counts the divisions and remainders taken of it, and stops a scan past ``most``."""

    most = 0
    used = 0

    def _count(self) -> None:
        self.used += 1
        if self.used > self.most:
            raise AssertionError(f"more than {self.most} trial divisions of {int(self)}")

    def __mod__(self, other):
        self._count()
        return int(self) % other

    def __floordiv__(self, other):
        self._count()
        return int(self) // other

    def __divmod__(self, other):
        self._count()
        return divmod(int(self), other)


def test_divisors_are_found_without_scanning_up_to_the_batch() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1] and divisors(49) == [1, 7, 49]
    assert divisors(2 ** 10 * 3 ** 4) == sorted(2 ** i * 3 ** j for i in range(11) for j in range(5))
    # A prime: the old scan over 1..n took minutes. Trial division up to sqrt(n) needs one remainder
    # per candidate below 31,623 (and a quotient per divisor found); the count stops a scan at once.
    n = 1_000_000_007
    counted = CountedInt(n)
    counted.most = 2 * (math.isqrt(n) + 1)
    assert divisors(counted) == [1, n]
    assert 0 < counted.used <= 2 * (math.isqrt(n) + 1)


def test_a_huge_global_batch_solves_in_bounded_time_and_memory(user_dir: Path) -> None:
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    code = (f"from gpipe_plan.planner.command import solve_file\n"
            f"plan = solve_file({str(user_dir / 'profile.json')!r}, None, stages=2, global_batch_size=1000000007)\n"
            f"print('M', plan['micro_batches'])\n")
    rss_mib, out = run_in_subprocess(code, timeout=60)
    # The micro-batch count is capped: a batch of a billion must not search (or allocate) per micro-batch.
    assert int(out.split("M")[1].split()[0]) <= MAX_MICRO_BATCHES
    assert rss_mib < 300, f"peak RSS {rss_mib:.0f} MiB"


def test_too_many_micro_batches_are_refused_in_one_line(profile_path: Path) -> None:
    result = cli("solve", "profile.json", "-k", "2", "-b", str(2 * MAX_MICRO_BATCHES), "-m",
                 str(2 * MAX_MICRO_BATCHES))
    assert result.exit_code == 2 and len(error_lines(result)) == 1, result.output
    assert "more than the planner considers" in result.output and not Path("plan.json").exists()


# ``gpipe-plan ARGS`` with every setting the search solves (planner/search.py's solve_setting: the
# pipeline's settings and the one-device comparison's) written to settings.json: its stages, the
# work budget it was given, the work its search used (Candidate.work_s) and whether it kept a plan.
RECORD_SETTINGS = """
import inspect, json, sys
import gpipe_plan.planner.search as search
real = search.solve_setting
signature = inspect.signature(real)
solved = []
def recorded(*args, **kwargs):
    candidate = real(*args, **kwargs)
    given = signature.bind(*args, **kwargs).arguments
    solved.append({"stages": given["setting"].stages, "work_budget_s": given.get("work_budget_s"),
                   "work_s": candidate.work_s, "planned": candidate.solution is not None})
    return candidate
search.solve_setting = recorded
from gpipe_plan.cli import main
try:
    main(sys.argv[1:], prog_name="gpipe-plan")
finally:
    with open("settings.json", "w") as f:
        json.dump(solved, f)
"""


@pytest.mark.parametrize("options", [
    ["-k", "2"],                                       # the greedy probes; 1F1B's O(K L^2) tables time out
    ["-k", "8", "--memory-limit", "300MiB"],           # per-stage recompute under a limit: the general DP
])
def test_sixty_thousand_layers_end_within_the_time_budget(user_dir: Path, options: list[str]) -> None:
    write_json(user_dir / "big.json", profile_doc(L=60_000, sizes=(1,), batch_size=2))
    budget, K = 2.0, int(options[1])
    result = subprocess.run([sys.executable, "-c", RECORD_SETTINGS, "solve", "big.json", *options,
                             "--time-budget", str(budget), "-o", "plan.json", "-q"], cwd=user_dir,
                            capture_output=True, text=True, timeout=120,     # a hang guard only
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr
    plan = json.loads((user_dir / "plan.json").read_text())
    assert sum(plan["balance"]) == 60_000
    # What the budget bounds is the searches' work, counted (budgets.WORK_PER_SECOND), not timed:
    # the same on every run, however loaded the machine (how long the whole solve takes, with
    # reading and writing 60,000 layers, is a benchmark's question). Every setting of the pipeline
    # kept a plan, and all the work together stays within the budget, but for the moment each
    # setting gets once it is spent (budgets.LEAST_SETTING_S). (A 1F1B suffix table that looked at
    # its budget only every 64 starts, each scanning up to L ends, took 2.6 s of 2 at K = 2.)
    solved = json.loads((user_dir / "settings.json").read_text())
    pipeline = [s for s in solved if s["stages"] == K]
    assert pipeline and all(s["planned"] for s in pipeline), pipeline
    work = sum(s["work_s"] for s in solved)
    assert 0 < work <= budget + len(solved) * LEAST_SETTING_S, (work, solved)


def test_show_refuses_a_timeline_of_what_is_not_a_plan(profile_path: Path) -> None:
    # (it printed the profile and drew nothing, without a word)
    result = cli("show", "profile.json", "--timeline", "t.svg")
    assert result.exit_code == 2 and not Path("t.svg").exists(), result.output
    assert "--timeline draws a plan's schedule, and 'profile.json' is a profile: give it the plan" in result.output


def test_show_of_json_that_is_not_an_object_says_so(user_dir: Path) -> None:
    # (it said its "format" is None)
    Path("list.json").write_text("[1, 2, 3]")
    result = cli("show", "list.json")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "'list.json' is not a gpipe-plan profile, plan or report: it holds a JSON list, not an object" in result.output


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


# The work each command does once its outputs are checked: any of these called means it started
# the work first. (The inputs named below do not exist either: reading one is work too.)
WORK_OF = {
    "solve": ["gpipe_plan.planner.command:load_profile", "gpipe_plan.planner.command:solve_request"],
    "explore": ["gpipe_plan.planner.command:load_profile", "gpipe_plan.planner.explore:explore"],
    "calibrate": ["gpipe_plan.profiles.command_calibrate:calibrate_command"],
    "import-pipedream": ["gpipe_plan.planner.pipedream:import_pipedream"],
    "show": ["gpipe_plan.artifacts:read_json", "gpipe_plan.planner.command:show_plan"],
    "run": ["gpipe_plan.runtime.command:load_plan", "gpipe_plan.runtime.launch:launch_local"],
    "profile": ["gpipe_plan.profiles.command:resolve_device", "gpipe_plan.profiles.command:profile_model"],
    "demo": ["gpipe_plan.demo:_demo"],
}


def forbid_work(monkeypatch: pytest.MonkeyPatch, command: str) -> list[str]:
    """Replace ``command``'s work (WORK_OF) by stubs that fail; the list of those called."""
    import importlib

    called: list[str] = []
    for target in WORK_OF[command]:
        module, name = target.split(":")

        def stub(*args, _target=target, **kwargs):
            called.append(_target)
            raise AssertionError(f"{_target} called before the outputs were checked")
        monkeypatch.setattr(importlib.import_module(module), name, stub)
    return called


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
def test_every_command_checks_its_outputs_before_any_work(profile_path: Path, args: list[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    Path("a-folder").mkdir()
    Path("plain-file").write_text("x")
    before = sorted(p.name for p in Path(".").iterdir())
    called = forbid_work(monkeypatch, args[0])
    result = cli(*args)
    assert called == [], f"{args[0]} started its work before refusing its output: {called}"
    assert result.exit_code == 2, result.output
    assert len(error_lines(result)) == 1 and result.output.startswith("error: "), result.output
    assert args[-2] in result.output, result.output                       # it names the output's flag
    assert sorted(p.name for p in Path(".").iterdir()) == before        # no file written


def test_check_output_paths_names_the_flag_and_the_reason(user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_output_paths({"--out": "fine.json", "--timeline": None})
    Path("sub").mkdir()
    with pytest.raises(BadInput, match="--out 'sub': it is a folder"):
        check_output_paths({"--out": "sub"})
    with pytest.raises(BadInput, match="--report 'nope/r.json': folder 'nope' does not exist"):
        check_output_paths({"--report": "nope/r.json"})
    # A folder the permissions deny. (chmod 555 would deny nothing to root, who may write anywhere,
    # so the test says what the permissions say: os.access refuses the folder "sub".)
    access = os.access

    def denied(path, mode, *args, **kwargs) -> bool:
        if Path(path).resolve() == (user_dir / "sub").resolve() and mode & os.W_OK:
            return False
        return access(path, mode, *args, **kwargs)
    monkeypatch.setattr(os, "access", denied)
    with pytest.raises(BadInput, match=r"^cannot write --out 'sub/x\.json': folder 'sub' is not writable$"):
        check_output_paths({"--out": "sub/x.json"})
    check_output_paths({"--out": "x.json"})            # the folder beside it is writable


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


def test_an_output_that_is_a_device_or_a_pipe_is_written_in_place(user_dir: Path) -> None:
    """``--out /dev/null`` must not put a plain file in the device's place (a rename over it
    did, as root: /dev/null gone for every program on the machine). A target that is not a plain
    file, a named pipe here (no root needed, and nothing lost if this fails), is written in place
    and stays what it was."""
    os.mkfifo("pipe")
    reader = os.open("pipe", os.O_RDONLY | os.O_NONBLOCK)    # (a writer's open waits for a reader)
    try:
        check_output_paths({"--out": "pipe"})
        write_json_atomic("pipe", {"a": 1})
        assert stat.S_ISFIFO(Path("pipe").stat().st_mode)
        assert json.loads(os.read(reader, 1 << 16)) == {"a": 1}
    finally:
        os.close(reader)


def test_an_output_that_is_a_link_is_written_through_it(user_dir: Path) -> None:
    """A link stays a link, and the file it names gets the output (a rename over the link had
    left that file as it was); a dangling link makes the file it names."""
    Path("real.json").write_text("{}")
    Path("link.json").symlink_to("real.json")
    check_output_paths({"--out": "link.json"})
    write_json_atomic("link.json", {"a": 2})
    assert Path("link.json").is_symlink() and json.loads(Path("real.json").read_text()) == {"a": 2}
    Path("dangling.json").symlink_to("made.json")
    write_json_atomic("dangling.json", {"a": 3})
    assert Path("dangling.json").is_symlink() and json.loads(Path("made.json").read_text()) == {"a": 3}


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


def test_bare_gpipe_plan_prints_the_help_on_stderr_with_clicks_exit_code() -> None:
    import click

    if not hasattr(click.exceptions, "NoArgsIsHelpError"):
        pytest.skip("click < 8.2 prints the help of a bare command itself")
    result = cli()
    assert result.exit_code == click.exceptions.NoArgsIsHelpError.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr == cli("--help").stdout             # the whole help, not an error line
    assert "error:" not in result.stderr and "solve" in result.stderr


# ``gpipe-plan ARGS`` that prints "searching" once the search starts (planner/search.py): a signal
# sent then reaches the command itself, not the interpreter while it is still starting.
ANNOUNCE_SEARCH = """
import sys
import gpipe_plan.planner.search as search
real = search.search_pipeline
def announced(*args, **kwargs):
    print("searching", flush=True)
    return real(*args, **kwargs)
search.search_pipeline = announced
from gpipe_plan.cli import main
main(sys.argv[1:], prog_name="gpipe-plan")
"""


def test_ctrl_c_during_a_solve_is_one_line_and_exit_130(user_dir: Path) -> None:
    # 2,000 layers and 4 stages: a search that runs its whole budget (10 s) unless stopped.
    write_json(user_dir / "profile.json", profile_doc(L=2000, batch_size=8))
    proc = subprocess.Popen([sys.executable, "-c", ANNOUNCE_SEARCH, "solve", "profile.json", "-k", "4",
                             "--time-budget", "10", "--out", "plan.json", "-q"], cwd=user_dir, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    try:
        started, _, _ = select.select([proc.stdout], [], [], 60)      # (a hang guard only)
        assert started and proc.stdout.readline() == "searching\n", proc.communicate(timeout=60)
        time.sleep(0.5)                                  # well inside the search
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)          # a hang guard only
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert err == "error: interrupted\n" and out == "", (out, err)
    assert not (user_dir / "plan.json").exists()


def test_the_smallest_memory_limit_is_rounded_up(profile_path: Path) -> None:
    result = cli("solve", "profile.json", "-k", "2", "--memory-limit", "1KiB")
    assert result.exit_code == 2, result.output
    need = result.output.split("the smallest limit that works is ")[1].split(";")[0].strip()
    assert cli("solve", "profile.json", "-k", "2", "--memory-limit", need.replace(" ", "")).exit_code == 0
    assert format_bytes(4.161 * 2**20, round_up=True) == "4.17 MiB"
    assert parse_size("4.17MiB") >= 4.161 * 2**20


def test_demo_refuses_bad_flags_before_profiling(user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    called = forbid_work(monkeypatch, "demo")          # the demo's profile, solve and run
    result = cli("demo", "--steps", "0")
    assert called == [], "the demo started before refusing --steps"
    assert result.exit_code == 2 and "--steps" in result.output and len(error_lines(result)) == 1


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
        # A tethered helper dies as its profiler does (the kernel kills it: lifeline.py), a moment
        # later; an untethered one would live on through its 9 cycles of timing, 2 x 0.4 s each
        # (profiles/contention.py: 7 s at least, on any machine). Waiting up to 5 s tells the two apart.
        deadline = time.monotonic() + 5
        while leftover_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
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
