"""The plan document (format ``gpipe-plan.plan``; see docs/plan-format.md).

Everything in it is a function of the profile and the options, with no timestamp and with
ties broken by a fixed order, so the same inputs give the same bytes: plans can be diffed,
cached and checked into a repository.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

from ..hostload import STEADY_SPREAD, busy_phases, busy_profile_text
from ..schema import FORMAT_VERSIONS, PLAN_FORMAT
from ..schedules import SPLIT_BACKWARD, chunks_per_stage, label
from ..speedprobe import STEADY
from ..weight_versions import ASYNC_SCHEDULES, staleness, stashed_versions
from . import milp
from .costmodel import CostModel
from .fixedcosts import PROBE_MISFIT_WARN, probe_misfit
from .objective import Evaluation, evaluate
from .profile import Profile
from .replicas import DevicesResult, Factorisation, placements, Topology
from .one_device import OneStage
from .problem import SolveOptions, global_batch_source
from .search import Candidate, SearchResult
from ..units import format_percent, format_seconds

MAX_RUNNERS_UP = 12
# A later stage's optimizer wait under this share of the step is not worth a warning: no decision turns on it.
OPTIMIZER_WAIT_QUIET = 0.01


def build_plan(profile: Profile, profile_path: str, profile_sha256: str, request: SolveOptions, result: SearchResult,
               one_stage: OneStage | None = None, devices: DevicesResult | None = None) -> dict[str, Any]:
    """The plan document for the search's best plan; ``request``: what ``solve`` was asked.

    ``one_stage``: the best plan of the same global batch on one device
    (:func:`.one_device.one_stage_baseline`), which the plan compares itself with; None leaves the
    comparison out, except for a one-device plan, which is its own baseline. ``devices``: the
    search over K stages x d replicas (:func:`.replicas.search_devices`); ``result`` is then its
    best factorisation's pipeline search (batch global / d). Without it: one replica.

    This function only puts the sections in order; each larger one is made by a function below
    named for it.
    """
    best = result.best
    assert best.solution is not None
    ev = best.solution.evaluation
    setting = best.setting
    chosen = devices.best if devices is not None else None
    replicas = setting.data_parallel
    global_batch = devices.global_batch_size if devices is not None else result.batch
    optimality = optimality_section(best.solution.method, ev.step_s, result, devices)
    return {
        "format": PLAN_FORMAT,
        "version": FORMAT_VERSIONS[PLAN_FORMAT],
        "model": profile.model,
        "precision": profile.precision,
        "param_dtype": profile.param_dtype,
        "profile": profile_section(profile, profile_path, profile_sha256),
        "options": options_section(profile, request, result, devices, global_batch),
        "balance": ev.balance,
        "micro_batches": setting.micro_batches,
        "micro_batch_size": best.micro_batch_size,
        "global_batch_size": global_batch,
        "schedule": setting.schedule,
        "virtual_stages": chunks_per_stage(setting.schedule, setting.virtual_stages),
        "data_parallel": replicas,
        "gradient_sync": setting.gradient_sync,
        # Version 8: each stage's updates a step (asynchronous schedules: gpipe_plan.weight_versions).
        "updates_per_step": ev.updates_per_step,
        # localsgd's H (plan_layout.sync_every); ddp and fsdp plans leave it out: they sync every step.
        **({"sync_every": setting.sync_every} if setting.gradient_sync == "localsgd" else {}),
        "placement": placement_doc(chosen, len(ev.stages)),
        "chunks": chunk_rows(profile.layers, ev),
        "stages": stage_rows(ev, setting.micro_batches, setting.schedule),
        "predicted": predicted_section(profile, best, ev, one_stage, devices, global_batch),
        "optimality": optimality,
        "factorisations": factorisation_rows(devices) if devices is not None else [
            one_pipeline_row(ev, result.proven, global_batch)],
        "runners_up": runners_up(result.candidates, global_batch, replicas),
        "warnings": plan_warnings(profile, best, ev) + unproven_warnings(optimality, request.time_budget_s),
    }


def profile_section(profile: Profile, path: str, sha256: str) -> dict[str, Any]:
    """The plan's ``profile``: the file it was made from (path and hash) and the device it measured."""
    return {"path": path, "sha256": sha256, "device": profile.device, "micro_batch_sizes": profile.sizes}


