"""`gpipe-plan explore`: the what-if grid on real GPU profiles, and three of its cells run for real.

    python -m bench explore                  # (docs/benchmarks.md: how long it took)

1. Two PipeDream GPU profiles (vgg16, resnet50; ../data/pipedream-profiles, imported with
   ``gpipe-plan import-pipedream``): the 4 x 6 x 2 x 2 grid (K in 1,2,4,8; M in 1..32;
   GPipe/1F1B; recompute never/always) under a 16 GB limit per device, timed as the whole CLI
   call a user makes.
2. The built-in ``gpt`` on this CPU: profile, explore K in {1, 2} x M in {1, 2, 4, 8}, then run
   three of the grid's cells with ``gpipe-plan solve`` (the cell's flags) and ``gpipe-plan run``,
   and put the measured step and throughput next to the cell's prediction.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from .common import PIPEDREAM, Ledger, cli, git_revision, machine, read_json, run_plan, table, write_section

GRID = ["-k", "1,2,4,8", "-m", "1,2,4,8,16,32", "--schedule", "gpipe,1f1b", "--recompute", "never,always"]
# (K, M, schedule, recompute): a balanced pipeline, a deep one with recomputation, one stage.
CELLS = [(2, 2, "gpipe", "never"), (2, 8, "1f1b", "always"), (1, 4, "gpipe", "never")]


def pipedream_grid(model: str, folder: Path) -> tuple[list[str], str]:
    profile = folder / f"{model}.json"
    cli("import-pipedream", PIPEDREAM / f"{model}.graph.txt", "--out", profile)
    doc = read_json(profile)
    out = folder / f"{model}.explore.json"
    started = time.perf_counter()
    cli("explore", profile, *GRID, "-b", doc["batch_size"], "--memory-limit", "16GB", "--json", out,
        "--chart", folder / f"{model}.svg")
    took = time.perf_counter() - started
    rows = read_json(out)["rows"]
    unproven = sum(not r.get("proven", True) for r in rows)
    fits = sum(r["fits"] for r in rows)
    best = max((r for r in rows if r["fits"]), key=lambda r: r["throughput_per_s"])
    line = [model, len(doc["layers"]), doc["batch_size"], len(rows), f"{took:.1f} s", fits, unproven,
            f"K={best['stages']} M={best['micro_batches']} {best['schedule']} {best['recompute']}: "
            f"{best['normalized_throughput']:.2f}x"]
    # GPipe, no recomputation: the GPipe paper's table, normalised to K = 1, M = 1.
    grid = {(r["stages"], r["micro_batches"]): r for r in rows if r["schedule"] == "gpipe" and r["recompute"] == "never"}
    ms = sorted({m for _, m in grid})
    body = [[K, *(f"{grid[K, m]['normalized_throughput']:.2f}{'' if grid[K, m]['fits'] else ' (no fit)'}" for m in ms)]
            for K in sorted({k for k, _ in grid})]
    return line, f"`{model}`, GPipe, recompute never (normalised throughput):\n\n" + table(["K \\ M", *map(str, ms)], body)


def gpt_cells(folder: Path, steps: int, ledger: Ledger) -> list[list[object]]:
    profile = folder / "gpt.json"
    cli("profile", "gpt", "--batch-size", 8, "--out", profile, "-q")
    grid = folder / "gpt.explore.json"
    cli("explore", profile, "-k", "1,2", "-m", "1,2,4,8", "-b", 8, "--json", grid)
    rows = read_json(grid)["rows"]
    out = []
    for K, M, schedule, recompute in CELLS:
        cell = next(r for r in rows if (r["stages"], r["micro_batches"], r["schedule"], r["recompute"]) ==
                    (K, M, schedule, recompute))
        plan = folder / f"gpt.K{K}.M{M}.{schedule}.{recompute}.plan.json"
        cli("solve", profile, "-k", K, "--micro-batches", M, "--schedule", schedule, "--recompute", recompute,
            "-b", 8, "--out", plan, "-q")
        report = run_plan(plan, steps, ledger=ledger)
        measured = report["measured_step_s"]
        out.append([K, M, schedule, recompute, " ".join(map(str, cell["balance"])),
                    f"{cell['step_s'] * 1e3:.1f}", f"{report['predicted_step_s'] * 1e3:.1f}", f"{measured * 1e3:.1f}",
                    f"{measured / cell['step_s']:.3f}", f"{cell['throughput_per_s']:.1f}", f"{8 / measured:.1f}",
                    f"{cell['bubble_fraction']:.0%}",
                    "-" if report.get("measured_bubble_fraction") is None else f"{report['measured_bubble_fraction']:.0%}"])
        print(" ".join(map(str, out[-1])), flush=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench explore", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vgg16,resnet50")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    ledger = Ledger()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        grids = [pipedream_grid(m, folder) for m in args.models.split(",")]
        cells = gpt_cells(folder, args.steps, ledger)
    text = "\n".join([
        "## `gpipe-plan explore`: grids on real profiles, and cells run for real", "",
        f"Machine: {machine()}; revision {git_revision()}. {ledger.line()}", "",
        "PipeDream GPU profiles, the 4 x 6 x 2 x 2 grid (K 1,2,4,8 x M 1..32 x GPipe/1F1B x recompute "
        "never/always), 16 GB per device; time is the whole `gpipe-plan explore` call (every cell an exact "
        "solve, 0.5 s budget per cell):", "",
        table(["model", "layers", "batch", "cells", "time", "cells that fit", "not proven in budget",
               "best cell that fits"], [g[0] for g in grids]), "",
        *(g[1] + "\n" for g in grids),
        f"Built-in `gpt` on this CPU, global batch 8: three cells of `explore -k 1,2 -m 1,2,4,8` run with "
        f"`gpipe-plan run --steps {args.steps}` (measured = median step after the first). 'cell' is explore's "
        "prediction, 'plan' the same setting's `solve` (they must agree):", "",
        table(["K", "M", "schedule", "recompute", "balance", "cell ms", "plan ms", "measured ms",
               "measured / cell", "cell samples/s", "measured samples/s", "cell bubble", "measured bubble"], cells), "",
    ])
    path = write_section("explore", text)
    print(text)
    print(f"wrote {path}")
