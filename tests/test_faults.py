"""Issue 28, faults during real work: no lost or mixed checkpoints, replicas that agree, no hang,
and one line for what a user can fix.

Each test runs what the fault campaign found broken and checks the promise. Faults the tests
cannot cause for real without root (a full disk) are injected where the system reports them:
``os.fsync`` or a write failing with ENOSPC, or a file-size limit (``RLIMIT_FSIZE``: a write past
it fails with EFBIG, since Python ignores SIGXFSZ) in a subprocess.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpipe_plan.artifacts import HOST_TAG, BadInput, Outputs, check_output_paths, write_json_atomic, write_text_atomic
from gpipe_plan.runtime import checkpoint_dir
from gpipe_plan.runtime.options import RunOptions, check_options

from handplan import hand_plan
from planner_helpers import cli, profile_doc, write_json
from test_runtime_multiproc import GPT

BIN = Path(sys.executable).parent


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def gpipe_plan(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120,
               preexec_fn=None) -> subprocess.CompletedProcess[str]:
    environment = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    environment.pop("GPIPE_PLAN_FAULT", None)
    return subprocess.run([str(BIN / "gpipe-plan"), *args], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec_fn)


def fake_step(folder: Path, step: int, run: dict | None) -> None:
    """A complete step folder as checkpoint.py leaves one, without its tensors (the folder logic reads only this)."""
    path = checkpoint_dir.step_folder(folder, step)
    path.mkdir(parents=True)
    (path / checkpoint_dir.META_FILE).write_text(json.dumps({"format": "gpipe-plan.checkpoint", "version": 2,
                                                             "step": step, "run": run}))


@pytest.fixture
def gpt_plan(user_dir: Path) -> Path:
    write_json_atomic(user_dir / "plan.json", hand_plan(GPT, [2, 2], micro_batches=2, micro_batch_size=2))
    return user_dir / "plan.json"


# --------------------------------------------------------------------------- 1. mixed checkpoints
def test_a_fresh_run_refuses_a_folder_holding_another_runs_checkpoints(gpt_plan: Path) -> None:
    """Seen: a fresh run pruned its own new steps, keeping another run's higher step numbers."""
    other = {"id": "a" * 32, "started_unix_s": 0, "seed": 0}
    for step in (2, 4, 6):
        fake_step(Path("ckpt"), step, other)
    started = time.monotonic()
    result = cli("run", "plan.json", "--steps", "3", "--checkpoint-dir", "ckpt", "--checkpoint-every", "1")
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output
    assert "already holds checkpoints" in result.output and "--resume" in result.output, result.output
    assert "step 2, 4, 6" in result.output and "seed 0" in result.output
    assert time.monotonic() - started < 5                 # refused before any rank starts
    assert sorted(p.name for p in Path("ckpt").iterdir()) == [".lock", "step-00000002", "step-00000004",
                                                              "step-00000006"]


def test_pruning_keeps_the_runs_own_newest_steps_and_no_other_runs(tmp_path: Path) -> None:
    mine, theirs = {"id": "m" * 32}, {"id": "t" * 32}
    for step in (2, 4, 6):
        fake_step(tmp_path, step, theirs)
    for step in (1, 3, 5):
        fake_step(tmp_path, step, mine)
    fake_step(tmp_path, 7, None)                               # written before steps named their run
    checkpoint_dir.partial_folder(tmp_path, 0).mkdir()          # a killed run's unfinished step
    assert checkpoint_dir.prune(tmp_path, 2, mine["id"]) == [1]
    assert sorted(checkpoint_dir.complete_steps(tmp_path)) == [2, 3, 4, 5, 6, 7]
    assert not checkpoint_dir.partial_folder(tmp_path, 0).exists()
    # A run that resumed a step without a record takes such steps for its own.
    assert checkpoint_dir.prune(tmp_path, 1, mine["id"], adopted=True) == [3, 5]


