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
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.cli_process import BIN, gpipe_plan
from gpipe_plan.artifacts import HOST_TAG, BadInput, Outputs, check_output_paths, write_bytes_atomic, write_json_atomic, write_text_atomic
from gpipe_plan.runtime import checkpoint_dir
from gpipe_plan.runtime.options import RunOptions, check_options

from helpers.handplan import hand_plan
from helpers.planner import cli, profile_doc, write_json
from helpers.ranks import GPT, model_spec



def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


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
def never_launch(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """``run``'s launcher replaced by one that records its calls and starts nothing."""
    from gpipe_plan.runtime import launch

    launched: list[tuple] = []

    def record(*args, **kwargs) -> None:
        launched.append(args)
        raise AssertionError("launch_local called: the ranks would start")
    monkeypatch.setattr(launch, "launch_local", record)
    return launched


def test_a_fresh_run_refuses_a_folder_holding_another_runs_checkpoints(gpt_plan: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen: a fresh run pruned its own new steps, keeping another run's higher step numbers."""
    other = {"id": "a" * 32, "started_unix_s": 0, "seed": 0}
    for step in (2, 4, 6):
        fake_step(Path("ckpt"), step, other)
    launched = never_launch(monkeypatch)
    result = cli("run", "plan.json", "--steps", "3", "--checkpoint-dir", "ckpt", "--checkpoint-every", "1")
    assert launched == [], "ranks started before the folder was refused"
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output
    assert "already holds checkpoints" in result.output and "--resume" in result.output, result.output
    assert "step 2, 4, 6" in result.output and "seed 0" in result.output
    assert sorted(p.name for p in Path("ckpt").iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]


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
    import io

    import torch

    from gpipe_plan.models import build_model

    # The old model: the file --save writes (torch.save of the unsplit model's state_dict, the
    # same keys and shapes), made here rather than by a first run (a launch of its own).
    buffer = io.BytesIO()
    torch.save(build_model(GPT, seed=1).module.state_dict(), buffer)
    write_bytes_atomic("model.pt", buffer.getvalue())
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
    from gpipe_plan.profiles import command

    measured: list[tuple] = []

    def measure(*args, **kwargs) -> None:
        measured.append(args)
        raise AssertionError("profile_model called: the measuring would start")
    monkeypatch.setattr(command, "profile_model", measure)
    result = cli("profile", "gpt", "--out", "p.json")
    assert measured == [], "the profiler measured before it found the disk full"
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output
    assert "cannot write --out 'p.json': no space left on the device holding '.'" in result.output, result.output
    assert leftovers(user_dir) == []


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



def test_a_launcher_sent_sigterm_stops_the_ranks_and_says_so(gpt_plan: Path, tmp_path: Path) -> None:
    """Seen: `kill`, `timeout` or a scheduler's SIGTERM ended the launcher at once, in silence (the
    shell's exit 143), its ranks killed by the kernel, its error folder and `.lock` left behind."""
    from helpers.cli_process import leftover_processes

    temp, mark = tmp_path / "temp", "sigterm-" + os.urandom(8).hex()
    temp.mkdir()
    env = dict(os.environ, PYTHONWARNINGS="ignore", TMPDIR=str(temp), GPIPE_PLAN_TEST_MARK=mark)
    env.pop("GPIPE_PLAN_FAULT", None)
    launcher = subprocess.Popen([str(BIN / "gpipe-plan"), "run", "plan.json", "--steps", "100000", "-q",
                                 "--checkpoint-dir", "ckpt", "--checkpoint-every", "2"], cwd=gpt_plan.parent, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        saved = gpt_plan.parent / "ckpt" / "step-00000002"
        deadline = time.monotonic() + 120          # a hang guard only
        while not saved.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)       # the ranks are training
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 143 and "Traceback" not in err, (launcher.returncode, err)
    assert error_lines(err)[-1] == ("error: stopped by SIGTERM: stopped all 2 ranks (the checkpoints saved are kept: "
                                    "--resume continues from the newest)"), err
    assert leftover_processes(mark) == [] and list(temp.glob("gpipe-plan-run-*")) == []
    assert saved.is_dir() and not (gpt_plan.parent / "ckpt" / ".lock").exists()

# --------------------------------------------------------------------------- 9. one line
@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e300])
def test_a_timeout_that_cannot_be_one_is_refused_before_the_ranks_start(gpt_plan: Path, timeout: float) -> None:
    """Seen: `run --timeout inf` failed with an OverflowError after 19 s of set-up."""
    with pytest.raises(BadInput, match="--timeout must be a positive number of seconds, at most"):
        check_options(RunOptions(plan=str(gpt_plan), timeout=timeout))


