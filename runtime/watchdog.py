"""A rank that makes no progress for ``--timeout`` seconds stops, saying what it was doing.

The waits for a neighbour carry their own timeout (:mod:`.p2p`), but a rank can also hang in
its own work, where nobody waits with a timeout: a data factory that never returns its batch
(each rank reads its own stream), a layer that never finishes, a checkpoint write to a file
system that stopped answering. Its neighbours then time out waiting for it and report
*themselves* as stuck, naming the wrong rank, and a rank waiting in a collective (a
checkpoint's) waited the process group's timeout, at least 30 s, and ended in a gloo traceback
that named neither the rank nor the checkpoint.

So each rank runs a watchdog thread during its steps. The training loop, the executors and the
waits say what the rank is doing as they start it (:func:`doing`: an assignment, nothing more);
when the same thing has lasted ``--timeout`` seconds, the watchdog reports one line, ``rank 0
made no progress for 5 s at step 3: reading the step's batch (data from 'pkg.data:batches')``,
and ends the process at once (``os._exit``: the main thread may be blocked in C code where no
exception reaches it). What a rank does is its own work (data, computing, writing) or a wait
for others (``waiting=True``); the launcher takes a stuck rank's own work for the cause and its
neighbours' waits for what followed (:mod:`.launch`).

Outside the steps (set-up, the outputs at the end) nothing is watched: building a large model
may take minutes, and the process group's own timeout bounds the collectives there.

A rank killed outright (SIGKILL, a factory that calls ``os.abort()``) can report nothing
itself. So at each coarse phase (building the model, calling the plan's factories, training,
writing the outputs) it also leaves what it does in a file the launcher reads once the rank is
dead (:func:`phase`): ``rank 0 was killed by SIGABRT while building the model (calling the
plan's model factory 'os:abort')``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

STALLED, WAITING = "stalled", "waiting"      # the kinds of record a stuck rank leaves (runtime/launch.py)
POLL_S = 0.1                                 # how late, at most, the watchdog notices a deadline

Reporter = Callable[[str, str], None]        # (kind, one-line message) -> None, before the process ends


def _print(kind: str, message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


_reporter: Reporter = _print
_active: "Watchdog | None" = None
_phase_file: str | None = None


def set_reporter(report: Reporter) -> None:
    """How a stuck rank reports (the worker writes the launcher's error record; default: stderr)."""
    global _reporter
    _reporter = report


def set_phase_file(path: str) -> None:
    """Where :func:`phase` leaves what the rank does (the worker: beside its error record)."""
    global _phase_file
    _phase_file = path


def phase(what: str) -> None:
    """This rank begins ``what`` (a phase, a few per run); kept on disk for the launcher, if asked."""
    if _phase_file is None:
        return
    with open(_phase_file + ".tmp", "w", encoding="utf-8") as f:
        f.write(what)
    os.replace(_phase_file + ".tmp", _phase_file)


def doing(what: str, waiting: bool = False) -> None:
    """This rank now does ``what`` (its own work, or with ``waiting`` a wait for other ranks)."""
    watchdog = _active
    if watchdog is not None:
        watchdog.current = (what, waiting, time.monotonic())


def at_step(step: int) -> None:
    """The step (counted from 1) that the messages name."""
    watchdog = _active
    if watchdog is not None:
        watchdog.step = step


class Watchdog:
    """The thread that ends a rank whose current activity has lasted ``timeout_s``."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self.current = ("starting its steps", False, time.monotonic())
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gpipe-plan watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            what, waiting, since = self.current
            left = since + self.timeout_s - time.monotonic()
            if left <= 0:
                self._fire(what, waiting)
            self._stop.wait(min(max(left, 0.0) + 0.01, POLL_S))

    def _fire(self, what: str, waiting: bool) -> None:
        hint = "is a rank stuck? raise --timeout for slow steps" if waiting else \
            "raise --timeout if it is only slow"
        _reporter(WAITING if waiting else STALLED,
                  f"rank {self.rank} made no progress for {self.timeout_s:g} s at step {self.step}: {what} ({hint})")
        os._exit(1)


@contextlib.contextmanager
def watching(rank: int, timeout_s: float) -> Iterator[Watchdog]:
    """Watch this rank inside the block; :func:`doing` says what it does."""
    global _active
    watchdog = Watchdog(rank, timeout_s)
    _active = watchdog
    watchdog.start()
    try:
        yield watchdog
    finally:
        _active = None
        watchdog.stop()
