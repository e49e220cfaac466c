"""Cost-model accuracy: measured against predicted step time and memory, before and after calibration.

    python -m bench accuracy                      # 2 models x 24 settings x 2 rounds
    python -m bench accuracy --rounds 1 --micro-batches 1,8 --models gpt   # a quicker, rougher run

For the built-ins (``gpt``, ``resnet``, default sizes, global batch 8), K in {1, 2}, M in
{1, 2, 4, 8}, recomputation never/always, GPipe and 1F1B (K = 1 runs one schedule: with one
stage the two are the same), each *cell* is:

1. ``gpipe-plan solve PROFILE -k K --micro-batches M --schedule S --recompute R`` (the plan
   with its predictions), ``gpipe-plan run PLAN --steps 20 --report R1``: the measured step is
   the median of the steps after the first;
2. ``gpipe-plan calibrate R1 --profile PROFILE`` (one calibration round), the same ``solve``
   on the calibrated profile and a second ``run``: the error after calibration.

The machine's speed drifts (see docs/runtime.md, "The machine's speed"), so every figure is
the median over rounds, each round re-profiles the models first and walks the cells in a
rotated order, and each run reports both the raw ratio (measured / predicted) and the ratio
at the speed the run's probe measured (``speed.step_time_ratio_at_run_speed``).

A generic probe does not track the model's own speed well, so the bench also keeps a *model
clock*: in its own process, one thread, it times the whole model's forward+backward at the
cell's micro-batch size for about a second right before and right after each run, and the
same around each profile. ``model_speed_ratio`` (run's reference / profile's reference) is
how much slower the machine ran this model during the run than during its profile; "at the
model's speed" divides it out, to tell the host's drift from the model's own error. It is no
reliable correction: a second of timing can miss a slow spell that the run catches, and the
other way round.

To say *where* an error comes from, each run's step is also re-predicted from the per-stage
forward, backward and optimizer times the run itself measured, through the same schedule
model (``ops`` column): if that matches the measured step, the schedule model is right and the
error is in the per-operation times; what is left (measured / ops) is waits, messages and
per-step work outside the operations. Per-operation errors are fitted as
``measured = c x predicted + a``: ``a`` is a fixed cost per operation (the executor's
per-micro-batch overhead), ``c - 1`` a proportional slowdown (drift, two ranks sharing caches
and memory bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.simulator import simulate_plan
from gpipe_plan.planner.profile import Profile
from gpipe_plan.schema import report_chunks

from .common import (Ledger, cli, med, measured_or_saved, ms, publish, read_json, rng, run_plan,
                     scatter_svg, table, write_svg)

@dataclasses.dataclass(frozen=True)
class Cell:
    model: str
    K: int
    M: int
    schedule: str
    recompute: str

    @property
    def key(self) -> str:
        """The cell's name in the saved results: ``gpt K2 M4 1f1b rc=never``."""
        return f"{self.model} K{self.K} M{self.M} {self.schedule} rc={self.recompute}"

    @classmethod
    def from_key(cls, key: str) -> Cell:
        """The cell a saved result's ``key`` names (the inverse of :attr:`key`)."""
        model, stages, micro_batches, schedule, recompute = key.split()
        return cls(model, int(stages.removeprefix("K")), int(micro_batches.removeprefix("M")), schedule,
                   recompute.removeprefix("rc="))

    @property
    def slug(self) -> str:
        return f"{self.model}-k{self.K}-m{self.M}-{self.schedule}-{self.recompute}"


def cells_of(models, stages, micro_batches, schedules, recomputes) -> list[Cell]:
    out = []
    for model in models:
        for K in stages:
            for M in micro_batches:
                for S in (schedules if K > 1 else schedules[:1]):
                    for R in recomputes:
                        out.append(Cell(model, K, M, S, R))
    return out


