"""The ``gpipe-plan`` command line: parse, call one function of a package, print.

Each command imports its package only when it runs (only planner/budgets.py, which imports
nothing, loads up front for the defaults the help shows), so ``gpipe-plan --help`` and
everything the planner does (``solve``, ``explore``, ``show`` of a plan) start without
importing torch.
Errors a user can fix are :class:`artifacts.BadInput`: one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from . import __version__
from .artifacts import LOSSES, PARAM_DTYPES, PRECISIONS, BadInput, RunFailure
from .plan_layout import GRADIENT_SYNCS
from .planner.budgets import EXPLORE_POINT_TIME_BUDGET_S, SOLVE_TIME_BUDGET_S
from .schedules import PLANNABLE_SCHEDULES


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
            command = exc.ctx.command_path if exc.ctx is not None else "gpipe-plan"
            _fail(f"{_one_line(exc.format_message())} (see '{command} --help')", exc.exit_code)
        except click.ClickException as exc:
            _fail(_one_line(exc.format_message()), exc.exit_code)
        except click.exceptions.Abort:
            _fail("aborted", 1)
        if not standalone:
            return returned
        sys.exit(returned if isinstance(returned, int) else 0)   # --help, --version: click's Exit code

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BadInput as exc:
            _fail(str(exc), 2)
        except RunFailure as exc:
            _fail(str(exc), 1)
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
    gpipe-plan run plan.json --steps 100           train with it, measured vs predicted
    gpipe-plan demo                                all three on a small GPT, on this CPU
    """


# --------------------------------------------------------------------------- profile
@main.command()
@click.argument("model")
@click.option("--batch-size", type=int, default=None,
              help="Largest micro-batch size to measure. Default: 8, or the largest of --micro-batch-sizes.")
@click.option("--micro-batch-sizes", default=None, metavar="1,2,4",
              help="Micro-batch sizes to measure. Default: 1, 2, 4, ... doubling up to --batch-size.")
@click.option("--global-batch-size", "-b", type=int, default=None,
              help="Samples per training step you mean to train with, recorded in the profile: solve and explore "
                   "plan for it unless told otherwise. Default: the largest micro-batch size measured.")
@click.option("--device", default="cpu", show_default=True, metavar="cpu|cuda|cuda:N", help="Device to profile on.")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="Compute dtype: bf16/fp16 run every forward under torch.autocast, as `run --precision` will.")
@click.option("--param-dtype", type=click.Choice(PARAM_DTYPES), default="fp32", show_default=True,
              help="Dtype of the parameters, gradients and optimizer state (bf16 needs --precision bf16).")
@click.option("--input-shape", default=None, metavar="S",
              help="Your model: the shape of one input sample, e.g. 64 or 3,32,32.")
@click.option("--num-classes", type=int, default=None,
              help="Your model (and resnet): the number of classes the output scores.")
@click.option("--input-dtype", default=None, metavar="DTYPE",
              help="Your model: input dtype, float32 (default) or int64 for token ids.")
@click.option("--vocab-size", type=int, default=None,
              help="gpt's vocabulary; for your model with --input-dtype int64, the token id range.")
@click.option("--loss", default=None, metavar="|".join(LOSSES) + "|pkg.module:fn",
              help="Your model's objective: classify (default; logits (batch, classes) against class ids), "
                   "lm (logits (batch, seq, vocab) against the next token of the input ids; needs --vocab-size), "
                   "or your own fn(outputs, targets) -> mean loss (with --data).")
@click.option("--data", default=None, metavar="pkg.module:factory",
              help="Your model's data: factory(batch_size) yields (inputs, targets) mini-batches (lm: ids and next "
                   "ids, both (batch, seq); classify: class ids (batch,)); the inputs' shapes come from them, and "
                   "--input-shape and the like, if given, must agree. `run` trains on them.")
@click.option("--cut-at", default=None, metavar="REGEX",
              help="Your model: module paths that become the layers, e.g. 'model\\.layers\\.\\d+'. "
                   "Default: each block of the model's repeated block list, and each other module with weights.")
