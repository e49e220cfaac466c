"""How much do per-layer medians move from one profile run to the next?

A plan is only as good as the profile it comes from. This profiles the same model several
times, in one process, and for every (layer, micro-batch size, forward|backward) figure whose
median is over 1 ms (below that, timer and scheduling noise dominate and the planner's
choices do not hinge on it) reports the spread across runs: (max - min) / median.

    .venv/bin/python bench/profile_spread.py gpt --runs 5
    .venv/bin/python bench/profile_spread.py resnet --runs 5 --repeats 20

The CPU's load average is printed before and after: on a shared machine, spread measures
the neighbours as much as the profiler.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from gpipe_plan.models import model_spec  # noqa: E402
from gpipe_plan.profiles.profiler import ProfileRequest, default_sizes, profile_model  # noqa: E402

THRESHOLD_S = 1e-3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="gpt", help="gpt or resnet (built-in options at defaults)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    request = ProfileRequest(spec=model_spec(args.model), micro_batch_sizes=default_sizes(args.batch_size),
                             device=torch.device("cpu"), threads=args.threads, warmup=args.warmup,
                             repeats=args.repeats)
    print(f"{args.model}: {args.runs} runs, sizes {request.micro_batch_sizes}, median of {args.repeats} "
          f"after {args.warmup} warm-up, {args.threads} thread(s); load before {_load()}")
    docs = []
    for run in range(args.runs):
        start = time.perf_counter()
        docs.append(profile_model(request))
        ratios = ", ".join(f"{r:.3f}" for r in docs[-1]["consistency"]["ratio"])
        print(f"  run {run + 1}: {time.perf_counter() - start:.1f} s, consistency ratio per size [{ratios}]")
    print(f"load after {_load()}")

    rows = []
    sizes = docs[0]["micro_batch_sizes"]
    for index, layer in enumerate(docs[0]["layers"]):
        for s, size in enumerate(sizes):
            for key in ("forward_s", "backward_s"):
                values = [doc["layers"][index][key][s] for doc in docs]
                # The same figure as a share of its own run's whole-model step: a machine-wide
                # slowdown (a busy neighbour for one whole run) cancels out of it.
                shares = [doc["layers"][index][key][s] / doc["consistency"]["model_step_s"][s] for doc in docs]
                middle = statistics.median(values)
                if middle > THRESHOLD_S:
                    rows.append((_spread(values), _spread(shares), layer["name"], size, key, middle))
    if not rows:
        print("no figure over 1 ms")
        return
    rows.sort(reverse=True)
    print(f"\n{len(rows)} figures over 1 ms; spread = (max - min) / median across runs")
    for label, column in (("seconds", 0), ("share of the run's whole-model step", 1)):
        spreads = [r[column] for r in rows]
        print(f"  {label}: median {statistics.median(spreads):.1%}, max {max(spreads):.1%}")
    print("widest (seconds):")
    for spread, share, name, size, key, middle in rows[:5]:
        print(f"  {name:16s} b={size:<3d} {key:10s} median {middle * 1e3:7.2f} ms  spread {spread:.1%}"
              f"  (share {share:.1%})")


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
