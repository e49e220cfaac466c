"""The profiler: how long `gpipe-plan profile` takes, how consistent and repeatable its figures are.

    python -m bench profiler                 # gpt and resnet, 5 profiles each
    python -m bench profiler --runs 3 --models gpt

For each built-in (default sizes, the default doubling sweep up to batch 8, one thread):

- the wall time of the whole command a user types, ``gpipe-plan profile MODEL --device cpu``
  (Python start, torch import, measuring, writing the file);
- consistency: the sum of the per-layer forward + backward medians against the whole model's
  measured step, per micro-batch size (the profile's ``consistency.ratio``);
- run-to-run spread: every (layer, size, forward|backward) median over 1 ms (below that timer
  and scheduling noise dominate and the planner's choices do not hinge on it), across runs:
  (max - min) / median. Also as a share of its own run's whole-model step, which cancels a
  machine-wide slowdown that lasted a whole run: the planner's choices depend on the layers'
  *relative* times.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from .common import Ledger, Others, cli, git_revision, machine, read_json, table, write_section

THRESHOLD_S = 1e-3


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def measure(model: str, runs: int, ledger: Ledger, folder: Path) -> dict:
    docs, walls = [], []
    for run in range(runs):
        out = folder / f"{model}.{run}.json"
        with Others() as others:
            started = time.perf_counter()
            cli("profile", model, "--device", "cpu", "--out", out, "-q")
            walls.append(time.perf_counter() - started)
        ledger.add(others.cores)
        docs.append(read_json(out))
        print(f"{model} run {run + 1}: {walls[-1]:.1f} s, consistency "
              f"{', '.join(f'{r:.3f}' for r in docs[-1]['consistency']['ratio'])}", flush=True)
    rows = []
    for index, layer in enumerate(docs[0]["layers"]):
        for s, size in enumerate(docs[0]["micro_batch_sizes"]):
            for key in ("forward_s", "backward_s"):
                values = [doc["layers"][index][key][s] for doc in docs]
                shares = [doc["layers"][index][key][s] / doc["consistency"]["model_step_s"][s] for doc in docs]
                if statistics.median(values) > THRESHOLD_S:
                    rows.append((_spread(values), _spread(shares), layer["name"], size, key,
                                 statistics.median(values)))
    ratios = [r for doc in docs for r in doc["consistency"]["ratio"] if r]
    contention = [doc["contention"]["slowdown"] for doc in docs if doc.get("contention")]
    return {"walls": walls, "ratios": ratios, "rows": sorted(rows, reverse=True), "contention": contention,
            "sizes": docs[0]["micro_batch_sizes"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench profiler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,resnet")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    ledger = Ledger()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            results[model] = measure(model, args.runs, ledger, Path(tmp))
    summary, widest = [], []
    for model, r in results.items():
        spreads = [row[0] for row in r["rows"]]
        shares = [row[1] for row in r["rows"]]
        summary.append([f"`{model}`", f"{statistics.median(r['walls']):.1f} s [{min(r['walls']):.1f}..{max(r['walls']):.1f}]",
                        f"{min(r['ratios']):.3f}..{max(r['ratios']):.3f}", len(spreads),
                        f"{statistics.median(spreads):.1%} / {max(spreads):.1%}" if spreads else "-",
                        f"{statistics.median(shares):.1%} / {max(shares):.1%}" if shares else "-",
                        " ".join(f"{c:.2f}" for c in r["contention"]) or "-"])
        for spread, share, name, size, key, middle in r["rows"][:3]:
            widest.append([f"`{model}`", name, size, key.replace("_s", ""), f"{middle * 1e3:.2f}", f"{spread:.1%}",
                           f"{share:.1%}"])
    text = "\n".join([
        "## The profiler: time, consistency, repeatability", "",
        f"Machine: {machine()}; revision {git_revision()}. {ledger.line()}", "",
        f"`gpipe-plan profile MODEL --device cpu` at its defaults (micro-batch sizes "
        f"{', '.join(map(str, next(iter(results.values()))['sizes']))}, median of 10 after 3 warm-up, one thread), "
        f"{args.runs} times per model, one after the other. Wall time is the whole command as a user runs it. "
        "Consistency is the sum of per-layer forward + backward over the whole model's step (every size of "
        "every run). Spread is (max - min) / median across the runs of each per-layer median over 1 ms; "
        "'as share' divides each by its own run's whole-model step first. The last column is each profile's "
        "`contention.slowdown` (the slower of two processes training at once against one alone; 1.00: within noise).", "",
        table(["model", "wall time, median [min..max]", "consistency (all sizes, all runs)", "figures over 1 ms",
               "spread median / max", "spread as share median / max", "contention slowdown per run"], summary), "",
        "The widest spreads:", "",
        table(["model", "layer", "micro-batch", "pass", "median ms", "spread", "as share"], widest), "",
    ])
    path = write_section("profiler", text)
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
