"""docs/benchmarks.md: a short introduction, the machine, and every part's section in order."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from .common import RESULTS, ROOT, git_revision, machine

TIMINGS = RESULTS / "data" / "timings.json"
# Sections written by hand: figures from scripts that run where `python -m bench` does not (a GPU
# machine), and the measurements behind rules the code states (moved out of its comments).
ELSEWHERE = {"gpu": "bench/gpu_smoke.sh and bench/gpu.sh on the GPU machine: CUDA paths, bf16 against fp32",
             "notes": "the measurements behind rules the code states (comments keep the rule, this its figures)"}

INTRO = """\
# Benchmarks

Every figure below comes from a run of `python -m bench PART` (bench/), on the machine named in
its section, except the last sections, which say where theirs come from (the GPU scripts, and
the measurements behind rules the code states). Regenerate everything with `python -m bench all`
(then this file is rebuilt), one part with `python -m bench PART` followed by
`python -m bench assemble`. Each part's section is also in `docs/benchmarks/PART.md`, its
pictures are `docs/benchmarks/*.svg` and the raw figures of the parts that time runs are in
`docs/benchmarks/data/*.json`.

The CPU parts (hand-tuning, accuracy, runtime, efficiency) run on a 2-core VM whose speed
drifts by 15-40% from one minute to the next. They interleave configurations in rounds, report
medians over rounds with the spread, record the cores other processes used during every timed
run, and give errors both raw and at the speed a reference workload measured during the run
(docs/runtime.md, "The machine's speed"); the accuracy part also at the model's own speed,
which the bench times around every run and every profile.
"""


def record_time(part: str, seconds: float, argv: list[str]) -> None:
    TIMINGS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}
    data[part] = {"seconds": round(seconds, 1), "options": argv, "finished": time.strftime("%Y-%m-%d %H:%M")}
    TIMINGS.write_text(json.dumps(data, indent=1) + "\n")


def assemble() -> Path:
    from .__main__ import PARTS  # noqa: PLC0415 (the registry, in its order)

    timings = json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}
    out = [INTRO, f"Assembled from the sections at revision {git_revision()}; this machine: {machine()}.", ""]
    rows = []
    sections = []
    for name, (module, what) in PARTS.items():
        path = RESULTS / f"{name}.md"
        if not path.exists():
            rows.append(f"| {name} | {what} | not run | |")
            continue
        t = timings.get(name)
        took = f"{t['seconds'] / 60:.0f} min" if t else "?"
        opts = " ".join(t["options"]) if t and t["options"] else "(defaults)"
        for side, st in timings.items():   # side jobs of the part (handtuning --confirm)
            if side.startswith(f"{name} "):
                took += f" + {st['seconds'] / 60:.0f} min"
                opts += f"`, then `{' '.join(st['options'])}"
        rows.append(f"| [{name}](#{_anchor(path)}) | {what} | {took} | `{opts}` |")
        text = path.read_text()
        # Pictures are linked relative to docs/benchmarks/ in the section's own file.
        text = re.sub(r"\]\((?!https?:|benchmarks/|#)([^)/]+\.svg)\)", r"](benchmarks/\1)", text)
        sections.append(text.rstrip() + "\n")
    for name, what in ELSEWHERE.items():   # sections measured by scripts, not by a part
        path = RESULTS / f"{name}.md"
        if path.exists():
            rows.append(f"| [{name}](#{_anchor(path)}) | {what} | | |")
            sections.append(path.read_text().rstrip() + "\n")
    out += ["| part | what | took | options |", "|---|---|---|---|", *rows, ""]
    total = sum(t["seconds"] for n, t in timings.items() if n.split()[0] in PARTS)
    if total:
        out += [f"The parts took {total / 3600:.1f} hours together when last run (on their own machine line).", ""]
    out += sections
    target = ROOT / "docs" / "benchmarks.md"
    target.write_text("\n".join(out))
    return target


def _anchor(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            slug = re.sub(r"[^\w\- ]", "", line[3:].strip().lower()).replace(" ", "-")
            return slug
    return path.stem
