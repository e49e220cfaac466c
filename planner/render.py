"""Show a plan on the terminal (rich) and redraw its timeline, from the plan alone.

What is shown is the plan's :class:`~gpipe_plan.plan_view.PlanView`, the one view every reader
of a plan has (``show`` reads the file through ``read_plan``, ``solve`` sees the plan it has
just made through ``view_of``), so every plan version reads alike here. ``show`` prints one
table of each: what a chunk costs per micro-batch, and what a device holds and how busy it is.
The timeline is the planner's own simulator replaying the plan's schedule over the chunks'
predicted times, so the picture is the prediction.
"""

from __future__ import annotations

from typing import Sequence

from rich.console import Console

from ..artifacts import BadInput, precision_label
from ..plan_view import ChunkPlan, Factorisation, PlanView, Prediction, RunnerUp, StagePlan, Tuning
from ..schedules import label as schedule_label
from ..weight_versions import ASYNC_SCHEDULES
from .simulator import ChunkTimes, Event, Timeline, simulate_plan
from .timeshare import time_shared_makespan
from .timeline import timeline_svg
from ..layer_names import LayerNames
from ..tables import NarrowTable, narrow_table
from ..units import BYTE_UNITS, TIME_UNITS, column_unit, format_bytes, format_figure, format_percent, format_seconds


def check_split_times(view: PlanView) -> None:
    """A schedule that splits the backward needs each chunk's I and W to be drawn or simulated."""
    if not view.split_backward:
        return
    for c in view.chunks:
        for key in ("backward_input_s", "backward_weight_s"):
            if getattr(c, key) is None:
                raise BadInput(f"{view.where}: {view.schedule} runs the backward as I and W, but "
                               f"'chunks[{c.index}].{key}' is missing: solve the profile again")


def chunk_times(chunk: ChunkPlan) -> ChunkTimes:
    """A chunk's predicted times per micro-batch, as the simulator takes them (a schedule
    that runs B never asks for I and W, which such a plan may leave out)."""
    return ChunkTimes(
        forward_s=chunk.forward_s or 0.0,
        backward_s=chunk.backward_s or 0.0,
        backward_input_s=chunk.backward_input_s or 0.0,
        backward_weight_s=chunk.backward_weight_s or 0.0,
        send_s=chunk.send_s or 0.0,
        recompute_s=chunk.recompute_s or 0.0,
    )


# An asynchronous plan's timeline: the middle step of a segment of this many steps (no flush).
STEADY_STATE_STEPS = 3


def plan_timeline(view: PlanView) -> Timeline:
    """Re-simulate the plan's schedule from its per-chunk predictions (no profile needed); a
    plan whose ranks share the host's cores (``options.concurrent_ranks``) on shared cores. An
    asynchronous schedule never flushes, so one step alone is not what it runs: its picture is
    the steady state, the middle step of a :data:`STEADY_STATE_STEPS`-step segment
    (planner/asynchronous.py, ``steady_window``)."""
    check_split_times(view)
    K, M, v = view.num_stages, view.micro_batches, view.virtual_stages
    times = [chunk_times(c) for c in view.chunks]
    if view.schedule in ASYNC_SCHEDULES:
        from .asynchronous import steady_window

        return steady_window(view.schedule, K, M, times, STEADY_STATE_STEPS)
    timeline = simulate_plan(view.schedule, K, M, v, times, [st.optimizer_s or 0.0 for st in view.stages],
                             record=True)
    concurrent = view.options.concurrent_ranks
    if concurrent is None or concurrent <= 0:
        return timeline
    makespan, events = time_shared_makespan(view.schedule, K, M, v, times, concurrent, record=True)
    makespan = max(makespan, timeline.makespan_s)
    events += [Event(e.stage, e.kind, e.micro_batch, makespan, makespan + e.end_s - e.start_s, e.chunk)
               for e in timeline.events if e.kind == "optimizer"]
    return Timeline(makespan_s=makespan, step_s=makespan + timeline.optimizer_tail_s, busy_s=timeline.busy_s,
                    events=events, optimizer_tail_s=timeline.optimizer_tail_s)