def resimulated_step(plan: dict[str, Any], profile_doc: dict[str, Any], report: dict[str, Any]) -> float | None:
    """The step the schedule model gives for the per-stage times the run measured."""
    K, M, b = plan["num_stages"] if "num_stages" in plan else len(plan["balance"]), plan["micro_batches"], \
        plan["micro_batch_size"]
    recompute = [bool(st["recompute"]) for st in plan.get("chunks", plan["stages"])]   # one chunk per stage
    setting = Setting(K, M, plan["schedule"], "never")
    cm = CostModel(Profile(profile_doc).at(b), setting)
    bounds = [0]
    for n in plan["balance"]:
        bounds.append(bounds[-1] + n)
    chunks, _ = cm.layout(bounds, recompute)
    measured, optimizer = [], []
    for ch, rep, chunk in zip(chunks, report["stages"], report_chunks(report)):   # one chunk per stage
        f, g, o = chunk.get("measured_forward_s"), chunk.get("measured_backward_s"), rep.get("measured_optimizer_s")
        if f is None or g is None:
            return None
        measured.append(dataclasses.replace(ch.times(), forward_s=f, backward_s=g))
        optimizer.append(o or 0.0)
    return simulate_plan(plan["schedule"], K, M, 1, measured, optimizer).step_s


