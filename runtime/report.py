"""Measured against predicted: the report JSON and the table printed at the end of a run.

Each rank measures its own stage (spans, memory); at the end rank 0 gathers them and
compares them with the plan's predictions (docs/report-format.md):

- the step: ``measured_step_s`` is the median over the steps after the first (which pays
  for warm-up: first-touch allocation, gloo's connection set-up) of rank 0's step time.
  Rank 0 runs the first forward and the last backward of every step, so its step is the
  pipeline's;
- per stage and micro-batch, the forward and backward time (medians of the spans), as the
  plan predicts them (per-micro-batch overhead included);
- the bubble: the share of stage-time spent idle, ``1 - sum(busy) / (K * step)``, the
  planner's own definition, with busy = forwards + backwards + the optimizer step;
- peak memory, in the plan's terms (see :mod:`.memory`).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from ..artifacts import REPORT_FORMAT, FORMAT_VERSIONS
from ..speedprobe import profile_probe_s, speed_ratio
from .plan import RunPlan
from .timing import Span


@dataclass
class RankResult:
    """What one rank measured, sent to rank 0 at the end."""

    rank: int
    spans: list[Span]
    step_s: dict[int, float]          # step -> seconds, on this rank
    memory: dict[str, Any]
    cpu_s: dict[int, float] = field(default_factory=dict)   # step -> CPU seconds of the process
    speed_probe_s: list[float] = field(default_factory=list)  # before and after training (speedprobe)
    hostname: str = field(default_factory=lambda: os.uname().nodename)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measured_steps(steps: list[int]) -> list[int]:
    """The steps that count: all but the first this run made (warm-up), unless it made one."""
    return steps[1:] if len(steps) > 1 else steps


def build_report(plan: RunPlan, results: list[RankResult], *, losses: dict[int, float], run: dict[str, Any],
                 tokens_per_sample: int | None) -> dict[str, Any]:
    """The report document (format ``gpipe-plan.report``, version 1)."""
    results = sorted(results, key=lambda r: r.rank)
    K = plan.num_stages
    steps = measured_steps(sorted(results[0].step_s))
    step_times = [results[0].step_s[s] for s in steps]
    measured_step = _median(step_times)
    stages = []
    busy_total = 0.0
    for sp, res in zip(plan.stages, results):
        spans = [s for s in res.spans if s.step in set(steps)]
        fwd = [s.duration_s for s in spans if s.kind == "forward"]
        bwd = [s.duration_s for s in spans if s.kind == "backward"]
        opt = [s.duration_s for s in spans if s.kind == "optimizer"]
        busy = [sum(s.duration_s for s in spans if s.step == st and s.kind in ("forward", "backward", "optimizer"))
                for st in steps]
        waits = [sum(s.duration_s for s in spans if s.step == st and s.kind == "wait") for st in steps]
        busy_s = _median(busy) or 0.0
        busy_total += busy_s
        stages.append({
            "index": sp.index,
            "layers": list(sp.layers),
            "recompute": sp.recompute,
            "predicted_forward_s": sp.forward_s,
            "measured_forward_s": _median(fwd),
            "predicted_backward_s": sp.backward_s,
            "measured_backward_s": _median(bwd),
            "measured_optimizer_s": _median(opt),
            "predicted_memory_bytes": sp.memory_bytes,
            "measured_peak_memory_bytes": res.memory.get("peak_bytes"),
            "predicted_memory": sp.memory_parts,
            "measured_memory": res.memory,
            "measured_busy_s": busy_s,
            "measured_wait_s": _median(waits),
            "measured_cpu_s": _median([res.cpu_s[st] for st in steps if st in res.cpu_s]),
            "predicted_idle_fraction": sp.idle_fraction,
            "measured_idle_fraction": (1 - busy_s / measured_step) if measured_step else None,
            "host": res.hostname,
        })
    B = plan.global_batch_size
    samples_per_s = B / measured_step if measured_step else None
    loss_steps = sorted(losses)
    return {
        "format": REPORT_FORMAT,
        "version": FORMAT_VERSIONS[REPORT_FORMAT],
        "plan": {"path": plan.path, "sha256": plan.sha256},
        "model": plan.model,
        "schedule": plan.schedule,
        "num_stages": K,
        "micro_batches": plan.micro_batches,
        "micro_batch_size": plan.micro_batch_size,
        "global_batch_size": B,
        "run": run,
        "steps_run": len(results[0].step_s),
        "steps_measured": len(steps),
        "predicted_step_s": plan.predicted_step_s,
        "measured_step_s": measured_step,
        "step_time_ratio": (measured_step / plan.predicted_step_s)
        if measured_step and plan.predicted_step_s else None,
        "speed": _speed(plan, results, measured_step),
        "measured_step_s_per_step": {str(s): results[0].step_s[s] for s in sorted(results[0].step_s)},
        "predicted_bubble_fraction": plan.predicted_bubble_fraction,
        "measured_bubble_fraction": (1 - busy_total / (K * measured_step)) if measured_step else None,
        "predicted_samples_per_s": plan.predicted_samples_per_s,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * tokens_per_sample if samples_per_s and tokens_per_sample else None,
        "loss": {
            "first": losses[loss_steps[0]] if loss_steps else None,
            "last": losses[loss_steps[-1]] if loss_steps else None,
            "per_step": {str(s): losses[s] for s in loss_steps},
        },
        "stages": stages,
    }


def _speed(plan: RunPlan, results: list[RankResult], measured_step: float | None) -> dict[str, Any]:
    """The machine's speed during the run against the profile's (see gpipe_plan.speedprobe)."""
    probes = [p for r in results for p in r.speed_probe_s]
    run_probe = statistics.mean(probes) if probes else None
    profile_probe = profile_probe_s(plan.profile_device)
    ratio = speed_ratio(run_probe, profile_probe)
    at_speed = plan.predicted_step_s * ratio if ratio and plan.predicted_step_s else None
    return {
        "profile_probe_s": profile_probe,
        "run_probe_s": run_probe,
        "per_rank_probe_s": {str(r.rank): r.speed_probe_s for r in results},
        "ratio": ratio,
        "predicted_step_s_at_run_speed": at_speed,
        "step_time_ratio_at_run_speed": (measured_step / at_speed) if measured_step and at_speed else None,
    }


def print_summary(report: dict[str, Any], console: Console) -> None:
    """The measured-vs-predicted table, one row per stage, and the step below it."""
    table = Table(title="measured vs predicted, per stage and micro-batch", title_justify="left")
    for column in ("stage", "layers", "forward", "backward", "peak memory", "idle"):
        table.add_column(column, justify="right" if column not in ("layers",) else "left")
    for st in report["stages"]:
        layers = st["layers"]
        names = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)})"
        if st["recompute"]:
            names += " [recompute]"
        table.add_row(
            str(st["index"]), names,
            _pair(st["measured_forward_s"], st["predicted_forward_s"], _ms),
            _pair(st["measured_backward_s"], st["predicted_backward_s"], _ms),
            _pair(st["measured_peak_memory_bytes"], st["predicted_memory_bytes"], _mib),
            _pair(st["measured_idle_fraction"], st["predicted_idle_fraction"], _pct),
        )
    console.print(table)
    step = _pair(report["measured_step_s"], report["predicted_step_s"], _ms)
    ratio = report["step_time_ratio"]
    off = f" ({(ratio - 1) * 100:+.0f}%)" if ratio else ""
    line = f"step {step}{off}   bubble {_pair(report['measured_bubble_fraction'], report['predicted_bubble_fraction'], _pct)}"
    if report["samples_per_s"]:
        line += f"   {report['samples_per_s']:,.1f} samples/s"
    if report["tokens_per_s"]:
        line += f"   {report['tokens_per_s']:,.0f} tokens/s"
    console.print(line + "   (measured / predicted)")
    speed = report.get("speed") or {}
    if speed.get("ratio"):
        console.print(
            f"this machine ran {abs(speed['ratio'] - 1):.0%} {'slower' if speed['ratio'] > 1 else 'faster'} than when "
            f"the profile was measured (speed probe); at that speed the prediction is "
            f"{_ms(speed['predicted_step_s_at_run_speed'])} ({(speed['step_time_ratio_at_run_speed'] - 1) * 100:+.0f}%)",
            highlight=False)


def _pair(measured: float | None, predicted: float | None, fmt: Any) -> str:
    left = fmt(measured) if measured is not None else "-"
    right = fmt(predicted) if predicted is not None else "-"
    return f"{left} / {right}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"