def plan_timeline_svg(view: PlanView) -> str:
    """The plan's predicted step as an SVG picture (planner/timeline.py)."""
    pred = view.predicted
    title = (f"{view.model_name}: {view.num_stages} stages, M = {view.micro_batches} x {view.micro_batch_size}, "
             f"{schedule_label(view.schedule, view.virtual_stages)}; predicted step {format_seconds(pred.step_s)}, "
             f"bubble {format_percent(pred.bubble_fraction, 1)}")
    if view.schedule in ASYNC_SCHEDULES:
        title += f" (steady state: step {STEADY_STATE_STEPS // 2 + 1} of a {STEADY_STATE_STEPS}-step segment, no flush)"
    labels = []
    for k in range(view.num_stages):
        held = view.chunks_of(k)
        label = f"stage {k}" + (" (rc)" if any(c.recompute for c in held) else "")
        labels.append(label if len(held) == 1 else f"{label} [{', '.join(str(c.index) for c in held)}]")
    return timeline_svg(plan_timeline(view), title, labels)


def render_plan(view: PlanView, console: Console) -> None:
    """Print the plan: its chunks, its stages, the schedule and what it predicts."""
    options, pred = view.options, view.predicted
    limit = options.memory_limit_bytes
    K, d = view.num_stages, view.data_parallel
    check_split_times(view)
    device = view.profile_device
    console.print(
        f"[bold]{view.model_name}[/bold] on {K} stage{'s' if K > 1 else ''}"
        + (f" x {d} replicas ({K * d} devices)" if d > 1 else "") + f", {batch_line(view)} "
        f"(profile: {device.get('type', '?')}, {device.get('name', '?')}; "
        f"{precision_label(view.precision, view.param_dtype)})")
    note = batch_source_note(view)
    if note:
        console.print(note, highlight=False)
    console.print(chunk_table(view.chunks, split=view.split_backward))
    asynchronous = view.schedule in ASYNC_SCHEDULES
    console.print(stage_table(view.stages, limit, sync=d > 1, versions=asynchronous))
    for line in replica_lines(view):
        console.print(line, highlight=False)
    samples = pred.samples_per_s
    console.print(
        f"micro-batches [bold]{view.micro_batches}[/bold] x {view.micro_batch_size} samples, "
        f"schedule [bold]{schedule_label(view.schedule, view.virtual_stages)}[/bold]"
        + (f" ({view.num_chunks} chunks, {view.num_chunks // K} per stage)" if view.num_chunks > K else "")
        + (f"; memory limit {format_bytes(limit)}" if limit else "")
        + {"device": " (the card's usable memory)", "host": " (this host's memory shared by its ranks)"}.get(
            options.memory_limit_source if limit else None, ""))
    scale = options.compute_scale
    if scale != 1.0:
        console.print(f"layer times x{scale:.3f}: stages computing side by side are slower than the profile's "
                      "one process (its measured 'contention')", highlight=False)
    if options.shared_core_slowdown != 1.0 or options.shared_core_action_s:
        console.print(f"every action x{options.shared_core_slowdown:.3f} + {format_seconds(options.shared_core_action_s)}: "
                      "the ranks share the host's cores, where each runs slower than on a core of its own (the "
                      "profile's measured 'shared_cores')", highlight=False)
    console.print(
        f"predicted step [bold]{format_seconds(pred.step_s)}[/bold], "
        f"bubble {format_percent(pred.bubble_fraction, 1)}, "
        + (f"throughput {samples:,.1f} samples/s" if samples else "throughput not defined (a zero step time)"),
        highlight=False)
    if asynchronous:
        console.print(asynchronous_line(view), highlight=False)
    comparison = one_device_line(pred, K * d, replicated=d > 1)
    if comparison:
        console.print(comparison, highlight=False)
    opt = view.optimality
    if opt is not None and opt.proven:
        searched = opt.settings_searched
        # Optimal among plans of K stages: whether K stages pay at all is the line above.
        rows = view.factorisations
        what = (f"[green]proven optimal[/green] for {K * d} devices over {len(rows)} (stages, replicas) pairs"
                if len(rows) > 1 else f"[green]proven optimal[/green] for {K} stage{'s' if K > 1 else ''}"
                + (f" x {d} replicas" if d > 1 else ""))
        settings = f"{searched} setting{'s' if searched != 1 else ''} of M and schedule"
        console.print(f"{what} and {settings}" if searched and len(rows) > 1 else
                      f"{what} over {settings}" if searched else what,
                      f"({opt.method})", highlight=False)
    elif opt is not None:
        console.print(f"[yellow]not proven optimal[/yellow]: within {opt.gap:.2%} of the lower bound"
                      if opt.gap is not None else "[yellow]not proven optimal[/yellow]")
    if view.tuning is not None:
        console.print(tuning_line(view.tuning), highlight=False)
    if view.runners_up:
        console.print(runners_up_table(view.runners_up, pred.step_s))
    if len(view.factorisations) > 1:
        console.print(factorisation_table(view.factorisations, K, d))
    for w in view.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")