# --------------------------------------------------------------------------- 2. replicas that agree
NON_TORCH_INIT = '''
import os, random
import torch
from torch import nn


class FromPythonsRandom(nn.Module):
    """A layer initialised from Python's generator, seeded per process: each rank its own weights."""
    def __init__(self):
        super().__init__()
        rng = random.Random(os.getpid())
        self.w = nn.Parameter(torch.tensor([[rng.gauss(0.0, 0.5) for _ in range(6)] for _ in range(6)]))

    def forward(self, x):
        return x @ self.w


class Report(nn.Module):
    """Writes the sum of the parameters this rank holds at each forward (a file per process)."""
    def __init__(self, owner):
        super().__init__()
        self.owner = [owner]

    def forward(self, x):
        total = sum(float(p.detach().double().sum()) for p in self.owner[0].parameters())
        with open(f"sums-{os.getpid()}.txt", "a") as f:
            f.write(repr(total) + "\\n")
        return x


def make():
    body = nn.Sequential(FromPythonsRandom(), nn.Tanh(), nn.Linear(6, 3))
    return nn.Sequential(Report(body), *body)
'''


def test_replicas_start_from_replica_zeros_weights(user_module, user_dir: Path) -> None:
    """Seen: a factory whose initialisation is not torch's seeded generator gave each replica its
    own weights, exited 0, and --save kept replica 0's."""
    from gpipe_plan.models import model_spec
    from helpers.ranks import data_parallel_plan

    spec = model_spec(f"{user_module(NON_TORCH_INIT)}:make", input_shape=[6], num_classes=3)
    write_json(user_dir / "dp.json", data_parallel_plan(spec, [4], 2, micro_batches=2, micro_batch_size=2,
                                                        schedule="gpipe"))
    for old in user_dir.glob("sums-*.txt"):
        old.unlink()          # the plan's own check ran the model here
    result = gpipe_plan("run", "dp.json", "--steps", "2", "-q", cwd=user_dir)
    assert result.returncode == 0, result.stderr
    sums = [f.read_text().split() for f in user_dir.glob("sums-*.txt")]
    assert len(sums) == 2, "one file per rank"
    assert sums[0][0] == sums[1][0], f"the replicas started apart: {sums[0][0]} and {sums[1][0]}"
    assert sums[0][-1] == sums[1][-1], "the replicas ended apart"


# --------------------------------------------------------------------------- 5, 6. no hang
BLOCKING_DATA = '''
import os, time
import torch
from torch import nn


def make():
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def batches(batch_size):
    step = 0
    while True:
        if step == 2 and os.environ.get("RANK") == "0":
            time.sleep(10 ** 6)          # a data source that never answers, on rank 0 only
        yield (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))
        step += 1


def loss(outputs, targets):
    return nn.functional.cross_entropy(outputs[0] if isinstance(outputs, tuple) else outputs, targets)
'''


def test_a_data_factory_that_never_returns_stops_every_rank_naming_it(user_module, user_dir: Path) -> None:
    """Seen: --timeout covered only the waits for a neighbour; a blocked data factory hung the run.
    Rank 1 waits for rank 0's activations and times out too: the line names rank 0, the cause."""
    from gpipe_plan.models import model_spec

    name = user_module(BLOCKING_DATA)
    spec = model_spec(f"{name}:make", data=f"{name}:batches", loss=f"{name}:loss")
    write_json(user_dir / "plan.json", hand_plan(spec, [2, 1], micro_batches=2, micro_batch_size=2))
    # (timeout: a hang guard; the line says the watchdog stopped the run after its 3 s)
    result = gpipe_plan("run", "plan.json", "--steps", "5", "--timeout", "3", "-q", cwd=user_dir, timeout=90)
    assert result.returncode == 1, result.stderr
    last = error_lines(result.stderr)[-1]
    assert last.startswith(f"error: rank 0 made no progress for 3 s at step 3: reading the step's batch (data from "
                           f"'{name}:batches')"), result.stderr
    assert last.endswith("stopped all 2 ranks") and "Traceback" not in result.stderr


