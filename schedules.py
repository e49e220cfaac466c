"""Pipeline schedules as data: what every stage runs in one training step, in order.

A schedule is, for each of the K stages (devices, ranks), a list of :class:`Action`\\ s. An
action is one piece of work on one *chunk* (a contiguous run of layers) for one micro-batch:

- ``F``: the forward;
- ``B``: the whole backward;
- ``I``: the backward for the *input* only (the gradient the previous chunk waits for);
- ``W``: the backward for the *weights* only (what the optimizer waits for; nobody else).

Splitting B into I and W is what zero-bubble schedules exploit: I is on the critical path, W
is not, so W can fill the idle slots ("bubbles") the pipeline would otherwise leave.

The data dependencies fix everything else: F of chunk c needs F of chunk c-1 (same micro-batch);
B or I of chunk c needs B or I of chunk c+1 (the last chunk: its own F); W needs its own I.
Each stage runs its list in order and waits for what it needs. The planner's simulator and
memory model, the native executor and the torch executor all read these very lists, so what
runs is what was predicted; adding a schedule means adding one function here.

Chunks and placement. With one chunk per stage (``gpipe``, ``1f1b``, ``zb-h1``) chunk c runs on
stage c. ``interleaved`` cuts the layers into K*v chunks placed round-robin (chunk c on stage
c mod K: each stage holds v chunks spread through the model, and a micro-batch loops through
the stages v times); ``zb-v`` cuts them into 2K chunks placed in a V (stage k holds chunk k and
chunk 2K-1-k, so the last stage holds the two middle chunks and the first stage the two ends:
the loss and the first layer sit on the same device).

The five schedules:

- ``gpipe`` (Huang et al. 2019): all M forwards, then all M backwards. Holds M micro-batches
  of activations.
- ``1f1b`` (PipeDream-flush; torch's ``Schedule1F1B``): stage k warms up with ``min(M, K-k)``
  forwards, then alternates one backward and one forward. Same bubble as GPipe,
  (K-1)/(M+K-1) of the step with balanced stages, holding at most K-k micro-batches.
- ``interleaved`` (Narayanan et al. 2021; torch's ``ScheduleInterleaved1F1B``): 1F1B over v
  chunks per stage, micro-batches taken in rounds of about K: the fill and drain pass
  through chunks v times smaller, so the bubble is about 1/v of 1F1B's, for v times as many
  sends. Needs M to be a multiple of its rounds, ``max(1, M // K)``.
- ``zb-h1`` (Qi et al. 2024, "ZB-H1"; torch's ``ScheduleInterleavedZeroBubble`` with one chunk
  per stage): 1F1B with B split into I and W, stage k postponing k of its W's into the drain,
  where they fill the wait for gradients. About a third of 1F1B's bubble at 1F1B's memory.
- ``zb-v`` (Qi et al. 2024, "ZB-V"; torch's ``ScheduleZBVZeroBubble``): two chunks per stage in
  a V, I and W split; near-zero bubble when F, I and W take about the same time, at 1F1B's
  activation memory.

The interleaved and zero-bubble orders are the ones torch.distributed.pipelining builds for
the same schedule (its ``_calculate_single_rank_operations``), without its lock-step padding
(``None`` slots): here a stage simply waits for its inputs. A test checks the two agree.

``torch.distributed.pipelining`` and torchtitan read a schedule as CSV, one row per stage, each
cell an action written ``{chunk}{kind}{micro_batch}`` (``3F0``, ``1I2``): :func:`to_csv`.

Pure Python: the planner (which must not import torch) and the runtime both use it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .weight_versions import ASYNC_SCHEDULES
from .weight_versions import problem as async_problem

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")   # synchronous: what ``auto`` chooses from
# The asynchronous ones (gpipe_plan.weight_versions) run 1F1B's order with no flush and one
# chunk per stage; a plan may name them, ``auto`` never picks them (they change the mathematics).
PLANNABLE_SCHEDULES = SCHEDULES + ASYNC_SCHEDULES
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-v"})     # schedules that run I and W instead of B
KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    """One piece of work: ``kind`` (F, B, I or W) on chunk ``chunk`` for micro-batch ``micro_batch``."""

    kind: str
    chunk: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind}{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The inverse of ``str``: ``"3F0"`` is the forward of micro-batch 0 on chunk 3."""
        text = text.strip()
        for i, ch in enumerate(text):
            if not ch.isdigit():
                kind, chunk, micro = ch, text[:i], text[i + 1:]
                if kind in KINDS and chunk and micro.isdigit():
                    return cls(kind, int(chunk), int(micro))
                break
        raise ValueError(f"not an action: {text!r} (expected chunk, kind F/B/I/W, micro-batch, e.g. '3F0')")


