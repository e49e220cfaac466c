"""``gpipe-plan demo``: the whole loop on the built-in gpt, on this CPU, in about two minutes.

It joins the three packages (profile, planner, runtime) as the command line does, so it lives
beside cli.py, not in any of them.

1. profile the default ``gpt`` layer by layer (one thread, as each rank will run), for the
   demo's global batch, and, as ``gpipe-plan profile`` does by default, the runtime's fixed
   costs per action and message (without them a plan of many chunks looks cheaper than it runs:
   planner/fixedcosts.py);
2. solve for ``--stages`` stages (2): where to cut, how many micro-batches, which schedule;
3. train with the plan for ``--steps`` steps (100), one process per stage, on a real text
   shipped with the package (the Declaration of Independence, public domain: runtime/texts/),
   byte by byte, so that the loss visibly falls from ln 256 = 5.5, a uniform guess among 256
   bytes;
4. show the plan, its predicted timeline, measured against predicted, and the loss.

Everything is written to ``--out-dir``, so that the profile, the plan, the report and the trace
can be looked at afterwards; without it, to a temporary folder that is deleted at the end, as
the last line says.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from .artifacts import BadInput
from .runtime.options import RunOptions, check_options
from .schema import write_artifact

if TYPE_CHECKING:
    from .plan_view import PlanView

GLOBAL_BATCH = 32
# The sizes profiled (M = 16, 8, 4 or 2 micro-batches of the global batch): the profile times the
# runtime's fixed costs at each, in a short 2-process pipeline, so each size costs seconds.
MICRO_BATCH_SIZES = [2, 4, 8, 16]
# The text the demo learns, and how (the README's recipe for real text, scaled to a short run):
# Adam at LEARNING_RATE after a linear warm-up over the first tenth of the steps, the global
# gradient norm clipped to GRAD_CLIP (docs/runtime.md, "Real text"; docs/benchmarks.md, "Demo").
DEMO_TEXT = Path(__file__).resolve().parent / "runtime" / "texts" / "declaration-of-independence.txt"
LEARNING_RATE = 1e-3
GRAD_CLIP = 1.0
STEPS = 100


# What the demo writes, and what each file is.
FILES = {"profile.json": "", "plan.json": "", "plan.svg": "the predicted timeline", "report.json": "",
         "trace.json": "the measured one: open it in https://ui.perfetto.dev"}


def demo_command(steps: int = STEPS, stages: int = 2, out_dir: str | None = None) -> None:
    check_demo_flags(steps, stages, out_dir)     # before half a minute of profiling
    console = Console()
    started = time.monotonic()
    if out_dir is not None:
        folder = Path(out_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:   # what the check cannot tell: /proc/d (no folder can be made there), a full disk
            raise BadInput(f"cannot make --out-dir '{folder}': {exc.strerror or exc}; choose another folder") from None
        _demo(console, folder, steps, stages)
    else:
        with tempfile.TemporaryDirectory(prefix="gpipe-plan-demo-") as tmp:
            _demo(console, Path(tmp), steps, stages)
    console.print(f"\ndone in {time.monotonic() - started:.0f} s. {files_line(out_dir)}", highlight=False)


def files_line(out_dir: str | None) -> str:
    """Where the demo's files are: in ``--out-dir``, or gone with the temporary folder they
    were written to (and how to keep them)."""
    if out_dir is not None:
        listed = ", ".join(f"{name} ({what})" if what else name for name, what in FILES.items())
        return f"Files in {out_dir}: {listed}"
    return (f"The files ({', '.join(FILES)}) were in a temporary folder, deleted now: keep them with "
            f"`gpipe-plan demo --out-dir DIR`")


def check_demo_flags(steps: int, stages: int, out_dir: str | None) -> None:
    """Refuse what the demo would only trip on after profiling: one line each (BadInput).

    ``--steps`` as ``run`` checks it, ``--stages`` from 1 to the default gpt's layers (each
    stage needs one), and ``--out-dir`` a folder that exists or can be made (its nearest
    existing ancestor a writable folder), not a file nor an empty path (which would be the
    current folder, which the user did not name).
    """
    from .models.gpt import DEFAULTS, layer_count

    if steps < 1:
        raise BadInput(f"--steps must be at least 1, got {steps}")
    layers = layer_count(DEFAULTS)
    if not 1 <= stages <= layers:
        raise BadInput(f"--stages must be from 1 to {layers} (the demo's gpt has {layers} layers, and each stage "
                       f"needs one), got {stages}")
    if out_dir is None:
        return
    if out_dir == "":
        raise BadInput("--out-dir was given an empty path: give it the folder to write the demo's files to")
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"--out-dir '{folder}' is a file, not a folder")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():        # plan.json/sub: no folder can be made inside a file
        raise BadInput(f"--out-dir '{folder}': '{existing}' is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(f"--out-dir '{folder}': folder '{existing}' is not writable")


def _demo(console: Console, folder: Path, steps: int, stages: int) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    profile_path, plan_path = folder / "profile.json", folder / "plan.json"

    console.rule("[bold]1. profile[/] the built-in gpt, layer by layer, 1 thread")
    profile = _profile(console, profile_path, stages)

    console.rule(f"[bold]2. solve[/] for {stages} stages, global batch {GLOBAL_BATCH}")
    plan = _solve(profile_path, plan_path, stages)
    _show_plan(console, plan_path, plan)

    console.rule(f"[bold]3. run[/] {steps} steps with the plan, {stages} processes, on {DEMO_TEXT.name}")
    from .runtime.launch import launch_local

    report_path = folder / "report.json"
    options = check_options(RunOptions(plan=str(plan_path), steps=steps, report=str(report_path),
                                       trace=str(folder / "trace.json"), log_every=10, data=str(DEMO_TEXT),
                                       lr=LEARNING_RATE, warmup_steps=max(1, steps // 10), grad_clip=GRAD_CLIP))
    threads = int(profile["device"].get("threads") or 1)
    launch_local(options, stages, threads)
    console.print(loss_line(report_path), highlight=False)


def _profile(console: Console, path: Path, stages: int) -> dict[str, Any]:
    import torch

    from .models import model_spec
    from .profiles.phases import phase_lines
    from .profiles.profiler import ProfileRequest, profile_model

    request = ProfileRequest(spec=model_spec("gpt"), micro_batch_sizes=MICRO_BATCH_SIZES,
                             device=torch.device("cpu"), threads=1, warmup=2, repeats=5, batch_size=GLOBAL_BATCH,
                             # the stages will compute side by side: measure what that costs
                             contention_processes=stages if stages > 1 else 0,
                             # ... and pay the runtime's own costs on every action and message, which
                             # decide between few chunks and many (planner/fixedcosts.py)
                             fixed_costs=stages > 1)
    with phase_lines():      # what the profile is doing, a line each, as profile prints them
        doc = profile_model(request)
    doc["global_batch_size"] = GLOBAL_BATCH   # as `profile --global-batch-size`: what solve plans for
    write_artifact(path, doc, "profile")
    from .profiles.show import render_profile

    render_profile(doc, console)
    return doc


def _solve(profile_path: Path, plan_path: Path, stages: int) -> dict[str, Any]:
    from .planner import solve_file

    return solve_file(str(profile_path), str(plan_path), stages=stages)   # the profile's global batch


def loss_line(report_path: Path) -> str:
    """What the model learned: its loss on the text at the first step and at the last."""
    from .artifacts import read_json

    loss = read_json(report_path, "report").get("loss") or {}
    if loss.get("first") is None:
        return "no loss recorded"
    return (f"\nloss on {DEMO_TEXT.name}: {loss['first']:.2f} at the first step, {loss['last']:.2f} at the last "
            f"(nats per byte; a uniform guess among 256 bytes is ln 256 = 5.55)")


def _show_plan(console: Console, plan_path: Path, plan: dict[str, Any]) -> None:
    from .artifacts import write_text_atomic
    from .plan_view import view_of
    from .planner.render import plan_timeline_svg, render_plan

    view = view_of(plan)
    render_plan(view, console)
    console.print(text_timeline(view), highlight=False)
    write_text_atomic(plan_path.with_suffix(".svg"), plan_timeline_svg(view))


def text_timeline(view: PlanView, width: int = 72) -> str:
    """The plan's predicted step, one row of characters per stage.

    ``F3==`` is the forward of micro-batch 3, ``B3====`` its backward (``I3`` and ``W3`` its
    halves under a zero-bubble schedule, ``R`` a recomputation), ``o`` the optimizer step,
    ``.`` idle: the dots are the bubble.
    """
    from .planner.render import plan_timeline

    timeline = plan_timeline(view)
    span = timeline.step_s or 1.0
    rows = []
    for k in range(view.num_stages):
        cells = ["."] * width
        for event in timeline.events:
            if event.stage != k or event.kind == "send":
                continue
            letter = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W",
                      "recompute": "R", "optimizer": "o"}[event.kind]
            label = letter if event.micro_batch < 0 else f"{letter}{event.micro_batch}"
            a = int(event.start_s / span * width)
            b = max(int(event.end_s / span * width), a + 1)
            for i in range(a, min(b, width)):
                cells[i] = label[i - a] if i - a < len(label) else ("=" if letter != "o" else "o")
        rows.append(f"stage {k} |{''.join(cells)}|")
    header = f"predicted timeline of one step ({span * 1e3:.1f} ms); '.' is idle: the bubble"
    return "\n".join([header, *rows])
