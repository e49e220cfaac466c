"""Every schedule's step as a mixed-integer linear programme (MILP): an exact solver and a bound.

The event simulator (:mod:`planner.simulator`) computes the step of one cut. Written as
constraints, the same computation becomes an optimisation over every cut at once:

* **Cuts as monotone binaries.** Chunk boundary ``b_j`` (j = 1 .. C-1; ``b_0 = 0``, ``b_C = L``)
  lies in its window ``j <= b_j <= L - C + j``; ``y[j][p] = 1`` means ``b_j <= p``. Then
  ``y[j][p] <= y[j][p+1]`` (monotone) and ``y[j+1][p] <= y[j][p-1]`` (chunks are not empty),
  and *any* function g of one cut position is linear in them: ``g(b_j) = g(hi) - Σ_p (g(p+1) -
  g(p)) y[j][p]`` (telescoping). A pass over chunk c's layers ``[b_c, b_c+1)`` costs
  ``prefix[b_c+1] - prefix[b_c] + fixed``, the cost model's own formula, so per-layer
  coefficients are prefix differences; a send is ``comm[b_c+1]``; memory and the optimizer
  step are sums of such terms.
* **A start time per action.** Each stage runs its list in a fixed order, so the schedule is a
  longest path: ``start(next) >= start(this) + duration(this)`` on a stage, ``start(consumer)
  >= arrival`` of its input, where an input crossing stages is a message on its link, sent no
  earlier than it was produced nor than the previous message on that link was sent plus that
  one's send time (first in, first out, as the simulator's links). Only difference
  constraints between start times: for fixed cuts the least solution is the simulator's, so
  the programme's optimum is the best cut's simulated step, not an approximation of it.
* **The step** is the makespan (``>=`` every stage's last end) plus the optimizer tail
  ``max_k (optimizer_k - start of stage k's first action)``. That first start is not left to
  the programme (it could delay it to hide a tail): it is the forward chain of micro-batch 0 up
  to stage k's lowest chunk, a linear form of the cuts.
* **Recomputation** per stage: fixed when the setting fixes it (or sets no memory limit: then
  it never pays), else a binary whose extra time (the rerun, ``>= 0``) is added with a big-M;
  **memory** per stage: its static bytes plus each of the undominated activation forms
  (:func:`costmodel.stage_peaks`) ``<=`` the limit, one set per recompute choice, the other
  relaxed.

The linear relaxation lets layers split between chunks (any fractional ``y`` is a mixture of
cuts), so its bound alone is weak on models with a few heavy layers; branching on the cuts
closes it. Solving it within a budget, and what its answer means: :mod:`planner.milp_solve`.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..collectives import ring_allreduce_s
from .costmodel import CostModel
from .simulator import compiled_program


# Building a programme and HiGHS's presolve take about 0.1 s of CPU per thousand variables and
# constraints; its root (the linear relaxation and its cut rounds) grows faster than the programme:
# 0.3-0.8 s per thousand up to 3,500 of them, 1.2-1.9 s at 4,600-7,700 on the 2-core development VM
# (docs/benchmarks/milp-charge.md). Charged as work, per thousand: ROOT_S_PER_THOUSAND_SQUARED
# times the thousands, but at least ROOT_S_PER_THOUSAND and at most ROOT_S_PER_THOUSAND_MOST. (The
# cap undercharges the largest roots, up to 1.9 times at 7,700; charged in full, a setting of 8
# stages and 32 micro-batches could no longer afford the root whose bound is its best: on the
# exactness bench its gaps grew, inception_v3's from 4% to 25%. The wall clock's safety net,
# budgets.WALL_SAFETY, bounds what it overruns.)
ROOT_S_PER_THOUSAND = 0.5
ROOT_S_PER_THOUSAND_SQUARED = 0.25
ROOT_S_PER_THOUSAND_MOST = 1.0
# How far a constant row may miss its bounds and still hold (rounding in the sums that made it;
# rows are in the programme's units, a layer's time or a memory limit, about 1).
CONSTANT_SLACK = 1e-9


def available() -> str | None:
    """The solver the programme would run on: "HiGHS" (highspy installed), "CBC" (pulp's, without
    highspy), or None: neither (the GPU image), and the planner plans with its branch and bound
    alone. Asked without importing them (pulp and highspy take 0.16 s to import)."""
    if _installed("highspy"):
        return "HiGHS"
    return "CBC" if _installed("pulp") else None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):     # ValueError: a module set to None in sys.modules
        return False


def size(cm: CostModel) -> int:
    """About how many variables and constraints ``cm``'s programme has, counted, not built: three
    per action (its start, its precedences, its message) and three per cut position."""
    actions = compiled_program(cm.schedule, cm.K, cm.M, cm.virtual_stages).actions
    return 3 * actions + 3 * max(0, cm.C - 1) * max(0, cm.L - cm.C)


def root_s_per_thousand(thousands: float) -> float:
    """What building a programme of ``thousands`` thousand variables and constraints and solving
    its root are charged per thousand: :data:`ROOT_S_PER_THOUSAND_SQUARED` times the thousands,
    within [:data:`ROOT_S_PER_THOUSAND`, :data:`ROOT_S_PER_THOUSAND_MOST`]."""
    return min(ROOT_S_PER_THOUSAND_MOST, max(ROOT_S_PER_THOUSAND, ROOT_S_PER_THOUSAND_SQUARED * thousands))


def fixed_cost_s(cm: CostModel) -> float:
    """What building ``cm``'s programme, handing it over and solving its root node cost, in
    seconds of work (:func:`root_s_per_thousand` per thousand of its :func:`size`). A setting
    whose budget cannot pay for it one and a half times over keeps its branch and bound's answer
    (planner/solvers.py)."""
    thousands = size(cm) / 1000
    return thousands * root_s_per_thousand(thousands)


def pass_terms(cm: CostModel, kind: str, chunk: int, recompute: bool) -> tuple[Sequence[float], float]:
    """The linear form of chunk ``chunk``'s ``kind`` pass (F, B, I or W), per micro-batch, as
    (prefix, fixed): over layers [s, e) it takes ``prefix[e] - prefix[s] + fixed``, what
    CostModel.forward / backward / backward_input / backward_weight compute, the fixed part
    :meth:`CostModel.chunk_fixed` (its kind's fixed cost, the cost between actions, the
    checkpoint call, its messages). Chunk 0 of a split backward has no input gradient: its I is
    the fixed part alone and its W the whole backward."""
    fixed = cm.chunk_fixed(kind, chunk, recompute and kind != "F")
    if kind == "F":
        return cm.pf, fixed
    if kind == "B":
        return (cm.pgr if recompute else cm.pg), fixed
    if chunk == 0 and cm.split:
        return ((0.0,) * (cm.L + 1), fixed) if kind == "I" else ((cm.pgr if recompute else cm.pg), fixed)
    if kind == "I":
        return (cm.pgir if recompute else cm.pgi), fixed
    return cm.pgw, fixed


def applicable(cm: CostModel) -> bool:
    """Whether the programme models ``cm`` exactly enough to serve: not under the CPU-issue bound
    (a pass there is the larger of two sums, which is not linear in the cuts; the branch and
    bound plans those settings alone), and with at least one layer per chunk."""
    return cm.issue is None and cm.C <= cm.L


# --------------------------------------------------------------------------- linear forms
class _Form:
    """``constant + Σ coefficient · variable``, kept as a dict (pulp's operators are slow)."""

    __slots__ = ("constant", "terms")

    def __init__(self, constant: float = 0.0, terms: dict | None = None):
        self.constant = constant
        self.terms = terms if terms is not None else {}

    def add(self, other: "_Form", factor: float = 1.0) -> "_Form":
        self.constant += factor * other.constant
        terms = self.terms
        for var, coef in other.terms.items():
            terms[var] = terms.get(var, 0.0) + factor * coef
        return self

    def plus(self, var, coef: float = 1.0) -> "_Form":
        self.terms[var] = self.terms.get(var, 0.0) + coef
        return self

    def scaled(self, factor: float) -> "_Form":
        return _Form(self.constant * factor, {v: c * factor for v, c in self.terms.items()})

    def upper(self, pr: "_Programme") -> float:
        """The largest value over the variables' boxes."""
        total = self.constant
        for var, coef in self.terms.items():
            low, high = pr.box(var)
            total += coef * (high if coef > 0 else low)
        return total


class _Programme:
    """A MILP in no solver's terms: columns (bounds, integrality) and rows ``lower <= Σ a x <=
    upper``, numbered as they are made; planner/milp_solve.py hands it to HiGHS or to pulp's CBC."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.low: list[float] = []
        self.high: list[float] = []
        self.binary: list[bool] = []
        self.rows: list[tuple[float, float, list[int], list[float]]] = []
        self.cost: dict[int, float] = {}
        # A row whose every variable dropped out is a constant: kept, it would be a row of no
        # columns (solvers differ on those); dropped, one that fails would be lost and a cut that
        # breaks it "proven" (a memory limit where L = C leaves no cut to choose). Noted instead.
        self.unsatisfiable = False

    def var(self, name: str, low: float = 0.0, high: float | None = None, binary: bool = False) -> int:
        self.names.append(name)
        self.low.append(low)
        self.high.append(1.0 if binary else (math.inf if high is None else high))
        self.binary.append(binary)
        return len(self.names) - 1

    def objective(self, form: _Form) -> None:
        """Minimise ``form`` (its constant dropped)."""
        self.cost = dict(form.terms)

    def at_least(self, form: _Form, rhs: float = 0.0) -> None:
        """form >= rhs."""
        self._add(form, rhs - form.constant, math.inf)

    def at_most(self, form: _Form, rhs: float = 0.0) -> None:
        """form <= rhs."""
        self._add(form, -math.inf, rhs - form.constant)

    def equal(self, form: _Form, rhs: float = 0.0) -> None:
        self._add(form, rhs - form.constant, rhs - form.constant)

    def _add(self, form: _Form, lower: float, upper: float) -> None:
        index = [v for v, c in form.terms.items() if c != 0.0]
        if index:
            self.rows.append((lower, upper, index, [form.terms[v] for v in index]))
        elif lower > CONSTANT_SLACK * max(1.0, abs(lower)) or upper < -CONSTANT_SLACK * max(1.0, abs(upper)):
            self.unsatisfiable = True

    def box(self, var: int) -> tuple[float, float]:
        return self.low[var], self.high[var]


class _Cuts:
    """The C - 1 cuts as monotone binaries (module docstring): ``y[j][p] = 1`` iff ``b_j <= p``."""

    def __init__(self, pr: _Programme, L: int, C: int):
        self.L, self.C = L, C
        self.lo = [j for j in range(C + 1)]
        self.hi = [L - C + j for j in range(C + 1)]
        self.hi[0], self.lo[C] = 0, L
        self.y: list[dict[int, Any]] = [{} for _ in range(C + 1)]
        for j in range(1, C):
            self.y[j] = {p: pr.var(f"y_{j}_{p}", binary=True) for p in range(self.lo[j], self.hi[j])}
            for p in range(self.lo[j], self.hi[j] - 1):
                pr.at_least(_Form(0.0, {self.y[j][p + 1]: 1.0, self.y[j][p]: -1.0}))
        for j in range(1, C - 1):       # b_j < b_j+1: b_j+1 <= p implies b_j <= p - 1
            for p, var in self.y[j + 1].items():
                below = self.y[j].get(p - 1)
                if below is None:
                    if p - 1 < self.lo[j]:
                        pr.at_most(_Form(0.0, {var: 1.0}))
                    continue
                pr.at_least(_Form(0.0, {below: 1.0, var: -1.0}))
        self.structure = len(pr.rows)      # the rows so far only say what a cut is
        self.silent: list[set[int]] = [set() for _ in range(C + 1)]

    def canonical_only(self, pr: _Programme) -> None:
        """Leave one of each set of cuts that cost alike (call once every cost is in ``pr``).

        A binary ``y[j][p]`` that no cost reads (every function of a cut takes the same value at
        p and p + 1: layer p costs nothing at all, as a zero-time layer with no parameters, on
        free links and without a memory limit) only tells cuts apart that cost the same: b_j = p
        and b_j = p + 1. Of those the programme keeps the leftmost: b_j = p + 1 only when b_j-1 = p
        (chunk j - 1 is that one layer). Moving such a b_j left while it can keeps every cost, so
        a cut that obeys this is as good as any (:meth:`canonical` finds it), and the search no
        longer branches between cuts that differ only where nothing is charged."""
        used = set()
        for row in pr.rows[self.structure:]:
            used.update(row[2])
        used.update(pr.cost)
        self.silent = [{p for p, var in self.y[j].items() if var not in used} for j in range(self.C + 1)]
        for j in range(1, self.C):
            for p in sorted(self.silent[j]):
                # y[j][p+1] - y[j][p] <= [b_j-1 = p]
                form = self.indicator(j, p + 1).add(self.indicator(j, p), -1.0)
                form.add(self.indicator(j - 1, p), -1.0).add(self.indicator(j - 1, p - 1))
                pr.at_most(form, 0.0)

    def canonical(self, bounds: Sequence[int]) -> tuple[int, ...]:
        """The cut of the same cost that :meth:`canonical_only` keeps: each b_j moved left while
        the layer it passes costs nothing and the chunk before keeps a layer."""
        out = list(bounds)
        moved = True
        while moved:
            moved = False
            for j in range(1, self.C):
                while out[j] - 1 in self.silent[j] and out[j] - 1 > out[j - 1]:
                    out[j] -= 1
                    moved = True
        return tuple(out)

    def indicator(self, j: int, p: int) -> _Form:
        """[b_j <= p]."""
        if p < self.lo[j]:
            return _Form(0.0)
        if p >= self.hi[j]:
            return _Form(1.0)
        return _Form(0.0, {self.y[j][p]: 1.0})

    def at(self, j: int, g: Sequence[float]) -> _Form:
        """g(b_j) for a function g of positions 0..L: ``g(hi) - Σ_p (g(p+1) - g(p)) y[j][p]``."""
        form = _Form(g[self.hi[j]])
        terms = form.terms
        for p, var in self.y[j].items():
            d = g[p + 1] - g[p]
            if d:
                terms[var] = -d
        return form

    def span(self, c: int, prefix: Sequence[float], fixed: float = 0.0) -> _Form:
        """prefix[b_c+1] - prefix[b_c] + fixed: a pass, or a sum of per-layer figures, over chunk c."""
        form = self.at(c + 1, prefix).add(self.at(c, prefix), -1.0)
        form.constant += fixed
        return form

    def member(self, i: int, c: int) -> _Form:
        """[layer i lies in chunk c] = [b_c <= i] - [b_c+1 <= i]."""
        return self.indicator(c, i).add(self.indicator(c + 1, i), -1.0)

    def values(self, bounds: Sequence[int]) -> dict:
        """The binaries' values for the cut ``bounds`` (a warm start)."""
        return {var: float(bounds[j] <= p) for j in range(1, self.C) for p, var in self.y[j].items()}

    def read(self, values: Sequence[float]) -> tuple[int, ...]:
        """The cut a solution (``values`` by column) holds."""
        bounds = [0]
        for j in range(1, self.C):
            bounds.append(self.lo[j] + sum(1 for var in self.y[j].values() if values[var] < 0.5))
        return (*bounds, self.L)


# --------------------------------------------------------------------------- the model
@dataclass
class _Model:
    pr: _Programme
    cuts: _Cuts
    recompute: list[Any]             # per stage: a bool, or a binary variable (its column)
    unit: float                      # seconds per time unit of the programme
    objective: _Form
    stats: dict = field(default_factory=dict)


def _time_unit(cm: CostModel) -> float:
    """Seconds per unit: the mean layer's work, but never so small that another term exceeds it
    a million times over (as ilp._scaled_times: solvers lose their tolerances across such ranges)."""
    L = cm.L
    work = (cm.pf[L] + cm.pg[L]) / max(1, L)
    others = [max(cm.comm, default=0.0), *(cm.chunk_fixed(kind, c, r) for kind in ("F", "B", "I", "W")
                                              for c in range(cm.C) for r in (False, True)), cm.popt[L]]
    return max(work, max(others) / 1e6) or 1.0


def build(cm: CostModel) -> _Model:
    """The programme of ``cm``'s setting (module docstring)."""
    pr = _Programme()
    L, C, K, M = cm.L, cm.C, cm.K, cm.M
    cuts = _Cuts(pr, L, C)
    unit = _time_unit(cm)
    inv = 1.0 / unit
    stage_of = cm.stage_of_chunk
    recompute: list[Any] = []
    for k in range(K):
        if cm.limit is None or len(cm.allowed_recompute) == 1:
            recompute.append(cm.allowed_recompute[0])
        else:
            recompute.append(pr.var(f"r_{k}", binary=True))

    # Durations, one variable per (kind, chunk) the schedule runs.
    kinds = ("F", "I", "W") if cm.split else ("F", "B")
    duration: dict[tuple[str, int], Any] = {}
    for c in range(C):
        r = recompute[stage_of[c]]
        for kind in kinds:
            var = pr.var(f"d_{kind}_{c}")
            duration[(kind, c)] = var
            if isinstance(r, bool) or kind == "F":
                form = cuts.span(c, *pass_terms(cm, kind, c, bool(r) and kind != "F")).scaled(inv)
            else:
                form = cuts.span(c, *pass_terms(cm, kind, c, False)).scaled(inv)
                rerun = cuts.span(c, *pass_terms(cm, kind, c, True)).scaled(inv).add(form, -1.0)
                if rerun.terms or rerun.constant:
                    big = rerun.upper(pr)
                    extra = pr.var(f"x_{kind}_{c}", high=max(0.0, big))
                    # extra >= rerun - big (1 - r): the rerun when recomputing, nothing otherwise
                    pr.at_least(_Form(big, {extra: 1.0, r: -big}).add(rerun, -1.0))
                    form.plus(extra)
            pr.equal(form.plus(var, -1.0))
    send: dict[int, Any] = {}
    for c in range(C - 1):
        if stage_of[c] != stage_of[c + 1]:
            form = cuts.at(c + 1, cm.comm).scaled(inv)
            if form.terms or form.constant:
                var = pr.var(f"s_{c}")
                pr.equal(form.plus(var, -1.0))
                send[c] = var

    # Start times and the schedule's dependencies, from the simulator's compiled program.
    prog = compiled_program(cm.schedule, K, M, cm.virtual_stages)
    kind_name = ("F", "B", "I", "W")
    start = [[pr.var(f"t_{k}_{i}") for i in range(len(ops))] for k, ops in enumerate(prog.ops)]
    producer: dict[int, tuple[int, int]] = {}
    for k, ops in enumerate(prog.ops):
        for i, op in enumerate(ops):
            if op[2] >= 0:
                producer[op[2]] = (k, i)

    def dur(op) -> Any:
        return duration[(kind_name[op[5]], op[6])]

    arrival: dict[int, _Form] = {}
    last_on_link: dict[int, tuple[Any, int]] = {}
    for k, ops in enumerate(prog.ops):
        for i, op in enumerate(ops):
            _, _, produce, lnk, cut, _, _, _ = op
            if produce < 0:
                continue
            done = _Form(0.0, {start[k][i]: 1.0, dur(op): 1.0})
            if lnk < 0 or cut not in send:
                arrival[produce] = done
                continue
            message = pr.var(f"m_{produce}")
            pr.at_least(_Form(0.0, {message: 1.0}).add(done, -1.0))
            previous = last_on_link.get(lnk)
            if previous is not None:
                pr.at_least(_Form(0.0, {message: 1.0, previous[0]: -1.0, send[previous[1]]: -1.0}))
            last_on_link[lnk] = (message, cut)
            arrival[produce] = _Form(0.0, {message: 1.0, send[cut]: 1.0})
    makespan = pr.var("makespan")
    for k, ops in enumerate(prog.ops):
        for i, op in enumerate(ops):
            if i + 1 < len(ops):
                pr.at_least(_Form(0.0, {start[k][i + 1]: 1.0, start[k][i]: -1.0, dur(op): -1.0}))
            if op[1] >= 0:
                pr.at_least(_Form(0.0, {start[k][i]: 1.0}).add(arrival[op[1]], -1.0))
        pr.at_least(_Form(0.0, {makespan: 1.0, start[k][-1]: -1.0, dur(ops[-1]): -1.0}))

    # The optimizer tail: max_k (optimizer_k - first start of stage k), that start the forward
    # chain of micro-batch 0 (each stage's first action is the forward of its lowest chunk).
    first = _first_starts(prog, duration, send, kind_name)
    tail = pr.var("tail")
    for k in range(K):
        opt = _stage_optimizer(pr, cm, cuts, k).scaled(inv)
        pr.at_least(_Form(0.0, {tail: 1.0}).add(opt, -1.0).add(first[k]))
    if cm.limit is not None:
        _memory(pr, cm, cuts, recompute)
    cuts.canonical_only(pr)
    objective = _Form(0.0, {makespan: 1.0, tail: 1.0})
    pr.objective(objective)
    stats = {"binaries": sum(pr.binary), "variables": len(pr.names), "constraints": len(pr.rows)}
    return _Model(pr, cuts, recompute, unit, objective, stats)


def _first_starts(prog, duration, send, kind_name) -> list[_Form]:
    """When each stage's first action can start: the forward chain of micro-batch 0.

    Stage k's first action waits for one input (or none, on stage 0), produced by another
    stage's first action and sent as the first message on its link; so its start is a sum of
    durations, fixed by the cut, not a choice the programme could delay."""
    K = prog.stages
    where: dict[int, tuple[int, int]] = {}
    for k, ops in enumerate(prog.ops):
        for i, op in enumerate(ops):
            if op[2] >= 0:
                where[op[2]] = (k, i)
    first: list[_Form | None] = [None] * K

    def of(k: int) -> _Form:
        if first[k] is None:
            op = prog.ops[k][0]
            if op[1] < 0:
                first[k] = _Form(0.0)
            else:
                j, i = where[op[1]]
                if i != 0:
                    raise AssertionError(f"stage {k}'s first input comes from action {i} of stage {j}")
                p = prog.ops[j][0]
                form = _Form(0.0).add(of(j)).plus(duration[(kind_name[p[5]], p[6])])
                if p[3] >= 0 and p[4] in send:
                    form.plus(send[p[4]])
                first[k] = form
        return first[k]

    return [of(k) for k in range(K)]


def _stage_in(cuts: _Cuts, cm: CostModel, i: int, k: int) -> _Form:
    """[layer i lies on stage k]."""
    form = _Form(0.0)
    for c in cm.peaks[k].chunks:
        form.add(cuts.member(i, c))
    return form


def _stage_optimizer(pr: _Programme, cm: CostModel, cuts: _Cuts, k: int) -> _Form:
    """CostModel.stage_optimizer of stage k, in seconds: the optimizer on its layers, the gradient
    sync over the replicas (affine in its parameter bytes when it has any) and tied exchanges."""
    form = _Form(0.0)
    chunks = cm.peaks[k].chunks
    for c in chunks:
        form.add(cuts.span(c, cm.popt))
    if cm.sync_on:
        st = cm.setting
        per_byte = ring_allreduce_s(1.0, st.data_parallel, st.sync_bandwidth_bytes_per_s, 0.0)
        latency = ring_allreduce_s(1.0, st.data_parallel, math.inf, st.sync_latency_s)
        for c in chunks:
            form.add(cuts.span(c, cm.pp), per_byte)
        if latency > 0:
            holds = pr.var(f"p_{k}", high=1.0)      # 1 when the stage holds parameters
            for i in range(cm.L):
                if cm.pp[i + 1] > cm.pp[i]:
                    pr.at_least(_Form(0.0, {holds: 1.0}).add(_stage_in(cuts, cm, i, k), -1.0))
            form.plus(holds, latency)
    for t, (layers, _) in enumerate(cm.figures.tied):
        cost = cm.tied_exchange_s(t)
        if cost <= 0:
            continue
        split = pr.var(f"tie_{t}_{k}", high=1.0)    # holds some, not all, of the tie's layers
        inside = {i: _stage_in(cuts, cm, i, k) for i in layers}
        for i in layers:
            for j in layers:
                if i != j:
                    pr.at_least(_Form(0.0, {split: 1.0}).add(inside[i], -1.0).add(inside[j]))
        form.plus(split, cost)
    return form


def _memory(pr: _Programme, cm: CostModel, cuts: _Cuts, recompute: list[Any]) -> None:
    """Each stage's memory within the limit (costmodel: static bytes, the activation forms of
    stage_peaks, the largest transient), in units of the limit; per recompute choice."""
    limit = cm.limit
    inv = 1.0 / limit
    in_bytes = [*cm.in_bytes, 0.0]
    for k in range(cm.K):
        chunks = cm.peaks[k].chunks
        static = _Form(0.0)
        for c in chunks:
            static.add(cuts.span(c, cm.pp), cm.static_per_param).add(cuts.span(c, cm.pbuf))
        if cm.has_transient:
            peak = pr.var(f"tr_{k}", high=max(cm.figures.transient_bytes) * inv)
            for i in range(cm.L):
                t = cm.figures.transient_bytes[i]
                if t > 0:
                    pr.at_least(_Form(0.0, {peak: 1.0}).add(_stage_in(cuts, cm, i, k), -t * inv))
            static = static.scaled(inv).plus(peak)
        else:
            static = static.scaled(inv)
        r = recompute[k]
        for choice in ((r,) if isinstance(r, bool) else (False, True)):
            held, extra, kept = [], [], []
            for c in chunks:
                h, x, w = _held(pr, cm, cuts, c, choice, in_bytes, f"{k}_{int(choice)}")
                held.append(h.scaled(inv))
                extra.append(x.scaled(inv))
                kept.append(w.scaled(inv))
            for h_counts, w_counts, e in cm.peaks[k].forms:
                form = _Form(0.0).add(static)
                for n, f in zip(h_counts, held):
                    if n:
                        form.add(f, n)
                for n, f in zip(w_counts, kept):
                    if n:
                        form.add(f, n)
                if e >= 0:
                    form.add(extra[e])
                if isinstance(r, bool):
                    pr.at_most(form, 1.0)
                else:
                    big = max(0.0, form.upper(pr) - 1.0)
                    # the choice not taken is relaxed by big
                    form.plus(r, -big if not choice else big)
                    pr.at_most(form, 1.0 + (big if choice else 0.0))


def _held(pr: _Programme, cm: CostModel, cuts: _Cuts, c: int, recompute: bool, in_bytes, tag: str
          ) -> tuple[_Form, _Form, _Form]:
    """CostModel._held of chunk c, in bytes: (held from F to B/I, extra while B/I recomputes,
    kept from I to W); a maximum becomes a variable at least both sides (it is only bounded
    above, so that is exact)."""
    act = cuts.span(c, cm.pa)
    kept = cuts.span(c, cm.pkept) if cm.split else _Form(0.0)
    if c == 0 and cm.split:
        if not recompute:
            return act, _Form(0.0), cuts.span(c, cm.pa)
        most = pr.var(f"k0_{tag}", high=max(act.upper(pr), in_bytes[0]))
        pr.at_least(_Form(0.0, {most: 1.0}).add(act, -1.0))
        pr.at_least(_Form(-in_bytes[0], {most: 1.0}))
        return _Form(in_bytes[0]), _Form(0.0), _Form(0.0, {most: 1.0})
    if not recompute:
        return act, _Form(0.0), kept
    inp = cuts.at(c, in_bytes)
    over = pr.var(f"e_{c}_{tag}", high=max(0.0, act.upper(pr)))
    pr.at_least(_Form(0.0, {over: 1.0}).add(act, -1.0).add(inp))
    return inp, _Form(0.0, {over: 1.0}), kept
