"""Planning against hand-tuning, measured: our plan vs a grid of uniform splits x M on this CPU.

    python -m bench handtuning                          # 2 models x 20 runs x 2 rounds
    python -m bench handtuning --rounds 1 --models resnet --shifts 0

For each model (``resnet`` at default sizes, and ``gpt --vocab-size 8192 --layers 6``, whose
head costs about as much as all six blocks together), global batch 32, K = 2, one thread per
rank:

- ours: ``gpipe-plan profile``, ``gpipe-plan solve -k 2 -b 32`` (M, schedule and
  recomputation all left to the planner), ``gpipe-plan run``;
- ours after one calibration round: ``gpipe-plan calibrate`` with that run's report, the same
  ``solve`` on the calibrated profile, ``run``;
- the hand-tuned grid: equal layer counts (and, with ``--shifts 1``, the splits one layer either
  side), GPipe, every M dividing the batch (the M the planner also considers), written with
  ``hand_plan`` (tests/helpers/handplan.py) and run by ``gpipe-plan run``.

Each round re-profiles and runs every configuration once (the grid in a rotated order); the
figures are medians over rounds. "Best grid point" is the grid point with the highest median
samples/s over rounds (picking the best per round would favour whichever point had a lucky
spell), and our plan is compared with it within each round.
"""

from __future__ import annotations

import argparse
import math
import json
import tempfile
from pathlib import Path
from typing import Any

from gpipe_plan.artifacts import write_json_atomic
from gpipe_plan.planner.costmodel import CostModel
from gpipe_plan.planner.settings import cost_setting
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.profile import Profile
from tests.helpers.handplan import hand_plan  # the hand-written plans are the tests' helper

from .common import (COLOURS, RESULTS, Ledger, bars_svg, cli, divisors, git_revision, machine, measured_or_saved,
                     med, publish, read_json, rng, run_plan, table, write_svg)

MODELS = {
    "resnet": ("resnet", []),
    "gpt-8k": ("gpt", ["--vocab-size", "8192", "--layers", "6"]),
}
OURS, OURS_CAL = "ours", "ours, calibrated"


def grid_balances(L: int, shifts: int) -> list[list[int]]:
    half = L // 2
    out = []
    for d in range(-shifts, shifts + 1):
        a = half + d
        if 1 <= a < L:
            out.append([a, L - a])
    return sorted(out, key=lambda b: abs(b[0] - half))


def describe(plan: dict[str, Any]) -> dict[str, Any]:
    return {"balance": plan["balance"], "M": plan["micro_batches"], "schedule": plan["schedule"],
            "recompute": [bool(s["recompute"]) for s in plan["stages"]],
            "predicted_step_s": (plan.get("predicted") or {}).get("step_s")}


def predict(profile_doc: dict[str, Any], balance: list[int], M: int, B: int, schedule: str = "gpipe") -> float:
    """The planner's prediction for a hand-made plan, with what `solve` charges too (neighbours)."""
    profile = Profile(profile_doc)
    K = len(balance)
    setting = cost_setting(profile, stages=K, micro_batches=M, schedule=schedule, virtual_stages=1, recompute="never",
                           memory_limit_bytes=None, link_bandwidth_bytes_per_s=math.inf, link_latency_s=0.0,
                           optimizer="adam", micro_batch_size=B / M)
    cm = CostModel(profile.at(B / M), setting)
    bounds = [0]
    for n in balance:
        bounds.append(bounds[-1] + n)
    return evaluate(cm, bounds).step_s


