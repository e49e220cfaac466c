"""The search around the solvers: every setting a request leaves open, best first, in one budget.

The best plan overall is the best of the best plans of each setting (planner/settings.py
enumerates them), so :func:`search` solves each exactly (planner/solvers.py says how) and
keeps all of them: the winner goes into the plan, the others are the runners-up a user
compares it with. GPipe's settings go first (its solver is fast and exact) and seed the
others; the best step found so far is the cutoff a later setting must beat to matter; the
settings share one budget (planner/budgets.py, :class:`budgets.SettingBudgets`), and what they
leave goes where the proof is still open (solvers.tighten).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from ..artifacts import BadInput
from ..schedules import PLANNABLE_SCHEDULES
from .budgets import LEAST_ILP_SETTING_S, LEAST_SETTING_S, SettingBudgets
from .costmodel import CostModel, Setting
from .gpipe_solver import GPipeSolver
from .least_memory import explain_infeasible
from .objective import Solution, proven_optimal
from .problem import PipelineProblem, SolveOptions, check_problem, one_pipeline
from .profile import LayerFigures, Profile
from .seeds import seed_cuts
from .settings import no_settings_reason, schedule_name, settings_for
from .solvers import search_setting, tighten


@dataclass
class Candidate:
    setting: Setting
    micro_batch_size: int
    solution: Solution | None              # None: nothing fits in memory with this setting
    work_s: float = 0.0                    # the deterministic work its search used (planner/solvers.py)

    @property
    def step_s(self) -> float:
        return self.solution.evaluation.step_s if self.solution else math.inf

    @property
    def lower_bound_s(self) -> float:
        """No plan with this setting is faster (inf when none fits)."""
        return self.solution.lower_bound_s if self.solution else math.inf

    def sort_key(self) -> tuple:
        ev = self.solution.evaluation if self.solution else None
        return (self.step_s, ev.peak_memory_bytes if ev else math.inf,
                self.setting.micro_batches, PLANNABLE_SCHEDULES.index(self.setting.schedule),
                self.setting.virtual_stages)


@dataclass
class SearchResult:
    problem: PipelineProblem               # what was searched (its batch: this pipeline's)
    candidates: list[Candidate] = field(default_factory=list)   # best first

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def batch(self) -> int:
        """This pipeline's samples per step: the global batch, or one replica's share of it."""
        return self.problem.batch

    @property
    def lower_bound_s(self) -> float:
        """No plan in the whole searched space (every setting) is faster than this."""
        return min(c.lower_bound_s for c in self.candidates)

    @property
    def proven(self) -> bool:
        """The best plan is optimal over every setting searched, not just its own."""
        return proven_optimal(self.best.step_s, self.lower_bound_s)

    @property
    def bound_by(self) -> str | None:
        """The method behind :attr:`lower_bound_s`: that of the setting with the least bound
        (the first, best first, among equals; None when no setting has a plan)."""
        solved = [c for c in self.candidates if c.solution is not None]
        return min(solved, key=lambda c: c.lower_bound_s).solution.bound_by if solved else None

    @property
    def work_s(self) -> float:
        """The deterministic work its settings used (planner/solvers.py)."""
        return sum(c.work_s for c in self.candidates)


def solve_setting(profile: Profile, setting: Setting, micro_batch_size: int, solver: str,
                  time_budget_s: float, seeds: list[tuple[int, ...]] = (), cutoff_s: float = math.inf,
                  figures: LayerFigures | None = None, work_budget_s: float | None = None) -> Candidate:
    """The best plan of one setting (planner/solvers.py). ``figures``: ``profile.at(micro_batch_size)``
    if already made. ``work_budget_s``: the budget in deterministic work, which, unlike the
    clock, gives the same plan on every run."""
    cm = CostModel(figures if figures is not None else profile.at(micro_batch_size), setting)
    solution, work_s = search_setting(cm, solver, time_budget_s, seeds, cutoff_s, work_budget_s)
    return Candidate(setting, micro_batch_size, solution, work_s)


def search(profile: Profile, options: SolveOptions, progress=None, explain: bool = True) -> SearchResult:
    """The request's own pipeline (:func:`.problem.one_pipeline`) searched: every setting its
    options leave open, best first (:func:`search_pipeline`)."""
    return search_pipeline(profile, one_pipeline(profile, options), progress, explain)


def search_pipeline(profile: Profile, problem: PipelineProblem, progress=None, explain: bool = True,
                    work_budget_s: float | None = None, cutoff_s: float = math.inf) -> SearchResult:
    """Solve every setting ``problem`` leaves open; the result's candidates are sorted best first.

    GPipe settings are solved first (their solver is fast and exact); each one's optimal
    partition seeds the 1F1B and ZB-H1 searches of the same M (and the best cut into 2K
    chunks found seeds the next setting of as many chunks), and the best step found so far is
    the cutoff below which a later search must go to matter: settings that cannot beat it are
    settled by their lower bound alone. ``progress``, if given, is called with
    (done, total, description) as settings finish.

    ``work_budget_s``: the work its settings share (default ``problem.time_budget_s``;
    planner/replicas.py gives each placement a share of its own, deterministic where the clock
    left by the placements before would not be). ``cutoff_s``: a step already achieved
    elsewhere (another placement): a setting that cannot beat it stops once that is proven.
    ``explain``: why nothing fits, worded for the user (else a bare line).
    """
    check_problem(profile, problem)
    settings = settings_for(profile, problem)
    if not settings:
        raise BadInput(no_settings_reason(profile, problem))
    result = SearchResult(problem)
    budgets = SettingBudgets(problem.time_budget_s, len(settings), time.perf_counter(),
                             LEAST_ILP_SETTING_S if problem.solver == "ilp" else LEAST_SETTING_S, work_budget_s)
    done = 0
    # Each micro-batch size's figures, made once for all its settings (O(L) each: with many
    # layers, making them per setting took longer than the searches).
    figures: dict[int, LayerFigures] = {}

    def at(size: int) -> LayerFigures:
        if size not in figures:
            figures[size] = profile.at(size)
        return figures[size]

    def run(setting: Setting, size: int, seeds: list, cutoff: float) -> Candidate:
        nonlocal done
        left = len(settings) - done
        candidate = solve_setting(profile, setting, size, problem.solver, budgets.time_s(left),
                                  seeds, cutoff, at(size), work_budget_s=budgets.work_s(left))
        budgets.spend(candidate)
        done += 1
        if progress:
            progress(done, len(settings), f"M={setting.micro_batches} {schedule_name(setting)}")
        return candidate

    gpipe = [(s, size) for s, size in settings if s.schedule == "gpipe"]
    others = [(s, size) for s, size in settings if s.schedule != "gpipe"]
    best_so_far = cutoff_s
    gpipe_best: dict[int, Candidate] = {}
    if problem.solver != "ilp":
        # A first, cheap pass (the staircase: a good plan and a lower bound per setting) orders
        # the exact searches best first, so that each can stop at what is already achieved.
        solvers = {}
        for s, size in gpipe:
            cm = CostModel(at(size), s)
            solvers[s] = GPipeSolver(cm, seeds=seed_cuts(cm))
        quick: dict[Setting, Candidate] = {}
        for i, (s, size) in enumerate(gpipe):
            solvers[s].time_budget_s = budgets.time_s(len(settings) - i)
            quick[s] = Candidate(s, size, solvers[s].solve(cutoff_s=0.0))
        best_so_far = min([cutoff_s, *(c.step_s for c in quick.values())])
        for setting, size in sorted(gpipe, key=lambda item: quick[item[0]].step_s):
            candidate = quick[setting]
            if candidate.solution is not None and not proven_optimal(best_so_far, candidate.lower_bound_s):
                solvers[setting].time_budget_s = budgets.time_s(len(settings) - done)
                candidate = Candidate(setting, size, solvers[setting].solve(cutoff_s=best_so_far))
            done += 1
            if progress:
                progress(done, len(settings), f"M={setting.micro_batches} gpipe")
            gpipe_best[setting.micro_batches] = candidate
            best_so_far = min(best_so_far, candidate.step_s)
            result.candidates.append(candidate)
    else:
        for setting, size in gpipe:
            candidate = run(setting, size, [], best_so_far)
            gpipe_best[setting.micro_batches] = candidate
            best_so_far = min(best_so_far, candidate.step_s)
            result.candidates.append(candidate)
    # 1F1B, then the others: seeded with the best partition of the same M and chunk count found
    # so far (GPipe's for 1F1B and ZB-H1), most promising first.
    found: dict[tuple[int, int], Candidate] = {(m, 1): c for m, c in gpipe_best.items()}
    order = {"1f1b": 0, "zb-h1": 1, "interleaved": 2, "zb-v": 2, "pipedream": 3, "pipedream-2bw": 3}
    for setting, size in sorted(others, key=lambda item: (order[item[0].schedule],
                                                         gpipe_best[item[0].micro_batches].step_s
                                                         if item[0].micro_batches in gpipe_best else 0.0)):
        chunks = setting.virtual_stages * (2 if setting.schedule == "zb-v" else 1)
        seed = found.get((setting.micro_batches, chunks))
        seeds = [seed.solution.evaluation.bounds] if seed and seed.solution else []
        candidate = run(setting, size, seeds, best_so_far)
        best_so_far = min(best_so_far, candidate.step_s)
        result.candidates.append(candidate)
        if candidate.solution and (seed is None or candidate.step_s < seed.step_s):
            found[(setting.micro_batches, chunks)] = candidate
    if problem.solver != "ilp":
        # What the settings left of the budget goes where the proof is still open.
        total = problem.time_budget_s if work_budget_s is None else work_budget_s
        tighten(result.candidates, lambda c: CostModel(at(c.micro_batch_size), c.setting), cutoff_s,
                total - budgets.spent_s, problem.time_budget_s - (time.perf_counter() - budgets.started))
    result.candidates.sort(key=Candidate.sort_key)
    if result.best.solution is None:
        # The explanation solves the memory problem again for each option that might help: worth
        # it for the user's request, not for the one-device comparison, which only needs to know.
        raise BadInput(explain_infeasible(profile, problem) if explain else "no plan fits in memory")
    return result


def first_pass_step(profile: Profile, problem: PipelineProblem) -> float:
    """The best step GPipe's first, cheap pass (its staircase) finds over the micro-batch counts
    ``problem`` leaves open: how replicas.py ranks the placements it searches, best first (inf:
    nothing fits, or the problem cannot run)."""
    try:
        check_problem(profile, problem)
    except BadInput:
        return math.inf
    best = math.inf
    for setting, size in settings_for(profile, replace(problem, schedule="gpipe", virtual_stages="auto")):
        solution = GPipeSolver(CostModel(profile.at(size), setting), time_budget_s=LEAST_SETTING_S).solve(cutoff_s=0.0)
        if solution is not None:
            best = min(best, solution.evaluation.step_s)
    return best
