"""Reading and writing gpipe-plan's JSON artifacts (profile, plan, report), safely.

The three packages are coupled only through these files: gpipe_plan/schema.py says what the
files hold, and this module how they are read and written. It gives three guarantees a user
can rely on:

- a bad file is reported in one line that names the file and what is wrong with it
  (:class:`BadInput`, which the CLI turns into exit code 2, without a traceback);
- an artifact of the wrong kind or version is refused before anything uses it (the formats,
  their versions and their keys are gpipe_plan/schema.py's, which reads and writes artifacts
  through this module);
- an output file is either the whole new document or absent: it is written to a temporary
  file in the same folder and renamed over the target, so an interrupted run never leaves
  half a JSON file behind.

No torch here: ``gpipe-plan solve`` imports this and must start fast.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

# Precision (docs/runtime.md, "Precision"): ``precision`` is the dtype the layers compute in
# (fp32, or bf16/fp16 under autocast), ``param_dtype`` the dtype the parameters, their
# gradients and the optimizer's state are kept in. Every pair but these is refused: fp32
# compute on low-precision weights gains nothing, and fp16 weights cannot be trained safely
# (Adam's epsilon underflows to zero in fp16; loss scaling needs fp32 master weights).
PRECISIONS = ("fp32", "bf16", "fp16")
PARAM_DTYPES = ("fp32", "bf16")
PRECISION_PAIRS = {("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32")}
# Training objectives of a model (`--loss`): what its first output is and which targets it meets.
#   classify: logits (batch, num_classes) against one class id per sample;
#   lm: logits (batch, seq, vocab) against the input ids shifted by one token (next token).
LOSSES: tuple[str, ...] = ("classify", "lm")


class BadInput(Exception):
    """The user gave something we cannot use. The message is one line: what, and what to do.

    The CLI prints it and exits with status 2.
    """


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a
    one-line error quotes of a library's multi-line message."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def named_first_line(exc: BaseException) -> str:
    """``Type: first line`` (or ``Type``), for errors whose type says what went wrong."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class RunFailure(Exception):
    """Something failed while running (a crashed rank, a NaN loss). The CLI exits with
    ``exit_code``: 1, or 128 + the signal's number for a run stopped by a signal (the shell's
    convention, which schedulers read)."""

    exit_code = 1


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    """Parse a JSON file, turning the usual failures into one-line :class:`BadInput` errors."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{what} '{p}' does not exist")
    if p.is_dir():
        raise BadInput(f"{what} '{p}' is a directory, not a JSON file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read {what} '{p}': {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"{what} '{p}' is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except RecursionError:
        raise BadInput(f"{what} '{p}' nests its JSON too deeply to read (no gpipe-plan file does)") from None
    except ValueError:   # json reads no integer of more than sys.get_int_max_str_digits() digits
        raise BadInput(f"{what} '{p}' holds an integer too long to read (thousands of digits)") from None


def check_precision(precision: Any, param_dtype: Any, where: str = "") -> tuple[str, str]:
    """``(precision, param_dtype)`` if it is a pair gpipe-plan trains with, else :class:`BadInput`.

    ``where``: the file the pair comes from (the message then names its keys, not the flags).
    """
    prefix, (precision_name, param_name) = (f"{where}: ", ("'precision'", "'param_dtype'")) if where else \
        ("", ("--precision", "--param-dtype"))
    if precision not in PRECISIONS:
        raise BadInput(f"{prefix}{precision_name} {precision!r} is not one of {', '.join(PRECISIONS)}")
    if param_dtype not in PRECISIONS:
        raise BadInput(f"{prefix}{param_name} {param_dtype!r} is not one of {', '.join(PARAM_DTYPES)}")
    if (precision, param_dtype) not in PRECISION_PAIRS:
        if param_dtype == "fp16":
            why = "fp16 parameters cannot be trained safely (Adam's epsilon underflows); keep them fp32"
        else:
            why = f"parameters in {param_dtype} need {param_dtype} compute (autocast in that dtype)"
        raise BadInput(f"{prefix}{precision_name} {precision} with {param_name} {param_dtype}: {why}")
    return precision, param_dtype


def precision_label(precision: str, param_dtype: str) -> str:
    """``fp32``, or e.g. ``bf16 autocast, fp32 parameters``: how a profile, plan or run computes."""
    return "fp32" if precision == "fp32" else f"{precision} autocast, {param_dtype} parameters"


def precision_of(doc: dict[str, Any], where: str) -> tuple[str, str]:
    """A profile's or plan's ``(precision, param_dtype)``; files written before they existed ran fp32."""
    return check_precision(doc.get("precision", "fp32"), doc.get("param_dtype", "fp32"), where)


def dumps(doc: Any) -> str:
    """Serialise deterministically: the same document always gives the same bytes."""
    return json.dumps(_finite(doc), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


# --------------------------------------------------------------------------- writing
# How a file is written: in full to a temporary file beside it, flushed to the disk, then
# renamed over it (a rename within a folder is atomic), so that a reader sees the old file or
# the new one, never half. The temporary file is named ``.NAME.HOST.PID.RANDOM.tmp``: a
# writer killed before its rename (kill -9, a power cut) leaves it behind, and the next write
# of NAME from this host removes every one whose process is gone (:func:`clear_leftovers`).
# The host is part of the name because on a shared file system a process number says nothing
# about another machine's processes: their leftovers are left to them.
TEMP_SUFFIX = ".tmp"
HOST_TAG = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
# What the check before any work writes to a folder to learn that it can be written: a
# device with less room than this is as good as full.
PROBE_BYTES = 64 * 1024


def temp_prefix(target: Path) -> str:
    """The start of this process's temporary files for ``target``: ``.NAME.HOST.PID.``."""
    return f".{target.name}.{HOST_TAG}.{os.getpid()}."


