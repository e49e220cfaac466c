"""Exactness: how often the planner proves its plan optimal, how far it is when it does not, and
how its plans compare with an earlier planner's.

Cases: the 14 PipeDream profiles (imported at their mini-batch, gnmt and gnmt_large at 64), each
of more than 64 layers coarsened to 48 (consecutive runs of equal layer count merged: times,
activations and parameters summed, the run's last output is what crosses a cut after it);
K = 2, 4, 8 stages; M = 8, 16, 32 micro-batches of a global batch of the profile's mini-batch
rounded up to a multiple of 32; each of the five schedules (interleaved with v = 2, 3, 4 open);
recompute auto, no memory limit, free links (the profiles measured none); the default budget
(30 s). Each case is one ``search`` (a solve without its one-device comparison), timed.

``--record FILE`` writes the raw rows (JSON lines; ``--resume`` continues a file) and nothing else: run it with an
older planner on the path (``PYTHONPATH`` naming a checkout as ``gpipe_plan``) to record its
plans; ``--baseline FILE`` then compares with them. Also measured: the gnmt case of issue 27
(K = 8, M = 8, 1f1b) and the solve of gnmt on 512 devices (``--scale``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

from .common import PIPEDREAM, RESULTS, ROOT, git_revision, machine, table, write_section

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
BATCH_SIZES = {"gnmt": 64, "gnmt_large": 64}   # token inputs: the batch cannot be read off the input
COARSE_LAYERS = 48
COARSEN_ABOVE = 64


def coarsened(doc: dict, layers: int) -> dict:
    """The profile with its layers merged into ``layers`` consecutive runs of (nearly) equal
    layer count: per-size times and activations summed, parameters summed, the run's last
    output kept (what crosses a cut after the run)."""
    old = doc["layers"]
    L = len(old)
    merged = []
    for g in range(layers):
        run = old[g * L // layers:(g + 1) * L // layers]
        layer = {"name": f"{run[0]['name']}..{run[-1]['name']}" if len(run) > 1 else run[0]["name"],
                 "param_bytes": sum(x.get("param_bytes", 0) for x in run),
                 "output_bytes": run[-1]["output_bytes"]}
        for key in ("forward_s", "backward_s", "activation_bytes"):
            layer[key] = [sum(x[key][i] for x in run) for i in range(len(run[0][key]))]
        merged.append(layer)
    return {**doc, "layers": merged}


def profiles() -> dict:
    """name -> (Profile, layers as profiled, global batch)."""
    from gpipe_plan.planner.pipedream import import_pipedream
    from gpipe_plan.planner.profile import Profile

    out = {}
    for path in sorted(PIPEDREAM.glob("*.graph.txt")):
        name = path.name.split(".")[0]
        doc = import_pipedream(str(path), batch_size=BATCH_SIZES.get(name))
        layers = len(doc["layers"])
        if layers > COARSEN_ABOVE:
            doc = coarsened(doc, COARSE_LAYERS)
        batch = int(doc["batch_size"])
        out[name] = (Profile(doc, where=name), layers, -(-batch // 32) * 32)
    return out


def solve_case(profile, batch: int, K: int, M: int, schedule: str, budget_s: float) -> dict:
    """One search, timed; the fields both an older and this planner can give."""
    from gpipe_plan.planner.problem import SolveOptions
    from gpipe_plan.planner.search import search

    options = SolveOptions(stages=K, micro_batches=M, schedule=schedule, global_batch_size=batch,
                           time_budget_s=budget_s)
    started, cpu = time.perf_counter(), time.process_time()
    result = search(profile, options)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    best = result.best
    ev = best.solution.evaluation
    return {"step_s": ev.step_s, "lower_bound_s": result.lower_bound_s, "proven": bool(result.proven),
            "seconds": seconds, "cpu_seconds": cpu_seconds, "virtual_stages": best.setting.virtual_stages,
            "balance": ev.balance, "bound_by": getattr(result, "bound_by", None)}


def cases(names, stages, micro_batches, schedules):
    for name in names:
        for K in stages:
            for M in micro_batches:
                for schedule in schedules:
                    yield name, K, M, schedule


def record(path: Path, names, stages, micro_batches, schedules, budget_s: float, resume: bool) -> list[dict]:
    """Solve every case, appending each row to ``path`` as it is done; ``resume``: keep the rows
    already there and solve only the cases they lack."""
    if not resume and path.exists():
        path.unlink()
    rows = read_rows(path)
    done = {(r["model"], r["stages"], r["micro_batches"], r["schedule"]) for r in rows}
    loaded = profiles()
    with path.open("a") as out:
        for name, K, M, schedule in cases(names, stages, micro_batches, schedules):
            if (name, K, M, schedule) in done:
                continue
            profile, layers, batch = loaded[name]
            row = {"model": name, "layers": layers, "planned_layers": profile.num_layers, "stages": K,
                   "micro_batches": M, "schedule": schedule, "global_batch_size": batch,
                   "load": os.getloadavg()[0], **solve_case(profile, batch, K, M, schedule, budget_s)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            rows.append(row)
            print(f"{name} K={K} M={M} {schedule}: {row['step_s'] * 1e3:.3f} ms proven={row['proven']} "
                  f"gap={gap(row):.1%} {row['seconds']:.1f} s", flush=True)
    return rows


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gap(row: dict) -> float:
    return row["step_s"] / row["lower_bound_s"] - 1 if row["lower_bound_s"] > 0 else math.inf


def gnmt_case(budget_s: float) -> dict:
    """Issue 27's example: gnmt (imported at batch 64), K = 8, M = 8, 1f1b; the peer's min-max
    partition [2, 5, 6, 7, 8, 10, 3, 4] scores 27.4364 ms in our cost model."""
    from gpipe_plan.planner.costmodel import CostModel, Setting
    from gpipe_plan.planner.objective import evaluate
    from gpipe_plan.planner.pipedream import import_pipedream
    from gpipe_plan.planner.profile import Profile

    profile = Profile(import_pipedream(str(PIPEDREAM / "gnmt.graph.txt"), batch_size=64), where="gnmt")
    row = solve_case(profile, 64, 8, 8, "1f1b", budget_s)
    bounds = [0]
    for n in (2, 5, 6, 7, 8, 10, 3, 4):
        bounds.append(bounds[-1] + n)
    peer = evaluate(CostModel(profile.at(8), Setting(8, 8, "1f1b", "never")), bounds)
    return {**row, "peer_step_s": peer.step_s}


def scale_case(budget_s: float) -> dict:
    """gnmt (batch 64) on 512 devices, 64 nodes, a 12.5 GB/s network, a global batch of 8192."""
    from gpipe_plan.planner.pipedream import import_pipedream
    from gpipe_plan.planner.profile import Profile
    from gpipe_plan.planner.replicas import search_devices
    from gpipe_plan.planner.problem import SolveOptions

    profile = Profile(import_pipedream(str(PIPEDREAM / "gnmt.graph.txt"), batch_size=64), where="gnmt")
    options = SolveOptions(devices=512, nodes=64, network_bandwidth_bytes_per_s=12.5e9, global_batch_size=8192,
                           data_parallel="auto", time_budget_s=budget_s)
    started = time.perf_counter()
    result = search_devices(profile, options)
    seconds = time.perf_counter() - started
    best = result.best
    cand = best.result.best
    return {"seconds": seconds, "step_s": cand.step_s, "lower_bound_s": result.lower_bound_s,
            "proven": bool(result.proven), "stages": best.stages, "data_parallel": best.data_parallel,
            "schedule": cand.setting.schedule, "micro_batches": cand.setting.micro_batches,
            "bound_by": getattr(result, "bound_by", None), "load": os.getloadavg()[0]}


# --------------------------------------------------------------------------- the section
def _pct(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1%}"


def summary(rows: list[dict], baseline: list[dict] | None) -> list[str]:
    old = {(r["model"], r["stages"], r["micro_batches"], r["schedule"]): r for r in baseline or []}
    text = []
    groups = [("K = 2", lambda r: r["stages"] == 2), ("K = 4", lambda r: r["stages"] == 4),
              ("K = 8", lambda r: r["stages"] == 8), ("all", lambda r: True)]
    header = ["stages", "cases", "proven", "median gap (unproven)", "worst gap", "median solve (s)", "worst solve (s)",
              "median CPU (s)", "worst CPU (s)"]
    if old:
        header += ["proven before", "median gap before", "plans faster / slower than before", "geomean new/old",
                   "best new/old"]
    out_rows = []
    for label, keep in groups:
        sel = [r for r in rows if keep(r)]
        if not sel:
            continue
        unproven = [gap(r) for r in sel if not r["proven"]]
        times = [r["seconds"] for r in sel]
        row = [label, len(sel), f"{sum(r['proven'] for r in sel)} ({sum(r['proven'] for r in sel) / len(sel):.0%})",
               _pct(statistics.median(unproven)) if unproven else "-", _pct(max(unproven)) if unproven else "-",
               f"{statistics.median(times):.2f}", f"{max(times):.1f}", *_cpu(sel)]
        if old:
            pairs = [(r, old[k]) for r in sel if (k := (r["model"], r["stages"], r["micro_batches"], r["schedule"])) in old]
            ratios = [r["step_s"] / o["step_s"] for r, o in pairs]
            before = [gap(o) for _, o in pairs if not o["proven"]]
            faster = sum(x < 1 - 1e-9 for x in ratios)
            slower = sum(x > 1 + 1e-9 for x in ratios)
            row += [f"{sum(o['proven'] for _, o in pairs)} ({sum(o['proven'] for _, o in pairs) / max(1, len(pairs)):.0%})",
                    _pct(statistics.median(before)) if before else "-", f"{faster} / {slower}",
                    f"{math.exp(statistics.mean(math.log(x) for x in ratios)):.4f}" if ratios else "-",
                    f"{min(ratios):.4f}" if ratios else "-"]
        out_rows.append(row)
    text.append(table(header, out_rows))
    by_schedule = []
    for schedule in SCHEDULES:
        for K in (2, 4, 8):
            sel = [r for r in rows if r["schedule"] == schedule and r["stages"] == K]
            if not sel:
                continue
            unproven = [gap(r) for r in sel if not r["proven"]]
            by_schedule.append([schedule, K, f"{sum(r['proven'] for r in sel)} of {len(sel)}",
                                _pct(statistics.median(unproven)) if unproven else "-",
                                _pct(max(unproven)) if unproven else "-",
                                f"{statistics.median(r['seconds'] for r in sel):.2f}",
                                f"{max(r['seconds'] for r in sel):.1f}", *_cpu(sel)])
    text += ["", "By schedule:", "", table(["schedule", "K", "proven", "median gap (unproven)", "worst gap",
                                             "median solve (s)", "worst solve (s)", "median CPU (s)", "worst CPU (s)"],
                                            by_schedule)]
    return text


def _cpu(rows: list[dict]) -> list[str]:
    """Median and worst CPU seconds of the rows' solves (rows recorded before CPU time was: '-')."""
    cpu = [r["cpu_seconds"] for r in rows if "cpu_seconds" in r]
    return [f"{statistics.median(cpu):.2f}", f"{max(cpu):.1f}"] if cpu else ["-", "-"]


