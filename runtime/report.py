"""Measured against predicted: the report JSON and the table printed at the end of a run.

Each rank measures its own stage (spans, memory); at the end rank 0 gathers them and
compares them with the plan's predictions (docs/report-format.md):

- the step: ``measured_step_s`` is the median over the steps after the first (which pays
  for warm-up: first-touch allocation, gloo's connection set-up) of rank 0's step time.
  Rank 0 runs the first forward and the last backward of every step, so its step is the
  pipeline's;
- per chunk and micro-batch (``chunks``), the forward and backward time (medians of the
  spans), as the plan predicts them (per-micro-batch overhead included); under a split
  backward also its halves, I and W, and B as their sum per micro-batch;
- per stage (``stages``, one per device), its busy and idle time and its peak memory, in
  the plan's terms (see :mod:`.memory`);
- the bubble: the share of stage-time spent idle, ``1 - sum(busy) / (K * step)``, the
  planner's own definition, with busy = forwards + backwards (B, or I and W) + the
  optimizer step;
- the host's load over the steps (``host_load``, gpipe_plan/hostload.py): what other
  processes used of each host's cores, the run's own taken out, so that the headline can
  name a busy host instead of blaming the cost model.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from ..layer_names import LayerNames
from ..tables import narrow_table
from ..schedules import label as schedule_label
from ..schema import CHUNK_TIME_KINDS, FORMAT_VERSIONS, REPORT_FORMAT, report_chunks, timing_key
from ..units import format_percent
from ..hostload import CpuSample, busy_hosts, host_load, load_text
from ..speedprobe import NO_SPEED_PROBE, SAME_SPEED, distrusted_probe, probe_doubt, profile_probe_s, speed_ratio
from ..plan_view import ChunkPlan, PlanView

if TYPE_CHECKING:   # timing imports torch; `gpipe-plan show report.json` must start without it
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
    speed_probe_spread: list[float] = field(default_factory=list)   # each probe's repeats' spread
    host: tuple[CpuSample, CpuSample] | None = None   # the host before the first step and after the last
    hostname: str = field(default_factory=lambda: os.uname().nodename)
    stage: int | None = None          # the stage it ran (None: a report of before data parallel, = rank)
    replica: int = 0                  # the replica of the pipeline it belonged to (data parallel)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measured_steps(steps: list[int]) -> list[int]:
    """The steps that count: all but the first this run made (warm-up), unless it made one."""
    return steps[1:] if len(steps) > 1 else steps


# The span kinds that are a stage's work (the rest is waiting, data, the step's sync).
BUSY_KINDS = ("forward", "backward", "backward_input", "backward_weight", "optimizer")
# The step's other timed parts: drawing the batch, the tied-weight sums, the end-of-step
# exchange of loss and norm (``measured_other_s``: calibrate keeps them out of the overhead).
OTHER_KINDS = ("data", "tied", "sync")


def build_report(plan: PlanView, results: list[RankResult], *, losses: dict[int, float], run: dict[str, Any],
                 tokens_per_sample: int | None) -> dict[str, Any]:
    """The report document, at the report format's current version (gpipe_plan/schema.py).

    With d replicas (data parallel) the per-stage and per-chunk figures are replica 0's, each
    stage's ``replicas`` lists every replica's, and ``measured_gradient_sync_s`` is the stage's
    gradient sync (median over steps; the slowest replica), beside the plan's prediction.
    """
    results = sorted(results, key=lambda r: r.rank)
    K = plan.num_stages
    steps = measured_steps(sorted(results[0].step_s))
    counted = set(steps)
    step_times = [results[0].step_s[s] for s in steps]
    measured_step = _median(step_times)
    spans = {res.rank: [s for s in res.spans if s.step in counted] for res in results}
    by_rank = {res.rank: res for res in results}
    # The torch executor's spans cover computation only: its waits are not measured (None, not 0).
    waits_measured = run.get("executor") != "torch"
    chunks = [_chunk_report(cp, spans.get(plan.rank_of(cp.stage, 0), []), plan.split_backward) for cp in plan.chunks]
    stages = []
    busy_total = 0.0
    for sp in plan.stages:
        res = by_rank[plan.rank_of(sp.index, 0)]
        mine = spans[res.rank]
        opt = [s.duration_s for s in mine if s.kind == "optimizer"]
        busy = [sum(s.duration_s for s in mine if s.step == st and s.kind in BUSY_KINDS) for st in steps]
        waits = [sum(s.duration_s for s in mine if s.step == st and s.kind == "wait") for st in steps]
        other = [sum(s.duration_s for s in mine if s.step == st and s.kind in OTHER_KINDS) for st in steps]
        busy_s = _median(busy) or 0.0
        busy_total += busy_s
        stages.append({
            "index": sp.index,
            "chunks": list(sp.chunks),
            "layers": [name for c in sp.chunks for name in plan.chunks[c].layers],
            timing_key("measured", "optimizer"): _median(opt),
            "predicted_memory_bytes": sp.memory_bytes,
            "measured_peak_memory_bytes": res.memory.get("peak_bytes"),
            "predicted_memory": sp.memory_parts,
            "measured_memory": res.memory,
            "measured_busy_s": busy_s,
            "measured_wait_s": _median(waits) if waits_measured else None,
            "measured_other_s": _median(other),
            "measured_cpu_s": _median([res.cpu_s[st] for st in steps if st in res.cpu_s]),
            "predicted_idle_fraction": sp.idle_fraction,
            "measured_idle_fraction": (1 - busy_s / measured_step) if measured_step else None,
            "host": res.hostname,
            "predicted_gradient_sync_s": sp.gradient_sync_s,
            "measured_gradient_sync_s": _slowest([_sync_s(spans[r], steps) for r in plan.stage_ranks(sp.index)]),
            "replicas": [_replica_report(by_rank[r], spans[r], steps, replica, waits_measured) for replica, r in
                         enumerate(plan.stage_ranks(sp.index))] if plan.data_parallel > 1 else None,
        })
    B = plan.global_batch_size
    samples_per_s = B / measured_step if measured_step else None
    loss_steps = sorted(losses)
    speed = _speed(plan, results, measured_step)
    load = host_load([(r.rank, *r.host) for r in results if r.host is not None], run.get("threads_per_rank") or 1)
    return {
        "format": REPORT_FORMAT,
        "version": FORMAT_VERSIONS[REPORT_FORMAT],
        "plan": {"path": plan.path, "sha256": plan.sha256},
        "model": plan.model,
        "schedule": plan.schedule,
        "virtual_stages": plan.virtual_stages,
        "num_stages": K,
        # Whether the ranks shared the host's cores, and what the plan charged each action for it
        # (calibrate: profiles/plausibility.py and profiles/overhead.py).
        "concurrent_ranks": plan.options.concurrent_ranks,
        "shared_core_slowdown": plan.options.shared_core_slowdown,
        "shared_core_action_s": plan.options.shared_core_action_s,
        "data_parallel": plan.data_parallel,
        "gradient_sync": plan.gradient_sync if plan.data_parallel > 1 else None,
        # The slowest stage's sync, predicted and measured alike; and what the plan says the
        # syncs add to the step (hidden, where the next step's fill leaves room).
        "predicted_gradient_sync_s": _slowest([sp.gradient_sync_s for sp in plan.stages]),
        "measured_gradient_sync_s": _slowest([st["measured_gradient_sync_s"] for st in stages]),
        "predicted_exposed_gradient_sync_s": plan.predicted.gradient_sync_s,
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
        "speed": speed,
        "host_load": load,
        "headline": headline(plan.predicted_step_s, plan.predicted.noise_sources, speed,
                             measured_step, load),
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
        "chunks": chunks,
        "stages": stages,
    }


def _sync_s(spans: list[Span], steps: list[int]) -> float | None:
    """A rank's gradient sync per step (its ``gradient_sync`` spans), median over ``steps``; None without any."""
    if not any(s.kind == "gradient_sync" for s in spans):
        return None
    return _median([sum(s.duration_s for s in spans if s.step == st and s.kind == "gradient_sync") for st in steps])


