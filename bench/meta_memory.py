"""Models larger than one process: the memory and time of profiling and running a model built on meta.

    python -m bench meta_memory                 # tens of minutes (docs/benchmarks.md: how long it took)
    python -m bench meta_memory --quick         # a 4-block width-512 model instead: a few minutes

The profiler and every rank of a run build the model on the meta device and make real only the
layer being measured, or the stage's own layers (models/materialize.py). Three measurements:

- (a) ``gpipe-plan profile gpt --layers 16 --width 2048`` (0.8 B parameters, 3.2 GB in fp32),
  the command a user types: its wall time and peak resident memory, next to the model's
  parameter bytes and the peak of building that model whole in one process (what the profiler,
  and every rank, needed before);
- (b) a 4-stage ``gpipe-plan run`` of 2 steps of that model, from a plan solved from (a)'s
  profile (SGD, micro-batch 1: light on this 24 GiB machine): each rank's peak resident memory
  (the report's ``peak_rss_bytes``) against its stage's parameter bytes and the whole model's;
- (c) ``gpipe-plan profile gpt --layers 24`` (default width) with figures shared between
  layers alike against ``--measure-every-layer``: wall time, consistency, and how much the
  blocks' separately measured times differ from each other (what sharing hides).

Memory is sampled every 0.1 s from /proc: the sum of the resident sets of the command's whole
process tree (it double-counts the pages processes share, ~0.3 GB of libraries each) and the
largest single process's own peak (``getrusage``). Without contention workers a profile is
one process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .common import BENCH_ENV, GPIPE_PLAN, RESULTS, ROOT, Ledger, Others, git_revision, machine, table, write_section

GiB = 2**30
PAGE = os.sysconf("SC_PAGE_SIZE")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def _tree_rss(root: int) -> int:
    tree, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except OSError:
            pass
        todo += tree.get(pid, [])
    return total


def measured(cmd: list[str], cwd: Path) -> dict[str, Any]:
    """Run ``cmd``; its wall time, the peak sum of its process tree's RSS, its largest process's peak."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    peak = 0
    started = time.perf_counter()
    with Others() as others:
        proc = subprocess.Popen(cmd, cwd=cwd, env=BENCH_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _tree_rss(proc.pid))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out, err = proc.communicate()
        done.set()
        sampler.join()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"wall_s": wall, "tree_peak_bytes": peak,
            # ru_maxrss of the children is the largest one's peak so far: only meaningful if it grew.
            "largest_process_peak_bytes": largest if largest > before * 1024 else None,
            "others_cores": others.cores, "stdout": out}


def gpipe(*args: object) -> list[str]:
    return [GPIPE_PLAN, *(str(a) for a in args)]


def whole_build_peak(options: list[str], folder: Path) -> dict[str, Any]:
    """Peak RSS of one process that builds the model whole, as every profile and rank did before."""
    script = folder / "build_whole.py"
    script.write_text("import resource\nfrom gpipe_plan.models import build_model, model_spec\n"
                      f"build_model(model_spec('gpt', **{_options_dict(options)!r}))\n"
                      "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n")
    run = measured([sys.executable, str(script)], folder)
    run["largest_process_peak_bytes"] = int(run["stdout"].split()[-1])
    return run


def _options_dict(options: list[str]) -> dict[str, int]:
    pairs = zip(options[::2], options[1::2])
    return {flag.lstrip("-").replace("-", "_"): int(value) for flag, value in pairs}


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def part_a(options: list[str], folder: Path, ledger: Ledger) -> dict[str, Any]:
    out = folder / "big.json"
    run = measured(gpipe("profile", "gpt", *options, "--out", out, "-q"), folder)
    ledger.add(run["others_cores"])
    doc = json.loads(out.read_text())
    params = sum(layer["param_bytes"] for layer in doc["layers"])
    largest_layer = max(layer["param_bytes"] for layer in doc["layers"])
    whole = whole_build_peak(options, folder)
    floor = measured([sys.executable, "-c", "import resource, gpipe_plan.models; "
                      "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"], folder)
    measured_layers = sum(1 for layer in doc["layers"] if layer["measured_as"] is None)
    print(f"(a) profile: {run['wall_s']:.0f} s, tree peak {_gib(run['tree_peak_bytes'])} GiB, "
          f"model {_gib(params)} GiB, whole build {_gib(whole['largest_process_peak_bytes'])} GiB", flush=True)
    return {"profile": {k: v for k, v in run.items() if k != "stdout"}, "param_bytes": params,
            "largest_layer_param_bytes": largest_layer, "layers": len(doc["layers"]),
            "measured_layers": measured_layers, "consistency": "consistency" in doc,
            "contention": doc.get("contention"), "whole_build": {k: v for k, v in whole.items() if k != "stdout"},
            "bare_process_bytes": int(floor["stdout"].split()[-1]),
            "profile_path": str(out)}