def section(rows, baseline, gnmt, scale, budget_s: float, loads: list[float]) -> str:
    text = [
        "## Exactness: proven plans on the PipeDream profiles",
        "",
        f"Machine: {machine()} (load average over the cases: median {statistics.median(loads):.2f}, "
        f"largest {max(loads):.2f}: other work shared the machine); revision {git_revision()}. "
        f"{__doc__.split('Cases: ', 1)[1].split('``--record')[0].strip()}",
        "",
        "'Proven' is `optimality.proven` (no plan of the setting space is faster); the gap of an unproven "
        "plan is `step / lower bound - 1`. 'Before' is the planner of the baseline file "
        "(same cases, recorded with `--record`; the searches are budgeted in work, so its plans do not depend "
        "on the machine that recorded them). 'Solve' is wall time, 'CPU' the process's CPU "
        "time (the searches run on one thread, so other load moves it little); the budget is work "
        "(planner/budgets.py), so a solve takes its budget in CPU time, and on a busy machine more in wall time, "
        f"up to budgets.WALL_SAFETY = 3 times it, where the clock stops it ({_past_the_net(rows, budget_s)}).",
        "",
        *summary(rows, baseline),
    ]
    if gnmt:
        text += ["", "### gnmt, K = 8, M = 8, 1f1b", "",
                 f"Step {gnmt['step_s'] * 1e3:.4f} ms, proven {gnmt['proven']}, lower bound "
                 f"{gnmt['lower_bound_s'] * 1e3:.4f} ms, in {gnmt['seconds']:.1f} s; balance {gnmt['balance']}. "
                 f"The peer's min-max partition [2, 5, 6, 7, 8, 10, 3, 4] scores {gnmt['peer_step_s'] * 1e3:.4f} ms "
                 f"in the same cost model."]
    if scale:
        text += ["", "### gnmt on 512 devices", "",
                 "`solve gnmt.json --devices 512 --nodes 64 --network-bandwidth 12.5 --global-batch-size 8192` "
                 f"(in process, without the one-device comparison): {scale['seconds']:.1f} s (load "
                 f"{scale['load']:.2f}); {scale['stages']} stages x {scale['data_parallel']} replicas, "
                 f"{scale['schedule']}, M = {scale['micro_batches']}, step {scale['step_s'] * 1e3:.3f} ms, "
                 f"proven {scale['proven']}, lower bound {scale['lower_bound_s'] * 1e3:.3f} ms "
                 f"(step / bound {scale['step_s'] / scale['lower_bound_s']:.3f}), bound by {scale['bound_by']}."]
    text += ["", "<details><summary>Every case</summary>", "",
             table(["model", "layers", "K", "M", "schedule", "step (ms)", "proven", "gap", "bound by", "solve (s)",
                    "before (ms)", "before proven"],
                   [[r["model"], f"{r['layers']}" + (f" -> {r['planned_layers']}" if r["planned_layers"] != r["layers"] else ""),
                     r["stages"], r["micro_batches"], r["schedule"] + (f" v={r['virtual_stages']}"
                                                                       if r["schedule"] == "interleaved" else ""),
                     f"{r['step_s'] * 1e3:.4f}", "yes" if r["proven"] else "no", _pct(gap(r)) if not r["proven"] else "0",
                     r.get("bound_by") or "-", f"{r['seconds']:.2f}",
                     *(_before(baseline, r))] for r in rows]),
             "", "</details>"]
    return "\n".join(text) + "\n"


