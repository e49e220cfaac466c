"""The cost model: what one chunk and one pipeline stage cost, in time and memory.

A plan cuts the L layers into contiguous chunks, one per stage unless the schedule puts
several on each (see "Chunks" below). A chunk (with one per stage: stage k) holds layers
``[s, e)`` and, with micro-batches of size b (figures from :mod:`planner.profile`), costs per
micro-batch::

    F_k = sum(forward_s[s:e])  + overhead            forward
    B_k = sum(backward_s[s:e]) + overhead            backward
    B_k = sum(recompute_backward_s[s:e]) + overhead + recompute_call   when the stage recomputes
    C_k = latency + output_bytes[e-1] / bandwidth    send to stage k+1 (0 for the last stage)

``overhead`` is the runtime's fixed cost per micro-batch and action between actions (the
executor's loop; profile key ``fixed_costs.between_actions_s``, or ``overhead.per_microbatch_s``
once calibrated: planner/fixedcosts.py): once for F and B, once each for I and W. Each action
kind also has its own fixed cost, and every message to or from another stage one more, paid by
the action that sends or receives it (:class:`~.fixedcosts.FixedCosts`, measured by ``profile``
with a real pipeline): so chunk c's forward is ``sum(forward_s[s:e]) + overhead + fixed F +
its messages``, and v chunks per stage pay v times the actions and their messages.

Per chunk. A time is ``prefix[e] - prefix[s] + fixed``, and a chunk's fixed part depends on
the chunk, not on its layers: its kind's fixed cost plus the messages its place gives it (a
chunk at the pipeline's end receives or sends nothing there; a zb-v stage hands its own pair
over without a message). :meth:`CostModel.formula` gives chunk c's two functions (for one chunk
per stage, chunk k is stage k), and every solver reads chunk times through it, so that its
bounds and the evaluation of its plans agree to the last bit. :meth:`CostModel.chunk_fixed`
says the fixed part of each of chunk c's actions (the exact MILP encodes each pass as its
layers' coefficients plus that).

The CPU-issue bound. On a GPU a call returns once its kernel is queued: a pass takes the
longer of its kernels' time and the CPU's time to issue them. A CUDA profile that timed both
(``issue_forward_s``, ``issue_backward_s``: profiles/issue.py) makes each pass over [s, e)
``max(sum GPU, sum issue) + fixed``: two term pairs, ``(prefix, fixed)`` each, whose larger is
the time (``stage_time_formula``'s ``issue``); a reach is then the smaller of the two reaches,
and the bounds that read prefix sums directly keep the GPU's, a lower bound still.

F and B have one definition, :func:`stage_time_formula`: :class:`CostModel` makes it once per
setting and chunk (``CostModel.formula(c)``; ``CostModel.forward`` and ``CostModel.whole_backward``
are the same without messages, from prefix sums: any stage in O(1)), its chunk figures call it,
and so do the solvers (planner/gpipe_solver.py, planner/onefoneb.py, planner/chunked.py), binding those
two functions to local names in their innermost loops rather than summing the prefixes
themselves. Where a solver needs "the largest stage within a time", it asks
:meth:`CostModel.forward_reach` / :meth:`CostModel.backward_reach`, which bisect on the same
prefix sums and settle on the same expression.

Recomputation (activation checkpointing) is not free beyond the rerun forward: the checkpointed
forward runs hooks on every tensor it would have saved, the rerun happens inside the backward,
and the wrapper itself costs a fixed ~0.1-0.5 ms per call on a CPU. A profile that timed the
layers under ``torch.utils.checkpoint`` (profile version 3) gives each layer's recomputing
backward (rerun included, plus what checkpointing added to its forward: a recomputing stage's
whole extra work is charged to its backward, the forward stays the plain one) and the wrapper's
cost ``recompute_call``, charged once per stage and micro-batch, as the runtime checkpoints a
stage as one piece. Older and imported profiles take the textbook figure: backward + forward.

Neighbours: the profile times each layer in one process alone, but the K stages of a pipeline
on one CPU host compute at the same time and share caches, memory bandwidth and, on a virtual
machine, whatever the host shares between its virtual cores. A CPU profile measures how much
slower the model computes with neighbours (``contention.slowdown``, at ``processes`` at once);
every forward, backward and optimizer time is then multiplied by :func:`neighbour_scale`: the
slowdown, weighted by how many other stages there are. Scaling the layer times by one factor per
setting keeps every solver exact.

Chunks. A schedule may put several chunks (contiguous runs of layers) on one stage
(:mod:`gpipe_plan.schedules`): ``interleaved`` v of them, ``zb-v`` two. A plan is then a cut of
the layers into K*v chunks, and each chunk costs as above (its own overhead per action). The
zero-bubble schedules split a chunk's backward B into the input gradient I and the weight
gradient W (profile keys ``backward_input_s`` / ``backward_weight_s``; older profiles: half of B
each). Recomputation reruns the forward inside B, or inside I for a split backward (W needs the
activations the rerun made), so its extra time is charged there.

Memory of stage k, in bytes::

    parameters + gradients + optimizer state (Adam 2x, momentum 1x, SGD 0x the parameters)
    + buffers                                                (of all its chunks)
      (the asynchronous schedules hold ``weight_versions.weight_copies`` copies of the
      parameters, the gradients and optimizer state once: :func:`charged_static_bytes`)
    + activations: the peak over the stage's action list (schedules.peak_bytes): each
      micro-batch holds a chunk's saved activations from its F to its B (or I); a chunk that
      recomputes holds only its *input* and, while it recomputes, the rest of its activations
      (the first layer saves its own input for backward, so that one is not held twice); a
      split backward keeps ``weight_kept_bytes`` (what W still needs) from its I to its W
    + the largest transient peak of its layers (CUDA profiles)

With one chunk per stage and a whole B that peak is ``n_k * activations`` (or, recomputing,
``(n_k - 1) * input + max(activations, input)``), n_k the most micro-batches in flight on stage
k (schedules.in_flight: M for GPipe, ``min(M, K - k)`` for 1F1B, ``K - k`` for the asynchronous
schedules, which never flush: their peak is read off a segment of several steps). The peak is linear in the
per-chunk byte counts, so it is the largest of a few linear forms (:class:`_StagePeaks`), found
once per schedule shape by replaying the lists: evaluating a stage is then O(chunks).

Replicas (planner/replicas.py): with d copies of the pipeline, stage k averages its gradients
over its d replicas once a step, a ring all-reduce of its parameter bytes
(:func:`gpipe_plan.collectives.ring_allreduce_s`), charged after its last backward with the optimizer
step (:meth:`CostModel.gradient_sync_s`); with FSDP, the parameters and optimizer state are
sharded 1/d between steps (:func:`charged_static_bytes`); with LocalSGD, no gradient is all-reduced and
the same all-reduce of the parameters runs once every H steps, charged 1/H of it per step.

Time of a whole step is a property of the schedule, not of one stage: see
:mod:`planner.simulator` (GPipe closed form and the event simulator).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Sequence

from ..schedules import (PLANNABLE_SCHEDULES, SPLIT_BACKWARD, all_actions, chunks_of_stage, chunks_per_stage, problem,
                         segment_actions, stage_of_chunk)
from ..weight_versions import ASYNC_SCHEDULES, weight_copies
from .profile import LayerFigures
from .fixedcosts import FixedCosts, messages
from ..collectives import ring_allreduce_s, ring_allreduce_s_per_byte
from .simulator import ChunkTimes

OPTIMIZER_STATE_MULTIPLIER = {"adam": 2, "momentum": 1, "sgd": 0}
RECOMPUTE_MODES = ("never", "always", "auto")


@dataclass(frozen=True)
class Setting:
    """Everything about a plan except where the stage boundaries go."""

    stages: int
    micro_batches: int
    schedule: str = "gpipe"
    recompute: str = "never"
    memory_limit_bytes: float | None = None
    link_bandwidth_bytes_per_s: float = math.inf   # inf: communication is free
    link_latency_s: float = 0.0
    optimizer: str = "adam"
    overhead_s: float = 0.0       # per action, between actions (planner/fixedcosts.py)
    fixed_costs: FixedCosts = FixedCosts()   # per action kind and per message
    compute_scale: float = 1.0    # neighbour_scale(...): every layer time is multiplied by it
    virtual_stages: int = 1       # chunks per stage of ``interleaved`` (2 for zb-v is implied)
    # Data parallel (planner/replicas.py): d replicas of the pipeline; each stage averages its
    # gradients over its d copies once a step, over the ring the placement gives it.
    data_parallel: int = 1
    sync_bandwidth_bytes_per_s: float = math.inf    # inf: the sync is free
    sync_latency_s: float = 0.0                     # per ring step
    gradient_sync: str = "ddp"                      # "ddp" | "fsdp" | "localsgd" (plan_layout.GRADIENT_SYNCS)
    sync_every: int = 1                             # localsgd: H, the steps between two averagings
    # More ranks than cores (planner/timeshare.py): how many of the K ranks the host runs at
    # full speed at once; inf: each has cores of its own (a GPU each, or enough CPU cores).
    concurrent_ranks: float = math.inf
    # ... and what every action costs there beyond its time on a core of its own: that time
    # times ``shared_core_slowdown`` (the optimizer step's too), plus ``shared_core_action_s``
    # (profile ``fixed_costs.shared_cores``); charged only when ``time_shared``.
    shared_core_slowdown: float = 1.0
    shared_core_action_s: float = 0.0

    @property
    def comm_on(self) -> bool:
        return math.isfinite(self.link_bandwidth_bytes_per_s)

    @property
    def time_shared(self) -> bool:
        """Whether the K ranks share fewer cores than they are: the step is then played out on
        shared cores (planner/timeshare.py), not on a core per rank."""
        return self.concurrent_ranks < self.stages

    @property
    def action_slowdown(self) -> float:
        """The factor on every action's and optimizer step's time: ``shared_core_slowdown`` where
        the ranks share cores, else 1."""
        return max(1.0, self.shared_core_slowdown) if self.time_shared else 1.0

    @property
    def action_added_s(self) -> float:
        """What every action costs besides: ``shared_core_action_s`` where the ranks share cores, else 0."""
        return max(0.0, self.shared_core_action_s) if self.time_shared else 0.0


def charged_static_bytes(params_bytes: float, optimizer: str, data_parallel: int = 1,
                         gradient_sync: str = "ddp", weight_versions: int = 1) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) in bytes, per rank, of a stage of ``params_bytes``.

    ``weight_versions``: the copies of the parameters the stage holds at once, the live ones
    included (:func:`gpipe_plan.weight_versions.weight_copies` for an asynchronous
    schedule's weight stashing; 1 otherwise); the gradients and the optimizer state are kept
    once whatever the versions (an update is applied to the newest weights only). The
    asynchronous schedules run with ddp only (problem.check_problem refuses fsdp).

    ``ddp`` keeps everything whole on each of the d replicas: P + P + multiplier*P. ``fsdp``
    (FSDP2 ``fully_shard``) keeps a 1/d shard of the parameters and of the optimizer state
    between steps, but gathers the whole parameters for the step (the planner charges them
    whole for all of it: conservative, a stage gathers per module in practice) and the
    gradients whole until the reduce-scatter: P + P/d, P, multiplier*P/d. The one home of
    this formula: :meth:`CostModel.static_memory` and the plan's memory breakdown both use it.
    With one replica there is nothing to shard: fsdp is charged as ddp.
    """
    multiplier = OPTIMIZER_STATE_MULTIPLIER[optimizer]
    if gradient_sync == "fsdp" and data_parallel > 1:
        return params_bytes * (1 + 1 / data_parallel), params_bytes, params_bytes * multiplier / data_parallel
    return params_bytes * weight_versions, params_bytes, params_bytes * multiplier