def options_section(profile: Profile, request: SolveOptions, result: SearchResult, devices: DevicesResult | None,
                    global_batch_size: int) -> dict[str, Any]:
    """The plan's ``options``: what ``solve`` was asked (``request``), so that the plan can be
    made again; the link, overhead and compute scale are what the chosen setting charged.
    """
    setting = result.best.setting
    return {
        "stages": request.stages,
        "global_batch_size": global_batch_size,
        "global_batch_size_source": global_batch_source(profile, request),
        "micro_batches": request.micro_batches,
        "schedule": request.schedule,
        "recompute": request.recompute,
        "memory_limit_bytes": request.memory_limit_bytes,
        "memory_limit_source": request.memory_limit_source,
        # The link inside a node (the user's or the profile's); with several nodes what the
        # pipeline's sends were charged is the placement's pipeline_* (the network, perhaps).
        "link_bandwidth_bytes_per_s": _finite_or_none(devices.topology.link_bandwidth_bytes_per_s
                                                      if devices is not None else setting.link_bandwidth_bytes_per_s),
        "link_latency_s": devices.topology.link_latency_s if devices is not None else setting.link_latency_s,
        "per_microbatch_overhead_s": setting.overhead_s,
        "fixed_costs": setting.fixed_costs.record(),
        "compute_scale": setting.compute_scale,
        # More ranks than cores (planner/timeshare.py): the ranks the host ran at once (null: a core each).
        "concurrent_ranks": setting.concurrent_ranks if setting.time_shared else None,
        # ... and what every action was charged there beyond its time on a core of its own.
        "shared_core_slowdown": setting.action_slowdown if setting.time_shared else None,
        "shared_core_action_s": setting.action_added_s if setting.time_shared else None,
        "optimizer": request.optimizer,
        "solver": request.solver,
        "virtual_stages": request.virtual_stages,
        "devices": request.devices,
        "data_parallel": request.data_parallel,
        "nodes": request.nodes,
        "network_bandwidth_bytes_per_s": _finite_or_none(request.network_bandwidth_bytes_per_s),
        "network_latency_s": request.network_latency_s,
        "gradient_sync": request.gradient_sync,
        **({"sync_every": request.sync_every} if request.gradient_sync == "localsgd" else {}),
    }


def chunk_rows(layers: list[dict[str, Any]], ev: Evaluation) -> list[dict[str, Any]]:
    """The plan's ``chunks``: each chunk's layers, its predicted times per micro-batch, and the
    tensors it sends on (``layers``: the profile's)."""
    rows = []
    for ch in ev.chunks:
        last = layers[ch.end - 1]
        row: dict[str, Any] = {
            "index": ch.index,
            "stage": ch.stage,
            "layers": [layers[i]["name"] for i in range(ch.start, ch.end)],
            # What other trainers call them (export): the unsplit model's module names.
            "modules": [layers[i].get("module") for i in range(ch.start, ch.end)],
            # What run checks the rebuilt model against: a model changed since its profile.
            "param_bytes": [layers[i]["param_bytes"] for i in range(ch.start, ch.end)],
            "first_layer": ch.start,
            "recompute": ch.recompute,
            "forward_s": ch.forward_s,
            "backward_s": ch.backward_s,
            "backward_input_s": ch.backward_input_s,
            "backward_weight_s": ch.backward_weight_s,
            "recompute_s": ch.recompute_s,
            "send_s": ch.send_s,
        }
        # Every chunk's outputs, the last one's too: the torch executor checks the logits'
        # dtype, which mixed precision changes and which only the profiled device can say.
        if last.get("output_shapes") is not None:
            row["output_shapes"] = last["output_shapes"]
            if last.get("output_dtypes") is not None:
                row["output_dtypes"] = last["output_dtypes"]
            if last.get("output_batched") is not None:  # a tensor the same for every micro-batch
                row["output_batched"] = last["output_batched"]
        rows.append(row)
    return rows


