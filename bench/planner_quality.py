"""Plan quality on the 14 real GPU profiles: our plans against the partitions users get today.

For each PipeDream profile and K stages, with M micro-batches and communication ignored
(the profiles carry no link measurements), every partition is scored by the same cost model:
GPipe's predicted step time, and the bottleneck max_k (F_k + B_k). Baselines: equal layer
counts (uniform), balanced parameters, and a time-balancing block heuristic. Optionally the
ILP re-solves each instance to confirm the DP's optimum where CBC finishes in time.
"""

from __future__ import annotations

import argparse
import math
import time

from gpipe_plan.planner import baselines
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.gpipe_solver import GPipeSolver
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.pipedream import import_pipedream
from gpipe_plan.planner.profile import Profile

from .common import PIPEDREAM, git_revision, machine, table, write_section

# GNMT's input is tokens, not an image: its mini-batch cannot be read off the input bytes.
BATCH_SIZES = {"gnmt": 64, "gnmt_large": 64}


def load_all() -> dict[str, Profile]:
    profiles = {}
    for path in sorted(PIPEDREAM.glob("*.graph.txt")):
        name = path.name.split(".")[0]
        profiles[name] = Profile(import_pipedream(str(path), batch_size=BATCH_SIZES.get(name)), where=name)
    return profiles


def bottleneck(ev) -> float:
    return max(s.forward_s + s.backward_s for s in ev.stages)


def run(stages=(2, 4, 8, 16), micro_batches=(64,), ilp_seconds: float = 0.0, ilp_max_layers: int = 0,
        ilp_max_stages: int = 0) -> str:
    profiles = load_all()
    rows, ratios = [], {"uniform": [], "parameters": [], "block": []}
    bneck = {"ours": [], "uniform": [], "parameters": [], "block": []}
    ilp_rows = []
    solve_times = []
    by_km: dict[tuple[int, int], dict[str, list[float]]] = {}
    for name, prof in profiles.items():
        fig = prof.at(prof.sizes[0])
        times = [f + b for f, b in zip(fig.forward_s, fig.backward_s)]
        for K in stages:
            if K > fig.num_layers:
                continue
            for M in micro_batches:
                cm = CostModel(fig, Setting(K, M, "gpipe", "never"))
                started = time.perf_counter()
                sol = GPipeSolver(cm).solve()
                solve_times.append(time.perf_counter() - started)
                ours = sol.evaluation
                parts = {
                    "uniform": evaluate(cm, baselines.uniform(fig.num_layers, K)),
                    "parameters": evaluate(cm, baselines.parameters(fig.param_bytes, K)),
                    "block": evaluate(cm, baselines.block(times, K)),
                }
                min_bneck = bottleneck(evaluate(cm, baselines.min_max(times, K)))
                for key, ev in parts.items():
                    ratios[key].append(ev.step_s / ours.step_s)
                    by_km.setdefault((K, M), {}).setdefault(key, []).append(ev.step_s / ours.step_s)
                    bneck[key].append(bottleneck(ev) / min_bneck)
                bneck["ours"].append(bottleneck(ours) / min_bneck)
                rows.append([name, fig.num_layers, K, M, f"{ours.step_s * 1e3:.1f}",
                             *(f"+{parts[k].step_s / ours.step_s - 1:.1%}" for k in parts),
                             f"{bottleneck(ours) / min_bneck - 1:+.1%}", f"{solve_times[-1] * 1e3:.0f}"])
                if ilp_seconds and (not ilp_max_layers or fig.num_layers <= ilp_max_layers) and \
                        (not ilp_max_stages or K <= ilp_max_stages):
                    from gpipe_plan.planner.ilp import solve_ilp

                    started = time.perf_counter()
                    ilp = solve_ilp(cm, time_limit_s=ilp_seconds)
                    took = time.perf_counter() - started
                    if ilp is None or not ilp.proven:
                        status = "did not finish" if ilp is None or not ilp.proven else ""
                    else:
                        same = math.isclose(ilp.evaluation.step_s, ours.step_s, rel_tol=1e-6)
                        status = "equal" if same else f"DIFFERENT ({ilp.evaluation.step_s:.6g} vs {ours.step_s:.6g})"
                    ilp_rows.append([name, fig.num_layers, K, M, status, f"{took:.1f}"])

    def geo(values):
        return math.exp(sum(math.log(v) for v in values) / len(values))

    _chart(by_km, geo)
    summary = [[key, f"+{geo(v) - 1:.1%}", f"+{max(v) - 1:.1%}", len(v)] for key, v in ratios.items()]
    bsummary = [[key, f"+{geo(v) - 1:.1%}", f"+{max(v) - 1:.1%}"] for key, v in bneck.items()]
    text = [
        "## Plan quality on 14 real GPU profiles (PipeDream)",
        "",
        f"Machine: {machine()}; revision {git_revision()}. Cost model: GPipe closed form, communication "
        f"ignored, M = {', '.join(map(str, micro_batches))} micro-batches of the profiled mini-batch. "
        f"Our plan is the proven optimum of the predicted step time.",
        "",
        "Predicted step time of each baseline partition relative to ours (geometric mean and worst over "
        "all models and K):",
        "",
        table(["partition", "geometric mean", "worst", "instances"], summary),
        "",
        "By K and M (geometric mean over the models, worst in brackets):",
        "",
        table(["K", "M", *(f"{k} vs ours" for k in ratios)],
              [[K, M, *(f"+{geo(v[k]) - 1:.1%} [+{max(v[k]) - 1:.1%}]" for k in ratios)]
               for (K, M), v in sorted(by_km.items())]),
        "",
        "![plan quality by K](benchmarks/quality.svg)",
        "",
        "Bottleneck max_k (F_k + B_k) relative to the least bottleneck any partition has (min-max "
        "partition of F+B). Ours optimises the step time, not the bottleneck, so it may sit a little "
        "above the least bottleneck:",
        "",
        table(["partition", "geometric mean", "worst"], bsummary),
        "",
        f"Solver time per instance: median {sorted(solve_times)[len(solve_times) // 2] * 1e3:.0f} ms, "
        f"max {max(solve_times) * 1e3:.0f} ms.",
        "",
        "<details><summary>Every instance</summary>",
        "",
        table(["model", "layers", "K", "M", "ours: step (ms)", "uniform", "parameters", "block",
               "our bottleneck vs least", "solve (ms)"], rows),
        "",
        "</details>",
    ]
    if ilp_rows:
        agree = sum(r[4] == "equal" for r in ilp_rows)
        limits = []
        if ilp_max_layers:
            limits.append(f"models of at most {ilp_max_layers} layers")
        if ilp_max_stages:
            limits.append(f"K <= {ilp_max_stages}")
        scope = f" (run only on {' and '.join(limits)}, to keep the benchmark's time sane)" if limits else ""
        disagree = [r for r in ilp_rows if r[4] not in ("equal", "did not finish")]
        verdict = ("none disagreed" if not disagree else
                   f"{len(disagree)} DISAGREED: " + "; ".join(f"{r[0]} K={r[2]} M={r[3]}" for r in disagree))
        text += ["", "### ILP against the DP", "",
                 f"ILP (pulp/CBC, {ilp_seconds:g} s limit each){scope}: equal to the DP's optimum on {agree} of "
                 f"{len(ilp_rows)} instances; the other {len(ilp_rows) - agree - len(disagree)} did not finish in "
                 f"time; {verdict}.", "",
                 "<details><summary>Every ILP instance</summary>", "",
                 table(["model", "layers", "K", "M", "ILP vs DP", "ILP seconds"], ilp_rows), "", "</details>"]
    return "\n".join(text) + "\n"


