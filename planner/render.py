"""Show a plan on the terminal (rich) and redraw its timeline, from the plan document alone."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from ..artifacts import precision_label
from .schedule import Timeline, simulate_times
from .timeline import timeline_svg
from .units import format_bytes, format_percent, format_seconds


def plan_timeline(plan: dict[str, Any]) -> Timeline:
    """Re-simulate the plan's schedule from its per-stage predictions (no profile needed)."""
    stages = plan["stages"]
    return simulate_times(
        plan["schedule"],
        [s["forward_s"] for s in stages],
        [s["backward_s"] for s in stages],
        [s["send_s"] for s in stages[:-1]],
        plan["micro_batches"],
        optimizer_s=[s.get("optimizer_s", 0.0) for s in stages],
        recompute_s=[s.get("recompute_s", 0.0) for s in stages],
        record=True,
    )


def plan_timeline_svg(plan: dict[str, Any]) -> str:
    model = plan.get("model", {})
    name = model.get("name") or model.get("factory") or "model"
    pred = plan["predicted"]
    title = (f"{name}: {len(plan['stages'])} stages, M = {plan['micro_batches']} x {plan['micro_batch_size']}, "
             f"{plan['schedule']}; predicted step {format_seconds(pred['step_s'])}, "
             f"bubble {format_percent(pred['bubble_fraction'], 1)}")
    labels = [f"stage {s['index']}" + (" (rc)" if s.get("recompute") else "") for s in plan["stages"]]
    return timeline_svg(plan_timeline(plan), title, labels)


def render_plan(plan: dict[str, Any], console: Console) -> None:
    model = plan.get("model", {})
    name = model.get("name") or model.get("factory") or "model"
    options = plan.get("options", {})
    limit = options.get("memory_limit_bytes")
    pred = plan["predicted"]
    K = len(plan["stages"])
    device = plan.get("profile", {}).get("device", {})
    console.print(
        f"[bold]{name}[/bold] on {K} stage{'s' if K > 1 else ''}, {batch_line(plan)} "
        f"(profile: {device.get('type', '?')}, {device.get('name', '?')}; "
        f"{precision_label(plan.get('precision', 'fp32'), plan.get('param_dtype', 'fp32'))})")
    note = batch_source_note(plan)
    if note:
        console.print(note, highlight=False)
    table = Table(title=None, show_lines=False, header_style="bold")
    for col, justify in [("stage", "right"), ("layers", "left"), ("#", "right"), ("forward", "right"),
                         ("backward", "right"), ("rc", "center"), ("send", "right"),
                         ("memory", "right"), ("idle", "right")]:
        table.add_column(col, justify=justify, no_wrap=col != "layers")
    for st in plan["stages"]:
        names = st["layers"]
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        mem = format_bytes(st["memory_bytes"])
        if limit:
            share = st["memory_bytes"] / limit
            colour = "red" if share > 1 else ("yellow" if share > 0.9 else "green")
            mem = f"[{colour}]{mem} ({share:.0%})[/{colour}]"
        table.add_row(
            str(st["index"]), span, str(len(names)),
            format_seconds(st["forward_s"], 3), format_seconds(st["backward_s"], 3),
            "yes" if st["recompute"] else "-",
            format_seconds(st["send_s"], 3) if st.get("send_s") else "-",
            mem, format_percent(st.get('idle_fraction', 0.0), 1),
        )
    console.print(table)
    samples = pred.get("samples_per_s")
    console.print(
        f"micro-batches [bold]{plan['micro_batches']}[/bold] x {plan['micro_batch_size']} samples, "
        f"schedule [bold]{plan['schedule']}[/bold]; times are per micro-batch; rc: recomputes"
        + (f"; memory limit {format_bytes(limit)}" if limit else "")
        + (" (the card's usable memory)" if limit and options.get("memory_limit_source") == "device" else ""))
    scale = options.get("compute_scale") or 1.0
    if scale != 1.0:
        console.print(f"layer times x{scale:.3f}: stages computing side by side are slower than the profile's "
                      "one process (its measured 'contention')", highlight=False)
    console.print(
        f"predicted step [bold]{format_seconds(pred['step_s'])}[/bold], "
        f"bubble {format_percent(pred['bubble_fraction'], 1)}, "
        + (f"throughput {samples:,.1f} samples/s" if samples else "throughput not defined (a zero step time)"),
        highlight=False)
    comparison = one_device_line(plan)
    if comparison:
        console.print(comparison, highlight=False)
    opt = plan.get("optimality", {})
    if opt.get("proven"):
        searched = opt.get("settings_searched")
        # Optimal among plans of K stages: whether K stages pay at all is the line above.
        what = f"[green]proven optimal[/green] for {K} stage{'s' if K > 1 else ''}"
        console.print(f"{what} over {searched} settings of M and schedule" if searched else what,
                      f"({opt.get('method')})", highlight=False)
    elif opt:
        gap = opt.get("gap")
        console.print(f"[yellow]not proven optimal[/yellow]: within {gap:.2%} of the lower bound"
                      if gap is not None else "[yellow]not proven optimal[/yellow]")
    runners = plan.get("runners_up") or []
    if runners:
        rt = Table(title="runners-up", header_style="bold")
        for col in ("M", "size", "schedule", "step", "vs best", "bubble", "peak memory", "balance"):
            rt.add_column(col, justify="right" if col not in ("schedule", "balance") else "left")
        for r in runners:
            if not r.get("fits"):
                rt.add_row(str(r["micro_batches"]), str(r["micro_batch_size"]), r["schedule"],
                           "[red]does not fit[/red]", "", "", "", "")
                continue
            versus = format_percent(r['step_s'] / pred['step_s'] - 1, 1, sign=True) if pred["step_s"] > 0 else "-"
            rt.add_row(str(r["micro_batches"]), str(r["micro_batch_size"]), r["schedule"],
                       format_seconds(r["step_s"]), versus,
                       format_percent(r['bubble_fraction'], 1), format_bytes(r["peak_memory_bytes"]),
                       " ".join(map(str, r.get("balance", []))))
        console.print(rt)
    for w in plan.get("warnings") or []:
        console.print(f"[yellow]warning:[/yellow] {w}")


