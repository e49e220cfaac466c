"""A plan as the exporters read it: its chunks, stages and batch, and each layer's module name.

Every exporter (:mod:`.to_torch`, :mod:`.to_torchtitan`, :mod:`.to_megatron`,
:mod:`.to_deepspeed`) says the same plan in another trainer's words. What they all need is
here, read and checked once: the chunks in pipeline order with their layers, the stage each
runs on, M, the micro-batch size, the replicas, and, for every layer, the *module name* the
target knows it by.

**Module names.** A trainer names a model's parts by their fully qualified names in the
unsplit model (``model.layers.3``, ``lm_head``, ``0`` for an ``nn.Sequential``'s first child):
torchtitan's ``module_fqns_per_model_part``, torch's ``split_spec``. Since profile format 8 each
layer records the module it is (``layers[i].module``, null when a layer is not one module:
a piece of a traced graph, several merged modules), and a plan of format 6 copies them into
``chunks[c].modules``. An older plan of an imported model (a Hugging Face model or an
``nn.Sequential``) is read with the layer names as the module names, since those are how its
layers were named; a built-in model's older plan has no module names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...artifacts import BadInput
from ...plan_layout import check_replicas, data_parallel, gradient_sync, plan_chunks, virtual_stages
from ...schedules import Action, all_actions
from ...schema import PLAN_FORMAT, read_artifact, validate
from ...weight_versions import ASYNC_SCHEDULES


def refuse_asynchronous(view: "PlanView", target: str) -> None:
    """Refuse, in one line, to export an asynchronous plan: every target here (torch's
    pipelining schedules and their CSV, torchtitan, Megatron, DeepSpeed) flushes every step and
    keeps one version of the weights, so none can run PipeDream's weight stashing."""
    if view.schedule in ASYNC_SCHEDULES:
        raise BadInput(f"{target} runs synchronous pipelines only (a flush every step, one version of the "
                       f"weights): it cannot express the plan's {view.schedule}; train it with gpipe-plan run, or "
                       "solve again with a synchronous --schedule (e.g. 1f1b) to export")


@dataclass(frozen=True)
class ExportChunk:
    """One chunk: its place in the pipeline, its stage, its layers and their module names."""

    index: int
    stage: int
    layers: tuple[str, ...]
    modules: tuple[str | None, ...]    # per layer: the unsplit model's module name, None if not one module
    recompute: bool


@dataclass(frozen=True)
class PlanView:
    """What every exporter reads of a plan (checked: its chunks and stages fit together)."""

    path: str
    doc: dict[str, Any]
    model: dict[str, Any]
    schedule: str
    stages: int                      # K
    virtual_stages: int              # chunks per stage
    micro_batches: int               # M
    micro_batch_size: int            # samples per micro-batch of one replica
    global_batch_size: int           # samples per step, every replica
    data_parallel: int               # d
    gradient_sync: str               # ddp | fsdp
    chunks: tuple[ExportChunk, ...]
    placement_order: str = "pipeline-inner"    # how the plan laid ranks out (plan_layout.PLACEMENT_ORDERS)
    nodes: int = 1

    @property
    def layers(self) -> list[str]:
        """Every layer, in model order."""
        return [name for chunk in self.chunks for name in chunk.layers]

    @property
    def balance(self) -> list[int]:
        """Layers per chunk, in pipeline order."""
        return [len(chunk.layers) for chunk in self.chunks]

    @property
    def step_s(self) -> float | None:
        """The plan's predicted step (None for a plan written by hand)."""
        value = (self.doc.get("predicted") or {}).get("step_s")
        return float(value) if isinstance(value, (int, float)) else None

    def chunks_of_stage(self, k: int) -> list[ExportChunk]:
        return [chunk for chunk in self.chunks if chunk.stage == k]

    def actions(self) -> list[list[Action]]:
        """Every stage's action list: the schedule the planner simulated."""
        return all_actions(self.schedule, self.stages, self.micro_batches, self.virtual_stages)

    def placement_note(self, target: str) -> str | None:
        """What a target that numbers a stage's replicas consecutively (torchtitan's, Megatron's and
        DeepSpeed's default rank order: data-inner) changes of a plan placed otherwise across
        nodes; None when nothing changes (one node, one replica, the plan's order is theirs, or
        one stage: no pipeline sends to move, whatever order a plan of format 6 named)."""
        if self.data_parallel == 1 or self.nodes == 1 or self.stages == 1 or \
                self.placement_order in ("data-inner", "data-only"):
            return None
        return (f"{target} orders ranks data-inner (a stage's replicas on consecutive ranks); the plan placed "
                f"them {self.placement_order} over {self.nodes} nodes so that the pipeline's sends stay in a node: "
                f"under {target}'s order they cross the network and the gradient syncs stay in a node")

    def unnamed(self) -> list[str]:
        """The layers that are not one module of the unsplit model (a target cannot name them)."""
        return [name for chunk in self.chunks for name, module in zip(chunk.layers, chunk.modules) if module is None]


def read_plan(path: str) -> PlanView:
    """The plan at ``path``, checked by the schema and the chunk layout (BadInput in one line)."""
    doc = read_artifact(path, PLAN_FORMAT)
    where = f"plan '{path}'"
    validate(doc, "plan", where)
    check_replicas(doc, where)
    raw = plan_chunks(doc, where)
    model = doc.get("model") or {}
    chunks = []
    for item, entry in zip(raw, doc.get("chunks") or doc["stages"]):
        layers = tuple(item["layers"])
        chunks.append(ExportChunk(item["index"], item["stage"], layers, _modules(entry, layers, model, where),
                                  bool(item["recompute"])))
    placement = doc.get("placement") if isinstance(doc.get("placement"), dict) else {}
    return PlanView(path=path, doc=doc, model=model, schedule=doc["schedule"], stages=len(doc["stages"]),
                    virtual_stages=virtual_stages(doc), micro_batches=int(doc["micro_batches"]),
                    micro_batch_size=int(doc["micro_batch_size"]), global_batch_size=int(doc["global_batch_size"]),
                    data_parallel=data_parallel(doc), gradient_sync=gradient_sync(doc), chunks=tuple(chunks),
                    placement_order=str(placement.get("order") or "pipeline-inner"),
                    nodes=int(placement.get("nodes") or 1))


def _modules(entry: dict[str, Any], layers: tuple[str, ...], model: dict[str, Any],
             where: str) -> tuple[str | None, ...]:
    """Each layer's module name: the plan's ``modules`` (format 6), else the rule for older plans."""
    modules = entry.get("modules")
    if modules is not None:
        if not isinstance(modules, list) or len(modules) != len(layers) or \
                any(m is not None and (not isinstance(m, str) or not m) for m in modules):
            raise BadInput(f"{where}: 'chunks[{entry.get('index')}].modules' must give one module name (or null) "
                           f"per layer")
        return tuple(modules)
    if model.get("source") == "import":
        return layers                    # an imported model's layers are named by their module paths
    return (None,) * len(layers)


def model_name(view: PlanView) -> str:
    """The model as a person reads it: the built-in's name or the factory's path."""
    return str(view.model.get("name") or view.model.get("factory") or "the model")
