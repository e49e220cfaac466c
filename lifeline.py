"""Helper processes that die with the process that started them, however it ends.

A process killed with SIGKILL runs no cleanup: its children are reparented to init and keep
computing, each pinning a core, until it finishes on its own.
Linux can do what the parent no longer can: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the
kernel to kill the calling process as soon as its parent dies. A child calls
:func:`die_with_parent` first thing; ``run``'s ranks (runtime/worker.py) and the profiler's
helper processes (profiles/spawn.py) both do.

No torch here, and nothing else: a child calls this before it imports anything heavy.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1   # from <linux/prctl.h>


def die_with_parent(parent_pid: int | None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (kill -9 included).

    ``parent_pid``: the pid of the process that started this one (0 or None: unknown). The
    request covers only a death *after* it is made, so if the parent is already gone (this
    process was reparented before it got here) it exits at once. Off Linux, where there is no
    prctl, it does nothing: the parent's own cleanup (a timeout, a kill) is all there is.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if parent_pid and os.getppid() != parent_pid:   # the parent died before prctl took effect
        os._exit(1)


class Tethered:
    """A child's entry point (``"pkg.module:function"``) that ties the child to its parent as
    early as possible: while the child is still being unpickled, before the target's imports.

    A ``spawn`` child starts a fresh interpreter and then unpickles its Process object: the
    target first, then its arguments, whose classes import torch (seconds). A target that
    called :func:`die_with_parent` only once it ran would leave that window open, and a killed
    parent's helpers would live on through it. Unpickling a Tethered calls
    :func:`die_with_parent` at once (see ``__reduce__``), and the real target, named by a
    string, is imported only when the child runs it.
    """

    def __init__(self, target: str, parent_pid: int):
        self.target = target
        self.parent_pid = parent_pid

    def __reduce__(self) -> tuple:
        return (_tie_on_unpickle, (self.target, self.parent_pid))

    def __call__(self, *args: object) -> object:
        import importlib

        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(*args)


def _tie_on_unpickle(target: str, parent_pid: int) -> Tethered:
    """Unpickling a :class:`Tethered` in the child: the tie first, then the callable."""
    die_with_parent(parent_pid)
    return Tethered(target, parent_pid)
