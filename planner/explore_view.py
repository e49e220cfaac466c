"""Show an exploration: GPipe-paper style tables, JSON rows, and a throughput chart (SVG).

A table, and a line of the chart, is one schedule and one recomputation policy, across K
and M. Interleaved cells say which chunks per stage (``v=2``) their best plan took. An
exploration of N devices (``--devices``) has a row per factorisation K x d = N (d replicas
of a K-stage pipeline) and, first, a table of each factorisation's best plan.
"""

from __future__ import annotations

from html import escape
from typing import Any

from rich.console import Console

from ..schedules import label as schedule_label
from .explore import Cell, Exploration
from ..tables import narrow_table
from ..units import BYTE_UNITS, TIME_UNITS, column_unit, format_bytes, format_figure, format_percent

PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


def distinct_colours(n: int) -> list[str]:
    """``n`` colours, no two alike: the palette while it lasts, else hues evenly round the wheel.

    Cycling a short palette gave two lines of one chart the same colour, and a reader took
    them for one setting.
    """
    if n <= len(PALETTE):
        return PALETTE[:n]
    return [f"hsl({round(360 * i / n)}, 65%, 42%)" for i in range(n)]


def series_label(c: Cell) -> str:
    """One line of the chart: a K (and d, with replicas), schedule and recompute setting across M."""
    replicas = f" d={c.data_parallel}" if c.data_parallel > 1 else ""
    return f"K={c.stages}{replicas} {c.schedule} rc={c.recompute}"


def shape_label(stages: int, data_parallel: int) -> str:
    """``4x2``: 4 stages times 2 replicas."""
    return f"{stages}x{data_parallel}"


def never_fitting(ex: Exploration) -> dict[str, str]:
    """The settings (chart lines) that fit at no M, each with why: the chart has no point for them.

    Without saying so a chart silently drops them, and a reader cannot tell a setting that
    never fits from one that was not asked for.
    """
    by_label: dict[str, list[Cell]] = {}
    for c in ex.cells:
        by_label.setdefault(series_label(c), []).append(c)
    out = {}
    for label, cells in by_label.items():
        if any(c.fits and c.normalized_throughput is not None for c in cells):
            continue
        over = any(c.step_s is not None for c in cells)   # a plan exists, only not within the limit
        out[label] = "over the memory limit at every M" if over else (cells[0].note or "no plan")
    return out


def never_fitting_line(never: dict[str, str]) -> str:
    """``over the memory limit at every M: K=1 gpipe rc=never, K=2 ...; ...``: grouped by why."""
    groups: dict[str, list[str]] = {}
    for label, why in never.items():
        groups.setdefault(why, []).append(label)
    return "; ".join(f"{why}: {', '.join(labels)}" for why, labels in groups.items())