STOP_IN_CHECKPOINT = '''
import os, signal
from gpipe_plan.runtime import watchdog

_doing = watchdog.doing


def doing(what, waiting=False):
    # Rank 1 stops itself as it starts writing its checkpoint tensors (a rank that hangs there).
    if os.environ.get("RANK") == "1" and what.startswith("writing its tensors") and "step-00000002" in what:
        with open(os.environ["STOPPED_AT"], "w") as f:
            f.write(what)
        os.kill(os.getpid(), signal.SIGSTOP)
    _doing(what, waiting)


watchdog.doing = doing
'''


def test_a_rank_stuck_in_a_checkpoint_stops_the_run_within_the_timeout(gpt_plan: Path, tmp_path: Path) -> None:
    """Seen: collectives waited max(--timeout, 30 s): 34 s, then a 40-line gloo traceback naming
    neither the rank nor the checkpoint."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(STOP_IN_CHECKPOINT)
    stopped_at = tmp_path / "stopped-at"
    env = {"PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]), "STOPPED_AT": str(stopped_at)}
    result = gpipe_plan("run", "plan.json", "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", "ckpt",
                        "--timeout", "3", "-q", cwd=gpt_plan.parent, env=env, timeout=120)   # a hang guard
    assert stopped_at.exists(), "rank 1 never stopped in its checkpoint"
    assert result.returncode == 1 and len(error_lines(result.stderr)) == 1, result.stderr
    line = result.stderr.strip()
    # Stopped by the watchdog after --timeout (3 s of no progress), not by gloo's own 30 s timeout,
    # whose error is a traceback that names neither the rank nor the checkpoint.
    assert line.startswith("error: rank 0 made no progress for 3 s at step 2: saving checkpoint "), line
    assert "step-00000002' with the other ranks" in line, line
    assert line.endswith("rank(s) 1 stopped (SIGSTOP or a debugger) and said nothing; stopped all 2 ranks"), line


# --------------------------------------------------------------------------- 7, 8. checkpoints
def saved_stage(folder: Path, steps: list[int]):
    """A one-stage run's checkpoints of ``steps``, saved in this process (no process group)."""
    import torch

    from gpipe_plan.models import build_model
    from gpipe_plan.runtime import checkpoint
    from gpipe_plan.runtime.plan import load_plan
    from gpipe_plan.runtime.stage import build_chunk

    write_json_atomic(folder / "one.json", hand_plan(GPT, [4], 1, 4))
    plan = load_plan(folder / "one.json")
    stage = build_chunk(build_model(GPT, seed=0), plan, 0)
    optimizer = torch.optim.Adam(stage.parameters())
    for step in steps:
        checkpoint.save(folder / "ckpt", step, stage, optimizer, {}, {"ranks": 1}, run={"id": "r" * 32})
    return stage, optimizer


def test_a_damaged_newest_checkpoint_is_one_line_naming_the_step_before(tmp_path: Path) -> None:
    """Seen: a 56-line traceback and exit 1: DCP's CheckpointException is a BaseException."""
    from gpipe_plan.runtime import checkpoint

    stage, optimizer = saved_stage(tmp_path, [2, 4])
    shard = checkpoint.step_folder(tmp_path / "ckpt", 4) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(BadInput, match=r"cannot read checkpoint '.*step-00000004' \(damaged\?\): .*; move "
                                       r"'step-00000004' out of the folder to resume from step 2"):
        checkpoint.load(tmp_path / "ckpt", 4, stage, optimizer, {}, seed=0)


def test_a_checkpoint_folder_removed_during_the_run_is_not_made_again(tmp_path: Path) -> None:
    """Seen: the run's next save made the folder again, without its lock; a second run then took
    it, removed this one's unfinished step and mixed its steps in. Now the save refuses."""
    from gpipe_plan.runtime import checkpoint
    from gpipe_plan.runtime.checkpoint_dir import claim, lock_identity

    stage, optimizer = saved_stage(tmp_path, [])
    folder = tmp_path / "ckpt"
    held = claim(folder, resume=False)
    try:
        lock = lock_identity(folder)
        checkpoint.save(folder, 1, stage, optimizer, {}, {"ranks": 1}, lock=lock)   # still ours: saved
        shutil.rmtree(folder)
        with pytest.raises(BadInput, match=r"--checkpoint-dir '.*ckpt' was removed or replaced during the run \(its "
                                           r"lock is gone\): stopped before saving step 2"):
            checkpoint.save(folder, 2, stage, optimizer, {}, {"ranks": 1}, lock=lock)
        assert not folder.exists()
    finally:
        held.release()


