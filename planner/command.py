"""``gpipe-plan solve`` and ``show`` for plans: read, search, write, print."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from ..artifacts import BadInput, Outputs, check_output_paths, dumps, file_sha256
from ..plan_layout import localsgd_problem
from ..schema import MAX_SECONDS, PROFILE_FORMAT, read_artifact, write_artifact
from ..schedules import PLANNABLE_SCHEDULES, SCHEDULES
from .budgets import LEAST_ONE_DEVICE_S, SOLVE_TIME_BUDGET_S
from .plan import build_plan
from .profile import Profile
from .render import batch_line, plan_timeline_svg, render_plan
from .replicas import search_devices
from .search import SolveOptions, device_memory_limit, one_stage_baseline, search, share_of_budget
from ..units import format_seconds, parse_bandwidth, parse_size


def load_profile(path: str) -> Profile:
    return Profile(read_artifact(path, PROFILE_FORMAT), where=f"profile '{path}'")   # Profile checks its keys


def _int_or_auto(text: str | int, flag: str, least: int, what: str) -> int | str:
    """An integer of at least ``least`` or ``auto``, from the command line or a caller."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif str(text).strip().lower() == "auto":
        return "auto"
    else:
        try:
            value = int(str(text))
        except ValueError:
            raise BadInput(f"{flag} must be {what} or 'auto', got {text!r}") from None
    if value < least:
        raise BadInput(f"{flag} must be at least {least}, got {value}")
    return value


def parse_micro_batches(text: str | int) -> int | str:
    return _int_or_auto(text, "--micro-batches", 1, "a positive integer")


def parse_virtual_stages(text: str | int) -> int | str:
    """``--virtual-stages``: interleaved's chunks per stage, at least 2, or ``auto``."""
    return _int_or_auto(text, "--virtual-stages", 2, "an integer of at least 2")


# ``--solver dp`` was the exact searches' first name (when GPipe's dynamic programme was all of them).
SOLVER_ALIASES = {"dp": "exact"}


def parse_data_parallel(text: str | int | None, devices: int | None) -> int | str:
    """``--data-parallel``: replicas d >= 1 or ``auto``; unset: auto with --devices, else 1."""
    if text is None:
        return "auto" if devices is not None else 1
    return _int_or_auto(text, "--data-parallel", 1, "a positive integer")


def solve_options(
    stages: int | None,
    micro_batches: int | str = "auto",
    global_batch_size: int | None = None,
    schedule: str = "auto",
    virtual_stages: int | str = "auto",
    recompute: str = "auto",
    memory_limit: str | int | None = None,
    link_bandwidth: str | float | None = None,
    link_latency: float | None = None,
    optimizer: str = "adam",
    solver: str = "exact",
    time_budget_s: float = SOLVE_TIME_BUDGET_S,
    devices: int | None = None,
    data_parallel: str | int | None = None,
    nodes: int = 1,
    network_bandwidth: str | float | None = None,
    network_latency: float = 0.0,
    gradient_sync: str = "ddp",
    sync_every: int | None = None,
) -> SolveOptions:
    """Options as typed on the command line -> :class:`SolveOptions` (one-line errors).

    ``sync_every``: localsgd's H, None where not given (``--sync-every`` belongs to localsgd alone).
    """
    if not (math.isfinite(time_budget_s) and time_budget_s > 0):
        raise BadInput(f"--time-budget must be a positive number of seconds, got {time_budget_s}")
    if stages is None and devices is None:
        raise BadInput("give --stages K (one pipeline of K devices) or --devices N (K stages x d replicas)")
    if devices is not None and devices < 1:
        raise BadInput(f"--devices must be at least 1, got {devices}")
    if network_latency is None or not (math.isfinite(network_latency) and network_latency >= 0):
        raise BadInput(f"--network-latency must be a finite number of seconds >= 0, got {network_latency}")
    if link_latency is not None and not (math.isfinite(link_latency) and link_latency >= 0):
        raise BadInput(f"--link-latency must be a finite number of seconds >= 0, got {link_latency}")
    replicas = parse_data_parallel(data_parallel, devices)
    # One replica for certain: d = 1, or K = N (search_devices checks the rest, once d is known).
    one = 1 if replicas == 1 or (stages is not None and stages == devices) else None
    reason = localsgd_problem(gradient_sync, sync_every, one)
    if reason:
        raise BadInput(reason)
    return SolveOptions(
        stages=stages,
        global_batch_size=global_batch_size,
        micro_batches=parse_micro_batches(micro_batches),
        schedule=schedule,
        virtual_stages=parse_virtual_stages(virtual_stages),
        recompute=recompute,
        memory_limit_bytes=None if memory_limit is None else (
            memory_limit if isinstance(memory_limit, int) else parse_size(memory_limit)),
        link_bandwidth_bytes_per_s=None if link_bandwidth is None else (
            float(link_bandwidth) * 1e9 if isinstance(link_bandwidth, (int, float)) else parse_bandwidth(link_bandwidth)),
        link_latency_s=link_latency,
        optimizer=optimizer,
        solver=SOLVER_ALIASES.get(solver, solver),
        time_budget_s=time_budget_s,
        devices=devices,
        data_parallel=replicas,
        nodes=nodes,
        network_bandwidth_bytes_per_s=None if network_bandwidth is None else (
            float(network_bandwidth) * 1e9 if isinstance(network_bandwidth, (int, float))
            else parse_bandwidth(network_bandwidth, "--network-bandwidth")),
        network_latency_s=network_latency,
        gradient_sync=gradient_sync,
        sync_every=sync_every if sync_every is not None else 1,
    )


