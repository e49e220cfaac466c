"""Shared fixture: a user's own model, written to a temporary current directory."""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary current directory: ``pkg.module:factory`` models are imported from there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def user_module(user_dir: Path) -> Callable[[str], str]:
    """Write Python source as a uniquely named module in the current directory; return its name.

    Unique names, because a module imported by one test stays in ``sys.modules``.
    """
    def write(source: str) -> str:
        name = f"user_model_{uuid.uuid4().hex[:8]}"
        (user_dir / f"{name}.py").write_text(textwrap.dedent(source))
        return name
    return write


@pytest.fixture(autouse=True)
def layers_timed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiles time their layers once, whatever the host's speed did: what a test counts of the
    profiler's work (progress units, runs) must not depend on it. The retakes ([Note: layers timed
    at the host's own speed]) have their own tests (tests/profiles/test_host_speed.py)."""
    from gpipe_plan import speedprobe      # (no torch: the planner's tests stay without it)

    monkeypatch.setattr(speedprobe, "LAYER_TRIES", 1)


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches the processes the tests start even when the suite itself was started with
    SIGINT ignored (a shell's ``command &`` without job control, as scripts run it): an ignored
    signal stays ignored across exec, so the tests that press Ctrl-C on a solve or a run would
    see it run on to its end. A handler, unlike an ignore, is reset to the default on exec."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the session's groups of ranks (tests/helpers/rank_pool.py), if any test started one."""
    import sys

    pool = sys.modules.get("helpers.rank_pool")
    if pool is not None:
        pool.close_all()
