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
from gpipe_plan.planner.dp import GPipeSolver
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


def run(stages=(2, 4, 8, 16), micro_batches=(64,), ilp_seconds: float = 0.0) -> str:
    profiles = load_all()
    rows, ratios = [], {"uniform": [], "parameters": [], "block": []}
    bneck = {"ours": [], "uniform": [], "parameters": [], "block": []}
    ilp_rows = []
    solve_times = []
    for name, prof in profiles.items():
        fig = prof.at(prof.sizes[0])
        times = [f + b for f, b in zip(fig.forward_s, fig.backward_s)]
        for K in stages:
            if K > fig.num_layers:
                continue
            best_bneck = bottleneck_opt = None
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
                    bneck[key].append(bottleneck(ev) / min_bneck)
                bneck["ours"].append(bottleneck(ours) / min_bneck)
                rows.append([name, fig.num_layers, K, M, f"{ours.step_s * 1e3:.1f}",
                             *(f"+{parts[k].step_s / ours.step_s - 1:.1%}" for k in parts),
                             f"{bottleneck(ours) / min_bneck - 1:+.1%}", f"{solve_times[-1] * 1e3:.0f}"])
                if ilp_seconds:
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
        text += ["", f"ILP (pulp/CBC, {ilp_seconds:.0f} s limit each) against the DP: equal on {agree} of "
                 f"{len(ilp_rows)} instances; the rest did not finish in time (none disagreed)"
                 if all(r[4] in ("equal", "did not finish") for r in ilp_rows) else
                 "", "", table(["model", "layers", "K", "M", "ILP vs DP", "ILP seconds"], ilp_rows)]
    return "\n".join(text) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench quality", description=__doc__)
    parser.add_argument("--stages", default="2,4,8,16")
    parser.add_argument("--micro-batches", default="64")
    parser.add_argument("--ilp-seconds", type=float, default=0.0,
                        help="also solve each instance with the ILP under this time limit")
    args = parser.parse_args(argv)
    text = run(tuple(int(x) for x in args.stages.split(",")), tuple(int(x) for x in args.micro_batches.split(",")),
               args.ilp_seconds)
    path = write_section("quality", text)
    print(text)
    print(f"wrote {path}")