class ModelClock:
    """The model's own speed now: median whole-model forward+backward at one size, one thread."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from gpipe_plan.models import build_model
        from gpipe_plan.profiles.contention import median_time_s

        torch.set_num_threads(1)
        self.torch = torch
        self.median_time_s = median_time_s
        self.model = build_model(spec, seed=0)

    def step_s(self, size: int, seconds: float = 1.0) -> float:
        model = self.model
        inputs, targets = model.synthetic_batch(size, self.torch.Generator().manual_seed(0))

        def step() -> None:
            model.loss(model.forward(*inputs), targets).backward()

        for _ in range(2):   # warm-up: this size's buffers
            step()
        median = self.median_time_s(step, seconds, 5)
        model.module.zero_grad(set_to_none=True)
        return median


def one_run(cell: Cell, profile: Path, folder: Path, tag: str, B: int, steps: int, ledger: Ledger,
            clock: ModelClock | None = None, reference_s: dict[int, float] | None = None) -> dict[str, Any]:
    plan = folder / f"{cell.slug}.{tag}.plan.json"
    cli("solve", profile, "-k", cell.K, "--micro-batches", cell.M, "--schedule", cell.schedule,
        "--recompute", cell.recompute, "-b", B, "--out", plan, "-q")
    rep_path = folder / f"{cell.slug}.{tag}.report.json"
    size = B // cell.M
    around = [clock.step_s(size)] if clock is not None else []
    report = run_plan(plan, steps, report=rep_path, ledger=ledger)
    if clock is not None:
        around.append(clock.step_s(size))
    model_speed = (statistics.mean(around) / reference_s[size]) if around and reference_s else None
    plan_doc = read_json(plan)
    prof_doc = read_json(profile)
    speed = report.get("speed") or {}
    ops = resimulated_step(plan_doc, prof_doc, report)
    stages = []
    for st in ({**stage, **chunk} for stage, chunk in zip(report["stages"], report_chunks(report))):
        stages.append({k: st.get(k) for k in ("predicted_forward_s", "measured_forward_s", "predicted_backward_s",
                                              "measured_backward_s", "measured_optimizer_s", "predicted_memory_bytes",
                                              "measured_peak_memory_bytes", "measured_wait_s", "measured_cpu_s",
                                              "measured_busy_s", "recompute")})
    return {
        "balance": plan_doc["balance"],
        "predicted_step_s": report["predicted_step_s"],
        "measured_step_s": report["measured_step_s"],
        "ratio": report["step_time_ratio"],
        "speed_ratio": speed.get("ratio"),
        "ratio_at_speed": speed.get("step_time_ratio_at_run_speed"),
        "ops_step_s": ops,
        "model_speed_ratio": model_speed,
        "ratio_at_model_speed": report["step_time_ratio"] / model_speed if model_speed else None,
        "memory_ratio": max((s["measured_peak_memory_bytes"] or 0) / s["predicted_memory_bytes"]
                            for s in stages if s["predicted_memory_bytes"]),
        "peak_predicted_bytes": max(s["predicted_memory_bytes"] or 0 for s in stages),
        "peak_measured_bytes": max(s["measured_peak_memory_bytes"] or 0 for s in stages),
        "others_cores": report["_others_cores"],
        "stages": stages,
        "warnings": report["run"].get("warnings"),
    }


def measure(cells: list[Cell], rounds: int, B: int, steps: int, calibrate: bool, ledger: Ledger,
            keep: Path | None) -> dict[str, Any]:
    results: dict[str, dict[str, list]] = {c.key: {"before": [], "after": []} for c in cells}
    profiles_meta = []
    with tempfile.TemporaryDirectory() as tmp:
        root = keep or Path(tmp)
        for r in range(rounds):
            folder = root / f"round{r}"
            folder.mkdir(parents=True, exist_ok=True)
            for model in dict.fromkeys(c.model for c in cells):
                mine = [c for c in cells if c.model == model]
                # Profile right before the runs that use it; walk the cells from a different
                # start each round so that a slow spell does not always hit the same cells.
                profile = folder / f"{model}.profile.json"
                clock = ModelClock({"source": "builtin", "name": model, "options": {}})
                sizes = sorted({B // c.M for c in mine})
                around = [[clock.step_s(b) for b in sizes]]
                cli("profile", model, "--batch-size", B, "--out", profile, "-q")
                around.append([clock.step_s(b) for b in sizes])
                reference_s = {b: statistics.mean(x) for b, x in zip(sizes, zip(*around))}
                doc = read_json(profile)
                profiles_meta.append({"round": r, "model": model, "speed_probe_s": doc["device"].get("speed_probe_s"),
                                      "probes_s": doc.get("measurement", {}).get("speed_probe_s"),
                                      "sizes": doc["micro_batch_sizes"],
                                      "model_step_s": doc.get("consistency", {}).get("model_step_s"),
                                      "consistency": doc.get("consistency", {}).get("ratio"),
                                      "contention": (doc.get("contention") or {}).get("slowdown"),
                                      "reference_s": {str(b): [x[i] for x in around] for i, b in enumerate(sizes)}})
                shift = (r * len(mine)) // max(rounds, 1)
                for cell in mine[shift:] + mine[:shift]:
                    before = one_run(cell, profile, folder, "before", B, steps, ledger, clock, reference_s)
                    results[cell.key]["before"].append(before)
                    print(f"round {r + 1} {cell.key:36s} before {before['ratio']:.3f} "
                          f"(at run speed {before['ratio_at_speed'] or float('nan'):.3f}, "
                          f"at model speed {before['ratio_at_model_speed'] or float('nan'):.3f})", flush=True)
                    if calibrate:
                        report = folder / f"{cell.slug}.before.report.json"
                        calibrated = folder / f"{cell.slug}.calibrated.json"
                        # --force: the part measures what calibration makes of every run it gets;
                        # one from a busy host is kept, and says so (``forced``; the ledger says how busy)
                        cli("calibrate", report, "--profile", profile, "--out", calibrated, "--force")
                        after = one_run(cell, calibrated, folder, "after", B, steps, ledger)
                        last_round = read_json(calibrated)["calibration"][-1]
                        after["speed_divided"] = last_round["speed_ratio_divided_out"] != 1.0
                        after["forced"] = last_round.get("forced") or []
                        results[cell.key]["after"].append(after)
                        print(f"round {r + 1} {cell.key:36s} after  {after['ratio']:.3f} "
                              f"(at run speed {after['ratio_at_speed'] or float('nan'):.3f})", flush=True)
    return {"cells": [dataclasses.asdict(c) | {"key": c.key} for c in cells], "results": results,
            "profiles": profiles_meta}


# ------------------------------------------------------------------------------------ analysis
def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = c x + a; returns (c, a)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    c = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 1.0
    return c, my - c * mx


def op_points(runs: list[dict[str, Any]], speed_key: str | None) -> list[tuple[float, float]]:
    """(predicted, measured) per operation; the prediction scaled by ``run[speed_key]`` if given."""
    pts = []
    for run in runs:
        scale = (run.get(speed_key) or 1.0) if speed_key else 1.0
        for st in run["stages"]:
            for kind in ("forward", "backward"):
                p, m = st[f"predicted_{kind}_s"], st[f"measured_{kind}_s"]
                if p and m:
                    pts.append((p * scale, m))
    return pts


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    """Per cell key: the cell and the medians over its rounds of every figure the section shows."""
    per_cell: dict[str, dict[str, Any]] = {}
    for c in data["cells"]:
        res = data["results"][c["key"]]
        b, a = res["before"], res["after"]
        per_cell[c["key"]] = {
            "cell": c,
            "ratio": med(x["ratio"] for x in b), "ratio_at_speed": med(x["ratio_at_speed"] for x in b),
            "ops": med(x["ops_step_s"] / x["predicted_step_s"] for x in b if x["ops_step_s"]),
            "left": med(x["measured_step_s"] / x["ops_step_s"] for x in b if x["ops_step_s"]),
            "memory": med(x["memory_ratio"] for x in b),
            "after": med(x["ratio"] for x in a), "after_at_speed": med(x["ratio_at_speed"] for x in a),
            # The other choice of `calibrate --speed-correction`: the same plan with every calibrated
            # time scaled by the before-run's speed ratio (divided out) or not (kept in).
            "after_other": med(_other_correction(x, y) for x, y in zip(b, a)),
            "after_memory": med(x["memory_ratio"] for x in a),
            "predicted": med(x["predicted_step_s"] for x in b), "measured": med(x["measured_step_s"] for x in b),
            "after_predicted": med(x["predicted_step_s"] for x in a), "after_measured": med(x["measured_step_s"] for x in a),
            "speed": med(x["speed_ratio"] for x in b),
            "model_speed": med(x.get("model_speed_ratio") for x in b),
            "ratio_at_model_speed": med(x.get("ratio_at_model_speed") for x in b),
        }
    return per_cell


def _other_correction(before: dict[str, Any], after: dict[str, Any]) -> float:
    """The after-run's ratio had calibration made the other ``--speed-correction`` choice."""
    speed = before["speed_ratio"] or 1.0
    # A run saved without ``speed_divided`` was calibrated before ``--speed-correction`` existed,
    # when calibration always divided the speed ratio out.
    divided = after.get("speed_divided", True)
    return after["ratio"] / speed if divided else after["ratio"] * speed


