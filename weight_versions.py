"""Asynchronous pipelines as data: which weights each micro-batch meets, and how many are kept.

The synchronous schedules (:mod:`gpipe_plan.schedules`) flush: every micro-batch of a step
runs on the same weights, the step ends when the last backward is done, and then every stage
updates once. The pipeline drains and fills again every step, and that is the bubble.

PipeDream (Narayanan et al., SOSP 2019) never flushes. Stage k of K runs 1F1B over the whole
run: ``K - k`` forwards to warm up, then one backward and one forward in turn, exactly the
order of :func:`gpipe_plan.schedules.one_f_one_b` over all the run's micro-batches at once.
Between the forward and the backward of one micro-batch the stage has updated its weights
several times, so the backward must use the weights its forward used, or the gradient is of
no function at all: *weight stashing* keeps each in-flight micro-batch's version until its
backward is done. The two schedules here differ in when a stage updates:

- ``pipedream``: every micro-batch is its own update. Micro-batch i (counted over the run,
  i = s * M + m for micro-batch m of step s) meets, on stage k, the weights after
  ``max(0, i - K + k + 1)`` updates: the backwards that stage has finished before its forward
  (:func:`version_used`). After its backward, the stage applies micro-batch i's gradient to
  its newest weights. So stage k's gradients are ``K - 1 - k`` updates stale, and it keeps up
  to ``K - k`` versions (the newest and one per micro-batch in flight).
- ``pipedream-2bw`` (Narayanan et al., ICML 2021, "double-buffered weights"): one update per
  step, of the mean gradient over the step's M micro-batches, as the synchronous schedules
  compute it, except that step t's micro-batches all meet the weights after ``max(0, t - 1)``
  updates. For SGD, W(t+1) = W(t) - lr * grad f(W(t-1)): a constant delay of one update on
  every stage, and two versions kept (the one in use and the newest). Step t's forwards need
  update t-2, done a whole step earlier, so no stage ever waits for a version as long as
  ``M >= K - 1`` (:func:`problem`).

A *segment* is a stretch of steps the pipeline runs without a flush. The rules count
micro-batches and updates from the segment's start, where every stage's versions are its
newest (a run drains at the end, and before a checkpoint, so a resumed run continues from
exactly what was saved: docs/runtime.md, "Asynchronous pipelines").

Pure Python: the planner (staleness, stashed versions), the runtime and the one-process
reference (:mod:`gpipe_plan.runtime.async_reference`) all read these rules.
"""

from __future__ import annotations

ASYNC_SCHEDULES = ("pipedream", "pipedream-2bw")


def problem(schedule: str, stages: int, micro_batches: int) -> str | None:
    """Why this asynchronous schedule cannot run, in words; None when it can."""
    if schedule not in ASYNC_SCHEDULES:
        return f"unknown asynchronous schedule {schedule!r}: expected one of {', '.join(ASYNC_SCHEDULES)}"
    if stages < 1 or micro_batches < 1:
        return "a schedule needs at least one stage and one micro-batch"
    if schedule == "pipedream-2bw" and micro_batches < stages - 1:
        return (f"pipedream-2bw needs at least K - 1 = {stages - 1} micro-batches per step (so that a step's "
                f"forwards never wait for the version they use), got {micro_batches}: raise --micro-batches")
    return None


def updates_per_step(schedule: str, micro_batches: int) -> int:
    """How many updates each stage applies per step: M for ``pipedream``, 1 for ``pipedream-2bw``."""
    return micro_batches if schedule == "pipedream" else 1


def version_used(schedule: str, stage: int, stages: int, micro_batches: int, micro_batch: int) -> int:
    """How many of the segment's updates stage ``stage`` has applied to the weights that
    micro-batch ``micro_batch`` (counted from the segment's start) meets, forward and backward."""
    if schedule == "pipedream":
        return max(0, micro_batch - stages + stage + 1)
    return max(0, micro_batch // micro_batches - 1)


def staleness(schedule: str, stage: int, stages: int) -> int:
    """In steady state, how many updates a stage's gradient lags behind the weights it is applied to."""
    return stages - 1 - stage if schedule == "pipedream" else 1


def stashed_versions(schedule: str, stage: int, stages: int) -> int:
    """The most weight versions stage ``stage`` holds at once, the newest included."""
    return stages - stage if schedule == "pipedream" else 2


def weight_copies(schedule: str, stage: int, stages: int) -> int:
    """The most copies of its parameters stage ``stage`` holds at once when run, what its memory
    is charged: the live (newest) weights, which the optimizer updates in place, and a stashed
    copy of each version a micro-batch in flight meets, taken when a forward first needs it
    (the autograd graph must keep the forward's own tensors while the live ones change). So one
    more than :func:`stashed_versions` on every stage but the last, where an update separates a
    forward from its backward; the last stage runs each forward right before its backward, on
    the live weights (``pipedream``: 1) or on its one older version (``pipedream-2bw``: 2)."""
    return stashed_versions(schedule, stage, stages) + (1 if stage < stages - 1 else 0)
