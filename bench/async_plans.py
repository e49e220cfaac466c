"""Asynchronous plans: what pipedream and pipedream-2bw are predicted to save over 1F1B, and cost in memory.

Cases: the 14 PipeDream profiles, read as bench/exactness.py reads them (imported at their
mini-batch, gnmt and gnmt_large at 64, more than 64 layers coarsened to 48; the global batch
the mini-batch rounded up to a multiple of 32); K = 2, 4, 8 stages; M = 8, 16 micro-batches;
each of 1f1b, pipedream and pipedream-2bw at its own best cut (``search`` at a fixed M and
schedule: recompute auto, no memory limit, free links, as the profiles measured none; Adam).
Reported: the predicted step of each against 1F1B's at the same K and M (the bubble the
asynchronous schedules remove), the one-time fill and drain they pay instead, and the peak
memory per stage of the three (the stashed weight versions and the K - k micro-batches in
flight against 1F1B's min(M, K - k)). Predictions only: nothing is run, and the searches are
exact, so any machine gives the same figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from .common import RESULTS, git_revision, machine, table, write_section

SCHEDULES = ("1f1b", "pipedream", "pipedream-2bw")
STAGES = (2, 4, 8)
MICRO_BATCHES = (8, 16)
DATA = RESULTS / "data"
EXAMPLE = ("vgg16", 4, 8)      # the profile, K and M whose per-stage memory is shown in full


def measure(budget_s: float) -> dict[str, Any]:
    from gpipe_plan.planner.problem import SolveOptions
    from gpipe_plan.planner.search import search

    from .exactness import profiles

    cells = []
    for name, (profile, layers, batch) in profiles().items():
        for K in STAGES:
            if K > profile.num_layers:
                continue
            for M in MICRO_BATCHES:
                cell: dict[str, Any] = {"profile": name, "layers": profile.num_layers, "stages": K,
                                        "micro_batches": M}
                for schedule in SCHEDULES:
                    started = time.perf_counter()
                    result = search(profile, SolveOptions(stages=K, micro_batches=M, schedule=schedule,
                                                          global_batch_size=batch, time_budget_s=budget_s))
                    ev = result.best.solution.evaluation
                    cell[schedule] = {
                        "step_s": ev.step_s, "bubble_fraction": ev.bubble_fraction(M),
                        "fill_drain_s": ev.fill_drain_s, "proven": result.proven,
                        "balance": ev.balance,
                        "stage_memory_bytes": [round(st.memory_bytes) for st in ev.stages],
                        "stage_params_bytes": [round(st.params_bytes) for st in ev.stages],
                        "stage_activations_bytes": [round(st.activations_bytes) for st in ev.stages],
                        "seconds": round(time.perf_counter() - started, 3)}
                cells.append(cell)
    return {"cells": cells}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render(data: dict[str, Any]) -> str:
    cells = data["cells"]
    rows = []
    for K in STAGES:
        for M in MICRO_BATCHES:
            here = [c for c in cells if c["stages"] == K and c["micro_batches"] == M]
            if not here:
                continue
            bubble = statistics.median(c["1f1b"]["bubble_fraction"] for c in here)
            row = [K, M, len(here), f"{bubble:.1%}"]
            for s in SCHEDULES[1:]:
                speed = [c["1f1b"]["step_s"] / c[s]["step_s"] for c in here]
                fill = [c[s]["fill_drain_s"] / c[s]["step_s"] for c in here]
                memory = [max(c[s]["stage_memory_bytes"]) / max(c["1f1b"]["stage_memory_bytes"]) for c in here]
                row += [f"{statistics.median(speed):.2f}x ({min(speed):.2f}-{max(speed):.2f})",
                        f"{statistics.median(fill):.2f}", f"{statistics.median(memory):.2f}x ({max(memory):.2f})"]
            rows.append(row)
    unproven = sum(1 for c in cells for s in SCHEDULES if not c[s]["proven"])
    text = ("Predicted with the planner alone (no run): each schedule's best cut at fixed K and M. Per K and M, "
            "the median over the profiles of: 1F1B's bubble share; for each asynchronous schedule its step's "
            "speed-up over 1F1B's (range), its one-time fill and drain in steps (`fill_drain_s / step_s`, paid "
            "once per run and per checkpoint), and the largest stage's memory over 1F1B's (worst).\n\n"
            + table(["K", "M", "profiles", "1F1B bubble", "pipedream speed-up", "fill+drain (steps)",
                     "peak memory vs 1F1B", "2bw speed-up", "fill+drain (steps)", "peak memory vs 1F1B"], rows)
            + f"\n\nSettings not proven optimal: {unproven} of {len(cells) * len(SCHEDULES)}. The profiles time no "
              "optimizer step, so pipedream's update after every micro-batch costs nothing here and its step is "
              "2bw's; what tells them apart is the memory of the weight copies (weight_versions.weight_copies: "
              "the live weights and one per version in flight, pipedream K - k + 1 on stage k, 2bw 3, one fewer on "
              "the last stage). Each schedule's memory is that of its own fastest cut, which is not the cut of least memory "
              "(below 1.00x: the asynchronous cut happens to load the heaviest stage less).\n")
    example = [c for c in cells if (c["profile"], c["stages"], c["micro_batches"]) == EXAMPLE]
    if example:
        c = example[0]
        K = c["stages"]
        mem_rows = []
        for k in range(K):
            mem_rows.append([k] + [f"{gib(c[s]['stage_memory_bytes'][k])} ({gib(c[s]['stage_params_bytes'][k])} "
                                   f"+ {gib(c[s]['stage_activations_bytes'][k])})" for s in SCHEDULES])
        text += (f"\nPeak memory per stage, GiB, {EXAMPLE[0]} at K = {K}, M = {c['micro_batches']} (in brackets: "
                 "the weight copies, and the activations in flight; gradients and Adam's state, 3x the "
                 "parameters, are the rest). Each at its own best cut: "
                 + ", ".join(f"{s} {c[s]['balance']}" for s in SCHEDULES) + ".\n\n"
                 + table(["stage", *SCHEDULES], mem_rows) + "\n")
    return text


def main(argv=None) -> str | None:
    parser = argparse.ArgumentParser(prog="python -m bench async-plans", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--render", action="store_true", help="rewrite the section from the saved figures")
    parser.add_argument("--time-budget", type=float, default=10.0, help="each search's budget (1f1b's)")
    args = parser.parse_args(argv)
    DATA.mkdir(parents=True, exist_ok=True)
    raw = DATA / "async-plans.json"
    if args.render:
        data = json.loads(raw.read_text())
    else:
        started = time.perf_counter()
        data = {**measure(args.time_budget), "revision": git_revision(), "machine": machine(),
                "seconds": round(time.perf_counter() - started, 1)}
        raw.write_text(json.dumps(data, indent=1) + "\n")
    text = ("## Asynchronous plans (pipedream, pipedream-2bw) against 1F1B\n\n"
            f"Revision {data['revision']}; machine: {data['machine']} (timing plays no part: the figures are "
            f"predictions of exact searches); the part took {data['seconds']} s there.\n\n" + render(data))
    print(f"wrote {write_section('async-plans', text)}")
    return "render" if args.render else None


if __name__ == "__main__":
    main()