def part_b(profile: Path, stages: int, folder: Path, ledger: Ledger) -> dict[str, Any]:
    plan = folder / "plan.json"
    subprocess.run(gpipe("solve", profile, "--stages", stages, "--micro-batches", stages, "--global-batch-size",
                         stages, "--optimizer", "sgd", "--out", plan, "-q"),
                   cwd=folder, env=BENCH_ENV, check=True, capture_output=True, text=True)
    report = folder / "report.json"
    run = measured(gpipe("run", plan, "--steps", 2, "--threads", 1, "--report", report, "-q"), folder)
    ledger.add(run["others_cores"])
    prof, doc, plan_doc = (json.loads(p.read_text()) for p in (profile, report, plan))
    param_bytes = {layer["name"]: layer["param_bytes"] for layer in prof["layers"]}
    ranks = []
    for st, sp in zip(doc["stages"], plan_doc["stages"]):
        memory = st["measured_memory"]
        ranks.append({"stage": sp["index"], "layers": len(sp["layers"]),
                      "stage_param_bytes": sum(param_bytes[n] for n in sp["layers"]),
                      "peak_rss_bytes": memory.get("peak_rss_bytes"),
                      "gradients_bytes": memory.get("gradients_bytes")})
    print(f"(b) run: {run['wall_s']:.0f} s, ranks' peaks "
          f"{', '.join(_gib(r['peak_rss_bytes']) for r in ranks)} GiB", flush=True)
    return {"run": {k: v for k, v in run.items() if k != "stdout"}, "ranks": ranks,
            "balance": plan_doc.get("balance")}


def old_profiler(revision: str, folder: Path) -> list[str]:
    """The command line of ``gpipe-plan`` at ``revision`` (a git archive of it, imported first)."""
    tree = folder / f"rev-{revision}"
    (tree / "pkg").mkdir(parents=True)
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree / "pkg")], input=archive, check=True)
    (tree / "gpipe_plan").symlink_to(tree / "pkg")
    return ["env", f"PYTHONPATH={tree}", sys.executable, "-c", "from gpipe_plan.cli import main; main()"]


def part_c(options: list[str], rounds: int, baseline: str | None, folder: Path, ledger: Ledger) -> dict[str, Any]:
    modes: dict[str, list[str]] = {
        "layer by layer, each kind once": gpipe("profile", "--layer-by-layer"),
        "layer by layer, every layer": gpipe("profile", "--layer-by-layer", "--measure-every-layer"),
        "whole model, every layer in the same rounds (the default below 1 GiB)": gpipe("profile"),
    }
    if baseline:
        modes[f"every layer, all in the same rounds ({baseline})"] = [*old_profiler(baseline, folder), "profile"]
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for r in range(rounds):   # alternated, so that the machine's drift lands on all alike
        for mode, command in modes.items():
            out = folder / f"c-{len(results[mode])}-{r}-{mode[:5].replace(' ', '-')}.json"
            run = measured([*command, "gpt", *options, "--contention-processes", "0", "--out", str(out), "-q"], folder)
            ledger.add(run["others_cores"])
            doc = json.loads(out.read_text())
            blocks = [layer for layer in doc["layers"] if layer["name"].startswith("block")]
            times = [layer["forward_s"][-1] + layer["backward_s"][-1] for layer in blocks]
            results[mode].append({"wall_s": run["wall_s"], "ratio": doc["consistency"]["ratio"],
                                  "block_step_s": times, "measured": sum(1 for la in doc["layers"]
                                                                         if la.get("measured_as") is None)})
            print(f"(c) {mode} round {r + 1}: {run['wall_s']:.0f} s, consistency "
                  f"{', '.join(f'{x:.3f}' for x in doc['consistency']['ratio'])}", flush=True)
    return results


