"""The plan as the runtime reads it: checked once, up front, then plain attributes.

A plan (docs/plan-format.md) says which layers each stage holds, how the batch is split into
micro-batches, in which order the stages run them, and what the planner predicted. The
runtime trusts nothing it has not checked: a hand-edited or truncated plan is refused here,
in one line that names the key, before any process starts. Checks that need the model (do
the layer names match it?) happen on each rank, in :mod:`.stage`.

No torch here: ``gpipe-plan run`` reads the plan in the launching process, which does not
import torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..artifacts import PLAN_FORMAT, BadInput, file_sha256, precision_of, read_artifact
from ..schema import validate
from .schedule import SCHEDULES


@dataclass(frozen=True)
class StagePlan:
    """One stage of the plan: its layers and what the planner predicted for it."""

    index: int
    layers: tuple[str, ...]
    first_layer: int
    recompute: bool
    forward_s: float | None          # predicted, per micro-batch
    backward_s: float | None         # predicted, per micro-batch (with recomputation)
    memory_bytes: float | None       # predicted peak
    memory_parts: dict[str, float]   # the parts of memory_bytes (params_bytes, activations_bytes, ...)
    idle_fraction: float | None
    output_shapes: tuple[tuple[int, ...], ...] | None   # per sample; None: derive by running
    output_dtypes: tuple[str, ...] | None
    # Per output: True (the default) when it is made per sample, its shape above without the
    # batch; False when it is the same for every micro-batch, its shape above whole.
    output_batched: tuple[bool, ...] | None = None


@dataclass(frozen=True)
class RunPlan:
    """Everything the runtime needs from a plan file."""

    path: str
    sha256: str
    doc: dict[str, Any]
    model: dict[str, Any]
    stages: tuple[StagePlan, ...]
    micro_batches: int
    micro_batch_size: int
    global_batch_size: int
    schedule: str
    predicted_step_s: float | None
    predicted_bubble_fraction: float | None
    predicted_samples_per_s: float | None
    profile_device: dict[str, Any]
    optimizer: str | None            # the optimizer the plan's memory model counted
    precision: str = "fp32"          # the compute dtype the profile measured (artifacts.PRECISIONS)
    param_dtype: str = "fp32"        # the dtype the parameters were kept in

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def profile_threads(self) -> int | None:
        threads = self.profile_device.get("threads")
        return threads if isinstance(threads, int) and threads >= 1 else None

    @property
    def layer_names(self) -> list[str]:
        return [name for stage in self.stages for name in stage.layers]


def load_plan(path: str | os.PathLike[str]) -> RunPlan:
    """Read and check a plan file; raise :class:`BadInput` naming the first problem."""
    doc = read_artifact(path, PLAN_FORMAT)
    where = f"plan '{path}'"
    # Every key's type and range (gpipe_plan/schema.py); below, how the keys fit together.
    validate(doc, "plan", where)

    def need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], context: str = "") -> Any:
        if key not in obj:
            raise BadInput(f"{where} has no '{context}{key}'")
        value = obj[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise BadInput(f"{where}: '{context}{key}' is {value!r}, expected {_kind_name(kind)}")
        return value

    model = need(doc, "model", dict)
    precision, param_dtype = precision_of(doc, where)
    if model.get("source") == "pipedream":
        raise BadInput(f"{where} was made from an imported PipeDream profile ('{model.get('name')}'): "
                       f"it can be planned and shown, but there is no PyTorch model to run")
    balance = need(doc, "balance", list)
    M = need(doc, "micro_batches", int)
    b = need(doc, "micro_batch_size", int)
    B = need(doc, "global_batch_size", int)
    schedule = need(doc, "schedule", str)
    raw_stages = need(doc, "stages", list)
    if schedule not in SCHEDULES:
        raise BadInput(f"{where}: schedule '{schedule}' is not one of {', '.join(SCHEDULES)}")
    if M < 1 or b < 1 or M * b != B:
        raise BadInput(f"{where}: micro_batches {M} x micro_batch_size {b} must equal global_batch_size {B}")
    if not raw_stages:
        raise BadInput(f"{where} has no stages")
    if len(balance) != len(raw_stages) or not all(isinstance(n, int) and n >= 1 for n in balance):
        raise BadInput(f"{where}: balance {balance} must have one positive count per stage ({len(raw_stages)} stages)")

    stages = []
    first = 0
    for k, raw in enumerate(raw_stages):
        ctx = f"stages[{k}]."
        if not isinstance(raw, dict):
            raise BadInput(f"{where}: stages[{k}] is not an object")
        names = need(raw, "layers", list, ctx)
        if len(names) != balance[k] or not all(isinstance(n, str) for n in names):
            raise BadInput(f"{where}: stages[{k}].layers has {len(names)} names, balance says {balance[k]}")
        shapes = raw.get("output_shapes")
        dtypes = raw.get("output_dtypes")
        if shapes is not None:
            if not isinstance(shapes, list) or not all(isinstance(s, list) for s in shapes):
                raise BadInput(f"{where}: stages[{k}].output_shapes must be a list of shapes")
            if not isinstance(dtypes, list) or len(dtypes) != len(shapes):
                raise BadInput(f"{where}: stages[{k}].output_dtypes must give one dtype per output shape")
        batched = raw.get("output_batched")
        if batched is not None and (shapes is None or not isinstance(batched, list) or len(batched) != len(shapes)
                                    or not all(isinstance(b, bool) for b in batched)):
            raise BadInput(f"{where}: stages[{k}].output_batched must give true or false per output shape")
        stages.append(StagePlan(
            index=k,
            layers=tuple(names),
            first_layer=first,
            recompute=bool(raw.get("recompute", False)),
            forward_s=_number(raw.get("forward_s")),
            backward_s=_number(raw.get("backward_s")),
            memory_bytes=_number(raw.get("memory_bytes")),
            memory_parts={k: float(v) for k, v in (raw.get("memory") or {}).items() if _number(v) is not None},
            idle_fraction=_number(raw.get("idle_fraction")),
            output_shapes=tuple(tuple(int(d) for d in s) for s in shapes) if shapes is not None else None,
            output_dtypes=tuple(str(d) for d in dtypes) if shapes is not None else None,
            output_batched=tuple(batched) if batched is not None else None,
        ))
        first += len(names)
    all_names = [n for s in stages for n in s.layers]
    if len(set(all_names)) != len(all_names):
        raise BadInput(f"{where}: a layer name appears in more than one place")

    predicted = doc.get("predicted") if isinstance(doc.get("predicted"), dict) else {}
    profile = doc.get("profile") if isinstance(doc.get("profile"), dict) else {}
    options = doc.get("options") if isinstance(doc.get("options"), dict) else {}
    device = profile.get("device") if isinstance(profile.get("device"), dict) else {}
    optimizer = options.get("optimizer") if isinstance(options.get("optimizer"), str) else None
    return RunPlan(
        path=os.fspath(path),
        sha256=file_sha256(path),
        doc=doc,
        model=model,
        stages=tuple(stages),
        micro_batches=M,
        micro_batch_size=b,
        global_batch_size=B,
        schedule=schedule,
        predicted_step_s=_number(predicted.get("step_s")),
        predicted_bubble_fraction=_number(predicted.get("bubble_fraction")),
        predicted_samples_per_s=_number(predicted.get("samples_per_s")),
        profile_device=device,
        optimizer=optimizer,
        precision=precision,
        param_dtype=param_dtype,
    )


def check_precision_matches(plan: RunPlan, precision: str | None, param_dtype: str | None) -> tuple[str, str]:
    """The precision to run with: the plan's, unless asked for another, which is refused.

    A plan's times and memory were measured in its profile's precision; run in another, the
    prediction is off by up to an order of magnitude in time and 2x in memory, and the
    shapes it sends between stages have other dtypes.
    """
    for flag, asked, planned in (("--precision", precision, plan.precision),
                                 ("--param-dtype", param_dtype, plan.param_dtype)):
        if asked is not None and asked != planned:
            wanted = (precision or plan.precision, param_dtype or plan.param_dtype)
            raise BadInput(f"{flag} {asked} differs from plan '{plan.path}', made from a profile measured with "
                           f"{flag} {planned}: re-profile with --precision {wanted[0]} --param-dtype {wanted[1]} "
                           f"and solve again, or drop {flag}")
    return plan.precision, plan.param_dtype


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {dict: "an object", list: "a list", int: "an integer", str: "a string", bool: "true or false"}
    if isinstance(kind, tuple):
        return " or ".join(names.get(k, k.__name__) for k in kind)
    return names.get(kind, kind.__name__)