def test_two_live_runs_cannot_share_a_folder(tmp_path: Path) -> None:
    """Seen: two runs in one folder, one died with an 81-line traceback; now the second is refused."""
    held = checkpoint_dir.claim(tmp_path / "ckpt", resume=False)
    try:
        with pytest.raises(BadInput, match=rf"is in use by another run \(pid {os.getpid()} on .*own --checkpoint-dir"):
            checkpoint_dir.claim(tmp_path / "ckpt", resume=True)
    finally:
        held.release()
    checkpoint_dir.claim(tmp_path / "ckpt", resume=True).release()    # free again once released


def test_the_lock_goes_with_a_killed_run_and_so_do_its_unfinished_steps(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    code = ("import sys, time; from pathlib import Path; from gpipe_plan.runtime import checkpoint_dir as c; "
            f"c.claim(Path({str(folder)!r}), resume=False); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        checkpoint_dir.partial_folder(folder, 3).mkdir()
        with pytest.raises(BadInput, match="in use by another run"):
            checkpoint_dir.claim(folder, resume=True)
    finally:
        holder.kill()
        holder.wait()
    checkpoint_dir.claim(folder, resume=True).release()
    assert not checkpoint_dir.partial_folder(folder, 3).exists()


# --------------------------------------------------------------------------- 3. all outputs or none
class FailingFsync:
    """``os.fsync`` that fails with ENOSPC from its ``n``-th call on: a disk that fills up."""

    def __init__(self, n: int) -> None:
        self.n, self.calls, self.real = n, 0, os.fsync

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if self.calls >= self.n:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.real(fd)


def test_solve_on_a_disk_that_fills_up_keeps_the_old_plan(user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen: the plan was replaced, then the timeline died with a traceback."""
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    Path("plan.json").write_text("old plan")
    with monkeypatch.context() as patched:
        patched.setattr(os, "fsync", FailingFsync(2))     # the plan is written, the timeline is not
        result = cli("solve", "profile.json", "-k", "2", "--out", "plan.json", "--timeline", "t.svg")
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output
    assert "cannot write --timeline 't.svg': no space left on the device" in result.output, result.output
    assert Path("plan.json").read_text() == "old plan" and not Path("t.svg").exists()
    assert leftovers(user_dir) == []


def test_outputs_are_renamed_together_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.txt").write_text("old a")
    with Outputs() as outputs:
        outputs.add(tmp_path / "a.txt", "new a")
        outputs.add(tmp_path / "b.txt", "new b")
        assert (tmp_path / "a.txt").read_text() == "old a"       # nothing visible before the end
    assert (tmp_path / "a.txt").read_text() == "new a" and (tmp_path / "b.txt").read_text() == "new b"
    with pytest.raises(ZeroDivisionError):
        with Outputs() as outputs:
            outputs.add(tmp_path / "a.txt", "newer a")
            1 / 0
    assert (tmp_path / "a.txt").read_text() == "new a" and leftovers(tmp_path) == []


def test_run_whose_trace_cannot_be_written_keeps_the_old_model(gpt_plan: Path) -> None:
    """Seen: --save replaced the model, then --trace failed, and there was no report. The trace
    here is larger than the file-size limit the ranks run under (a write past it fails: EFBIG)."""
    first = gpipe_plan("run", "plan.json", "--steps", "1", "--save", "model.pt", "-q", cwd=gpt_plan.parent)
    assert first.returncode == 0, first.stderr
    old = Path("model.pt").read_bytes()
    limit = 2 * len(old)               # the model (and the report) fit; the trace of 40 steps does not

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = gpipe_plan("run", "plan.json", "--steps", "40", "--seed", "1", "--save", "model.pt", "--trace", "t.json",
                        "--report", "r.json", "-q", cwd=gpt_plan.parent, preexec_fn=small_files)
    assert result.returncode == 2, result.stderr
    assert error_lines(result.stderr) == [f"error: cannot write --trace '{Path('t.json').resolve()}': File too large"]
    assert Path("model.pt").read_bytes() == old, "the old model was replaced"
    assert not Path("t.json").exists() and not Path("r.json").exists() and leftovers(gpt_plan.parent) == []


@pytest.mark.parametrize("args, flags", [
    (["solve", "profile.json", "-k", "2", "--out", "x.svg", "--timeline", "x.svg"], "--out and --timeline"),
    (["explore", "profile.json", "--json", "x.json", "--chart", "./x.json"], "--json and --chart"),
    (["run", "plan.json", "--report", "r.json", "--trace", "r.json"], "--report and --trace"),
    (["export", "plan.json", "--to", "torch", "--out", "s.csv", "--schedule-csv", "s.csv"], "--out and --schedule-csv"),
])
def test_two_outputs_on_one_path_are_refused(gpt_plan: Path, args: list[str], flags: str) -> None:
    """Seen: one of the two was silently lost."""
    write_json(gpt_plan.parent / "profile.json", profile_doc(L=6, batch_size=8))
    before = sorted(p.name for p in Path(".").iterdir())
    result = cli(*args)
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output
    assert f"{flags} both name" in result.output, result.output
    assert sorted(p.name for p in Path(".").iterdir()) == before


def test_an_output_where_no_file_can_be_made_is_one_line(user_dir: Path) -> None:
    """Seen: `solve --out /proc/x.json` and on a full disk: tracebacks (after all the work, for profile)."""
    if Path("/proc/self").exists():
        with pytest.raises(BadInput, match=r"cannot write --out '/proc/x.json': no file can be created in folder"):
            check_output_paths({"--out": "/proc/x.json"})


def test_a_full_disk_is_found_before_the_work(user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    started = time.monotonic()
    result = cli("profile", "gpt", "--out", "p.json")
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output
    assert "cannot write --out 'p.json': no space left on the device holding '.'" in result.output, result.output
    assert time.monotonic() - started < 10 and leftovers(user_dir) == []


# --------------------------------------------------------------------------- 4. leftovers
def test_a_write_killed_before_its_rename_is_cleared_by_the_next_write(user_dir: Path) -> None:
    """Seen: kill -9 during --save left 25 MB of a 100 MB model in a .NAME.*.tmp file, for good."""
    code = ("import os, signal; from gpipe_plan import artifacts; "
            "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL); "
            "artifacts.write_bytes_atomic('model.pt', b'x' * 100000)")
    killed = subprocess.run([sys.executable, "-c", code], cwd=user_dir)
    assert killed.returncode == -signal.SIGKILL
    assert len(leftovers(user_dir)) == 1                       # what the killed writer left
    mine = Path(f".model.pt.{HOST_TAG}.{os.getpid()}.live.tmp")
    mine.write_text("a live writer's")                         # this process is alive: not a leftover
    write_text_atomic("model.pt", "new")
    assert Path("model.pt").read_text() == "new" and leftovers(user_dir) == [mine.name]


def test_a_killed_launchers_folder_is_cleared_by_the_next_run(gpt_plan: Path, tmp_path: Path) -> None:
    """Seen: every killed launcher left an empty /tmp/gpipe-plan-run-* folder."""
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {"TMPDIR": str(temp)}
    launcher = subprocess.Popen([str(BIN / "gpipe-plan"), "run", "plan.json", "--steps", "500", "-q"],
                                cwd=gpt_plan.parent, env=dict(os.environ, PYTHONWARNINGS="ignore", **env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(temp.glob("gpipe-plan-run-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.kill()
    launcher.wait()
    left = list(temp.glob("gpipe-plan-run-*"))
    assert len(left) == 1
    again = gpipe_plan("run", "plan.json", "--steps", "1", "-q", cwd=gpt_plan.parent, env=env)
    assert again.returncode == 0, again.stderr
    assert list(temp.glob("gpipe-plan-run-*")) == []


# --------------------------------------------------------------------------- 9. one line
@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e300, 0.0])
def test_a_timeout_that_cannot_be_one_is_refused_before_the_ranks_start(gpt_plan: Path, timeout: float) -> None:
    """Seen: `run --timeout inf` failed with an OverflowError after 19 s of set-up."""
    with pytest.raises(BadInput, match="--timeout must be a positive number of seconds, at most"):
        check_options(RunOptions(plan=str(gpt_plan), timeout=timeout))
