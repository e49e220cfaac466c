"""One group of ranks per world size, started once and reused by every test of the session.

Starting ranks is the dearest thing the tests do: each rank is a fresh interpreter that imports
torch and the runtime (about 3 s of CPU each; a group of 4 took 16 s to start on the 2-core test
machine). So, as torch's own ``MultiProcContinuousTest`` does, the ranks of a world size are
started once, join their gloo group once, and then run one task after another: a task is a
picklable function ``fn(rank, world_size, *args)`` that every rank calls, in the folder and with
the environment the test had when it asked (as a freshly spawned rank would have had them).

A rank that raises, or dies, fails the task (:class:`RanksFailed`, with the rank's traceback) and
the whole group is stopped: the next task of that size starts a fresh one. A caller that knows a
task may leave the group in an unknown state (a run stopped half-way) asks for ``fresh_after``.
"""

from __future__ import annotations

import atexit
import os
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch.multiprocessing as mp

from gpipe_plan.runtime.launch import free_port

START_TIMEOUT_S = 300.0
# A task whose ranks say nothing for this long fails (and its group is killed), so that a task
# stuck in a collective fails its test instead of hanging the suite; far longer than any task
# of the suite takes.
TASK_TIMEOUT_S = 900.0


class RanksFailed(Exception):
    """A task failed on a rank of the pool (its traceback), or a rank died."""


def _serve(rank: int, world_size: int, port: int, conn: Connection) -> None:
    """One rank: join the group once, then run every task sent until told to stop."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:              # the test process went away: so does the rank
            break
        if task is None:
            break
        fn, args, environment, cwd = task
        os.environ.clear()
        os.environ.update(environment)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.chdir(cwd)
        try:
            conn.send(("ok", fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - reported to the test, which stops the group
            conn.send(("error", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - on the way out
        pass


class _Pool:
    def __init__(self, world_size: int) -> None:
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.conns: list[Connection] = []
        self.procs = []
        port = free_port()
        try:
            for rank in range(world_size):
                parent, child = context.Pipe()
                proc = context.Process(target=_serve, args=(rank, world_size, port, child), daemon=False)
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            self._replies("start", timeout=START_TIMEOUT_S)
        except BaseException:
            self.close(force=True)
            raise

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
        task = (fn, args, dict(os.environ), os.getcwd())
        for conn in self.conns:
            conn.send(task)
        return self._replies(getattr(fn, "__qualname__", repr(fn)), timeout=TASK_TIMEOUT_S)

    def _replies(self, what: str, timeout: float | None = None) -> list[Any]:
        """Each rank's reply, in rank order; the first error or death raises at once."""
        values: list[Any] = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while pending:
            ready = wait([*pending, *sentinels], timeout=timeout)
            if not ready:
                raise RanksFailed(f"{what}: ranks {sorted(pending.values())} did not answer in {timeout:.0f} s")
            for item in ready:
                if item in pending:
                    rank = pending.pop(item)
                    try:
                        status, value = item.recv()
                    except EOFError:
                        raise RanksFailed(f"{what}: rank {rank} died (exit code {self.procs[rank].exitcode})")
                    if status == "error":
                        raise RanksFailed(f"{what} failed on rank {rank}:\n{value}")
                    values[rank] = value
                elif item in sentinels and sentinels[item] in pending.values():
                    rank = sentinels[item]
                    raise RanksFailed(f"{what}: rank {rank} died (exit code {self.procs[rank].exitcode})")
        return values

    def close(self, force: bool = False) -> None:
        """Stop the ranks: asked to leave the group, or (``force``: ranks that may be stuck in
        a collective of a failed task) killed."""
        if not force:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


_pools: dict[int, _Pool] = {}


def run_on_ranks(fn: Callable[..., Any], args: tuple[Any, ...], world_size: int,
                 fresh_after: bool = False) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank of the pool of ``world_size`` (started
    on first use, or again after a failure); return each rank's value, in rank order."""
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _pools[world_size] = _Pool(world_size)
    try:
        values = pool.run(fn, args)
    except BaseException:
        discard(world_size, force=True)
        raise
    if fresh_after:
        discard(world_size)
    return values


def discard(world_size: int, force: bool = False) -> None:
    """Stop the pool of ``world_size`` (if any): the next task of that size starts a fresh group."""
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.close(force)


def close_all() -> None:
    for world_size in list(_pools):
        discard(world_size)


atexit.register(close_all)