def _slowest(values: list[float | None]) -> float | None:
    """The largest known value: a stage's replicas sync together, so the step waits for the slowest."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _replica_report(res: RankResult, spans: list[Span], steps: list[int], replica: int,
                    waits_measured: bool = True) -> dict[str, Any]:
    """One replica of a stage: its rank and host, busy and waiting time, gradient sync, peak memory."""
    busy = [sum(s.duration_s for s in spans if s.step == st and s.kind in BUSY_KINDS) for st in steps]
    waits = [sum(s.duration_s for s in spans if s.step == st and s.kind == "wait") for st in steps]
    return {"replica": replica, "rank": res.rank, "host": res.hostname, "measured_busy_s": _median(busy),
            "measured_wait_s": _median(waits) if waits_measured else None,
            "measured_gradient_sync_s": _sync_s(spans, steps),
            "measured_peak_memory_bytes": res.memory.get("peak_bytes")}


def _chunk_report(cp: ChunkPlan, spans: list[Span], split: bool) -> dict[str, Any]:
    """One chunk's measured times per micro-batch (medians over steps and micro-batches) beside
    the plan's; ``backward`` is B, or under a split backward I + W of the same micro-batch."""
    def durations(kind: str) -> dict[tuple[int, int], float]:
        out: dict[tuple[int, int], float] = {}
        for s in spans:
            if s.kind == kind and s.chunk == cp.index:
                out[(s.step, s.micro_batch)] = out.get((s.step, s.micro_batch), 0.0) + s.duration_s
        return out

    forward = durations("forward")
    if split:
        halves = durations("backward_input"), durations("backward_weight")
        whole = {key: halves[0].get(key, 0.0) + halves[1].get(key, 0.0) for key in halves[0].keys() | halves[1].keys()}
        measured_input = _median(list(halves[0].values()))
        measured_weight = _median(list(halves[1].values()))
    else:
        whole = durations("backward")
        measured_input = measured_weight = None
    predicted = {"forward": cp.forward_s, "backward": cp.backward_s,
                 "backward_input": cp.backward_input_s if split else None,
                 "backward_weight": cp.backward_weight_s if split else None}
    measured = {"forward": _median(list(forward.values())), "backward": _median(list(whole.values())),
                "backward_input": measured_input, "backward_weight": measured_weight}
    return {
        "index": cp.index,
        "stage": cp.stage,
        "layers": list(cp.layers),
        "recompute": cp.recompute,
        **{timing_key(who, kind): times[kind] for kind in CHUNK_TIME_KINDS
           for who, times in (("predicted", predicted), ("measured", measured))},
    }