def batch_line(plan: dict[str, Any]) -> str:
    """``global batch 32 = 8 micro-batches of 4``: the batch a plan is for, and how it is split.

    Said first, because every figure of the plan holds for that batch only.
    """
    M, size, batch = plan["micro_batches"], plan["micro_batch_size"], plan["global_batch_size"]
    return f"global batch {batch} = {M} micro-batch{'es' if M != 1 else ''} of {size}"


def batch_source_note(plan: dict[str, Any]) -> str | None:
    """A warning when the global batch is a stand-in: an older profile that records none."""
    if (plan.get("options") or {}).get("global_batch_size_source") != "largest micro-batch":
        return None
    return (f"[yellow]note:[/yellow] global batch {plan['global_batch_size']} is the profile's largest micro-batch "
            "(the profile records no global batch): give --global-batch-size for the batch you train with")


# A pipeline within this share of one device's step is "as fast", even where the plan gives no
# noise band: two predictions closer than 1% are the same figure for any decision.
AS_FAST = 0.01


def one_device_line(plan: dict[str, Any]) -> str | None:
    """The plan against the best one-device plan of the same batch, in one line (None: K = 1 or unknown).

    A pipeline pays a bubble, sends and, on one host, neighbours for its speed; whether that
    pays is a comparison with one device, which the plan records (plan version 4). Within the
    prediction's own noise band (``predicted.noise_fraction``), the two are as fast as each other.
    """
    pred = plan["predicted"]
    K = len(plan["stages"])
    if K == 1 or "one_stage_fits" not in pred:
        return None
    step, mine = pred.get("one_stage_step_s"), pred["step_s"]
    one_memory = format_bytes(pred.get("one_stage_peak_memory_bytes"))
    memory = f"{format_bytes(pred['peak_memory_bytes'])} per device on {K} stages"
    if not pred["one_stage_fits"] or step is None:
        return (f"one device does not fit: it needs {one_memory} ({memory}); "
                f"pipelining is what makes this plan possible")
    speedup = pred.get("speedup_over_one_stage") or 0.0
    noise = max(pred.get("noise_fraction") or 0.0, AS_FAST)
    times = f"{format_seconds(step)} vs {format_seconds(mine)}"
    memories = f"memory {one_memory} on one device, {memory}"
    if speedup < 1.0 - noise:
        return f"[yellow]one device is faster[/yellow]: {times}; pipelining does not pay here ({memories})"
    if speedup <= 1.0 + noise:
        return f"[yellow]one device is as fast[/yellow]: {times}; pipelining does not pay here ({memories})"
    return f"{speedup:.2f}x faster than one device ({format_seconds(mine)} vs {format_seconds(step)}; {memories})"