def clear_leftovers(target: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files that killed writers of ``target`` left beside it; return them.

    Only this host's, and only those whose process no longer runs: a live writer's file (another
    command writing the same path at this moment) is its own.
    """
    p = Path(target)
    folder = p.parent
    start = f".{p.name}.{HOST_TAG}."
    removed = []
    try:
        children = list(folder.iterdir())
    except OSError:
        return removed
    for child in children:
        name = child.name
        if not (name.startswith(start) and name.endswith(TEMP_SUFFIX)):
            continue
        pid = name[len(start):].split(".", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            try:
                child.unlink()
                removed.append(child)
            except OSError:
                pass
    return removed


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Why an existing file is not replaced: its permissions or attributes keep it from being written.
PROTECTED = "the file exists and cannot be written (its permissions or attributes, such as chattr +i, " \
            "protect it): make it writable or choose another path"


def cannot_write(path: str | os.PathLike[str], exc: OSError, flag: str | None = None,
                 size: int | None = None, in_place: bool = False) -> BadInput:
    """The one line for a file the system would not let us write: which file, and why, in words.

    ``in_place``: ``path`` is a device or a pipe, written in place (:func:`write_target`), not a
    file made in its folder and renamed over it."""
    p = Path(path)
    folder = p.parent
    what = f"{flag} '{p}'" if flag else f"'{p}'"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        kind = "no space left" if exc.errno == errno.ENOSPC else "the disk quota is used up"
        if in_place:
            # A device that is full, or says so (/dev/full): its folder's free space is not its own.
            return BadInput(f"cannot write {what}: the write failed, {kind} on it (a device, written in place); "
                            f"write it elsewhere")
        # The free space is named where it explains the failure. A file system may refuse a write
        # with room to spare (its inodes used up; a quota is not free space), and "11.76 GiB free for
        # 13.27 KiB" contradicts itself: then the line says only that the write failed.
        try:
            free_bytes: int | None = shutil.disk_usage(folder).free
        except OSError:
            free_bytes = None
        if exc.errno == errno.ENOSPC and free_bytes is not None and free_bytes < (size or PROBE_BYTES):
            room = f", {_format_size(free_bytes)} free" + (f" for {_format_size(size)}" if size else "")
        else:
            room = " (the write failed, though the device reports free space)" if exc.errno == errno.ENOSPC else ""
        return BadInput(f"cannot write {what}: {kind} on the device holding '{folder}'{room}; "
                        f"free some space or write it elsewhere")
    if exc.errno in (errno.EACCES, errno.EPERM):
        # Refused by the file or by its folder: a rename over an existing file needs only the folder
        # writable, so where it is, the file itself is protected (chattr +i; another's in /tmp).
        if in_place:
            reason = "it is not writable"
        elif p.exists() and os.access(folder, os.W_OK | os.X_OK):
            reason = PROTECTED
        else:
            reason = f"folder '{folder}' is not writable"
        return BadInput(f"cannot write {what}: {reason}")
    reason = {errno.EROFS: "its file system is read-only",
              errno.ENOENT: f"no file can be created in folder '{folder}'"}.get(exc.errno or 0,
                                                                                exc.strerror or str(exc))
    return BadInput(f"cannot write {what}: {reason}")


def _format_size(n: int) -> str:
    from .units import format_bytes   # here, not at the top: units imports BadInput from this module

    return format_bytes(n)


def write_json_atomic(path: str | os.PathLike[str], doc: Any) -> None:
    """Write ``doc`` as JSON to ``path`` so that readers see the old file or the new one, never half."""
    write_text_atomic(path, dumps(doc))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it, with the mode a
    plain ``open(path, "w")`` would give (see :func:`_creation_mode`). A file that cannot be
    written (a full disk, a read-only file system) is :class:`BadInput`, and leaves nothing."""
    with Outputs() as outputs:
        outputs.add(path, data)


class Outputs:
    """Every file one command writes, made visible together: all of them or none.

    ``add`` writes a file in full to its temporary file (flushed to the disk) at once, so that a
    full disk shows there; leaving the ``with`` block renames every one over its target, one
    after the other; an error inside the block removes them all and the old files stay as they
    were. So ``run --save m.pt --trace t.json --report r.json`` on a full disk no longer
    replaces the model and then fails on the report. The renames take no space and do not fail
    on a healthy file system; a crash among them leaves some new files and some old ones, each
    whole.
    """

    def __init__(self) -> None:
        self._staged: list[tuple[Path, str, Path, str | None]] = []   # (target, temporary, as given, flag)
        self._direct: list[tuple[Path, Path, bytes, str | None]] = []   # (as given, device, data, flag)

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()

    def add(self, path: str | os.PathLike[str], data: bytes | str, flag: str | None = None) -> None:
        """Write ``data`` to ``path``'s temporary file now; :class:`BadInput` if the system refuses."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        p = Path(path)
        target, direct = write_target(p)
        if direct:
            self._direct.append((p, target, data, flag))
            return
        folder = target.parent
        if not folder.exists():
            raise BadInput(f"cannot write {flag + ' ' if flag else ''}'{p}': folder '{folder}' does not exist")
        clear_leftovers(target)
        mode = _creation_mode(target)
        try:
            fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target), suffix=TEMP_SUFFIX, dir=folder)
        except OSError as exc:
            raise cannot_write(p, exc, flag, len(data)) from None
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as exc:
            _unlink(tmp)
            if isinstance(exc, OSError):
                raise cannot_write(p, exc, flag, len(data)) from None
            raise
        self._staged.append((target, tmp, p, flag))

    def commit(self) -> None:
        """Write the outputs that are devices (first: one may fail, as /dev/full does, before any
        file is replaced), rename every staged file over its target, then make the renames
        durable."""
        for given, device, data, flag in self._direct:
            try:
                with open(device, "wb") as f:
                    f.write(data)
            except OSError as exc:
                self.discard()
                raise cannot_write(given, exc, flag, len(data), in_place=True) from None
        self._direct = []
        folders = set()
        while self._staged:
            target, tmp, given, flag = self._staged[0]
            try:
                os.replace(tmp, target)
            except OSError as exc:
                self.discard()
                raise cannot_write(given, exc, flag) from None
            self._staged.pop(0)
            folders.add(target.parent)
        for folder in folders:
            fsync_folder(folder)

    def discard(self) -> None:
        for _, tmp, _, _ in self._staged:
            _unlink(tmp)
        self._staged = []
        self._direct = []


def write_target(path: str | os.PathLike[str]) -> tuple[Path, bool]:
    """Where writing ``path`` puts the bytes, and whether it is written in place.

    A symbolic link is written through, to the file it names (a rename over the link would put a
    file in its place and leave the file it names as it was). A device, a pipe or a socket
    (``--out /dev/null``) is written in place: renamed over, it would be replaced by a plain file,
    and /dev/null would be gone for every program on the machine. Everything else is a file,
    written atomically beside itself."""
    p = Path(path)
    target = Path(os.path.realpath(p)) if p.is_symlink() else p
    return target, target.exists() and not target.is_file() and not target.is_dir()


def _unlink(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Make the renames in ``folder`` durable (a crash after them must not bring the old names back)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def locate(recorded: str, named_by: str, sha256: str | None = None) -> str | None:
    """A file another names (a report its plan, a plan its profile), as recorded there:
    ``recorded`` as written if it exists, else beside the file that names it, else None.

    With the ``sha256`` recorded too, a file found so that is not the one (another project's
    ``p.json`` in the current folder, tried first as written) or none found gives way to the
    first file with that SHA-256 of: the recorded path beside ``named_by`` and a file of its name
    beside it (a folder moved whole: a report records its plan's absolute path); where neither
    has it, what was found (the caller says it has changed) or None."""
    found = _as_recorded(recorded, named_by)
    if not sha256 or (found is not None and file_sha256(found) == sha256):
        return found
    here = Path(named_by).parent
    for other in (here / recorded, here / Path(recorded).name):
        try:
            if other.is_file() and file_sha256(other) == sha256:
                return str(other)
        except (OSError, ValueError):     # a name no file can have
            continue
    return found


def _as_recorded(recorded: str, named_by: str) -> str | None:
    """:func:`locate` by the recorded path alone: as written, else beside ``named_by``."""
    try:
        if Path(recorded).is_file():
            return recorded
        beside = Path(named_by).parent / recorded
        if not Path(recorded).is_absolute() and beside.is_file():
            return str(beside)
    except (OSError, ValueError):   # a name no file can have (a NUL byte, too long)
        return None
    return None


def check_output_paths(outputs: dict[str, str | os.PathLike[str] | None],
                       inputs: tuple[str | os.PathLike[str], ...] = ()) -> None:
    """Refuse, before any work, an output a command could not write: one line, naming the flag.

    ``outputs`` maps each option (``"--out"``) to the path it was given (None: not asked for).
    A command calls this first, with all of its outputs, so that it either writes every file
    or fails before touching any: ``solve --out plan.json --timeline missing/t.svg`` must not
    replace plan.json and then fail on the timeline, and ``run --report`` to a folder it cannot
    write must not train for an hour first. Checked: the path is not empty (``Path("")`` is
    the current folder, which the user did not name) nor a folder, its folder
    exists and is a folder we may create files in (a small file is written there and removed:
    that finds a full disk, a read-only file system and a folder such as /proc where no file
    can be made, which permissions alone do not say), an existing file there may be replaced,
    no two outputs name one file (one would silently be lost), and no output is one of the
    command's ``inputs`` (``export plan.json -o plan.json`` would replace the plan it reads).

    A device or a pipe (``--out /dev/null``) is let through when its permissions allow: it is
    written in place, and nothing is learned of it without writing to it (a probe would reach
    a pipe's reader), so one that refuses the write (/dev/full) is found at the write, which
    :meth:`Outputs.commit` does before it replaces any file, and said as a device's failure.
    """
    read = {Path(path).resolve() for path in inputs}
    named: dict[Path, str] = {}
    for flag, value in outputs.items():
        if value is None:
            continue
        if os.fspath(value) == "":
            raise BadInput(f"{flag} was given an empty path: give it the file to write")
        p = Path(value)
        resolved = p.resolve()
        if resolved in read:
            raise BadInput(f"cannot write {flag} '{p}': it is the file this command reads; choose another path")
        if resolved in named:
            raise BadInput(f"{named[resolved]} and {flag} both name '{p}': one would be lost; give each its own path")
        named[resolved] = flag
        if p.is_dir():
            raise BadInput(f"cannot write {flag} '{p}': it is a folder")
        target, direct = write_target(p)
        if direct:
            if not os.access(target, os.W_OK):
                raise BadInput(f"cannot write {flag} '{p}': it is not writable")
            continue
        folder = target.parent
        if not folder.is_dir():
            what = f"'{folder}' is a file, not a folder" if folder.exists() else f"folder '{folder}' does not exist"
            raise BadInput(f"cannot write {flag} '{p}': {what}")
        # The atomic writers create a temporary file in the folder and rename it over the target:
        # that needs write and search permission on the folder.
        if not os.access(folder, os.W_OK | os.X_OK):
            raise BadInput(f"cannot write {flag} '{p}': folder '{folder}' is not writable")
        # An existing file that may not be written is left alone: immutable (chattr +i, which even
        # root's access() honours) or another user's in a sticky folder such as /tmp, the rename
        # over it would fail after the work; merely read-only, it is one the user protected, which
        # ``open(path, "w")`` would refuse too.
        if target.exists() and not os.access(target, os.W_OK):
            raise BadInput(f"cannot write {flag} '{p}': {PROTECTED}")
        _probe(target, flag)


def _probe(target: Path, flag: str) -> None:
    """Create a temporary file beside ``target``, give it :data:`PROBE_BYTES`, remove it."""
    folder = target.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target), suffix=TEMP_SUFFIX, dir=folder)
    except OSError as exc:
        raise cannot_write(target, exc, flag) from None
    try:
        try:
            os.posix_fallocate(fd, 0, PROBE_BYTES)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise cannot_write(target, exc, flag) from None
            # EOPNOTSUPP and the like: a file system that cannot reserve space says nothing here.
    finally:
        os.close(fd)
        _unlink(tmp)


def _creation_mode(target: Path) -> int:
    """The permission bits a new file gets from ``open()``: 0o666 less the umask, or, when the
    target exists, its own mode (overwriting keeps a file's permissions, as ``cp`` does).

    ``tempfile.mkstemp`` creates 0600 files whatever the umask, so the atomic writers set this
    on the temporary file before renaming it into place.
    """
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)       # the only way to read it; set back at once (the CLI is one thread)
        os.umask(umask)
        return 0o666 & ~umask


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def json_number(value: Any) -> float | None:
    """A number read from an artifact, as a float; None when it is absent, null, a bool (JSON's
    true is not 1 here) or not finite. The one reading of an optional figure for every reader."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _finite(doc: Any) -> Any:
    """JSON has no infinity: store it as null (the formats document which keys may be null)."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_finite(v) for v in doc]
    return doc
