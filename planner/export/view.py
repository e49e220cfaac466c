"""What the exporters share of a plan: the one plan view, and the words they all use about it.

Every exporter (:mod:`.to_torch`, :mod:`.to_torchtitan`, :mod:`.to_megatron`,
:mod:`.to_deepspeed`) says the same plan in another trainer's words. They read it by the one
door every reader uses (:func:`gpipe_plan.plan_view.read_plan`: its chunks in pipeline order
with their layers and each layer's module name, the stage each runs on, M, the micro-batch
size, the replicas); what is here is what only exporting asks of it: whether the target can
run its schedule at all, what a target's own rank order changes, which layers no target can
name.
"""

from __future__ import annotations

from ...artifacts import BadInput
from ...plan_view import PlanView
from ...weight_versions import ASYNC_SCHEDULES


def refuse_asynchronous(view: PlanView, target: str) -> None:
    """Refuse, in one line, to export an asynchronous plan: every target here (torch's
    pipelining schedules and their CSV, torchtitan, Megatron, DeepSpeed) flushes every step and
    keeps one version of the weights, so none can run PipeDream's weight stashing."""
    if view.schedule in ASYNC_SCHEDULES:
        raise BadInput(f"{target} runs synchronous pipelines only (a flush every step, one version of the "
                       f"weights): it cannot express the plan's {view.schedule}; train it with gpipe-plan run, or "
                       "solve again with a synchronous --schedule (e.g. 1f1b) to export")


def placement_note(view: PlanView, target: str) -> str | None:
    """What a target that numbers a stage's replicas consecutively (torchtitan's, Megatron's and
    DeepSpeed's default rank order: data-inner) changes of a plan placed otherwise across
    nodes; None when nothing changes (one node, one replica, the plan's order is theirs, or
    one stage: no pipeline sends to move, whatever order a plan of format 6 named)."""
    if view.data_parallel == 1 or view.nodes == 1 or view.num_stages == 1 or \
            view.placement_order in ("data-inner", "data-only"):
        return None
    return (f"{target} orders ranks data-inner (a stage's replicas on consecutive ranks); the plan placed "
            f"them {view.placement_order} over {view.nodes} nodes so that the pipeline's sends stay in a node: "
            f"under {target}'s order they cross the network and the gradient syncs stay in a node")


def unnamed(view: PlanView) -> list[str]:
    """The layers that are not one module of the unsplit model (a target cannot name them)."""
    return [name for chunk in view.chunks for name, module in zip(chunk.layers, chunk.modules) if module is None]


def model_name(view: PlanView) -> str:
    """The model as a person reads it: the built-in's name or the factory's path."""
    return str(view.model.get("name") or view.model.get("factory") or "the model")