def tuning_line(tuning: Tuning) -> str:
    """What ``gpipe-plan tune`` ran to choose the plan, in one sentence."""
    ran = [c for c in tuning.candidates if c.median_step_s is not None]
    chosen = next(c for c in tuning.candidates if c.chosen)
    own = tuning.candidates[0]
    if not ran or own.median_step_s is None:
        return f"tuned: no other plan predicted within {tuning.within:.0%} of this one; none run"
    each = f"{tuning.rounds} x {tuning.steps} steps each"
    confirming = len(own.measured_step_s) - tuning.rounds
    if confirming > 0:
        each += f", then {confirming} more of solve's plan and the one that had beaten it in each"
    if own.chosen:
        return (f"tuned: solve's plan kept ({format_seconds(own.median_step_s)} a step): none of the {len(ran) - 1} "
                f"other plans predicted within {tuning.within:.0%} ran faster in every round ({each})")
    mine = chosen.median_step_s
    return (f"tuned: this plan ran faster in every round than solve's ({format_seconds(mine)} a step against "
            f"{format_seconds(own.median_step_s)}, {mine / own.median_step_s - 1:+.1%}), of {len(ran)} plans "
            f"predicted within {tuning.within:.0%} ({each})")


def runners_up_table(runners: Sequence[RunnerUp], best_step_s: float | None) -> NarrowTable:
    """The settings of the chosen (K, d) that lost, best first, against the plan's step."""
    fitting = [r for r in runners if r.fits]
    unit, size = column_unit((r.step_s for r in fitting), TIME_UNITS)
    memory_unit, memory_size = column_unit((r.peak_memory_bytes for r in fitting), BYTE_UNITS)
    table = narrow_table("runners-up", ("M", "size", "schedule", f"step {unit}", "vs best", "bubble",
                                        f"peak {memory_unit}", "balance"),
                         left=("schedule", "balance"))
    for r in runners:
        schedule = schedule_label(r.schedule, r.virtual_stages)
        if not r.fits:
            table.add_row(str(r.micro_batches), str(r.micro_batch_size), schedule,
                          "[red]does not fit[/red]", "", "", "", "")
            continue
        versus = format_percent(r.step_s / best_step_s - 1, 1, sign=True) \
            if best_step_s and best_step_s > 0 and r.step_s is not None else "-"
        table.add_row(str(r.micro_batches), str(r.micro_batch_size), schedule,
                      format_figure(r.step_s, size), versus, format_percent(r.bubble_fraction, 1),
                      format_figure(r.peak_memory_bytes, memory_size), balance_text(r.balance))
    return table


# The runners-up's balance column at most this wide, so that a row of many chunks stays on one
# line at 80 columns; the plan file has the whole list.
BALANCE_CHARS = 17


def balance_text(balance: Sequence[int], width: int = BALANCE_CHARS) -> str:
    """Layers per chunk, ``5 6``; cut at a number with `` …`` beyond ``width`` characters."""
    text = " ".join(map(str, balance))
    if len(text) <= width:
        return text
    return text[:text.rfind(" ", 0, width - 1)] + " …"


def replica_lines(view: PlanView) -> list[str]:
    """With replicas or several nodes: the placement and its reason, and what the syncs cost."""
    d = view.data_parallel
    lines = []
    if d > 1 or view.nodes > 1:
        if view.placement_reason:
            lines.append(f"placement: {view.placement_reason}")
        exposed = view.predicted.gradient_sync_s
        syncs = [st.gradient_sync_s or 0.0 for st in view.stages]
        if d > 1 and view.gradient_sync == "localsgd":
            H = view.sync_every
            lines.append(f"gradient sync (localsgd) over {d} replicas: no gradient all-reduce; the parameters "
                         f"averaged every {H} step{'s' if H != 1 else ''}, charged 1/{H} of it per step: up to "
                         f"{format_seconds(max(syncs), 3)} per stage"
                         + (f"; adds {format_seconds(exposed, 3)} to the step (the rest hides in the next "
                            "step's fill)" if exposed is not None else ""))
        elif d > 1:
            lines.append(f"gradient sync ({view.gradient_sync}) over {d} replicas: up to "
                         f"{format_seconds(max(syncs), 3)} per stage, after its last backward"
                         + (f"; adds {format_seconds(exposed, 3)} to the step (the rest hides in the next "
                            "step's fill)" if exposed is not None else ""))
    return lines