def neighbour_scale(slowdown: float, processes: int, stages: int) -> float:
    """The factor on every layer time of a K-stage plan, from a profile's measured slowdown.

    ``slowdown`` was measured with ``processes`` copies computing at once. With K stages a
    stage has K - 1 neighbours; we take the interference as growing in proportion to them
    (capped at what was measured). It does not depend on how much the stages overlap in time:
    the penalty comes with the neighbour process, not only with its computing at the same
    moment: stages that take turns (M = 1) were measured to slow each other about as much as
    stages that overlap (M >= 2) (docs/planner.md, "Neighbours"). One stage computes as
    profiled.
    """
    if stages <= 1 or slowdown <= 1.0:
        return 1.0
    neighbours = min(stages - 1, processes - 1) / max(1, processes - 1)
    return 1.0 + (slowdown - 1.0) * neighbours


@dataclass(frozen=True)
class ChunkCost:
    """Predicted figures of one chunk (layers ``[start, end)``); times are per micro-batch."""

    index: int
    stage: int               # the stage (device) that runs it
    start: int
    end: int
    recompute: bool
    forward_s: float
    backward_s: float        # the whole backward B; for a split backward, I + W
    backward_input_s: float  # I (the recomputed forward included when `recompute`)
    backward_weight_s: float  # W
    recompute_s: float       # the part of B (or I) that is recomputation
    send_s: float            # to the next chunk; 0 when it is on the same stage, or for the last chunk

    def times(self) -> ChunkTimes:
        return ChunkTimes(self.forward_s, self.backward_s, self.backward_input_s, self.backward_weight_s,
                          self.send_s, self.recompute_s)