def _divided(data: dict[str, Any]) -> bool:
    """Whether calibration divided the speed ratio out (in any of the saved runs)."""
    return any(y.get("speed_divided", True) for res in data["results"].values() for y in res["after"])


def err_stats(values: list[float | None]) -> tuple[float, float] | None:
    xs = [abs(v - 1) for v in values if v is not None]
    return (statistics.median(xs), max(xs)) if xs else None


def cell_results(data: dict[str, Any]) -> list[tuple[Cell, dict[str, list]]]:
    """Each cell's saved runs (``{"before": [...], "after": [...]}``) with the cell its key names, in
    the order they were saved."""
    return [(Cell.from_key(key), res) for key, res in data["results"].items()]


def _stat_row(label: str, cells: list[dict[str, Any]], key: str, runs_key: str, runs: list) -> list[str]:
    """A summary row: the error of ``key`` over the cells (median, worst), and of ``runs_key`` over
    single ``runs`` (worst)."""
    s = err_stats([c[key] for c in cells])
    single = err_stats([x[runs_key] for x in runs])
    if s is None:
        return [label, "-", "-", "-"]
    return [label, f"{s[0]:.1%}", f"{s[1]:.1%}", f"{single[1]:.1%}" if single else "-"]


def summary_rows(data: dict[str, Any], cells: list[dict[str, Any]], before: list[tuple[Cell, dict]],
                 model_clocked: bool) -> list[list[str]]:
    """The headline table: step and memory error before calibration, after it, and by K."""
    all_before = [x for _, x in before]
    all_after = [x for _, res in cell_results(data) for x in res["after"]]
    summary = [_stat_row("step, raw (before calibration)", cells, "ratio", "ratio", all_before),
               _stat_row("step, at the run's speed (before)", cells, "ratio_at_speed", "ratio_at_speed", all_before)]
    if model_clocked:
        summary.append(_stat_row("step, at the model's speed (before)", cells, "ratio_at_model_speed",
                                 "ratio_at_model_speed", all_before))
    if any(c["after"] is not None for c in cells):
        summary += [_stat_row("step, raw (after one calibration round)", cells, "after", "ratio", all_after),
                    _stat_row("step, at the run's speed (after)", cells, "after_at_speed", "ratio_at_speed", all_after),
                    _stat_row(f"step, raw, after calibrating {'*without*' if _divided(data) else '*with*'} the "
                              f"speed correction (derived: the other `--speed-correction`)", cells, "after_other",
                              "ratio", [])]
    # One stage runs no pipeline at all: its error is the profile against the machine of the moment
    # (the floor the host's drift sets); what K = 2 adds on top of it is the pipeline's.
    for label, key in (("raw", "ratio"), ("at the model's speed", "ratio_at_model_speed")):
        if key == "ratio_at_model_speed" and not model_clocked:
            continue
        for K in sorted({c["cell"]["K"] for c in cells}):
            s = err_stats([c[key] for c in cells if c["cell"]["K"] == K])
            single = err_stats([x.get(key) for cell, x in before if cell.K == K])
            if s:
                summary.append([f"step, {label} (before), K = {K} only", f"{s[0]:.1%}", f"{s[1]:.1%}",
                                f"{single[1]:.1%}" if single else "-"])
    summary.append(_stat_row("peak memory per stage (worst stage)", cells, "memory", "memory_ratio", all_before))
    return summary