@click.option("--layers", type=int, default=None, help="gpt: transformer blocks (default 4).")
@click.option("--width", type=int, default=None, help="gpt: model width (default 128); resnet: base channels (16).")
@click.option("--heads", type=int, default=None, help="gpt: attention heads (default 4).")
@click.option("--seq-len", type=int, default=None, help="gpt: tokens per sample (default 64).")
@click.option("--blocks", default=None, metavar="2,2,2", help="resnet: residual blocks per stage (default 2,2,2).")
@click.option("--image-size", type=int, default=None, help="resnet: image side in pixels (default 32).")
@click.option("--threads", type=int, default=1, show_default=True,
              help="CPU intra-op threads while measuring; runs of a plan use the same per rank.")
@click.option("--warmup", type=int, default=3, show_default=True, help="Untimed runs before the timed ones.")
@click.option("--repeats", type=int, default=10, show_default=True, help="Timed runs; the median is kept.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the parameters and synthetic data.")
@click.option("--measure-link", is_flag=True,
              help="Also measure latency and bandwidth between two processes, and an all-reduce over them "
                   "(gloo on CPU; NCCL on CUDA, the all-reduce over every GPU, at most 8).")
@click.option("--contention-processes", type=int, default=None, metavar="N",
              help="CPU: also time the model with N processes computing at once (as N stages do), so "
                   "plans predict what neighbours cost; 0: do not. Default: cores / --threads, at most 8 "
                   "(0 on one core); more than the cores run at once is refused.")
@click.option("--recompute-timing/--no-recompute-timing", default=True, show_default=True,
              help="Also time every layer under activation checkpointing, so that plans price recomputation "
                   "as measured (about a third more profiling time).")
@click.option("--split-backward-timing/--no-split-backward-timing", default=True, show_default=True,
              help="Also time every layer's backward split into the input and the weight gradient, and weigh what "
                   "stays alive between them, so that plans price zero-bubble schedules (zb-h1, zb-v) as measured "
                   "(about a third more profiling time).")
@click.option("--fixed-costs/--no-fixed-costs", default=True, show_default=True,
              help="Also run a short 2-process pipeline of the model's layers to measure what the runtime costs "
                   "per action and message, which plans charge (seconds; see docs/profile-format.md).")
@click.option("--layer-by-layer/--whole-model", default=None,
              help="Layer by layer: only the layer being measured is in memory, and layers that are alike (same "
                   "code, parameter shapes, input and output shapes: a transformer's blocks) are measured once. "
                   "Whole model: every layer measured in the same rounds, next to the model's own step (their "
                   "sum matches it; layers timed alone run a few percent faster). Default: whole model up to "
                   "1 GiB of parameters, layer by layer above.")
@click.option("--measure-every-layer", is_flag=True,
              help="Layer by layer: measure every layer, not each kind once.")
@click.option("--whole-model-check/--no-whole-model-check", default=None,
              help="Layer by layer: also time the whole model's training step, to check that the layers add up "
                   "to it (the profile's consistency); it needs the whole model in memory. Default: only for "
                   "models whose parameters take at most 1 GiB.")
@click.option("--out", "-o", type=click.Path(dir_okay=False), default="profile.json", show_default=True,
              help="Where to write the profile JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary; print only the profile's path.")
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
@click.option("--stages", "-k", type=int, default=None,
              help="Number of pipeline stages K (one device each). Required unless --devices is given.")
@click.option("--devices", type=int, default=None, metavar="N",
              help="Plan N devices as K stages x d replicas (K x d = N): the best K and d unless fixed.")
@click.option("--data-parallel", "-d", default=None, metavar="d|auto",
              help="Replicas d of the pipeline, each on global batch / d samples, gradients synced once a "
                   "step. Default: 1 without --devices, 'auto' (every d dividing N) with it.")
@click.option("--nodes", type=int, default=1, show_default=True,
              help="Machines the devices are spread over, N / nodes each (ranks node-major); must divide N.")
@click.option("--network-bandwidth", default=None, metavar="GB/s",
              help="Bandwidth between nodes in GB/s; required with --nodes > 1.")