@dataclass(frozen=True)
class StageCost:
    """Predicted figures of one stage (device): the chunks it runs and its memory."""

    index: int
    chunks: tuple[int, ...]  # the chunk indices it holds, in pipeline order
    recompute: bool          # its chunks recompute (all alike)
    optimizer_s: float       # everything after its last backward: gradient sync + optimizer (+ ties)
    gradient_sync_s: float   # the part of optimizer_s that syncs gradients over the replicas
    in_flight: int           # most micro-batches whose activations it holds at once
    params_bytes: float
    gradients_bytes: float
    optimizer_state_bytes: float
    buffers_bytes: float
    activations_bytes: float
    transient_bytes: float

    @property
    def memory_bytes(self) -> float:
        return (self.params_bytes + self.gradients_bytes + self.optimizer_state_bytes
                + self.buffers_bytes + self.activations_bytes + self.transient_bytes)


@dataclass(frozen=True)
class _StagePeaks:
    """The activation peak of one stage's action list as the largest of a few linear forms.

    ``schedules.peak_bytes`` replays the list with bytes per chunk; every point it compares is
    ``sum_c h_c held_c + sum_c w_c kept_c (+ extra_c of the chunk in backward)`` with counts that
    depend on the list only. Those count vectors (all but the dominated ones) are found once
    here; the peak for any bytes is then the largest form. ``in_flight``: schedules.in_flight.
    """

    chunks: tuple[int, ...]                                  # the stage's chunks, pipeline order
    forms: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]   # (h, w, local chunk in backward or -1)
    in_flight: int

    def peak(self, held: Sequence[float], extra: Sequence[float], kept: Sequence[float]) -> float:
        best = 0.0
        for h, w, e in self.forms:
            value = sum(n * b for n, b in zip(h, held))
            if any(w):
                value += sum(n * b for n, b in zip(w, kept))
            if e >= 0:
                value += extra[e]
            if value > best:
                best = value
        return best