def write(data: dict[str, Any], ledger: Ledger, args: argparse.Namespace) -> None:
    a, b, c = data["a"], data["b"], data["c"]
    bare, whole = a["bare_process_bytes"], a["param_bytes"]
    lines = ["## Models larger than one process", "",
             f"`python -m bench meta_memory{' --quick' if args.quick else ''}` at revision {git_revision()}; "
             f"{machine()} (a 2-core VM with 24 GiB of memory, no GPU).", "",
             "The profiler and every rank of a run build the model on the meta device and make real only the "
             "layer being measured, or their own stage's layers (docs/models.md, \"Models larger than one "
             "device\"). Memory is the peak resident set: of the command's whole process tree, sampled every "
             "0.1 s and summed (each process counts the libraries it maps), and of its largest single process "
             f"(`getrusage`). A bare Python process that imports torch and gpipe_plan.models peaks at "
             f"{_gib(bare)} GiB.", ""]
    contention = a.get("contention") or {}
    lines += [f"**(a) Profiling** `gpipe-plan profile gpt {' '.join(args.big)}`: {a['layers']} layers, "
              f"{whole / 1e9:.2f} GB of fp32 parameters, the largest layer "
              f"{a['largest_layer_param_bytes'] / 1e9:.2f} GB; {a['measured_layers']} distinct layers measured; "
              f"whole-model check {'on' if a['consistency'] else 'off (the default above 1 GiB of parameters)'}; "
              f"contention timed on layer '{contention.get('layer', '-')}' in {contention.get('processes', '-')} "
              "processes.", ""]
    lines.append(table(["", "wall", "peak RSS, process tree", "peak RSS, largest process"], [
        ["profile (built on meta, one layer real at a time)", f"{a['profile']['wall_s']:.0f} s",
         f"{_gib(a['profile']['tree_peak_bytes'])} GiB", f"{_gib(a['profile']['largest_process_peak_bytes'])} GiB"],
        ["only building the model whole, as every profile did before", f"{a['whole_build']['wall_s']:.0f} s",
         f"{_gib(a['whole_build']['tree_peak_bytes'])} GiB",
         f"{_gib(a['whole_build']['largest_process_peak_bytes'])} GiB"],
    ]))
    lines += ["", "What the profile's own process holds at its peak is one layer's worth, whatever the depth: the "
              "measured layer's parameters and gradients, copies of them with Adam's two state tensors to time its "
              "optimizer step (four times the layer), its activations at one micro-batch size, and the inputs of "
              "the layers still to be measured; the process tree adds the contention workers, one layer each."]
    lines += ["", f"**(b) Running** {len(b['ranks'])} stages, 2 steps, plan solved from (a)'s profile "
              f"(balance {b['balance']}, SGD, micro-batch 1, one thread per rank): {b['run']['wall_s']:.0f} s, "
              f"process tree peak {_gib(b['run']['tree_peak_bytes'])} GiB (launcher included). Before, every rank "
              f"built the whole model ({_gib(whole)} GiB of parameters) before keeping its stage.", ""]
    lines.append(table(["rank", "layers", "stage's parameters", "share of the model", "peak RSS",
                        "peak RSS above a bare process", "that / (stage's parameters + gradients)"], [
        [r["stage"], r["layers"], f"{_gib(r['stage_param_bytes'])} GiB", f"{r['stage_param_bytes'] / whole:.0%}",
         f"{_gib(r['peak_rss_bytes'])} GiB", f"{_gib(r['peak_rss_bytes'] - bare)} GiB",
         f"{(r['peak_rss_bytes'] - bare) / (2 * r['stage_param_bytes']):.2f}"]
        for r in b["ranks"] if r["peak_rss_bytes"]]))
    rows = []
    for mode, runs in c.items():
        walls = [r["wall_s"] for r in runs]
        ratios = [x for r in runs for x in r["ratio"] if x]
        spreads = [(max(r["block_step_s"]) - min(r["block_step_s"])) / statistics.median(r["block_step_s"])
                   for r in runs]
        rows.append([mode, runs[0]["measured"], f"{statistics.median(walls):.0f} s",
                     f"{min(walls):.0f}..{max(walls):.0f} s", f"{statistics.median(ratios):.3f}",
                     f"{min(ratios):.3f}..{max(ratios):.3f}", f"{statistics.median(spreads):.1%}"])
    lines += ["", f"**(c) Profiling time, layer by layer against the whole model**: `gpipe-plan profile gpt "
              f"{' '.join(args.small)} --contention-processes 0`, {args.rounds} round(s) alternating the "
              "configurations; the whole-model check is on (a small model). Consistency is the sum of the layers "
              "over the whole model's step, over every micro-batch size and round; block spread is (slowest - "
              "fastest) / median of the blocks' forward+backward at the largest size within one profile (0 with "
              "shared figures, by construction)."
              + (f" The last row is the profiler at revision {args.baseline}, which built the whole model and "
                 "timed every layer in the same rounds, one after the other as in the model." if args.baseline
                 else ""), ""]
    lines.append(table(["figures", "layers measured", "wall (median)", "wall (range)", "consistency (median)",
                        "consistency (range)", "block spread"], rows))
    lines += ["", ledger.line(), ""]
    write_section("meta_memory", "\n".join(lines))
    (RESULTS / "data").mkdir(parents=True, exist_ok=True)
    (RESULTS / "data" / "meta_memory.json").write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench meta_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model for (a) and (b), one round of (c)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (c)")
    parser.add_argument("--baseline", default="", metavar="REV",
                        help="(c) also profiles with gpipe-plan at this git revision (default: none)")
    parser.add_argument("--only-c", action="store_true",
                        help="measure (c) again; (a) and (b) are read from the last results")
    args = parser.parse_args(argv)
    args.big = ["--layers", "4", "--width", "512"] if args.quick else ["--layers", "16", "--width", "2048"]
    args.small = ["--layers", "24"]
    if args.quick:
        args.rounds = 1
    ledger = Ledger()
    with tempfile.TemporaryDirectory(prefix="meta-memory-") as tmp:
        folder = Path(tmp)
        if args.only_c:
            last = json.loads((RESULTS / "data" / "meta_memory.json").read_text())
            a, b = last["a"], last["b"]
        else:
            a = part_a(args.big, folder, ledger)
            b = part_b(Path(a.pop("profile_path")), args.stages, folder, ledger)
        c = part_c(args.small, args.rounds, args.baseline or None, folder, ledger)
    write({"a": a, "b": b, "c": c, "options": {"big": args.big, "small": args.small, "stages": args.stages}},
          ledger, args)
    os.chdir(ROOT)