@click.option("--network-latency", default=0.0, type=float, metavar="SECONDS", show_default=True,
              help="Per-message latency between nodes (each ring step of a gradient sync pays it).")
@click.option("--gradient-sync", type=click.Choice(GRADIENT_SYNCS), default="ddp", show_default=True,
              help="How a stage's replicas share what they learn: all-reduce the gradients, whole copies (ddp), "
                   "or sharded parameters, gradients and optimizer state (fsdp: less memory, same traffic), "
                   "every step; or each replica steps on its own gradients and the parameters are averaged "
                   "every --sync-every steps (localsgd: 1/H of the traffic, another algorithm).")
@click.option("--sync-every", type=int, default=None, metavar="H",
              help="With --gradient-sync localsgd: average the replicas' parameters after every H steps "
                   "(H >= 1; recorded in the plan, which run follows). Default: 1.")
@click.option("--micro-batches", "-m", default="auto", show_default=True,
              help="Micro-batches per step M (per replica), or 'auto' to search the divisors of its batch.")
@click.option("--global-batch-size", "-b", type=int, default=None,
              help="Samples per training step over all replicas. Default: the profile's largest micro-batch size.")
@click.option("--schedule", type=click.Choice([*PLANNABLE_SCHEDULES, "auto"]),
              default="auto", show_default=True,
              help="Pipeline schedule (docs/planner.md, 'Schedules'); 'auto' picks the fastest synchronous one "
                   "that fits (never pipedream or pipedream-2bw, which train with stale weights: ask for them).")
@click.option("--virtual-stages", default="auto", show_default=True, metavar="N|auto",
              help="interleaved: chunks per stage (each stage holds N runs of layers); 'auto' tries 2, 3 and 4.")
@click.option("--recompute", type=click.Choice(["never", "always", "auto"]), default="auto", show_default=True,
              help="Activation recomputation; 'auto' decides per stage, only where memory needs it.")
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="Memory per device, e.g. 16GiB, 512MB, 80GB. Default: no limit.")
@click.option("--link-bandwidth", default=None, metavar="GB/s|inf",
              help="Link bandwidth between stages in GB/s, or 'inf' to ignore communication. "
                   "Default: the profile's measured link, else 'inf'.")
@click.option("--link-latency", default=None, type=float, metavar="SECONDS",
              help="Per-message link latency in seconds. Default: the profile's measured link, else 0.")
@click.option("--optimizer", type=click.Choice(["adam", "sgd", "momentum"]), default="adam", show_default=True,
              help="Optimizer whose state the memory model counts (Adam 2x params, momentum 1x).")
@click.option("--solver", type=click.Choice(["exact", "ilp", "dp"]), default="exact", show_default=True,
              help="exact: the exact searches (GPipe's dynamic programme; branch and bound for the other "
                   "schedules, then a MILP on HiGHS where pulp is installed; 'dp' is its old name); ilp: an "
                   "integer linear programme alone (pulp/CBC for gpipe and 1f1b, the schedule MILP for the others).")
@click.option("--out", "-o", type=click.Path(dir_okay=False), default="plan.json", show_default=True,
              help="Where to write the plan JSON.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None,
              help="Also draw the predicted schedule as an SVG timeline.")
@click.option("--time-budget", type=float, default=SOLVE_TIME_BUDGET_S, show_default=True,
              help="Seconds the search may take in all; past it the best plan found is kept, with its gap "
                   "to the proven lower bound.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the plan's path, predicted step time and batch.")
def solve(**options: Any) -> None:
    """Compute the best plan for PROFILE: stages, replicas, micro-batches, schedule, recomputation."""
    from .planner.command import solve_command

    solve_command(**options)


# --------------------------------------------------------------------------- explore
@main.command()
@click.argument("profile", type=click.Path(dir_okay=False))
@click.option("--stages", "-k", default=None,
              help="Comma-separated stage counts K (rows). Default: 1,2,4,8; with --devices, every K dividing it.")
@click.option("--micro-batches", "-m", default="auto", show_default=True,
              help="Comma-separated micro-batch counts M (columns), or 'auto': the powers of two dividing the batch.")