def stage_rows(ev: Evaluation, micro_batches: int, schedule: str = "gpipe") -> list[dict[str, Any]]:
    """The plan's ``stages``: each stage's chunks, its predicted memory by part, how busy it is,
    and (version 8) how stale its gradients are and how many weight versions it holds: an
    asynchronous schedule's (gpipe_plan.weight_versions), else 0 and 1."""
    busy = ev.busy_s(micro_batches)
    K = len(ev.stages)
    asynchronous = schedule in ASYNC_SCHEDULES
    rows = []
    for k, st in enumerate(ev.stages):
        rows.append({
            "index": k,
            "chunks": list(st.chunks),
            "optimizer_s": st.optimizer_s,
            "gradient_sync_s": st.gradient_sync_s,
            "memory_bytes": int(math.ceil(st.memory_bytes)),
            "memory": {
                "params_bytes": int(st.params_bytes),
                "gradients_bytes": int(st.gradients_bytes),
                "optimizer_state_bytes": int(st.optimizer_state_bytes),
                "buffers_bytes": int(st.buffers_bytes),
                "activations_bytes": int(math.ceil(st.activations_bytes)),
                "transient_bytes": int(math.ceil(st.transient_bytes)),
            },
            "in_flight": st.in_flight,
            "busy_s": busy[k],
            "idle_fraction": max(0.0, 1.0 - busy[k] / ev.step_s) if ev.step_s > 0 else 0.0,
            "staleness_updates": staleness(schedule, k, K) if asynchronous else 0,
            "weight_versions": stashed_versions(schedule, k, K) if asynchronous else 1,
        })
    return rows


def predicted_section(profile: Profile, best: Candidate, ev: Evaluation, one_stage: OneStage | None,
                      devices: DevicesResult | None, global_batch_size: int) -> dict[str, Any]:
    """The plan's ``predicted``: the step, what the gradient syncs add to it, the comparison with
    one device, and how far chance alone may move a run from it (``ev``: ``best``'s evaluation)."""
    devices_used = best.setting.stages * best.setting.data_parallel
    # The neighbours whose noise reaches a stage are the processes on its own node: every one
    # of the K x d on one node, at most a node's worth with several.
    processes_per_node = devices_used if devices is None else min(devices_used, devices.topology.devices_per_node)
    return {**step_predictions(ev, best.setting.micro_batches, global_batch_size),
            "gradient_sync_s": exposed_sync_s(profile, best.micro_batch_size, best.setting, ev),
            **versus_one_stage(ev, one_stage, devices_used),
            **prediction_noise(profile, processes_per_node)}


def step_predictions(ev: Evaluation, micro_batches: int, global_batch_size: int) -> dict[str, Any]:
    """The step's predicted time, bubble, throughput and peak memory (the start of ``predicted``)."""
    return {
        "step_s": ev.step_s,
        "makespan_s": ev.makespan_s,
        "bubble_fraction": ev.bubble_fraction(micro_batches),
        "samples_per_s": global_batch_size / ev.step_s if ev.step_s > 0 else None,
        "peak_memory_bytes": int(math.ceil(ev.peak_memory_bytes)),
        "optimizer_wait_s": ev.optimizer_wait_s,
        # More ranks than cores: the step with a core per rank, which sharing them lengthens to step_s.
        "dedicated_step_s": ev.dedicated_step_s,
        # Version 8, asynchronous schedules (null otherwise): step_s is M periods of the steady
        # state; the fill and drain beyond them are paid once per run (planner/asynchronous.py).
        "steady_state_period_s": ev.steady_state_period_s,
        "fill_drain_s": ev.fill_drain_s,
    }


