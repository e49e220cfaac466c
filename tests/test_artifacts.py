"""What an output path that cannot be written is told (gpipe_plan/artifacts.py: check_output_paths
before the work, Outputs at the write): one line that names the flag, the path the user typed,
and the real reason; nothing half-written, nothing lost.

Each test runs a case whose line was wrong: it blamed a writable folder for a protected file,
named a free-space figure that contradicted "no space left", called a file a folder that is
not writable, or named '.' for an empty path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from gpipe_plan.artifacts import BadInput, Outputs, check_output_paths, write_json_atomic

from helpers.planner import cli, profile_doc, write_json

PROTECTED = ("the file exists and cannot be written (its permissions or attributes, such as chattr +i, protect "
             "it): make it writable or choose another path")


def error_lines(result) -> list[str]:
    """The non-empty lines a CliRunner result printed (stderr is mixed into output)."""
    return [line for line in result.output.splitlines() if line.strip()]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@contextlib.contextmanager
def protected(path: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``path`` made a file that may not be written: immutable (``chattr +i``: needs root and a
    file system with the attribute, else skipped), or read-only as its permissions make it for
    anyone but root (os.access refuses it, as it would for a user: root's access ignores the
    mode bits)."""
    if how == "chattr":
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)],
                                                            capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here (needs root and a file system that has it)")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        return
    access = os.access
    target = path.resolve()

    def read_only(where, mode, *args, **kwargs) -> bool:
        if Path(where).resolve() == target and mode & os.W_OK:
            return False
        return access(where, mode, *args, **kwargs)
    monkeypatch.setattr(os, "access", read_only)
    yield


@pytest.mark.parametrize("how", ["chattr", "permissions"])
def test_an_existing_file_that_cannot_be_written_is_refused_before_the_work(user_dir: Path, how: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # (was found after the work, at the rename, as "cannot write 'imm.json': folder '.' is not
    # writable", although the folder is, and without the flag)
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    Path("imm.json").write_text("old")
    with protected(Path("imm.json"), how, monkeypatch):
        with pytest.raises(BadInput) as refused:
            check_output_paths({"--out": "imm.json"})
        assert str(refused.value) == f"cannot write --out 'imm.json': {PROTECTED}"
        result = cli("solve", "profile.json", "-k", "2", "-q", "--out", "imm.json")
        assert result.exit_code == 2, result.output
        assert error_lines(result) == [f"error: cannot write --out 'imm.json': {PROTECTED}"], result.output
    assert Path("imm.json").read_text() == "old" and leftovers(user_dir) == []


def test_a_file_the_rename_cannot_replace_names_the_flag_and_the_file(user_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Found only at the write (it became immutable after the check): the same line, not the folder's."""
    Path("imm.json").write_text("old")

    def refuse(src, dst, *args, **kwargs) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(BadInput) as refused:
        with Outputs() as outputs:
            outputs.add("imm.json", "new", "--out")
    assert str(refused.value) == f"cannot write --out 'imm.json': {PROTECTED}"
    assert Path("imm.json").read_text() == "old" and leftovers(user_dir) == []


@pytest.mark.skipif(not (Path("/dev/full").exists() and os.access("/dev/full", os.W_OK)), reason="needs /dev/full")
def test_a_device_that_is_full_is_not_given_a_free_space_figure(user_dir: Path) -> None:
    # (was "no space left on the device holding '/dev', 11.76 GiB free for 13.27 KiB": /dev's free
    # space is not the device's, and contradicted the line)
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    check_output_paths({"--out": "/dev/full"})    # a device is a fine output (/dev/null): found at the write
    result = cli("solve", "profile.json", "-k", "2", "-q", "--out", "/dev/full", "--timeline", "t.svg")
    assert result.exit_code == 2, result.output
    assert error_lines(result) == ["error: cannot write --out '/dev/full': the write failed, no space left on it "
                                   "(a device, written in place); write it elsewhere"], result.output
    assert not Path("t.svg").exists() and leftovers(user_dir) == []     # written first: no file replaced


def test_a_full_disk_is_given_its_free_space_only_where_that_explains_it(user_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", no_room)
    with pytest.raises(BadInput) as refused:          # the device reports room (its inodes used up, say)
        write_json_atomic("p.json", {"a": 1})
    assert str(refused.value) == ("cannot write 'p.json': no space left on the device holding '.' (the write failed, "
                                  "though the device reports free space); free some space or write it elsewhere")
    usage = shutil.disk_usage(".")
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage._replace(free=1000))
    with pytest.raises(BadInput) as refused:          # it does not: the figure says why
        write_json_atomic("p.json", {"a": "x" * 2000})
    line = str(refused.value)
    assert line.startswith("cannot write 'p.json': no space left on the device holding '.', 1000 B free for ") \
        and line.endswith(" KiB; free some space or write it elsewhere"), line
    assert leftovers(user_dir) == [] and not Path("p.json").exists()


def test_a_folder_that_is_a_file_is_called_a_file(user_dir: Path) -> None:
    # (was "folder 'plan.json' is not a folder")
    Path("plan.json").write_text("{}")
    with pytest.raises(BadInput, match=r"^cannot write --out 'plan\.json/x\.json': 'plan\.json' is a file, "
                                       r"not a folder$"):
        check_output_paths({"--out": "plan.json/x.json"})


@pytest.mark.parametrize("args, flag", [
    (["solve", "profile.json", "-k", "2", "-q", "--out", ""], "--out"),
    (["explore", "profile.json", "--stages", "2", "--json", ""], "--json"),
    (["import-pipedream", "graph.txt", "--out", ""], "--out"),
])
def test_an_empty_output_path_is_called_empty(user_dir: Path, args: list[str], flag: str) -> None:
    # (was "cannot write --out '.': it is a folder": a path the user did not type)
    write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))
    Path("graph.txt").write_text("")
    before = sorted(p.name for p in user_dir.iterdir())
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert error_lines(result) == [f"error: {flag} was given an empty path: give it the file to write"], result.output
    assert sorted(p.name for p in user_dir.iterdir()) == before
