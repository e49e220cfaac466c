"""``gpipe-plan profile``: check the options, measure with a progress bar, write, summarise.

Everything a user can get wrong is checked before the first measurement, and the profile is
written only once it is complete (atomically): an error leaves no file behind.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..artifacts import BadInput, RunFailure, check_output_paths, first_line
from ..options import check_seed, comma_list
from ..allocator import steady_allocator
from ..hostload import usable_cores
from ..models import Precision, model_spec
from ..schema import check_global_batch_size, write_artifact
from .device import resolve_device
from .contention import default_processes, most_processes
from .options import ProfileOptions
from .phases import announced, phase_lines, phase_text
from .profiler import ProfileRequest, default_sizes, profile_model
from .show import render_profile

DEFAULT_BATCH_SIZE = 8


def profile_command(model: str, **options: Any) -> None:
    """Profile MODEL and write the profile JSON to ``--out``; ``options`` are the fields of
    :class:`~.options.ProfileOptions` (an unknown one is a TypeError: a wiring bug, not user
    input). Raises BadInput / RunFailure."""
    steady_allocator()       # as run's ranks will allocate (allocator.py), here and in the probes
    o = ProfileOptions(**options)
    chosen = Precision(o.precision, o.param_dtype)   # checks the pair (BadInput)
    spec = model_spec(model, **o.model_options())
    sizes, batch = parse_sizes(o.micro_batch_sizes, o.batch_size)
    intended_batch = intended_global_batch(o.global_batch_size, sizes)
    for flag, value, least in (("--threads", o.threads, 1), ("--warmup", o.warmup, 0),
                               ("--repeats", o.repeats, 1)):
        if value < least:
            raise BadInput(f"{flag} must be at least {least}, got {value}")
    check_seed(o.seed)
    if o.layer_by_layer is False:
        for flag, given in (("--measure-every-layer", o.measure_every_layer),
                            ("--whole-model-check/--no-whole-model-check", o.whole_model_check is not None)):
            if given:
                raise BadInput(f"{flag} is for a profile taken layer by layer, and --whole-model measures every "
                               "layer beside the model's own step: leave one of them out")
    check_output_paths({"--out": o.out})      # before minutes of measuring
    dev = resolve_device(o.device)
    cores = usable_cores()
    if dev.type == "cpu" and o.threads > cores:
        # (the profile records them, and every rank of a run then starts that many)
        raise BadInput(f"--threads {o.threads} is more than the {cores} cores this host lets us use: "
                       f"threads beyond them take turns and measure nothing real; use at most {cores}")
    if o.measure_link and dev.type == "cuda" and torch.cuda.device_count() < 2:
        raise BadInput("--measure-link on cuda needs two GPUs (NCCL between them); this machine has one")
    contention_processes = o.contention_processes
    if contention_processes is None:
        contention_processes = default_processes(o.threads) if dev.type == "cpu" else 0
    if contention_processes < 0 or contention_processes == 1:
        raise BadInput(f"--contention-processes must be 0 (do not measure) or at least 2, got {contention_processes}")
    if dev.type == "cpu" and contention_processes > most_processes(o.threads):
        most = most_processes(o.threads)
        raise BadInput(f"--contention-processes {contention_processes} at --threads {o.threads} needs "
                       f"{contention_processes * o.threads} cores and this host has {usable_cores()}: more processes "
                       "than it runs at once take turns on its cores, which plans model themselves (docs/planner.md, "
                       f"\"More ranks than cores\"); use {'at most ' + str(most) if most >= 2 else '0'}")
    request = ProfileRequest(spec=spec, micro_batch_sizes=sizes, device=dev, threads=o.threads, warmup=o.warmup,
                             repeats=o.repeats, seed=o.seed, measure_link=o.measure_link, batch_size=batch,
                             contention_processes=contention_processes, recompute=o.recompute_timing,
                             split_backward=o.split_backward_timing,
                             precision=chosen, share_figures=not o.measure_every_layer,
                             whole_model_check=o.whole_model_check, layer_by_layer=o.layer_by_layer,
                             fixed_costs=o.fixed_costs, shared_cores=o.shared_cores)

    err = Console(stderr=True)
    try:
        with phase_lines(enabled=not o.quiet), _progress_for(err, o.quiet) as bar:
            doc = profile_model(request, bar)
    except (BadInput, KeyboardInterrupt):
        raise
    except torch.cuda.OutOfMemoryError as exc:
        raise RunFailure(f"out of GPU memory while profiling: use smaller --micro-batch-sizes "
                         f"({first_line(exc)})") from None
    except Exception as exc:
        # (torch's CPU allocator says so in a RuntimeError, not a MemoryError)
        if isinstance(exc, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(exc):
            raise RunFailure(f"out of memory while profiling: use smaller --micro-batch-sizes "
                             f"({first_line(exc)})") from None
        raise RunFailure(f"profiling failed: {type(exc).__name__}: {first_line(exc)}") from None
    doc["global_batch_size"] = intended_batch   # what solve and explore plan for by default
    write_artifact(o.out, doc, "profile", flag="--out")
    if o.quiet:
        print(os.fspath(o.out))
        return
    console = Console()
    render_profile(doc, console)
    console.print(f"wrote {o.out}")


def parse_sizes(text: str | None, batch_size: int | None) -> tuple[list[int], int]:
    """``--micro-batch-sizes`` and ``--batch-size`` -> (ascending sizes, the batch size).

    Without sizes: doubling from 1 up to the batch size (default 8). With sizes and no batch
    size: the batch size is the largest of them.
    """
    if batch_size is not None and batch_size < 1:
        raise BadInput(f"--batch-size must be a positive integer, got {batch_size}")
    if text is None:
        batch = batch_size or DEFAULT_BATCH_SIZE
        return default_sizes(batch), batch
    sizes = sorted(comma_list(text, "--micro-batch-sizes", "1,2,4"))
    if sizes[0] < 1:
        raise BadInput(f"--micro-batch-sizes '{text}' must be positive integers")
    if batch_size is not None and sizes[-1] != batch_size:
        # (a larger --batch-size was recorded as if measured; the global batch is --global-batch-size)
        raise BadInput(f"--micro-batch-sizes go up to {sizes[-1]}, and --batch-size (the largest size to measure) "
                       f"says {batch_size}: give one of them (the batch you train with is --global-batch-size)")
    return sizes, batch_size or sizes[-1]


def intended_global_batch(global_batch_size: int | None, sizes: list[int]) -> int:
    """``--global-batch-size``, else the largest micro-batch size measured (one micro-batch a step).

    The profile records it so that ``solve`` plans for the batch the user trains with instead
    of silently taking the largest size measured; it need not be one of the measured sizes.
    """
    if global_batch_size is None:
        return sizes[-1]
    check_global_batch_size(global_batch_size)
    return global_batch_size




def _progress_for(console: Console, quiet: bool) -> "_Bar | PhaseLines":
    """A live bar on a terminal; one plain line per phase otherwise (a log, a CI job); nothing if quiet."""
    if quiet or console.is_terminal:
        return _Bar(console, enabled=not quiet)
    return PhaseLines(console.file)


class PhaseLines:
    """The profiler's Progress without a terminal: one line on stderr as each phase begins.

    A live bar redraws itself with control codes, which a log file cannot show, so without a
    terminal the profile used to print nothing until the end. A phase is what a user can tell
    apart: a layer (all its sizes, plain and checkpointed, and its optimizer step), the whole
    model, the link, the neighbours; the timing harnesses belong to the layer being measured.
    Each phase is announced once, the first time it runs: a profiler that times the layers in
    interleaved rounds would otherwise print a line per layer per round; one that a phase line
    announced as it began (profiles/phases.py: a layer measured alone) is not said again. In a
    long stretch without a new phase, a line every ``heartbeat_s`` says how far the profile is.
    """

    def __init__(self, stream: Any, heartbeat_s: float = 30.0, clock: Any = time.monotonic) -> None:
        self._stream = stream
        self._heartbeat_s = heartbeat_s
        self._clock = clock
        self._total = 0
        self._done = 0
        self._seen: set[str] = set()
        self._phase: str | None = None
        self._started = self._last = clock()

    def __enter__(self) -> "PhaseLines":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None and self._phase is not None:
            self._line("done")

    def begin(self, total: int) -> None:
        self._total = total

    def step(self, description: str) -> None:
        self._done += 1
        phase = phase_of(description)
        if phase is not None and phase not in self._seen:
            self._seen.add(phase)
            self._phase = phase
            if not announced(phase):     # a phase line said it when it began (profiles/phases.py)
                self._line(phase)
        elif self._phase is not None and self._clock() - self._last >= self._heartbeat_s:
            self._line(f"still {phase or self._phase}")

    def _line(self, what: str) -> None:
        now = self._clock()
        self._last = now
        share = self._done / self._total if self._total else None
        print(phase_text(what, share, now - self._started), file=self._stream, flush=True)


def phase_of(description: str) -> str | None:
    """The phase a unit of the profiler's work belongs to: ``b=4 block0 (recompute)`` -> ``block0``.

    Units are named by the runner that ran (``b=SIZE NAME``, ``NAME (recompute)``, ``NAME (split)``,
    ``NAME optimizer step``, ``whole model``, ...); the timing harnesses run beside every layer and
    start no phase of their own (None).
    """
    name = re.sub(r"^b=\d+ ", "", description)
    name = name.removesuffix(" (recompute)").removesuffix(" (split)").removesuffix(" optimizer step")
    if name in ("harness", "recompute harness", "split harness"):
        return None
    return name


class _Bar:
    """A rich progress bar over (micro-batch size x layer) on stderr; the profiler's Progress."""

    def __init__(self, console: Console, enabled: bool) -> None:
        # Time remaining: rich's estimate from the units done so far (layers of a kind cost alike).
        # What is being measured goes last, cut to the room left, so that the counts and the
        # times always show (rich would squeeze them to "0:…" on an 80-column terminal).
        self._console = console
        self._bar_width = 20 if console.width >= 100 else 10
        self._progress = Progress(TextColumn("profiling"), BarColumn(bar_width=self._bar_width), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.description}"),
                                  console=console, transient=True, disable=not enabled,
                                  refresh_per_second=4)  # the bar's thread shares the CPU being measured
        self._task: Any = None
        self._total = 0

    def __enter__(self) -> "_Bar":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def begin(self, total: int) -> None:
        self._total = total
        if self._task is None:
            self._task = self._progress.add_task("", total=total)
        else:       # the work grew: the same bar, a longer way
            self._progress.update(self._task, total=total)

    def step(self, description: str) -> None:
        self._progress.update(self._task, advance=1, description=self._fit(description))

    def _fit(self, description: str) -> str:
        """The description cut to what is left of the line: "profiling", the bar, "done/total",
        elapsed and remaining (7 characters each) and a space between columns."""
        counts = 2 * len(str(self._total)) + 1
        room = self._console.width - (len("profiling") + self._bar_width + counts + 7 + 7 + 5) - 1
        if len(description) <= room:
            return description
        return description[:room - 1] + "…" if room >= 8 else ""