@click.option("--devices", type=int, default=None, metavar="N",
              help="Explore N devices as K stages x d replicas (every K x d = N): rows are the factorisations, "
                   "each replica takes the global batch / d. Default: one replica, rows K.")
@click.option("--nodes", type=int, default=None,
              help="With --devices: machines the devices are spread over, N / nodes each; must divide N. Default: 1.")
@click.option("--network-bandwidth", default=None, metavar="GB/s",
              help="With --devices: bandwidth between nodes in GB/s; required with --nodes > 1.")
@click.option("--network-latency", default=None, type=float, metavar="SECONDS",
              help="With --devices: per-message latency between nodes (each ring step of a gradient sync pays "
                   "it). Default: 0.")
@click.option("--gradient-sync", type=click.Choice(GRADIENT_SYNCS), default=None,
              help="With --devices: how a stage's replicas share gradients: all-reduce (ddp, the default), "
                   "sharded (fsdp), or parameters averaged every --sync-every steps (localsgd).")
@click.option("--sync-every", type=int, default=None, metavar="H",
              help="With --devices and --gradient-sync localsgd: the steps between two averagings. Default: 1.")
@click.option("--global-batch-size", "-b", type=int, default=None,
              help="Samples per step. Default: the profile's largest micro-batch size.")
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="Memory per device (e.g. 80GB): marks cells that do not fit and enables the capacity table.")
@click.option("--schedule", default="auto", show_default=True,
              help="gpipe, 1f1b, interleaved, zb-h1, zb-v, pipedream, pipedream-2bw, a comma list, or auto (the "
                   "five synchronous ones; interleaved with its best of 2, 3, 4 chunks per stage).")
@click.option("--recompute", default="never,always", show_default=True,
              help="Comma list of never, always, auto (per stage).")
@click.option("--link-bandwidth", default=None, metavar="GB/s|inf",
              help="Link bandwidth in GB/s or 'inf'. Default: the profile's measured link, else 'inf'.")
@click.option("--optimizer", type=click.Choice(["adam", "sgd", "momentum"]), default="adam", show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write every cell as JSON rows.")
@click.option("--chart", type=click.Path(dir_okay=False), default=None, help="Draw throughput vs M (SVG).")
@click.option("--time-budget", type=float, default=EXPLORE_POINT_TIME_BUDGET_S, show_default=True,
              help="Seconds per cell before a search settles for its best plan so far (marked *).")
def explore(**options: Any) -> None:
    """What-if tables for PROFILE: throughput and memory for each K, M, schedule, recompute.

    Every cell holds the planner's optimal plan for that setting, not a uniform split. With
    --devices N the rows are every K stages x d replicas = N, led by each one's best plan.
    """
    from .planner.command import explore_command

    explore_command(**options)


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
              help="Fold the run in even when calibrate would refuse it as not the model's cost (a busy host, a "
                   "ratio no correct run gives); a run of another model or profile is refused all the same.")
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
    if isinstance(doc, dict) and doc.get("format") == PROFILE_FORMAT:
        from rich.console import Console

        from .profiles.show import render_profile

        render_profile(read_profile(file), Console())
        return
    if isinstance(doc, dict) and doc.get("format") == REPORT_FORMAT:
        from .runtime.report import show_report

        show_report(read_report(file), file)
        return
    from .planner.command import show_plan

    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise BadInput(f"'{file}' is not a gpipe-plan profile, plan or report (its \"format\" is "
                       f"{doc.get('format') if isinstance(doc, dict) else None!r})")
    show_plan(file, timeline=timeline)


# --------------------------------------------------------------------------- run
@main.command()
@click.argument("plan", type=click.Path(dir_okay=False))
@click.option("--steps", type=int, default=20, show_default=True,
              help="Training steps to run in all (a resumed run continues up to this count).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the initial parameters (the same on every rank) and of the data.")
@click.option("--optimizer", type=click.Choice(["adam", "adamw", "sgd", "momentum"]), default=None,
              help="Optimizer. Default: the one the plan's memory model counted, else adam.")
@click.option("--lr", type=float, default=None,
              help="Learning rate. Default: 1e-3 for adam/adamw, 1e-2 for sgd/momentum.")