def solve_file(profile_path: str, plan_path: str | None = None, *, stages: int | None = None,
               progress: bool = False, outputs: Outputs | None = None, **options: Any) -> dict[str, Any]:
    """Plan from a profile file; writes the plan (atomically) when ``plan_path`` is given.

    ``options`` are those of :func:`solve_options` (e.g. ``global_batch_size=32``,
    ``micro_batches="auto"``, ``memory_limit="16GiB"``, ``devices=8``); ``outputs``: the set of
    files the plan is written with (all or none). Returns the plan document.
    """
    started = time.perf_counter()
    profile = load_profile(profile_path)
    opts = device_memory_limit(profile, solve_options(stages, **options))
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
        raise BadInput(f"the best plan for a global batch of {result.global_batch_size} takes {step / 86400:,.0f} days "
                       f"per step: plan a smaller --global-batch-size")
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
    plan = build_plan(profile, profile_path, file_sha256(profile_path), result, one_stage=baseline, devices=devices)
    if plan_path is not None:
        write_artifact(plan_path, plan, "solved plan", outputs, "--out")
    return plan


def solve_command(profile: str, stages: int | None, micro_batches: str, global_batch_size: int | None, schedule: str,
                  recompute: str, memory_limit: str | None, link_bandwidth: str | None, link_latency: float | None,
                  optimizer: str, solver: str, out: str, timeline: str | None, quiet: bool,
                  time_budget: float = SOLVE_TIME_BUDGET_S, virtual_stages: str = "auto", devices: int | None = None,
                  data_parallel: str | None = None, nodes: int = 1, network_bandwidth: str | None = None,
                  network_latency: float = 0.0, gradient_sync: str = "ddp", sync_every: int | None = None) -> None:
    started = time.perf_counter()
    check_output_paths({"--out": out, "--timeline": timeline}, inputs=(profile,))   # both files or neither
    with Outputs() as outputs:   # the plan and its timeline: both or neither
        plan = solve_file(profile, out, stages=stages, progress=not quiet and sys.stderr.isatty(), outputs=outputs,
                          micro_batches=micro_batches, global_batch_size=global_batch_size, schedule=schedule,
                          virtual_stages=virtual_stages, recompute=recompute, memory_limit=memory_limit,
                          link_bandwidth=link_bandwidth, link_latency=link_latency, optimizer=optimizer, solver=solver,
                          time_budget_s=time_budget, devices=devices, data_parallel=data_parallel, nodes=nodes,
                          network_bandwidth=network_bandwidth, network_latency=network_latency,
                          gradient_sync=gradient_sync, sync_every=sync_every)
        if timeline:
            outputs.add(timeline, plan_timeline_svg(plan), "--timeline")
    console = Console()
    if quiet:
        console.print(f"{out}: predicted step {format_seconds(plan['predicted']['step_s'])}, {batch_line(plan)}",
                      highlight=False)
        return
    render_plan(plan, console)
    console.print(f"wrote {out}" + (f" and {timeline}" if timeline else "")
                  + f" in {time.perf_counter() - started:.2f} s", highlight=False)