@functools.lru_cache(maxsize=64)
def stage_peaks(schedule: str, stages: int, micro_batches: int, virtual_stages: int) -> tuple[_StagePeaks, ...]:
    """Every stage's :class:`_StagePeaks` for one schedule shape (cached: M may be thousands)."""
    from ..schedules import in_flight

    out = []
    if schedule in ASYNC_SCHEDULES:
        # No flush: in steady state stage k holds K - k micro-batches however few a step has, so
        # the peak is read from a segment long enough for every stage to reach it.
        steps = -(-stages // micro_batches) + 1
        lists = [segment_actions(k, stages, micro_batches, steps) for k in range(stages)]
    else:
        lists = all_actions(schedule, stages, micro_batches, virtual_stages)
    for k, actions in enumerate(lists):
        local = {c: i for i, c in enumerate(chunks_of_stage(schedule, k, stages, virtual_stages))}
        n = len(local)
        h, w = [0] * n, [0] * n
        points: set[tuple[tuple[int, ...], tuple[int, ...], int]] = set()
        for a in actions:
            i = local[a.chunk]
            if a.kind == "F":
                h[i] += 1
                points.add((tuple(h), tuple(w), -1))
            elif a.kind in ("B", "I"):
                points.add((tuple(h), tuple(w), i))
                h[i] -= 1
                if a.kind == "I":
                    w[i] += 1
                    points.add((tuple(h), tuple(w), -1))
            else:
                w[i] -= 1
        out.append(_StagePeaks(tuple(local), _undominated(points), in_flight(actions)))
    return tuple(out)


def _undominated(points: set[tuple[tuple[int, ...], tuple[int, ...], int]]) -> tuple:
    """The points no other point beats for every choice of non-negative bytes: one with at
    least the same counts everywhere and the same backward chunk (or any, when it has none)."""
    ordered = sorted(points, key=lambda p: (-(sum(p[0]) + sum(p[1])), p[2] < 0, p))
    kept: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    for p in ordered:
        if not any((q[2] == p[2] or p[2] < 0)
                   and all(a >= b for a, b in zip(q[0], p[0])) and all(a >= b for a, b in zip(q[1], p[1]))
                   for q in kept):
            kept.append(p)
    return tuple(kept)


def stage_time_formula(forward_terms: tuple[list[float], float],
                       backward_terms: dict[bool, tuple[list[float], float]],
                       issue: tuple[list[float], dict[bool, list[float]]] | None = None,
                       ) -> tuple[Callable[[int, int], float], Callable[[int, int, bool], float]]:
    """The stage-time formula: ``forward(s, e)`` and ``backward(s, e, recompute)`` of layers
    ``[s, e)``, per micro-batch, the F and B of the module docstring (B whole, as GPipe and
    1F1B run it).

    Each term is (prefix sums of the layers' times, fixed cost per micro-batch) and a time is
    ``prefix[e] - prefix[s] + fixed``, always in that order, so that every caller gets the very
    same float for the same stage: a solver's bound and the evaluation of its plan must agree
    to the last bit. :class:`CostModel` makes the two functions once per setting; its chunk
    figures and the solvers' innermost loops (once per candidate stage, O(K L^2) calls) call
    them. They are closures rather than methods because a closure reads its prefix sums as
    local cells, where a method looks each one up on the instance at every call.

    ``issue``: the prefix sums of the CPU's issue times of the forward and of the backward
    (plain, recomputing), for a profile that has them (CUDA). A pass then takes the larger of
    its layers' two sums, plus the fixed part: each term pair is ``(prefix, fixed)`` and the time
    is the largest of them (see "The CPU-issue bound" in the module docstring).
    """
    forward_prefix, forward_fixed = forward_terms
    plain_prefix, plain_fixed = backward_terms[False]
    rerun_prefix, rerun_fixed = backward_terms[True]
    if issue is not None:
        return _issue_bound_formula(forward_terms, backward_terms, issue)

    def forward(s: int, e: int) -> float:
        return forward_prefix[e] - forward_prefix[s] + forward_fixed

    def backward(s: int, e: int, recompute: bool) -> float:
        if recompute:
            return rerun_prefix[e] - rerun_prefix[s] + rerun_fixed
        return plain_prefix[e] - plain_prefix[s] + plain_fixed

    return forward, backward


def _issue_bound_formula(forward_terms: tuple[list[float], float],
                         backward_terms: dict[bool, tuple[list[float], float]],
                         issue: tuple[list[float], dict[bool, list[float]]],
                         ) -> tuple[Callable[[int, int], float], Callable[[int, int, bool], float]]:
    """:func:`stage_time_formula` under the CPU-issue bound: the larger sum, then the fixed part
    (when the GPU's sum is the larger, the very float of the plain formula)."""
    forward_prefix, forward_fixed = forward_terms
    plain_prefix, plain_fixed = backward_terms[False]
    rerun_prefix, rerun_fixed = backward_terms[True]
    forward_issue, backward_issue = issue
    plain_issue, rerun_issue = backward_issue[False], backward_issue[True]

    def forward(s: int, e: int) -> float:
        gpu, cpu = forward_prefix[e] - forward_prefix[s], forward_issue[e] - forward_issue[s]
        return (gpu if gpu >= cpu else cpu) + forward_fixed

    def backward(s: int, e: int, recompute: bool) -> float:
        if recompute:
            gpu, cpu = rerun_prefix[e] - rerun_prefix[s], rerun_issue[e] - rerun_issue[s]
            return (gpu if gpu >= cpu else cpu) + rerun_fixed
        gpu, cpu = plain_prefix[e] - plain_prefix[s], plain_issue[e] - plain_issue[s]
        return (gpu if gpu >= cpu else cpu) + plain_fixed

    return forward, backward


class CostModel:
    """Per-chunk and per-stage costs for one :class:`Setting`, from prefix sums: any chunk costs O(1)."""

    def __init__(self, figures: LayerFigures, setting: Setting):
        if setting.schedule not in PLANNABLE_SCHEDULES:
            raise ValueError(f"unknown schedule {setting.schedule!r}")
        if setting.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"unknown recompute mode {setting.recompute!r}")
        reason = problem(setting.schedule, setting.stages, setting.micro_batches, setting.virtual_stages)
        if reason:
            raise ValueError(reason)
        # The neighbours' slowdown, and sharing cores where the ranks do, slow every layer alike;
        # sharing slows the runtime's own work per action too (its fixed costs, below), and adds
        # a cost of its own to every action (with the cost between actions).
        slowdown = setting.action_slowdown
        if setting.compute_scale * slowdown != 1.0:
            figures = figures.times_scaled(setting.compute_scale * slowdown)
        self.figures = figures
        self.setting = setting
        self.L = figures.num_layers
        self.K = setting.stages
        self.M = setting.micro_batches
        self.schedule = setting.schedule
        self.virtual_stages = setting.virtual_stages
        self.chunks_per_stage = chunks_per_stage(setting.schedule, setting.virtual_stages)
        self.C = self.K * self.chunks_per_stage         # chunks in the pipeline
        self.split = setting.schedule in SPLIT_BACKWARD  # runs I and W instead of B
        # Costs are clamped to >= 0 (NaN to 0) here, where every solver reads them: the solvers'
        # loops step through thresholds that only grow with a stage, and a negative cost would
        # let them walk forever (a negative calibrated overhead once did). See _cost.
        self.overhead = _cost(setting.overhead_s * slowdown + setting.action_added_s)
        self.limit = setting.memory_limit_bytes
        # Prefix sums: the sum over layers [s, e) is pre[e] - pre[s].
        self.pf = _prefix(figures.forward_s)
        self.pg = _prefix(figures.backward_s)
        # Backward of a recomputing stage re-runs its forward: one prefix for both, so that the
        # solvers and the evaluation compute the very same float for it.
        recomputing = figures.recomputing_backward_s()
        self.pgr = _prefix(recomputing)
        # The split backward: I (with the rerun when recomputing) and W.
        self.pgi = _prefix(figures.input_backward_s())
        self.pgir = _prefix([i + r - b for i, r, b in zip(figures.input_backward_s(), recomputing, figures.backward_s)])
        self.pgw = _prefix(figures.weight_backward_s())
        self.pkept = _prefix(figures.kept_bytes())
        # ... plus the checkpoint wrapper's own cost, once per stage and micro-batch.
        call = self.recompute_call = _cost(figures.recompute_call_s)
        self.overhead_recompute = self.overhead + call
        # Fixed costs per action kind (planner/fixedcosts.py), each with the cost between
        # actions; zero when the profile measured none, which leaves every figure as before.
        fixed = setting.fixed_costs.scaled(slowdown)
        self.forward_fixed = self.overhead + _cost(fixed.forward_s)
        self.backward_fixed = {False: self.overhead + _cost(fixed.backward_s)}
        self.backward_fixed[True] = self.backward_fixed[False] + call
        self.input_fixed = {False: self.overhead + _cost(fixed.backward_input_s)}
        self.input_fixed[True] = self.input_fixed[False] + call
        self.weight_fixed = self.overhead + _cost(fixed.backward_weight_s)
        # ... and per message to or from another stage, on the action that sends or receives it.
        self.send_fixed = _cost(fixed.send_s)
        self.receive_fixed = _cost(fixed.receive_s)
        self.messages = messages(setting.schedule, self.K, setting.virtual_stages)
        self.forward_messages = [m.forward_sends * self.send_fixed + m.forward_receives * self.receive_fixed
                                 for m in self.messages]
        self.backward_messages = [m.backward_sends * self.send_fixed + m.backward_receives * self.receive_fixed
                                  for m in self.messages]
        # Each pass over layers [s, e) costs prefix[e] - prefix[s] + its fixed cost: the pairs,
        # named once here, and the one formula on them (stage_time_formula). These are without
        # messages; chunk c's own pairs (formula(c)) add its messages to the fixed parts.
        self.forward_terms: tuple[list[float], float] = (self.pf, self.forward_fixed)
        self.backward_terms: dict[bool, tuple[list[float], float]] = {
            False: (self.pg, self.backward_fixed[False]), True: (self.pgr, self.backward_fixed[True])}
        # The CPU-issue bound (CUDA profiles): each pass takes the larger of its layers' GPU and
        # issue sums; prefix sums of the issue times per kind, None without them.
        issue = figures.issue_times()
        self.issue: dict[str, list[float]] | None = None if issue is None else {
            key: _prefix(times) for key, times in issue.items()}
        self.issue_terms = None if self.issue is None else (
            self.issue["F"], {False: self.issue["B"], True: self.issue["B recompute"]})
        self.forward, self.whole_backward = stage_time_formula(self.forward_terms, self.backward_terms,
                                                               self.issue_terms)
        self._formulas: dict[tuple[float, float, float], tuple[Callable[[int, int], float],
                                                                Callable[[int, int, bool], float]]] = {}
        # A split backward runs I and W: its B is their sum (see backward_input).
        self.backward: Callable[[int, int, bool], float] = (
            self._split_backward if self.split else self.whole_backward)
        self.pa = _prefix(figures.activation_bytes)
        self.pp = _prefix(figures.param_bytes)
        self.pbuf = _prefix(figures.buffer_bytes)
        self.popt = _prefix(figures.optimizer_s)
        # The copies of its weights each stage holds at once: an asynchronous schedule stashes one
        # per version in flight beside the live ones (gpipe_plan.weight_versions.weight_copies),
        # a synchronous one holds one.
        self.asynchronous = setting.schedule in ASYNC_SCHEDULES
        self.weight_versions = [weight_copies(setting.schedule, k, self.K) if self.asynchronous else 1
                                for k in range(self.K)]
        # parameters + gradients + optimizer state per parameter byte (2 + multiplier for ddp),
        # per stage (its weight versions)
        self.static_per_param_of = [sum(charged_static_bytes(1.0, setting.optimizer, setting.data_parallel,
                                                             setting.gradient_sync, versions))
                                    for versions in self.weight_versions]
        self.static_per_param = self.static_per_param_of[0]
        # The gradient sync over the replicas: on when there are several and it costs something.
        self.sync_on = setting.data_parallel > 1 and (
            math.isfinite(setting.sync_bandwidth_bytes_per_s) or setting.sync_latency_s > 0)
        self.has_transient = any(figures.transient_bytes)
        # The sparse table takes O(L log L) to build: only when some layer has a transient peak.
        self.transient = _RangeMax(figures.transient_bytes if self.has_transient else [])
        # comm[e]: time to send what crosses the cut before layer e (e = 1..L-1); no cut at L.
        self.comm = [0.0] * (self.L + 1)
        if setting.comm_on:
            for e in range(1, self.L):
                self.comm[e] = _cost(setting.link_latency_s + figures.output_bytes[e - 1]
                                     / setting.link_bandwidth_bytes_per_s)
        # in_bytes[s]: one micro-batch of what stage starting at s receives (kept when recomputing).
        self.in_bytes = [figures.input_bytes] + list(figures.output_bytes[:-1])
        self._max_end: dict[tuple[int, int, bool], int] = {}
        self.allowed_recompute: tuple[bool, ...] = {
            "never": (False,), "always": (True,), "auto": (False, True)}[setting.recompute]
        if self.asynchronous:
            # The runtime recomputes no asynchronous stage: the rerun would meet the newest weights,
            # not the stashed ones (runtime/options.async_problem); solve refuses "always".
            self.allowed_recompute = (False,)
        self.peaks = stage_peaks(setting.schedule, self.K, self.M, setting.virtual_stages)
        self.stage_of_chunk = [stage_of_chunk(setting.schedule, c, self.K) for c in range(self.C)]
        # Stages whose lists hold micro-batches alike share the cache of max_end (one chunk each).
        forms = {}
        self._peak_class = [forms.setdefault((p.forms, versions), len(forms))
                            for p, versions in zip(self.peaks, self.weight_versions)]

    # ------------------------------------------------------------------ pieces
    def in_flight(self, k: int) -> int:
        """Most micro-batches whose activations stage k holds at once (from its action list)."""
        return self.peaks[k].in_flight

    # forward(s, e), whole_backward(s, e, recompute) and backward(s, e, recompute) are set in
    # __init__: see stage_time_formula.

    def _split_backward(self, s: int, e: int, recompute: bool, c: int | None = None) -> float:
        """B of layers [s, e) under a schedule that splits it: I + W (of chunk c, with its messages)."""
        return self.backward_input(s, e, recompute, c) + self.backward_weight(s, e, recompute, c)

    def formula(self, c: int) -> tuple[Callable[[int, int], float], Callable[[int, int, bool], float]]:
        """Chunk c's ``forward(s, e)`` and whole ``backward(s, e, recompute)``: the stage-time
        formula with the chunk's messages in the fixed parts (with one chunk per stage, chunk k
        is stage k). Chunks whose fixed parts are alike share the functions."""
        fm, bm = self.forward_messages[c], self.backward_messages[c]
        key = (fm, bm)
        found = self._formulas.get(key)
        if found is None:
            if fm == 0.0 and bm == 0.0:
                found = (self.forward, self.whole_backward)
            else:
                found = stage_time_formula(
                    (self.pf, self.forward_fixed + fm),
                    {False: (self.pg, self.backward_fixed[False] + bm), True: (self.pgr, self.backward_fixed[True] + bm)},
                    self.issue_terms)
            self._formulas[key] = found
        return found

    def chunk_fixed(self, kind: str, c: int, recompute: bool = False) -> float:
        """The fixed part of chunk c's ``kind`` action (F, B, I or W), per micro-batch: what it
        costs beyond its layers' prefix sums (its kind's fixed cost, the cost between actions,
        the checkpoint call when recomputing, and its messages). Chunk 0's I under a split
        backward is all fixed (it computes nothing); its W is the whole backward's layers plus
        this. Every pass time is ``prefix[e] - prefix[s] + chunk_fixed``."""
        if kind == "F":
            return self.forward_fixed + self.forward_messages[c]
        if kind == "B":
            return self.backward_fixed[recompute] + self.backward_messages[c]
        if kind == "I":
            if c == 0 and self.split:
                return self.overhead + self.backward_messages[0]
            return self.input_fixed[recompute] + self.backward_messages[c]
        if kind == "W":
            return self.weight_fixed + self.recompute_call if c == 0 and self.split and recompute else self.weight_fixed
        raise ValueError(f"unknown action kind {kind!r}")

    def message_totals(self, chunks: Sequence[int]) -> float:
        """What the messages of one forward and one backward of each of ``chunks`` cost together."""
        return sum(self.forward_messages[c] + self.backward_messages[c] for c in chunks)

    def forward_reach(self, s: int, budget: float, fixed: float | None = None) -> int:
        """The largest e >= s with ``forward(s, e) <= budget`` (s if none), by bisection; with
        ``fixed``, for a forward of that fixed part (a chunk's: :meth:`chunk_fixed`)."""
        prefix, own = self.forward_terms
        fixed = own if fixed is None else fixed
        e = reach(prefix, s, budget, fixed)
        # Under the CPU-issue bound both sums must keep within the budget.
        return e if self.issue is None else min(e, reach(self.issue["F"], s, budget, fixed))

    def backward_reach(self, s: int, budget: float, recompute: bool, fixed: float | None = None) -> int:
        """The largest e >= s with ``whole_backward(s, e, recompute) <= budget`` (s if none)."""
        prefix, own = self.backward_terms[recompute]
        fixed = own if fixed is None else fixed
        e = reach(prefix, s, budget, fixed)
        if self.issue is None:
            return e
        return min(e, reach(self.issue["B recompute" if recompute else "B"], s, budget, fixed))

    def _layers_sum(self, prefix: list[float], issue_key: str, s: int, e: int) -> float:
        """The layers' sum of a pass over [s, e): under the CPU-issue bound the larger of the two."""
        gpu = prefix[e] - prefix[s]
        if self.issue is None:
            return gpu
        cpu = self.issue[issue_key][e] - self.issue[issue_key][s]
        return gpu if gpu >= cpu else cpu

    def backward_input(self, s: int, e: int, recompute: bool, c: int | None = None) -> float:
        """I of layers [s, e): the input gradient, with the recomputed forward when recomputing
        (as chunk c, with its messages; None: without).

        Chunk 0 has no input gradient to send: its I computes nothing and its W runs the whole
        backward, as torch.distributed.pipelining does (and both executors, which run its code)."""
        bm = self.backward_messages[c] if c is not None else 0.0
        if s == 0 and self.split:
            return self.overhead + bm
        if recompute:
            return self._layers_sum(self.pgir, "I recompute", s, e) + (self.input_fixed[True] + bm)
        return self._layers_sum(self.pgi, "I", s, e) + (self.input_fixed[False] + bm)

    def backward_weight(self, s: int, e: int, recompute: bool = False, c: int | None = None) -> float:
        """W of layers [s, e): the weight gradient (for chunk 0, the whole backward: see I).
        W exchanges no message (``c`` is accepted for symmetry with I)."""
        if s == 0 and self.split:
            prefix, key = (self.pgr, "B recompute") if recompute else (self.pg, "B")
            return self._layers_sum(prefix, key, 0, e) + self.chunk_fixed("W", 0, recompute)
        return self._layers_sum(self.pgw, "W", s, e) + self.weight_fixed

    def optimizer(self, s: int, e: int) -> float:
        """The step after the backward: the gradient sync over the replicas, the optimizer on
        layers [s, e), and tied-gradient exchanges."""
        if not self.figures.tied and not self.sync_on:
            return self.popt[e] - self.popt[s]
        return self.stage_optimizer(((s, e),))

    def gradient_sync_s(self, spans: Sequence[tuple[int, int]]) -> float:
        """One step's gradient sync of a stage holding the layer ranges ``spans`` over its d
        replicas: one ring all-reduce (ddp) or reduce-scatter + all-gather (fsdp, the same time)
        of all its parameter bytes (planner/replicas.py). It runs after the stage's last
        backward, before its optimizer step, so it is charged in the same after-the-backward
        term, which the schedule hides in the next step's fill when the stage has room.

        ``localsgd`` all-reduces no gradient: it averages the parameters, the same ring
        all-reduce of the same bytes, once every H steps, right after the optimizer step. A plan
        is one step repeated, so it is charged amortised, 1/H of the all-reduce every step (docs/planner.md,
        "LocalSGD"): the mean step, where the steps that average take the whole of it."""
        if not self.sync_on:
            return 0.0
        nbytes = sum(self.pp[e] - self.pp[s] for s, e in spans)
        allreduce_s = ring_allreduce_s(nbytes, self.setting.data_parallel, self.setting.sync_bandwidth_bytes_per_s,
                                       self.setting.sync_latency_s)
        if self.setting.gradient_sync == "localsgd":
            allreduce_s /= self.setting.sync_every
        return _cost(allreduce_s)

    @functools.cached_property
    def least_backward_prefix(self) -> list[float]:
        """Prefix sums of each layer's backward at its least, whatever chunk it falls in: B at
        the cheaper recompute choice allowed, and for the split backward the least of I + W and
        B (chunk 0 runs its whole backward as W, and a layer may fall in it)."""
        plain = self.allowed_recompute[0]
        if not self.split:
            return self.pgr if plain else self.pg
        first = self.pgir if plain else self.pgi
        whole = self.pgr if plain else self.pg
        least = [min(first[i + 1] - first[i] + self.pgw[i + 1] - self.pgw[i], whole[i + 1] - whole[i])
                 for i in range(self.L)]
        return [0.0, *accumulate(least)]

    # [Note: a layer's floor]
    # Whatever the cut, one stage runs all M forwards and backwards of layer l, one action at a
    # time (a chunk's actions run in micro-batch order, so none before its forward of micro-batch
    # 0), and that first forward waits for micro-batch 0 to pass every layer before l; after the
    # last backward of l, the last micro-batch's gradient still goes back through every layer
    # before l (a layer of l's chunk before l is in that chunk's M actions, which count it at
    # least once). So the makespan is at least F(<l) + M (F(l) + B(l)) + B(<l), at the least
    # times (no fixed costs, messages or reruns). With the split backward the last I of l may
    # be followed by its W's and no chain: F(<l) + M (F(l) + I(l) + W(l)). The chunked branch
    # and bound's water level holds the heaviest layer whole but not where it sits, and the
    # schedule MILP's relaxation splits it between chunks: on gnmt_large (K = 8, M = 32,
    # interleaved) a 2.4 ms layer near the end makes this 89.8 ms, against 78.1 ms from the
    # branch and bound and 74.4 ms from the relaxation. The branch and bound's bound holds it, so
    # every setting's bound does; the MILP does not have it as a row (docs/planner.md).
    @functools.cached_property
    def layer_floor_s(self) -> float:
        """No plan of the setting has a makespan below this ([Note: a layer's floor])."""
        back = self.least_backward_prefix
        pf = self.pf
        floor = 0.0
        for layer in range(self.L):
            own = self.M * (pf[layer + 1] - pf[layer] + back[layer + 1] - back[layer])
            drain = 0.0 if self.split else back[layer]
            floor = max(floor, pf[layer] + own + drain)
        return floor

    def gradient_sync_s_per_byte(self) -> float:
        """The least each parameter byte more adds to a stage's :meth:`gradient_sync_s` (0 when
        nothing syncs): the ring's per-byte time, amortised like the sync itself for localsgd."""
        if not self.sync_on:
            return 0.0
        rate = ring_allreduce_s_per_byte(self.setting.data_parallel, self.setting.sync_bandwidth_bytes_per_s)
        if self.setting.gradient_sync == "localsgd":
            rate /= self.setting.sync_every
        return rate

    def stage_optimizer(self, spans: Sequence[tuple[int, int]]) -> float:
        """The optimizer step of a stage holding the layer ranges ``spans``, and its tied-gradient
        exchanges: a stage holding some, not all, of a tie's layers sends and receives the
        parameter's gradient once a step (runtime.tied)."""
        total = self.gradient_sync_s(spans)
        for s, e in spans:
            total += self.popt[e] - self.popt[s]
        for t, (layers, _) in enumerate(self.figures.tied):
            inside = sum(1 for i in layers if any(s <= i < e for s, e in spans))
            if 0 < inside < len(layers):
                total += self.tied_exchange_s(t)
        return total

    def least_first_optimizer(self) -> float:
        """A lower bound on stage 0's optimizer step over every partition: the least over its
        possible ends (the optimizer time and the gradient sync alone grow with the stage; a
        tie's exchange need not)."""
        if not self.figures.tied:
            return self.optimizer(0, 1)
        return min(self.optimizer(0, e) for e in range(1, self.L - self.K + 2))

    def tied_exchange_s(self, tie: int) -> float:
        """One exchange of tie ``tie``'s gradient over the link (0 when communication is free)."""
        if not self.setting.comm_on:
            return 0.0
        return self.setting.link_latency_s + self.figures.tied[tie][1] / self.setting.link_bandwidth_bytes_per_s

    def static_memory(self, s: int, e: int, k: int = 0) -> float:
        """Parameters (each weight version), gradients, optimizer state and buffers of layers
        [s, e) on stage k."""
        return (self.pp[e] - self.pp[s]) * self.static_per_param_of[k] + (self.pbuf[e] - self.pbuf[s])

    def _held(self, s: int, e: int, recompute: bool) -> tuple[float, float, float]:
        """(held from F to B/I, extra while B/I recomputes, kept from I to W) of layers [s, e)."""
        act = self.pa[e] - self.pa[s]
        kept = self.pkept[e] - self.pkept[s] if self.split else 0.0
        if s == 0 and self.split:
            # Chunk 0's I frees nothing (see backward_input): all it held, and its rerun, wait for W.
            return (act, 0.0, act) if not recompute else (self.in_bytes[0], 0.0, max(act, self.in_bytes[0]))
        if not recompute:
            return act, 0.0, kept
        inp = self.in_bytes[s]
        return inp, (act - inp if act > inp else 0.0), kept

    def activations(self, k: int, spans: Sequence[tuple[int, int] | None], recompute: bool) -> float:
        """The activation peak of stage k holding the layer ranges ``spans`` (its chunks, in
        order; None for a chunk not chosen yet, which then holds nothing: a lower bound)."""
        if len(spans) == 1 and spans[0] and not self.split:     # the common case, without the tuples
            held, extra, _ = self._held(*spans[0], recompute)
            return self.peaks[k].peak((held,), (extra,), (0.0,))
        held, extra, kept = zip(*(self._held(*span, recompute) if span else (0.0, 0.0, 0.0) for span in spans))
        return self.peaks[k].peak(held, extra, kept)

    def stage_memory(self, k: int, spans: Sequence[tuple[int, int] | None], recompute: bool) -> float:
        """Memory of stage k holding the layer ranges ``spans`` (its chunks, in pipeline order;
        None as in :meth:`activations`)."""
        known = [span for span in spans if span]
        mem = sum(self.static_memory(s, e, k) for s, e in known) + self.activations(k, spans, recompute)
        if self.has_transient and known:
            mem += max(self.transient.query(s, e) for s, e in known)
        return mem

    def memory(self, s: int, e: int, k: int, recompute: bool) -> float:
        """Memory of stage k holding the one chunk [s, e) (schedules with one chunk per stage)."""
        return self.stage_memory(k, ((s, e),), recompute)

    def fits(self, s: int, e: int, k: int, recompute: bool) -> bool:
        return self.limit is None or e <= self.max_end(s, k, recompute)

    def max_end(self, s: int, k: int, recompute: bool) -> int:
        """The longest one-chunk stage starting at s that fits: the largest e with
        memory(s, e) <= limit (s when not even one layer fits). For a fixed start, memory only
        grows with the end, so this one number answers every "does [s, e) fit?" question; it
        is cached."""
        if self.limit is None:
            return self.L
        key = (s, self._peak_class[k], recompute)
        found = self._max_end.get(key)
        if found is None:
            lo, hi = s, self.L          # lo fits (or is s); find the last e that fits
            if self.memory(s, hi, k, recompute) <= self.limit:
                lo = hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self.memory(s, mid, k, recompute) <= self.limit:
                    lo = mid
                else:
                    hi = mid
            found = self._max_end[key] = lo
        return found

    def choose_recompute(self, s: int, e: int, k: int) -> bool | None:
        """The recompute choice for a one-chunk stage, or None when no allowed choice fits.

        Recomputation only ever adds time (it re-runs the forward), so it is chosen only when
        the stage would not fit without it: that is the time-optimal per-stage rule, and the
        brute-force tests check it against trying both.
        """
        for r in self.allowed_recompute:
            if self.fits(s, e, k, r):
                return r
        return None

    def choose_stage_recompute(self, k: int, spans: Sequence[tuple[int, int]]) -> bool | None:
        """The same rule for a stage of several chunks, all of them alike."""
        if self.limit is None:
            return self.allowed_recompute[0]
        for r in self.allowed_recompute:
            if self.limit is None or self.stage_memory(k, spans, r) <= self.limit:
                return r
        return None

    def spans(self, bounds: Sequence[int], k: int) -> tuple[tuple[int, int], ...]:
        """The layer ranges of stage k's chunks, for chunk boundaries ``bounds``."""
        return tuple((bounds[c], bounds[c + 1]) for c in self.peaks[k].chunks)

    def chunk_times(self, c: int, s: int, e: int, recompute: bool) -> tuple[float, float, float, float]:
        """Chunk c = layers [s, e): its F, B, I and W per micro-batch, messages included (the
        one place the solvers and the evaluation read a chunk's times from). Under a split
        backward B is I + W; else I and W say what the halves would take."""
        forward, whole = self.formula(c)
        i = self.backward_input(s, e, recompute, c)
        w = self.backward_weight(s, e, recompute, c)
        b = i + w if self.split else whole(s, e, recompute)
        return forward(s, e), b, i, w

    def chunk(self, c: int, s: int, e: int, recompute: bool) -> ChunkCost:
        """Chunk c = layers [s, e)."""
        k = self.stage_of_chunk[c]
        send = self.comm[e] if c < self.C - 1 and self.stage_of_chunk[c + 1] != k else 0.0
        f, b, i, w = self.chunk_times(c, s, e, recompute)
        if recompute:
            plain = self.chunk_times(c, s, e, False)
            rerun = b - plain[1]
        else:
            rerun = 0.0
        if not self.split:
            # A schedule that runs B: I and W say what the halves would take (the plan shows them).
            w = self.backward_weight(s, e, False, c)
        return ChunkCost(c, k, s, e, recompute, f, b, i, w, rerun, send)

    def stage(self, k: int, spans: Sequence[tuple[int, int]], recompute: bool) -> StageCost:
        """Stage k holding the layer ranges ``spans`` (its chunks, in pipeline order)."""
        pp, pbuf = self.pp, self.pbuf
        params = buffers = 0.0
        for s, e in spans:
            params += pp[e] - pp[s]
            buffers += pbuf[e] - pbuf[s]
        held_params, gradients, state = charged_static_bytes(params, self.setting.optimizer,
                                                             self.setting.data_parallel, self.setting.gradient_sync,
                                                             self.weight_versions[k])
        return StageCost(
            index=k, chunks=self.peaks[k].chunks, recompute=recompute,
            optimizer_s=self.stage_optimizer(spans),
            gradient_sync_s=self.gradient_sync_s(spans),
            in_flight=self.peaks[k].in_flight,
            params_bytes=held_params,
            gradients_bytes=gradients,
            optimizer_state_bytes=state,
            buffers_bytes=buffers,
            activations_bytes=self.activations(k, spans, recompute),
            transient_bytes=max(self.transient.query(s, e) for s, e in spans) if self.has_transient else 0.0,
        )

    def layout(self, bounds: Sequence[int], recompute: Sequence[bool] | None = None
               ) -> tuple[list[ChunkCost], list[StageCost]]:
        """The chunks and stages of the cut ``bounds`` (``0 = b0 < ... < bC = L``, one range per
        chunk); ``recompute`` per stage, or None to choose it per stage (the rule above)."""
        if len(bounds) != self.C + 1:
            raise ValueError(f"{self.schedule} with {self.K} stages has {self.C} chunks: "
                             f"expected {self.C + 1} boundaries, got {len(bounds)}")
        chosen = []
        stage_spans = [self.spans(bounds, k) for k in range(self.K)]
        for k in range(self.K):
            if recompute is not None:
                chosen.append(bool(recompute[k]))
                continue
            r = self.choose_stage_recompute(k, stage_spans[k])
            chosen.append(bool(r) if r is not None else self.allowed_recompute[-1])
        chunks = [self.chunk(c, bounds[c], bounds[c + 1], chosen[self.stage_of_chunk[c]]) for c in range(self.C)]
        stages = [self.stage(k, stage_spans[k], chosen[k]) for k in range(self.K)]
        return chunks, stages