def fit_rows(before: list[tuple[Cell, dict]], model_clocked: bool) -> list[list[object]]:
    """Per K and per speed correction: every operation's measured = c x predicted + a."""
    by_k: dict[int, list[dict]] = {}
    for cell, run in before:
        by_k.setdefault(cell.K, []).append(run)
    fits: list[list[object]] = []
    for K, runs in sorted(by_k.items()):
        for label, speed_key in (("raw", None), ("at run speed", "speed_ratio"),
                                 ("at the model's speed", "model_speed_ratio")):
            if speed_key == "model_speed_ratio" and not model_clocked:
                continue
            pts = op_points(runs, speed_key)
            if len(pts) < 3:
                continue
            c, a = fit_line(pts)
            ratios = [m / p for p, m in pts]
            fits.append([K, label, len(pts), f"{statistics.median(ratios):.3f}", f"{c:.3f}", f"{a * 1e3:+.2f}"])
    return fits


def overlap_rows(before: list[tuple[Cell, dict]], model_clocked: bool) -> list[list[object]]:
    """Two ranks at once: K = 2, M = 1 (the stages take turns) against M > 1 (they overlap), and K = 1."""
    overlap: list[list[object]] = []
    for label, pick in (("K = 1", lambda k, m: k == 1), ("K = 2, M = 1 (stages take turns)", lambda k, m: k == 2 and m == 1),
                        ("K = 2, M >= 2 (stages overlap)", lambda k, m: k == 2 and m >= 2)):
        runs = [run for cell, run in before if pick(cell.K, cell.M)]
        pts = op_points(runs, "speed_ratio")
        model_pts = op_points(runs, "model_speed_ratio") if model_clocked else []
        if pts:
            overlap.append([label, len(pts), f"{statistics.median(m / p for p, m in pts):.3f}",
                            f"{statistics.median(x['speed_ratio'] or float('nan') for x in runs):.3f}",
                            f"{statistics.median(m / p for p, m in model_pts):.3f}" if model_pts else "-"])
    return overlap


