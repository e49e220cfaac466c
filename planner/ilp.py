"""The same problem as an integer linear programme (pulp with its bundled CBC solver).

A second, independent exact method for GPipe and 1F1B (``--solver ilp`` plans the other
schedules with the schedule MILP, planner/milp.py): the tests hold the DP and this ILP to the
same optimum, and brute force holds both. It is slower than the DP, but it is a direct transcription of the
cost model, which makes it easy to trust.

Variables: ``below[i][k]`` = 1 when layer i sits in stage k or earlier. Contiguity is then
``below[i+1][k] <= below[i][k] <= below[i][k+1]``, layer i's stage indicator is
``below[i][k] - below[i][k-1]``, and layer i ends stage k exactly when
``below[i][k] - below[i+1][k]`` is 1, which prices the cut. ``recompute[k]`` chooses
recomputation; its extra time (the rerun per layer plus the checkpoint call, ``R_k * recompute[k]``)
is linearised with a big-M bound.

Time, GPipe: the closed form, with ``phi >= F_k, C_k`` and ``gamma >= B_k, C_k``.
Time, 1F1B: every operation of the schedule gets a start-time variable; each must start after
its stage's previous operation and after its input arrived over the link (links are
sequential resources too), and the step is the end of stage 0's last backward plus its
optimizer step. Minimising the step over start times is the schedule's longest path, so the
ILP's optimum is exactly the simulator's step for the best partition.

Memory: per stage, in the form of :mod:`planner.costmodel`; with recomputation allowed, one
constraint for each choice, the one not taken relaxed by a big-M.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

try:  # only --solver ilp needs pulp; the exact solvers and every other command run without it
    import pulp
except ImportError:  # pragma: no cover - pulp is a dependency; a GPU image may lack it
    pulp = None

from ..artifacts import BadInput
from .budgets import SOLVER_TIME_BUDGET_S
from .costmodel import CostModel
from .objective import Solution, evaluate
from ..schedules import all_actions


def solve_ilp(cm: CostModel, time_limit_s: float = SOLVER_TIME_BUDGET_S) -> Solution | None:
    """The best partition of ``cm`` as CBC finds it within ``time_limit_s`` (None: nothing fits,
    or CBC found no plan in time). ``proven`` only when CBC proved its optimum."""
    _check_supported(cm)
    model = _build_model(cm)
    with warnings.catch_warnings():
        # PuLP 3.3 announces API changes for 4.0 (pyproject keeps us below it).
        warnings.simplefilter("ignore", DeprecationWarning)
        status = model.prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(time_limit_s)), gapRel=0,
                                                    gapAbs=1e-9))
    return _read_solution(cm, model, status)


def _check_supported(cm: CostModel) -> None:
    """Refuse what the ILP cannot do, in one line: pulp missing, or a schedule it does not model."""
    if pulp is None:
        raise BadInput("--solver ilp needs the pulp package, which is not installed here: pip install pulp, "
                       "or use --solver exact")
    if cm.schedule not in ("gpipe", "1f1b"):
        raise BadInput(f"this ILP plans gpipe and 1f1b only, not {cm.schedule}: --solver ilp plans the other "
                       "schedules with the schedule MILP (planner/milp.py)")


@dataclass(frozen=True)
class _ScaledTimes:
    """The cost model's times in units of the mean layer's work, which keeps CBC's tolerances
    meaningful whatever the model's scale; but never so small a unit that another term (a send,
    a tied exchange, the overhead) exceeds it :data:`_LARGEST_COEFFICIENT` times over: CBC finds
    no solution among coefficients that far apart (layers of 1e-257 s beside a 0.1 s exchange)."""

    time_unit: float
    forward: list[float]         # per layer
    backward: list[float]
    rerun: list[float]           # what recomputing adds to each layer's backward (>= 0)
    call: float                  # the checkpoint call, once per recomputing stage
    optimizer: list[float]       # per layer
    forward_fixed: list[float]   # per stage: its forward's fixed part (CostModel.chunk_fixed)
    backward_fixed: list[float]  # per stage: its plain backward's
    comm: list[float]            # comm[e]: the cut before layer e
    # The CPU-issue bound (CUDA profiles): per layer, the issue time of its forward and backward
    # and what recomputing adds to the backward's; None without it.
    issue_forward: list[float] | None = None
    issue_backward: list[float] | None = None
    issue_rerun: list[float] | None = None


_LARGEST_COEFFICIENT = 1e6


def _scaled_times(cm: CostModel) -> _ScaledTimes:
    fig = cm.figures
    forward_fixed = [cm.chunk_fixed("F", k) for k in range(cm.K)]
    backward_fixed = [cm.chunk_fixed("B", k) for k in range(cm.K)]
    others = [*cm.comm, *forward_fixed, *backward_fixed, fig.recompute_call_s, *fig.optimizer_s,
              *(cm.tied_exchange_s(t) for t in range(len(fig.tied)))]
    work = (sum(fig.forward_s) + sum(fig.backward_s)) / cm.L
    unit = max(work, max(others) / _LARGEST_COEFFICIENT) or 1.0
    return _ScaledTimes(
        time_unit=unit,
        forward=[x / unit for x in fig.forward_s],
        backward=[x / unit for x in fig.backward_s],
        rerun=[(r - b) / unit for r, b in zip(fig.recomputing_backward_s(), fig.backward_s)],
        call=fig.recompute_call_s / unit,
        optimizer=[x / unit for x in fig.optimizer_s],
        forward_fixed=[x / unit for x in forward_fixed],
        backward_fixed=[x / unit for x in backward_fixed],
        comm=[c / unit for c in cm.comm],
        **_scaled_issue(cm, unit),
    )


def _scaled_issue(cm: CostModel, unit: float) -> dict[str, list[float]]:
    issue = cm.figures.issue_times()
    if issue is None:
        return {}
    return {"issue_forward": [x / unit for x in issue["F"]], "issue_backward": [x / unit for x in issue["B"]],
            "issue_rerun": [(r - b) / unit for r, b in zip(issue["B recompute"], issue["B"])]}


@dataclass
class _Model:
    """The programme and the variables a plan is read back from."""

    prob: Any
    below: list[list[Any]]       # below[i][k]: layer i sits in stage k or earlier
    recompute: list[Any]         # per stage: 0 or 1 when fixed, else a binary variable


def _build_model(cm: CostModel) -> _Model:
    """The whole programme: the partition's variables, each stage's times, the step time to
    minimise, and (under a limit) the memory constraints."""
    L, K = cm.L, cm.K
    times = _scaled_times(cm)
    prob = pulp.LpProblem("gpipe_plan", pulp.LpMinimize)
    below = _contiguous_stages(prob, L, K)

    def member(i: int, k: int):
        """1 when layer i is in stage k."""
        return below[i][k] - (below[i][k - 1] if k else 0)

    for k in range(K):
        prob += pulp.lpSum(member(i, k) for i in range(L)) >= 1

    def ends(i: int, k: int):
        """1 when layer i is the last layer of stage k (k < K-1)."""
        return below[i][k] - below[i + 1][k]

    recompute = _recompute_choices(prob, cm)
    forward, backward, send = _stage_times(prob, cm, times, member, ends, recompute)
    optimizer_tail = _optimizer_tail(prob, cm, times, member, forward, send)
    prob += _makespan(prob, cm, forward, backward, send) + optimizer_tail
    if cm.limit is not None:
        _memory_constraints(prob, cm, member, ends, recompute)
    return _Model(prob, below, recompute)


def _contiguous_stages(prob, L: int, K: int) -> list[list[Any]]:
    """``below[i][k]``, constrained so that every stage is a contiguous run of layers and the
    last stage ends the model."""
    below = [[_var(prob, f"below_{i}_{k}", cat="Binary") for k in range(K)] for i in range(L)]
    for i in range(L):
        prob += below[i][K - 1] == 1
        for k in range(K - 1):
            prob += below[i][k] <= below[i][k + 1]
        if i + 1 < L:
            for k in range(K):
                prob += below[i + 1][k] <= below[i][k]
    return below


def _recompute_choices(prob, cm: CostModel) -> list[Any]:
    """Per stage: 0 or 1 when the setting fixes recomputation, else a binary variable."""
    recompute = []
    for k in range(cm.K):
        if cm.allowed_recompute == (False,):
            recompute.append(0)
        elif cm.allowed_recompute == (True,):
            recompute.append(1)
        else:
            recompute.append(_var(prob, f"recompute_{k}", cat="Binary"))
    return recompute


def _stage_times(prob, cm: CostModel, times: _ScaledTimes, member, ends, recompute):
    """Each stage's forward and backward (recomputation's extra linearised with a big-M) and
    each cut's send, as expressions: (forward, backward, send)."""
    L, K = cm.L, cm.K
    forward, backward, send = [], [], []
    big_extra = sum(times.rerun) + times.call
    for k in range(K):
        fk = pulp.lpSum(times.forward[i] * member(i, k) for i in range(L)) + times.forward_fixed[k]
        rerun_k = pulp.lpSum(times.rerun[i] * member(i, k) for i in range(L)) + times.call
        extra = _var(prob, f"recompute_time_{k}", 0)
        if isinstance(recompute[k], int):
            prob += extra == (rerun_k if recompute[k] else 0)
        else:
            prob += extra >= rerun_k - big_extra * (1 - recompute[k])
        bk = pulp.lpSum(times.backward[i] * member(i, k) for i in range(L)) + times.backward_fixed[k] + extra
        if times.issue_forward is not None:
            fk, bk = _issue_bound(prob, k, times, member, recompute[k], fk, bk, L)
        forward.append(fk)
        backward.append(bk)
        if k < K - 1:
            send.append(pulp.lpSum(times.comm[i + 1] * ends(i, k) for i in range(L - 1)))
    return forward, backward, send