def _chart(by_km: dict, geo) -> None:
    """Grouped bars: each baseline's predicted step relative to ours, geometric mean per (K, M)."""
    from .common import COLOURS, write_svg

    keys = sorted(by_km)
    names = list(next(iter(by_km.values())))
    width, height, left, up, down = 760, 320, 60, 30, 60
    pw, ph = width - left - 150, height - up - down
    top = max(geo(v[n]) for v in by_km.values() for n in names) * 1.1
    group = pw / len(keys)
    bar = group * 0.8 / len(names)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13" font-weight="bold">Predicted step of the usual partitions '
           f'relative to ours (geometric mean over 14 models)</text>']
    step = 0.5 if top > 2 else 0.25
    v = 1.0
    while v <= top:
        y = up + ph - v / top * ph
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="{"#888" if v == 1 else "#eee"}"/>')
        out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{v:g}x</text>')
        v += step
    for i, km in enumerate(keys):
        x0 = left + i * group + group * 0.1
        for j, n in enumerate(names):
            val = geo(by_km[km][n])
            h = val / top * ph
            out.append(f'<rect x="{x0 + j * bar:.1f}" y="{up + ph - h:.1f}" width="{bar - 1:.1f}" height="{h:.1f}" '
                       f'fill="{COLOURS[j]}"/>')
        out.append(f'<text x="{left + i * group + group / 2:.1f}" y="{up + ph + 14}" text-anchor="middle">K={km[0]}</text>')
        out.append(f'<text x="{left + i * group + group / 2:.1f}" y="{up + ph + 28}" text-anchor="middle">M={km[1]}</text>')
    for j, n in enumerate(names):
        out.append(f'<rect x="{left + pw + 20}" y="{up + j * 18}" width="10" height="10" fill="{COLOURS[j]}"/>')
        out.append(f'<text x="{left + pw + 36}" y="{up + j * 18 + 9}">{n}</text>')
    out.append(f'<text x="{left + pw + 20}" y="{up + len(names) * 18 + 12}">1x = our plan</text></svg>')
    write_svg("quality.svg", "\n".join(out) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench quality", description=__doc__)
    parser.add_argument("--stages", default="2,4,8,16")
    parser.add_argument("--micro-batches", default="64")
    parser.add_argument("--ilp-seconds", type=float, default=0.0,
                        help="also solve each instance with the ILP under this time limit")
    parser.add_argument("--ilp-max-layers", type=int, default=0, help="ILP only on models with at most this many layers")
    parser.add_argument("--ilp-max-stages", type=int, default=0, help="ILP only for K up to this")
    args = parser.parse_args(argv)
    text = run(tuple(int(x) for x in args.stages.split(",")), tuple(int(x) for x in args.micro_batches.split(",")),
               args.ilp_seconds, args.ilp_max_layers, args.ilp_max_stages)
    path = write_section("quality", text)
    print(text)
    print(f"wrote {path}")
