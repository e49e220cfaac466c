"""``gpipe-plan`` in a child process, as a user runs it: the one helper for every test that does.

In-process runs (click's runner) are ``helpers.planner.cli``; a child process is needed where the
command starts ranks of its own, or its exit status and streams must be the real ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

BIN = Path(sys.executable).parent   # this interpreter's scripts: the gpipe-plan of this checkout


def gpipe_plan(*args: str, cwd: Path, fault: str | None = None, env: dict[str, str] | None = None,
               timeout: float = 300, preexec_fn=None) -> subprocess.CompletedProcess[str]:
    """Run ``gpipe-plan ARGS`` in ``cwd`` and check that it left no process behind.

    The environment is this one's with warnings off (a run's stderr is what it says) and ``env``
    on top (``PYTHONWARNINGS=""`` gives Python's own warnings, as a user's shell does), and the
    tests' fault injection (GPIPE_PLAN_FAULT) only when ``fault`` gives it, never inherited. A mark in the environment finds the launcher's ranks afterwards: a command must
    take its processes with it, whatever its exit. ``timeout`` bounds a hang (seconds)."""
    mark = uuid.uuid4().hex
    environment = {**os.environ, "GPIPE_PLAN_TEST_MARK": mark, "PYTHONWARNINGS": "ignore", **(env or {})}
    environment.pop("GPIPE_PLAN_FAULT", None)
    if fault:
        environment["GPIPE_PLAN_FAULT"] = fault
    result = subprocess.run([str(BIN / "gpipe-plan"), *args], cwd=cwd, env=environment, capture_output=True,
                            text=True, timeout=timeout, preexec_fn=preexec_fn)
    assert leftover_processes(mark) == [], "processes left behind"
    return result


def leftover_processes(mark: str) -> list[int]:
    """Processes whose environment carries ``mark`` (the launcher's and its ranks')."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found