def label(schedule: str, virtual_stages: int = 1) -> str:
    """The schedule as users read it: ``interleaved v=2`` (its chunks per stage are a choice);
    the other schedules' chunks per stage are fixed, so their name says it all."""
    return f"{schedule} v={virtual_stages}" if schedule == "interleaved" else schedule


# ---------------------------------------------------------------------------- placement
def chunks_per_stage(schedule: str, virtual_stages: int = 1) -> int:
    """How many chunks each stage holds: v for ``interleaved``, 2 for ``zb-v``, else 1."""
    if schedule == "interleaved":
        return virtual_stages
    if schedule == "zb-v":
        return 2
    return 1


def stage_of_chunk(schedule: str, chunk: int, stages: int) -> int:
    """The stage (device) that runs chunk ``chunk``."""
    if schedule == "interleaved":
        return chunk % stages
    if schedule == "zb-v":
        return chunk if chunk < stages else 2 * stages - 1 - chunk
    return chunk


def chunks_of_stage(schedule: str, stage: int, stages: int, virtual_stages: int = 1) -> list[int]:
    """The chunks stage ``stage`` holds, in pipeline order."""
    total = stages * chunks_per_stage(schedule, virtual_stages)
    return [c for c in range(total) if stage_of_chunk(schedule, c, stages) == stage]


