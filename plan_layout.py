"""Where a plan's layers run: its chunks, each on one stage, checked to fit together.

A plan (docs/plan-format.md) cuts the model into *chunks*, contiguous runs of layers numbered
in pipeline order, and places them on *stages* (devices). Since plan format 5 the plan lists
both: ``chunks`` (per chunk its layers, the stage that runs it, its predicted times and the
tensors it sends) and ``stages`` (per stage the chunks it holds and its memory). Before
version 5 there were only ``stages``, each holding one run of layers: a version-4 stage is
one chunk on its own stage.

The schema (gpipe_plan/schema.py) checks each key on its own; what it cannot check is how
the keys fit together: ``balance`` must count each chunk's layers, chunk c must run on the
stage the schedule puts it on (:func:`gpipe_plan.schedules.stage_of_chunk`), each stage must
list exactly its chunks, and so on. :func:`plan_chunks` checks that once, for every reader
(``run``, ``show``, ``calibrate``, ``export``), and gives them the chunks in one shape
whatever the plan's version, so none of them needs to know there ever was another.

Pure Python, no torch: the planner's commands import it.
"""

from __future__ import annotations

from typing import Any

from .artifacts import BadInput
from .schedules import PLANNABLE_SCHEDULES, chunks_of_stage, chunks_per_stage, problem, stage_of_chunk

# The keys every chunk :func:`plan_chunks` returns has (None where the plan says nothing).
CHUNK_KEYS = ("index", "stage", "layers", "first_layer", "recompute", "forward_s", "backward_s",
              "backward_input_s", "backward_weight_s", "recompute_s", "send_s",
              "output_shapes", "output_dtypes", "output_batched", "param_bytes")


def virtual_stages(doc: dict[str, Any]) -> int:
    """How many chunks each stage of the plan holds (``virtual_stages``; 1 before version 5)."""
    v = doc.get("virtual_stages", 1)
    return v if isinstance(v, int) and not isinstance(v, bool) else 1


