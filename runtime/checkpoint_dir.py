"""The checkpoint folder: which steps it holds, which run each belongs to, and who writes it.

A ``--checkpoint-dir`` holds one folder per saved step (:mod:`.checkpoint` writes them)::

    CHECKPOINT_DIR/
      .lock                  while a run writes here: locked by it (its pid and host inside)
      step-00000040/         complete: its checkpoint.json names the run it belongs to
      step-00000060.partial/ a step some rank never finished (a killed run): never resumed

Three rules keep two runs from mixing there:

- **A step knows its run.** Each step's ``checkpoint.json`` carries a ``run`` record: an id
  drawn when the run started without ``--resume``, when it started, the SHA-256 of its plan, its
  seed and the options that change what it trains (:func:`new_run`). A run resumed from a step
  takes that step's record, id and all, so the id follows the run through every resume and
  every change of plan.
- **A fresh run refuses a folder that holds steps.** Without ``--resume``, complete steps
  there belong to another run: pruning them, or resuming them later, would mix two runs. So
  the run stops in one line naming ``--resume`` and how to start over (:func:`claim`).
- **Pruning touches only the run's own steps** (:func:`prune`): it keeps the run's newest
  ``--keep-checkpoints``, whatever the step numbers of other runs' steps there.

One live run per folder: :func:`claim` takes an exclusive ``flock`` on ``.lock`` for the
run's lifetime (the launcher holds it; under torchrun, rank 0) and removes the file at the end.
The kernel drops the lock when the process ends, however it ends, so a killed run leaves at
most an unlocked ``.lock``, never a stale lock; ``.partial`` folders a killed run left are
cleared when the next run claims the folder, since no live run can be writing them then. On a shared file
system the lock is as good as its ``flock`` (NFS v4 and Linux's NFS client honour it).

No torch here: the launcher claims the folder before any rank starts.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from ..artifacts import BadInput

META_FILE = "checkpoint.json"
PARTIAL = ".partial"
LOCK_FILE = ".lock"
_STEP_DIR = re.compile(r"step-(\d{8})")
_V1_FILE = re.compile(r"stage-\d+-of-\d+\.pt")
# The options of ``run`` that change what a run trains (its run record keeps them): not the
# outputs, the executor or the threads, which change how fast, not what.
TRAINING_OPTIONS = ("optimizer", "lr", "weight_decay", "momentum", "grad_clip", "lr_schedule", "warmup_steps",
                    "steps", "data", "precision", "param_dtype")


def step_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}"


def partial_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}{PARTIAL}"


def complete_steps(folder: Path) -> dict[int, int]:
    """Complete step folders, ``{step: format version}``: 2 has ``checkpoint.json``, 1 stage files."""
    if not folder.is_dir():
        return {}
    found: dict[int, int] = {}
    for child in folder.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if not match or not child.is_dir():
            continue
        if (child / META_FILE).is_file():
            found[int(match.group(1))] = 2
        elif any(_V1_FILE.fullmatch(f.name) for f in child.iterdir()):
            found[int(match.group(1))] = 1
    return found


# ---------------------------------------------------------------------- whose steps
def new_run(plan_sha256: str, options: Any) -> dict[str, Any]:
    """The record of a run started without ``--resume``: a new id, and what it trains with.

    ``options``: the run's :class:`~.options.RunOptions` (the keys of :data:`TRAINING_OPTIONS`
    and ``seed`` are kept).
    """
    values = dataclasses.asdict(options)
    return {"id": uuid.uuid4().hex, "started_unix_s": round(time.time(), 3), "plan_sha256": plan_sha256,
            "seed": values["seed"], "options": {key: values[key] for key in TRAINING_OPTIONS}}


def run_of(folder: Path, step: int) -> dict[str, Any] | None:
    """The run record of a complete step; None for a step written before steps had one (or unreadable)."""
    try:
        meta = json.loads((step_folder(folder, step) / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    run = meta.get("run") if isinstance(meta, dict) else None
    return run if isinstance(run, dict) and isinstance(run.get("id"), str) else None


def describe_run(run: dict[str, Any] | None) -> str:
    """``seed 0, started 2026-12-01 22:20``: enough to tell one run from another."""
    if run is None:
        return "written before checkpoints named their run"
    started = run.get("started_unix_s")
    when = time.strftime(", started %Y-%m-%d %H:%M", time.localtime(started)) if isinstance(started, (int, float)) \
        else ""
    return f"seed {run.get('seed')}{when}"


def prune(folder: Path, keep: int, run_id: str, adopted: bool = False) -> list[int]:
    """Rank 0: delete this run's complete steps but its newest ``keep``; return the steps deleted.

    ``adopted``: the run resumed from a step without a run record, and takes such steps for its
    own. Another run's steps are never touched; ``.partial`` folders older than the run's newest
    step are (no live run writes them: the folder is :func:`claim`\\ ed).
    """
    mine = sorted(step for step, version in complete_steps(folder).items() if version == 2
                  and _belongs(run_of(folder, step), run_id, adopted))
    gone = mine[:-keep]
    for step in gone:
        shutil.rmtree(step_folder(folder, step), ignore_errors=True)
    if mine:
        for child in folder.iterdir():
            match = _STEP_DIR.fullmatch(child.name.removesuffix(PARTIAL))
            if child.name.endswith(PARTIAL) and match and int(match.group(1)) < mine[-1]:
                shutil.rmtree(child, ignore_errors=True)
    return gone


def _belongs(run: dict[str, Any] | None, run_id: str, adopted: bool) -> bool:
    return run["id"] == run_id if run is not None else adopted


# ---------------------------------------------------------------------- one run per folder
@dataclasses.dataclass
class Claim:
    """A run's hold on its checkpoint folder: the open, locked ``.lock``."""

    folder: Path
    fd: int

    def release(self) -> None:
        """Remove ``.lock`` and drop the lock (a run that is killed drops it too, and leaves the file)."""
        if self.fd >= 0:
            try:
                os.unlink(self.folder / LOCK_FILE)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = -1