@click.option("--weight-decay", type=float, default=0.0, show_default=True, help="Weight decay.")
@click.option("--momentum", type=float, default=0.9, show_default=True, help="Momentum of --optimizer momentum.")
@click.option("--grad-clip", type=float, default=None, metavar="NORM",
              help="Clip the global gradient norm (over all stages) to NORM.")
@click.option("--lr-schedule", type=click.Choice(["constant", "cosine"]), default="constant", show_default=True,
              help="Learning-rate schedule after the warm-up; cosine decays to lr/10 at the last step.")
@click.option("--warmup-steps", type=int, default=0, show_default=True, help="Linear learning-rate warm-up steps.")
@click.option("--data", default=None, metavar="FILE.txt|pkg.module:factory",
              help="A language model (gpt, or yours with --loss lm): train on this text, byte-level (vocabulary "
                   ">= 256). Your model: factory(batch_size) yields (inputs, targets) mini-batches. "
                   "Default: the profile's --data factory, else synthetic data.")
@click.option("--save", type=click.Path(dir_okay=False), default=None, metavar="model.pt",
              help="Write the trained model's full state_dict (the unsplit model's keys), for torch.load.")
@click.option("--report", type=click.Path(dir_okay=False), default=None, metavar="report.json",
              help="Write measured vs predicted (step time, per-stage times, memory, bubble) as JSON.")
@click.option("--trace", type=click.Path(dir_okay=False), default=None, metavar="trace.json",
              help="Write a Chrome trace of every stage's forwards and backwards (open in ui.perfetto.dev).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="Save checkpoints here, every --checkpoint-every steps and at the end: one "
                   "torch.distributed.checkpoint per step, keyed like the unsplit model (all ranks must see it).")
@click.option("--checkpoint-every", type=int, default=100, show_default=True, help="Steps between checkpoints.")
@click.option("--keep-checkpoints", type=int, default=2, show_default=True, help="Newest checkpoints to keep.")
@click.option("--resume", is_flag=True,
              help="Continue from the newest complete checkpoint in --checkpoint-dir (start fresh if there is "
                   "none), under this plan or any other split of the same model (other stages, balance, batch).")
@click.option("--init-from", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Start from these weights of the unsplit model: a torch.save'd state_dict (.pt, .bin) or a "
                   ".safetensors file, keyed like model.state_dict() (as --save writes it); each rank reads only its "
                   "stage's tensors. The optimizer starts fresh, at step 0. With --resume, an existing checkpoint wins.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="Compute dtype (fp16 adds loss scaling). Default: the plan's; a different one is refused, "
                   "since the plan's times and memory were measured in its own.")
@click.option("--param-dtype", type=click.Choice(PARAM_DTYPES), default=None,
              help="Dtype of the parameters, gradients and optimizer state. Default: the plan's.")
@click.option("--executor", type=click.Choice(["auto", "native", "torch"]), default="auto", show_default=True,
              help="native: gpipe-plan's executor (gloo/CPU); torch: torch.distributed.pipelining; "
                   "auto: native on CPU, torch on CUDA.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where ranks run: cuda is one GPU per rank (cuda:LOCAL_RANK); auto follows the plan's profile.")
@click.option("--threads", type=int, default=None,
              help="CPU threads per rank. Default: the threads the plan's profile measured with.")
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="Seconds a rank waits for a neighbour before it declares the run stuck.")
@click.option("--log-every", type=int, default=10, show_default=True,
              help="When the output is not a terminal: print a progress line every N steps.")
@click.option("--quiet", "-q", is_flag=True, help="No progress line or table (errors and warnings still show).")
def run(**options: Any) -> None:
    """Train with PLAN: one process per stage of each replica, measured against the prediction.

    \b
    Runs the plan's K stages x d replicas (data_parallel) as K*d local
    processes (gloo on CPU, NCCL on CUDA); each stage's replicas average
    their gradients once a step.
    Across machines, start it with torchrun instead (see docs/runtime.md):
      torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
               --rdzv-endpoint HOST:29500 -m gpipe_plan.cli run plan.json
    """
    from .runtime.command import run_command

    run_command(**options)


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