def optimality_section(method: str, step_s: float, result: SearchResult,
                       devices: DevicesResult | None) -> dict[str, Any]:
    """The plan's ``optimality``: whether the search proved the plan the fastest, and its gap to
    the proven lower bound (``method`` and ``step_s``: the chosen plan's)."""
    # Over every setting searched (each M, schedule) and every (K, d) and placement, not only
    # the chosen one.
    if devices is not None:
        proven, lower_bound, bound_by = devices.proven, devices.lower_bound_s, devices.bound_by
        searched = [c for f in devices.factorisations if f.result is not None for c in f.result.candidates]
    else:
        proven, lower_bound, bound_by = result.proven, result.lower_bound_s, result.bound_by
        searched = result.candidates
    settings_bound_by: dict[str, int] = {}
    for c in searched:
        if c.solution is not None:
            settings_bound_by[c.solution.bound_by] = settings_bound_by.get(c.solution.bound_by, 0) + 1
    return {
        "proven": proven,
        "method": method,
        "settings_searched": len(searched),
        "lower_bound_s": lower_bound,
        "gap": (step_s / lower_bound - 1.0) if lower_bound > 0 else None,
        "bound_by": bound_by,
        "settings_bound_by": dict(sorted(settings_bound_by.items())),
        "milp_solver": milp.available(),
    }


def unproven_warnings(optimality: dict[str, Any], time_budget_s: float) -> list[str]:
    """What a plan the search did not prove optimal says of it: how far from the best possible it
    can be, and what would search further (nothing when it is proven)."""
    if optimality["proven"]:
        return []
    gap = optimality["gap"]
    how_far = (f": it is at most {gap:.2%} slower than the best plan possible (optimality.gap)"
               if gap is not None else "")
    return [f"the search spent its --time-budget ({time_budget_s:g} s) before proving this plan "
            f"optimal{how_far}; a larger --time-budget searches further"]


