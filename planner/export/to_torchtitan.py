"""torchtitan: the plan as its ``[parallelism]`` and ``[training]`` settings.

torchtitan (pytorch/torchtitan) splits a model for pipeline parallelism by module names:
``module_fqns_per_model_part`` lists, per model part (a chunk: torch's ``PipelineStage``), the
fully qualified names of the modules it keeps; every other module of the model is removed
from that part. The parts go to ranks as the schedule says: one per rank for single-stage
schedules (``1F1B``, ``GPipe``), round-robin for looped ones (``Interleaved1F1B``), in a V for
``ZBVZeroBubble``: the same placements as gpipe-plan's schedules, so the plan's chunk c is
torchtitan's part c. Its keys:

- ``pipeline_parallel_degree``: K;
- ``pipeline_parallel_schedule``: the torch schedule class of the plan's schedule without its
  ``Schedule`` prefix (the name torch's ``get_schedule_class`` resolves). Where torch has no class
  for it (``zb-h1``: one chunk per rank with the backward split), ``pipeline_parallel_schedule_csv``
  names the plan's action lists (written next to the fragment), which torchtitan then runs with
  ``_PipelineScheduleRuntime`` whatever the schedule's name; the name still has to resolve (it
  says one chunk per rank or several, and where the chunks go: a V for ``ZBVZeroBubble`` and
  ``DualPipeV``, round-robin for the rest), so it is ``PipelineScheduleSingle`` there
  (``_PipelineScheduleRuntime`` itself is no name ``get_schedule_class`` knows);
- ``pipeline_parallel_microbatch_size``: the plan's micro-batch size;
- ``module_fqns_per_model_part``: per chunk, its layers' module names;
- ``data_parallel_replicate_degree`` (ddp) or ``data_parallel_shard_degree`` (fsdp): d;
- ``[training] local_batch_size``: one replica's batch, global / d; ``global_batch_size``.

torchtitan up to 0.2 reads such a TOML file (``--job.config_file``); from 0.3 its configs are
Python and these are command-line overrides (``--parallelism.pipeline_parallel_degree 2``):
the fragment carries both, the overrides as a comment. What it cannot express: a layer that
is not one module of the model (a piece of a traced graph) has no name to list; the fragment
lists the named ones and says which were left to the model's own forward.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from ...artifacts import BadInput
from ...schedules import to_csv
from . import Exported
from ...plan_view import PlanView
from .view import model_name, placement_note, unnamed

# gpipe-plan's schedule -> torch's schedule class (torchtitan drops the "Schedule" prefix).
TORCH_SCHEDULE_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                        "zb-v": "ScheduleZBVZeroBubble"}


def titan_schedule(schedule: str) -> str | None:
    """torchtitan's name for the schedule, None where only the CSV can say it."""
    name = TORCH_SCHEDULE_CLASS.get(schedule)
    return name.removeprefix("Schedule") if name else None


def titan_schedule_with_csv(schedule: str, virtual_stages: int) -> str:
    """``pipeline_parallel_schedule`` beside a ``pipeline_parallel_schedule_csv``: torchtitan runs
    the CSV with ``_PipelineScheduleRuntime`` but still resolves this name (torch's
    ``get_schedule_class``) to count the chunks per rank and place them (a V for ZBVZeroBubble,
    round-robin otherwise), so it must name a class that places them as the plan does: the
    schedule's own, else torch's base class for one chunk per rank or for several."""
    return titan_schedule(schedule) or ("PipelineScheduleSingle" if virtual_stages == 1 else "PipelineScheduleMulti")


