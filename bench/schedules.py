"""Today's schedules: what each one measures and predicts, and what the planner picks.

    python -m bench schedules                       # both parts (how long each took: docs/benchmarks.md)
    python -m bench schedules --part pipedream      # the PipeDream profiles only
    python -m bench schedules --rounds 1 --steps 6  # a rough CPU figure

Two parts:

1. ``cpu``: the built-in ``gpt`` on K = 2 stages, M = 4 micro-batches, global batch 32, on
   this CPU (``gpipe-plan run``, separate processes, gloo). One profile; for each schedule
   (gpipe, 1f1b, interleaved with v = 2, zb-h1, zb-v) ``solve --schedule S`` gives the best
   plan of that schedule, and the planner's own choice is ``solve --schedule auto`` (M fixed
   at 4). Each plan runs for ``--steps`` steps; the rounds interleave the schedules (every
   schedule once per round) so that the host's drift lands on all alike. Reported: the median
   step after the first, against 1F1B's in the same round and against its prediction, and
   whether ``auto`` chose the fastest measured schedule.
2. ``pipedream``: the 14 PipeDream profiles (real GPU timings; they have no split backward,
   so I = W = B / 2 is assumed, as ``solve`` does for any profile without it) at K = 4, 8
   and M = 8, 32: each schedule's best plan (fixed M, no recomputation, no memory limit),
   its bubble (the share of stage-time idle) and how much of 1F1B's bubble it removes, and
   which schedule ``auto`` picks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpipe_plan.schedules import label

from .common import Ledger, cli, git_revision, machine, read_json, run_plan, table, write_section

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
DATA = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "data"


# ---------------------------------------------------------------------------- part 1: this CPU
def measure_cpu(rounds: int, steps: int, ledger: Ledger) -> dict[str, Any]:
    K, M, B = 2, 4, 32
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        profile = folder / "gpt.profile.json"
        cli("profile", "gpt", "--batch-size", B // M, "--global-batch-size", B, "--out", profile, "-q")
        plans: dict[str, Path] = {}
        for schedule in (*SCHEDULES, "auto"):
            plan = folder / f"{schedule}.plan.json"
            extra = ["--virtual-stages", "2"] if schedule == "interleaved" else []
            cli("solve", profile, "-k", K, "-m", M, "-b", B, "--schedule", schedule, *extra, "--out", plan, "-q")
            plans[schedule] = plan
        docs = {s: read_json(p) for s, p in plans.items()}
        runs_of = (*SCHEDULES, "auto")    # the planner's own choice runs too (it may pick another v)
        measured: dict[str, list[float]] = {s: [] for s in runs_of}
        runs: list[dict[str, Any]] = []
        for r in range(rounds):
            order = runs_of if r % 2 == 0 else tuple(reversed(runs_of))
            for schedule in order:
                report = run_plan(plans[schedule], steps, ledger=ledger)
                measured[schedule].append(report["measured_step_s"])
                runs.append({"round": r, "schedule": schedule, "measured_step_s": report["measured_step_s"],
                             "others_cores": report["_others_cores"],
                             "measured_bubble_fraction": report.get("measured_bubble_fraction")})
    return {
        "model": "gpt (built-in defaults)", "stages": K, "micro_batches": M, "global_batch_size": B,
        "rounds": rounds, "steps": steps,
        "plans": {s: {"schedule": d["schedule"], "virtual_stages": d.get("virtual_stages", 1),
                      "balance": d["balance"], "predicted_step_s": d["predicted"]["step_s"],
                      "predicted_bubble_fraction": d["predicted"]["bubble_fraction"]} for s, d in docs.items()},
        "measured_step_s": measured,
        "runs": runs,
    }


def render_cpu(data: dict[str, Any]) -> str:
    plans, measured = data["plans"], data["measured_step_s"]
    rows = []
    for s in (*SCHEDULES, "auto"):
        ratios_1f1b = [m / o for m, o in zip(measured[s], measured["1f1b"])]
        median = statistics.median(measured[s])
        predicted = plans[s]["predicted_step_s"]
        name = label(plans[s]["schedule"], plans[s]["virtual_stages"])
        rows.append([name if s != "auto" else f"auto: {name}",
                     str(plans[s]["balance"]), f"{predicted * 1e3:.1f}", f"{median * 1e3:.1f}",
                     f"{median / predicted:.3f}",
                     f"{min(ratios_1f1b):.3f}-{max(ratios_1f1b):.3f}" if s != "1f1b" else "1",
                     f"{plans[s]['predicted_bubble_fraction']:.1%}"])
    fastest = min(measured, key=lambda s: statistics.median(measured[s]))
    auto = plans["auto"]
    verdict = (f"`solve --schedule auto` chose **{label(auto['schedule'], auto['virtual_stages'])}** (balance "
               f"{auto['balance']}, predicted {auto['predicted_step_s'] * 1e3:.1f} ms); the fastest measured plan "
               f"was **{'the auto plan' if fastest == 'auto' else label(plans[fastest]['schedule'], plans[fastest]['virtual_stages'])}**")
    if fastest != "auto":
        ratio = statistics.median(measured["auto"]) / statistics.median(measured[fastest])
        verdict += f": the auto plan measured {ratio - 1:+.1%} against it"
    return (f"`{data['model']}`, K = {data['stages']}, M = {data['micro_batches']}, global batch "
            f"{data['global_batch_size']}; {data['rounds']} rounds of {data['steps']} steps each, the "
            f"schedules interleaved within a round (median step after the first).\n\n"
            + table(["schedule", "balance (layers per chunk)", "predicted ms", "measured ms", "measured/predicted",
                     "vs 1f1b, per round", "predicted bubble"], rows)
            + f"\n\n{verdict}.\n")


# ---------------------------------------------------------------------------- part 2: PipeDream
def measure_pipedream(stages=(4, 8), micro_batches=(8, 32), time_budget_s: float = 2.0) -> dict[str, Any]:
    from gpipe_plan.planner.problem import SolveOptions
    from gpipe_plan.planner.search import search

    from .planner_quality import load_all

    cells = []
    for name, profile in load_all().items():
        size = profile.sizes[0]
        layers = profile.at(size).num_layers
        for K in stages:
            for M in micro_batches:
                cell: dict[str, Any] = {"profile": name, "layers": layers, "stages": K, "micro_batches": M}
                for schedule in (*SCHEDULES, "auto"):
                    # auto searches seven settings (interleaved at v = 2, 3, 4): five times the budget.
                    budget = time_budget_s * (5 if schedule == "auto" else 1)
                    options = SolveOptions(stages=K, global_batch_size=M * size, micro_batches=M, schedule=schedule,
                                           recompute="never", time_budget_s=budget,
                                           virtual_stages=2 if schedule == "interleaved" else "auto")
                    started = time.perf_counter()
                    try:
                        result = search(profile, options, explain=False)
                        best = result.best
                        ev = best.solution.evaluation if best.solution else None
                    except Exception as exc:  # a schedule that cannot cut this many layers
                        cell[schedule] = {"error": str(exc).splitlines()[0]}
                        continue
                    cell[schedule] = None if ev is None else {
                        "step_s": ev.step_s, "bubble_fraction": ev.bubble_fraction(M),
                        "schedule": best.setting.schedule,
                        "virtual_stages": getattr(best.setting, "virtual_stages", 1),
                        "proven": best.solution.proven, "seconds": round(time.perf_counter() - started, 3)}
                cells.append(cell)
    return {"stages": list(stages), "micro_batches": list(micro_batches), "cells": cells,
            "assumption": "I = W = B/2 (the profiles have no split backward)"}


def render_pipedream(data: dict[str, Any]) -> str:
    rows = []
    picks: dict[str, int] = {}
    unproven = 0
    for K in data["stages"]:
        for M in data["micro_batches"]:
            cells = [c for c in data["cells"] if c["stages"] == K and c["micro_batches"] == M
                     and isinstance(c.get("1f1b"), dict) and "step_s" in c["1f1b"]]
            if not cells:
                continue
            row = [K, M, len(cells), f"{statistics.median(c['1f1b']['bubble_fraction'] for c in cells):.1%}"]
            for s in SCHEDULES:
                removed = [1 - c[s]["bubble_fraction"] / c["1f1b"]["bubble_fraction"]
                           for c in cells if isinstance(c.get(s), dict) and "bubble_fraction" in c[s]
                           and c["1f1b"]["bubble_fraction"] > 0]
                speed = [c["1f1b"]["step_s"] / c[s]["step_s"] for c in cells
                         if isinstance(c.get(s), dict) and "step_s" in c[s]]
                row.append(f"{statistics.median(removed):+.0%} / {statistics.median(speed):.2f}x" if removed else "-")
            rows.append(row)
            for c in cells:
                auto = c.get("auto")
                if isinstance(auto, dict) and "schedule" in auto:
                    name = label(auto["schedule"], auto.get("virtual_stages", 1))
                    picks[name] = picks.get(name, 0) + 1
                    unproven += not auto["proven"]
                for s in SCHEDULES:
                    if isinstance(c.get(s), dict) and c[s].get("proven") is False:
                        unproven += 1
    total = sum(picks.values())
    pick_text = ", ".join(f"{k} {v}/{total}" for k, v in sorted(picks.items(), key=lambda kv: -kv[1]))
    return ("The 14 PipeDream profiles (GPU timings; no split backward, so I = W = B/2 is assumed), each "
            "schedule's best plan at a fixed M, no recomputation, no memory limit. A cell: the median share "
            "of 1F1B's bubble the schedule removes / the median speed-up of its step over 1F1B's.\n\n"
            + table(["K", "M", "profiles", "1F1B bubble (median)", *SCHEDULES], rows)
            + f"\n\n`--schedule auto` picked: {pick_text}. Searches that stopped at their time budget "
              f"(not proven optimal): {unproven}.\n")


def main(argv=None) -> str | None:
    parser = argparse.ArgumentParser(prog="python -m bench schedules", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "cpu", "pipedream", "render"), default="all",
                        help="render: rewrite the section from the saved figures, measuring nothing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    DATA.mkdir(parents=True, exist_ok=True)
    raw = DATA / "schedules.json"
    data: dict[str, Any] = json.loads(raw.read_text()) if raw.exists() else {}
    ledger = Ledger()
    if args.part in ("all", "pipedream"):
        data["pipedream"] = {**measure_pipedream(), "revision": git_revision()}
    if args.part in ("all", "cpu"):
        data["cpu"] = {**measure_cpu(args.rounds, args.steps, ledger), "revision": git_revision()}
        data["cpu"]["machine_use"] = ledger.line()
    if args.part != "render":
        data["machine"] = machine()
    raw.write_text(json.dumps(data, indent=1) + "\n")
    text = "## Today's schedules (interleaved, zero bubble)\n\n"
    if "cpu" in data:
        text += (f"### On this CPU\n\nRevision {data['cpu'].get('revision', '?')}. {data['cpu'].get('machine_use', '')} "
                 + render_cpu(data["cpu"]) + "\n")
    if "pipedream" in data:
        text += (f"### On the PipeDream profiles\n\nRevision {data['pipedream'].get('revision', '?')} (no timing: "
                 f"the searches are budgeted in work, so any machine gives the same plans). "
                 + render_pipedream(data["pipedream"]) + "\n")
    text = text.replace("\n\n", f"\n\nMachine: {data['machine']}.\n\n", 1)
    print(f"wrote {write_section('schedules', text)}")
    # Re-rendering measures nothing: its time is kept apart from the part's own (bench/__main__.py).
    return "render" if args.part == "render" else None


if __name__ == "__main__":
    main()
