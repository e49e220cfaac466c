"""Hand a plan to the trainers people already use: ``gpipe-plan export``.

Many users train with torchtitan, Megatron-Core, DeepSpeed or their own loop around
``torch.distributed.pipelining``, and balance stages there by hand. ``export --to TARGET``
says the plan in the target's own terms, one module per target, each from the plan alone
(no torch: the planner's side of the project):

======================  ============================================================
``torch``               :mod:`.to_torch`: a training script (``PipelineStage`` per chunk,
                        the schedule's action lists, ``n_microbatches``, ``split_spec``)
``torchtitan``          :mod:`.to_torchtitan`: its ``[parallelism]`` / ``[training]`` settings
``megatron``            :mod:`.to_megatron`: ``--pipeline-model-parallel-layout`` and batch args
``deepspeed``           :mod:`.to_deepspeed`: the config's batch keys and the partition
======================  ============================================================

``--schedule-csv`` (:mod:`.schedule_csv`) writes the schedule alone, as torch's CSV.

An asynchronous plan (``pipedream``, ``pipedream-2bw``) is refused in one line by every target
and by ``--schedule-csv``: they all flush every step and keep one version of the weights.

A target that cannot express the plan exactly exports the nearest split it can
(:mod:`.expressible`) and says so, with the planner's prediction for it (:mod:`.cost`). Every
file is written atomically, and only after every export of the call succeeded; bad input
(an unknown target, a plan whose layers have no module names where the target needs them, an
output that cannot be written) is one line and no file.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from ...artifacts import BadInput, Outputs, check_output_paths
from .schedule_csv import ExportedSchedule, describe, export_schedule_csv

TARGETS = ("torch", "torchtitan", "megatron", "deepspeed")
DEFAULT_SUFFIX = {"torch": ".py", "torchtitan": ".toml", "megatron": ".args", "deepspeed": ".json"}

__all__ = ["TARGETS", "Exported", "ExportedSchedule", "describe", "describe_export", "export_plan",
           "export_schedule_csv"]


@dataclass
class Exported:
    """What one target made of a plan: its files (path -> text), and how faithful they are."""

    target: str
    files: dict[str, str]
    exact: bool                              # the target runs the plan's very split
    notes: list[str] = field(default_factory=list)
    summary: str = ""
    exported_balance: list[int] | None = None    # the split exported instead, when not exact
    cost_note: str | None = None             # the planner's prediction for that split


def default_out(plan_path: str, target: str) -> str:
    """``plan.json`` -> ``plan.torchtitan.toml``: beside the plan, named for the target."""
    path = Path(plan_path)
    return str(path.with_name(f"{path.stem}.{target}{DEFAULT_SUFFIX[target]}"))


def export_plan(plan_path: str, target: str, out: str | None = None, outputs: Outputs | None = None) -> Exported:
    """Export the plan for ``target`` and write its files (atomically, all or none); ``outputs``:
    the set of the command's files they join (written with them)."""
    if target not in TARGETS:
        raise BadInput(f"unknown export target '{target}': choose one of {', '.join(TARGETS)}")
    out = out or default_out(plan_path, target)
    check_output_paths({"--out": out}, inputs=(plan_path,))
    from ...plan_view import read_plan
    from .view import refuse_asynchronous

    view = read_plan(plan_path)
    refuse_asynchronous(view, {"torch": "a torchrun script of torch.distributed.pipelining"}.get(target, target))
    if view.gradient_sync == "localsgd" and view.data_parallel > 1:
        # Every target's data parallel all-reduces gradients each step: its config would train another algorithm.
        raise BadInput(f"plan '{plan_path}' trains with localsgd (the replicas' parameters averaged every "
                       f"{view.sync_every} steps), which a {target} config cannot say: export a plan solved "
                       f"with --gradient-sync ddp or fsdp, or train this one with gpipe-plan run")
    module = _target_module(target)
    exported: Exported = module.export(view, out)
    if exported.exported_balance is not None and exported.exported_balance != view.balance:
        from .cost import predicted_cost

        cost = predicted_cost(view, exported.exported_balance)
        if cost.step_s is not None and view.predicted_step_s:
            fits = "" if cost.fits else ", over the memory limit"
            exported.cost_note = (f"the exported split {exported.exported_balance} is predicted at "
                                  f"{cost.step_s * 1e3:.3g} ms per step{fits} against the plan's "
                                  f"{view.predicted_step_s * 1e3:.3g} ms ({cost.step_s / view.predicted_step_s - 1:+.1%}; {cost.note})")
        else:
            exported.cost_note = f"the exported split {exported.exported_balance}: {cost.note}"
    for path in exported.files:
        if path != out:
            check_output_paths({"--out (its companion file)": path}, inputs=(plan_path,))
    with (contextlib.nullcontext(outputs) if outputs is not None else Outputs()) as written:
        for path, text in exported.files.items():
            written.add(path, text, "--out")
    return exported


def _target_module(target: str):
    from . import to_deepspeed, to_megatron, to_torch, to_torchtitan

    return {"torch": to_torch, "torchtitan": to_torchtitan, "megatron": to_megatron, "deepspeed": to_deepspeed}[target]


def describe_export(exported: Exported) -> list[str]:
    """What was written, and how close to the plan, a line each."""
    lines = [exported.summary, f"wrote {', '.join(exported.files)}",
             "exact: the target runs the plan's split" if exported.exact else
             "not exact: the target cannot express the plan's split (notes below)"]
    lines += [f"note: {n}" for n in exported.notes]
    if exported.cost_note:
        lines.append(f"note: {exported.cost_note}")
    return lines
