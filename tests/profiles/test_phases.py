"""``profile``'s phase lines: what it starts, said on stderr the moment it starts, also into a log.

A profile builds and captures the model and runs it once before its progress can count any
work; into a log it used to say nothing all that while (profiles/phases.py).
"""

from __future__ import annotations

import queue
import re
import subprocess
import textwrap
import threading
from pathlib import Path

from helpers.cli_process import BIN

# A model whose factory waits for a file: the profile cannot get past building it until the
# test says so, so a line seen before that was said when the phase began, not after it.
GATED = """
    import os, time
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    def make():
        while not os.path.exists("go"):
            time.sleep(0.05)
        return Net()
"""
PROFILE = ["--input-shape", "8", "--num-classes", "4", "--micro-batch-sizes", "1,2", "--warmup", "0", "--repeats",
           "1", "--contention-processes", "0", "--no-recompute-timing", "--no-split-backward-timing",
           "--no-fixed-costs"]


def _lines(stream) -> queue.Queue[str | None]:
    """The lines of a pipe as they come (None at its end), read on a thread."""
    found: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            found.put(line.rstrip("\n"))
        found.put(None)

    threading.Thread(target=read, daemon=True).start()
    return found


def _said(line: str) -> str:
    return re.sub(r"^profiling \[[ \d?%]+, +\d+ s\] ", "", line)


def test_the_first_phase_line_comes_while_the_model_is_still_being_built(user_dir: Path) -> None:
    (user_dir / "gated.py").write_text(textwrap.dedent(GATED))
    process = subprocess.Popen([str(BIN / "gpipe-plan"), "profile", "gated:make", *PROFILE, "-o", "p.json"],
                               cwd=user_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = _lines(process.stderr)
        first = lines.get(timeout=120)
        assert first is not None and _said(first) == "building model 'gated:make'", first
        assert process.poll() is None and not (user_dir / "p.json").exists()   # the factory still waits
        (user_dir / "go").write_text("")
        assert process.wait(timeout=300) == 0
    finally:
        process.kill()
    rest = []
    while (line := lines.get(timeout=10)) is not None:
        rest.append(_said(line))
    # Capturing (not an nn.Sequential), checking, measuring; then the units, and the end.
    assert rest[:3] == ["capturing 'gated:make' with torch.export"] * 2 + ["checking the 2 layers on a micro-batch"], rest
    assert rest[3] == "measuring 2 layers at sizes 1,2: memory, then 1 timed round" and rest[-1] == "done", rest


def test_layer_by_layer_says_which_layer_of_how_many_once_and_quiet_says_nothing(user_dir: Path) -> None:
    (user_dir / "go").write_text("")
    (user_dir / "gated.py").write_text(textwrap.dedent(GATED))
    result = subprocess.run([str(BIN / "gpipe-plan"), "profile", "gated:make", *PROFILE, "--layer-by-layer",
                             "-o", "p.json"], cwd=user_dir, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    said = [_said(line) for line in result.stderr.splitlines()]
    assert "measuring layer 1 of 2: a" in said and "measuring layer 2 of 2: b" in said, said
    assert "a" not in said and "b" not in said, said       # the unit lines do not name them again
    assert said.index("running 2 micro-batch sizes through the layers") < said.index("measuring layer 1 of 2: a")
    quiet = subprocess.run([str(BIN / "gpipe-plan"), "profile", "gated:make", *PROFILE, "-q", "-o", "q.json"],
                           cwd=user_dir, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.strip() == "q.json", quiet.stderr


def test_a_dict_without_logits_is_trained_on_its_first_value_and_the_profile_says_which(user_module) -> None:
    name = user_module("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

            def forward(self, x):
                h = torch.tanh(self.a(x))
                return {"scores": self.b(h), "hidden": h}

        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.b = nn.Linear(16, 4)

            def forward(self, h):
                return {"scores": self.b(h), "hidden": h}

        def make():
            return Net()

        def make_sequential():
            return nn.Sequential(nn.Linear(8, 16), Head())
    """)
    # In this process (click's runner, stderr apart): the two tests above run profile in a child
    # process, with its real streams; a child here cost two more starts of torch (5 s each).
    from click.testing import CliRunner

    from gpipe_plan.cli import main

    for factory in ("make", "make_sequential"):       # captured with torch.export; cut at its children
        result = CliRunner().invoke(main, ["profile", f"{name}:{factory}", *PROFILE, "-o", "p.json"])
        assert result.exit_code == 0, result.output
        notes = [_said(line) for line in result.stderr.splitlines() if "note:" in line]
        assert notes == ["note: the model returns a dict without 'logits': the loss trains on its first value, "
                         "'scores' (the others ride along: 'hidden'); name the value to train on 'logits' to choose "
                         "another"], result.stderr