def profile_rows(data: dict[str, Any]) -> list[list[object]]:
    """The profiles themselves: the whole-model step at each size, per sample, and the probes."""
    rows: list[list[object]] = []
    for pm in data.get("profiles", []):
        if not pm.get("model_step_s"):
            continue
        per = [t / b * 1e3 for t, b in zip(pm["model_step_s"], pm["sizes"])]
        probes = pm.get("probes_s") or []
        rows.append([pm["round"] + 1, pm["model"],
                     " ".join(f"{t * 1e3:.1f}" for t in pm["model_step_s"]),
                     " ".join(f"{v:.2f}" for v in per),
                     f"{pm['model_step_s'][1] / pm['model_step_s'][0]:.2f}" if len(pm["model_step_s"]) > 1 else "-",
                     " / ".join(f"{v * 1e3:.1f}" for v in probes),
                     f"{pm['contention']:.2f}" if pm.get("contention") else "-"])
    return rows


def detail_rows(data: dict[str, Any], cells: list[dict[str, Any]]) -> list[list[object]]:
    """One row per cell: its plan, its predictions and every ratio, medians with [min..max] over rounds."""
    detail: list[list[object]] = []
    for c in cells:
        cc = c["cell"]
        res = data["results"][cc["key"]]
        b = res["before"]
        detail.append([cc["model"], cc["K"], cc["M"], cc["schedule"] if cc["K"] > 1 else "-", cc["recompute"],
                       " ".join(map(str, b[0]["balance"])) if b else "-",
                       ms(c["predicted"]), ms(c["measured"]),
                       f"{c['ratio']:.3f} [{rng([x['ratio'] for x in b])}]",
                       f"{c['speed']:.2f}" if c["speed"] else "-",
                       f"{c['ratio_at_speed']:.3f} [{rng([x['ratio_at_speed'] for x in b])}]" if c["ratio_at_speed"] else "-",
                       f"{c['model_speed']:.2f}" if c["model_speed"] else "-",
                       f"{c['ratio_at_model_speed']:.3f} [{rng([x.get('ratio_at_model_speed') for x in b])}]"
                       if c["ratio_at_model_speed"] else "-",
                       f"{c['ops']:.3f}" if c["ops"] else "-", f"{c['left']:.3f}" if c["left"] else "-",
                       f"{c['memory']:.3f}",
                       f"{c['after']:.3f} [{rng([x['ratio'] for x in res['after']])}]" if c["after"] else "-",
                       f"{c['after_at_speed']:.3f}" if c["after_at_speed"] else "-",
                       f"{c['after_other']:.3f}" if c["after_other"] else "-"])
    return detail


def draw_pictures(data: dict[str, Any], cells: list[dict[str, Any]]) -> None:
    """docs/benchmarks/accuracy-*.svg: step measured against predicted (raw and at the run's speed),
    and each stage's peak memory."""
    step_series: dict[str, list[tuple[float, float]]] = {}
    speed_series: dict[str, list[tuple[float, float]]] = {}
    for c in cells:
        m = c["cell"]["model"]
        res = data["results"][c["cell"]["key"]]
        step_series.setdefault(f"{m}, profile", []).append((c["predicted"], c["measured"]))
        speed_series.setdefault(f"{m}, profile", []).append((
            med(x["predicted_step_s"] * (x["speed_ratio"] or 1) for x in res["before"]), c["measured"]))
        if c["after"] is not None:
            step_series.setdefault(f"{m}, calibrated", []).append((c["after_predicted"], c["after_measured"]))
            speed_series.setdefault(f"{m}, calibrated", []).append((
                med(x["predicted_step_s"] * (x["speed_ratio"] or 1) for x in res["after"]), c["after_measured"]))
    order = sorted(step_series)
    write_svg("accuracy-step.svg", scatter_svg("Step time: measured vs predicted (median over rounds)",
                                               {k: step_series[k] for k in order}, "predicted step", "measured step"))
    write_svg("accuracy-step-speed.svg", scatter_svg(
        "Step time: measured vs predicted at the run's measured speed", {k: speed_series[k] for k in sorted(speed_series)},
        "predicted step x speed ratio", "measured step"))
    mem_series: dict[str, list[tuple[float, float]]] = {}
    for cell, res in cell_results(data):
        for x in res["before"][:1]:
            for st in x["stages"]:
                if st["predicted_memory_bytes"] and st["measured_peak_memory_bytes"]:
                    mem_series.setdefault(cell.model, []).append(
                        (st["predicted_memory_bytes"], st["measured_peak_memory_bytes"]))
    write_svg("accuracy-memory.svg", scatter_svg("Peak memory per stage: measured vs predicted", mem_series,
                                                 "predicted", "measured", unit_scale=2 ** -20, unit="MiB"))


