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
from rich.table import Table

from ..artifacts import precision_label, precision_of
from ..schema import layers_sharing_figures, recompute_timed, slowdown_of_slowest, split_backward_timed
from ..units import format_bytes, format_seconds


def render_profile(doc: dict[str, Any], console: Console) -> None:
    """Print ``doc`` (a profile the schema accepts) on ``console``: a header, a layer table, checks."""
    sizes = doc["micro_batch_sizes"]
    layers = doc["layers"]
    console.print(_header(doc))
    column = len(sizes) - 1  # the largest micro-batch size: where the costs matter most
    table = Table(title=f"per layer at micro-batch size {sizes[column]}", title_justify="left",
                  caption="saved: activations kept for backward; output: bytes crossing the cut after the layer",
                  caption_justify="left")
    longest = max(len(layer["name"]) for layer in layers)
    for heading in ("layer", "forward", "backward", "saved", "output", "params"):
        if heading == "layer":  # names are what the user reads first: never cut them short
            table.add_column(heading, min_width=min(longest, 40), overflow="fold")
        else:
            table.add_column(heading, justify="right", no_wrap=True)
    total_f = total_b = 0.0
    total_act = total_params = 0
    for layer in layers:
        f = layer["forward_s"][column]
        b = layer["backward_s"][column]
        act = layer["activation_bytes"][column]
        total_f += f
        total_b += b
        total_act += act
        total_params += layer["param_bytes"]
        table.add_row(layer["name"], format_seconds(f), format_seconds(b), format_bytes(act),
                      format_bytes(layer["output_bytes"][column]), format_bytes(layer["param_bytes"]))
    table.add_section()
    table.add_row("total", format_seconds(total_f), format_seconds(total_b), format_bytes(total_act),
                  "", format_bytes(total_params))
    console.print(table)
    if split_backward_timed(layers):   # I (input gradient) and W (weight gradient)
        console.print(_split_table(layers, column, sizes[column], longest))
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
        console.print(CONSISTENCY_MEANING, highlight=False)
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
    link = doc.get("link")
    if link:
        console.print(f"link ({link.get('backend', '?')}): latency {format_seconds(link.get('latency_s'))}, "
                      f"bandwidth {format_rate(link.get('bandwidth_bytes_per_s'))}")
        if link.get("allreduce_processes"):
            console.print(f"all-reduce over {link['allreduce_processes']} processes (ring): latency "
                          f"{format_seconds(link.get('allreduce_latency_s'))} per step, bus bandwidth "
                          f"{format_rate(link.get('allreduce_bandwidth_bytes_per_s'))}", highlight=False)


def _fixed_costs_line(fixed: Any) -> str | None:
    """The runtime's fixed costs, as plans charge them (profile version 9; docs/planner.md)."""
    if not isinstance(fixed, dict):
        return None
    kinds = ", ".join(f"{name} {format_seconds(fixed.get(key))}" for name, key in (
        ("F", "forward_s"), ("B", "backward_s"), ("I", "backward_input_s"), ("W", "backward_weight_s")))
    runs = fixed.get("configurations") or []
    fit = ", ".join(f"{r['schedule']}{' v=' + str(r['virtual_stages']) if r['schedule'] == 'interleaved' else ''} "
                    f"{r['measured_step_s'] / r['predicted_step_s']:.2f}"
                    for r in runs if r.get("predicted_step_s"))
    return (f"fixed costs per action ({fixed.get('executor', '?')} executor, {fixed.get('backend', '?')}, "
            f"{format_seconds(fixed.get('seconds'))} to measure): {kinds}, between actions "
            f"{format_seconds(fixed.get('between_actions_s'))}; per message sent "
            f"{format_seconds(fixed.get('send_s'))}, received {format_seconds(fixed.get('receive_s'))}; plans charge "
            f"them on every action" + (f" (measured / fitted step of the runs: {fit})" if fit else ""))


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


def _split_table(layers: list[dict[str, Any]], column: int, size: int, longest: int) -> Table:
    """Per layer, the backward as zero-bubble schedules split it: I, W, and what W keeps alive."""
    table = Table(title=f"backward split in two at micro-batch size {size}", title_justify="left",
                  caption="I: input gradient (what the previous stage waits for); W: weight gradient; "
                          "kept: bytes alive from I until W", caption_justify="left")
    table.add_column("layer", min_width=min(longest, 40), overflow="fold")
    for heading in ("backward", "I", "W", "saved", "kept"):
        table.add_column(heading, justify="right", no_wrap=True)
    totals = [0.0, 0.0, 0.0, 0, 0]
    for layer in layers:
        values = [layer[key][column] for key in ("backward_s", "backward_input_s", "backward_weight_s",
                                                 "activation_bytes", "weight_kept_bytes")]
        totals = [t + v for t, v in zip(totals, values)]
        table.add_row(layer["name"], *(format_seconds(v) for v in values[:3]),
                      *(format_bytes(v) for v in values[3:]))
    table.add_section()
    table.add_row("total", *(format_seconds(v) for v in totals[:3]), *(format_bytes(v) for v in totals[3:]))
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


def _consistency(consistency: dict[str, Any], sizes: list[int]) -> Table:
    table = Table(title="consistency: sum of layers vs the whole model's step", title_justify="left")
    for heading in ("micro-batch", "sum of layers", "whole model", "ratio"):
        table.add_column(heading, justify="right")
    sums = consistency.get("layer_sum_s") or []
    steps = consistency.get("model_step_s") or []
    ratios = consistency.get("ratio") or []
    for i, size in enumerate(sizes):
        ratio = _at(ratios, i)
        shown = "-" if ratio is None else f"{ratio:.3f}"
        if ratio is not None and abs(ratio - 1) > 0.15:
            shown = f"[yellow]{shown}[/]"  # plans from this profile will be off by about as much
        table.add_row(str(size), format_seconds(_at(sums, i)), format_seconds(_at(steps, i)), shown)
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
