"""Start the K ranks of a plan on this machine, watch them, and stop them all if one fails.

``gpipe-plan run plan.json`` is a small launcher: it starts one process per stage with the
environment ``torchrun`` would give them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...),
then waits. The guarantees:

- a rank that fails stops every rank: as soon as one exits with an error (or is killed), the
  launcher terminates the others, then kills what is left a few seconds later;
- the error shown is the original one, with its rank: ranks whose only complaint is that a
  neighbour went away, or that they waited too long for another rank, are not the cause (see
  :mod:`.worker`); a rank stuck in its own work says so itself (:mod:`.watchdog`), and one that
  was stopped (SIGSTOP) and says nothing is named as such;
- no process is left behind: the launcher waits for every rank it started, and each rank
  asks Linux to kill it if the launcher itself dies (``PR_SET_PDEATHSIG``);
- a launcher asked to stop stops the ranks and says so: Ctrl-C (exit 130), and SIGTERM or
  SIGHUP (``kill``, ``timeout``, a scheduler, a closed terminal), which would otherwise end it
  at once, in silence, the ranks killed mid-write by the kernel (:class:`Stopped`, exit 143 or 129).

No torch here: the launcher only starts and watches processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts import HOST_TAG, BadInput, RunFailure, process_alive
from .options import ENV, RunOptions
from .watchdog import STALLED, WAITING
from .worker import ERROR_DIR_ENV, PARENT_ENV

POLL_S = 0.05
GRACE_S = 3.0          # after SIGTERM, before SIGKILL
SETTLE_S = 0.5         # after the first failure, let the others report theirs


# The ranks' error files go to a folder of the temporary directory named after the launcher
# (``gpipe-plan-run-HOST-PID-RANDOM``): a launcher killed with SIGKILL cannot remove its own, so
# every launch removes those of this host's launchers that are gone.
ERRORS_PREFIX = "gpipe-plan-run-"


def clear_dead_launchers() -> list[Path]:
    """Remove the error folders that killed launchers of this host left; return them."""
    start = f"{ERRORS_PREFIX}{HOST_TAG}-"
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{start}*"):
        pid = folder.name[len(start):].split("-", 1)[0]
        if folder.is_dir() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@dataclass
class Failure:
    rank: int
    kind: str            # a key of ORDER: error | bad_input | stalled | waiting | peer_lost | signal | ...
    message: str
    time: float
    traceback: str = ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stopped(RunFailure):
    """The launcher got SIGTERM or SIGHUP. A :class:`RunFailure`, so that wherever it surfaces
    (the stop, the clean-up after it) the command ends in its one line, with the exit status a
    process killed by that signal has (143 for SIGTERM, 129 for SIGHUP), which schedulers read."""

    def __init__(self, signum: int, nprocs: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}: stopped all {nprocs} ranks (the checkpoints "
                         f"saved are kept: --resume continues from the newest)")
        self.exit_code = 128 + signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stop_on_signals(nprocs: int) -> dict[int, Any]:
    """Have SIGTERM and SIGHUP raise :class:`Stopped` in the launcher; return the handlers they had."""
    def stopped(signum: int, frame: Any) -> None:
        raise Stopped(signum, nprocs)

    if threading.current_thread() is not threading.main_thread():   # only the main thread may set them
        return {}
    return {sig: signal.signal(sig, stopped) for sig in STOP_SIGNALS}


def launch_local(options: RunOptions, nprocs: int, threads: int) -> None:
    """Run ``nprocs`` ranks here; return when all succeeded, raise when one failed."""
    clear_dead_launchers()
    previous = _stop_on_signals(nprocs)
    stopping = False
    try:
        _launch(options, nprocs, threads)
    except (KeyboardInterrupt, Stopped):
        stopping = True     # the signals stay ignored (_launch): the command ends in its one line
        raise
    finally:
        if not stopping:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _launch(options: RunOptions, nprocs: int, threads: int) -> None:
    """:func:`launch_local`'s ranks, from start to stop."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=f"{ERRORS_PREFIX}{HOST_TAG}-{os.getpid()}-") as errors:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(nprocs):
                env = dict(os.environ)
                env.update({
                    "RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "GPIPE_PLAN_LAUNCHER": "gpipe-plan", ENV: options.to_json(), ERROR_DIR_ENV: errors,
                    PARENT_ENV: str(os.getpid()),
                    # The thread pools size themselves at start-up from these: set them to the
                    # rank's share before torch starts (train() also calls set_num_threads).
                    "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                })
                # Own process group: Ctrl-C reaches the launcher only, which stops the ranks.
                procs.append(subprocess.Popen([sys.executable, "-m", "gpipe_plan.runtime.worker"], env=env,
                                              process_group=0))
            failure = _watch(procs, Path(errors), patience_s=options.timeout)
        except (KeyboardInterrupt, Stopped):
            # From the first Ctrl-C (or SIGTERM, SIGHUP) on the launcher only stops the ranks and
            # exits: another one, as a held key or an impatient hand sends, must not cut the stop
            # short (it had left "aborted", exit 1, and tracebacks of interrupted clean-ups).
            for sig in (signal.SIGINT, *STOP_SIGNALS):
                signal.signal(sig, signal.SIG_IGN)
            _stop(procs)
            raise
        finally:
            _stop(procs)
    if failure is not None:
        raise _as_exception(failure, nprocs)


# A rank's failure explains the others' (a cause) or follows from one (a symptom: a neighbour
# vanished, or a wait for another rank outlasted --timeout); lower comes first.
ORDER = {"bad_input": 0, "error": 1, STALLED: 2, "signal": 3, "exit": 4, "interrupted": 5, WAITING: 6, "peer_lost": 7}
SYMPTOMS = (WAITING, "peer_lost")


def _watch(procs: list[subprocess.Popen[bytes]], errors: Path, patience_s: float) -> Failure | None:
    """Wait for the ranks; at the first failure, collect what the others say and pick the cause.

    When all that failed so far are symptoms, the cause may still be on its way: a rank stuck in
    its own work reports once its watchdog's ``--timeout`` is over, which can be later than the
    neighbour that waited for it (it may have started waiting first). So the launcher waits for
    it, up to ``patience_s`` more, unless every rank still running is stopped (SIGSTOP, a
    debugger): a stopped rank says nothing, and is itself the answer.
    """
    first_failure_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return None
        if first_failure_at is None and any(c not in (None, 0) for c in codes):
            first_failure_at = time.monotonic()
        if first_failure_at is not None:
            waited = time.monotonic() - first_failure_at
            running = [rank for rank, c in enumerate(codes) if c is None]
            causes = [f for f in _failures(procs, errors) if f.kind not in SYMPTOMS]
            if not running or (waited > SETTLE_S and (causes or waited > patience_s + SETTLE_S
                                                      or all(_stopped(procs[r].pid) for r in running))):
                return _root_cause(procs, errors)
        time.sleep(POLL_S)


def _root_cause(procs: list[subprocess.Popen[bytes]], errors: Path) -> Failure:
    """The failure that explains the others: a real error before a lost neighbour; a symptom names
    the ranks that said nothing (stopped, or still running)."""
    failures = sorted(_failures(procs, errors), key=lambda f: (ORDER.get(f.kind, 9), f.time))
    best = failures[0]
    if best.kind in SYMPTOMS:
        said = {f.rank for f in failures}
        silent = [rank for rank, p in enumerate(procs) if p.poll() is None and rank not in said]
        stopped = [rank for rank in silent if _stopped(procs[rank].pid)]
        if stopped:
            best.message += f"; rank(s) {', '.join(map(str, stopped))} stopped (SIGSTOP or a debugger) and said nothing"
        elif silent:
            best.message += f"; rank(s) {', '.join(map(str, silent))} still running, silent"
    return best


def _failures(procs: list[subprocess.Popen[bytes]], errors: Path) -> list[Failure]:
    """What every rank that ended (or wrote its record) says, in rank order."""
    failures: list[Failure] = []
    for rank, p in enumerate(procs):
        record = _read_error(errors / f"rank-{rank}.json")
        if record is not None:
            failures.append(Failure(rank, record["kind"], record["message"], record["time"], record["traceback"]))
        elif p.returncode is not None and p.returncode < 0:
            name = signal.Signals(-p.returncode).name
            failures.append(Failure(rank, "signal", f"rank {rank} was killed by {name}{_while(errors, rank)}",
                                    time.time()))
        elif p.returncode not in (None, 0):
            failures.append(Failure(rank, "exit", f"rank {rank} exited with status {p.returncode}"
                                                  f"{_while(errors, rank)}", time.time()))
    return failures


def _while(errors: Path, rank: int) -> str:
    """`` while building the model (...)``: the phase a dead rank last said it was in (runtime/watchdog.py)."""
    try:
        return f" while {(errors / f'rank-{rank}.phase').read_text(encoding='utf-8')}"
    except OSError:
        return ""


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T or t in /proc: SIGSTOP, a debugger); False off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] in ("T", "t")


def _read_error(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _as_exception(failure: Failure, nprocs: int) -> Exception:
    if failure.kind == "bad_input":
        return BadInput(failure.message)
    if failure.traceback and failure.kind == "error":
        sys.stderr.write(f"--- rank {failure.rank} traceback ---\n{failure.traceback}")
    if failure.kind in ("signal", "exit") or failure.message.startswith(f"rank {failure.rank} "):
        return RunFailure(f"{failure.message}; stopped all {nprocs} ranks")
    return RunFailure(f"rank {failure.rank} failed: {failure.message}; stopped all {nprocs} ranks")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate every rank still running, kill the stubborn ones, reap them all."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            if _stopped(p.pid):   # a stopped process takes SIGTERM only once it continues
                os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