def test_a_rank_lost_during_a_save_is_the_news_not_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen: a rank killed mid-save read as bad input (exit 2) in gloo's words, the killed rank
    unnamed. A lost peer is a symptom: the launcher then names the rank that went."""
    import torch.distributed.checkpoint as dcp

    from gpipe_plan.runtime import checkpoint
    from gpipe_plan.runtime.p2p import PeerLost
    from gpipe_plan.runtime.worker import error_kind

    stage, optimizer = saved_stage(tmp_path, [])

    def lost(*args, **kwargs):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1")

    monkeypatch.setattr(dcp, "save", lost)
    with pytest.raises(PeerLost) as info:
        checkpoint.save(tmp_path / "ckpt", 1, stage, optimizer, {}, {"ranks": 1})
    assert error_kind(info.value) == "peer_lost"


def test_a_checkpoint_whose_bytes_changed_is_refused_not_resumed(tmp_path: Path) -> None:
    """Seen: 64 bytes overwritten inside a shard resumed silently, the model 2.5e-3 off (or a NaN
    loss blamed on the learning rate). The files' checksums, saved beside them, refuse it."""
    from gpipe_plan.runtime import checkpoint

    stage, optimizer = saved_stage(tmp_path, [2, 4])
    newest = checkpoint.step_folder(tmp_path / "ckpt", 4)
    recorded = json.loads((newest / "checkpoint.json").read_text())["files_crc32"]
    assert set(recorded) == {p.name for p in newest.glob("*.distcp")} != set()
    checkpoint.load(tmp_path / "ckpt", 4, stage, optimizer, {}, seed=0)       # intact: resumes
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    with pytest.raises(BadInput, match=r"cannot read checkpoint '.*step-00000004' \(damaged\?\): __0_0.distcp is not "
                                       r"the file that was saved \(its checksum differs\); move 'step-00000004' out "
                                       r"of the folder to resume from step 2"):
        checkpoint.load(tmp_path / "ckpt", 4, stage, optimizer, {}, seed=0)


@pytest.mark.parametrize("damage", ["index", "record", "foreign record"])
def test_a_newest_checkpoint_with_a_damaged_index_or_record_names_the_step_before(tmp_path: Path, damage: str) -> None:
    """A truncated ``.metadata`` or a broken ``checkpoint.json`` said only that it could not be
    read; like a damaged shard, it now says which complete step to resume from."""
    from gpipe_plan.runtime import checkpoint

    stage, optimizer = saved_stage(tmp_path, [2, 4])
    newest = checkpoint.step_folder(tmp_path / "ckpt", 4)
    if damage == "index":
        index = newest / ".metadata"
        index.write_bytes(index.read_bytes()[:40])
    else:
        (newest / "checkpoint.json").write_text("{" if damage == "record" else '{"format": "another-tool"}')
    with pytest.raises(BadInput, match=r"cannot read checkpoint '.*step-00000004' \(damaged\?\): .*; move "
                                       r"'step-00000004' out of the folder to resume from step 2") as info:
        checkpoint.load(tmp_path / "ckpt", 4, stage, optimizer, {}, seed=0)
    assert "\n" not in str(info.value)


SAVE_UNDER_A_SIZE_LIMIT = '''
import resource, sys
from pathlib import Path
sys.path[:0] = {paths!r}
from gpipe_plan.artifacts import BadInput
from test_faults import saved_stage
from gpipe_plan.runtime import checkpoint
stage, optimizer = saved_stage(Path({folder!r}), [])
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
try:
    checkpoint.save(Path({folder!r}) / "ckpt", 1, stage, optimizer, {{}}, {{"ranks": 1}})
except BadInput as exc:
    print("BadInput:", exc)
'''


