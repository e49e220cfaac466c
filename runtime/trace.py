"""A Chrome trace of the run: every stage's forwards and backwards on one timeline.

The Trace Event Format (``{"traceEvents": [...]}``) opens in https://ui.perfetto.dev and in
``chrome://tracing``. Each stage is a process row; each span a complete event (``"ph": "X"``)
named as the schedule's CSV names its action, ``{chunk}{kind}{micro-batch}``: ``2F3`` (forward
of micro-batch 3 on chunk 2), ``2B3`` (its backward), or, under a split backward, ``2I3`` (the
input gradient) and ``2W3`` (the weight gradient) as two spans of their own; besides them
``optimizer``, ``wait`` (blocked on a neighbour's activations or gradients, ``wait 2``: for
chunk 2), ``data`` (drawing the step's batch) and ``sync`` (learning the step's loss from the
stage holding the last chunk) and, with several replicas, ``gradient_sync`` (averaging the
stage's gradients over its replicas; each rank a row then, named by stage and replica), with
the step, chunk and micro-batch in its ``args``. Timestamps are microseconds since the ranks'
common origin (see :mod:`.timing`). In the picture the pipeline's diagonal fill,
the drain, and the bubbles the planner predicted are plain to see.
"""

from __future__ import annotations

from typing import Any

from .timing import Span

_COLOR = {"forward": "thread_state_running", "backward": "rail_response", "backward_input": "rail_response",
          "backward_weight": "rail_animation", "optimizer": "good", "wait": "thread_state_sleeping",
          "data": "thread_state_iowait", "sync": "thread_state_sleeping", "gradient_sync": "rail_load"}

# The action letter of each span kind (gpipe_plan.schedules: F, B, I, W).
_LETTER = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}


def span_name(span: Span) -> str:
    """``2F3`` for an action (``F3`` when the span names no chunk); the kind for the others."""
    letter = _LETTER.get(span.kind)
    if letter is not None:
        return f"{span.chunk if span.chunk >= 0 else ''}{letter}{span.micro_batch}"
    if span.kind == "wait" and span.chunk >= 0:
        return f"wait {span.chunk}"
    return span.kind


def chrome_trace(spans_by_stage: list[list[Span]], metadata: dict[str, Any],
                 row_names: list[str] | None = None) -> dict[str, Any]:
    """The trace document for the spans of every stage (stage k's list at index k); with data
    parallel, of every rank (rank k's list at index k, its row named by ``row_names[k]``)."""
    events: list[dict[str, Any]] = []
    for k, spans in enumerate(spans_by_stage):
        name = row_names[k] if row_names is not None else f"stage {k}"
        events.append({"name": "process_name", "ph": "M", "pid": k, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": k, "args": {"sort_index": k}})
        for span in spans:
            events.append({
                "name": span_name(span),
                "cat": span.kind,
                "ph": "X",
                "pid": k,
                "tid": 0,
                "ts": round(span.start_s * 1e6, 3),
                "dur": round(span.duration_s * 1e6, 3),
                "cname": _COLOR.get(span.kind, "generic_work"),
                "args": {"step": span.step, "chunk": span.chunk, "micro_batch": span.micro_batch},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}
