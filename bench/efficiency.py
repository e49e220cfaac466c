"""Runtime efficiency: the measured step against the ideal, GPipe's bubble bound and torch by hand.

    python -m bench efficiency                       # gpt, batch 32, M = 4 and 8, 3 rounds
    python -m bench efficiency --rounds 1 --micro-batches 8

For the built-in ``gpt`` (default sizes) with a global batch of 32 on K = 2 stages (one thread
per rank, both cores), per M:

- ``compute``: one stage doing all the work with the same M micro-batches (``gpipe-plan run``
  of a 1-stage plan): the total compute the pipeline splits, measured;
- ideal = compute / K; GPipe's bubble bound = (M + K - 1) / M x compute / K (balanced stages);
- ours: ``gpipe-plan solve -k 2 -m M --schedule gpipe --recompute never`` run by
  ``gpipe-plan run`` (native executor), and the same plan with ``--executor torch``;
- by hand: bench/torch_by_hand.py, ``torch.distributed.pipelining`` written directly
  (``PipelineStage`` with static shapes, ``ScheduleGPipe``, gloo, a uniform split), no gpipe-plan
  runtime;
- and the single stage with the whole batch (M = 1), what one core does without pipelining.

Every configuration runs once per round, rounds interleaved; medians over rounds, [min..max].
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpipe_plan.schema import report_chunks

from .common import (BENCH_ENV, COLOURS, ROOT, Ledger, Others, bars_svg, cli, measured_or_saved, med, publish,
                     read_json, rng, run_plan, table, write_svg)


def by_hand(model: str, options: str, M: int, B: int, steps: int, ledger: Ledger, balance: str = "") -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "torch_by_hand.py"), "--model", model, "--micro-batches", str(M),
           "--batch", str(B), "--steps", str(steps)]
    if options:
        cmd += ["--options", options]
    if balance:
        cmd += ["--balance", balance]
    with Others() as others:
        done = subprocess.run(cmd, cwd=ROOT, env=BENCH_ENV, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    ledger.add(others.cores)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, ledger: Ledger) -> dict[str, Any]:
    mbs = [int(x) for x in args.micro_batches.split(",")]
    B, steps = args.batch, args.steps
    runs: dict[str, list[dict]] = {}
    meta: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for r in range(args.rounds):
            profile = folder / f"profile{r}.json"
            cli("profile", args.model, *args.profile_options.split(), "--batch-size", B, "--out", profile, "-q")
            plans = {}
            one = folder / f"k1-m1-{r}.json"
            cli("solve", profile, "-k", 1, "-m", 1, "-b", B, "--schedule", "gpipe", "--recompute", "never",
                "--out", one, "-q")
            plans["1 stage, M = 1 (whole batch)"] = (one, [])
            for M in mbs:
                k1 = folder / f"k1-m{M}-{r}.json"
                k2 = folder / f"k2-m{M}-{r}.json"
                cli("solve", profile, "-k", 1, "-m", M, "-b", B, "--schedule", "gpipe", "--recompute", "never",
                    "--out", k1, "-q")
                cli("solve", profile, "-k", 2, "-m", M, "-b", B, "--schedule", "gpipe", "--recompute", "never",
                    "--out", k2, "-q")
                meta[f"balance M={M}"] = read_json(k2)["balance"]
                plans[f"compute: 1 stage, M = {M}"] = (k1, [])
                plans[f"ours, native, M = {M}"] = (k2, [])
                plans[f"ours, --executor torch, M = {M}"] = (k2, ["--executor", "torch"])
                plans[f"torch by hand, uniform, M = {M}"] = (None, [M])
            names = list(plans)
            shift = (r * len(names)) // args.rounds
            for name in names[shift:] + names[:shift]:
                plan, extra = plans[name]
                if plan is None:
                    got = by_hand(args.model, args.hand_options, extra[0], B, steps, ledger)
                    row = {"measured_step_s": got["measured_step_s"], "samples_per_s": got["samples_per_s"],
                           "balance": got["balance"], "others": None}
                else:
                    rep = run_plan(plan, steps, *extra, report=plan.with_suffix(f".{len(extra)}.report.json"),
                                   ledger=ledger)
                    row = {"measured_step_s": rep["measured_step_s"], "samples_per_s": rep["samples_per_s"],
                           "predicted_step_s": rep["predicted_step_s"], "balance": read_json(plan)["balance"],
                           "run_probe_s": (rep.get("speed") or {}).get("run_probe_s"),
                           "bubble": rep.get("measured_bubble_fraction"), "others": rep["_others_cores"],
                           "ops": [(ch["measured_forward_s"], ch["measured_backward_s"], st["measured_optimizer_s"])
                                   for st, ch in zip(rep["stages"], report_chunks(rep))]}
                runs.setdefault(name, []).append(row)
                print(f"round {r + 1} {name:40s} {row['measured_step_s'] * 1e3:8.1f} ms", flush=True)
    return {"runs": runs, "meta": meta}


def render(data: dict[str, Any]) -> str:
    args = argparse.Namespace(**data["args"])
    runs = data["runs"]
    K = 2
    mbs = [int(x) for x in args.micro_batches.split(",")]
    rounds = len(next(iter(runs.values())))
    base = "1 stage, M = 1 (whole batch)"
    rows, bars = [], []
    for M in mbs:
        comp = f"compute: 1 stage, M = {M}"
        for name in (f"ours, native, M = {M}", f"ours, --executor torch, M = {M}", f"torch by hand, uniform, M = {M}"):
            if name not in runs:
                continue
            steps = [x["measured_step_s"] for x in runs[name]]
            # Within each round: against that round's compute and single-stage figures.
            ideal = [x["measured_step_s"] / (c["measured_step_s"] / K) for x, c in zip(runs[name], runs[comp])]
            bound = [x["measured_step_s"] / ((M + K - 1) / M * c["measured_step_s"] / K)
                     for x, c in zip(runs[name], runs[comp])]
            speedup = [b0["measured_step_s"] / x["measured_step_s"] for x, b0 in zip(runs[name], runs[base])]
            # Where the time goes (our runtime's reports only): the stages' summed per-micro-batch
            # work against the single stage's (two ranks slowing each other), and the measured step
            # against GPipe's makespan for the stages' own measured times (schedule and executor).
            inflation, sched = [], []
            for x, c in zip(runs[name], runs[comp]):
                if x.get("ops") and c.get("ops"):
                    inflation.append(sum(f + g for f, g, _ in x["ops"]) / sum(f + g for f, g, _ in c["ops"]))
                    fs, gs = [f for f, _, _ in x["ops"]], [g for _, g, _ in x["ops"]]
                    span = sum(fs) + sum(gs) + (M - 1) * (max(fs) + max(gs)) + (x["ops"][0][2] or 0.0)
                    sched.append(x["measured_step_s"] / span)
            rows.append([name, " ".join(map(str, runs[name][0]["balance"])), f"{med(steps) * 1e3:.1f}",
                         f"{args.batch / med(steps):.1f}",
                         f"{med(ideal):.2f} [{rng(ideal)}]", f"{med(bound):.2f} [{rng(bound)}]",
                         f"{med(speedup):.2f} [{rng(speedup)}]",
                         f"{med(inflation):.2f}" if inflation else "-", f"{med(sched):.2f}" if sched else "-"])
            colour = COLOURS[0] if "native" in name else COLOURS[1] if "executor" in name else COLOURS[3]
            bars.append((name, med(speedup), min(speedup), max(speedup), colour))
        cs = [x["measured_step_s"] for x in runs[comp]]
        ref = [b0["measured_step_s"] / x["measured_step_s"] for x, b0 in zip(runs[comp], runs[base])]
        rows.append([comp, " ".join(map(str, runs[comp][0]["balance"])), f"{med(cs) * 1e3:.1f}",
                     f"{args.batch / med(cs):.1f}", "-", "-", f"{med(ref):.2f} [{rng(ref)}]", "-", "-"])
        bars.append((f"GPipe bound, M = {M} (x compute)", med(ref) * 2 * M / (M + K - 1), 0, 0, "#cccccc"))
    bs = [x["measured_step_s"] for x in runs[base]]
    rows.append([base, " ".join(map(str, runs[base][0]["balance"])), f"{med(bs) * 1e3:.1f}", f"{args.batch / med(bs):.1f}", "-", "-", "1.00", "-", "-"])
    write_svg("efficiency.svg", bars_svg(
        f"{args.model}, batch {args.batch}, K = 2: speed-up over one stage with the whole batch (median, min-max)",
        bars, "samples/s relative to 1 stage, M = 1 (1 thread)", reference=1.0, reference_label="1 stage"))
    return "\n".join([
        "## Runtime efficiency: against the ideal, the bubble bound and torch.distributed.pipelining by hand",
        "",
        f"Machine: {data['machine']}; revision {data['revision']}. {data['ledger']}",
        "",
        f"`{args.model}` ({args.profile_options or 'default sizes'}), global batch {args.batch}, K = 2 stages, "
        f"1 thread per rank (2 cores), GPipe, {args.steps} steps per run (median of the steps after the first), "
        f"{rounds} interleaved round(s), each re-profiling first; medians over rounds, [min..max]. "
        "`compute` is one stage running all the work with the same micro-batches (measured); ideal = "
        "compute / K; bubble bound = (M + K - 1) / M x compute / K. 'Torch by hand' is bench/torch_by_hand.py: "
        "`PipelineStage` with static shapes + `ScheduleGPipe` on gloo, uniform split, no gpipe-plan runtime. "
        "Ratios are taken within each round.",
        "",
        "![efficiency](benchmarks/efficiency.svg)",
        "",
        table(["configuration", "balance", "ms/step", "samples/s", "step / ideal", "step / bubble bound",
               "speed-up vs 1 stage, M = 1", "stage work / 1-stage work", "step / GPipe of own op times"], rows),
        "",
        "The last two columns split our runs' loss against the bound (from their reports' per-stage medians): "
        "`stage work / 1-stage work` is the stages' summed forward+backward per micro-batch against the single "
        "stage's at the same micro-batch size (above 1: two ranks computing at once each run slower than one "
        "alone, and the executor's per-micro-batch work); `step / GPipe of own op times` is the measured step "
        "against GPipe's makespan (plus stage 0's optimizer step) for the stages' own measured times (above 1: "
        "waits and messages the schedule does not hide).",
        "",
        "Our plans' balance per M: " + ", ".join(f"{k.split()[1]}: {v}" for k, v in data["meta"].items()) + ".",
    ]) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench efficiency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--profile-options", default="", help="model flags for `gpipe-plan profile`")
    parser.add_argument("--hand-options", default="", help="the same model's options as JSON for torch_by_hand.py")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", default="4,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", default=None)
    parser.add_argument("--from-json", type=Path, default=None)
    args = parser.parse_args(argv)
    data = measured_or_saved("efficiency", args, lambda ledger: measure(args, ledger))
    publish("efficiency", render(data))