def render_exploration(ex: Exploration, console: Console, memory_limit_bytes: int | None) -> None:
    replicas = ex.devices is not None
    rows = sorted({(c.stages, c.data_parallel) for c in ex.cells}, key=lambda kd: (kd[0], kd[1]))
    ms = sorted({c.micro_batches for c in ex.cells})
    combos = []
    for c in ex.cells:
        if (c.schedule, c.recompute) not in combos:
            combos.append((c.schedule, c.recompute))
    lookup = {(c.stages, c.data_parallel, c.micro_batches, c.schedule, c.recompute): c for c in ex.cells}
    console.print(f"global batch {ex.global_batch_size}; throughput normalised to one device with one "
                  f"micro-batch (K = 1, M = 1, gpipe, no recomputation): "
                  f"{ex.global_batch_size / ex.reference_step_s:,.1f} samples/s", highlight=False)
    if replicas:
        render_factorisations(ex, console)
    for schedule, recompute in combos:
        cells = [c for c in ex.cells if (c.schedule, c.recompute) == (schedule, recompute)]
        unit, size = column_unit((c.peak_memory_bytes for c in cells if c.step_s is not None), BYTE_UNITS)
        table = narrow_table(f"{schedule}, recompute {recompute}: normalised throughput, and under it the bubble "
                             f"and peak {unit} per device", ("K x d \\ M" if replicas else "K \\ M", *map(str, ms)))
        for K, d in rows:
            row = [shape_label(K, d) if replicas else str(K)]
            for M in ms:
                c = lookup.get((K, d, M, schedule, recompute))
                if c is None or c.step_s is None:
                    row.append("[dim]-[/dim]")
                    continue
                shape = schedule_label(schedule, c.virtual_stages)[len(schedule):]   # " v=2": its chunks per stage
                text = (f"{c.normalized_throughput:.2f}{'' if c.proven else '*'}{shape}\n"
                        f"{format_percent(c.bubble_fraction)} {format_figure(c.peak_memory_bytes, size)}")
                row.append(text if c.fits else f"[red]{text}\nover[/red]")
            table.add_row(*row)
        console.print(table)
    if any(not c.proven for c in ex.cells if c.step_s is not None):
        console.print("* search stopped at its time budget: the best plan found, not proven optimal")
    if memory_limit_bytes:
        console.print(f"cells marked over (red) exceed the memory limit of {format_bytes(memory_limit_bytes)} per "
                      "device (shown: their best plan without the limit)")
    never = never_fitting(ex)
    if never:
        console.print(f"settings with no line in the chart, {never_fitting_line(never)}", highlight=False)
    if replicas:
        # How many blocks fit K devices is a one-replica question (explore without --devices).
        return
    if ex.block is None:
        console.print("capacity: no repeated block found in this profile")
    elif ex.capacity:
        b = ex.block
        table = narrow_table(f"capacity: copies of the repeated block ({', '.join(b['names'])}; "
                             f"{b['blocks']} in the profile) that fit {format_bytes(memory_limit_bytes)} per device",
                             ("K", "recompute", "blocks", "parameters", "with"), left=("recompute", "with"))
        for cap in ex.capacity:
            table.add_row(str(cap.stages), cap.recompute, f"{cap.blocks:,}",
                          f"{cap.parameters / 1e6:,.1f} M ({format_bytes(cap.param_bytes)})", cap.setting)
        console.print(table)
    elif not memory_limit_bytes:
        console.print("capacity: give --memory-limit to see how many blocks fit")


def render_factorisations(ex: Exploration, console: Console) -> None:
    """The --devices summary: per K x d (best first) its best plan that fits, or why none does."""
    found = [f.best for f in ex.factorisations if f.best is not None]
    unit, size = column_unit((c.step_s for c in found), TIME_UNITS)
    memory_unit, memory_size = column_unit((c.peak_memory_bytes for c in found), BYTE_UNITS)
    table = narrow_table(f"{ex.devices} devices as K stages x d replicas: the best plan of each that fits "
                         f"(samples/s: x one device; sync: the slowest stage's gradient sync)",
                         ("K x d", "best plan that fits", f"step {unit}", "samples/s", f"sync {unit}",
                          f"peak {memory_unit}", "fit"), left=("K x d", "best plan that fits"),
                         wrap=("best plan that fits",))
    for f in ex.factorisations:
        c = f.best
        if c is None:
            table.add_row(shape_label(f.stages, f.data_parallel), f"[red]{f.reason}[/red]", "-", "-", "-", "-",
                          f"0/{f.cells}")
            continue
        plan = f"M={c.micro_batches} {schedule_label(c.schedule, c.virtual_stages)} rc={c.recompute}"
        if c.order and c.data_parallel > 1 and c.stages > 1:
            plan += f" {c.order}"             # the order matters only with both stages and replicas
        table.add_row(shape_label(f.stages, f.data_parallel), plan,
                      f"{format_figure(c.step_s, size)}{'' if c.proven else '*'}",
                      f"{c.throughput_per_s:,.1f} ({c.normalized_throughput:.2f}x)",
                      format_figure(c.slowest_stage_gradient_sync_s or 0.0, size),
                      format_figure(c.peak_memory_bytes, memory_size), f"{f.fitting_cells}/{f.cells}")
    console.print(table)