def plan_warnings(profile: Profile, best: Candidate, ev: Evaluation) -> list[str]:
    """What the user should know before trusting the prediction, one sentence each
    (``ev``: ``best``'s evaluation; whether the search proved it: :func:`unproven_warnings`)."""
    setting = best.setting
    lo, hi = profile.measured_range()
    warnings = []
    if not lo <= best.micro_batch_size <= hi:
        warnings.append(
            f"micro-batch size {best.micro_batch_size} is outside the profiled sizes {lo}..{hi}: "
            "its times are extrapolated; profile with --micro-batch-sizes covering it for a firmer prediction")
    if ev.optimizer_wait_s > OPTIMIZER_WAIT_QUIET * ev.step_s:
        warnings.append(
            f"a later stage's work after its last backward (gradient sync, optimizer step) outlasts the next "
            f"step's fill before it by {format_seconds(ev.optimizer_wait_s)}: {format_percent(ev.optimizer_wait_s / ev.step_s, 1)} "
            f"of the {format_seconds(ev.step_s)} step, already in the prediction (predicted.optimizer_wait_s) and "
            "weighed by the search against the other splits and schedules; only a faster optimizer step or "
            "gradient sync on that stage would remove it")
    if setting.data_parallel > 1 and not math.isfinite(setting.sync_bandwidth_bytes_per_s) \
            and setting.sync_latency_s == 0:
        warnings.append(
            f"the gradient syncs of the {setting.data_parallel} replicas are charged nothing: the profile has no "
            "link figures and no --link-bandwidth was given, so more replicas always look free; profile with "
            "--measure-link, or give --link-bandwidth, for a plan that weighs them")
    if profile.fixed_costs is None and setting.stages > 1 and profile.model.get("source") != "pipedream":
        warnings.append(
            "the profile measured no fixed costs per action and message (profile format 9): the plan charges "
            f"{'the calibrated overhead' if profile.calibrated_overhead_s else 'nothing'} for the runtime's work "
            "per action, so schedules of many chunks (interleaved) look cheaper than they run; profile again "
            "(`gpipe-plan profile` measures them unless told --no-fixed-costs)")
    misfit = probe_misfit(profile.fixed_costs_record, setting.schedule, setting.virtual_stages,
                          best.micro_batch_size) if setting.stages > 1 else None
    if misfit is not None and misfit[0] > PROBE_MISFIT_WARN:
        shape = label(setting.schedule, setting.virtual_stages)
        warnings.append(
            f"the profile's probe ran {shape} at {misfit[0]:.2f}x the step its fitted fixed costs predict (2 stages, "
            f"micro-batch {misfit[1]}): this plan is likely to run slower than predicted by about as much "
            "(docs/planner.md, \"Fixed costs\"); compare it with another --schedule, or run both")
    if setting.time_shared:
        ranks = setting.stages * setting.data_parallel
        measured = profile.shared_core_slowdown is not None
        slower = (f"every action {setting.action_slowdown:.2f}x slower than on a core of its own and "
                  f"{format_seconds(setting.action_added_s)} longer, as the profile measured with ranks sharing its "
                  "cores" if measured else
                  "the profile did not measure how much slower ranks run there (profile format 10, "
                  "'--shared-cores'), so it runs slower than predicted")
        warnings.append(
            f"the {ranks} ranks share {profile.host_cores} core{'s' if profile.host_cores != 1 else ''} of the "
            f"profiled host, which runs {setting.concurrent_ranks * setting.data_parallel:g} at once: the step is "
            f"predicted with the cores shared fairly among the ranks computing ({format_seconds(ev.step_s)}, against "
            f"{format_seconds(ev.dedicated_step_s or ev.step_s)} were no more of them computing at once than it "
            f"runs), {slower} (docs/planner.md, \"More ranks than cores\"); as many stages as cores, or fewer, "
            "avoid it")
    if setting.compute_scale > 1.0 and profile.contention_spread > STEADY_SPREAD:
        readings = profile.contention_readings
        warnings.append(
            f"the profile measured the neighbours' slowdown, which the plan charges on every layer "
            f"({setting.compute_scale:.2f}x here), while the host's own speed swung (its cycles spread by "
            f"{profile.contention_spread:.2f} in the steadiest of {readings} reading{'s' if readings != 1 else ''}): "
            "the step may be off by as much; profile again on a quiet host")
    if profile.layer_slowness > 1 + STEADY:
        warnings.append(
            f"the profile timed its layers while the host ran {profile.layer_slowness - 1:.0%} slower than its own "
            f"speed (the speed probe around them, the least slow of {profile.layer_tries} "
            f"tr{'ies' if profile.layer_tries != 1 else 'y'}): the step may be predicted as much too slow; profile "
            "again when the host holds its speed")
    busy = busy_phases(profile.doc.get("host_load"))
    if busy:
        warnings.append(
            f"the profile was measured on a busy host ({busy_profile_text(busy)}): its times are partly the other "
            "processes', and so is this plan's prediction; profile again on a quiet host")
    if setting.schedule in ASYNC_SCHEDULES:
        K = setting.stages
        stale = sorted({staleness(setting.schedule, k, K) for k in range(K)})
        warnings.append(
            f"{setting.schedule} never flushes: its gradients are {'-'.join(map(str, (stale[0], stale[-1]))) if len(stale) > 1 else stale[0]} "
            "update(s) stale (stages[].staleness_updates), which changes what training computes; compare its loss "
            "with a synchronous schedule's before relying on it (docs/planner.md, \"Asynchronous pipelines\")")
    if setting.schedule == "pipedream" and setting.micro_batches > 1:
        # pipedream updates after every micro-batch: M, chosen for speed, is also the update's batch.
        per_update = best.micro_batch_size * setting.data_parallel
        warnings.append(
            f"pipedream applies each micro-batch's gradient as an update of its own: {setting.micro_batches} "
            f"updates a step, each of {per_update} sample{'s' if per_update != 1 else ''} (micro-batch "
            f"{best.micro_batch_size} x {setting.data_parallel} replica{'s' if setting.data_parallel != 1 else ''}), "
            "not one of the global batch; the search chose M for speed: give -m for the batch an update should "
            "see (fewer micro-batches, larger updates), or pipedream-2bw, which updates once a step")
    if setting.schedule in SPLIT_BACKWARD and not profile.split_measured:
        warnings.append(
            f"{setting.schedule} splits each backward into I and W, which this profile did not measure: "
            "the plan takes I = W = backward_s / 2 and keeps every activation until W; "
            "profile again (profile format 7) for measured figures")
    return warnings


# What a runner-up shows a user beside its schedule's name: two settings alike in all of it are one plan.
_SHOWN = ("micro_batches", "micro_batch_size", "fits", "step_s", "bubble_fraction", "peak_memory_bytes", "balance",
          "recompute")