def _issue_bound(prob, k: int, times: _ScaledTimes, member, recompute, fk, bk, L: int):
    """Stage k's forward and backward under the CPU-issue bound: variables at least the GPU's
    sums and at least the issue sums (each with the fixed part); every objective term grows with
    them, so the optimum holds each at the larger (planner/costmodel.py)."""
    f = _var(prob, f"issue_bound_forward_{k}", 0)
    b = _var(prob, f"issue_bound_backward_{k}", 0)
    prob += f >= fk
    prob += f >= pulp.lpSum(times.issue_forward[i] * member(i, k) for i in range(L)) + times.forward_fixed[k]
    prob += b >= bk
    rerun = pulp.lpSum(times.issue_rerun[i] * member(i, k) for i in range(L)) + times.call
    issue_extra = _var(prob, f"issue_recompute_{k}", 0)
    if isinstance(recompute, int):
        prob += issue_extra == (rerun if recompute else 0)
    else:
        prob += issue_extra >= rerun - (sum(times.issue_rerun) + times.call) * (1 - recompute)
    prob += b >= (pulp.lpSum(times.issue_backward[i] * member(i, k) for i in range(L)) + times.backward_fixed[k]
                  + issue_extra)
    return f, b


def _optimizer_tail(prob, cm: CostModel, times: _ScaledTimes, member, forward, send):
    """The optimizer tail (planner.objective.gpipe_optimizer_tail): max_k (optimizer_k - fill before k)."""
    L, K = cm.L, cm.K
    optimizer_tail = _var(prob, "optimizer_tail", 0)
    before = 0
    for k in range(K):
        prob += optimizer_tail >= (pulp.lpSum(times.optimizer[i] * member(i, k) for i in range(L))
                                   + _tied_exchange(prob, cm, member, k, times.time_unit) - before)
        before = before + forward[k] + (send[k] if k < K - 1 else 0)
    return optimizer_tail


