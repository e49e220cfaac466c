"""The cost model's setting of a plan, rebuilt from what the plan recorded of it.

A plan's ``options`` keep every figure the solver charged (the link, the per-micro-batch
overhead and the fixed costs per action and message, the neighbours' compute scale, the ranks
the host ran at once, the memory limit, the optimizer) and its
``placement`` what the gradient syncs of its replicas were charged: with the profile's layers
they give back the very cost model that chose the plan, to price another split.
"""

from __future__ import annotations

import math
from typing import Any

from ...artifacts import json_number
from ..costmodel import Setting
from ..fixedcosts import FixedCosts
from ...plan_view import PlanView


def plan_setting(view: PlanView) -> Setting:
    """The plan's Setting."""
    options: dict[str, Any] = view.doc.get("options") or {}
    placement: dict[str, Any] = view.doc.get("placement") or {}
    # What the pipeline's sends were charged: the placement's (format 6), else the link.
    charged = placement if "pipeline_bandwidth_bytes_per_s" in placement else {
        "pipeline_bandwidth_bytes_per_s": options.get("link_bandwidth_bytes_per_s"),
        "pipeline_latency_s": options.get("link_latency_s")}
    limit = options.get("memory_limit_bytes")
    return Setting(
        stages=view.num_stages, micro_batches=view.micro_batches, schedule=view.schedule,
        recompute=str(options.get("recompute") or "auto"),
        memory_limit_bytes=json_number(limit),
        link_bandwidth_bytes_per_s=_bandwidth(charged.get("pipeline_bandwidth_bytes_per_s")),
        link_latency_s=float(charged.get("pipeline_latency_s") or 0.0),
        optimizer=str(options.get("optimizer") or "adam"),
        overhead_s=float(options.get("per_microbatch_overhead_s") or 0.0),
        fixed_costs=FixedCosts.from_record(options.get("fixed_costs")),
        compute_scale=float(options.get("compute_scale") or 1.0),
        virtual_stages=view.virtual_stages,
        data_parallel=view.data_parallel,
        sync_bandwidth_bytes_per_s=_bandwidth(placement.get("sync_bandwidth_bytes_per_s")),
        sync_latency_s=float(placement.get("sync_latency_s") or 0.0),
        gradient_sync=view.gradient_sync,
        concurrent_ranks=json_number(options.get("concurrent_ranks")) or math.inf,
    )


def _bandwidth(value: Any) -> float:
    """A recorded bandwidth; null (or absent) is a free link."""
    number = json_number(value)
    return math.inf if number is None else number