def factorisation_table(rows: Sequence[Factorisation], stages: int, replicas: int) -> NarrowTable:
    """Every (K, d) searched, best first: the chosen one marked, why the others lost or cannot run."""
    unit, size = column_unit((r.step_s for r in rows if r.fits), TIME_UNITS)
    table = narrow_table("stages x replicas", ("K", "d", "order", f"step {unit}", "samples/s", "", "why not"),
                         left=("order", "", "why not"), wrap=("why not",))
    for r in rows:
        chosen = r.stages == stages and r.data_parallel == replicas
        step = format_figure(r.step_s, size) if r.fits and r.step_s is not None else "-"
        rate = f"{r.samples_per_s:,.1f}" if r.samples_per_s else "-"
        table.add_row(str(r.stages), str(r.data_parallel), r.order or "-", step, rate,
                      "[green]chosen[/green]" if chosen else "", r.reason or "")
    return table


def chunk_table(chunks: Sequence[ChunkPlan], split: bool) -> NarrowTable:
    """Per chunk: where it runs, its layers, and what one micro-batch costs on it.

    ``split``: the schedule runs the backward as I (input gradient) and W (weight gradient),
    which are shown apart; else as one B. The times are in one unit, the largest's.
    """
    kinds = ("backward_input_s", "backward_weight_s") if split else ("backward_s",)
    unit, size = column_unit((getattr(c, key) for c in chunks for key in ("forward_s", "send_s", *kinds)), TIME_UNITS)
    backward = ("I", "W") if split else ("backward",)
    halves = "I: input gradient, W: weight gradient; " if split else ""
    table = narrow_table(f"per chunk and micro-batch, in {unit} ({halves}rc: recomputes)",
                         ("chunk", "stage", "layers", "#", "forward", *backward, "rc", "send"), left=("layers", "rc"))
    naming = LayerNames(name for c in chunks for name in c.layers)
    for c in chunks:
        table.add_row(
            str(c.index), str(c.stage), naming.span(list(c.layers), count=False), str(len(c.layers)),
            format_figure(c.forward_s, size), *(format_figure(getattr(c, key), size) for key in kinds),
            "rc" if c.recompute else "-",
            format_figure(c.send_s, size) if c.send_s else "-",
        )
    table.note = naming.note()
    return table


def asynchronous_line(view: PlanView) -> str:
    """What an asynchronous plan's step means: M steady-state periods, the one-time fill and
    drain beside it, and how often each stage updates."""
    period, fill = view.predicted.steady_state_period_s, view.predicted.fill_drain_s
    updates = view.updates_per_step
    return (f"no flush: the step is {view.micro_batches} steady-state periods"
            + (f" of {format_seconds(period)}" if period is not None else "")
            + (f", plus {format_seconds(fill)} of fill and drain once per run (and per checkpoint)" if fill is not None
               else "")
            + f"; every stage updates {updates} time{'s' if updates != 1 else ''} a step, each gradient computed "
            "on weights some updates older than those it is applied to (the stage table's 'stale')")