def runners_up(candidates: list[Candidate], global_batch_size: int, data_parallel: int = 1) -> list[dict[str, Any]]:
    """The settings that lost to ``candidates[0]``, best first, at most :data:`MAX_RUNNERS_UP`.

    A setting whose plan is the winner's under another schedule's name is left out: on one
    stage every schedule runs a micro-batch's forward then its backward, so at M = 1 gpipe and
    1f1b are one plan, and listing it would show the winner again at "+0.0%"."""
    rows = [runner_up(c, global_batch_size, data_parallel) for c in candidates]
    best = _shown(rows[0]) if rows else None
    return [row for row in rows[1:] if _shown(row) != best][:MAX_RUNNERS_UP]


def _shown(row: dict[str, Any]) -> dict[str, Any]:
    """What a user sees of a runner-up, floats to 9 significant digits: GPipe's closed form and
    1F1B's event simulation give one plan's step in different roundings."""
    return {key: float(f"{row[key]:.9g}") if isinstance(row.get(key), float) else row.get(key) for key in _SHOWN}


def runner_up(c: Candidate, global_batch_size: int, data_parallel: int = 1) -> dict[str, Any]:
    """A setting of the chosen (K, d) that lost; ``global_batch_size`` over all replicas."""
    row: dict[str, Any] = {
        "data_parallel": data_parallel,
        "micro_batches": c.setting.micro_batches,
        "micro_batch_size": c.micro_batch_size,
        "schedule": c.setting.schedule,
        "virtual_stages": chunks_per_stage(c.setting.schedule, c.setting.virtual_stages),
        "fits": c.solution is not None,
    }
    if c.solution is not None:
        ev = c.solution.evaluation
        row.update({
            "step_s": ev.step_s,
            "samples_per_s": global_batch_size / ev.step_s if ev.step_s > 0 else None,
            "bubble_fraction": ev.bubble_fraction(c.setting.micro_batches),
            "peak_memory_bytes": int(math.ceil(ev.peak_memory_bytes)),
            "balance": ev.balance,
            "recompute": [ch.recompute for ch in ev.chunks],
            "proven": c.solution.proven,
        })
    return row


def placement_doc(chosen: Factorisation | None, stages: int) -> dict[str, Any]:
    """The plan's ``placement``: which rank runs stage k of replica r, and why that order.

    One replica: stage k on rank k, on one node (plan_layout.placement_ranks reads it so)."""
    if chosen is None or chosen.placement is None:
        trivial = placements(stages, 1, Topology(devices_per_node=stages))[0]
        return {"nodes": 1, "devices_per_node": stages, "order": trivial.order,
                "ranks": [list(row) for row in trivial.ranks], "reason": trivial.reason}
    p = chosen.placement
    return {"nodes": p.nodes, "devices_per_node": p.devices_per_node, "order": p.order,
            "ranks": [list(row) for row in p.ranks], "reason": p.reason,
            "pipeline_bandwidth_bytes_per_s": _finite_or_none(p.pipeline_bandwidth_bytes_per_s),
            "pipeline_latency_s": p.pipeline_latency_s,
            "sync_bandwidth_bytes_per_s": _finite_or_none(p.sync_bandwidth_bytes_per_s),
            "sync_latency_s": p.sync_latency_s}


def _finite_or_none(value: float | None) -> float | None:
    """A bandwidth for JSON: null for an infinite (free) one, or for none given."""
    return value if value is not None and math.isfinite(value) else None


def factorisation_rows(devices: DevicesResult) -> list[dict[str, Any]]:
    """The plan's ``factorisations``: every (K, d) searched, best first, with why not if not."""
    rows = []
    for f in devices.factorisations:
        rows.append({
            "stages": f.stages,
            "data_parallel": f.data_parallel,
            "order": f.placement.order if f.placement is not None else None,
            "fits": f.fits,
            "step_s": f.step_s if f.fits else None,
            "samples_per_s": f.samples_per_s(devices.global_batch_size),
            "proven": f.proven if f.fits else None,
            "reason": f.reason or None,
        })
    return rows


