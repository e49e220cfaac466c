"""The cost model's setting of a plan, rebuilt from what the plan recorded of it.

A plan's ``options`` keep every figure the solver charged (the link, the per-micro-batch
overhead and the fixed costs per action and message, the neighbours' compute scale, the ranks
the host ran at once and how much slower they ran, the memory limit, the optimizer) and its
``placement`` what the gradient syncs of its replicas were charged: with the profile's layers
they give back the very cost model that chose the plan, to price another split.
"""

from __future__ import annotations

import math

from ..costmodel import Setting
from ..fixedcosts import FixedCosts
from ...plan_view import PlanView


def plan_setting(view: PlanView) -> Setting:
    """The plan's Setting."""
    options = view.options
    return Setting(
        stages=view.num_stages, micro_batches=view.micro_batches, schedule=view.schedule,
        recompute=options.recompute,
        memory_limit_bytes=options.memory_limit_bytes,
        link_bandwidth_bytes_per_s=_bandwidth(options.pipeline_bandwidth_bytes_per_s),
        link_latency_s=options.pipeline_latency_s,
        optimizer=view.optimizer or "adam",
        overhead_s=options.per_microbatch_overhead_s,
        fixed_costs=FixedCosts.from_record(options.fixed_costs),
        compute_scale=options.compute_scale,
        virtual_stages=view.virtual_stages,
        data_parallel=view.data_parallel,
        sync_bandwidth_bytes_per_s=_bandwidth(options.sync_bandwidth_bytes_per_s),
        sync_latency_s=options.sync_latency_s,
        gradient_sync=view.gradient_sync,
        concurrent_ranks=options.concurrent_ranks or math.inf,
        shared_core_slowdown=options.shared_core_slowdown,
        shared_core_action_s=options.shared_core_action_s,
    )


def _bandwidth(value: float | None) -> float:
    """A recorded bandwidth; null (or absent) is a free link."""
    return math.inf if value is None else value
