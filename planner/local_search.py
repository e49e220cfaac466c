"""Iterated local search over the cuts: a better plan for an exact search to start from.

An exact search is as quick as its best plan is good: the branch and bound prunes with it, the
MILP starts from it and stops at it. Where the branch and bound stops with a gap, its best plan
is a local optimum of moving one cut at a time (its own first descent), and the MILP's primal
side improves on it slowly: on the exactness bench (resnet50, K = 8, M = 32, interleaved v = 2)
the plan a 30 s search kept took 67.04 ms a step, and this search found one of 64.92 ms from it
in 1.7 s of CPU time (docs/benchmarks/exactness.md). So a setting the
branch and bound leaves open gets this search first (planner/solvers.py), on its own share of
the setting's work (budgets.LOCAL_SEARCH_SHARE); the MILP gets the rest and a better start.
After the proofs it also gets what no MILP run can use ([Note: what no proof can use],
planner/solvers.py).

[Note: moving a layer across chunks]
A move shifts cuts b_i .. b_j together by one layer (1 <= i <= j <= C - 1): one layer passes from
chunk i - 1 to chunk j (or back) and every chunk between keeps its size. One move so rebalances
two chunks however far apart, where moving one cut (i = j) only trades between neighbours; the
step of a chunked schedule depends on every stage's chunks, often far apart in the pipeline.
A descent takes the first move that lowers the step, from there the next, until none does
(C (C - 1) moves a pass; a plan seen before is not evaluated again). Then a
kick: one to three random shifts of one or two layers from the best plan, and a descent from
there, kept when it is better (iterated local search). The generator is seeded and the budget
counted in evaluations, so the plan is the same on every run and machine.
"""

from __future__ import annotations

import random
from typing import Sequence

from .costmodel import CostModel
from .objective import RELATIVE_SLACK, Evaluation, evaluate
from .simulator import compiled_program

# What one evaluation (the cost model's chunks and stages, and a simulation of the whole step)
# is charged, in seconds of work: what it took on the 2-core development VM, 50 us, 5 us per chunk
# and 0.3 us per action played out (PipeDream profiles, K = 4 and 8, M = 8 to 32: 210-800 us an
# evaluation, 0.82-1.17 times the charge).
EVALUATION_S = 50e-6
EVALUATION_S_PER_CHUNK = 5e-6
EVALUATION_S_PER_ACTION = 0.3e-6
# Kicks in a row that find nothing better, after which the search stops whatever work is left
# (the rest goes to the MILP). From the plans of short searches of six open settings of the
# exactness bench, kicks unlimited, 9 of the 10 improvements after the first descent came within
# 15 kicks of the one before (one after 26); every kick that finds nothing is work the MILP lacks.
STALL_KICKS = 20


def _better(a: Evaluation, b: Evaluation) -> bool:
    """Whether plan ``a`` fits and beats ``b`` (any plan that fits beats one that does not)."""
    return a.fits and (not b.fits or a.step_s < b.step_s * (1 - RELATIVE_SLACK))


def evaluation_cost_s(cm: CostModel) -> float:
    """What one evaluation of ``cm``'s step is charged, in seconds of work."""
    actions = compiled_program(cm.schedule, cm.K, cm.M, cm.virtual_stages).actions
    return EVALUATION_S + EVALUATION_S_PER_CHUNK * cm.C + EVALUATION_S_PER_ACTION * actions


def moves(bounds: Sequence[int], step: int = 1) -> list[tuple[int, ...]]:
    """Every cut one move from ``bounds`` ([Note: moving a layer across chunks]): cuts i..j
    shifted by ``step`` either way, where every chunk keeps a layer."""
    C = len(bounds) - 1
    out = []
    for i in range(1, C):
        for j in range(i, C):
            for d in (-step, step):
                # only the chunks at the ends change size: i - 1 and j
                if bounds[i - 1] < bounds[i] + d and bounds[j] + d < bounds[j + 1]:
                    out.append((*bounds[:i], *(b + d for b in bounds[i:j + 1]), *bounds[j + 1:]))
    return out


class LocalSearch:
    """Iterated local search from a plan of ``cm`` within ``work_s`` seconds of work."""

    def __init__(self, cm: CostModel, work_s: float, seed: int = 0):
        self.cm = cm
        self.cost_s = evaluation_cost_s(cm)
        self.budget = max(0, int(work_s / self.cost_s))      # evaluations
        self.evaluations = 0
        self.rng = random.Random(seed)
        self.seen: dict[tuple[int, ...], Evaluation] = {}

    @property
    def work_s(self) -> float:
        """The work used so far, in seconds of work."""
        return self.evaluations * self.cost_s

    def _spent(self) -> bool:
        return self.evaluations >= self.budget

    def _evaluate(self, bounds: tuple[int, ...]) -> Evaluation:
        ev = self.seen.get(bounds)
        if ev is None:
            ev = evaluate(self.cm, bounds)
            self.evaluations += 1
            self.seen[bounds] = ev
        return ev

    def descend(self, start: Evaluation) -> Evaluation:
        """Take moves that lower the step until none does or the budget ends."""
        current = start
        improved = True
        while improved and not self._spent():
            improved = False
            for bounds in moves(current.bounds):
                if self._spent():
                    break
                ev = self._evaluate(bounds)
                if _better(ev, current):
                    current, improved = ev, True
                    break           # the scan starts again from the better plan
        return current

    def kick(self, bounds: Sequence[int]) -> tuple[int, ...]:
        """One to three random moves of one or two layers from ``bounds``."""
        out = tuple(bounds)
        for _ in range(self.rng.randint(1, 3)):
            options = moves(out, self.rng.choice((1, 2)))
            if options:
                out = options[self.rng.randrange(len(options))]
        return out

    def run(self, start: Evaluation) -> Evaluation:
        """The best plan found from ``start`` (``start`` itself when none is better)."""
        best = self.descend(start)
        stall = 0
        while not self._spent() and stall < STALL_KICKS:
            found = self.descend(self._evaluate(self.kick(best.bounds)))
            if _better(found, best):
                best, stall = found, 0
            else:
                stall += 1
        return best
