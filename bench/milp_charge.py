"""The MILP's charge: what HiGHS's branch-and-bound nodes and simplex iterations cost on this machine, per size.

The schedule MILP (planner/milp_solve.py) is budgeted in work, not in wall time: it stops after
a number of nodes set from a node charge by the programme's size, and a run is charged its
simplex iterations, so that a plan is the same on every run. The charge should be about what the
work costs here, or a budget of 30 s either takes far less than 30 s (and proves less than it
could) or more. This part measures it: for chunked settings of the PipeDream profiles that the
default budget leaves unproven (interleaved at K = 4 and 8, zb-v at K = 4 and 8), it warm-starts
the programme from a short search's plan and runs it four times: with a node limit of 0 (HiGHS
then stops after its presolve, before it solves the root's linear relaxation: the set-up), of 1
(the root: its relaxation and cut rounds), of 200 and of 800 nodes, in CPU seconds of this
process (HiGHS runs on one thread in it, so other load on the machine scarcely moves the
figure). Per thousand variables and constraints, it reports the set-up, the root, the first 200
nodes after it and the next 600, the iterations after the root, and both charges' ratio (CPU /
charged) at the root, at 200 and at 800 nodes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from .common import git_revision, machine, table, write_section

CASES = ("resnet50:4:8:interleaved:2", "resnet50:4:8:interleaved:3", "resnet50:4:8:interleaved:4",
         "nasnetalarge:4:8:interleaved:4", "gnmt_large:4:16:interleaved:4", "densenet121:4:8:zb-v:1",
         "resnet50:8:8:zb-v:1", "resnet101:8:16:zb-v:1", "vgg16:8:8:interleaved:2", "gnmt:8:8:interleaved:3",
         "inception_v3:8:16:interleaved:4", "resnext50:8:32:interleaved:4")
NODE_COUNTS = (0, 1, 200, 800)


def measure(case: str, profiles: dict) -> list[dict]:
    """One case (model:K:M:schedule:v) run to each of NODE_COUNTS nodes: CPU seconds and what was charged."""
    from gpipe_plan.planner import milp, milp_solve
    from gpipe_plan.planner.costmodel import CostModel
    from gpipe_plan.planner.problem import SolveOptions
    from gpipe_plan.planner.search import search

    name, K, M, schedule, v = case.split(":")
    profile, _, batch = profiles[name]
    chunks = {"virtual_stages": int(v)} if schedule == "interleaved" else {}
    start = search(profile, SolveOptions(stages=int(K), micro_batches=int(M), schedule=schedule,
                                         global_batch_size=batch, time_budget_s=2.0, **chunks)).best
    cm = CostModel(profile.at(start.micro_batch_size), start.setting)
    model = milp.build(cm)
    fixed = milp.fixed_cost_s(cm)
    rows = []
    for nodes in NODE_COUNTS:
        # A budget half a late node above what `nodes` nodes are charged: the limit is `nodes`.
        budget = fixed + milp_solve.nodes_cost_s(model, nodes) + milp_solve.nodes_cost_s(model, 1) / 2
        cpu = time.process_time()
        result = milp_solve.solve_milp(cm, start.solution.evaluation, work_budget_s=budget, time_limit_s=600)
        rows.append({"case": case, "thousands": milp_solve._thousands(model), "limit": nodes,
                     "nodes": result.stats["nodes"], "iterations": result.stats.get("iterations"),
                     "cpu_s": time.process_time() - cpu,
                     "node_charge_s": fixed + milp_solve.nodes_cost_s(model, result.stats["nodes"]),
                     "charged_s": result.work_s, "proven": result.proven})
    return rows


def section(rows: list[dict]) -> str:
    from gpipe_plan.planner import milp, milp_solve

    by_case: dict[str, dict[int, dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["limit"]] = r
    lines, roots, early, late, per_iteration = [], [], [], [], []
    node_ratios: dict[int, list[float]] = {1: [], 200: [], 800: []}
    ratios: dict[int, list[float]] = {1: [], 200: [], 800: []}
    for case, runs in by_case.items():
        size = runs[0]["thousands"]
        roots.append(runs[1]["cpu_s"] / size)
        cells = [case, f"{size:.2f}", f"{runs[0]['cpu_s'] / size:.2f}", f"{roots[-1]:.2f}"]
        # (HiGHS may explore one node past its limit: a run reached its limit when it did not prove first)
        root, first, second = runs[1], runs[200], runs[800]
        if root["proven"]:
            cells.append(f"(proven at {root['nodes']})")
        elif not first["proven"]:
            early.append((first["cpu_s"] - root["cpu_s"]) / size / (first["nodes"] - root["nodes"]) * 1000)
            cells.append(f"{early[-1]:.1f}")
        else:
            cells.append(f"(proven at {first['nodes']})")
        if not first["proven"] and second["nodes"] > first["nodes"]:
            late.append((second["cpu_s"] - first["cpu_s"]) / size / (second["nodes"] - first["nodes"]) * 1000)
            cells.append(f"{late[-1]:.1f}" + ("" if not second["proven"] else f" (proven at {second['nodes']})"))
        else:
            cells.append("-")
        if second["iterations"] and second["iterations"] > root["iterations"]:
            per_iteration.append((second["cpu_s"] - root["cpu_s"]) / size
                                 / (second["iterations"] - root["iterations"]) * 1e6)
            cells.append(f"{per_iteration[-1]:.0f}")
        else:
            cells.append("-")
        cells.append(" / ".join(f"{runs[n]['cpu_s'] / runs[n]['node_charge_s']:.2f}" for n in (1, 200, 800)))
        cells.append(" / ".join(f"{runs[n]['cpu_s'] / runs[n]['charged_s']:.2f}" for n in (1, 200, 800)))
        for n in (1, 200, 800):
            node_ratios[n].append(runs[n]["cpu_s"] / runs[n]["node_charge_s"])
            ratios[n].append(runs[n]["cpu_s"] / runs[n]["charged_s"])
        lines.append(cells)
    head = ["case (model:K:M:schedule:v)", "thousand vars + rows", "set-up (CPU s / thousand)",
            "root (CPU s / thousand)", "first 200 nodes (CPU ms / node / thousand)",
            "next 600 (CPU ms / node / thousand)", "iterations after the root (CPU us / iteration / thousand)",
            "CPU / node charge (root / 200 / 800 nodes)", "CPU / charged: iterations (root / 200 / 800)"]
    med = statistics.median

    def spread(values: list[float]) -> str:
        return f"median {med(values):.2f}, {min(values):.2f}-{max(values):.2f}"

    every_node = node_ratios[1] + node_ratios[200] + node_ratios[800]
    every = ratios[1] + ratios[200] + ratios[800]
    return "\n".join([
        "## The MILP's charge",
        "",
        f"Machine: {machine()}; revision {git_revision()}. `python -m bench milp-charge`: each case's",
        "programme warm-started from a 2 s search's plan and run to its set-up (a node limit of 0), its root",
        "(1 node), 200 and 800 branch-and-bound nodes, in CPU seconds of the process (HiGHS on one thread). "
        "The node limit comes from the node charge: building and the root, per thousand variables and constraints, "
        f"{milp.ROOT_S_PER_THOUSAND_SQUARED:g} s times the thousands, within {milp.ROOT_S_PER_THOUSAND:g}-"
        f"{milp.ROOT_S_PER_THOUSAND_MOST:g} s (`milp.root_s_per_thousand`); then "
        f"{milp_solve.EARLY_NODE_S_PER_THOUSAND * 1000:g} ms per node per thousand for the first "
        f"{milp_solve.EARLY_NODES} nodes and {milp_solve.NODE_S_PER_THOUSAND * 1000:g} ms after. A run is charged "
        f"its simplex iterations: {milp_solve.SOLVE_S_PER_THOUSAND:g} s per thousand plus "
        f"{milp_solve.ITERATION_S_PER_THOUSAND * 1e6:g} us per iteration per thousand (planner/milp_solve.py, "
        "[Note: a MILP is charged what it did]).",
        "",
        table(head, lines),
        "",
        f"Root: median {med(roots):.2f} s per thousand (range {min(roots):.2f}-{max(roots):.2f}). "
        f"First 200 nodes: median {med(early):.1f} ms per node per thousand (range {min(early):.1f}-{max(early):.1f}); "
        f"later nodes: median {med(late):.1f} ({min(late):.1f}-{max(late):.1f}); iterations after the root: "
        f"median {med(per_iteration):.0f} us per iteration per thousand ({min(per_iteration):.0f}-"
        f"{max(per_iteration):.0f}). CPU / charged over the three runs of every case: by the node charge "
        f"{spread(every_node)}; by the iterations (what a run is charged) {spread(every)} (under "
        "budgets.WALL_SAFETY = 3: the node limit, not the clock, ends a search unless the machine is about three "
        "times slower than this one).",
        "",
    ])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench milp-charge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="Comma list of model:K:M:schedule:v.")
    args = parser.parse_args(argv)
    from .exactness import profiles

    loaded = profiles()
    rows = []
    for case in args.cases.split(","):
        rows.extend(measure(case, loaded))
        print(case, [(r["nodes"], round(r["cpu_s"], 2)) for r in rows[-len(NODE_COUNTS):]], flush=True)
    print(f"wrote {write_section('milp-charge', section(rows) + f'(load average at the end {os.getloadavg()[0]:.2f})' + chr(10))}")


if __name__ == "__main__":
    main()
