"""The ``gpipe-plan`` command line: parse, call one function of a package, print.

Each command imports its package only when it runs, so ``gpipe-plan --help`` and everything
the planner does (``solve``, ``explore``, ``show`` of a plan) start without importing torch.
Errors a user can fix are :class:`artifacts.BadInput`: one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from . import __version__
from .artifacts import BadInput, RunFailure


class _Group(click.Group):
    """Turns the project's own errors into one line and an exit status, never a traceback."""

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


# --------------------------------------------------------------------------- solve
@main.command()
@click.argument("profile", type=click.Path(dir_okay=False))
@click.option("--stages", "-k", type=int, required=True, help="Number of pipeline stages K (one device each).")
@click.option("--micro-batches", "-m", default="auto", show_default=True,
              help="Micro-batches per step M, or 'auto' to search the divisors of the global batch.")
@click.option("--global-batch-size", "-b", type=int, default=None,
              help="Samples per training step. Default: the profile's largest micro-batch size.")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b", "auto"]), default="auto", show_default=True,
              help="Pipeline schedule; 'auto' picks the faster one that fits.")
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
@click.option("--solver", type=click.Choice(["dp", "ilp"]), default="dp", show_default=True,
              help="Exact dynamic programme (fast) or integer linear programme (pulp/CBC).")
@click.option("--out", "-o", type=click.Path(dir_okay=False), default="plan.json", show_default=True,
              help="Where to write the plan JSON.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None,
              help="Also draw the predicted schedule as an SVG timeline.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the plan's path and predicted step time.")
def solve(**options: Any) -> None:
    """Compute the best plan for PROFILE: stages, micro-batches, schedule, recomputation."""
    from .planner.command import solve_command

    solve_command(**options)


# --------------------------------------------------------------------------- show
@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--timeline", type=click.Path(dir_okay=False), default=None,
              help="For a plan: also draw its predicted schedule as an SVG timeline.")
def show(file: str, timeline: str | None) -> None:
    """Pretty-print a profile or a plan."""
    from .planner.command import show_command

    show_command(file, timeline=timeline)


if __name__ == "__main__":  # pragma: no cover
    main()
