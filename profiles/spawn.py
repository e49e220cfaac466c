"""Helper processes for measurements that need several processes at once (link, contention).

Each worker is started with the ``spawn`` method (a fresh interpreter: no state inherited from
the profiler's process, and the same way on every platform), gets its rank and a queue, and
puts what it measured on the queue. A worker still running at the deadline is killed, so a
measurement never leaves processes behind.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import wait as wait_for
from typing import Any, Callable

import torch.multiprocessing as mp

from ..lifeline import Tethered

# Shared objects a worker needs (a barrier) must come from the context the workers start in.
SPAWN = mp.get_context("spawn")
# How often the parent looks for results while its workers run.
POLL_S = 0.05


def run_workers(target: Callable[..., None], count: int, shared: tuple, timeout_s: float, what: str) -> list[Any]:
    """Run ``target(rank, *shared, queue)`` in ``count`` processes; return what they put on the queue.

    Raises RuntimeError saying ``what`` the processes were doing when one fails or overruns
    ``timeout_s``.
    """
    results = SPAWN.SimpleQueue()
    # Each child dies with this process, even when it is killed (lifeline.py); daemon=True only
    # covers a parent that exits normally.
    entry = Tethered(f"{target.__module__}:{target.__qualname__}", os.getpid())
    procs = [SPAWN.Process(target=entry, args=(rank, *shared, results), daemon=True) for rank in range(count)]
    # The children import torch afresh; spare the user its warning about a missing NumPy.
    quiet = "ignore:Failed to initialize NumPy"
    previous = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{previous},{quiet}" if previous else quiet
    try:
        for p in procs:
            p.start()
    finally:
        if previous is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = previous
    deadline = time.monotonic() + timeout_s
    out: list[Any] = []
    # Read what the workers put while they run: a worker writing more than the pipe holds (64 KiB
    # on Linux) blocks until it is read, and would never exit for a join to see.
    while True:
        while not results.empty():
            out.append(results.get())
        alive = [p for p in procs if p.is_alive()]
        if not alive or time.monotonic() >= deadline:
            break
        wait_for([p.sentinel for p in alive], timeout=POLL_S)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    # A worker killed or failed may have left half a message: read on only after clean exits.
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"the {count} process{'es' if count != 1 else ''} {what} failed "
                           f"(exit code{'s' if count != 1 else ''} {[p.exitcode for p in procs]})")
    while not results.empty():
        out.append(results.get())
    return out