def test_a_checkpoint_that_cannot_be_written_leaves_no_partial_folder(tmp_path: Path) -> None:
    """Seen: a full disk during a checkpoint left a 160 MB .partial that kept the disk full. Here a
    file-size limit makes the write fail for real (EFBIG) in a subprocess."""
    code = SAVE_UNDER_A_SIZE_LIMIT.format(paths=sys.path, folder=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("BadInput: cannot save checkpoint '") and "File too large" in done.stdout, done.stdout
    assert "File too large, over this process's file-size limit, ulimit -f 19.53 KiB" in done.stdout, done.stdout
    assert "removed the unfinished 'step-00000001.partial'" in done.stdout
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == []


def test_a_full_disk_during_a_checkpoint_is_named_as_such(tmp_path: Path) -> None:
    """torch says only `unexpected pos 704 vs 598`: the line says what is short, and where."""
    from torch.distributed.checkpoint.api import CheckpointException

    from gpipe_plan.runtime.checkpoint import _save_failure

    partial = tmp_path / "step-00000004.partial"
    full = CheckpointException("write", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    line = str(_save_failure(full, partial, 10 ** 6))
    assert line.startswith(f"cannot save checkpoint '{tmp_path}': no space left on its device ("), line
    assert "removed the unfinished 'step-00000004.partial'" in line and "then --resume" in line
    opaque = CheckpointException("write", {0: (RuntimeError("unexpected pos 704 vs 598"), None)})
    assert "no space left" in str(_save_failure(opaque, partial, 10 ** 30))   # more than any disk has free


@pytest.mark.parametrize("code, says", [(errno.EFBIG, "File too large, over "), (errno.EDQUOT, "over the disk quota"),
                                        (errno.ENOSPC, "no space left on its device")])
def test_a_write_error_behind_torchs_unexpected_pos_is_named(tmp_path: Path, code: int, says: str) -> None:
    """Seen under `ulimit -f` (and so a disk quota, or a file system's largest file): the line said
    only torch's `unexpected pos 704 vs 598`. The write's own error is that error's __context__."""
    from torch.distributed.checkpoint.api import CheckpointException

    from gpipe_plan.runtime.checkpoint import _save_failure

    opaque = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    opaque.__context__ = OSError(code, os.strerror(code))
    line = str(_save_failure(CheckpointException("write", {0: (opaque, None)}), tmp_path / "step-00000004.partial", 10))
    assert line.startswith(f"cannot save checkpoint '{tmp_path}': {says}"), line
    assert "unexpected pos" not in line and "removed the unfinished 'step-00000004.partial'" in line, line
    assert line.endswith("then --resume"), line


def test_a_file_size_limit_met_by_every_rank_is_named_not_torchs_unexpected_pos(user_dir: Path) -> None:
    """Seen under `ulimit -f`: `cannot save checkpoint ...: RuntimeError: [enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598`: torch's zip writer hides the OSError of
    a tensor's write (layers of width 128 here), and DCP hands each rank's failure to the others
    pickled, which drops it. The ranks now hand over the OSError itself."""
    write_json_atomic(user_dir / "wide.json", hand_plan(model_spec("gpt", layers=2, width=128, heads=2, seq_len=8,
                                                                   vocab_size=256), [2, 2], 2, 2))

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))   # inside each rank's first big tensor

    result = gpipe_plan("run", "wide.json", "--steps", "2", "--checkpoint-dir", "ckpt", "--checkpoint-every", "1", "-q",
                        cwd=user_dir, preexec_fn=small_files, timeout=180)
    last = error_lines(result.stderr)[-1]
    assert result.returncode == 2 and "unexpected pos" not in last, result.stderr
    assert last.startswith(f"error: cannot save checkpoint '{user_dir / 'ckpt'}': File too large, over this "
                           f"process's file-size limit, ulimit -f 97.66 KiB (this rank's tensors take "), last
    assert [p.name for p in (user_dir / "ckpt").iterdir()] == []