def stage_table(stages: Sequence[StagePlan], limit: float | None, sync: bool = False,
                versions: bool = False) -> NarrowTable:
    """Per stage (device): the chunks it holds, its peak memory (against the limit), the
    micro-batches whose activations it holds at once, and how busy it is in a step;
    ``sync``: also its gradient sync over the replicas (per rank, each replica alike);
    ``versions``: its gradients' staleness in updates and the weight versions it stashes (an
    asynchronous schedule's)."""
    memory_unit, memory_size = column_unit((st.memory_bytes for st in stages), BYTE_UNITS)
    time_unit, time_size = column_unit((value for st in stages for value in (st.busy_s, st.gradient_sync_s)),
                                       TIME_UNITS)
    columns = ("stage", "chunks", f"memory {memory_unit}", "in flight", f"busy {time_unit}", "idle")
    table = narrow_table(None, columns + ((f"sync {time_unit}",) if sync else ())
                         + (("stale", "versions") if versions else ()), left=("chunks",))
    for st in stages:
        mem = format_figure(st.memory_bytes, memory_size)
        if limit and st.memory_bytes is not None:
            share = st.memory_bytes / limit
            colour = "red" if share > 1 else ("yellow" if share > 0.9 else "green")
            mem = f"[{colour}]{mem} ({share:.0%})[/{colour}]"
        held = ", ".join(str(c) for c in st.chunks)
        table.add_row(str(st.index), held, mem, "-" if st.in_flight is None else str(st.in_flight),
                      format_figure(st.busy_s, time_size), format_percent(st.idle_fraction or 0.0, 1),
                      *((format_figure(st.gradient_sync_s or 0.0, time_size),) if sync else ()),
                      *((str(st.staleness_updates), str(st.weight_versions)) if versions else ()))
    return table


def batch_line(view: PlanView) -> str:
    """``global batch 32 = 8 micro-batches of 4``: the batch a plan is for, and how it is split.

    Said first, because every figure of the plan holds for that batch only.
    """
    M, size, batch = view.micro_batches, view.micro_batch_size, view.global_batch_size
    d = view.data_parallel
    replicas = f"{d} replicas x " if d > 1 else ""
    return f"global batch {batch} = {replicas}{M} micro-batch{'es' if M != 1 else ''} of {size}"


def batch_source_note(view: PlanView) -> str | None:
    """A warning when the global batch is a stand-in: an older profile that records none."""
    if view.options.global_batch_size_source != "largest micro-batch":
        return None
    return (f"[yellow]note:[/yellow] global batch {view.global_batch_size} is the profile's largest micro-batch "
            "(the profile records no global batch): give --global-batch-size for the batch you train with")


# A pipeline within this share of one device's step is "as fast", even where the plan gives no
# noise band: two predictions closer than 1% are the same figure for any decision.
AS_FAST = 0.01


def one_device_line(pred: Prediction, devices: int, replicated: bool = False) -> str | None:
    """The plan against the best one-device plan of the same batch, in one line (None: K = 1 or unknown).

    A pipeline pays a bubble, sends and, on one host, neighbours for its speed; whether that
    pays is a comparison with one device, which the plan records (plan version 4). The line
    says which is faster and by how much; a pipeline ahead by no more than the prediction's
    own noise (``predicted.noise_fraction``) does not pay either, and the line says the gap is
    within that noise. ``devices``: the plan's (stages x replicas); ``replicated``: it has replicas.
    """
    if devices == 1 or not pred.one_stage_compared:
        return None
    step, mine = pred.one_stage_step_s, pred.step_s
    one_memory = format_bytes(pred.one_stage_peak_memory_bytes)
    memory = (f"{format_bytes(pred.peak_memory_bytes)} per device on "
              f"{devices} {'devices' if replicated else 'stages'}")
    if not pred.one_stage_fits or step is None:
        return (f"one device does not fit: it needs {one_memory} ({memory}); "
                f"pipelining is what makes this plan possible")
    speedup = pred.speedup_over_one_stage or 0.0
    band = pred.noise_fraction
    noise = max(band or 0.0, AS_FAST)
    times = f"{format_seconds(step)} vs {format_seconds(mine)}"
    memories = f"memory {one_memory} on one device, {memory}"
    if speedup <= 1.0 + noise:
        # Which is ahead, by what share of the step, and whether that gap is within the noise.
        within = f", within the prediction's noise of ±{format_percent(band)}" if band and abs(speedup - 1) <= band else ""
        if speedup < 1.0 - AS_FAST:
            return (f"[yellow]one device is faster[/yellow]: {format_percent(1 - speedup)} less time per step "
                    f"({times}{within}); pipelining does not pay here ({memories})")
        if speedup > 1.0 + AS_FAST:
            return (f"[yellow]the pipeline is faster[/yellow]: {format_percent(1 - 1 / speedup)} less time per step "
                    f"({format_seconds(mine)} vs {format_seconds(step)} on one device{within}); pipelining may not "
                    f"pay here ({memories})")
        return f"[yellow]one device is as fast[/yellow] ({times}); pipelining does not pay here ({memories})"
    return f"{speedup:.2f}x faster than one device ({format_seconds(mine)} vs {format_seconds(step)}; {memories})"