def _speed(plan: PlanView, results: list[RankResult], measured_step: float | None) -> dict[str, Any]:
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
        "per_rank_probe_spread": {str(r.rank): r.speed_probe_spread for r in results},
        "ratio": ratio,
        "predicted_step_s_at_run_speed": at_speed,
        "step_time_ratio_at_run_speed": (measured_step / at_speed) if measured_step and at_speed else None,
    }


def headline(predicted_step_s: float | None, plan_noise: dict[str, float] | None, speed: dict[str, Any],
             measured_step_s: float | None, load: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run judged against its plan's own prediction, with the band chance alone would
    explain; beside it the prediction at the machine's speed during the run, where the speed
    probe held still long enough to tell it; and whether the host was busy.

    The band (``noise_fraction``) adds in quadrature, as independent relative errors:

    - the plan's noise (``predicted.noise_sources``: the profile's speed drift while it measured,
      the neighbours' spread between cycles; docs/plan-format.md);
    - ``run_speed_drift``: the probes of the run (every rank, before and after) spread by half
      their range over their mean: the machine's speed moved that much during the run.

    ``at_run_speed`` is the plan's prediction times the probe's speed ratio, when the probe can
    be trusted (:func:`gpipe_plan.speedprobe.probe_doubt`: its readings steady, each and
    between before and after) and the ratio is not the profile's speed; its band adds half the
    correction, ``|ratio - 1| / 2``, since the generic probe tracks the model's own drift only
    partly (docs/runtime.md, "Measured against predicted"). Otherwise ``speed_left_out`` says why.
    ``host_busy``: other processes took cores the run needed (gpipe_plan/hostload.py; None: not
    measured), which makes the step the host's as much as the plan's.
    """
    sources = {k: float(v) for k, v in (plan_noise or {}).items() if isinstance(v, (int, float))}
    probes = [p for pair in (speed.get("per_rank_probe_s") or {}).values() for p in pair if p and p > 0]
    if len(probes) >= 2:
        sources["run_speed_drift"] = (max(probes) - min(probes)) / (max(probes) + min(probes))
    noise = math.sqrt(sum(v * v for v in sources.values())) if sources else None
    off = measured_step_s / predicted_step_s if measured_step_s and predicted_step_s else None
    ratio = speed.get("ratio")
    doubt = None
    at_speed = None
    if ratio and predicted_step_s:
        spreads = [s for pair in (speed.get("per_rank_probe_spread") or {}).values() for s in pair if s is not None]
        doubt = probe_doubt(probes, spreads, sources.get("profile_speed_drift"), ratio)
        if doubt is None and abs(ratio - 1.0) > SAME_SPEED:
            scaled = predicted_step_s * ratio
            band = math.hypot(noise or 0.0, abs(ratio - 1.0) / 2)
            scaled_off = measured_step_s / scaled if measured_step_s else None
            at_speed = {"predicted_step_s": scaled, "speed_ratio": ratio, "noise_fraction": band,
                        "step_time_ratio": scaled_off,
                        "within_noise": abs(scaled_off - 1.0) <= band if scaled_off is not None else None}
    return {
        "predicted_step_s": predicted_step_s,
        "basis": "profile",
        "noise_fraction": noise,
        "noise_sources": sources,
        "step_time_ratio": off,
        "within_noise": abs(off - 1.0) <= noise if off is not None and noise is not None else None,
        "at_run_speed": at_speed,
        "speed_left_out": doubt if ratio else NO_SPEED_PROBE if not speed.get("profile_probe_s") else None,
        "host_busy": bool(busy_hosts(load)) if load else None,
    }


def print_summary(report: dict[str, Any], console: Console) -> None:
    """What a run measured against what its plan predicted: a table per chunk (its times per
    micro-batch), one per stage (its memory, idle share and, with replicas, gradient sync),
    then the step, the bubble and throughput, and the loss."""
    console.print(chunk_table(report))
    console.print(stage_table(report))
    console.print(step_line(report), highlight=False)
    line = f"bubble {_pair(report.get('measured_bubble_fraction'), report.get('predicted_bubble_fraction'), _pct)}"
    if report.get("samples_per_s"):
        line += f"   {report['samples_per_s']:,.1f} samples/s"
    if report.get("tokens_per_s"):
        line += f"   {report['tokens_per_s']:,.0f} tokens/s"
    console.print(line + "   (measured / predicted)", highlight=False)
    loss = report.get("loss") or {}
    per_step = loss.get("per_step") or {}
    if loss.get("first") is not None and loss.get("last") is not None and per_step:
        steps = sorted(int(s) for s in per_step)
        console.print(f"loss {loss['first']:.4f} at step {steps[0] + 1} -> {loss['last']:.4f} at step {steps[-1] + 1}",
                      highlight=False)


def chunk_table(report: dict[str, Any]) -> Table:
    """Per chunk, in pipeline order by stage: its layers and one micro-batch's forward and
    backward (B, or I + W under a split backward), measured / predicted, in ms.

    A report's keys are checked by gpipe_plan/schema.py; those a run always writes may still
    be absent from a hand-made one, and are shown as "-".
    """
    chunks = report_chunks(report)
    split = any(c.get("measured_backward_input_s") is not None for c in chunks)
    table = narrow_table("measured vs predicted, per chunk and micro-batch (rc: recomputes)",
                         ("stage", "chunk", "layers", "forward ms", "I+W ms" if split else "backward ms"),
                         left=("layers",))
    naming = LayerNames(name for st in report["stages"] for name in st.get("layers") or [])
    for chunk in sorted(chunks, key=lambda c: (c.get("stage", 0), c.get("index", 0))):
        names = naming.span(chunk.get("layers") or [])
        table.add_row(
            str(chunk.get("stage", "-")), str(chunk.get("index", "-")),
            names + (" rc" if chunk.get("recompute") else ""),
            _pair(chunk.get("measured_forward_s"), chunk.get("predicted_forward_s"), _ms_number),
            _pair(chunk.get("measured_backward_s"), chunk.get("predicted_backward_s"), _ms_number),
        )
    if naming.note():
        table.note = naming.note()
    return table


def stage_table(report: dict[str, Any]) -> Table:
    """Per stage (device): its peak memory and idle share, measured / predicted; with replicas
    also its gradient sync per step (the slowest replica's)."""
    replicated = (report.get("data_parallel") or 1) > 1
    columns = ("stage", "peak MiB", "idle") + ((f"{report.get('gradient_sync')} sync ms",) if replicated else ())
    table = narrow_table("measured vs predicted, per stage", columns)
    for st in report["stages"]:
        row = [str(st.get("index", "-")),
               _pair(st.get("measured_peak_memory_bytes"), st.get("predicted_memory_bytes"), _mib_number),
               _pair(st.get("measured_idle_fraction"), st.get("predicted_idle_fraction"), _pct)]
        if replicated:
            row.append(_pair(st.get("measured_gradient_sync_s"), st.get("predicted_gradient_sync_s"), _ms_number))
        table.add_row(*row)
    if replicated:
        table.note = f"{report.get('data_parallel')} replicas of each stage; the figures are replica 0's"
    return table


def step_line(report: dict[str, Any]) -> str:
    """The step measured against the plan's prediction: its error, the expected band and what
    explains a miss (a busy host, the machine's speed, or the cost model; or that a probe it
    cannot trust leaves that open), in one paragraph.

    A report before version 5 has a headline of another shape (its prediction the speed-adjusted
    one), or none: one is made from its own fields, its plan's noise as it recorded it.
    """
    head = report.get("headline") or {}
    if "at_run_speed" not in head:
        plan_noise = {k: v for k, v in (head.get("noise_sources") or {}).items() if k not in OLD_RUN_NOISE}
        head = headline(report.get("predicted_step_s"), plan_noise, report.get("speed") or {},
                        report.get("measured_step_s"), report.get("host_load"))
    measured, predicted = report.get("measured_step_s"), head["predicted_step_s"]
    line = f"step {_ms(measured) if measured is not None else '-'} measured"
    if predicted is None:
        return line + " (the plan predicts none)"
    line += f", {_ms(predicted)} predicted"
    off, noise = head["step_time_ratio"], head["noise_fraction"]
    if off is None:
        return line
    error = format_percent(off - 1.0, sign=True)
    band = f"±{format_percent(noise)}" if noise is not None else None
    at_speed = head.get("at_run_speed")
    busy = busy_hosts(report.get("host_load"))
    if busy:
        # The host, not the plan: say what it did and what to do, and judge nothing else.
        several = len((report.get("host_load") or {}).get("hosts") or []) > 1
        return (f"{line} ({error}{f', expected {band}' if band else ''}): "
                + "; ".join(load_text(h, named=several) for h in busy)
                + ": the step measures that load as much as the plan; rerun on a quiet machine to judge the prediction")
    # A probe that cannot be trusted (the machine's speed moved during the run, or its readings
    # did) leaves the miss unexplained either way: the run cannot judge the cost model.
    doubted = distrusted_probe(head) is not None
    if noise is None:
        line += f" ({error})"
    elif head["within_noise"]:
        line += f" ({error}, within the expected {band})"
    elif (at_speed and at_speed.get("within_noise")) or doubted:
        line += f" ({error}, beyond the expected {band})"
    else:
        line += (f" ({error}, beyond the expected {band}: the cost model misses something here; "
                 "`gpipe-plan calibrate` folds this run into the profile)")
    if at_speed:
        ratio = at_speed["speed_ratio"]
        line += (f"; at this machine's speed ({format_percent(abs(ratio - 1.0))} {'slower' if ratio > 1 else 'faster'} "
                 f"than at profiling, by the speed probe) {_ms(at_speed['predicted_step_s'])} predicted "
                 f"({format_percent(at_speed['step_time_ratio'] - 1.0, sign=True)}, "
                 f"{'within' if at_speed['within_noise'] else 'beyond'} ±{format_percent(at_speed['noise_fraction'])})")
        if at_speed["within_noise"] and not head["within_noise"]:
            line += ": the machine's speed explains the miss, not the cost model"
    elif not head.get("speed_left_out") and (report.get("speed") or {}).get("ratio"):
        line += "; the machine ran at the profile's speed (speed probe)"
    elif head.get("speed_left_out") == NO_SPEED_PROBE:
        line += "; no speed probe: the machine's drift since profiling is not known"
    elif doubted:
        line += f"; the speed-adjusted prediction is left out: the speed probe cannot be trusted ({head['speed_left_out']})"
        if noise is not None and not head["within_noise"]:
            line += (": the machine's speed may explain the miss as much as the cost model; rerun on a quiet "
                     "machine to judge the prediction")
    return line


# The noise sources a headline before version 5 added from the run itself (made again from the
# report's speed); the others are its plan's.
OLD_RUN_NOISE = ("run_speed_drift", "speed_correction")


def _pair(measured: float | None, predicted: float | None, fmt: Any) -> str:
    left = fmt(measured) if measured is not None else "-"
    right = fmt(predicted) if predicted is not None else "-"
    return f"{left} / {right}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _ms_number(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mib_number(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _pct(fraction: float) -> str:
    return format_percent(fraction)


def show_report(report: dict[str, Any], path: str, console: Console | None = None) -> None:
    """``gpipe-plan show report.json``: what the run was, then its measured-vs-predicted table.

    Reads only the report: the table a run printed at its end can be had again later, or on
    another machine, without torch.
    """
    console = console or Console()
    model = report.get("model") or {}
    name = model.get("name") or model.get("factory") or "model"
    plan = (report.get("plan") or {}).get("path") or "?"
    K, d = report.get("num_stages"), report.get("data_parallel") or 1
    schedule = schedule_label(str(report.get("schedule")), report.get("virtual_stages") or 1)
    replicas = f" x {d} replicas" if d > 1 else ""
    console.print(f"[bold]report[/bold] {path}: {name} on {K} stage{'s' if K != 1 else ''}{replicas} (plan {plan}), "
                  f"global batch {report.get('global_batch_size')} = {f'{d} x ' if d > 1 else ''}"
                  f"{report.get('micro_batches')} micro-batches of "
                  f"{report.get('micro_batch_size')}, {schedule}; {report.get('steps_run')} steps, "
                  f"medians over {report.get('steps_measured')}", highlight=False)
    print_summary(report, console)
