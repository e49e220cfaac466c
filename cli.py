"""The ``gpipe-plan`` command line: parse, call one function of a package, print.

Each option is declared once: those of profile, solve, explore, run and tune as the fields of
their request (gpipe_plan/options.py, [Note: options as data]), generated here; the few
of the small commands (calibrate, import-pipedream, export, show, demo) here, by click.
Each command imports its package only when it runs (only the requests, which import nothing
heavy, load up front for the help), so ``gpipe-plan --help`` and everything the planner does
(``solve``, ``explore``, ``show`` of a plan) start without importing torch.
Errors a user can fix are :class:`artifacts.BadInput`: one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from . import __version__
from .artifacts import BadInput, RunFailure
from .options import click_options
from .planner.request import ExploreRequest, SolveCommand
from .profiles.options import ProfileOptions
from .runtime.options import RunOptions
from .tune import TuneOptions


class _Group(click.Group):
    """Turns the project's own errors into one line and an exit status, never a traceback."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Click's usage errors (unknown option, missing argument, bad value) as one line, exit 2.

        Click's own standalone mode prints three (usage, a hint, the error); run without it,
        its errors come here as exceptions and get the same one-line form as everything else,
        with where to look for help. ``--help`` and ``--version`` still exit 0, and, as in
        click's standalone mode, this ends with ``sys.exit`` unless asked not to.
        """
        standalone = kwargs.pop("standalone_mode", True)
        try:
            returned = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":   # bare `gpipe-plan` (click >= 8.2): the help
                click.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message(), err=True)
                sys.exit(exc.exit_code)
            command = exc.ctx.command_path if exc.ctx is not None else self._command_named(args, kwargs)
            _fail(f"{_one_line(exc.format_message())} (see '{command} --help')", exc.exit_code)
        except click.ClickException as exc:
            _fail(_one_line(exc.format_message()), exc.exit_code)
        except click.exceptions.Abort:
            _fail("aborted", 1)
        if not standalone:
            return returned
        sys.exit(returned if isinstance(returned, int) else 0)   # --help, --version: click's Exit code

    def _command_named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """``gpipe-plan COMMAND`` of the command line, for an error click raised without a context
        (an option missing its value), else ``gpipe-plan``."""
        given = kwargs.get("args", args[0] if args else None)
        words = sys.argv[1:] if given is None else list(given)
        name = next((w for w in words if w in self.commands), None)
        program = kwargs.get("prog_name") or "gpipe-plan"
        return f"{program} {name}" if name else program

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BadInput as exc:
            _fail(str(exc), 2)
        except RunFailure as exc:
            _fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", 130)


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _one_line(message: str) -> str:
    """Click's message with its line breaks folded (a Choice error lists the choices on one line already)."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="gpipe-plan")
def main() -> None:
    """Plan pipeline-parallel training for a PyTorch model, and run the plan.

    \b
    gpipe-plan profile gpt --out profile.json      measure each layer (time, memory)
    gpipe-plan solve profile.json --stages 4       compute the best plan
    gpipe-plan tune plan.json --out tuned.json     run near-ties briefly, keep a faster one
    gpipe-plan run plan.json --steps 100           train with it, measured vs predicted
    gpipe-plan demo                                all three on a small GPT, on this CPU
    """


# --------------------------------------------------------------------------- profile
@main.command()
@click.argument("model")
@click_options(ProfileOptions)
def profile(**options: Any) -> None:
    """Measure MODEL layer by layer: time, activation memory, output sizes.

    MODEL is a built-in (gpt, resnet) or your own as pkg.module:factory, where factory()
    returns an nn.Module (give --input-shape and --num-classes).
    """
    from .profiles import profile_command

    profile_command(**options)


# --------------------------------------------------------------------------- solve
@main.command()
@click.argument("profile", type=click.Path(dir_okay=False))
@click_options(SolveCommand)
def solve(profile: str, **options: Any) -> None:
    """Compute the best plan for PROFILE: stages, replicas, micro-batches, schedule, recomputation."""
    from .planner.command import solve_command

    solve_command(profile, **options)


