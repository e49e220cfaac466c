"""One rank, as a process: run :func:`.train.train`, and fail in a way the launcher can report.

``gpipe-plan run`` starts K of these (``python -m gpipe_plan.runtime.worker``); under
``torchrun`` the ``run`` command calls :func:`run_rank` in the process torchrun started.

When a rank fails, the others fail soon after, with errors that only say their neighbour
went away. The one error worth showing is the first, so each failing rank writes its error,
with the time, its kind and the traceback, to a file the launcher reads (the idea of
torchelastic's error files), and exits at once with ``os._exit``: a process whose peers are
gone must not wait for them at interpreter shutdown.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from typing import NoReturn

from ..allocator import steady_allocator
from ..artifacts import BadInput
from ..lifeline import die_with_parent
from . import watchdog
from .options import ENV, RunOptions

ERROR_DIR_ENV = "GPIPE_PLAN_ERROR_DIR"
PARENT_ENV = "GPIPE_PLAN_PARENT_PID"


def error_kind(exc: BaseException) -> str:
    from .p2p import PeerLost, TimedOut, looks_like_lost_peer
    from .watchdog import WAITING

    if isinstance(exc, BadInput):
        return "bad_input"
    if isinstance(exc, PeerLost) or looks_like_lost_peer(exc):
        return "peer_lost"
    if isinstance(exc, TimedOut) or "Timed out" in str(exc):   # ours, or a collective's own timeout (gloo)
        return WAITING
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return "error"


def describe(exc: BaseException) -> str:
    """The error in one line: its type (unless ours) and message."""
    from ..artifacts import RunFailure

    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, (BadInput, RunFailure)):
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def run_rank(options: RunOptions) -> int:
    """Run this process's rank; return the exit status (0, 1 failure, 2 bad input)."""
    from .distributed import world_from_env
    from .train import train

    steady_allocator()       # a rank torchrun started has not met run_command's (allocator.py)
    world = world_from_env()
    if world is None:
        raise BadInput("not started as a rank (RANK and WORLD_SIZE are unset)")
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:   # a stuck rank (runtime/watchdog.py) leaves its record where the launcher reads it
        watchdog.set_reporter(lambda kind, message: _write_record(error_dir, world.rank, kind, message))
        watchdog.set_phase_file(os.path.join(error_dir, f"rank-{world.rank}.phase"))
    try:
        train(options, world)
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then we exit
        from ..artifacts import RunFailure

        kind = error_kind(exc)
        # A failure of ours (the loss is nan, ...) says all there is in its line; a traceback of
        # the planner's own loop would only bury it. Anything else keeps its traceback.
        tb = "" if isinstance(exc, RunFailure) else "".join(traceback.format_exception(exc))
        if error_dir:
            _write_record(error_dir, world.rank, kind, describe(exc), tb)
        else:  # under torchrun: say it ourselves, with the rank
            sys.stderr.write(f"{tb if kind == 'error' else ''}error: rank {world.rank}: {describe(exc)}\n")
        return 2 if kind == "bad_input" else 130 if kind == "interrupted" else 1


def _write_record(folder: str, rank: int, kind: str, message: str, traceback_text: str = "") -> None:
    """The rank's failure, for the launcher: its kind (``error``, ``bad_input``, ...), one line, the traceback."""
    record = {"rank": rank, "time": time.time(), "kind": kind, "message": message, "traceback": traceback_text}
    path = os.path.join(folder, f"rank-{rank}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def _die_with_parent() -> None:
    """Ask Linux to kill this rank if the launcher dies (kill -9 included): no orphans."""
    die_with_parent(int(os.environ.get(PARENT_ENV, "0")))


def main() -> NoReturn:
    _die_with_parent()
    # torch warns at import when NumPy is absent; nothing here uses NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    status = run_rank(RunOptions.from_json(os.environ[ENV]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