def _makespan(prob, cm: CostModel, forward, backward, send):
    """The schedule's makespan: GPipe's closed form, with ``phi >= F_k, C_k`` and
    ``gamma >= B_k, C_k``; 1F1B's longest path over start times (:func:`_schedule_makespan`)."""
    K, M = cm.K, cm.M
    if cm.setting.schedule != "gpipe":
        return _schedule_makespan(prob, cm.setting.schedule, K, M, forward, backward, send)
    phi = _var(prob, "phi", 0)
    gamma = _var(prob, "gamma", 0)
    for k in range(K):
        prob += phi >= forward[k]
        prob += gamma >= backward[k]
    for c in send:
        prob += phi >= c
        prob += gamma >= c
    return pulp.lpSum(forward) + pulp.lpSum(backward) + 2 * pulp.lpSum(send) + (M - 1) * (phi + gamma)


def _read_solution(cm: CostModel, model: _Model, status) -> Solution | None:
    """The plan CBC found, evaluated by the cost model (None when it found none)."""
    prob, below, L, K = model.prob, model.below, cm.L, cm.K
    if pulp.LpStatus[status] == "Infeasible":
        return None
    if pulp.LpStatus[status] != "Optimal" and prob.sol_status not in (pulp.LpSolutionIntegerFeasible,):
        return None
    stage_of = [min(k for k in range(K) if (below[i][k].value() or 0) > 0.5) for i in range(L)]
    bounds = [0] + [i for i in range(1, L) if stage_of[i] != stage_of[i - 1]] + [L]
    # A recompute variable no constraint needs (e.g. stages with no forward time) may be left
    # without a value: it changes nothing, so read it as "no".
    chosen = [bool(r) if isinstance(r, int) else bool(round(r.value() or 0)) for r in model.recompute]
    ev = evaluate(cm, bounds, chosen)
    proven = pulp.LpStatus[status] == "Optimal" and prob.sol_status == pulp.LpSolutionOptimal
    lower = ev.step_s if proven else 0.0     # CBC stopped early: no bound we can vouch for
    if proven and ev.dedicated_step_s is not None:
        # Shared cores: the programme optimises the dedicated step, which bounds every plan's
        # time-shared step from below (planner/timeshare.py); this plan is proven only if it meets it.
        lower = ev.dedicated_step_s
        proven = ev.step_s <= lower
    return Solution(ev, proven, lower, f"integer linear programme (pulp/CBC), {cm.setting.schedule}",
                    {"variables": len(prob.variables()), "constraints": len(prob.constraints)}, bound_by="ilp")


