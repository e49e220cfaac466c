"""``gpipe-plan solve`` and ``show`` for plans: read, search, write, print."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from ..artifacts import BadInput, Outputs, check_output_paths, dumps, file_sha256
from ..options import comma_list
from ..plan_view import PlanView, read_plan, view_of
from ..schema import MAX_SECONDS, PROFILE_FORMAT, read_artifact, write_artifact
from ..schedules import PLANNABLE_SCHEDULES, SCHEDULES
from .budgets import LEAST_ONE_DEVICE_S
from .plan import build_plan
from .profile import Profile
from .render import batch_line, plan_timeline_svg, render_plan
from .replicas import search_devices
from .request import RECOMPUTES, ExploreRequest, SolveCommand, SolveRequest
from .budgets import share_of_budget
from .one_device import one_stage_baseline
from .problem import device_memory_limit
from .search import search
from ..units import format_seconds, parse_bandwidth, parse_size


def load_profile(path: str) -> Profile:
    return Profile(read_artifact(path, PROFILE_FORMAT), where=f"profile '{path}'")   # Profile checks its keys


def solve_file(profile_path: str, plan_path: str | None = None, *, progress: bool = False,
               outputs: Outputs | None = None, **options: Any) -> dict[str, Any]:
    """Plan from a profile file; writes the plan (atomically) when ``plan_path`` is given.

    ``options`` are the fields of :class:`~.request.SolveRequest`, as the command line types them
    (e.g. ``stages=2``, ``global_batch_size=32``, ``micro_batches="auto"``, ``memory_limit="16GiB"``,
    ``devices=8``); ``outputs``: the set of files the plan is written with (all or none).
    Returns the plan document.
    """
    return solve_request(profile_path, SolveRequest(**options), plan_path, progress=progress, outputs=outputs)


def solve_request(profile_path: str, request: SolveRequest, plan_path: str | None = None, *, progress: bool = False,
                  outputs: Outputs | None = None) -> dict[str, Any]:
    """:func:`solve_file` for a request already made (the command line's)."""
    started = time.perf_counter()
    profile = load_profile(profile_path)
    opts = device_memory_limit(profile, request.solve_options())
    # One pipeline on one node (no --devices, d = 1) is the search it always was; else every
    # (K, d) and placement.
    replicated = opts.devices is not None or opts.data_parallel != 1 or opts.nodes != 1
    run = (lambda hook: search_devices(profile, opts, progress=hook)) if replicated else \
        (lambda hook: search(profile, opts, progress=hook))
    if progress:
        with _progress() as bar:
            task = bar.add_task("solving", total=None)
            found = run(lambda done, total, what: bar.update(
                task, completed=done, total=total, description=f"solving {what}"))
    else:
        found = run(None)
    devices = found if replicated else None
    result = found.best.result if replicated else found
    step = result.best.step_s
    if plan_path is not None and step > MAX_SECONDS:   # beyond what a plan file records (schema.py)
        batch = devices.global_batch_size if replicated else result.batch
        raise BadInput(f"the best plan for a global batch of {batch} takes {step / 86400:,.0f} days "
                       f"per step: plan a smaller --global-batch-size, or check --link-bandwidth, --link-latency, "
                       f"--network-bandwidth and --network-latency (a link that slow makes every message take "
                       f"that long)")
    # What the pipeline must beat: the best plan of the same batch on one device.
    # It shares the time budget: what the pipeline's search left of it.
    left = share_of_budget(opts.time_budget_s, started, 1, least_s=LEAST_ONE_DEVICE_S)
    used = result.best.setting.stages * result.best.setting.data_parallel
    single = replace(opts, time_budget_s=left)
    if opts.memory_limit_source == "host":   # one device alone on the host has all of its share
        single = device_memory_limit(profile, replace(single, memory_limit_bytes=None), ranks_per_host=1)
    baseline = one_stage_baseline(profile, single) if used > 1 else None
    if baseline is not None and (baseline.step_s or 0.0) > MAX_SECONDS:
        baseline = None   # one device would take months a step: there is nothing to compare with
    plan = build_plan(profile, profile_path, file_sha256(profile_path), opts, result, one_stage=baseline,
                      devices=devices)
    if plan_path is not None:
        write_artifact(plan_path, plan, "solved plan", outputs, "--out")
    return plan


def solve_command(profile: str, **options: Any) -> None:
    """``gpipe-plan solve PROFILE``: ``options`` are :class:`~.request.SolveCommand`'s fields."""
    command = SolveCommand(**options)
    out, timeline, quiet = command.out, command.timeline, command.quiet
    started = time.perf_counter()
    check_output_paths({"--out": out, "--timeline": timeline}, inputs=(profile,))   # both files or neither
    with Outputs() as outputs:   # the plan and its timeline: both or neither
        plan = solve_request(profile, command, out, progress=not quiet and sys.stderr.isatty(), outputs=outputs)
        view = view_of(plan)
        if timeline:
            outputs.add(timeline, plan_timeline_svg(view), "--timeline")
    console = Console()
    if quiet:
        console.print(f"{out}: predicted step {format_seconds(view.predicted.step_s)}, {batch_line(view)}",
                      highlight=False)
        return
    render_plan(view, console)
    console.print(f"wrote {out}" + (f" and {timeline}" if timeline else "")
                  + f" in {time.perf_counter() - started:.2f} s", highlight=False)
    close = tune_hint(view, out)
    if close:
        console.print(close, highlight=False)


def tune_hint(view: PlanView, out: str) -> str | None:
    """A line pointing at ``gpipe-plan tune`` where other settings are predicted within its
    default fraction of the plan (the cost model's ranking among them is within its own error)."""
    from ..tune import TUNE_WITHIN as within
    step = view.predicted.step_s
    near = [r for r in view.runners_up if r.fits and r.step_s is not None and step and r.step_s <= step * (1 + within)]
    if not near:
        return None
    return (f"{len(near)} other setting{'s are' if len(near) > 1 else ' is'} predicted within {within:.0%} of this "
            f"plan, closer than the prediction's own error may be: `gpipe-plan tune {out} --out tuned.json` runs "
            f"them (and the cuts one move away) on this host and keeps one only if it runs faster")


def show_plan(path: str, timeline: str | None = None) -> None:
    check_output_paths({"--timeline": timeline}, inputs=(path,))
    view = read_plan(path, "solved plan")    # gpipe_plan/schema.py: with what render_plan prints
    render_plan(view, Console())
    if timeline:
        with Outputs() as outputs:
            outputs.add(timeline, plan_timeline_svg(view), "--timeline")
        Console().print(f"wrote {timeline}", highlight=False)


def import_pipedream_command(graph: str, batch_size: int | None, out: str | None) -> None:
    from .pipedream import import_pipedream

    check_output_paths({"--out": out}, inputs=(graph,))
    doc = import_pipedream(graph, batch_size=batch_size)
    Profile(doc, where=graph)   # what we write must be a profile the planner accepts
    target = out or f"{doc['model']['name']}.profile.json"
    check_output_paths({"--out": target}, inputs=(graph,))   # the default name, once the model's name is known
    write_artifact(target, doc, "profile", flag="--out")
    Console().print(f"wrote {target}: {len(doc['layers'])} layers from {doc['source']['nodes']} nodes, "
                    f"batch {doc['batch_size']}", highlight=False)


def explore_command(profile: str, **options: Any) -> None:
    """``gpipe-plan explore PROFILE``: ``options`` are :class:`~.request.ExploreRequest`'s fields."""
    from .explore import explore
    from .explore_view import exploration_chart, exploration_json, render_exploration

    request = ExploreRequest(**options)
    check_output_paths({"--json": request.json_out, "--chart": request.chart}, inputs=(profile,))
    request.check()
    prof = load_profile(profile)
    ks = None if request.stages is None else _int_list(request.stages, "--stages")
    ms: list[int] | str = "auto" if request.micro_batches.strip().lower() == "auto" else \
        _int_list(request.micro_batches, "--micro-batches")
    # auto: the synchronous five; the asynchronous ones only when listed (they train with stale weights).
    schedules = list(SCHEDULES) if request.schedule == "auto" else \
        _choices(request.schedule, PLANNABLE_SCHEDULES, "--schedule")
    recomputes = _choices(request.recompute, RECOMPUTES, "--recompute")
    limit = parse_size(request.memory_limit) if request.memory_limit else prof.usable_memory_bytes   # see device_memory_limit
    bandwidth = parse_bandwidth(request.link_bandwidth) if request.link_bandwidth else None
    network = parse_bandwidth(request.network_bandwidth, "--network-bandwidth") if request.network_bandwidth else None
    with _progress() as bar:
        task = bar.add_task("exploring", total=None)
        ex = explore(prof, ks, ms, request.global_batch_size, limit, schedules, recomputes,
                     link_bandwidth_bytes_per_s=bandwidth, optimizer=request.optimizer,
                     time_budget_s=request.time_budget_s,
                     progress=lambda done, total, what: bar.update(task, completed=done, total=total,
                                                                   description=f"exploring {what}"),
                     devices=request.devices, nodes=request.nodes, network_bandwidth_bytes_per_s=network,
                     network_latency_s=request.network_latency_s, gradient_sync=request.gradient_sync,
                     sync_every=request.sync_every if request.sync_every is not None else 1)
    with Outputs() as outputs:   # the table and the chart: both or neither
        if request.json_out:
            outputs.add(request.json_out, dumps(exploration_json(ex)), "--json")
        if request.chart:
            outputs.add(request.chart, exploration_chart(ex), "--chart")
    console = Console()
    render_exploration(ex, console, limit)
    written = [p for p in (request.json_out, request.chart) if p]
    if written:
        console.print("wrote " + " and ".join(written), highlight=False)


def _int_list(text: str, flag: str) -> list[int]:
    return comma_list(text, flag, "1,2,4,8")


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    values = comma_list(text, flag, ",".join(allowed[:2]), item=str.lower)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise BadInput(f"{flag} takes a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return values


class CountColumn(ProgressColumn):
    """``3/8`` once the number of settings is known; before that, a spinner instead of ``0/None``."""

    def __init__(self) -> None:
        super().__init__()
        self._spinner = SpinnerColumn()

    def render(self, task: Task) -> Text:
        if task.total is None:
            return self._spinner.render(task)
        return Text(f"{int(task.completed)}/{int(task.total)}")


def _progress() -> Progress:
    # The bar pulses while the total is unknown (BarColumn does that for total=None). Only on a
    # terminal: elsewhere (a log, a pipe) rich's transient bar leaves an empty line behind.
    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), CountColumn(),
                    TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


__all__ = ["solve_file", "solve_command", "show_plan", "load_profile", "PROFILE_FORMAT"]
