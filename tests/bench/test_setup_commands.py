"""bench/setup.py (`python -m bench setup`): it times the README's own two set-up commands."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT))    # bench/ is the repository's, not the package's
    from bench import setup

    return setup


def test_the_readme_commands_are_found_and_split_into_install_and_job(setup) -> None:
    demo, tests = setup.readme_commands((ROOT / "README.md").read_text())
    assert setup.split_command(demo)[1] == "gpipe-plan demo"
    install, job = setup.split_command(tests)
    assert job.startswith("pytest") and "pip install" in install and ".[test]" in install
    # CI runs the README's test command (.ci/run says so): the same job, pip quieted
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'-e ".[test]" && {job}' in ci


def test_a_command_without_a_job_and_pytests_summary_line(setup) -> None:
    with pytest.raises(SystemExit, match="cannot split"):
        setup.split_command("gpipe-plan demo")
    assert setup.test_summary("....\n1891 passed, 16 skipped in 612.33s (0:10:12)\n") == \
        "1891 passed, 16 skipped in 612.33s (0:10:12)"
    assert setup.test_summary("3 failed, 1888 passed in 600.00s\n") == "3 failed, 1888 passed in 600.00s"
    assert setup.test_summary("nothing\n") == "no summary"