def measure(args: argparse.Namespace, ledger: Ledger) -> dict[str, Any]:
    B, steps = args.batch, args.steps
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        for r in range(args.rounds):
            for model in args.models.split(","):
                name, flags = MODELS[model]
                folder = root / f"round{r}" / model
                folder.mkdir(parents=True, exist_ok=True)
                entry = out.setdefault(model, {"runs": {}, "plans": [], "predicted": {}})
                profile = folder / "profile.json"
                cli("profile", name, *flags, "--batch-size", B, "--out", profile, "-q")
                prof = read_json(profile)
                L = len(prof["layers"])
                grid = {}
                for balance in grid_balances(L, args.shifts):
                    for M in divisors(B):
                        label = f"{'+'.join(map(str, balance))}, M = {M}"
                        path = folder / f"grid-{balance[0]}-{M}.json"
                        write_json_atomic(path, hand_plan(prof["model"], balance, M, B // M, "gpipe"))
                        grid[label] = path
                        entry["predicted"].setdefault(label, []).append(predict(prof, balance, M, B))
                # Ours first (its report calibrates), then the calibrated plan and the grid, rotated.
                plan = folder / "ours.json"
                cli("solve", profile, "-k", 2, "-b", B, "--out", plan, "-q")
                report = folder / "ours.report.json"
                rep = run_plan(plan, steps, report=report, ledger=ledger)
                entry["runs"].setdefault(OURS, []).append(_row(rep))
                plan_doc = read_json(plan)
                calibrated = folder / "profile.calibrated.json"
                # --force: a run from a busy host is folded in all the same (the ledger says how busy)
                cli("calibrate", report, "--profile", profile, "--out", calibrated, "--force")
                plan_cal = folder / "ours-calibrated.json"
                cli("solve", calibrated, "-k", 2, "-b", B, "--out", plan_cal, "-q")
                entry["plans"].append({"round": r, OURS: describe(plan_doc), OURS_CAL: describe(read_json(plan_cal)),
                                       "speed_probe_s": prof["device"].get("speed_probe_s")})
                order = [OURS_CAL, *grid]
                shift = (r * len(order)) // args.rounds
                for label in order[shift:] + order[:shift]:
                    path = plan_cal if label == OURS_CAL else grid[label]
                    rep = run_plan(path, steps, ledger=ledger)
                    entry["runs"].setdefault(label, []).append(_row(rep))
                print(f"round {r + 1} {model}: ours {entry['runs'][OURS][-1]['samples_per_s']:.1f} samples/s, "
                      f"best of this round's grid {max(entry['runs'][g][-1]['samples_per_s'] for g in grid):.1f}",
                      flush=True)
    return out


def best_grid_point(entry: dict[str, Any]) -> str:
    runs = entry["runs"]
    grid = [k for k in runs if k not in (OURS, OURS_CAL)]
    return max(grid, key=lambda k: med(x["samples_per_s"] for x in runs[k]))


def confirm(data: dict[str, Any], pairs: int, ledger: Ledger) -> dict[str, Any]:
    """Our plan against the best grid point of the saved rounds, in fresh paired runs.

    The best of ~20 grid points by median is partly the luckiest (the winner's curse): its
    median over the rounds that chose it is biased up. Runs made after the choice are not.
    Each model is profiled and planned afresh, then ours and that grid point alternate.
    """
    args = argparse.Namespace(**data["args"])
    B = args.batch
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model, entry in data["results"].items():
            best = best_grid_point(entry)
            name, flags = MODELS[model]
            folder = Path(tmp) / model
            folder.mkdir(parents=True)
            profile = folder / "profile.json"
            cli("profile", name, *flags, "--batch-size", B, "--out", profile, "-q")
            plan = folder / "ours.json"
            cli("solve", profile, "-k", 2, "-b", B, "--out", plan, "-q")
            split, M = best.split(", M = ")
            balance = [int(n) for n in split.split("+")]
            hand = folder / "best.json"
            write_json_atomic(hand, hand_plan(read_json(profile)["model"], balance, int(M), B // int(M), "gpipe"))
            ratios = []
            for i in range(pairs):
                order = [(OURS, plan), (best, hand)]
                measured = {label: run_plan(path, args.steps, ledger=ledger)["samples_per_s"]
                            for label, path in (order if i % 2 == 0 else order[::-1])}
                ratios.append(measured[OURS] / measured[best])
                print(f"confirm {model} pair {i + 1}: ours / {best} = {ratios[-1]:.3f}", flush=True)
            out[model] = {"best": best, "ours": describe(read_json(plan)), "ratios": ratios}
    return out


def _row(rep: dict[str, Any]) -> dict[str, Any]:
    return {"samples_per_s": rep["samples_per_s"], "measured_step_s": rep["measured_step_s"],
            "predicted_step_s": rep.get("predicted_step_s"), "run_probe_s": (rep.get("speed") or {}).get("run_probe_s"),
            "others": rep["_others_cores"]}


def render(data: dict[str, Any]) -> str:
    args = argparse.Namespace(**data["args"])
    intro = [
        "## Planning against hand-tuning, measured on this CPU",
        "",
        f"Machine: {data['machine']}; revision {data['revision']}. {data['ledger']}",
        "",
        f"Global batch {args.batch}, K = 2, one thread per rank, {args.steps} steps per run (median of the "
        f"steps after the first), {args.rounds} round(s); each round re-profiles the model, plans, runs our plan, "
        f"calibrates once from that run and re-plans, then runs the calibrated plan and every grid point in a "
        f"rotated order. Grid: equal layer counts"
        f"{' and the splits one layer either side' if args.shifts else ''}, GPipe, every M dividing {args.batch}. "
        "Samples/s are medians over rounds [min..max]; 'vs ours' is the median over rounds of the grid point's "
        "samples/s / our plan's in the same round. The best grid point is the one with the highest median.",
        "",
    ]
    text: list[str] = []
    headline = []
    for model, entry in data["results"].items():
        runs = entry["runs"]
        grid = [k for k in runs if k not in (OURS, OURS_CAL)]
        best = best_grid_point(entry)
        ours = runs[OURS]

        def paired(label: str) -> list[float]:
            return [x["samples_per_s"] / o["samples_per_s"] for x, o in zip(runs[label], ours)]

        best_round = [max(runs[g][i]["samples_per_s"] for g in grid) / ours[i]["samples_per_s"]
                      for i in range(len(ours))]
        cal_vs_best = [c["samples_per_s"] / b["samples_per_s"] for c, b in zip(runs[OURS_CAL], runs[best])]
        plans = entry["plans"]
        p0 = plans[0][OURS]
        headline.append([model, _plan_text(plans, OURS), f"{med(x['samples_per_s'] for x in ours):.1f}",
                         best, f"{med(x['samples_per_s'] for x in runs[best]):.1f}",
                         f"{med(1 / v for v in paired(best)):.3f} [{rng([1 / v for v in paired(best)], '{:.3f}')}]",
                         f"{med(1 / v for v in best_round):.3f}",
                         f"{med(cal_vs_best):.3f} [{rng(cal_vs_best, '{:.3f}')}]"])
        rows, bars = [], []
        ordered = sorted(runs, key=lambda k: -med(x["samples_per_s"] for x in runs[k]))
        for label in ordered:
            sps = [x["samples_per_s"] for x in runs[label]]
            if label in (OURS, OURS_CAL):
                pred = med(args.batch / p[label]["predicted_step_s"] for p in plans if p[label]["predicted_step_s"])
                what = _plan_text(plans, label)
            else:
                pred = med(args.batch / s for s in entry["predicted"][label])
                what = label.replace("+", " + ")
            vs = paired(label)
            rows.append([label, what, f"{pred:.1f}", f"{med(sps):.1f} [{rng(sps, '{:.1f}')}]",
                         f"{med(vs):.3f}" if label != OURS else "1"])
            colour = COLOURS[0] if label == OURS else COLOURS[2] if label == OURS_CAL else \
                COLOURS[3] if label == best else "#bbbbbb"
            bars.append((f"{label}" if label in (OURS, OURS_CAL) else label, med(sps), min(sps), max(sps), colour))
        svg = f"handtuning-{model}.svg"
        write_svg(svg, bars_svg(f"{model}, K = 2, batch {args.batch}: measured samples/s (median, min-max over rounds)",
                                bars, "samples/s", reference=med(x["samples_per_s"] for x in ours),
                                reference_label="ours"))
        text += [f"### {model}", "",
                 f"Profile flags: `{' '.join(MODELS[model][1]) or '(defaults)'}`; our plan in round 1: balance "
                 f"{p0['balance']}, M = {p0['M']}, {p0['schedule']}.", "",
                 f"![{model}](benchmarks/{svg})", "",
                 table(["configuration", "plan", "predicted samples/s", "measured samples/s", "vs ours"], rows), ""]
    summary = [
        "### Result",
        "",
        table(["model", "our plan", "ours samples/s", "best grid point", "its samples/s",
               "ours / best grid point (paired by round)", "ours / best of each round's grid",
               "ours calibrated / best grid point"], headline),
        "",
        "'ours / best of each round's grid' compares with the luckiest grid point of each round, a harder "
        "(biased) bar: the maximum of many noisy runs.",
        "",
    ]
    check = data.get("confirm")
    if check:
        rows = [[model, c["best"], _plan_text([{OURS: c["ours"]}], OURS), len(c["ratios"]),
                 f"{med(c['ratios']):.3f} [{rng(c['ratios'], '{:.3f}')}]"] for model, c in check["models"].items()]
        summary += [
            "Out of sample: the best grid point above is partly the luckiest of the grid (chosen by the same runs "
            "that measure it). `python -m bench handtuning --confirm N` then profiles and plans each model afresh "
            "and runs our plan and that grid point alternately, N pairs, after the choice "
            f"(revision {check['revision']}; {check['machine']}; {check['ledger']}):",
            "",
            table(["model", "best grid point (chosen above)", "our plan (fresh profile)", "pairs",
                   "ours / best grid point, median [min..max]"], rows),
            "",
        ]
    return "\n".join(intro + summary + text) + "\n"


def _plan_text(plans: list[dict], key: str) -> str:
    seen = []
    for p in plans:
        d = p[key]
        s = f"{'+'.join(map(str, d['balance']))}, M = {d['M']}, {d['schedule']}" + \
            (", recompute" if any(d["recompute"]) else "")
        if s not in seen:
            seen.append(s)
    return "; ".join(seen)


def main(argv=None) -> str | None:
    parser = argparse.ArgumentParser(prog="python -m bench handtuning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet,gpt-8k", help=f"from {', '.join(MODELS)}")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--shifts", type=int, default=1, help="also the splits this many layers off equal counts")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", default=None, help="keep profiles, plans and reports in this folder")
    parser.add_argument("--from-json", type=Path, default=None)
    parser.add_argument("--confirm", type=int, default=0, metavar="N",
                        help="instead: N fresh paired runs of our plan against the saved best grid point")
    args = parser.parse_args(argv)
    if args.confirm:
        saved = RESULTS / "data" / "handtuning.json"
        data = read_json(args.from_json or saved)
        ledger = Ledger()
        started = machine()
        models = confirm(data, args.confirm, ledger)
        data["confirm"] = {"models": models, "revision": git_revision(), "machine": started, "ledger": ledger.line()}
        saved.write_text(json.dumps(data, indent=1))
    else:
        data = measured_or_saved("handtuning", args, lambda ledger: {"results": measure(args, ledger)})
    publish("handtuning", render(data))
    return "confirm" if args.confirm else None