def plan_chunks(doc: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The plan's chunks in pipeline order, each a dict with every key of :data:`CHUNK_KEYS`.

    ``doc`` has passed the plan schema; ``where`` names it in errors (``plan 'p.json'``). A
    plan without ``chunks`` (version 4 and before) gives one chunk per stage. Raises
    :class:`BadInput`, in one line naming the key, when the parts do not fit together or
    the schedule cannot run this many stages and micro-batches.
    """
    schedule = doc.get("schedule")
    if schedule not in PLANNABLE_SCHEDULES:
        raise BadInput(f"{where}: schedule {schedule!r} is not one of {', '.join(PLANNABLE_SCHEDULES)}")
    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages:
        raise BadInput(f"{where} has no stages")
    K, v, M = len(stages), virtual_stages(doc), doc.get("micro_batches")
    per_stage = chunks_per_stage(schedule, v)
    if v != per_stage:
        raise BadInput(f"{where}: 'virtual_stages' is {v}, but {schedule} runs {per_stage} chunk"
                       f"{'s' if per_stage != 1 else ''} per stage")
    if isinstance(M, int):
        reason = problem(schedule, K, M, v)
        if reason:
            raise BadInput(f"{where}: {reason}")
    if "chunks" in doc:
        raw, key = doc["chunks"], "chunks"
    elif per_stage == 1:
        raw, key = stages, "stages"          # before version 5: each stage is one chunk
    else:
        raise BadInput(f"{where}: schedule {schedule} needs 'chunks' (plan format 5); solve the profile again")
    if not isinstance(raw, list) or len(raw) != K * per_stage:
        count = len(raw) if isinstance(raw, list) else 0
        raise BadInput(f"{where}: '{key}' has {count} entries; {K} stages of {schedule} with "
                       f"{per_stage} chunk{'s' if per_stage != 1 else ''} each need {K * per_stage}")
    balance = doc.get("balance")
    if not isinstance(balance, list) or len(balance) != len(raw):
        raise BadInput(f"{where}: balance {balance} must have one layer count per chunk ({len(raw)} chunks)")

    chunks: list[dict[str, Any]] = []
    first = 0
    for c, item in enumerate(raw):
        path = f"{key}[{c}]"
        if not isinstance(item, dict):
            raise BadInput(f"{where}: '{path}' is not an object")
        names = item.get("layers")
        if not isinstance(names, list) or not names:
            raise BadInput(f"{where} has no '{path}.layers'")
        if len(names) != balance[c]:
            raise BadInput(f"{where}: '{path}.layers' has {len(names)} names, balance says {balance[c]}")
        stage = stage_of_chunk(schedule, c, K)
        for name, expected in (("index", c), ("first_layer", first)) + ((("stage", stage),) if key == "chunks" else ()):
            if item.get(name, expected) != expected:
                raise BadInput(f"{where}: '{path}.{name}' is {item[name]!r}, expected {expected}"
                               + (f" ({schedule} runs chunk {c} on stage {stage})" if name == "stage" else ""))
        _check_outputs(item, f"{where}: '{path}")
        if item.get("param_bytes") is not None and len(item["param_bytes"]) != len(names):
            raise BadInput(f"{where}: '{path}.param_bytes' has {len(item['param_bytes'])} entries for "
                           f"{len(names)} layers; solve the profile again")
        chunk = {name: item.get(name) for name in CHUNK_KEYS}
        chunk.update(index=c, stage=stage, first_layer=first, recompute=bool(item.get("recompute", False)))
        chunks.append(chunk)
        first += len(names)
    names = [n for chunk in chunks for n in chunk["layers"]]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise BadInput(f"{where}: layer '{twice}' appears in more than one chunk")
    if key == "chunks":
        for k, st in enumerate(stages):
            if not isinstance(st, dict):
                raise BadInput(f"{where}: 'stages[{k}]' is not an object")
            held = chunks_of_stage(schedule, k, K, v)
            if st.get("index", k) != k or st.get("chunks", held) != held:
                found = "index" if st.get("index", k) != k else "chunks"
                raise BadInput(f"{where}: 'stages[{k}].{found}' is {st[found]!r}, expected "
                               f"{k if found == 'index' else held} ({schedule} with {K} stages)")
    return chunks


def _check_outputs(item: dict[str, Any], prefix: str) -> None:
    """The tensors a chunk sends: one dtype, and at most one batched flag, per shape."""
    shapes, dtypes, batched = item.get("output_shapes"), item.get("output_dtypes"), item.get("output_batched")
    if shapes is not None and (not isinstance(dtypes, list) or len(dtypes) != len(shapes)):
        raise BadInput(f"{prefix}.output_dtypes' must give one dtype per output shape")
    if batched is not None and (shapes is None or len(batched) != len(shapes)):
        raise BadInput(f"{prefix}.output_batched' must give true or false per output shape")


# ---------------------------------------------------------------------- replicas (plan format 6)
# How each stage's d replicas share what they learn (docs/planner.md, "Data parallel", "LocalSGD"):
# ``ddp`` and ``fsdp`` average the gradients every step; ``localsgd`` lets each replica step on its
# own gradients and averages the parameters every ``sync_every`` (H) steps.
GRADIENT_SYNCS = ("ddp", "fsdp", "localsgd")
# How ranks are laid out: a replica's stages consecutive, a stage's replicas consecutive, or (plan
# format 7) one stage of d replicas, which has no pipeline to lay out (format 6 called it pipeline-inner).
PLACEMENT_ORDERS = ("pipeline-inner", "data-inner", "data-only")


def data_parallel(doc: dict[str, Any]) -> int:
    """How many replicas of the pipeline the plan runs side by side (``data_parallel``; 1 before version 6)."""
    d = doc.get("data_parallel", 1)
    return d if isinstance(d, int) and not isinstance(d, bool) and d >= 1 else 1


def gradient_sync(doc: dict[str, Any]) -> str:
    """How each stage's replicas share what they learn: ``ddp`` (gradients all-reduced), ``fsdp``
    (sharded) or ``localsgd`` (parameters averaged every :func:`sync_every` steps)."""
    mode = doc.get("gradient_sync", "ddp")
    return mode if mode in GRADIENT_SYNCS else "ddp"


def sync_every(doc: dict[str, Any]) -> int:
    """H, the steps between two parameter averagings of a ``localsgd`` plan (``sync_every``); 1 for
    ddp and fsdp, which sync every step, and where the key is absent."""
    H = doc.get("sync_every", 1)
    if gradient_sync(doc) != "localsgd" or not isinstance(H, int) or isinstance(H, bool) or H < 1:
        return 1
    return H


def gradient_sync_problem(gradient_sync: str, sync_every: int | None, replicas: int | None) -> str:
    """Why this gradient sync and H cannot be planned ("" if they can), in one line; ``replicas``:
    d where it is fixed (None: still to be searched).

    H says how often localsgd averages, so it belongs to localsgd alone; it counts steps, so it
    is at least 1; one replica has no other to average with, nor to shard over (fsdp): a plan
    of one would silently be ddp's, which syncs nothing.
    """
    if sync_every is not None and gradient_sync != "localsgd":
        return (f"--sync-every sets how often localsgd averages the replicas' parameters; --gradient-sync "
                f"{gradient_sync} syncs every step: give --gradient-sync localsgd, or leave --sync-every out")
    if gradient_sync == "fsdp" and replicas == 1:
        return ("--gradient-sync fsdp shards each stage over its d >= 2 replicas, and this plan has one: give "
                "--data-parallel 2 or more (or --devices N), or leave --gradient-sync out")
    if gradient_sync != "localsgd":
        return ""
    if sync_every is not None and (not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1):
        return f"--sync-every must be a whole number of steps, at least 1, got {sync_every!r}"
    if replicas == 1:
        return ("--gradient-sync localsgd averages the parameters of d >= 2 replicas, and this plan has one: "
                "give --data-parallel 2 or more (or --devices N), or use --gradient-sync ddp")
    return ""


def placement_ranks(doc: dict[str, Any], where: str) -> list[list[int]]:
    """``ranks[k][r]``: the global rank (process) that runs stage k of replica r.

    From the plan's ``placement.ranks`` (format 6); a plan without one (before version 6, or
    one replica) runs stage k on rank k. Raises :class:`BadInput` unless it is K lists of d
    ranks that use every rank 0 .. K*d-1 exactly once.
    """
    stages = doc.get("stages")
    K, d = (len(stages) if isinstance(stages, list) else 0), data_parallel(doc)
    placement = doc.get("placement")
    if not isinstance(placement, dict) or "ranks" not in placement:
        if d != 1:
            raise BadInput(f"{where}: 'data_parallel' is {d} but the plan has no 'placement.ranks'; solve the "
                           f"profile again")
        return [[k] for k in range(K)]
    ranks = placement["ranks"]
    if (not isinstance(ranks, list) or len(ranks) != K
            or any(not isinstance(row, list) or len(row) != d for row in ranks)):
        raise BadInput(f"{where}: 'placement.ranks' must list, for each of the {K} stages, the ranks of its {d} "
                       f"replica(s)")
    flat = [r for row in ranks for r in row]
    if sorted(flat) != list(range(K * d)) or any(isinstance(r, bool) for r in flat):
        raise BadInput(f"{where}: 'placement.ranks' must use every rank 0..{K * d - 1} exactly once, found {flat}")
    return [list(row) for row in ranks]


def check_replicas(doc: dict[str, Any], where: str) -> list[list[int]]:
    """The cross-key checks of plan format 6 for readers that take the plan whole (``run``, ``show``, ``export``):
    the batch splits evenly (``global_batch_size == data_parallel * micro_batches *
    micro_batch_size``: each replica runs M micro-batches of that size) and the placement is a
    permutation of the ranks (:func:`placement_ranks`, which it returns)."""
    d, M, size, batch = data_parallel(doc), doc.get("micro_batches"), doc.get("micro_batch_size"), \
        doc.get("global_batch_size")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in (M, size, batch)) and d * M * size != batch:
        replicas = f"data_parallel {d} x " if d > 1 else ""
        raise BadInput(f"{where}: {replicas}micro_batches {M} x micro_batch_size {size} must equal "
                       f"global_batch_size {batch}")
    return placement_ranks(doc, where)
