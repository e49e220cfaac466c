"""A plan written by hand: a given split and schedule, no predictions (a helper of the tests).

``gpipe-plan solve`` makes plans from profiles. Tests that must not depend on timing, and the
benchmarks that run a split of their own choosing (a torchgpipe ``balance``), need the same
document (docs/plan-format.md) for a split they choose: this writes it, with the predictions
left out, so that ``run`` reports measured figures only. ``balance`` counts the layers of each
chunk, in pipeline order; the schedule places the chunks on stages (``gpipe_plan.schedules``).

It lives with the tests, not in the package: a user's plans come from ``solve``. The tests
import it as ``helpers.handplan`` (tests/ is on their path), the benchmarks as
``tests.helpers.handplan`` (they run from the repository's root). What it writes is
checked against the plan schema (``gpipe_plan.schema``) before it is returned.
"""

from __future__ import annotations

from typing import Any, Sequence

from gpipe_plan.models import Precision, build_model
from gpipe_plan.models.layered import batch_dimensions
from gpipe_plan.schedules import chunks_of_stage, chunks_per_stage, problem, stage_of_chunk
from gpipe_plan.schema import FORMAT_VERSIONS, PLAN_FORMAT, check_built
from gpipe_plan.tensor_memory import unique_bytes


def hand_plan(spec: dict[str, Any], balance: Sequence[int], micro_batches: int, micro_batch_size: int,
              schedule: str = "gpipe", recompute: bool | Sequence[bool] = False, threads: int = 1,
              with_shapes: bool = True, precision: str = "fp32", param_dtype: str = "fp32",
              virtual_stages: int | None = None) -> dict[str, Any]:
    """A runnable plan for ``spec`` cut by ``balance`` (layers per chunk), in ``precision``.

    The stages are ``len(balance)`` over the schedule's chunks per stage: ``virtual_stages``
    for ``interleaved`` (2 unless given), 2 for ``zb-v``, else 1. ``recompute``: one flag for
    every chunk, or one per chunk. ``with_shapes``: the tensors crossing each cut, as this CPU
    computes them in that precision (a CUDA run in bf16 may differ: leave them out there and
    the ranks derive them).
    """
    v = virtual_stages if virtual_stages is not None else chunks_per_stage(schedule, 2)
    per_stage = chunks_per_stage(schedule, v)
    K = len(balance) // per_stage
    reason = problem(schedule, K, micro_batches, v)
    if len(balance) != K * per_stage or K < 1:
        reason = f"{schedule} puts {per_stage} chunk(s) on each stage: {len(balance)} chunks do not divide into stages"
    if reason:
        raise ValueError(reason)
    model = build_model(spec, seed=0)
    chosen = Precision(precision, param_dtype)
    chosen.cast(model)
    names = [name for name, _ in model.layers]
    modules = model.module_names()
    if sum(balance) != len(names):
        raise ValueError(f"balance {list(balance)} covers {sum(balance)} layers; the model has {len(names)}")
    flags = [recompute] * len(balance) if isinstance(recompute, bool) else list(recompute)
    if with_shapes:  # at two sizes: what crosses a cut with the batch, and what without (a table)
        with chosen.autocast("cpu"):
            outputs, more = model.check(batch_size=2), model.check(batch_size=3)
    else:
        outputs = more = None
    chunks = []
    first = 0
    for c, count in enumerate(balance):
        chunk: dict[str, Any] = {"index": c, "stage": stage_of_chunk(schedule, c, K),
                                 "layers": names[first:first + count], "modules": modules[first:first + count],
                                 "param_bytes": [unique_bytes(layer.parameters())
                                                 for _, layer in model.layers[first:first + count]],
                                 "first_layer": first,
                                 "recompute": bool(flags[c])}
        if outputs is not None and more is not None:
            last = first + count - 1
            out = outputs[last]
            batched = batch_dimensions(names[last], [t.shape for t in out], 2, [t.shape for t in more[last]], 3)
            chunk["output_shapes"] = [list(t.shape[1:] if b else t.shape) for t, b in zip(out, batched)]
            chunk["output_dtypes"] = [str(t.dtype).replace("torch.", "") for t in out]
            if not all(batched):
                chunk["output_batched"] = batched
        chunks.append(chunk)
        first += count
    doc = {
        "format": PLAN_FORMAT,
        "version": FORMAT_VERSIONS[PLAN_FORMAT],
        "model": model.spec,
        "precision": precision,
        "param_dtype": param_dtype,
        "profile": {"path": None, "sha256": None, "device": {"type": "cpu", "name": "hand-written", "threads": threads}},
        "options": {"stages": K, "virtual_stages": v},
        "balance": list(balance),
        "micro_batches": micro_batches,
        "micro_batch_size": micro_batch_size,
        "global_batch_size": micro_batches * micro_batch_size,
        "schedule": schedule,
        "virtual_stages": v,
        "chunks": chunks,
        "stages": [{"index": k, "chunks": chunks_of_stage(schedule, k, K, v)} for k in range(K)],
        "predicted": {},
    }
    # Checked where it is built: a helper that drifts from the format fails here, in every test
    # that uses it, rather than in the one that happens to read the key it got wrong.
    check_built(doc, "plan", f"hand plan {list(balance)}")
    return doc
