"""The plan as the runtime runs it: read by the one door (``gpipe_plan.plan_view``), then what
only a run refuses.

Every reader gets the same :class:`~gpipe_plan.plan_view.PlanView`; a run refuses besides a
plan of a model there is nothing to run of (an imported PipeDream profile), run options the
plan's gradient sync cannot honour, and a precision other than the one its profile measured.

No torch here: ``gpipe-plan run`` reads the plan in the launching process, which does not
import torch.
"""

from __future__ import annotations

import os
from typing import Any

from ..artifacts import BadInput
from ..plan_view import PlanView, read_plan


def load_plan(path: str | os.PathLike[str]) -> PlanView:
    """The plan at ``path``, read and checked (:func:`~gpipe_plan.plan_view.read_plan`), refused
    in one line when it was made from an imported PipeDream profile."""
    plan = read_plan(path)
    _refuse_imported_model(plan.model, f"plan '{path}'")
    return plan


def check_sync_matches(plan: PlanView, grad_clip: float | None) -> None:
    """Refuse, in one line, run options the plan's gradient sync cannot honour: ``--grad-clip``
    under localsgd, which clips by the global gradient norm while each replica steps on its own
    gradient (one norm over d different gradients would clip none of them by its own)."""
    if plan.gradient_sync == "localsgd" and plan.data_parallel > 1 and grad_clip is not None:
        raise BadInput("--grad-clip clips by the global gradient norm, but under the plan's localsgd each replica "
                       "steps on its own gradient: leave --grad-clip out, or solve with --gradient-sync ddp")


def check_precision_matches(plan: PlanView, precision: str | None, param_dtype: str | None) -> tuple[str, str]:
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


def _refuse_imported_model(model: dict[str, Any], where: str) -> None:
    """Refuse a plan of an imported PipeDream profile: it names no PyTorch model to build."""
    if model.get("source") == "pipedream":
        raise BadInput(f"{where} was made from an imported PipeDream profile ('{model.get('name')}'): "
                       f"it can be planned and shown, but there is no PyTorch model to run")