class _RangeMax:
    """Maximum over any range of a fixed list in O(1) (a sparse table)."""

    def __init__(self, values: Sequence[float]):
        self.table = [list(values)]
        n, width = len(values), 1
        while 2 * width <= n:
            prev = self.table[-1]
            self.table.append([max(prev[i], prev[i + width]) for i in range(n - 2 * width + 1)])
            width *= 2

    def query(self, s: int, e: int) -> float:
        """max(values[s:e]) for s < e."""
        level = (e - s).bit_length() - 1
        row = self.table[level]
        return max(row[s], row[e - (1 << level)])


def _cost(value: float) -> float:
    """A time or a size as the solvers may use it: never negative, NaN read as 0.

    ``max(0.0, nan)`` is 0.0 (the comparison is false, so the first argument wins).
    """
    return max(0.0, float(value))


def _prefix(values: Sequence[float]) -> list[float]:
    """Prefix sums of clamped costs (see :func:`_cost`): non-decreasing, as bisection needs.

    Clamping each value costs as much as the sum itself, so it is done only when needed: a
    sum that is not NaN (no NaN inside) and a least value >= 0 mean there is nothing to clamp.
    """
    floats = list(map(float, values))
    total = sum(floats)
    if not (total == total and min(floats, default=0.0) >= 0.0):
        floats = [_cost(v) for v in floats]
    return [0.0, *accumulate(floats)]


def reach(prefix: list[float], start: int, budget: float, extra: float = 0.0) -> int:
    """The largest e >= start with ``prefix[e] - prefix[start] + extra <= budget`` (start if none).

    Bisection finds it on the rearranged inequality; the two loops then settle it on the very
    expression the rest of the planner evaluates, so that rounding can never make a stage
    pass here and exceed the budget there.
    """
    base = prefix[start]
    e = max(start, bisect.bisect_right(prefix, base + budget - extra) - 1)
    while e > start and prefix[e] - base + extra > budget:
        e -= 1
    last = len(prefix) - 1
    while e < last and prefix[e + 1] - base + extra <= budget:
        e += 1
    return e
