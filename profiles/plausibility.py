"""Whether what a run measured is the model's cost, before calibration folds it into the profile.

Calibration scales each layer by its chunk's measured / predicted ratio (profiles/calibrate.py),
for every plan made from the profile after it. A ratio that is not the model's does lasting
harm, so each round is checked first, and a refusal says what the run measured that explains
it, and what to do:

- **a busy host** (the report's ``host_load``, version 5: gpipe_plan/hostload.py): other
  processes took cores the run needed, so its stages ran slow by their load, not by their
  layers. A round that would slow the profile down by more than :data:`SLOW_MARGIN` is then
  refused: what it would fold in is that load; rerun on a quiet machine, or ``--force``;
- **ranks that shared the host's cores** (the plan's ``concurrent_ranks``, report version 6):
  each span holds its rank's waits for a core, which no ratio tells from its layers' time;
  refused, ``--force`` takes it (with what the plan charged for sharing taken off both sides);
- **a ratio outside** :data:`PLAUSIBLE` (0.2-5x, where a correct run of a plan from this
  profile does not fall): refused with what explains it, when something does (the machine's
  speed against the profile's, by the speed probe; a busy host) and otherwise as what it most
  likely is (a plan from another profile, or a run that went wrong); ``--force`` takes it.

What no run can make consistent stays refused, ``--force`` or not, and is checked where the
report is read (profiles/calibrate.py): a report of another model or precision, layers the
profile does not have, chunks that are not the plan's, a ``--profile`` that is not the plan's,
a report the profile's rounds already hold.

Pure JSON in, words out: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..artifacts import BadInput
from ..hostload import busy_hosts, load_text

# A stage measured this far from its prediction is not what a correct run of its plan gives.
PLAUSIBLE = (0.2, 5.0)
# On a busy host, a round that would slow any layer down by more than this is the host's load.
SLOW_MARGIN = 0.05


@dataclass(frozen=True)
class Ratio:
    """One measured / predicted ratio a round would fold in."""

    what: str        # "stage 0", "chunk 2 (stage 1)"
    kind: str        # forward, backward, optimizer
    value: float


def check_round(report: dict[str, Any], report_path: str, ratios: list[Ratio], force: bool,
                concurrent_ranks: float | None = None) -> list[str]:
    """Refuse a round whose ratios are not the model's (one line: what explains them, what to do),
    unless ``force``; return what ``force`` let through, one sentence each (empty: nothing).
    ``concurrent_ranks``: the ranks the run's host ran at once where its plan had them share the
    host's cores (None: a core each)."""
    forced = []
    for problem in (_shared_cores(report, concurrent_ranks), _busy_host(report, ratios), _implausible(report, ratios)):
        if problem is None:
            continue
        what, advice = problem
        if not force:
            raise BadInput(f"'{report_path}': {what}: {advice}, or pass --force to fold it in anyway")
        forced.append(what)
    return forced


def _shared_cores(report: dict[str, Any], concurrent_ranks: float | None) -> tuple[str, str] | None:
    """(what is wrong, what to do) with folding in a run whose ranks shared the host's cores; None:
    a core each. Each of its spans holds the time its rank waited for a core, by how many others
    ran at that moment, which no per-chunk ratio can tell from its layers' time (and its optimizer
    steps, all at once, run as many times slower as ranks share a core)."""
    if concurrent_ranks is None:
        return None
    stages = report.get("num_stages") or len(report["stages"])
    ranks = stages * (report.get("data_parallel") or 1)
    return (f"its {ranks} ranks shared the host's cores ({concurrent_ranks:g} of each pipeline's {stages} ran at "
            "once), so each measured time holds the waits for a core beside the layers' own",
            "calibrate with a run of one core per rank (fewer stages, or a host with more cores)")


def _busy_host(report: dict[str, Any], ratios: list[Ratio]) -> tuple[str, str] | None:
    """(what is wrong, what to do) with folding in a slow run from a busy host; None: the host
    was quiet (or not measured), or the run was not slow."""
    busy = busy_hosts(report.get("host_load"))
    slowest = max(ratios, key=lambda r: r.value, default=None)
    if not busy or slowest is None or slowest.value <= 1.0 + SLOW_MARGIN:
        return None
    several = len(report["host_load"].get("hosts") or []) > 1
    return ("; ".join(load_text(h, named=several) for h in busy)
            + f", so what calibrate would fold in (up to {slowest.value:.2f}x the prediction, {slowest.what}'s "
            f"{slowest.kind}) is that load, not the model's cost", "rerun on a quiet machine")


def _implausible(report: dict[str, Any], ratios: list[Ratio]) -> tuple[str, str] | None:
    """(what explains the ratio furthest outside :data:`PLAUSIBLE`, what to do); None: all within it."""
    outside = [r for r in ratios if not PLAUSIBLE[0] <= r.value <= PLAUSIBLE[1]]
    if not outside:
        return None
    worst = max(outside, key=lambda r: max(r.value, 1 / r.value) if r.value > 0 else float("inf"))
    said = (f"{worst.what} measured its {worst.kind} {worst.value:.2f}x the prediction, beyond the "
            f"{PLAUSIBLE[0]:g}-{PLAUSIBLE[1]:g}x a correct run of a plan from this profile gives")
    if busy_hosts(report.get("host_load")):     # said in full by _busy_host, which comes first
        return f"{said}, which the busy host's load explains", "rerun on a quiet machine"
    speed = (report.get("speed") or {}).get("ratio")
    if speed and PLAUSIBLE[0] <= worst.value / speed <= PLAUSIBLE[1]:
        return (f"{said}, as the machine ran at {speed:.2f}x the profile's time (speed probe)",
                "profile again on this machine, or calibrate with --speed-correction")
    load = report.get("host_load")
    host = (f"other processes used {load['other_cores']:.2f} cores" if load else
            "the report, from before report version 5, does not record the host's load")
    probe = f"the speed probe read {speed:.2f}x the profile's time" if speed else "no speed probe"
    return (f"{said}, and neither the host ({host}) nor the machine's speed ({probe}) explains it: the plan may "
            "come from another profile, or the run went wrong",
            "calibrate with the profile the run's plan was made from")