def claim(folder: Path, resume: bool) -> Claim:
    """Take the folder for this run, or refuse in one line (:class:`BadInput`).

    Refused: a folder another live run holds; without ``resume``, a folder holding complete
    steps (another run's). Taken: ``.partial`` folders (killed runs' unfinished steps) are
    removed.
    """
    held = _lock(folder)
    try:
        steps = sorted(complete_steps(folder))
        if steps and not resume:
            shown = ", ".join(map(str, steps[-3:])) + (f" and {len(steps) - 3} older" if len(steps) > 3 else "")
            raise BadInput(f"--checkpoint-dir '{folder}' already holds checkpoints of a run (step {shown}; "
                           f"{describe_run(run_of(folder, steps[-1]))}): continue it with --resume, or start over "
                           f"in an empty folder (a new --checkpoint-dir, or delete its step-* folders)")
        for child in folder.iterdir():
            if child.name.endswith(PARTIAL) and _STEP_DIR.fullmatch(child.name.removesuffix(PARTIAL)):
                shutil.rmtree(child, ignore_errors=True)
        os.ftruncate(held.fd, 0)
        os.pwrite(held.fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                       "since_unix_s": round(time.time(), 3)}).encode(), 0)
    except BaseException:
        held.release()
        raise
    return held


def lock_identity(folder: Path) -> tuple[int, int] | None:
    """Which file the folder's lock is now (device, inode); None when there is none. A rank reads
    it when training starts, while the run holds the folder, and :func:`check_still_held` compares."""
    try:
        st = os.stat(folder / LOCK_FILE)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_still_held(folder: Path, identity: tuple[int, int] | None, step: int) -> None:
    """Refuse to save into a folder that is no longer the one this run took (:class:`BadInput`).

    A folder removed (or moved, or replaced) during the run has lost its lock: writing there
    would make a folder without one, which a second run could then take and mix with this one's
    steps (it removes the ``.partial`` folders it finds). ``identity``: :func:`lock_identity`
    at the start."""
    if identity is None or lock_identity(folder) == identity:
        return
    raise BadInput(f"--checkpoint-dir '{folder}' was removed or replaced during the run (its lock is gone): "
                   f"stopped before saving step {step}, so that no other run's checkpoints mix with this one's; "
                   f"the steps saved before went with the folder: --resume from them in a folder that stays")


def _lock(folder: Path) -> Claim:
    """An exclusive ``flock`` on ``folder/.lock``, or :class:`BadInput` naming its holder.

    The lock must be on the file the path names *now*: a holder that releases removes the file,
    and one that opened it just before would hold a lock on a file nobody else can open. So a
    lock taken on a file no longer at the path is dropped and taken again.
    """
    path = folder / LOCK_FILE
    while True:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise BadInput(f"cannot use --checkpoint-dir '{folder}': {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise BadInput(f"cannot lock --checkpoint-dir '{folder}': {exc.strerror or exc}") from None
            raise BadInput(f"--checkpoint-dir '{folder}' is in use by another run ({holder}): two runs writing one "
                           f"folder would mix their checkpoints; give this run its own --checkpoint-dir") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return Claim(folder, fd)
        os.close(fd)


def _read_holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it: ``pid 123 on host-a since 22:20``."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict) or "pid" not in record:
        return "its holder did not say who it is"
    since = record.get("since_unix_s")
    when = time.strftime(" since %Y-%m-%d %H:%M", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"pid {record.get('pid')} on {record.get('host')}{when}"
