"""Show a plan on the terminal (rich) and redraw its timeline, from the plan document alone."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from ..artifacts import precision_label
from .schedule import Timeline, simulate_times
from .timeline import timeline_svg
from .units import format_bytes, format_seconds


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
             f"bubble {pred['bubble_fraction']:.1%}")
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
        f"[bold]{name}[/bold] on {K} stage{'s' if K > 1 else ''} "
        f"(profile: {device.get('type', '?')}, {device.get('name', '?')}; "
        f"{precision_label(plan.get('precision', 'fp32'), plan.get('param_dtype', 'fp32'))})")
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
            mem, f"{st.get('idle_fraction', 0.0):.1%}",
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
        f"bubble {pred['bubble_fraction']:.1%}, "
        + (f"throughput {samples:,.1f} samples/s" if samples else "throughput not defined (a zero step time)"),
        highlight=False)
    opt = plan.get("optimality", {})
    if opt.get("proven"):
        searched = opt.get("settings_searched")
        console.print(f"[green]proven optimal[/green] over {searched} settings of M and schedule"
                      if searched else "[green]proven optimal[/green]", f"({opt.get('method')})", highlight=False)
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
            versus = f"+{r['step_s'] / pred['step_s'] - 1:.1%}" if pred["step_s"] > 0 else "-"
            rt.add_row(str(r["micro_batches"]), str(r["micro_batch_size"]), r["schedule"],
                       format_seconds(r["step_s"]), versus,
                       f"{r['bubble_fraction']:.1%}", format_bytes(r["peak_memory_bytes"]),
                       " ".join(map(str, r.get("balance", []))))
        console.print(rt)
    for w in plan.get("warnings") or []:
        console.print(f"[yellow]warning:[/yellow] {w}")
