"""The plan document (format ``gpipe-plan.plan``; see docs/plan-format.md).

Everything in it is a function of the profile and the options, with no timestamp and with
ties broken by a fixed order, so the same inputs give the same bytes: plans can be diffed,
cached and checked into a repository.
"""

from __future__ import annotations

import math
from typing import Any

from ..artifacts import PLAN_FORMAT, FORMAT_VERSIONS
from .objective import Evaluation
from .profile import Profile
from .search import Candidate, SearchResult

MAX_RUNNERS_UP = 12


def build_plan(profile: Profile, profile_path: str, profile_sha256: str, result: SearchResult) -> dict[str, Any]:
    options = result.options
    best = result.best
    assert best.solution is not None
    ev = best.solution.evaluation
    setting = best.setting
    M = setting.micro_batches
    layers = profile.layers
    busy = ev.busy_s(M)
    stages = []
    for k, st in enumerate(ev.stages):
        last = layers[st.end - 1]
        stage: dict[str, Any] = {
            "index": k,
            "layers": [layers[i]["name"] for i in range(st.start, st.end)],
            "first_layer": st.start,
            "recompute": st.recompute,
            "forward_s": st.forward_s,
            "backward_s": st.backward_s,
            "recompute_s": st.recompute_s,
            "send_s": st.send_s,
            "optimizer_s": st.optimizer_s,
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
        }
        # Every stage's outputs, the last one's too: the torch executor checks the logits'
        # dtype, which mixed precision changes and which only the profiled device can say.
        if last.get("output_shapes") is not None:
            stage["output_shapes"] = last["output_shapes"]
            if last.get("output_dtypes") is not None:
                stage["output_dtypes"] = last["output_dtypes"]
        stages.append(stage)
    sol = best.solution
    lo, hi = profile.measured_range()
    warnings = []
    if not lo <= best.micro_batch_size <= hi:
        warnings.append(
            f"micro-batch size {best.micro_batch_size} is outside the profiled sizes {lo}..{hi}: "
            "its times are extrapolated; profile with --micro-batch-sizes covering it for a firmer prediction")
    if ev.optimizer_wait_s > 0:
        warnings.append(
            f"a later stage's optimizer step outlasts the next step's fill by {ev.optimizer_wait_s:.3g} s "
            "(predicted.optimizer_wait_s): the step includes that wait")
    if not result.proven:
        warnings.append("the search ran out of time before proving this plan optimal; see optimality.gap")
    return {
        "format": PLAN_FORMAT,
        "version": FORMAT_VERSIONS[PLAN_FORMAT],
        "model": profile.model,
        "precision": profile.precision,
        "param_dtype": profile.param_dtype,
        "profile": {
            "path": profile_path,
            "sha256": profile_sha256,
            "device": profile.device,
            "micro_batch_sizes": profile.sizes,
        },
        "options": {
            "stages": options.stages,
            "global_batch_size": result.global_batch_size,
            "micro_batches": options.micro_batches,
            "schedule": options.schedule,
            "recompute": options.recompute,
            "memory_limit_bytes": options.memory_limit_bytes,
            "memory_limit_source": options.memory_limit_source,
            "link_bandwidth_bytes_per_s": setting.link_bandwidth_bytes_per_s if setting.comm_on else None,
            "link_latency_s": setting.link_latency_s,
            "per_microbatch_overhead_s": setting.overhead_s,
            "compute_scale": setting.compute_scale,
            "optimizer": options.optimizer,
            "solver": options.solver,
        },
        "balance": [st.end - st.start for st in ev.stages],
        "micro_batches": M,
        "micro_batch_size": best.micro_batch_size,
        "global_batch_size": result.global_batch_size,
        "schedule": setting.schedule,
        "stages": stages,
        "predicted": predicted(ev, M, result.global_batch_size),
        "optimality": {
            # Over every setting searched (each M, schedule), not only the chosen one.
            "proven": result.proven,
            "method": sol.method,
            "settings_searched": len(result.candidates),
            "lower_bound_s": result.lower_bound_s,
            "gap": (ev.step_s / result.lower_bound_s - 1.0) if result.lower_bound_s > 0 else None,
        },
        "runners_up": [runner_up(c, result.global_batch_size) for c in result.candidates[1:MAX_RUNNERS_UP + 1]],
        "warnings": warnings,
    }


def predicted(ev: Evaluation, micro_batches: int, global_batch_size: int) -> dict[str, Any]:
    return {
        "step_s": ev.step_s,
        "makespan_s": ev.makespan_s,
        "bubble_fraction": ev.bubble_fraction(micro_batches),
        "samples_per_s": global_batch_size / ev.step_s if ev.step_s > 0 else None,
        "peak_memory_bytes": int(math.ceil(ev.peak_memory_bytes)),
        "optimizer_wait_s": ev.optimizer_wait_s,
    }


def runner_up(c: Candidate, global_batch_size: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "micro_batches": c.setting.micro_batches,
        "micro_batch_size": c.micro_batch_size,
        "schedule": c.setting.schedule,
        "fits": c.solution is not None,
    }
    if c.solution is not None:
        ev = c.solution.evaluation
        row.update({
            "step_s": ev.step_s,
            "samples_per_s": global_batch_size / ev.step_s if ev.step_s > 0 else None,
            "bubble_fraction": ev.bubble_fraction(c.setting.micro_batches),
            "peak_memory_bytes": int(math.ceil(ev.peak_memory_bytes)),
            "balance": [st.end - st.start for st in ev.stages],
            "recompute": [st.recompute for st in ev.stages],
            "proven": c.solution.proven,
        })
    return row
