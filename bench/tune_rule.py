"""How often ``gpipe-plan tune`` switches, simulated: its own rule on rounds of made-up times.

    python -m bench tune-rule                     # under a minute
    python -m bench tune-rule --trials 20000

``tune`` keeps solve's plan unless a candidate ran faster in every round than the plan in any,
or beat it round by round and again in the confirming rounds ([Note: a tie stays solve's] in
tune.py). Whether that is too strict or too loose depends on the host's noise, which no real run
repeats often enough to count: so this draws each run's step as the plan's own time times
(1 + a drift the whole round shares + the run's own noise), both normal, a candidate 0-10%
faster than the plan, and the others as fast as the plan, and hands them to the very functions
tune calls (``tune._leader``, ``tune._kept``). It counts how often the faster candidate is
chosen, and, where every candidate runs alike, how often any replaces the plan. Two hosts: runs
that share most of their noise within a round (the VM's slow minutes), and runs that share none.
No model, no run: under a minute.
"""

from __future__ import annotations

import argparse
import json
import random

from .common import RESULTS, git_revision, table, write_section

ROUNDS, CONFIRM_ROUNDS = 3, 2      # tune's defaults
HOSTS = (("drift 5%, own 2%", 0.05, 0.02), ("no drift, own 5%", 0.0, 0.05))
FASTER = (0.0, 0.02, 0.04, 0.06, 0.10)
OTHERS = (1, 3)


def chosen(faster: float, others: int, drift: float, own: float, confirm: int, rng: random.Random) -> int:
    """One simulated tune: the index kept (0: solve's plan; 1: the faster candidate)."""
    from gpipe_plan.tune import _kept, _leader, _Measured

    speeds = [1.0, 1.0 - faster] + [1.0] * (others - 1)
    drifts = [rng.gauss(0.0, drift) for _ in range(ROUNDS + confirm)]
    measured = [_Measured([]) for _ in speeds]
    for r in range(ROUNDS):
        for i, speed in enumerate(speeds):
            measured[i].steps_s.append(speed * (1 + drifts[r] + rng.gauss(0.0, own)))
    lead = _leader(measured, ROUNDS) if confirm else None
    if lead is not None:
        for r in range(ROUNDS, ROUNDS + confirm):
            for i in (0, lead):
                measured[i].steps_s.append(speeds[i] * (1 + drifts[r] + rng.gauss(0.0, own)))
    return _kept(measured, ROUNDS)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench tune-rule", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows, data = [], []
    for host, drift, own in HOSTS:
        for others in OTHERS:
            for faster in FASTER:
                rates = []
                for confirm in (0, CONFIRM_ROUNDS):
                    rng = random.Random(args.seed)
                    picks = [chosen(faster, others, drift, own, confirm, rng) for _ in range(args.trials)]
                    # alike: any switch; faster: the faster one chosen
                    rates.append(sum(p != 0 for p in picks) / args.trials if faster == 0 else
                                 sum(p == 1 for p in picks) / args.trials)
                rows.append([host, others, "alike" if faster == 0 else f"{faster:.0%} faster",
                             f"{rates[0]:.1%}", f"{rates[1]:.1%}"])
                data.append({"host": host, "drift": drift, "own": own, "others": others, "faster": faster,
                             "without_confirming": rates[0], "with_confirming": rates[1]})
    (RESULTS / "data").mkdir(parents=True, exist_ok=True)
    (RESULTS / "data" / "tune-rule.json").write_text(json.dumps({"trials": args.trials, "rows": data}))
    text = "\n".join([
        "## Tune's rule: how often it switches, simulated",
        "",
        f"Revision {git_revision()}; {args.trials:,} simulated tunes per row (seed {args.seed}), "
        f"{ROUNDS} rounds, and {CONFIRM_ROUNDS} confirming rounds where a candidate beat the plan in each "
        "(tune's defaults). A run's step: the plan's time x (1 + the round's drift + the run's own noise), "
        "both normal with the standard deviations named. 'Alike': every candidate as fast as the plan, "
        "and the row counts tunes that replaced it anyway; else one candidate is that much faster, and the "
        "row counts tunes that chose it. 'Overlap test only': the rule before the confirming rounds "
        "(`--confirm-rounds 0`).",
        "",
        table(["host", "other candidates", "candidate", "overlap test only", "with confirming rounds"], rows),
        "",
    ])
    print(f"wrote {write_section('tune-rule', text)}")
