"""``gpipe-plan demo``'s last line says where its files are: kept in --out-dir, or deleted with
the temporary folder they were written to, and how to keep them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gpipe_plan.demo as demo
from helpers.planner import cli


@pytest.fixture
def quick_demo(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The demo with its profile, solve and run replaced by writing the files they write."""
    folders: list[Path] = []

    def write_files(console, folder: Path, steps: int, stages: int) -> None:
        folders.append(folder)
        for name in demo.FILES:
            (folder / name).write_text("{}")

    monkeypatch.setattr(demo, "_demo", write_files)
    return folders


def _last_line(output: str) -> str:
    """The demo's last line, as one line (the console wraps it at its width)."""
    return "done in " + " ".join(output.rsplit("done in ", 1)[-1].split())


def test_without_out_dir_the_last_line_says_the_files_are_gone_and_how_to_keep_them(user_dir: Path,
                                                                                  quick_demo: list[Path]) -> None:
    result = cli("demo")
    assert result.exit_code == 0, result.output
    last = _last_line(result.output)
    assert not quick_demo[0].exists()                         # the temporary folder is gone ...
    assert str(quick_demo[0]) not in last                      # ... and the line does not send the user there
    assert re.fullmatch(r"done in \d+ s\. The files \(profile\.json, plan\.json, plan\.svg, report\.json, "
                        r"trace\.json\) were in a temporary folder, deleted now: keep them with "
                        r"`gpipe-plan demo --out-dir DIR`", last), last


def test_with_out_dir_the_last_line_names_the_folder_that_holds_them(user_dir: Path, quick_demo: list[Path]) -> None:
    result = cli("demo", "--out-dir", "kept")
    assert result.exit_code == 0, result.output
    last = _last_line(result.output)
    assert last.startswith("done in ") and ". Files in kept: profile.json, plan.json, plan.svg" in last, last
    assert sorted(p.name for p in (user_dir / "kept").iterdir()) == sorted(demo.FILES)


@pytest.mark.parametrize("stages", ["0", "7", "100"])
def test_stages_the_demo_model_cannot_have_are_refused_before_profiling(user_dir: Path, quick_demo: list[Path],
                                                                       stages: str) -> None:
    result = cli("demo", "--stages", stages)
    assert result.exit_code == 2, result.output
    assert f"--stages must be from 1 to 6 (the demo's gpt has 6 layers, and each stage needs one), got {stages}" \
        in result.output
    assert quick_demo == []          # refused before any of the demo's work


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc, where no folder can be made")
def test_an_out_dir_the_system_will_not_make_is_one_line_naming_it(user_dir: Path, quick_demo: list[Path]) -> None:
    # (its parent, /proc, is writable as root: the check let it through and mkdir's
    # FileNotFoundError came out with its traceback)
    result = cli("demo", "--out-dir", "/proc/d")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == ["error: cannot make --out-dir '/proc/d': No such file or directory; "
                                          "choose another folder"], result.output
    assert quick_demo == []


@pytest.mark.parametrize("out_dir, line", [
    # (was "folder 'plan.json' is not writable": a file is no folder, whatever its permissions)
    ("plan.json/sub", "error: --out-dir 'plan.json/sub': 'plan.json' is a file, not a folder"),
    # (was the current folder, which the user did not name)
    ("", "error: --out-dir was given an empty path: give it the folder to write the demo's files to"),
])
def test_an_out_dir_that_cannot_be_a_folder_is_refused_before_profiling(user_dir: Path, quick_demo: list[Path],
                                                                         out_dir: str, line: str) -> None:
    Path("plan.json").write_text("{}")
    result = cli("demo", "--out-dir", out_dir)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [line], result.output
    assert quick_demo == [] and sorted(p.name for p in user_dir.iterdir()) == ["plan.json"]
