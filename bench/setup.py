"""The README's two set-up commands, timed as a new user runs them: on a fresh clone, from nothing.

    python -m bench setup                 # about 15 minutes on the 2-core VM (the tests take most)
    python -m bench setup --no-tests      # the first command alone, about a minute

The commands are read from the README itself (its first two ``bash`` blocks: "Try it" and "The
tests"), so that what is timed is what the README says. Each is run in its own clone of the
working tree's HEAD, in a new virtual environment, split at its last ``&&``: the install (its
``venv`` and ``pip install``) and the job (``gpipe-plan demo``; ``pytest``), each timed. pip's own
cache and the CPU wheel of torch the machine holds are used as a user's would be: the figures say
what installing costs on a machine that has downloaded torch before, not a first download.
The test job's summary line (passed, skipped) is recorded with its time. The README quotes these
figures.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import ROOT, Ledger, Others, measured_or_saved, publish

README = ROOT / "README.md"


def readme_commands(text: str) -> list[str]:
    """The README's first two ``bash`` blocks' commands: the demo's, then the tests'."""
    blocks = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    if len(blocks) < 2:
        raise SystemExit("README.md has fewer than two ```bash blocks: where are its set-up commands?")
    return [blocks[0].strip(), blocks[1].strip()]


def split_command(command: str) -> tuple[str, str]:
    """(install, job): the command split at its last ``&&``."""
    install, _, job = command.rpartition("&&")
    if not install:
        raise SystemExit(f"cannot split {command!r} into an install and a job at its last '&&'")
    return install.strip(), job.strip()


def timed(shell: str, cwd: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``shell`` in bash in ``cwd``: its wall time, exit status, the cores others used, its output's tail."""
    with Others() as others:
        started = time.monotonic()
        done = subprocess.run(["bash", "-c", shell], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
        seconds = time.monotonic() - started
    return {"seconds": seconds, "returncode": done.returncode, "others_cores": others.cores,
            "tail": (done.stdout + done.stderr)[-2000:]}


def run_command(command: str, ledger: Ledger, timeout_s: float) -> dict[str, Any]:
    """One README command in a fresh clone: install, then the job in the same environment."""
    install, job = split_command(command)
    activate = ". .venv/bin/activate"
    with tempfile.TemporaryDirectory(prefix="bench-setup-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        first = timed(install, clone, timeout_s)
        ledger.add(first["others_cores"])
        if first["returncode"] != 0:
            return {"command": command, "install": first, "job": None}
        # (the install activated its venv in its own shell: the job activates it again)
        then = timed(f"{activate} && {job}", clone, timeout_s)
        ledger.add(then["others_cores"])
    return {"command": command, "install": first, "job": then}


def test_summary(tail: str) -> str:
    """pytest's last line, e.g. ``1891 passed, 16 skipped in 612.3s`` (less its ``=`` rules)."""
    lines = [line.strip("= ").strip() for line in tail.splitlines() if " passed" in line or " failed" in line]
    return lines[-1] if lines else "no summary"


def measure(args: argparse.Namespace, ledger: Ledger) -> dict[str, Any]:
    demo, tests = readme_commands(README.read_text())
    out = {"demo": run_command(demo, ledger, args.timeout)}
    if not args.no_tests:
        out["tests"] = run_command(tests, ledger, args.timeout)
    return out


def _line(name: str, entry: dict[str, Any]) -> str:
    install, job = entry["install"], entry["job"]
    if job is None:
        return f"- {name}: the install failed ({install['returncode']}): {install['tail'][-300:]!r}"
    status = "" if job["returncode"] == 0 else f", exit status {job['returncode']}"
    extra = f" ({test_summary(job['tail'])})" if name == "tests" else ""
    return (f"- {name}: `{entry['command']}` took {install['seconds'] + job['seconds']:.0f} s: "
            f"{install['seconds']:.0f} s to install, {job['seconds']:.0f} s for `{split_command(entry['command'])[1]}`"
            f"{extra}{status}; other processes used {max(install['others_cores'], job['others_cores']):.2f} of a "
            f"core at most meanwhile.")


def section(data: dict[str, Any]) -> str:
    lines = ["## Set-up: the README's two commands on a fresh clone", "",
             f"Machine: {data['machine']}; revision {data['revision']}. {data['ledger']}", "",
             "Each command in its own clone of HEAD and a new virtual environment, torch's CPU wheel already "
             "downloaded once on the machine (pip's cache), timed as two parts: the install, then the job "
             "(bench/setup.py).", ""]
    lines.append(_line("demo", data["demo"]))
    if "tests" in data:
        lines.append(_line("tests", data["tests"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench setup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-tests", action="store_true", help="time the first command only")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per part before giving up")
    parser.add_argument("--from-json", type=Path, help="re-render from saved figures")
    args = parser.parse_args(argv)
    data = measured_or_saved("setup", args, lambda ledger: measure(args, ledger))
    publish("setup", section(data))


if __name__ == "__main__":
    main()