def one_pipeline_row(ev: Evaluation, proven: bool, global_batch_size: int) -> dict[str, Any]:
    """The plan's one row of ``factorisations`` when the search was over one pipeline (no --devices)."""
    return {"stages": len(ev.stages), "data_parallel": 1, "order": "pipeline-inner", "fits": True,
            "step_s": ev.step_s, "samples_per_s": global_batch_size / ev.step_s if ev.step_s > 0 else None,
            "proven": proven, "reason": None}


def exposed_sync_s(profile: Profile, micro_batch_size: int, setting: Any, ev: Evaluation) -> float:
    """How much the gradient syncs add to the step: the step of the same cut and recomputation
    with the syncs left out, subtracted from the plan's. The schedule hides a stage's sync in
    the next step's fill when it has room, so this is often less than any stage's sync."""
    if setting.data_parallel <= 1 or not any(st.gradient_sync_s for st in ev.stages):
        return 0.0
    alone = CostModel(profile.at(micro_batch_size), replace(setting, data_parallel=1, memory_limit_bytes=None))
    return max(0.0, ev.step_s - evaluate(alone, ev.bounds, ev.recompute).step_s)


def versus_one_stage(ev: Evaluation, one_stage: OneStage | None, stages: int) -> dict[str, Any]:
    """The plan against the best one-device plan of the same global batch.

    ``speedup_over_one_stage`` > 1: the pipeline is faster. A one-stage plan is its own
    baseline (speedup 1). Without a baseline (``one_stage`` None for K > 1) nothing is said.
    """
    if stages == 1:
        return {"one_stage_step_s": ev.step_s, "one_stage_fits": True,
                "one_stage_peak_memory_bytes": int(math.ceil(ev.peak_memory_bytes)), "speedup_over_one_stage": 1.0}
    if one_stage is None:
        return {}
    step = one_stage.step_s
    memory = one_stage.peak_memory_bytes
    return {
        "one_stage_step_s": step,
        "one_stage_fits": one_stage.result is not None,
        # When one device does not fit: the least memory it would need.
        "one_stage_peak_memory_bytes": int(math.ceil(memory)) if memory is not None else None,
        "speedup_over_one_stage": step / ev.step_s if step is not None and ev.step_s > 0 else None,
    }


def prediction_noise(profile: Profile, stages: int) -> dict[str, Any]:
    """How much a run's step may differ from the prediction by chance alone, as a fraction.

    From what the profile itself measured twice (docs/plan-format.md, ``predicted.noise_fraction``):

    - ``profile_speed_drift``: the reference workload timed before and after the layers
      (``measurement.speed_probe_s``): half their difference over their mean. The machine's
      speed moved by that much while the layers were timed, so any layer's time may be off by it;
    - ``neighbours_spread`` (K > 1, CPU profiles with ``contention``): the neighbours' slowdown
      changed from one contention cycle to the next (profiles/contention.py); half the
      interquartile range of ``contention.cycle_ratios`` over their median, in the share a
      K-stage plan charges.

    They are independent, so they add in quadrature. This is noise, not the cost model's
    error: it says how far apart two honest measurements of the same thing fall.
    """
    sources: dict[str, float] = {}
    probes = (profile.doc.get("measurement") or {}).get("speed_probe_s")
    if isinstance(probes, list) and len(probes) >= 2 and all(_positive(p) for p in probes):
        sources["profile_speed_drift"] = (max(probes) - min(probes)) / (max(probes) + min(probes))
    ratios = (profile.doc.get("contention") or {}).get("cycle_ratios")
    processes = profile.contention_processes
    if stages > 1 and processes > 1 and isinstance(ratios, list) and len(ratios) >= 2 \
            and all(_positive(r) for r in ratios):
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        share = min(stages - 1, processes - 1) / (processes - 1)   # as costmodel.neighbour_scale charges it
        sources["neighbours_spread"] = (q3 - q1) / 2 / statistics.median(ratios) * share
    if not sources:
        return {}
    return {"noise_fraction": math.sqrt(sum(v * v for v in sources.values())), "noise_sources": sources}


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
