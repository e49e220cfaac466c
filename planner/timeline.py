"""Draw a schedule as an SVG timeline: one row per stage, time to the right.

The picture is the event simulator's own record of the step (:func:`planner.simulator.simulate_plan`),
so what a user sees is exactly what the planner predicted: forwards, backwards (or, in the
zero-bubble schedules, the input gradient I and the weight gradient W, each its own colour:
W filling the gaps is the point of those schedules), the recomputed forwards inside
backwards, sends on the links, the optimizer step, and the white gaps between them, which
are the bubble. A stage that holds several chunks (interleaved, zb-v) labels each box with
its action as the schedule CSV writes it: ``2F0`` is chunk 2's forward of micro-batch 0.
"""

from __future__ import annotations

from html import escape
from typing import Sequence

from .simulator import Event, Timeline

COLOURS = {
    "forward": "#4C78A8",
    "backward": "#54A24B",
    "backward_input": "#2E7D32",
    "backward_weight": "#E3B505",
    "recompute": "#F58518",
    "send": "#9D9D9D",
    "optimizer": "#B279A2",
}
# What the legend calls each kind of box.
LEGEND = {"backward_input": "input grad (I)", "backward_weight": "weight grad (W)"}
# The letter the schedule CSV writes for each kind of work (gpipe_plan/schedules.py).
ACTION_LETTER = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
CHAR_WIDTH = 7           # about the width of a digit or capital at this font size, in pixels
ROW_HEIGHT = 34
LINK_HEIGHT = 8
LEFT = 130
# Room right of the time axis: its last label ("33.35 ms") is centred on the axis's end, and
# half of it would fall outside the picture with less.
RIGHT = 60
WIDTH = 1100


def timeline_svg(timeline: Timeline, title: str, stage_labels: Sequence[str] | None = None) -> str:
    events = timeline.events
    K = 1 + max((e.stage for e in events), default=0)
    span = max(timeline.step_s, max((e.end_s for e in events), default=0.0)) or 1.0
    scale = (WIDTH - LEFT - RIGHT) / span
    top = 48
    height = top + K * (ROW_HEIGHT + LINK_HEIGHT + 6) + 60
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]

    def row_y(stage: int) -> float:
        return top + stage * (ROW_HEIGHT + LINK_HEIGHT + 6)

    for k in range(K):
        y = row_y(k)
        label = stage_labels[k] if stage_labels and k < len(stage_labels) else f"stage {k}"
        out.append(f'<rect x="{LEFT}" y="{y}" width="{span * scale:.2f}" height="{ROW_HEIGHT}" '
                   f'fill="#f4f4f4" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 8}" y="{y + ROW_HEIGHT / 2 + 4}" text-anchor="end">{escape(label)}</text>')
    chunks_on = [set() for _ in range(K)]
    for ev in events:
        if ev.chunk >= 0 and ev.kind in ACTION_LETTER:
            chunks_on[ev.stage].add(ev.chunk)
    for ev in events:
        out.append(_rect(ev, row_y, scale, several_chunks=len(chunks_on[ev.stage]) > 1))
    # time axis
    axis_y = row_y(K) + 4
    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{LEFT + span * scale:.2f}" y2="{axis_y}" stroke="#333"/>')
    for i in range(6):
        t = span * i / 5
        x = LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="#333"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 16}" text-anchor="middle">{_time(t)}</text>')
    # legend: the kinds of box this picture has
    x = LEFT
    legend_y = axis_y + 34
    drawn = {ev.kind for ev in events}
    for kind, colour in COLOURS.items():
        if kind not in drawn:
            continue
        out.append(f'<rect x="{x}" y="{legend_y - 9}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16}" y="{legend_y + 1}">{LEGEND.get(kind, kind)}</text>')
        x += 110
    out.append(f'<rect x="{x}" y="{legend_y - 9}" width="12" height="12" fill="#f4f4f4" stroke="#ddd"/>')
    out.append(f'<text x="{x + 16}" y="{legend_y + 1}">idle (bubble)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _rect(ev: Event, row_y, scale: float, several_chunks: bool) -> str:
    x = LEFT + ev.start_s * scale
    w = max(0.5, (ev.end_s - ev.start_s) * scale)
    colour = COLOURS.get(ev.kind, "#000")
    if ev.kind == "send":
        y = row_y(ev.stage) + ROW_HEIGHT + 2
        h = LINK_HEIGHT
    else:
        y = row_y(ev.stage)
        h = ROW_HEIGHT
    tip = f"{ev.kind} micro-batch {ev.micro_batch}" if ev.micro_batch >= 0 else ev.kind
    if ev.chunk >= 0 and ev.kind != "optimizer":
        tip += f", chunk {ev.chunk}"
    body = (f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h}" fill="{colour}" stroke="white" '
            f'stroke-width="0.5"><title>{escape(tip)}: {_time(ev.start_s)} to {_time(ev.end_s)}</title></rect>')
    if ev.kind in ACTION_LETTER and ev.micro_batch >= 0:
        # Where a stage holds several chunks the box says which, as the CSV writes the action
        # ("2F0"), or, too narrow for that, the chunk alone; else the micro-batch.
        labels = ([f"{ev.chunk}{ACTION_LETTER[ev.kind]}{ev.micro_batch}", f"{ev.chunk}"] if several_chunks
                  else [str(ev.micro_batch)])
        fitting = [text for text in labels if w > CHAR_WIDTH * len(text) + 2]
        if fitting:
            ink = "black" if ev.kind == "backward_weight" else "white"   # legible on the light yellow
            body += (f'<text x="{x + w / 2:.2f}" y="{y + h / 2 + 4:.2f}" text-anchor="middle" fill="{ink}">'
                     f'{fitting[0]}</text>')
    return body


def _time(t: float) -> str:
    """A moment of the step as the axis and tooltips print it; its start is plain ``0`` (any unit)."""
    if t == 0:
        return "0"
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} µs"
