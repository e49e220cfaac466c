"""``gpipe-plan tune``: run the plans the cost model cannot tell apart, keep one that runs faster.

``solve`` chooses by prediction; where other plans are predicted within the model's own error
of its choice, the choice is chance ([Note: when the host, not the model, must choose] in
planner/alternatives.py). ``tune`` asks the host instead:

1. the candidates: the plan and those predicted within ``--within`` of it (the planner makes
   each as a whole plan document, from the plan's profile);
2. each runs ``--steps`` steps, ``--rounds`` times, the order reversed every other round so
   that a host growing busier or quieter does not favour the first or the last; a run's
   measured step is its report's (the median over its steps after the first), a candidate's
   the median over its rounds;
3. the plan is kept unless a candidate ran faster in every round than it did in any, or beat it
   round by round in those rounds and in ``--confirm-rounds`` more of the two alone ([Note: a
   tie stays solve's]); then that candidate is written to ``--out``, the plan ``run`` then
   takes, with the ``tuning`` section (plan format 11) saying what was run and measured.

It only orchestrates: the planner makes the candidates, ``run`` runs them (one after another,
each as ``gpipe-plan run`` would), and files pass between them, as everywhere. A candidate whose
run fails is reported and left out; the plan's own failing is the tune's failure.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .artifacts import BadInput, RunFailure, check_output_paths, file_sha256
from .options import option
from .schema import FORMAT_VERSIONS, PLAN_FORMAT, REPORT_FORMAT, read_artifact, write_artifact


# The default --within: plans predicted at most 5% slower than the chosen one are tried (solve
# points at tune where a runner-up is that close: planner/command.py).
TUNE_WITHIN = 0.05


@dataclass(frozen=True)
class TuneOptions:
    """``gpipe-plan tune``'s options, each declared once (gpipe_plan/options.py)."""

    plan: str
    out: str | None = option("--out", "-o", path="file", metavar="tuned.plan.json",
                             help="Write the plan kept here: PLAN, or a candidate that ran faster in every round (required; may be PLAN).")
    within: float = option("--within", default=TUNE_WITHIN, type=float, show_default=True,
                           help="Run the plans predicted at most this fraction slower than PLAN (0.05: 5%).")
    candidates: int = option("--candidates", default=4, type=int, show_default=True,
                             help="Plans to run at most, PLAN included.")
    steps: int = option("--steps", default=10, type=int, show_default=True,
                        help="Training steps per run; a run's step is the median of those after the first.")
    rounds: int = option("--rounds", default=3, type=int, show_default=True,
                         help="Rounds: each runs every candidate once, in reverse order every other round (at 1, "
                              "a candidate that won it must also win the confirming rounds).")
    confirm_rounds: int = option("--confirm-rounds", default=2, type=int, show_default=True,
                                 help="Where no candidate ran faster in every round than PLAN in any, but one beat it "
                                      "in each round, run the two this many rounds more; it replaces PLAN if it "
                                      "beats it in each of those too (0: never).")
    quiet: bool = option("--quiet", "-q", default=False, is_flag=True, help="Print only the result.")

    def check(self) -> None:
        """One line for each option no tune can honour, before any work."""
        if self.out is None:
            raise BadInput("tune needs --out FILE: where to write the plan it keeps")
        if not 0.0 <= self.within <= 1.0:
            raise BadInput(f"--within {self.within}: give a fraction of the plan's step from 0 to 1 (0.05 is 5%)")
        if self.candidates < 1:
            raise BadInput(f"--candidates {self.candidates}: give 1 or more (PLAN counts as one)")
        if self.steps < 2:
            raise BadInput(f"--steps {self.steps}: give 2 or more (a run's first step, which warms up, is not measured)")
        if self.rounds < 1:
            raise BadInput(f"--rounds {self.rounds}: give 1 or more")
        if self.confirm_rounds < 0:
            raise BadInput(f"--confirm-rounds {self.confirm_rounds}: give 0 (never) or more")
        if self.rounds == 1 and self.confirm_rounds == 0:
            raise BadInput("--rounds 1 with --confirm-rounds 0: one run of each cannot tell two plans apart (plans that "
                           "run alike would win 1 time in 2), so nothing could replace PLAN: give --rounds 2 or more, "
                           "or --confirm-rounds 1 or more")
        from .plan_view import profile_file_of

        # The plan's profile is an input: tune reads it, and so does a later tune or calibrate of
        # the plan it writes. (PLAN itself may be --out: the plan kept replaces it.)
        profile = profile_file_of(self.plan)
        check_output_paths({"--out": self.out}, inputs=(profile,) if profile else ())


