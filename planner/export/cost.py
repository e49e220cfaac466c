"""What the planner predicts for a split other than the plan's: the price of the nearest one.

When a target cannot express a plan's split exactly, the export gives the nearest one it can
(:mod:`.expressible`) and says what that costs: the same cost model, under the same setting
(M, schedule, recompute, links, limits), evaluated at the other boundaries. That needs the
per-layer figures, which live in the profile the plan was solved from (``profile.path``, read
relative to the current folder, then to the plan's), checked by its ``sha256``; without it the
export says the cost is unknown rather than guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ...artifacts import file_sha256
from .expressible import bounds_of
from ...plan_view import PlanView


@dataclass(frozen=True)
class SplitCost:
    """A split's predicted step and peak memory, or why there is none."""

    step_s: float | None
    peak_memory_bytes: float | None
    fits: bool | None
    note: str            # how it was found, or why it could not be


def predicted_cost(view: PlanView, balance: list[int]) -> SplitCost:
    """The planner's prediction for ``balance`` under the plan's own setting."""
    profile_path = plan_profile_path(view)
    if profile_path is None:
        return SplitCost(None, None, None, "its cost is unknown: the profile the plan was solved from is not here")
    from ..profile import Profile            # the planner proper loads only when a cost is asked for
    from ..command import load_profile
    from ..objective import evaluate
    from ..costmodel import CostModel
    from .setting import plan_setting

    profile: Profile = load_profile(str(profile_path))
    cm = CostModel(profile.at(view.micro_batch_size), plan_setting(view))
    recompute = [any(c.recompute for c in view.chunks_of(k)) for k in range(view.num_stages)]
    # The rebuilt model must price the plan's own split as the plan did, or its price of
    # another split means nothing.
    own = evaluate(cm, bounds_of(view.balance), recompute)
    if view.predicted_step_s is None or not math.isclose(own.step_s, view.predicted_step_s, rel_tol=1e-9):
        return SplitCost(None, None, None, "its cost is unknown: the plan's setting could not be rebuilt from the "
                                           "plan and its profile (solve the profile again)")
    ev = evaluate(cm, bounds_of(balance), recompute)
    return SplitCost(ev.step_s if math.isfinite(ev.step_s) else None, ev.peak_memory_bytes, bool(ev.fits),
                     f"predicted from the profile '{profile_path}'")


def plan_profile_path(view: PlanView) -> Path | None:
    """The plan's profile, where it can be found unchanged (same sha256), else None."""
    path, digest = view.profile_path, view.profile_sha256
    if path is None or digest is None:
        return None
    for candidate in (Path(path), Path(view.path).parent / path):
        try:
            if candidate.is_file() and file_sha256(str(candidate)) == digest:
                return candidate
        except OSError:
            continue
    return None
