"""Phase lines: what ``profile`` starts now, said on stderr the moment it starts.

Before the first unit of work a progress bar can count, a profile builds the model, captures
it with ``torch.export`` (a Hugging Face model: a minute or more on a small CPU), runs a
micro-batch through it and, layer by layer, walks the batches through every layer. Those
phases have no units, so neither the bar nor :class:`~.command.PhaseLines` (the bar's plain
form for a log) could say anything: a profile writing to a log was silent for minutes.
:func:`announce` is the one way to say such a phase: one line, on stderr, flushed at once,
whether stderr is a terminal or a file (on a terminal it prints above the live bar, which
rich keeps at the bottom while it redirects stderr). The line's form is the bar-less
progress's own (:func:`phase_text`), so a log reads as one list of what happened when.

Lines are said only inside :func:`phase_lines` (the ``profile`` command and the demo open it;
``--quiet`` opens it disabled): a library call of ``profile_model`` prints nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class _Phases:
    enabled: bool
    started: float
    said: set[str] = field(default_factory=set)   # the phases announced, by their key


_CURRENT: ContextVar[_Phases | None] = ContextVar("gpipe_plan_phase_lines", default=None)


@contextmanager
def phase_lines(enabled: bool = True) -> Iterator[None]:
    """Phase lines on (or, ``enabled`` False, explicitly off) for the code inside; elapsed
    times count from here."""
    token = _CURRENT.set(_Phases(enabled, time.monotonic()))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def announce(what: str, key: str | None = None) -> None:
    """Say that ``what`` begins now, in one line on stderr (inside :func:`phase_lines` only).

    ``key``: the name the progress's units give the same phase (a layer's name), so that the
    bar-less progress does not announce it a second time (:func:`announced`); a phase of a
    key said already is not said again.
    """
    phases = _CURRENT.get()
    if phases is None or not phases.enabled or (key is not None and key in phases.said):
        return
    if key is not None:
        phases.said.add(key)
    print(phase_text(what, None, time.monotonic() - phases.started), file=sys.stderr, flush=True)


def announced(key: str) -> bool:
    """Whether :func:`announce` has said the phase ``key`` already."""
    phases = _CURRENT.get()
    return phases is not None and phases.enabled and key in phases.said


def phase_text(what: str, share: float | None, elapsed_s: float) -> str:
    """``profiling [ 12%,    30 s] what``: the share of the counted work done (``?`` before the
    count is known) and the seconds since the profile began."""
    done = f"{share:4.0%}" if share is not None else "   ?"
    return f"profiling [{done}, {elapsed_s:5.0f} s] {what}"



def counted(n: int, noun: str) -> str:
    """``3 layers``, ``1 layer``: a count in a phase line."""
    return f"{n} {noun}{'s' if n != 1 else ''}"