def show_plan(path: str, timeline: str | None = None) -> None:
    check_output_paths({"--timeline": timeline}, inputs=(path,))
    from ..plan_view import read_plan

    plan = read_plan(path, "solved plan").doc    # gpipe_plan/schema.py: what render_plan reads
    render_plan(plan, Console(), f"plan '{path}'")
    if timeline:
        with Outputs() as outputs:
            outputs.add(timeline, plan_timeline_svg(plan, f"plan '{path}'"), "--timeline")
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


def explore_command(profile: str, stages: str | None, micro_batches: str, global_batch_size: int | None,
                    memory_limit: str | None, schedule: str, recompute: str, link_bandwidth: str | None,
                    optimizer: str, json_out: str | None, chart: str | None, time_budget: float,
                    devices: int | None = None, nodes: int | None = None, network_bandwidth: str | None = None,
                    network_latency: float | None = None, gradient_sync: str | None = None,
                    sync_every: int | None = None) -> None:
    from .explore import explore
    from .explore_view import exploration_chart, exploration_json, render_exploration

    check_output_paths({"--json": json_out, "--chart": chart}, inputs=(profile,))
    if devices is None and (nodes is not None or network_bandwidth is not None or network_latency is not None
                            or gradient_sync is not None or sync_every is not None):
        raise BadInput("--nodes, --network-bandwidth, --network-latency, --gradient-sync and --sync-every describe "
                       "the devices of --devices N: give --devices too")
    reason = localsgd_problem(gradient_sync or "ddp", sync_every, 1 if devices == 1 else None)
    if reason:
        raise BadInput(reason)
    if devices is not None and devices < 1:
        raise BadInput(f"--devices must be at least 1, got {devices}")
    if nodes is not None and (nodes < 1 or devices % nodes):
        raise BadInput(f"--nodes {nodes} must be at least 1 and divide --devices {devices} (each node holds "
                       f"the same number of devices)")
    if network_latency is not None and not (math.isfinite(network_latency) and network_latency >= 0):
        raise BadInput(f"--network-latency must be a finite number of seconds >= 0, got {network_latency}")
    prof = load_profile(profile)
    ks = None if stages is None else _int_list(stages, "--stages")
    ms: list[int] | str = "auto" if micro_batches.strip().lower() == "auto" else _int_list(micro_batches, "--micro-batches")
    # auto: the synchronous five; the asynchronous ones only when listed (they train with stale weights).
    schedules = list(SCHEDULES) if schedule == "auto" else _choices(schedule, PLANNABLE_SCHEDULES, "--schedule")
    recomputes = _choices(recompute, ("never", "always", "auto"), "--recompute")
    limit = parse_size(memory_limit) if memory_limit else prof.usable_memory_bytes   # see device_memory_limit
    bandwidth = parse_bandwidth(link_bandwidth) if link_bandwidth else None
    network = parse_bandwidth(network_bandwidth, "--network-bandwidth") if network_bandwidth else None
    with _progress() as bar:
        task = bar.add_task("exploring", total=None)
        ex = explore(prof, ks, ms, global_batch_size, limit, schedules, recomputes,
                     link_bandwidth_bytes_per_s=bandwidth, optimizer=optimizer, time_budget_s=time_budget,
                     progress=lambda done, total, what: bar.update(task, completed=done, total=total,
                                                                   description=f"exploring {what}"),
                     devices=devices, nodes=nodes, network_bandwidth_bytes_per_s=network,
                     network_latency_s=network_latency, gradient_sync=gradient_sync or "ddp",
                     sync_every=sync_every if sync_every is not None else 1)
    with Outputs() as outputs:   # the table and the chart: both or neither
        if json_out:
            outputs.add(json_out, dumps(exploration_json(ex)), "--json")
        if chart:
            outputs.add(chart, exploration_chart(ex), "--chart")
    console = Console()
    render_exploration(ex, console, limit)
    written = [p for p in (json_out, chart) if p]
    if written:
        console.print("wrote " + " and ".join(written), highlight=False)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{flag} takes a comma-separated list of integers, like 1,2,4,8; got {text!r}") from None
    if not values:
        raise BadInput(f"{flag} needs at least one value")
    return values


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    values = [x.strip().lower() for x in str(text).split(",") if x.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
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
    # The bar pulses while the total is unknown (BarColumn does that for total=None).
    return Progress(TextColumn("{task.description}"), BarColumn(), CountColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True)


__all__ = ["solve_file", "solve_command", "show_plan", "load_profile", "PROFILE_FORMAT"]
