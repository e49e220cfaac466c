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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the session's groups of ranks (tests/helpers/rank_pool.py), if any test started one."""
    import sys

    pool = sys.modules.get("helpers.rank_pool")
    if pool is not None:
        pool.close_all()
