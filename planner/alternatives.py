"""The plans ``gpipe-plan tune`` runs: those the cost model cannot tell apart from the chosen one.

[Note: when the host, not the model, must choose]
``solve`` ranks plans by their predicted step, and a prediction has an error: a few percent
where each rank has its own core or device, more where the ranks share a host's cores (the
kernel picks which rank runs, which the model spreads evenly: docs/planner.md, "More ranks than
cores") or where a GPU waits on its CPU to issue kernels. Two plans predicted closer than that
error are ranked by chance: the bench's small Llama on 4 ranks of a 2-core host, 1F1B, M = 2,
cut [1, 2, 1, 3] or [1, 1, 2, 3], both predicted 66.5 ms, ran 62.4-70.0 and 56.1-61.1 ms
(docs/benchmarks/fidelity.md). No cost model settles such a tie; a few steps of each on the
host do. So ``tune`` runs the chosen plan and the plans predicted within ``within`` of it, a
few steps each, rounds interleaved, and keeps the fastest measured (tune.py).

The candidates, best predicted first, the chosen plan always first among equals:

* the chosen plan;
* each runner-up (the best plan of another setting of the same stages and replicas: M,
  schedule, v) predicted within ``within`` of it;
* each cut one move from the chosen one ([Note: moving a layer across chunks] in
  planner/local_search.py) predicted within ``within``: the ties of one setting, which the
  search kept only one of.

Each is a whole plan document, made as ``solve`` makes one from the same profile and the
setting the plan recorded (planner/export/setting.py), so that ``run`` runs it as any plan.
This module needs the plan's profile (unchanged: its sha256 is checked); no torch.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Any

from ..artifacts import BadInput
from ..schedules import chunks_per_stage, stage_of_chunk
from ..schema import TUNING_SOURCES, check_built
from .costmodel import CostModel, Setting
from .export.cost import plan_profile_path
from .export.expressible import bounds_of
from .export.setting import plan_setting
from .local_search import moves
from .objective import Evaluation, Solution, evaluate, proven_optimal
from .plan import (chunk_rows, exposed_sync_s, one_pipeline_row, plan_warnings, runner_up, stage_rows,
                   step_predictions)
from .profile import Profile
from .search import Candidate
from .settings import size_charges

# What a candidate is, in the plan's ``tuning.candidates[].source``.
CHOSEN, RUNNER_UP, ONE_MOVE = TUNING_SOURCES


@dataclass(frozen=True)
class Alternative:
    """One plan to try: where it came from, its setting and cut, and its plan document."""

    source: str                      # CHOSEN, RUNNER_UP or ONE_MOVE
    setting: Setting
    micro_batch_size: int
    evaluation: Evaluation
    doc: dict[str, Any]

    @property
    def predicted_step_s(self) -> float:
        return self.evaluation.step_s


def alternatives(plan_doc: dict[str, Any], plan_path: str, within: float, most: int) -> list[Alternative]:
    """The chosen plan of ``plan_doc`` (read from ``plan_path``) and at most ``most - 1`` others
    predicted within ``within`` (a fraction: 0.05 is 5%) of its step, best predicted first
    ([Note: when the host, not the model, must choose]). Raises BadInput where the plan's
    profile is not at hand unchanged, or its setting cannot be rebuilt from it."""
    from ..plan_view import view_of
    from .command import load_profile

    view = view_of(plan_doc, "solved plan", f"plan '{plan_path}'", plan_path)
    if view.predicted_step_s is None:
        raise BadInput(f"plan '{plan_path}' has no prediction (a plan written by hand): tune compares "
                       f"plans solve made; solve the profile and tune its plan")
    profile_path = plan_profile_path(view)
    if profile_path is None:
        raise BadInput(f"plan '{plan_path}': its profile '{view.profile_path}' is not here unchanged (tune prices "
                       f"the other plans from it): put it back, or solve again")
    profile = load_profile(str(profile_path))
    setting = plan_setting(view)
    recompute = [any(c.recompute for c in view.chunks_of(k)) for k in range(view.num_stages)]
    cm = CostModel(profile.at(view.micro_batch_size), setting)
    chosen = evaluate(cm, bounds_of(view.balance), recompute)
    if not math.isclose(chosen.step_s, view.predicted_step_s, rel_tol=1e-9):
        raise BadInput(f"plan '{plan_path}': its setting could not be rebuilt from the plan and its profile "
                       f"(predicted {view.predicted_step_s * 1e3:.3f} ms, rebuilt {chosen.step_s * 1e3:.3f} ms): "
                       f"solve the profile again")
    limit = chosen.step_s * (1 + within)
    found: list[tuple[str, Setting, int, Evaluation]] = [(CHOSEN, setting, view.micro_batch_size, chosen)]
    for row in plan_doc.get("runners_up") or ():
        if not row.get("fits") or row.get("step_s") is None or row["step_s"] > limit:
            continue
        other = _at_size(replace(setting, micro_batches=row["micro_batches"], schedule=row["schedule"],
                                 virtual_stages=row.get("virtual_stages") or 1),
                         profile, row["micro_batch_size"], view.micro_batch_size)
        flags = row.get("recompute") or [False] * len(row["balance"])
        per_stage = [False] * setting.stages
        for c, flag in enumerate(flags):
            per_stage[stage_of_chunk(other.schedule, c, other.stages)] |= bool(flag)
        ev = evaluate(CostModel(profile.at(row["micro_batch_size"]), other), bounds_of(row["balance"]), per_stage)
        if ev.fits and math.isclose(ev.step_s, row["step_s"], rel_tol=1e-9):
            found.append((RUNNER_UP, other, row["micro_batch_size"], ev))
    for bounds in moves(chosen.bounds):
        ev = evaluate(cm, bounds, recompute)
        if ev.fits and ev.step_s <= limit:
            found.append((ONE_MOVE, setting, view.micro_batch_size, ev))
    # Best predicted first (a stable sort: among equals, as found).
    found.sort(key=lambda item: item[3].step_s)
    # solve's plan as a runner-up of a runner-up made the plan (as solve would list it)
    optimality = plan_doc.get("optimality") or {}
    own = Candidate(setting, view.micro_batch_size, Solution(chosen, bool(optimality.get("proven")),
                                                             optimality.get("lower_bound_s") or 0.0, "solve's plan"))
    own_row = runner_up(own, plan_doc["global_batch_size"], setting.data_parallel)
    out: list[Alternative] = []
    for source, st, size, ev in _chosen_first(found, most):
        doc = plan_doc if source == CHOSEN else _plan_doc(plan_doc, profile, st, size, ev, source, own_row)
        out.append(Alternative(source, st, size, ev, doc))
    return out


def _at_size(setting: Setting, profile: Profile, size: int, plan_size: int) -> Setting:
    """``setting`` (the plan's, rebuilt from what it recorded at ``plan_size``) for micro-batches
    of ``size``: solve charged each setting its own size's figures (planner/settings.py,
    ``size_charges``)."""
    if size == plan_size:
        return setting
    return replace(setting, **size_charges(profile, setting.stages, size))


def _chosen_first(found: list, most: int) -> list:
    """The chosen plan, then the ``most - 1`` best others (``found`` best first)."""
    chosen = next(item for item in found if item[0] == CHOSEN)
    return [chosen, *[item for item in found if item is not chosen][:max(0, most - 1)]]


def _plan_doc(base: dict[str, Any], profile: Profile, setting: Setting, micro_batch_size: int, ev: Evaluation,
              source: str, base_row: dict[str, Any]) -> dict[str, Any]:
    """``base`` (the chosen plan's document) made another plan's: its setting, cut and
    predictions, as ``solve`` would have written them had it chosen this one; what solve was asked
    (``options``), its profile and placement stay, and its runners-up, where a runner-up made the
    plan gives its row to solve's plan (``base_row``, its runners-up row)."""
    doc = copy.deepcopy(base)
    M = setting.micro_batches
    global_batch = doc["global_batch_size"]
    lower = (doc.get("optimality") or {}).get("lower_bound_s")
    proven = lower is not None and proven_optimal(ev.step_s, lower)
    doc.update({
        "balance": ev.balance,
        "micro_batches": M,
        "micro_batch_size": micro_batch_size,
        "schedule": setting.schedule,
        "virtual_stages": chunks_per_stage(setting.schedule, setting.virtual_stages),
        "updates_per_step": ev.updates_per_step,
        "chunks": chunk_rows(profile.layers, ev),
        "stages": stage_rows(ev, M, setting.schedule),
    })
    # what this setting is charged at its own micro-batch size (plan.py's options, _at_size)
    doc["options"].update({"per_microbatch_overhead_s": setting.overhead_s,
                           "fixed_costs": setting.fixed_costs.record()})
    predicted = doc["predicted"]
    predicted.update(step_predictions(ev, M, global_batch))
    predicted["gradient_sync_s"] = exposed_sync_s(profile, micro_batch_size, setting, ev)
    if predicted.get("one_stage_step_s") is not None and ev.step_s > 0:
        predicted["speedup_over_one_stage"] = predicted["one_stage_step_s"] / ev.step_s
    if doc.get("optimality"):
        doc["optimality"].update({"proven": proven, "method": f"gpipe-plan tune's candidate ({source})",
                                  "gap": (ev.step_s / lower - 1.0) if lower else None})
    if source == RUNNER_UP:
        doc["runners_up"] = _runners_up_beside(base, doc, base_row)
    if len(doc.get("factorisations") or ()) == 1:
        doc["factorisations"] = [one_pipeline_row(ev, proven, global_batch)]
    solution = Solution(ev, proven, lower if lower is not None else 0.0, f"tune's candidate ({source})")
    doc["warnings"] = plan_warnings(profile, Candidate(setting, micro_batch_size, solution), ev)
    check_built(doc, "solved plan", f"tune's candidate ({source})")
    return doc


def _runners_up_beside(base: dict[str, Any], doc: dict[str, Any], base_row: dict[str, Any]) -> list[dict[str, Any]]:
    """The runners-up of ``doc``, a runner-up of ``base`` made the plan: the same settings, its
    own row replaced by ``base_row`` (``base``'s plan), best first."""
    def key(row: dict[str, Any]) -> tuple:
        return row["schedule"], row["micro_batches"], row["micro_batch_size"], row.get("virtual_stages") or 1

    rows = [row for row in base.get("runners_up") or () if key(row) != key(doc)] + [base_row]
    return sorted(rows, key=lambda row: (not row.get("fits"), row.get("step_s") or math.inf))
