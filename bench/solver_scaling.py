"""Solver scaling: solve time against the number of layers and of stages, DP and ILP.

One setting per solve (M = 64, communication off, no memory limit) on synthetic profiles
(bench/synthetic.py, with optimizer time per layer); GPipe and 1F1B for the DP, GPipe for the
ILP (pulp/CBC) under a time limit. Writes a table and a log-log chart.
"""

from __future__ import annotations

import argparse
import math
import time

from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.gpipe_solver import GPipeSolver
from gpipe_plan.planner.onefoneb import OneFOneBSolver
from gpipe_plan.planner.profile import Profile

from .common import RESULTS, git_revision, machine, table, write_section
from .synthetic import synthetic_profile


def solve_time(layers: int, stages: int, method: str, limit_s: float) -> tuple[float, bool]:
    profile = Profile(synthetic_profile(layers, seed=layers))
    schedule = "1f1b" if method == "dp-1f1b" else "gpipe"
    cm = CostModel(profile.at(1), Setting(stages, 64, schedule, "never"))
    started = time.perf_counter()
    if method == "ilp":
        from gpipe_plan.planner.ilp import solve_ilp

        sol = solve_ilp(cm, time_limit_s=limit_s)
    elif schedule == "gpipe":
        sol = GPipeSolver(cm, time_budget_s=limit_s).solve()
    else:
        sol = OneFOneBSolver(cm, time_budget_s=limit_s).solve()
    return time.perf_counter() - started, bool(sol and sol.proven)


def chart(series: dict[str, list[tuple[int, float, bool]]], xlabel: str, title: str) -> str:
    width, height, left, right, up, down = 640, 380, 70, 150, 30, 50
    xs = [x for pts in series.values() for x, _, _ in pts]
    ys = [y for pts in series.values() for _, y, _ in pts]
    x0, x1 = math.log10(min(xs)), math.log10(max(xs))
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    pw, ph = width - left - right, height - up - down

    def px(x): return left + (math.log10(x) - x0) / ((x1 - x0) or 1) * pw
    def py(y): return up + ph - (math.log10(y) - y0) / ((y1 - y0) or 1) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13" font-weight="bold">{title}</text>']
    for e in range(y0, y1 + 1):
        out.append(f'<line x1="{left}" y1="{py(10**e):.1f}" x2="{left + pw}" y2="{py(10**e):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{py(10**e) + 4:.1f}" text-anchor="end">{10**e:g} s</text>')
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{up + ph + 16}" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 10}" text-anchor="middle">{xlabel}</text>')
    colours = ["#4C78A8", "#F58518", "#54A24B", "#E45756"]
    for i, (name, pts) in enumerate(series.items()):
        c = colours[i % len(colours)]
        path = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for j, (x, y, _) in enumerate(pts))
        out.append(f'<path d="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        for x, y, ok in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c if ok else "white"}" stroke="{c}"/>')
        out.append(f'<text x="{left + pw + 10}" y="{up + 14 * i + 4}" fill="{c}">{name}</text>')
    out.append(f'<text x="{left + pw + 10}" y="{up + 14 * len(series) + 10}">hollow: not proven</text></svg>')
    return "\n".join(out) + "\n"


def run(layer_counts, stage_counts, fixed_stages: int, fixed_layers: int, ilp_limit: float, dp_limit: float) -> str:
    methods = ["dp-gpipe", "dp-1f1b", "ilp"]
    by_layers: dict[str, list] = {m: [] for m in methods}
    by_stages: dict[str, list] = {m: [] for m in methods}
    rows = []
    for L in layer_counts:
        for m in methods:
            if m == "ilp" and L > 1000:
                continue
            t, ok = solve_time(L, fixed_stages, m, ilp_limit if m == "ilp" else dp_limit)
            by_layers[m].append((L, t, ok))
            rows.append([m, L, fixed_stages, f"{t:.3f}", "yes" if ok else "no (time limit)"])
    for K in stage_counts:
        for m in methods:
            if m == "ilp" and K > 32:
                continue
            t, ok = solve_time(fixed_layers, K, m, ilp_limit if m == "ilp" else dp_limit)
            by_stages[m].append((K, t, ok))
            rows.append([m, fixed_layers, K, f"{t:.3f}", "yes" if ok else "no (time limit)"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scaling-layers.svg").write_text(chart(by_layers, "layers", f"Solve time vs layers (K = {fixed_stages})"))
    (RESULTS / "scaling-stages.svg").write_text(chart(by_stages, "stages", f"Solve time vs stages ({fixed_layers} layers)"))
    return "\n".join([
        "## Solver scaling",
        "",
        f"Machine: {machine()}; revision {git_revision()}. One setting per solve: M = 64, no communication, "
        f"no memory limit, synthetic profiles with optimizer time per layer. Time limits: DP {dp_limit:g} s, "
        f"ILP {ilp_limit:g} s (CBC); 'proven' = the solver finished its proof of optimality.",
        "",
        "![solve time vs layers](benchmarks/scaling-layers.svg) ![solve time vs stages](benchmarks/scaling-stages.svg)",
        "",
        table(["solver", "layers", "stages", "seconds", "proven"], rows),
    ]) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench scaling", description=__doc__)
    parser.add_argument("--layers", default="100,200,500,1000,2000,5000")
    parser.add_argument("--stages", default="2,4,8,16,32,64,128")
    parser.add_argument("--fixed-stages", type=int, default=8)
    parser.add_argument("--fixed-layers", type=int, default=500)
    parser.add_argument("--ilp-limit", type=float, default=60.0)
    parser.add_argument("--dp-limit", type=float, default=60.0)
    args = parser.parse_args(argv)
    text = run([int(x) for x in args.layers.split(",")], [int(x) for x in args.stages.split(",")],
               args.fixed_stages, args.fixed_layers, args.ilp_limit, args.dp_limit)
    path = write_section("scaling", text)
    print(text)
    print(f"wrote {path}")
