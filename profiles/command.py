"""``gpipe-plan profile``: check the options, measure with a progress bar, write, summarise.

Everything a user can get wrong is checked before the first measurement, and the profile is
written only once it is complete (atomically): an error leaves no file behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..artifacts import BadInput, RunFailure, write_json_atomic
from ..models import Precision, model_spec
from .device import resolve_device
from .contention import default_processes
from .profiler import ProfileRequest, default_sizes, profile_model
from .show import render_profile

DEFAULT_BATCH_SIZE = 8

# CLI option -> model_spec option. The model decides which of them apply to it.
_MODEL_OPTIONS = ("layers", "width", "heads", "seq_len", "vocab_size", "blocks", "image_size",
                  "input_shape", "num_classes", "input_dtype")


def profile_command(model: str, batch_size: int | None = None, micro_batch_sizes: str | None = None,
                    device: str = "cpu", threads: int = 1, warmup: int = 3, repeats: int = 10,
                    seed: int = 0, measure_link: bool = False, out: str = "profile.json",
                    quiet: bool = False, contention_processes: int | None = None, recompute_timing: bool = True,
                    precision: str = "fp32", param_dtype: str = "fp32", **options: Any) -> None:
    """Profile MODEL and write the profile JSON to ``out``. Raises BadInput / RunFailure."""
    chosen = Precision(precision, param_dtype)   # checks the pair (BadInput)
    spec = model_spec(model, **{k: options.get(k) for k in _MODEL_OPTIONS})
    unknown = set(options) - set(_MODEL_OPTIONS)
    if unknown:
        raise TypeError(f"unexpected options: {sorted(unknown)}")  # a CLI wiring bug, not user input
    sizes, batch = parse_sizes(micro_batch_sizes, batch_size)
    for flag, value, least in (("--threads", threads, 1), ("--warmup", warmup, 0), ("--repeats", repeats, 1)):
        if value < least:
            raise BadInput(f"{flag} must be at least {least}, got {value}")
    target = Path(out)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise BadInput(f"cannot write '{out}': folder '{folder}' does not exist")
    dev = resolve_device(device)
    if measure_link and dev.type == "cuda" and torch.cuda.device_count() < 2:
        raise BadInput("--measure-link on cuda needs two GPUs (NCCL between them); this machine has one")
    if contention_processes is None:
        contention_processes = default_processes(threads) if dev.type == "cpu" else 0
    if contention_processes < 0 or contention_processes == 1:
        raise BadInput(f"--contention-processes must be 0 (do not measure) or at least 2, got {contention_processes}")
    request = ProfileRequest(spec=spec, micro_batch_sizes=sizes, device=dev, threads=threads, warmup=warmup,
                             repeats=repeats, seed=seed, measure_link=measure_link, batch_size=batch,
                             contention_processes=contention_processes, recompute=recompute_timing,
                             precision=chosen)

    err = Console(stderr=True)
    try:
        with _Bar(err, enabled=not quiet) as bar:
            doc = profile_model(request, bar)
    except (BadInput, KeyboardInterrupt):
        raise
    except torch.cuda.OutOfMemoryError as exc:
        raise RunFailure(f"out of GPU memory while profiling: use smaller --micro-batch-sizes "
                         f"({_first_line(exc)})") from None
    except Exception as exc:
        raise RunFailure(f"profiling failed: {type(exc).__name__}: {_first_line(exc)}") from None
    write_json_atomic(out, doc)
    if quiet:
        print(os.fspath(out))
        return
    console = Console()
    render_profile(doc, console)
    console.print(f"wrote {out}")


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
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise BadInput(f"--micro-batch-sizes '{text}' is not a comma-separated list of integers, e.g. 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise BadInput(f"--micro-batch-sizes '{text}' must be positive integers")
    if batch_size is not None and sizes[-1] > batch_size:
        raise BadInput(f"--micro-batch-sizes go up to {sizes[-1]}, above --batch-size {batch_size}")
    return sizes, batch_size or sizes[-1]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class _Bar:
    """A rich progress bar over (micro-batch size x layer) on stderr; the profiler's Progress."""

    def __init__(self, console: Console, enabled: bool) -> None:
        self._progress = Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.description}"), TimeElapsedColumn(),
                                  console=console, transient=True, disable=not enabled,
                                  refresh_per_second=4)  # the bar's thread shares the CPU being measured
        self._task: Any = None

    def __enter__(self) -> "_Bar":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def begin(self, total: int) -> None:
        self._task = self._progress.add_task("", total=total)

    def step(self, description: str) -> None:
        self._progress.update(self._task, advance=1, description=description)
