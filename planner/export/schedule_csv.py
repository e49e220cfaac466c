"""Hand a plan's schedule to another executor: the CSV torch.distributed.pipelining reads.

The planner's schedule is data (gpipe_plan/schedules.py): per stage, the ordered actions
F, B, I, W on a chunk and a micro-batch. torch's ``_PipelineScheduleRuntime`` runs any such
list, read from a CSV with one row per stage (rank) and one cell per action, ``{chunk}{kind}
{micro_batch}`` (``3F0``, ``1I2``), and adds the sends and receives itself; torchtitan takes
the same file as ``pipeline_parallel_schedule_csv`` (beside a ``pipeline_parallel_schedule``
that torch resolves and that places the chunks as the plan does: :mod:`.to_torchtitan`).
:func:`export_schedule_csv` writes the plan's very list there, so torch runs, action for
action, what the planner simulated.

The chunk number is torch's ``stage_index`` (the PipelineStage of that run of layers); a
rank must hold the same chunks as the plan's stage (``stages[k].chunks``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...artifacts import Outputs, check_output_paths, write_text_atomic
from ...schedules import label as schedule_label
from ...schedules import to_csv
from ...plan_view import read_plan
from .view import refuse_asynchronous


@dataclass(frozen=True)
class ExportedSchedule:
    """What :func:`export_schedule_csv` wrote: enough to say so in one line."""

    path: str
    schedule: str
    virtual_stages: int
    stages: int
    chunks: int
    micro_batches: int
    actions: int
    kinds: tuple[str, ...]          # the kinds of action the file holds, F B or F I W


def export_schedule_csv(plan_path: str, csv_path: str, outputs: Outputs | None = None) -> ExportedSchedule:
    """Write the plan's schedule as torch's compute-only CSV, atomically; raise
    :class:`~gpipe_plan.artifacts.BadInput` (nothing written) when the plan is not one to export.
    ``outputs``: the set of the command's files it joins (written with them)."""
    check_output_paths({"--schedule-csv": csv_path}, inputs=(plan_path,))
    view = read_plan(plan_path)
    refuse_asynchronous(view, "torch's schedule CSV (_PipelineScheduleRuntime)")
    actions = view.actions()
    if outputs is None:
        write_text_atomic(csv_path, to_csv(actions))
    else:
        outputs.add(csv_path, to_csv(actions), "--schedule-csv")
    kinds = {a.kind for row in actions for a in row}
    return ExportedSchedule(
        path=csv_path, schedule=view.schedule, virtual_stages=view.virtual_stages, stages=len(actions),
        chunks=len(view.chunks), micro_batches=view.micro_batches,
        actions=sum(len(row) for row in actions), kinds=tuple(k for k in "FBIW" if k in kinds))


def describe(exported: ExportedSchedule) -> list[str]:
    """What was written and how torch and torchtitan load it, a line each."""
    from .to_torchtitan import titan_schedule_with_csv

    e = exported
    return [
        f"wrote {e.path}: {schedule_label(e.schedule, e.virtual_stages)} on {e.stages} "
        f"stage{'s' if e.stages != 1 else ''} (a row each), {e.chunks} chunks, M = {e.micro_batches}: "
        f"{e.actions} actions ({', '.join(e.kinds)})",
        f"torch: build each rank's PipelineStage per chunk it holds (stage_index = chunk), then "
        f"_PipelineScheduleRuntime(stages, n_microbatches={e.micro_batches}, loss_fn=...)._load_csv('{e.path}')",
        f"torchtitan: --parallelism.pipeline_parallel_schedule {titan_schedule_with_csv(e.schedule, e.virtual_stages)} "
        f"--parallelism.pipeline_parallel_schedule_csv {e.path} (it runs the CSV with _PipelineScheduleRuntime; the "
        f"schedule's name places the chunks)",
    ]