def problem(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> str | None:
    """Why this combination cannot run, in words; None when it can."""
    if schedule in ASYNC_SCHEDULES:
        if virtual_stages != 1:
            return f"{schedule} does not take --virtual-stages (only interleaved does)"
        return async_problem(schedule, stages, micro_batches)
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}: expected one of {', '.join(PLANNABLE_SCHEDULES)}"
    if stages < 1 or micro_batches < 1:
        return "a schedule needs at least one stage and one micro-batch"
    if schedule == "interleaved":
        if virtual_stages < 2:
            return "interleaved needs at least 2 virtual stages per stage (--virtual-stages)"
        rounds = max(1, micro_batches // stages)
        if micro_batches % rounds:
            return (f"interleaved takes micro-batches in rounds of about {stages} (one per stage): "
                    f"{micro_batches} is not a multiple of its {rounds} rounds")
    elif virtual_stages != 1 and virtual_stages != chunks_per_stage(schedule, virtual_stages):
        return f"{schedule} does not take --virtual-stages (only interleaved does)"
    return None


# ---------------------------------------------------------------------------- the orders
def gpipe(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """All forwards, then all backwards (in the same micro-batch order)."""
    return ([Action("F", stage, m) for m in range(micro_batches)]
            + [Action("B", stage, m) for m in range(micro_batches)])


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """Warm up with ``min(M, K - k)`` forwards, then alternate B and F, then drain."""
    warmup = min(micro_batches, stages - stage)
    actions = [Action("F", stage, m) for m in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_backward < micro_batches:
        actions.append(Action("B", stage, next_backward))
        next_backward += 1
        if next_forward < micro_batches:
            actions.append(Action("F", stage, next_forward))
            next_forward += 1
    return actions


def interleaved(stage: int, stages: int, micro_batches: int, virtual_stages: int,
                zero_bubble: bool = False) -> list[Action]:
    """Interleaved 1F1B over ``virtual_stages`` chunks (with ``zero_bubble``: torch's ZB1P).

    Micro-batches go in rounds of ``per_round``; a stage runs round after round of forwards
    on its first chunk, then its second, and so on (backwards the other way round). It warms
    up with ``(v-1) per_round + 2 (K-1-k)`` forwards (``+ (K-1-k)`` for zero bubble), then
    pairs one forward with one backward (I for zero bubble, whose W follows once the stage
    has postponed k of them), then drains.
    """
    K, M, v, k = stages, micro_batches, virtual_stages, stage
    rounds = max(1, M // K)
    per_round = M // rounds
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (K - 1 - k), M * v)
    total = M * v
    postponed = k if zero_bubble else 0

    def forward_chunk(i: int) -> int:
        return ((i // per_round) % v) * K + k

    def backward_chunk(i: int) -> int:
        return (v - 1 - ((i - warmup) // per_round) % v) * K + k

    next_mb: dict[tuple[str, int], int] = defaultdict(int)

    def take(kind: str, chunk: int) -> Action:
        m = next_mb[(kind, chunk)]
        next_mb[(kind, chunk)] = m + 1
        return Action(kind, chunk, m)

    backward_kind = "I" if zero_bubble else "B"
    actions: list[Action] = []
    backward_steps: list[int] = []
    weights_done = 0
    for i in range(warmup + total):
        if i < warmup:
            actions.append(take("F", forward_chunk(i)))
            continue
        if i < total:                              # steady: one forward, one backward
            actions.append(take("F", forward_chunk(i)))
        actions.append(take(backward_kind, backward_chunk(i)))
        backward_steps.append(i)
        if zero_bubble and i - warmup >= postponed:
            actions.append(take("W", backward_chunk(backward_steps[weights_done])))
            weights_done += 1
    while zero_bubble and weights_done < len(backward_steps):
        actions.append(take("W", backward_chunk(backward_steps[weights_done])))
        weights_done += 1
    return actions


def zb_v(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """ZB-V: chunks k and 2K-1-k on stage k, forwards down the V's left arm and back up its right.

    The order is torch's ``ScheduleZBVZeroBubble``: warm up on the first chunk, then on both,
    then a steady state of F, I, W on each chunk in turn, then a drain that runs the
    postponed W's in the gaps while gradients travel back up.
    """
    K, M, k = stages, micro_batches, stage
    # Build as if there were at least 2K-1 micro-batches (the pattern needs them), then drop
    # the actions of micro-batches that do not exist.
    n = max(2 * K - 1, M)
    first, second = k, 2 * K - 1 - k
    f0 = f1 = b0 = b1 = 0
    actions: list[Action] = []
    for _ in range(2 * (K - k) - 1):
        actions.append(Action("F", first, f0)); f0 += 1
    for _ in range(k):
        actions.append(Action("F", second, f1)); f1 += 1
        actions.append(Action("F", first, f0)); f0 += 1
    for _ in range(K - k):
        actions.append(Action("F", second, f1)); f1 += 1
        actions.append(Action("I", second, b1))
        actions.append(Action("W", second, b1)); b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            actions.append(Action("F", first, f0)); f0 += 1
        actions.append(Action("I", first, b0))
        actions.append(Action("W", first, b0)); b0 += 1
        actions.append(Action("F", second, f1)); f1 += 1
        actions.append(Action("I", second, b1))
        actions.append(Action("W", second, b1)); b1 += 1
    w0, w1 = b0, b1
    for _ in range(k):
        actions.append(Action("I", first, b0)); b0 += 1
        actions.append(Action("I", second, b1)); b1 += 1
    for _ in range(K - k):
        actions.append(Action("I", first, b0)); b0 += 1
        actions.append(Action("W", first, w0)); w0 += 1
    while w1 < b1:
        actions.append(Action("W", second, w1)); w1 += 1
    while w0 < b0:
        actions.append(Action("W", first, w0)); w0 += 1
    return [a for a in actions if a.micro_batch < M]


def stage_actions(schedule: str, stage: int, stages: int, micro_batches: int,
                  virtual_stages: int = 1) -> list[Action]:
    """The actions stage ``stage`` of ``stages`` runs in one training step, in order."""
    reason = problem(schedule, stages, micro_batches, virtual_stages)
    if reason:
        raise ValueError(reason)
    if schedule == "gpipe":
        return gpipe(stage, stages, micro_batches)
    if schedule in ASYNC_SCHEDULES:
        return segment_actions(stage, stages, micro_batches, 1)
    if schedule == "1f1b":
        return one_f_one_b(stage, stages, micro_batches)
    if schedule == "interleaved":
        return interleaved(stage, stages, micro_batches, virtual_stages)
    if schedule == "zb-h1":
        return interleaved(stage, stages, micro_batches, 1, zero_bubble=True)
    return zb_v(stage, stages, micro_batches)


def segment_actions(stage: int, stages: int, micro_batches: int, steps: int) -> list[Action]:
    """An asynchronous schedule's order on stage ``stage`` over a segment of ``steps`` steps (no
    flush inside it): 1F1B over all ``steps * micro_batches`` micro-batches, numbered from the
    segment's start; one step taken alone is a segment of one (:mod:`gpipe_plan.weight_versions`)."""
    return one_f_one_b(stage, stages, steps * micro_batches)


def all_actions(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Every stage's actions: ``all_actions(...)[k]`` is stage k's list."""
    return [stage_actions(schedule, k, stages, micro_batches, virtual_stages) for k in range(stages)]


# ---------------------------------------------------------------------------- reading a list
def in_flight(actions: Sequence[Action], chunk: int | None = None) -> int:
    """The most micro-batches whose forward has run and whose B (or I) has not, at any point,
    on ``chunk`` (all of the list's chunks together when None): how many sets of saved
    activations the stage holds at its peak."""
    live = peak = 0
    for a in actions:
        if chunk is not None and a.chunk != chunk:
            continue
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind in ("B", "I"):
            live -= 1
    return peak


def peak_bytes(actions: Sequence[Action], held_bytes: Mapping[int, float],
               backward_extra_bytes: Mapping[int, float] | None = None,
               weight_kept_bytes: Mapping[int, float] | None = None) -> float:
    """The peak of the memory a stage's micro-batches hold, replaying its actions in order.

    Per chunk: ``held_bytes`` from its F until its B or I (the saved activations, or only the
    input when the chunk recomputes); ``backward_extra_bytes`` more while its B or I runs (the
    recomputed activations); ``weight_kept_bytes`` from its I until its W (what the weight
    gradient still needs: the layers' inputs). A stage's memory is its chunks' parameters and
    optimizer state plus this peak.
    """
    extra = backward_extra_bytes or {}
    kept = weight_kept_bytes or {}
    live = peak = 0.0
    for a in actions:
        if a.kind == "F":
            live += held_bytes[a.chunk]
            peak = max(peak, live)
        elif a.kind in ("B", "I"):
            peak = max(peak, live + extra.get(a.chunk, 0.0))
            live -= held_bytes[a.chunk]
            if a.kind == "I":
                live += kept.get(a.chunk, 0.0)
                peak = max(peak, live)
        else:  # W
            live -= kept.get(a.chunk, 0.0)
    return peak


def check_actions(schedule: str, stages: int, micro_batches: int, virtual_stages: int,
                  actions: Sequence[Sequence[Action]]) -> None:
    """Raise ValueError unless ``actions`` is a complete schedule of this shape: every chunk
    runs F and B (or I then W) once per micro-batch, each on the stage it belongs to, with
    its forward before its backward."""
    chunks = stages * chunks_per_stage(schedule, virtual_stages)
    split = schedule in SPLIT_BACKWARD
    expected = ("F", "I", "W") if split else ("F", "B")
    seen: dict[tuple[str, int, int], int] = {}
    for k, stage_list in enumerate(actions):
        for position, a in enumerate(stage_list):
            if not 0 <= a.chunk < chunks or stage_of_chunk(schedule, a.chunk, stages) != k:
                raise ValueError(f"stage {k} runs {a}, which is not one of its chunks")
            if a.kind not in expected or not 0 <= a.micro_batch < micro_batches:
                raise ValueError(f"stage {k} runs {a}, which {schedule} with M={micro_batches} does not have")
            key = (a.kind, a.chunk, a.micro_batch)
            if key in seen:
                raise ValueError(f"stage {k} runs {a} twice")
            seen[key] = position
    for c in range(chunks):
        for m in range(micro_batches):
            order = [seen.get((kind, c, m)) for kind in expected]
            if None in order:
                missing = expected[order.index(None)]
                raise ValueError(f"no stage runs {Action(missing, c, m)}")
            if order != sorted(order):  # type: ignore[type-var]
                raise ValueError(f"chunk {c} runs micro-batch {m}'s {'/'.join(expected)} out of order")


def to_csv(actions: Sequence[Sequence[Action]]) -> str:
    """The schedule in the compute-only CSV torch's ``_PipelineScheduleRuntime._load_csv`` reads
    (and torchtitan's ``pipeline_parallel_schedule_csv`` takes): one row per stage."""
    return "".join(",".join(str(a) for a in row) + "\n" for row in actions)


def from_csv(text: str) -> list[list[Action]]:
    """The inverse of :func:`to_csv` (empty cells, torch's padding, are skipped)."""
    return [[Action.parse(cell) for cell in line.split(",") if cell.strip()]
            for line in text.splitlines() if line.strip()]