def test_weights_a_diverged_update_made_nan_are_not_saved_over_the_good_ones(gpt_plan: Path) -> None:
    """Seen with --lr 1e6: step 2's loss was finite but its update made the weights NaN; step 2 was
    saved all NaN and pruned step 1 (--keep-checkpoints 1), and `--resume` with a lower --lr met a NaN
    loss at once. Weights that are not finite are not saved; the last good step stays."""
    result = gpipe_plan("run", "plan.json", "--steps", "4", "--checkpoint-dir", "ckpt", "--checkpoint-every", "1",
                        "--keep-checkpoints", "1", "-q", cwd=gpt_plan.parent, fault="nan-grad:1:1", timeout=180)
    last = error_lines(result.stderr)[-1]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.match(r"error: rank [01] failed: the weights are not finite after step 2 \('model/", last), last
    assert "step 2 was not saved and the newest checkpoint, step 1, is kept" in last and "--resume" in last, last
    assert sorted(p.name for p in (gpt_plan.parent / "ckpt").iterdir()) == ["step-00000001"]


# --------------------------------------------------------------------------- 10. absurd plans
def test_a_cpu_plan_fits_the_host_it_was_profiled_on(user_dir: Path) -> None:
    """Seen: `solve --global-batch-size 1000000000` wrote 5.6 TiB per device on a 23 GiB machine.
    (A prime batch here: one micro-batch count to search, so the refusal comes at once.)"""
    doc = profile_doc(L=6, batch_size=8)
    doc["version"], doc["device"]["memory_bytes"] = 9, 64 * 2**20
    write_json(user_dir / "host.json", doc)
    result = cli("solve", "host.json", "-k", "2", "--global-batch-size", "1000000007", "--out", "huge.json")
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output
    assert "no plan fits this host's share per rank, 28.80 MiB (the profiled host's 64.00 MiB less headroom" in \
        result.output, result.output
    assert not Path("huge.json").exists()
    assert cli("solve", "host.json", "-k", "2", "--out", "plan.json").exit_code == 0
    options = json.loads(Path("plan.json").read_text())["options"]
    assert options["memory_limit_source"] == "host" and options["memory_limit_bytes"] == int(64 * 2**20 * 0.9) // 2
    # An older profile, without the host's memory, plans as it did: no limit but --memory-limit.
    del doc["device"]["memory_bytes"]
    write_json(user_dir / "old.json", doc)
    assert cli("solve", "old.json", "-k", "2", "--out", "old-plan.json").exit_code == 0
    assert json.loads(Path("old-plan.json").read_text())["options"]["memory_limit_bytes"] is None


def test_a_plan_of_months_per_step_is_one_line(user_dir: Path) -> None:
    """Where the batch fits the memory, its step may still last months: the plan's schema would
    refuse it (a traceback); the request is refused in one line instead."""
    doc = profile_doc(L=6, batch_size=8)
    doc["version"], doc["device"]["memory_bytes"] = 9, 8 * 2**40
    write_json(user_dir / "host.json", doc)
    result = cli("solve", "host.json", "-k", "2", "--global-batch-size", "1000000007", "--out", "huge.json")
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output
    assert re.search(r"takes [\d,]+ days per step: plan a smaller --global-batch-size", result.output), result.output
    assert not Path("huge.json").exists()


def test_a_cpu_profile_records_the_hosts_memory() -> None:
    import torch

    from gpipe_plan.profiles.device import describe

    memory = describe(torch.device("cpu"), threads=1)["memory_bytes"]
    assert 2**28 < memory <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")   # RAM, or a container's share


# --------------------------------------------------------------------------- 11. code named by files
def test_run_says_which_code_a_plan_makes_it_import_and_a_factory_that_aborts_is_named(gpt_plan: Path) -> None:
    """Seen: run imported the plan's `module:attr` without a word; `os:abort` gave `rank 0 was killed by SIGABRT`."""
    doc = hand_plan(GPT, [2, 2], 2, 2)
    doc["model"] = {"source": "import", "factory": "os:abort", "input_shape": [8], "input_dtype": "float32",
                    "num_classes": 4, "vocab_size": None, "loss": "classify"}
    write_json(gpt_plan.parent / "abort.json", doc)
    result = gpipe_plan("run", "abort.json", "--steps", "1", "-q", cwd=gpt_plan.parent)
    lines = error_lines(result.stderr)
    assert result.returncode == 1 and len(lines) == 2, result.stderr
    assert lines[0].startswith(f"note: the plan names code, which every rank imports and runs: the model factory "
                               f"'os:abort' from {os.__file__}"), lines[0]
    assert lines[1] == ("error: rank 0 was killed by SIGABRT while building the model (calling the plan's model "
                        "factory 'os:abort'); stopped all 2 ranks"), lines[1]