# --------------------------------------------------------------------------- explore
@main.command()
@click.argument("profile", type=click.Path(dir_okay=False))
@click_options(ExploreRequest)
def explore(profile: str, **options: Any) -> None:
    """What-if tables for PROFILE: throughput and memory for each K, M, schedule, recompute.

    Every cell holds the planner's optimal plan for that setting, not a uniform split. With
    --devices N the rows are every K stages x d replicas = N, led by each one's best plan.
    """
    from .planner.command import explore_command

    explore_command(profile, **options)


# --------------------------------------------------------------------------- calibrate
@main.command()
@click.argument("report", type=click.Path(dir_okay=False))
@click.option("--profile", "-p", "profile_path", type=click.Path(dir_okay=False), default=None,
              help="The profile the run's plan was made from. Default: the one the report's plan names.")
@click.option("--out", "-o", type=click.Path(dir_okay=False), default=None,
              help="Where to write the calibrated profile. Default: PROFILE with .calibrated.json.")
@click.option("--speed-correction/--no-speed-correction", default=False, show_default=True,
              help="Divide the machine's speed drift during the run (the report's speed probe) out of the "
                   "measured times. Off by default: the probe times a generic workload, whose drift can differ "
                   "from the model's own, so dividing it out can move the times away from what the model cost "
                   "(docs/runtime.md, 'Calibration').")
@click.option("--force", is_flag=True, default=False,
              help="Fold the run in even when calibrate would refuse it as not the model's cost (ranks that "
                   "shared the host's cores, a busy host, a ratio no correct run gives); a run of another model "
                   "or profile is refused all the same.")
def calibrate(report: str, profile_path: str | None, out: str | None, speed_correction: bool, force: bool) -> None:
    """Fold a run's measured per-stage times (REPORT from `run --report`) into its profile.

    A second `solve` with the calibrated profile plans with what the pipeline really costs.
    """
    from .artifacts import check_output_paths
    from .profiles.command_calibrate import calibrate_command

    check_output_paths({"--out": out}, inputs=(report,) + ((profile_path,) if profile_path else ()))
    calibrate_command(report, profile_path, out, speed_correction=speed_correction, force=force)


# --------------------------------------------------------------------------- import-pipedream
@main.command("import-pipedream")
@click.argument("graph", type=click.Path(dir_okay=False))
@click.option("--batch-size", type=int, default=None,
              help="Mini-batch the graph was profiled with. Default: inferred from an ImageNet-style input.")
@click.option("--out", "-o", type=click.Path(dir_okay=False), default=None,
              help="Where to write the profile. Default: MODEL.profile.json.")
def import_pipedream(graph: str, batch_size: int | None, out: str | None) -> None:
    """Convert a PipeDream graph.txt (per-operator GPU profile) into a gpipe-plan profile."""
    from .planner.command import import_pipedream_command

    import_pipedream_command(graph, batch_size=batch_size, out=out)


# --------------------------------------------------------------------------- export
@main.command()
@click.argument("plan", type=click.Path(dir_okay=False))
@click.option("--to", "target", default=None, metavar="torch|torchtitan|megatron|deepspeed",
              help="The trainer to hand the plan to: torch (a torchrun script), torchtitan (its parallelism "
                   "settings), megatron (its arguments), deepspeed (its config and partition).")
@click.option("--out", "-o", type=click.Path(dir_okay=False), default=None,
              help="Where to write the export (default: beside the plan, e.g. plan.torchtitan.toml).")
@click.option("--schedule-csv", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Write the plan's per-stage action lists as the CSV torch's _PipelineScheduleRuntime "
                   "and torchtitan's pipeline_parallel_schedule_csv read.")
def export(plan: str, target: str | None, out: str | None, schedule_csv: str | None) -> None:
    """Export a PLAN for another trainer, or its schedule as torch's CSV (no torch needed).

    \b
    gpipe-plan export plan.json --to torchtitan       plan.torchtitan.toml
    gpipe-plan export plan.json --to torch -o train.py
    gpipe-plan export plan.json --schedule-csv schedule.csv
    """
    from .artifacts import Outputs, check_output_paths
    from .planner.export import describe, describe_export, export_plan, export_schedule_csv

    if target is None and schedule_csv is None:
        raise BadInput("say what to export: --to torch|torchtitan|megatron|deepspeed, or --schedule-csv FILE")
    if target is None and out is not None:
        raise BadInput("--out goes with --to TARGET; the schedule's CSV is written to --schedule-csv FILE")
    check_output_paths({"--out": out, "--schedule-csv": schedule_csv}, inputs=(plan,))
    # The target first (it refuses what it cannot export), the CSV after: a refusal writes nothing.
    with Outputs() as outputs:
        lines = describe_export(export_plan(plan, target, out, outputs)) if target is not None else []
        if schedule_csv is not None:
            lines = describe(export_schedule_csv(plan, schedule_csv, outputs)) + lines
    for line in lines:
        click.echo(line)