def summary_section(data: dict[str, Any], cells: list[dict[str, Any]], before: list[tuple[Cell, dict]],
                    model_clocked: bool) -> str:
    """The section's head: the machine, what each cell ran, the pictures and the headline errors."""
    args = argparse.Namespace(**data["args"])
    raw = err_stats([c["ratio"] for c in cells])
    at_speed = err_stats([c["ratio_at_speed"] for c in cells])
    at_model_speed = err_stats([c["ratio_at_model_speed"] for c in cells])
    return "\n".join([
        "## Cost-model accuracy on this CPU: measured against predicted",
        "",
        f"Machine: {data['machine']}; revision {data['revision']}. {data['ledger']}",
        "",
        f"Built-in `gpt` and `resnet` (default sizes), global batch {args.batch}, 1 thread per rank; "
        f"K in {{{args.stages}}}, M in {{{args.micro_batches}}}, recompute never/always, GPipe and 1F1B "
        f"(K = 1: one schedule). Each cell: `gpipe-plan solve` with the cell's flags, `gpipe-plan run --steps "
        f"{args.steps}` (measured step = median of the steps after the first), then one calibration round "
        f"(`gpipe-plan calibrate`, the same `solve` on the calibrated profile, a second run). {args.rounds} "
        f"round(s); each round re-profiles both models just before their cells and walks the cells in a "
        f"rotated order. Figures are medians over rounds, [min..max] over rounds in brackets. "
        f"'At run speed': the prediction scaled by the run's speed probe (`speed.step_time_ratio_at_run_speed`). "
        f"'At the model's speed': scaled instead by the model clock, the whole model's forward+backward at the "
        f"cell's micro-batch size timed by the bench for a second right before and after the run, over the same "
        f"around the profile (the host's drift, measured on the model itself).",
        "",
        "![step: measured vs predicted](benchmarks/accuracy-step.svg) "
        "![step at the run's speed](benchmarks/accuracy-step-speed.svg) "
        "![memory: measured vs predicted](benchmarks/accuracy-memory.svg)",
        "",
        "Error = |measured / predicted - 1|, over the cells (each cell the median of its rounds); the last "
        "column is the worst single run:",
        "",
        table(["figure", "median error", "worst error (cells)", "worst single run"],
              summary_rows(data, cells, before, model_clocked)),
        "",
        f"Target: median within 10%, worst within 25%. Before calibration the raw step error is "
        f"{raw[0]:.1%} median, {raw[1]:.1%} worst; at the run's speed {at_speed[0]:.1%} / {at_speed[1]:.1%}"
        + (f"; at the model's speed {at_model_speed[0]:.1%} / {at_model_speed[1]:.1%}." if at_model_speed else ".")
        if raw and at_speed else "",
    ])


def error_source_section(cells: list[dict[str, Any]], before: list[tuple[Cell, dict]], model_clocked: bool) -> str:
    """Where the error comes from: the schedule model against the per-operation times, the
    per-operation fit, and two ranks computing at once."""
    ops_err = err_stats([c["ops"] for c in cells])
    left_err = err_stats([c["left"] for c in cells])
    return "\n".join([
        "### Where the error comes from",
        "",
        f"Re-predicting each run's step from the per-stage times *that run measured* (same schedule model) "
        f"gives the `ops` column: |ops / predicted - 1| is {ops_err[0]:.1%} median, {ops_err[1]:.1%} worst, while "
        f"the step the run measured is within {left_err[0]:.1%} median ({left_err[1]:.1%} worst) of that "
        f"re-prediction (`measured/ops`). So the schedule model (bubble, waits, optimizer tail) holds and the error "
        f"sits in the per-operation times." if ops_err and left_err else "",
        "",
        "Per-operation fit, every forward and backward of every stage of every run: measured = c x predicted + a "
        "('at run speed': predicted first scaled by the run's speed ratio). `a` is a fixed cost per operation "
        "(the executor's per-micro-batch work), `c - 1` a proportional slowdown:",
        "",
        table(["K", "prediction", "operations", "median measured/predicted", "c", "a (ms)"],
              fit_rows(before, model_clocked)),
        "",
        "Two ranks computing at once: per-operation measured / predicted at the run's speed, where the stages "
        "take turns and where they overlap (and the speed probe's ratio, which each rank measures alone):",
        "",
        table(["runs", "operations", "median op ratio at run speed", "median speed ratio",
               "median op ratio at the model's speed"], overlap_rows(before, model_clocked)),
    ])


