"""The one-device plan every solve is compared with: what a pipeline must beat (:class:`OneStage`).

Every solve also solves the same global batch on one stage of one device, at that device's own
best M, and the plan records the comparison (planner/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..artifacts import BadInput
from .least_memory import least_memory
from .problem import SolveOptions, check_problem, problem_of, resolve_global_batch
from .profile import Profile
from .search import SearchResult, search_pipeline
from .settings import ReplicaSync, pipeline_link, settings_for


@dataclass
class OneStage:
    """The best plan on one device for the same global batch: what a pipeline must beat.

    A pipeline pays for its stages with a bubble, sends and, on one host, neighbours that slow
    each other down; for a small or unbalanced model one device can be as fast. ``result`` is
    the best one-stage plan (None when no setting fits one device's memory), and then
    ``least_memory_bytes`` is the smallest memory one device would need.
    """

    result: SearchResult | None
    least_memory_bytes: float | None = None

    @property
    def step_s(self) -> float | None:
        return self.result.best.step_s if self.result is not None else None

    @property
    def peak_memory_bytes(self) -> float | None:
        if self.result is None:
            return self.least_memory_bytes
        return self.result.best.solution.evaluation.peak_memory_bytes


def one_stage_baseline(profile: Profile, options: SolveOptions) -> OneStage:
    """Solve the same request on one stage of one device (no replicas), with the same solver and options.

    Only the micro-batch count is left open ("auto"): a fixed M is a choice made for the
    pipeline (it is what fills it), while one device should be judged at its own best M;
    the global batch stays the same, so the two plans train alike.
    """
    single = replace(problem_of(options, stages=1, batch=resolve_global_batch(profile, options),
                                link=pipeline_link(profile, options), sync=ReplicaSync()),
                     micro_batches="auto", virtual_stages="auto",
                     schedule=options.schedule if options.schedule in ("gpipe", "1f1b") else "auto")
    try:
        return OneStage(search_pipeline(profile, single, explain=False))
    except BadInput:
        # Nothing fits one device: say how much memory it would take (search raised only that,
        # since the other checks passed for the pipeline's own options).
        check_problem(profile, single)
        need = min(least_memory(profile, s, size) for s, size in settings_for(profile, single))
        return OneStage(None, need)
