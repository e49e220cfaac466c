"""The asynchronous schedules run for real on this CPU: measured against predicted, and against 1F1B.

    python -m bench async-run                     # gpt, K = 2, M = 4, 3 rounds of 30 steps
    python -m bench async-run --rounds 2 --steps 12
    python -m bench async-run --from-json docs/benchmarks/data/async-run.json     # re-render

One profile of the built-in ``gpt`` (global batch 16, micro-batch sizes 2 and 4), then one plan per
schedule at K = 2 and M = 4 (``solve --schedule S``: its own exact cut): 1f1b, the zero-bubble
zb-v, and the asynchronous pipedream and pipedream-2bw. Each plan runs ``--steps`` steps
(``gpipe-plan run``, the median step after the first), all plans once per round, the order
reversed every other round, so that the host's drift lands on all alike. The question: does
the bubble the asynchronous schedules remove on paper come off the measured step?
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .common import Ledger, cli, measured_or_saved, publish, read_json, run_plan, table

SCHEDULES = ("1f1b", "zb-v", "pipedream", "pipedream-2bw")


def measure(args: argparse.Namespace, ledger: Ledger) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="async-run-"))
    profile = work / "gpt.json"
    cli("profile", "gpt", "--micro-batch-sizes", "2,4", "--global-batch-size", "16", "--out", profile, "--quiet")
    plans = {}
    for schedule in SCHEDULES:
        plans[schedule] = work / f"{schedule}.json"
        cli("solve", profile, "--stages", args.stages, "--micro-batches", args.micro_batches,
            "--global-batch-size", "16", "--schedule", schedule, "--out", plans[schedule], "--quiet")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEDULES}
    for r in range(args.rounds):
        for schedule in (SCHEDULES if r % 2 == 0 else tuple(reversed(SCHEDULES))):
            report = run_plan(plans[schedule], args.steps, "--lr", "1e-3", ledger=ledger,
                              report=work / f"{schedule}-{r}.report.json")
            runs[schedule].append({"measured_step_s": report["measured_step_s"],
                                   "loss_last": report["loss"]["last"], "others_cores": report["_others_cores"]})
    rows = []
    for schedule in SCHEDULES:
        plan = read_json(plans[schedule])
        rows.append({"schedule": schedule, "balance": plan["balance"], "predicted_step_s": plan["predicted"]["step_s"],
                     "bubble_fraction": plan["predicted"].get("bubble_fraction"),
                     "fill_drain_s": plan["predicted"].get("fill_drain_s"), "runs": runs[schedule]})
    return {"rows": rows}


def render(data: dict[str, Any]) -> str:
    rows = data["rows"]
    base = statistics.median(r["measured_step_s"] for r in rows[0]["runs"])
    body = []
    for row in rows:
        measured = [r["measured_step_s"] for r in row["runs"]]
        median = statistics.median(measured)
        body.append([row["schedule"], row["balance"], f"{row['predicted_step_s'] * 1e3:.1f}",
                     " / ".join(f"{m * 1e3:.1f}" for m in measured), f"{median / row['predicted_step_s']:.2f}",
                     f"{base / median:.2f}x", f"{row['runs'][0]['loss_last']:.4f}"])
    args = data["args"]
    return "\n".join([
        "## The asynchronous schedules run on this CPU (gpt, K = 2)",
        "",
        f"Revision {data['revision']}; machine: {data['machine']}. {data['ledger']}",
        "",
        f"The built-in gpt profiled once, then each schedule's own exact plan at K = {args['stages']}, "
        f"M = {args['micro_batches']} (global batch 16), run {args['steps']} steps per round, {args['rounds']} "
        "rounds interleaved (the order reversed every other round). Measured: each run's median step after "
        "the first, in ms; the speed-up against 1F1B's median; the last step's loss of the first round "
        "(SGD at lr 1e-3 from the same seed: the asynchronous schedules compute another, stale, training).",
        "",
        table(["schedule", "cut", "predicted ms", "measured ms per round", "measured / predicted",
               "vs 1f1b (measured)", "last loss"], body),
        "",
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench async-run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--from-json", type=Path, default=None, help="re-render saved figures")
    args = parser.parse_args(argv)
    data = measured_or_saved("async-run", args, lambda ledger: measure(args, ledger))
    publish("async-run", render(data))


if __name__ == "__main__":
    main()