@dataclass
class _Measured:
    """One candidate's runs."""

    steps_s: list[float | None]
    failed: str | None = None

    @property
    def median_s(self) -> float | None:
        from .plan_view import median_of_rounds     # not at start-up: the command line imports this module

        return median_of_rounds(self.steps_s, self.failed)


def tune_command(plan: str, **options: Any) -> None:
    """Tune PLAN (:class:`TuneOptions`). Raises BadInput (exit 2) or RunFailure (exit 1)."""
    opts = TuneOptions(plan=plan, **options)
    opts.check()
    from .planner.alternatives import alternatives

    doc = read_artifact(plan, PLAN_FORMAT)
    tried = alternatives(doc, plan, opts.within, opts.candidates)
    say = (lambda line: None) if opts.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    if len(tried) == 1:
        say(f"no other plan is predicted within {opts.within:.0%} of this one's "
            f"{tried[0].predicted_step_s * 1e3:.3f} ms: nothing to run; the plan is written as it is")
        measured = [_Measured([])]
    else:
        say(f"{len(tried)} plans predicted within {opts.within:.0%} of {tried[0].predicted_step_s * 1e3:.3f} ms: "
            f"{opts.rounds} round(s) of {opts.steps} steps each")
        measured = _measure(tried, opts, say)
    best = _kept(measured, opts.rounds)
    out = {**tried[best].doc, "version": FORMAT_VERSIONS[PLAN_FORMAT]}
    out["tuning"] = {
        "tuned_from": {"path": plan, "sha256": file_sha256(plan)},
        "within": opts.within, "steps": opts.steps, "rounds": opts.rounds,
        "candidates": [{"source": a.source, "schedule": a.setting.schedule, "virtual_stages": a.doc["virtual_stages"],
                        "micro_batches": a.setting.micro_batches, "micro_batch_size": a.micro_batch_size,
                        "balance": list(a.evaluation.balance), "predicted_step_s": a.predicted_step_s,
                        "measured_step_s": m.steps_s, "failed": m.failed, "chosen": i == best}
                       for i, (a, m) in enumerate(zip(tried, measured))],
    }
    write_artifact(opts.out, out, "solved plan", None, "--out")
    print(_summary(tried, measured, best, opts.out))


def _measure(tried: list, opts: TuneOptions, say) -> list[_Measured]:
    """Each candidate run ``opts.rounds`` times, ``opts.steps`` steps each, order reversed every
    other round; then, where no candidate is clear of the plan but one beat it in every round
    (:func:`_leader`), the plan and that one ``opts.confirm_rounds`` rounds more."""
    from .artifacts import write_json_atomic

    measured = [_Measured([]) for _ in tried]
    with tempfile.TemporaryDirectory(prefix="gpipe-plan-tune-") as tmp:
        paths = []
        for i, a in enumerate(tried):
            path = Path(tmp) / f"candidate{i}.plan.json"
            write_json_atomic(path, a.doc)
            paths.append(path)
        everyone = list(range(len(tried)))
        for r in range(opts.rounds):
            _round(r, everyone, tried, paths, measured, opts, say, Path(tmp))
        lead = _leader(measured, opts.rounds) if opts.confirm_rounds else None
        if lead is not None:
            say(f"  {_name(tried[lead])} beat solve's plan in each round, but their rounds overlap: "
                f"{opts.confirm_rounds} round(s) more of the two alone")
            for r in range(opts.rounds, opts.rounds + opts.confirm_rounds):
                _round(r, [0, lead], tried, paths, measured, opts, say, Path(tmp))
    return measured


def _round(r: int, among: list[int], tried: list, paths: list[Path], measured: list[_Measured], opts: TuneOptions,
           say, tmp: Path) -> None:
    """Round ``r``: each candidate of ``among`` that has not failed runs once, in reverse order
    every other round."""
    from .runtime.command import run_command

    for i in (among if r % 2 == 0 else among[::-1]):
        if measured[i].failed is not None:
            continue
        report = tmp / f"candidate{i}.round{r}.report.json"
        try:
            with _output_to(tmp / f"candidate{i}.round{r}.log"):
                run_command(plan=str(paths[i]), steps=opts.steps, report=str(report), quiet=True)
            step = read_artifact(report, REPORT_FORMAT).get("measured_step_s")
        except (RunFailure, BadInput) as exc:
            if i == 0:
                raise
            measured[i].failed = str(exc)
            say(f"  round {r + 1}: {_name(tried[i])}: failed ({exc}); left out")
            continue
        measured[i].steps_s.append(step)
        say(f"  round {r + 1}: {_name(tried[i])}: predicted {tried[i].predicted_step_s * 1e3:.1f} ms, "
            f"measured {_ms(step)}")


@contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """This process's and its children's stdout and stderr into ``path`` (a run's warnings and
    notes, the same for every candidate, would bury the tune's own lines; a failure is raised
    with its one line all the same)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def _kept(measured: list[_Measured], rounds: int) -> int:
    """The candidate to keep: the plan itself (index 0), unless some candidate ran faster in
    every one of the first ``rounds`` rounds than the plan in any (then the least median of
    those), or, failing that, one ran the confirming rounds after them and beat the plan in each
    round it ran.

    [Note: a tie stays solve's]
    Plans the model cannot tell apart often run alike too, and then the fastest median is the
    host's noise: on the 2-core VM, 2 ranks, three plans within 4% ran 43-49 ms each, their
    medians 1% apart, in an order the next tune would not repeat. So a candidate replaces the
    plan only on evidence that chance rarely gives two plans that run alike:
    - their rounds do not overlap: by chance 1 time in C(2r, r) (20 at r = 3 rounds; at r = 1,
      a coin's toss, the test is not made: a winner of the one round must win the confirming
      rounds). A plan that runs 10% faster, as the ties of ranks sharing cores can, clears it;
    - or it wins round by round: the plans of one round run within a minute or two, so a host
      that slows for a while slows the whole round, and a plan a few percent faster can lose the
      overlap test to that drift yet beat the plan in every round. Three such wins come by
      chance 1 time in 8, too often to switch on; so the leader of those (:func:`_leader`) and
      the plan run the confirming rounds, and it must win those too: 1 time in 32 by chance at
      3 + 2 rounds (docs/runtime.md, "Tuning", has what the two tests catch)."""
    own = measured[0]
    if own.median_s is None:
        return 0
    own_fastest = min((s for s in own.steps_s[:rounds] if s is not None), default=None)
    # One round proves nothing (C(2, 1) = 2: a coin's toss), so there the overlap test is left
    # out and a winner must win the confirming rounds too.
    clear = [(m.median_s, i) for i, m in enumerate(measured[1:], 1)
             if rounds > 1 and m.median_s is not None and own_fastest is not None
             and max((s for s in m.steps_s[:rounds] if s is not None), default=math.inf) < own_fastest]
    if clear:
        return min(clear)[1]
    confirmed = [i for i, m in enumerate(measured[1:], 1)
                 if m.median_s is not None and len(m.steps_s) > rounds and _won_every_round(m, own)]
    return confirmed[0] if confirmed else 0


def _leader(measured: list[_Measured], rounds: int) -> int | None:
    """The candidate the confirming rounds are for: none where one is already clear of the plan
    (:func:`_kept`), else the least median of those that beat the plan in each round."""
    if _kept(measured, rounds) != 0 or measured[0].median_s is None:
        return None
    won = [(m.median_s, i) for i, m in enumerate(measured[1:], 1)
           if m.median_s is not None and _won_every_round(m, measured[0])]
    return min(won)[1] if won else None


def _won_every_round(m: _Measured, own: _Measured) -> bool:
    """Whether ``m`` ran faster than the plan in each round both ran."""
    return len(m.steps_s) == len(own.steps_s) and all(
        mine is not None and theirs is not None and mine < theirs for mine, theirs in zip(m.steps_s, own.steps_s))


def _name(a) -> str:
    from .schedules import label

    return (f"{a.source}: {label(a.setting.schedule, a.doc['virtual_stages'])}, M={a.setting.micro_batches}, "
            f"balance {list(a.evaluation.balance)}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _summary(tried: list, measured: list[_Measured], best: int, out: str) -> str:
    chosen, own = measured[best].median_s, measured[0].median_s
    if own is None:
        return f"{out}: the plan as solve chose it (nothing else to run)"
    ran = sum(m.median_s is not None for m in measured)
    if best == 0:
        others = ("no other plan could be measured" if ran == 1 else
                  "the other plan measured did not run faster in every round" if ran == 2 else
                  f"none of the other {ran - 1} measured ran faster in every round")
        return (f"{out}: solve's plan kept, measured {_ms(own)} a step (predicted "
                f"{tried[0].predicted_step_s * 1e3:.1f} ms): {others}")
    return (f"{out}: {_name(tried[best])}, measured {_ms(chosen)} a step (predicted "
            f"{tried[best].predicted_step_s * 1e3:.1f} ms), faster in every round than solve's plan, "
            f"{_ms(own)} ({chosen / own - 1:+.1%})")