def _past_the_net(rows: list[dict], budget_s: float) -> str:
    from gpipe_plan.planner.budgets import WALL_SAFETY

    near = [r for r in rows if r["seconds"] > 0.9 * WALL_SAFETY * budget_s]
    return (f"{len(near)} of {len(rows)} cases took more than 90% of that, so the clock may have ended them and "
            "their plans depend on the load" if near else "no case came near it")


def _before(baseline, r) -> list[str]:
    for o in baseline or []:
        if (o["model"], o["stages"], o["micro_batches"], o["schedule"]) == (
                r["model"], r["stages"], r["micro_batches"], r["schedule"]):
            return [f"{o['step_s'] * 1e3:.4f}", "yes" if o["proven"] else "no"]
    return ["-", "-"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench exactness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help="comma-separated model names (default: all 14)")
    parser.add_argument("--stages", default="2,4,8")
    parser.add_argument("--micro-batches", default="8,16,32")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--budget", type=float, default=30.0, help="--time-budget of each solve")
    parser.add_argument("--record", type=Path, help="only solve the cases into this JSON-lines file")
    parser.add_argument("--rows", type=Path, default=RESULTS / "data" / "exactness-rows.jsonl",
                        help="where this planner's rows go")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in the file, solve the rest")
    parser.add_argument("--baseline", type=Path, help="rows recorded with an earlier planner, to compare with")
    parser.add_argument("--scale", action="store_true", help="also the solve of gnmt on 512 devices")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n] or [p.name.split(".")[0] for p in sorted(PIPEDREAM.glob("*.graph.txt"))]
    stages = [int(x) for x in args.stages.split(",")]
    ms = [int(x) for x in args.micro_batches.split(",")]
    schedules = [s for s in args.schedules.split(",") if s]
    if args.record:
        record(args.record, names, stages, ms, schedules, args.budget, args.resume)
        return
    args.rows.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in record(args.rows, names, stages, ms, schedules, args.budget, args.resume)
            if r["model"] in names and r["stages"] in stages and r["micro_batches"] in ms and r["schedule"] in schedules]
    baseline = None
    if args.baseline:
        found = args.baseline if args.baseline.exists() else ROOT / args.baseline
        if not found.exists():
            raise SystemExit(f"bench exactness: no baseline file {args.baseline} (rows an earlier planner recorded "
                             "with --record; docs/benchmarks/data/exactness-rows-*.jsonl)")
        baseline = read_rows(found)
    gnmt = gnmt_case(args.budget)
    scale = scale_case(args.budget) if args.scale else None
    data = {"rows": rows, "baseline": baseline, "gnmt": gnmt, "scale": scale}
    (RESULTS / "data" / "exactness.json").write_text(json.dumps(data, indent=1) + "\n")
    text = section(rows, baseline, gnmt, scale, args.budget, [r["load"] for r in rows])
    path = write_section("exactness", text)
    print(text)
    print(f"wrote {path}")
