"""Reading and writing gpipe-plan's JSON artifacts (profile, plan, report), safely.

The three packages are coupled only through these files, so this module is the one piece
they share. It gives them three guarantees a user can rely on:

- a bad file is reported in one line that names the file and what is wrong with it
  (:class:`BadInput`, which the CLI turns into exit code 2, without a traceback);
- an artifact of the wrong kind or version is refused before anything uses it;
- an output file is either the whole new document or absent: it is written to a temporary
  file in the same folder and renamed over the target, so an interrupted run never leaves
  half a JSON file behind.

No torch here: ``gpipe-plan solve`` imports this and must start fast.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "gpipe-plan.profile"
PLAN_FORMAT = "gpipe-plan.plan"
REPORT_FORMAT = "gpipe-plan.report"

# The version each format is written with, and the versions this code can read. Profile 2
# added ``contention`` and plan 2 ``options.compute_scale``; profile 3 the recompute timings;
# profile 4 takes ``contention.slowdown`` from the slowest process (and adds
# ``slowest_step_s``). Each only adds optional keys or refines a measurement, so older files
# still read (a version 1 profile plans as if neighbours cost nothing).
FORMAT_VERSIONS: dict[str, int] = {PROFILE_FORMAT: 4, PLAN_FORMAT: 2, REPORT_FORMAT: 1}
READABLE_VERSIONS: dict[str, tuple[int, ...]] = {PROFILE_FORMAT: (1, 2, 3, 4), PLAN_FORMAT: (1, 2), REPORT_FORMAT: (1,)}


class BadInput(Exception):
    """The user gave something we cannot use. The message is one line: what, and what to do.

    The CLI prints it and exits with status 2.
    """


class RunFailure(Exception):
    """Something failed while running (a crashed rank, a NaN loss). The CLI exits with 1."""


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


def read_artifact(path: str | os.PathLike[str], fmt: str) -> dict[str, Any]:
    """Read a gpipe-plan artifact and check that it is the expected format and version."""
    what = fmt.split(".")[-1]
    doc = read_json(path, what)
    check_format(doc, fmt, str(path))
    return doc


def check_format(doc: Any, fmt: str, where: str) -> None:
    """Refuse a document that is not ``fmt`` at a version this code reads."""
    what = fmt.split(".")[-1]
    if not isinstance(doc, dict):
        raise BadInput(f"'{where}' is not a gpipe-plan {what}: expected a JSON object")
    found = doc.get("format")
    if found != fmt:
        hint = f" (it is a {found.split('.')[-1]})" if isinstance(found, str) and found.startswith("gpipe-plan.") else ""
        raise BadInput(f"'{where}' is not a gpipe-plan {what}: \"format\" is {found!r}, expected {fmt!r}{hint}")
    version = doc.get("version")
    readable = READABLE_VERSIONS[fmt]
    if version not in readable or isinstance(version, bool):
        raise BadInput(
            f"'{where}' is {what} format version {version!r}; this gpipe-plan reads {_versions(readable)}: "
            "re-create it with this version of gpipe-plan"
        )


def _versions(readable: tuple[int, ...]) -> str:
    """(1,) -> 'version 1'; (1, 2, 3) -> 'versions 1, 2 or 3'."""
    if len(readable) == 1:
        return f"version {readable[0]}"
    return "versions " + ", ".join(map(str, readable[:-1])) + f" or {readable[-1]}"


def dumps(doc: Any) -> str:
    """Serialise deterministically: the same document always gives the same bytes."""
    return json.dumps(_finite(doc), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def write_json_atomic(path: str | os.PathLike[str], doc: Any) -> None:
    """Write ``doc`` as JSON to ``path`` so that readers see the old file or the new one, never half."""
    write_text_atomic(path, dumps(doc))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.exists():
        raise BadInput(f"cannot write '{p}': folder '{folder}' does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _finite(doc: Any) -> Any:
    """JSON has no infinity: store it as null (the formats document which keys may be null)."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_finite(v) for v in doc]
    return doc
