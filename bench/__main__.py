"""python -m bench PART [options]; PART is one of the parts below, 'all', or 'assemble'.

Each part writes docs/benchmarks/PART.md (and its pictures, docs/benchmarks/*.svg, and its
raw figures, docs/benchmarks/data/PART.json where it measures runs). 'all' runs every part
with its defaults, in the order below, then 'assemble' joins the sections into
docs/benchmarks.md. On a small CPU machine 'all' takes hours (docs/benchmarks.md lists the
time each part took when last run); every part takes options to be quicker
(python -m bench PART --help). Leave the machine to the benchmark while it runs: the parts
that time runs record the cores other processes used meanwhile.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PARTS = {
    "setup": ("bench.setup", "the README's two set-up commands on a fresh clone: install, demo, tests, timed"),
    "profiler": ("bench.profiler", "gpipe-plan profile: wall time, consistency, run-to-run spread"),
    "drift": ("bench.drift", "this machine's speed over time, one process alone and two at once"),
    "noise": ("bench.noise", "the speed probe's steadiness and the host's load, quiet and beside busy loops"),
    "quality": ("bench.planner_quality", "plan quality on the 14 PipeDream profiles vs the usual heuristics"),
    "solver": ("bench.planner_speed", "solver speed: 2,000 layers x 64 stages, full search on 500 layers"),
    "exactness": ("bench.exactness", "share of plans proven optimal, gaps and solve time on the PipeDream "
                                     "profiles, every schedule, K = 2-8; against an earlier planner's plans"),
    "milp-charge": ("bench.milp_charge", "what the MILP's branch-and-bound nodes cost here, per size, against "
                                         "what the work budget charges them"),
    "scaling": ("bench.solver_scaling", "solver time vs layers (100-5,000) and stages (2-128), DP and ILP"),
    "explore": ("bench.explore_grid", "explore grids on two PipeDream profiles; three gpt cells run for real"),
    "handtuning": ("bench.handtuning", "our plan vs a grid of hand-tuned uniform splits x M, measured on this CPU"),
    "accuracy": ("bench.accuracy", "cost model: measured vs predicted step and memory, before/after calibration"),
    "fidelity": ("bench.fidelity", "does the default plan run fastest? every schedule measured vs predicted, "
                                   "gpt, resnet, llama at K = 2, 4"),
    "tune-rule": ("bench.tune_rule", "how often gpipe-plan tune's rule switches plans, simulated on drifting "
                                     "and steady hosts (no runs)"),
    "runtime": ("bench.runtime_speedup", "2 stages vs 1 on this CPU: samples/s, per-micro-batch overhead"),
    "efficiency": ("bench.efficiency", "measured step vs ideal and bubble bound; vs torch.distributed.pipelining by hand"),
    "demo": ("bench.demo", "gpipe-plan demo's loss on the text it ships; the text recipe on a 12-layer gpt"),
    "schedules": ("bench.schedules", "gpipe, 1f1b, interleaved, zb-h1, zb-v: measured on gpt (CPU) and planned on PipeDream"),
    "meta_memory": ("bench.meta_memory", "a 0.8 B model: profile and 4-stage run memory per process; shared figures"),
    "async-plans": ("bench.async_plans", "pipedream and pipedream-2bw against 1F1B on the PipeDream profiles: "
                                         "predicted step, fill and drain, memory per stage (planner only)"),
    "async-run": ("bench.async_run", "1f1b, zb-v, pipedream, pipedream-2bw run on this CPU: gpt at K = 2, "
                                     "measured against predicted and against 1F1B"),
    "data-parallel": ("bench.data_parallel", "K stages x d replicas: the planner's choice on PipeDream for 8-64 "
                                             "devices; 4x1, 2x2, 1x4 measured on this CPU"),
    "async": ("bench.async_pipelines", "pipedream, pipedream-2bw, 1F1B and LocalSGD: loss per update and per "
                                       "predicted second, quadratic, logistic regression, gpt, S = 2, 4, 8"),
}

# Options 'all' gives a part instead of its defaults.
ALL_OPTIONS: dict[str, list[str]] = {
    "quality": ["--micro-batches", "8,64", "--ilp-seconds", "20", "--ilp-max-layers", "200"],
    "exactness": ["--baseline", "docs/benchmarks/data/exactness-rows-1f052a7.jsonl", "--scale"],
    "scaling": ["--ilp-limit", "20"],
    "runtime": ["--rounds", "2"],
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        for name, (_, what) in PARTS.items():
            print(f"  {name:11s} {what}")
        print(f"  {'assemble':11s} join docs/benchmarks/*.md into docs/benchmarks.md (no measuring)")
        return
    part = sys.argv[1]
    if part == "assemble":
        from .assemble import assemble

        print(f"wrote {assemble()}")
        return
    names = list(PARTS) if part == "all" else [part]
    for name in names:
        if name not in PARTS:
            sys.exit(f"unknown part {name!r}; choose from {', '.join(PARTS)}, all or assemble")
    took = {}
    failed = []
    for name in names:
        started = time.monotonic()
        module = __import__(PARTS[name][0], fromlist=["main"])
        try:
            # A part may name a side job it ran instead (handtuning --confirm): its time is kept
            # apart from the part's own.
            side = module.main(sys.argv[2:] if part != "all" else ALL_OPTIONS.get(name, []))
        except Exception:  # in 'all', one broken part must not lose the others' hours
            if part != "all":
                raise
            import traceback

            traceback.print_exc()
            failed.append(name)
            continue
        finally:
            os.chdir(ROOT)  # a part may change directory (runtime_speedup does)
        took[name] = time.monotonic() - started
        from .assemble import record_time

        record_time(f"{name} {side}" if side else name, took[name],
                    sys.argv[2:] if part != "all" else ALL_OPTIONS.get(name, []))
    if part == "all":
        from .assemble import assemble

        print(f"wrote {assemble()}")
        print("took: " + ", ".join(f"{n} {s / 60:.0f} min" for n, s in took.items()))
        if failed:
            sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