# --------------------------------------------------------------------------- show
@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--timeline", type=click.Path(dir_okay=False), default=None,
              help="For a plan: also draw its predicted schedule as an SVG timeline.")
def show(file: str, timeline: str | None) -> None:
    """Pretty-print a profile, a plan or a run's report (none needs torch)."""
    from .artifacts import check_output_paths, read_json
    from .schema import PLAN_FORMAT, PROFILE_FORMAT, REPORT_FORMAT, read_profile, read_report

    check_output_paths({"--timeline": timeline}, inputs=(file,))
    doc = read_json(file, "file")
    found = doc.get("format") if isinstance(doc, dict) else None
    if timeline is not None and found in (PROFILE_FORMAT, REPORT_FORMAT):
        kind = "a profile" if found == PROFILE_FORMAT else "a run's report"
        raise BadInput(f"--timeline draws a plan's schedule, and '{file}' is {kind}: give it the plan")
    if found == PROFILE_FORMAT:
        from rich.console import Console

        from .profiles.show import render_profile

        render_profile(read_profile(file), Console())
        return
    if found == REPORT_FORMAT:
        from .runtime.report import show_report

        show_report(read_report(file), file)
        return
    from .planner.command import show_plan

    if not isinstance(doc, dict):
        raise BadInput(f"'{file}' is not a gpipe-plan profile, plan or report: it holds a JSON "
                       f"{type(doc).__name__ if doc is not None else 'null'}, not an object")
    if found != PLAN_FORMAT:
        raise BadInput(f"'{file}' is not a gpipe-plan profile, plan or report (its \"format\" is {found!r})")
    show_plan(file, timeline=timeline)


# --------------------------------------------------------------------------- run
@main.command()
@click.argument("plan", type=click.Path(dir_okay=False))
@click_options(RunOptions)
def run(**options: Any) -> None:
    """Train with PLAN: one process per stage of each replica, measured against the prediction.

    \b
    Runs the plan's K stages x d replicas (data_parallel) as K*d local
    processes (gloo on CPU, NCCL on CUDA); each stage's replicas average
    their gradients once a step (ddp, fsdp) or their weights every H steps
    (localsgd).
    Across machines, start it with torchrun instead (see docs/runtime.md):
      torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
               --rdzv-endpoint HOST:29500 -m gpipe_plan.cli run plan.json
    """
    from .runtime.command import run_command

    run_command(**options)


# --------------------------------------------------------------------------- tune
@main.command()
@click.argument("plan", type=click.Path(dir_okay=False))
@click_options(TuneOptions)
def tune(plan: str, **options: Any) -> None:
    """Run PLAN and the plans predicted about as fast, a few steps each; keep one that runs faster.

    \b
    Where plans are predicted closer than the cost model's own error on
    this host (ranks sharing cores, a GPU waiting on its CPU), solve's
    choice among them is chance: tune runs them, rounds interleaved, and
    writes to --out, for run, the fastest that ran faster than PLAN in
    every round (else PLAN). Needs PLAN's profile.
    """
    from .tune import tune_command

    tune_command(plan, **options)


# --------------------------------------------------------------------------- demo
@main.command()
@click.option("--steps", type=int, default=100, show_default=True, help="Training steps.")
@click.option("--stages", "-k", type=int, default=2, show_default=True, help="Pipeline stages.")
@click.option("--out-dir", type=click.Path(file_okay=False), default=None,
              help="Keep the profile, plan, report and trace here. Default: a temporary folder.")
def demo(**options: Any) -> None:
    """Profile the built-in gpt on this CPU, plan 2 stages, train with the plan, compare.

    The whole loop in a few minutes: profile -> solve -> run on a public-domain text the
    package ships, then the plan, its timeline, measured against predicted, and the loss.
    """
    from .demo import demo_command

    demo_command(**options)


if __name__ == "__main__":  # pragma: no cover
    main()
