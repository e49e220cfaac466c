"""Pretty-print a profile: what was measured, per layer, and how far the sum can be trusted.

Used at the end of ``gpipe-plan profile`` and by ``gpipe-plan show profile.json``. Reads only
the JSON document, never torch, so that showing a profile starts instantly.

It takes a profile its schema has accepted (gpipe_plan/schema.py: every writer checks what it
writes, ``show`` what it reads), so it indexes the keys the schema requires and ``.get``s only
the optional ones. Whether a profile has a measurement an older or imported one lacks (the
split backward, the recompute timings, shared figures) it asks gpipe_plan/schema.py, which
the planner asks too: one answer for both.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console

from ..artifacts import precision_label, precision_of
from ..hostload import busy_phases, busy_profile_text
from ..schedules import label
from ..schema import layers_sharing_figures, recompute_timed, slowdown_of_slowest, split_backward_timed
from ..layer_names import LayerNames
from ..tables import NarrowTable, narrow_table
from ..units import BYTE_UNITS, TIME_UNITS, column_unit, format_figure, format_seconds


def render_profile(doc: dict[str, Any], console: Console) -> None:
    """Print ``doc`` (a profile the schema accepts) on ``console``: a header, a layer table, checks."""
    sizes = doc["micro_batch_sizes"]
    layers = doc["layers"]
    console.print(_header(doc))
    column = len(sizes) - 1  # the largest micro-batch size: where the costs matter most
    naming = LayerNames(layer["name"] for layer in layers)
    figures = [[layer["forward_s"][column], layer["backward_s"][column], layer["activation_bytes"][column],
                layer["output_bytes"][column], layer["param_bytes"]] for layer in layers]
    totals = [sum(row[i] for row in figures) for i in range(5)]
    console.print(figure_table(
        f"per layer at micro-batch size {sizes[column]} (saved: activations kept for backward; output: bytes "
        "crossing the cut after the layer)",
        [("forward", "s"), ("backward", "s"), ("saved", "B"), ("output", "B"), ("params", "B")],
        [naming.short(layer["name"]) for layer in layers], figures, totals[:3] + [None, totals[4]], naming.note()))
    if split_backward_timed(layers):   # I (input gradient) and W (weight gradient)
        console.print(_split_table(layers, column, sizes[column], naming))
        console.print(_split_line(layers, sizes), highlight=False)
    sharing = _sharing_line(layers)
    if sharing:
        console.print(sharing, highlight=False)
    built_whole = (doc.get("measurement") or {}).get("built_whole")
    if built_whole:
        console.print(f"[yellow]built whole[/], every parameter in memory at once: {built_whole}", highlight=False)
    consistency = doc.get("consistency")
    if consistency:
        console.print(_consistency(consistency, sizes))
    contention = doc.get("contention")
    if contention:
        # A pipeline goes at its slowest stage's pace: newer profiles take the slowest process.
        who = "the slowest one's step" if slowdown_of_slowest(contention) else "a step"
        console.print(f"neighbours: with {contention['processes']} processes computing at once, {who} at "
                      f"micro-batch {contention.get('micro_batch_size')} takes "
                      f"{contention['slowdown']:.2f}x its time alone (measured "
                      f"{', '.join(f'{r:.2f}' for r in contention.get('cycle_ratios', []))}); plans with K > 1 "
                      "charge it", highlight=False)
    recompute = _recompute_line(doc, layers, sizes)
    if recompute:
        console.print(recompute, highlight=False)
    fixed = _fixed_costs_line(doc.get("fixed_costs"))
    if fixed:
        console.print(fixed, highlight=False)
    shared = _shared_cores_line(doc.get("fixed_costs"))
    if shared:
        console.print(shared, highlight=False)
    busy = _host_load_line(doc.get("host_load"))
    if busy:
        console.print(busy, highlight=False)
    speed = _host_speed_line((doc.get("measurement") or {}).get("host_speed"))
    if speed:
        console.print(speed, highlight=False)
    link = doc.get("link")
    if link:
        console.print(f"link ({link.get('backend', '?')}): latency {format_seconds(link.get('latency_s'))}, "
                      f"bandwidth {format_rate(link.get('bandwidth_bytes_per_s'))}")
        if link.get("allreduce_processes"):
            console.print(f"all-reduce over {link['allreduce_processes']} processes (ring): latency "
                          f"{format_seconds(link.get('allreduce_latency_s'))} per step, bus bandwidth "
                          f"{format_rate(link.get('allreduce_bandwidth_bytes_per_s'))}", highlight=False)


def _host_load_line(load: Any) -> str | None:
    """What else ran on the host while the profile measured (version 9), when it took from it."""
    busy = busy_phases(load if isinstance(load, dict) else None)
    if not busy:
        return None
    return f"[yellow]busy host[/]: {busy_profile_text(busy)}; plans from this profile say so"


def _host_speed_line(host_speed: Any) -> str | None:
    """How slow the host ran while the layers were timed, where they were timed again or the
    kept try was slow (version 13; [Note: layers timed at the host's own speed])."""
    from ..speedprobe import STEADY

    tries = host_speed.get("layer_tries") if isinstance(host_speed, dict) else None
    if not tries or (len(tries) == 1 and tries[0] <= 1 + STEADY):
        return None
    kept = min(tries)
    head = "[yellow]slow host[/]" if kept > 1 + STEADY else "host speed"
    return (f"{head}: the layers were timed {len(tries)} time{'s' if len(tries) != 1 else ''}, the speed probe around "
            f"them {', '.join(f'{t:.2f}' for t in tries)}x the host's own "
            f"{format_seconds(host_speed.get('fastest_probe_s'))}; the least slow ({kept:.2f}x) kept"
            + ("; plans from this profile say so" if kept > 1 + STEADY else ""))


def _fixed_costs_line(fixed: Any) -> str | None:
    """The runtime's fixed costs, as plans charge them (profile version 9; docs/planner.md)."""
    if not isinstance(fixed, dict):
        return None
    kinds = ", ".join(f"{name} {format_seconds(fixed.get(key))}" for name, key in (
        ("F", "forward_s"), ("B", "backward_s"), ("I", "backward_input_s"), ("W", "backward_weight_s")))
    runs = fixed.get("configurations") or []
    fit = ", ".join(f"{label(r['schedule'], r.get('virtual_stages', 1))} {r['measured_step_s'] / r['predicted_step_s']:.2f}"
                    for r in runs if r.get("predicted_step_s"))
    sizes = [e for e in fixed.get("per_micro_batch_size") or [] if isinstance(e, dict)]
    others = "; ".join(f"at {e.get('micro_batch_size')}: F {format_seconds(e.get('forward_s'))}, "
                       f"B {format_seconds(e.get('backward_s'))}, sent {format_seconds(e.get('send_s'))}, "
                       f"received {format_seconds(e.get('receive_s'))}"
                       for e in sizes if e.get("micro_batch_size") != fixed.get("micro_batch_size"))
    return (f"fixed costs per action ({fixed.get('executor', '?')} executor, {fixed.get('backend', '?')}, "
            f"{format_seconds(fixed.get('seconds'))} to measure), at micro-batch {fixed.get('micro_batch_size', '?')}: "
            f"{kinds}, between actions "
            f"{format_seconds(fixed.get('between_actions_s'))}; per message sent "
            f"{format_seconds(fixed.get('send_s'))}, received {format_seconds(fixed.get('receive_s'))}"
            + (f" ({others})" if others else "")
            + ("; plans charge those at their micro-batch size on every action" if sizes
               else "; plans charge them on every action")
            + (f" (measured / fitted step of the runs: {fit})" if fit else "")
            + (f"; the optimizer step {fixed['optimizer_scale']:.2f}x the layers' figures in the pipeline "
               f"(plans charge it so)" if isinstance(fixed.get("optimizer_scale"), (int, float)) else ""))


def _shared_cores_line(fixed: Any) -> str | None:
    """How much slower ranks ran where they shared the host's cores (profile version 10)."""
    shared = fixed.get("shared_cores") if isinstance(fixed, dict) else None
    if not isinstance(shared, dict):
        return None
    fit = ", ".join(f"{r['schedule']} {r['measured_step_s'] / r['predicted_step_s']:.2f}"
                    for r in shared.get("configurations") or [] if r.get("predicted_step_s"))
    at_once = shared.get("concurrent_ranks")
    return (f"shared cores: {shared.get('processes')} processes where the host runs "
            f"{'?' if at_once is None else format(at_once, 'g')} at once ({format_seconds(shared.get('seconds'))} to measure): "
            f"every action {shared['slowdown']:.2f}x its time on a core of its own plus "
            f"{format_seconds(shared.get('per_action_s') or 0.0)}; plans of more ranks than cores charge them"
            + (f" (measured / fitted step: {fit})" if fit else ""))


def _sharing_line(layers: list[dict[str, Any]]) -> str | None:
    """How many layers were measured and how many took another's figures (None: not recorded)."""
    shared = layers_sharing_figures(layers)
    if shared is None:
        return None
    if not shared:
        return f"measured all {len(layers)} layers (none alike)"
    return f"measured {len(layers) - shared} distinct layers of {len(layers)}; {shared} share their figures"


def _recompute_line(doc: dict[str, Any], layers: list[dict[str, Any]], sizes: list[int]) -> str | None:
    """What recomputation costs over the plain passes, whole model, at each size (None: not timed)."""
    if not recompute_timed(doc):
        return None
    calls = doc["recompute_call_s"]
    parts = []
    for i, size in enumerate(sizes):
        plain = sum(l["forward_s"][i] + l["backward_s"][i] for l in layers)
        checkpointed = sum(l["recompute_forward_s"][i] + l["recompute_backward_s"][i] for l in layers) + calls[i]
        if plain > 0:
            parts.append(f"{checkpointed / plain:.2f}x at {size}")
    return (f"recomputation: the whole model under checkpointing takes {', '.join(parts)} its plain forward+backward "
            f"(one checkpoint call: {format_seconds(calls[-1])}); plans that recompute charge it")


def _split_table(layers: list[dict[str, Any]], column: int, size: int, naming: LayerNames) -> NarrowTable:
    """Per layer, the backward as zero-bubble schedules split it: I, W, and what W keeps alive."""
    keys = ("backward_s", "backward_input_s", "backward_weight_s", "activation_bytes", "weight_kept_bytes")
    figures = [[layer[key][column] for key in keys] for layer in layers]
    return figure_table(
        f"backward split in two at micro-batch size {size} (I: input gradient, what the previous stage waits "
        "for; W: weight gradient; kept: bytes alive from I until W)",
        [("backward", "s"), ("I", "s"), ("W", "s"), ("saved", "B"), ("kept", "B")],
        [naming.short(layer["name"]) for layer in layers], figures,
        [sum(row[i] for row in figures) for i in range(len(keys))], naming.note())


def figure_table(title: str, columns: list[tuple[str, str]], names: list[str], rows: list[list[float]],
                 totals: list[float | None], note: str | None) -> NarrowTable:
    """A row of figures per layer and their total: each column a time (``"s"``) or a size
    (``"B"``), printed in the unit of its largest figure, named in its heading."""
    units = [column_unit([row[i] for row in rows] + [totals[i]], TIME_UNITS if kind == "s" else BYTE_UNITS)
             for i, (_, kind) in enumerate(columns)]
    table = narrow_table(title, ("layer", *(f"{name} {unit}" for (name, _), (unit, _) in zip(columns, units))),
                         left=("layer",))
    for name, row in zip(names, rows):
        table.add_row(name, *(format_figure(v, unit_size) for v, (_, unit_size) in zip(row, units)))
    table.add_section()
    table.add_row("total", *("" if v is None else format_figure(v, unit_size) for v, (_, unit_size) in zip(totals, units)))
    table.note = note
    return table


def _split_line(layers: list[dict[str, Any]], sizes: list[int]) -> str:
    """What splitting the backward costs in time and keeps in memory, whole model, per size (version 7)."""
    times, kept = [], []
    for i, size in enumerate(sizes):
        plain = sum(l["backward_s"][i] for l in layers)
        split = sum(l["backward_input_s"][i] + l["backward_weight_s"][i] for l in layers)
        saved = sum(l["activation_bytes"][i] for l in layers)
        if plain > 0:
            times.append(f"{split / plain:.2f}x at {size}")
        if saved > 0:
            kept.append(f"{sum(l['weight_kept_bytes'][i] for l in layers) / saved:.2f}x at {size}")
    return (f"split backward: I + W take {', '.join(times) or '-'} the plain backward; between them a micro-batch "
            f"keeps {', '.join(kept) or '-'} its saved activations; zero-bubble plans (zb-h1, zb-v) charge both")


def _header(doc: dict[str, Any]) -> str:
    model = doc["model"]
    device = doc["device"]
    what = model.get("name") or model.get("factory") or "?"
    options = model.get("options")
    if options:
        what += " (" + ", ".join(f"{k}={_compact(v)}" for k, v in options.items()) + ")"
    where = f"{device.get('type', '?')}: {device.get('name', '?')}"
    if device.get("threads"):
        where += f", {device['threads']} thread{'s' if device['threads'] != 1 else ''}"
    sizes = ", ".join(str(s) for s in doc["micro_batch_sizes"])
    precision = precision_label(*precision_of(doc, "profile"))
    lines = [f"[bold]profile[/] of {what}", f"  device          {where}", f"  micro-batches   {sizes}",
             f"  precision       {precision}"]
    if isinstance(doc.get("global_batch_size"), int):
        lines.append(f"  global batch    {doc['global_batch_size']} (what solve and explore plan for by default)")
    measurement = doc.get("measurement")
    if measurement:
        lines.append(f"  timing          {measurement.get('statistic', 'median')} of {measurement.get('repeats')} "
                     f"after {measurement.get('warmup')} warm-up ({measurement.get('timer')})")
    return "\n".join(lines)


# What the ratio says, printed under it: a user meets it in the profile's summary, not the docs.
CONSISTENCY_MEANING = ("ratio: the sum of the per-layer times over the whole model's step; near 1 means the "
                       "per-layer figures add up, and plans from them hold")


def _consistency(consistency: dict[str, Any], sizes: list[int]) -> NarrowTable:
    sums = consistency.get("layer_sum_s") or []
    steps = consistency.get("model_step_s") or []
    ratios = consistency.get("ratio") or []
    unit, size = column_unit([_at(sums, i) for i in range(len(sizes))] + [_at(steps, i) for i in range(len(sizes))],
                             TIME_UNITS)
    table = narrow_table("consistency: sum of layers vs the whole model's step",
                         ("micro-batch", f"sum of layers {unit}", f"whole model {unit}", "ratio"))
    for i, micro_batch in enumerate(sizes):
        ratio = _at(ratios, i)
        shown = "-" if ratio is None else f"{ratio:.3f}"
        if ratio is not None and abs(ratio - 1) > 0.15:
            shown = f"[yellow]{shown}[/]"  # plans from this profile will be off by about as much
        table.add_row(str(micro_batch), format_figure(_at(sums, i), size), format_figure(_at(steps, i), size), shown)
    table.note = CONSISTENCY_MEANING
    return table


def _at(values: Any, index: int) -> Any:
    if isinstance(values, list) and 0 <= index < len(values):
        return values[index]
    return None


def _compact(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def format_rate(bytes_per_s: float | None) -> str:
    if bytes_per_s is None or not math.isfinite(bytes_per_s):
        return "unlimited"
    return f"{bytes_per_s / 1e9:.2f} GB/s"