def _tied_exchange(prob, cm: CostModel, member, k: int, time_unit: float):
    """Stage k's tied-gradient exchanges (CostModel.stage_optimizer), linearised.

    ``split`` is 1 when stage k holds some but not all of a tie's layers: it is at least
    member(i) - member(j) for every pair of the tie's layers, and the minimisation keeps it at
    0 otherwise (its cost only raises the optimizer tail).
    """
    terms = []
    for t, (layers, _) in enumerate(cm.figures.tied):
        cost = cm.tied_exchange_s(t) / time_unit
        if cost <= 0:
            continue
        split = _var(prob, f"tied_{t}_{k}", 0)
        for i in layers:
            for j in layers:
                if i != j:
                    prob += split >= member(i, k) - member(j, k)
        terms.append(cost * split)
    return pulp.lpSum(terms) if terms else 0


def _var(prob, name: str, low: float | None = None, cat: str = "Continuous"):
    """A variable of ``prob``: PuLP 3.3+ attaches it with add_variable, older PuLP builds it alone."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, cat=cat)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.LpVariable(name, lowBound=low, cat=cat)


def _schedule_makespan(prob, schedule: str, K: int, M: int, forward, backward, send):
    """Start-time variables for every operation and send; returns stage 0's finish time."""
    orders = [[(a.kind, a.micro_batch) for a in actions] for actions in all_actions(schedule, K, M)]
    start = {}
    for k in range(K):
        previous = None
        for kind, m in orders[k]:
            var = _var(prob, f"start_{kind}_{k}_{m}", 0)
            start[(kind, k, m)] = var
            if previous is not None:
                prev_kind = previous[0]
                prob += var >= start[previous] + (forward[k] if prev_kind == "F" else backward[k])
            previous = (kind, k, m)
    # Links: sends leave in the order their stage produced them, one at a time.
    for k in range(K - 1):
        fwd_prev = bwd_prev = None
        for kind, m in orders[k]:
            if kind == "F":
                sent = _var(prob, f"send_fwd_{k}_{m}", 0)
                prob += sent >= start[("F", k, m)] + forward[k]
                if fwd_prev is not None:
                    prob += sent >= fwd_prev + send[k]
                prob += start[("F", k + 1, m)] >= sent + send[k]
                fwd_prev = sent
        for kind, m in orders[k + 1]:
            if kind == "B":
                sent = _var(prob, f"send_bwd_{k}_{m}", 0)
                prob += sent >= start[("B", k + 1, m)] + backward[k + 1]
                if bwd_prev is not None:
                    prob += sent >= bwd_prev + send[k]
                prob += start[("B", k, m)] >= sent + send[k]
                bwd_prev = sent
    for m in range(M):
        prob += start[("B", K - 1, m)] >= start[("F", K - 1, m)] + forward[K - 1]
    last_kind, last_m = orders[0][-1]
    return start[(last_kind, 0, last_m)] + backward[0]


def _memory_constraints(prob, cm: CostModel, member, ends, recompute) -> None:
    L, K = cm.L, cm.K
    fig = cm.figures
    unit = cm.limit
    static = [(p * cm.static_per_param + b) / unit for p, b in zip(fig.param_bytes, fig.buffer_bytes)]
    act = [a / unit for a in fig.activation_bytes]
    trans = [t / unit for t in fig.transient_bytes]
    inbytes = [x / unit for x in cm.in_bytes]
    big = 1.0 + sum(static) + cm.M * (sum(act) + max(inbytes) + max(trans, default=0.0))
    for k in range(K):
        n = cm.in_flight(k)
        held = pulp.lpSum(static[i] * member(i, k) for i in range(L))
        acts = pulp.lpSum(act[i] * member(i, k) for i in range(L))
        peak = _var(prob, f"transient_{k}", 0)
        for i in range(L):
            if trans[i] > 0:
                prob += peak >= trans[i] * member(i, k)
        stage_input = inbytes[0] if k == 0 else pulp.lpSum(inbytes[i + 1] * ends(i, k - 1) for i in range(L - 1))
        plain = held + peak + n * acts
        # (n - 1) inputs + max(activations, input): see planner.costmodel
        held_one = _var(prob, f"recompute_peak_{k}", 0)
        prob += held_one >= acts
        prob += held_one >= stage_input
        recomputing = held + peak + (n - 1) * stage_input + held_one
        r = recompute[k]
        if isinstance(r, int):
            prob += (recomputing if r else plain) <= 1.0
        else:
            prob += plain <= 1.0 + big * r
            prob += recomputing <= 1.0 + big * (1 - r)
