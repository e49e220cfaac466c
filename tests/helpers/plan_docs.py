"""Hand-made plan documents of format 5, for tests that must not depend on the solver.

Each is checked against the plan schema as it is made (as ``solve``'s own plans are before they
are written), so that a hand-made plan drifting from the format fails here."""

from __future__ import annotations

from typing import Any

from gpipe_plan.schema import FORMAT_VERSIONS, PLAN_FORMAT, check_built
from gpipe_plan.schedules import SPLIT_BACKWARD, chunks_of_stage, chunks_per_stage, stage_of_chunk


def chunked_plan(schedule: str, stages: int, virtual_stages: int = 1, micro_batches: int = 4,
                 forward_s: float = 0.01, send_s: float = 0.0) -> dict[str, Any]:
    """A plan of ``schedule`` on ``stages`` stages: one layer per chunk (``layer{c}``), every
    chunk taking ``forward_s`` forward and twice that backward (I and W half each)."""
    v = chunks_per_stage(schedule, virtual_stages)
    total = stages * v
    split = schedule in SPLIT_BACKWARD
    chunks = []
    for c in range(total):
        stage = stage_of_chunk(schedule, c, stages)
        last = c == total - 1
        crosses = not last and stage_of_chunk(schedule, c + 1, stages) != stage
        chunks.append({
            "index": c, "stage": stage, "layers": [f"layer{c}"], "first_layer": c, "recompute": False,
            "forward_s": forward_s, "backward_s": 2 * forward_s,
            "backward_input_s": forward_s if split else None, "backward_weight_s": forward_s if split else None,
            "recompute_s": 0.0, "send_s": send_s if crosses else 0.0,
        })
    doc: dict[str, Any] = {
        "format": PLAN_FORMAT, "version": FORMAT_VERSIONS[PLAN_FORMAT],
        "model": {"source": "builtin", "name": "toy", "options": {}},
        "profile": {"path": None, "sha256": None, "device": {"type": "cpu", "name": "test"}},
        "options": {"stages": stages, "schedule": schedule, "virtual_stages": v},
        "schedule": schedule, "virtual_stages": v,
        "balance": [1] * total, "micro_batches": micro_batches, "micro_batch_size": 1,
        "global_batch_size": micro_batches,
        "chunks": chunks,
        "stages": [{"index": k, "chunks": chunks_of_stage(schedule, k, stages, v), "optimizer_s": 0.0,
                    "memory_bytes": 1000, "memory": {}, "in_flight": 1, "busy_s": 0.1, "idle_fraction": 0.1}
                   for k in range(stages)],
        "predicted": {"step_s": 1.0, "bubble_fraction": 0.1, "peak_memory_bytes": 1000},
        "optimality": {"proven": True, "method": "test", "settings_searched": 1},
        "warnings": [], "runners_up": [],
    }
    check_built(doc, "solved plan", "chunked_plan")
    return doc


def as_version_4(doc: dict[str, Any]) -> dict[str, Any]:
    """The same plan as version 4 wrote it (one chunk per stage): no ``chunks``, no ``virtual_stages``,
    each stage carrying its chunk's layers and times."""
    assert doc["virtual_stages"] == 1, "version 4 had one chunk per stage"
    old = {key: value for key, value in doc.items() if key not in ("chunks", "virtual_stages")}
    old["version"] = 4
    old["stages"] = []
    for stage, chunk in zip(doc["stages"], doc["chunks"]):
        merged = {**{k: v for k, v in stage.items() if k != "chunks"},
                  **{k: v for k, v in chunk.items() if k not in ("stage", "backward_input_s", "backward_weight_s")}}
        old["stages"].append(merged)
    check_built(old, "solved plan", "as_version_4")
    return old
