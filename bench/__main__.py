"""python -m bench PART [options]; PART is one of the parts below, or 'all'."""

from __future__ import annotations

import sys

PARTS = {
    "quality": ("bench.planner_quality", "plan quality on the 14 PipeDream profiles vs the usual heuristics"),
    "solver": ("bench.planner_speed", "solver speed: 2,000 layers x 64 stages, full search on 500 layers"),
    "runtime": ("bench.runtime_speedup", "2 stages vs 1 on this CPU: samples/s, per-micro-batch overhead"),
    "scaling": ("bench.solver_scaling", "solver time vs layers (100-5,000) and stages (2-128), DP and ILP"),
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        for name, (_, what) in PARTS.items():
            print(f"  {name:10s} {what}")
        return
    part = sys.argv[1]
    names = list(PARTS) if part == "all" else [part]
    for name in names:
        if name not in PARTS:
            sys.exit(f"unknown part {name!r}; choose from {', '.join(PARTS)} or all")
        module = __import__(PARTS[name][0], fromlist=["main"])
        module.main(sys.argv[2:] if part != "all" else [])


main()
