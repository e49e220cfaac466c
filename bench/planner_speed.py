"""Solver speed: how long planning takes, in process and as a whole CLI call.

Targets (issue 3): 2,000 layers into 64 stages with M fixed under 1 s in process and under
3 s for the whole ``gpipe-plan solve`` call; the full search (every M, both schedules,
per-stage recomputation) on 500 layers and K = 8 under 10 s. Profiles are synthetic
(bench/synthetic.py); each figure is the median of a few runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpipe_plan.planner.profile import Profile
from gpipe_plan.planner.problem import SolveOptions
from gpipe_plan.planner.search import search

from .common import ROOT, git_revision, machine, table, write_section
from .synthetic import synthetic_profile


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def run(repeats: int = 3) -> str:
    rows = []
    cases = [
        ("2,000 layers, K = 64, M = 64, gpipe, no communication", 2000, dict(stages=64, micro_batches=64,
         schedule="gpipe", global_batch_size=64), False, False),
        ("... with optimizer time per layer", 2000, dict(stages=64, micro_batches=64, schedule="gpipe",
         global_batch_size=64), True, False),
        ("... with optimizer time and a 25 GB/s link", 2000, dict(stages=64, micro_batches=64, schedule="gpipe",
         global_batch_size=64), True, True),
        ("500 layers, K = 8, full search (M auto, schedule auto, recompute auto)", 500,
         dict(stages=8, global_batch_size=256), True, False),
        ("... with a 25 GB/s link", 500, dict(stages=8, global_batch_size=256), True, True),
        ("... with a memory limit that forces recomputation", 500,
         dict(stages=8, global_batch_size=256, memory_limit_bytes=None), True, False),
    ]
    for label, layers, options, optimizer, link in cases:
        doc = synthetic_profile(layers, optimizer=optimizer, link=link)
        profile = Profile(doc)
        if "memory_limit_bytes" in options:
            # 70% of what the unconstrained best plan needs: something must recompute.
            best = search(profile, SolveOptions(**{**options, "memory_limit_bytes": None}))
            options = {**options, "memory_limit_bytes": int(0.7 * best.best.solution.evaluation.peak_memory_bytes)}
        seconds, result = timed(lambda: search(profile, SolveOptions(**options, time_budget_s=60)), repeats)
        best = result.best
        rows.append([label, f"{seconds:.2f}", best.setting.micro_batches, best.setting.schedule,
                     sum(best.solution.evaluation.recompute), "yes" if result.proven else "no"])
    # The whole CLI call (process start, imports, read, solve, write) for the first case.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        path.write_text(json.dumps(synthetic_profile(2000, optimizer=False)))
        cmd = [sys.executable, "-m", "gpipe_plan.cli", "solve", str(path), "--stages", "64", "--micro-batches", "64",
               "--global-batch-size", "64", "--schedule", "gpipe", "--out", str(Path(tmp) / "plan.json"), "--quiet"]
        cli_s, _ = timed(lambda: subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT), repeats)
    rows.insert(1, ["the same as one `gpipe-plan solve` call (process start to plan written)", f"{cli_s:.2f}",
                    64, "gpipe", 0, "yes"])
    text = "\n".join([
        "## Solver speed",
        "",
        f"Machine: {machine()}; revision {git_revision()}. Synthetic profiles (bench/synthetic.py); "
        f"median of {repeats} runs. 'Proven' means optimal over every setting searched.",
        "",
        table(["case", "seconds", "chosen M", "schedule", "stages recomputing", "proven"], rows),
    ])
    return text + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench solver", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    text = run(args.repeats)
    path = write_section("solver", text)
    print(text)
    print(f"wrote {path}")