def profiles_section(data: dict[str, Any]) -> str:
    """The profiles the cells were planned from, as the profiler measured them."""
    rows = profile_rows(data)
    return "\n".join([
        "The profiles (taken right before their cells): the whole-model forward+backward at each micro-batch "
        "size as the profiler measured it (`consistency.model_step_s`), per sample, the step at b = 2 over the "
        "step at b = 1 (a compute-bound model would be near 2; per-call costs make it somewhat less), and the "
        "profile's speed probe before / after measuring, and the slowdown it measured with two processes at once "
        "(`contention`, charged to K = 2 plans; '-': not recorded):",
        "",
        table(["round", "model", "step at each size (ms)", "per sample (ms)", "b=2 / b=1", "probe before / after (ms)",
               "contention slowdown"],
              rows) if rows else "(not recorded in this run)",
    ])


def every_cell_section(data: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    """Every cell's figures, folded away."""
    return "\n".join([
        "<details><summary>Every cell</summary>",
        "",
        "Times in ms. `speed`: the run's speed probe / the profile's (> 1: the machine was slower); `model "
        "speed`: the same with the model clock. `ops`: the "
        "step re-predicted from the run's measured per-stage times / the prediction; `measured/ops`: what the "
        "schedule model misses. `memory`: worst stage's measured / predicted peak.",
        "",
        table(["model", "K", "M", "schedule", "recompute", "balance", "predicted", "measured", "measured/predicted",
               "speed", "at run speed", "model speed", "at model speed", "ops", "measured/ops", "memory", "after calibration", "after, at run speed",
               "after, other speed correction"],
              detail_rows(data, cells)),
        "",
        "</details>",
    ])


def render(data: dict[str, Any]) -> str:
    """The part's markdown section from its saved figures (and its pictures, written beside it)."""
    cells = list(summarise(data).values())
    before = [(cell, run) for cell, res in cell_results(data) for run in res["before"]]
    model_clocked = any(c["ratio_at_model_speed"] is not None for c in cells)
    draw_pictures(data, cells)
    sections = [summary_section(data, cells, before, model_clocked),
                error_source_section(cells, before, model_clocked),
                profiles_section(data),
                every_cell_section(data, cells)]
    return "\n\n".join(sections) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,resnet")
    parser.add_argument("--stages", default="1,2")
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--recompute", default="never,always")
    parser.add_argument("--batch", type=int, default=8, help="global batch (and the profile's largest size)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-calibration", action="store_true", help="skip the calibrated re-runs (half the time)")
    parser.add_argument("--keep", type=Path, default=None, help="keep profiles, plans and reports in this folder")
    parser.add_argument("--from-json", type=Path, default=None, help="re-render from a saved accuracy.json")
    args = parser.parse_args(argv)

    def measure_cells(ledger: Ledger) -> dict[str, Any]:
        cells = cells_of(args.models.split(","), [int(x) for x in args.stages.split(",")],
                         [int(x) for x in args.micro_batches.split(",")], args.schedules.split(","),
                         args.recompute.split(","))
        return measure(cells, args.rounds, args.batch, args.steps, not args.no_calibration, ledger, args.keep)

    publish("accuracy", render(measured_or_saved("accuracy", args, measure_cells)))