def export(view: PlanView, out: str) -> Exported:
    named_parts = [[m for m in chunk.modules if m is not None] for chunk in view.chunks]
    schedule = titan_schedule(view.schedule)
    files: dict[str, str] = {}
    notes: list[str] = []
    csv_name = None
    if schedule is None:
        csv_name = str(Path(out).with_suffix(".schedule.csv"))
        files[csv_name] = to_csv(view.actions())
        schedule = titan_schedule_with_csv(view.schedule, view.virtual_stages)
        notes.append(f"torch has no class for {view.schedule}: the schedule is the plan's action lists, in {csv_name} "
                     f"(torchtitan runs them with _PipelineScheduleRuntime; {schedule} places the chunks)")
    nameless = unnamed(view)
    if nameless:
        notes.append(f"{len(nameless)} layer(s) are not one module of the model and cannot be listed "
                     f"({', '.join(nameless[:3])}{', ...' if len(nameless) > 3 else ''}): they run wherever the "
                     f"model's own forward runs them")
    empty = [c for c, part in enumerate(named_parts) if not part]
    if empty:
        raise BadInput(f"plan '{view.path}': {_no_names(view, empty)}")
    if any(chunk.recompute for chunk in view.chunks):
        notes.append(f"the plan recomputes chunks {[c.recompute for c in view.chunks]}: not exported; torchtitan's own "
                     f"[activation_checkpoint] mode applies to every part alike")
    placement = placement_note(view, "torchtitan")
    if placement:
        notes.append(placement)
    parallelism: dict[str, object] = {
        "pipeline_parallel_degree": view.num_stages,
        "pipeline_parallel_schedule": schedule,
        "pipeline_parallel_microbatch_size": view.micro_batch_size,
        "module_fqns_per_model_part": named_parts,
    }
    if csv_name is not None:
        parallelism["pipeline_parallel_schedule_csv"] = csv_name
    degree_key = "data_parallel_shard_degree" if view.gradient_sync == "fsdp" else "data_parallel_replicate_degree"
    parallelism[degree_key] = view.data_parallel
    if view.gradient_sync != "fsdp":
        parallelism["data_parallel_shard_degree"] = 1
    training = {"local_batch_size": view.global_batch_size // view.data_parallel,
                "global_batch_size": view.global_batch_size}
    files[out] = _toml(view, parallelism, training, notes)
    exact = not nameless and not placement
    return Exported("torchtitan", files, exact=exact, notes=notes,
                    summary=f"torchtitan: {view.num_stages} ranks x {view.data_parallel} replica(s), "
                            f"{len(named_parts)} model parts, schedule {schedule}")


def _no_names(view: PlanView, empty: list[int]) -> str:
    """Why torchtitan cannot build some chunks: none of their layers has a module name."""
    if len(unnamed(view)) == len(view.layer_names):
        return ("its layers have no module names (a PipeDream import, or a plan solved from a profile before "
                "format 8), which torchtitan's module_fqns_per_model_part needs: profile the model again")
    return (f"chunk(s) {empty} hold no layer that is one module of the model, so torchtitan cannot build them: "
            f"profile with --cut-at at module boundaries and solve again")


def _toml(view: PlanView, parallelism: dict[str, object], training: dict[str, object], notes: list[str]) -> str:
    """The fragment: TOML sections, with the same settings as command-line overrides in a comment."""
    lines = [f"# torchtitan settings for {model_name(view)}, from the gpipe-plan plan '{view.path}'",
             "# (torchtitan <= 0.2: merge into the job's TOML file; >= 0.3: pass the overrides below)"]
    lines += [f"# note: {n}" for n in notes]
    lines.append("# " + " ".join(shlex.quote(arg) for arg in cli_overrides(parallelism, training)))
    lines.append("")
    for section, values in (("parallelism", parallelism), ("training", training)):
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    # JSON's strings, integers and nested lists of strings are TOML's too.
    return json.dumps(value)


def cli_overrides(parallelism: dict[str, object], training: dict[str, object]) -> list[str]:
    """The settings as torchtitan >= 0.3 command-line overrides, one argument per list item: its
    parser reads a ``list[str]`` as ``a,b,c`` and a list of them as several such arguments."""
    args: list[str] = []
    for section, values in (("parallelism", parallelism), ("training", training)):
        for key, value in values.items():
            args.append(f"--{section}.{key}")
            if isinstance(value, list):
                args += [",".join(part) for part in value]
            else:
                args.append(str(value))
    return args
