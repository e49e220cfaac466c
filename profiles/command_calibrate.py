"""``gpipe-plan calibrate``: read a report and a profile, write the calibrated profile, print."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ..artifacts import BadInput, check_output_paths, file_sha256, locate
from ..layer_names import LayerNames
from ..tables import NarrowTable, narrow_table
from ..plan_view import read_plan
from ..schema import read_profile, read_report, write_artifact
from ..speedprobe import distrusted_probe
from .calibrate import calibrate, named_file, recorded_file


def calibrate_command(report: str, profile: str | None, out: str | None, speed_correction: bool = False,
                      force: bool = False) -> None:
    console = Console()
    from_report = profile is None
    if from_report:
        profile, plan_path = profile_of_report(report)
    else:
        plan_path = check_profile_of_plan(report, profile)
    target = out or str(Path(profile).with_suffix("")) + ".calibrated.json"
    # The profile and plan the report led to are inputs too: --out over either would lose it.
    check_output_paths({"--out": target}, inputs=(report, profile, *([plan_path] if plan_path else [])))
    if from_report:
        console.print(f"calibrating '{profile}', the profile the run's plan was made from", highlight=False)
    doc = calibrate(profile, report, use_speed_probe=speed_correction, force=force)
    write_artifact(target, doc, "profile", flag="--out")
    last = doc["calibration"][-1]
    for problem in last.get("forced") or []:
        console.print(f"[yellow]--force:[/] folded in although {problem}", highlight=False)
    console.print(round_table(last))
    spread = last.get("run_spread")
    if spread:
        console.print(f"the run's steps spread by {spread:.1%}: each ratio is moved toward 1 by that much noise",
                      highlight=False)
    console.print(overhead_line(last["overhead"]), highlight=False)
    drift = last["speed_ratio_divided_out"]
    if drift != 1.0:
        console.print(f"the machine ran at {drift:.2f}x the profile's time during that run (speed probe): divided out",
                      highlight=False)
    doubt = distrusted_probe(read_report(report).get("headline") or {})
    if doubt:
        console.print(f"[yellow]note:[/] the run's speed probe cannot be trusted ({doubt}): the machine's speed may "
                      "have moved these ratios as much as the model's costs did; a run on a quiet machine "
                      "calibrates better", highlight=False)
    console.print(f"wrote {target}: solve with it to plan with the measured costs", highlight=False)


def round_table(calibration_round: dict) -> NarrowTable:
    """One calibration round: per chunk its forward and backward scales, and its stage's optimizer scale."""
    table = narrow_table("calibration: x the prediction per chunk (optimizer: per stage) as applied, the "
                         "measured ratio in brackets where the run's spread moved it",
                         ("chunk", "stage", "layers", "forward", "backward", "optimizer"), left=("layers",))
    stages = {st["stage"]: st for st in calibration_round["stages"]}
    naming = LayerNames(name for ch in calibration_round["chunks"] for name in ch["layers"])
    for ch in calibration_round["chunks"]:
        table.add_row(str(ch["chunk"]), str(ch["stage"]), naming.span(ch["layers"]), _scale(ch, "forward"),
                      _scale(ch, "backward"), _scale(stages.get(ch["stage"], {}), "optimizer"))
    table.note = naming.note()
    return table


def overhead_line(overhead: dict) -> str:
    """What the round measured of the runtime's cost per action, or why it could not."""
    before = overhead.get("previous_per_microbatch_s") if overhead.get("measured") else overhead.get("per_microbatch_s")
    was = "none" if not before else f"{before * 1e3:.3f} ms"
    if not overhead.get("measured"):
        return f"per-action overhead not measured: {overhead.get('reason')}; left as it was ({was})"
    per_stage = ", ".join(f"stage {g['stage']} {g['per_action_s'] * 1e3:.3f} ms over {g['actions']} actions"
                          for g in overhead["stages"])
    return (f"per-action overhead: {overhead['per_microbatch_s'] * 1e3:.3f} ms (was {was}), the median over stages "
            f"of the step less the stage's actions, waits and gradient sync, per action ({per_stage}); plans with "
            "more than one stage charge it on every forward and backward (I and W each)")


def _scale(stage: dict, kind: str) -> str:
    """``1.18``, or ``1.02 (1.05)`` when the run's spread shrank the measured ratio (the table's
    heading says they are factors: x the prediction)."""
    applied = stage.get(f"{kind}_scale")
    if applied is None:
        return "-"
    measured = stage.get(f"measured_{kind}_ratio")
    if measured is None or round(measured, 2) == round(applied, 2):
        return f"{applied:.2f}"
    return f"{applied:.2f} ({measured:.2f})"


PROFILE_HINT = "give --profile PROFILE (the profile the run's plan was made from)"


def profile_of_report(report_path: str) -> tuple[str, str]:
    """The profile a run's plan was made from, as the report and its plan name them, and the plan.

    The report names its plan (``plan.path``), the plan its profile (``profile.path``), each
    as given on the command line then: tried as written (relative to here), then beside the
    file that names it. Refused in one line when a file is gone or has changed since (its
    SHA-256 is not the one recorded): scales computed against one profile's predictions mean
    nothing for another's.
    """
    report = read_report(report_path)
    plan_path = named_file(*recorded_file(report, "plan"), "plan", f"report '{report_path}'", report_path,
                           "a run of plan", hint=PROFILE_HINT)
    plan = read_plan(plan_path)
    return named_file(plan.profile_path, plan.profile_sha256, "profile", f"plan '{plan_path}'", plan_path,
                      "made from profile", hint=PROFILE_HINT), plan_path


def check_profile_of_plan(report_path: str, profile_path: str) -> str | None:
    """``--profile`` must be the very profile the run's plan was made from, where the plan says;
    returns that plan's path (None: the report's plan is not found).

    Two profiles of one model differ in their figures: scales computed against one's
    predictions would be applied to the other's. When the report's plan can be found and
    records its profile's SHA-256, a profile with another is refused in one line. The file is
    read as a profile first, so that one that is missing, not JSON or not a profile is told so.
    """
    read_profile(profile_path)
    report = read_report(report_path)
    recorded = report.get("plan") if isinstance(report.get("plan"), dict) else {}
    sha256 = recorded.get("sha256") if isinstance(recorded.get("sha256"), str) else None
    plan_path = locate(recorded["path"], report_path, sha256) if isinstance(recorded.get("path"), str) else None
    if plan_path is None:
        return None
    plan = read_plan(plan_path)
    expected = plan.profile_sha256
    if expected is not None and file_sha256(profile_path) != expected:
        raise BadInput(f"profile '{profile_path}' is not the one plan '{plan_path}' was made from (its SHA-256 "
                       f"differs): calibrate with that profile ('{plan.profile_path}'), or leave --profile out")
    return plan_path