def exploration_json(ex: Exploration) -> dict[str, Any]:
    """The exploration as JSON (docs/planner.md, "What-if tables"). Version 2 added the replica
    keys: ``devices``, ``factorisations`` and each row's ``data_parallel``, ``order`` and
    ``slowest_stage_gradient_sync_s`` (a version-1 reader's keys are all still there)."""
    return {
        "format": "gpipe-plan.exploration",
        "version": 2,
        "global_batch_size": ex.global_batch_size,
        "reference_step_s": ex.reference_step_s,
        "devices": ex.devices,
        "rows": [c.row() for c in ex.cells],
        "factorisations": [f.row() for f in ex.factorisations],
        "repeated_block": ex.block,
        "capacity": [c.row() for c in ex.capacity],
    }


def exploration_chart(ex: Exploration, width: int = 720, height: int = 420) -> str:
    """Normalised throughput against M (log scale), one line per K and schedule/recompute."""
    import math

    ms = sorted({c.micro_batches for c in ex.cells})
    series: dict[str, list[tuple[int, float]]] = {}
    for c in ex.cells:
        if c.normalized_throughput is not None and c.fits:
            series.setdefault(series_label(c), []).append((c.micro_batches, c.normalized_throughput))
    never = never_fitting(ex)
    top = max((y for pts in series.values() for _, y in pts), default=1.0) * 1.1
    left, right, up, down = 60, 190, 30, 50
    plot_h = height - up - down
    # Room for every legend entry beside the plot, and a line per setting that never fits below both.
    below = max(height, up + 14 * len(series) + 10)
    height = below + (14 * (len(never) + 1) + 10 if never else 0)
    plot_w = width - left - right
    span = math.log2(max(ms)) - math.log2(min(ms)) or 1.0

    def x(m: int) -> float:
        return left + (math.log2(m) - math.log2(min(ms))) / span * plot_w

    def y(v: float) -> float:
        return up + plot_h - v / top * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13" font-weight="bold">Predicted throughput vs micro-batches '
           f'(normalised to K=1, M=1)</text>',
           f'<line x1="{left}" y1="{up + plot_h}" x2="{left + plot_w}" y2="{up + plot_h}" stroke="#333"/>',
           f'<line x1="{left}" y1="{up}" x2="{left}" y2="{up + plot_h}" stroke="#333"/>']
    for m in ms:
        out.append(f'<text x="{x(m):.1f}" y="{up + plot_h + 16}" text-anchor="middle">{m}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{up + plot_h + 36}" text-anchor="middle">micro-batches M</text>')
    for i in range(6):
        v = top * i / 5
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>')
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + plot_w}" y2="{y(v):.1f}" stroke="#eee"/>')
    colours = distinct_colours(len(series))
    for i, (label, pts) in enumerate(sorted(series.items())):
        colour = colours[i]
        dash = "" if "never" in label else ' stroke-dasharray="5,3"'
        path = " ".join(f"{'M' if j == 0 else 'L'}{x(m):.1f},{y(v):.1f}" for j, (m, v) in enumerate(sorted(pts)))
        out.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        ly = up + 14 * i
        out.append(f'<line x1="{left + plot_w + 10}" y1="{ly}" x2="{left + plot_w + 30}" y2="{ly}" '
                   f'stroke="{colour}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{left + plot_w + 34}" y="{ly + 4}">{escape(label)}</text>')
    if never:
        y0 = below + 4
        out.append(f'<text x="{left}" y="{y0}" font-weight="bold">not drawn: these settings fit at no M</text>')
        for j, (label, why) in enumerate(never.items()):
            out.append(f'<text x="{left}" y="{y0 + 14 * (j + 1)}" class="never">{escape(label)}: {escape(why)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
