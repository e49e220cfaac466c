"""allocator.py: profile and run fix glibc's mmap and trim thresholds, for themselves and for
the processes they start, and keep a figure the user set."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpipe_plan import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or allocator._glibc() is None,
                                reason="glibc only")

VARIABLES = [variable for _, variable, _ in allocator.SETTINGS]


def test_the_thresholds_are_fixed_here_and_for_the_processes_started_after(monkeypatch: pytest.MonkeyPatch):
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    applied = allocator.steady_allocator()
    assert applied == {variable: value for _, variable, value in allocator.SETTINGS}
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['MALLOC_MMAP_THRESHOLD_'], "
                            "os.environ['MALLOC_TRIM_THRESHOLD_'])"], capture_output=True, text=True, check=True)
    assert child.stdout.split() == [str(32 << 20), str(256 << 20)]


def test_a_figure_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    applied = allocator.steady_allocator()
    assert applied["MALLOC_MMAP_THRESHOLD_"] == 1 << 20
    assert applied["MALLOC_TRIM_THRESHOLD_"] == 256 << 20


def test_a_preloaded_allocator_is_left_alone(monkeypatch: pytest.MonkeyPatch):
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert allocator.steady_allocator() == {}
    assert not any(variable in __import__("os").environ for variable in VARIABLES)


def test_profile_and_run_and_a_rank_set_it_before_they_allocate():
    """The three entry points call it first (a rank under torchrun has not met run's)."""
    import inspect

    from gpipe_plan.profiles.command import profile_command
    from gpipe_plan.runtime.command import run_command
    from gpipe_plan.runtime.worker import run_rank

    for entry in (profile_command, run_command, run_rank):
        body = [line.strip() for line in inspect.getsource(entry).split('"""')[-1].splitlines()]
        statements = [line for line in body if line and not line.startswith(("from ", "import ", "#"))]
        assert statements[0].startswith("steady_allocator()"), entry.__name__
