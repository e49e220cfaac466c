"""One rank's training run, top to bottom.

Every rank runs :func:`train`; rank k runs stage k, which holds one chunk of layers or
several (``interleaved``, ``zb-v``); with ``data_parallel`` = d replicas of the pipeline, rank
``placement.ranks[k][r]`` runs stage k of replica r, on its 1/d of each step's batch, and the
d replicas of each stage average their gradients once a step, or their weights every H steps
under localsgd (:mod:`.gradient_sync`). It reads
like a single-process training script because it nearly is one, in three parts:
:func:`_set_up` (build the model, keep our stage's chunks, one optimizer over all of them,
resume), :func:`_run_steps` (for each step, :func:`_one_step`:
draw the batch, run our stage's actions of the pipeline schedule, learn the loss, step the
optimizer), and :func:`_write_outputs`. Everything pipeline-specific hides in the executor
(:mod:`.executor`), which runs the schedule's action list (``gpipe_plan.schedules``). Under
the asynchronous schedules (``pipedream``, ``pipedream-2bw``) the executor
(:mod:`.async_executor`) runs segments of steps without a flush and calls the loop's
:func:`_apply_update` when ``gpipe_plan.weight_versions``' rules say; a segment drains before
each checkpoint and at the end.
"""

from __future__ import annotations

import gc
import io
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from ..artifacts import BadInput, Outputs, RunFailure, dumps, precision_label
from ..cudamemory import outside_allocator_bytes
from ..models import LayeredModel, Precision, build_model, built_whole, is_language_model
from ..schema import write_artifact
from ..weight_versions import ASYNC_SCHEDULES
from .. import hostload
from ..speedprobe import profile_probe_s, speed_probe, speed_ratio
from . import checkpoint, faults, watchdog
from .checkpoint_dir import TRAINING_OPTIONS, lock_identity, new_run
from .conditions import condition_warnings, cpu_cores, threads_per_rank
from .data import BatchSource, batch_source
from .distributed import Replicas, World, check_world, choose_device, init, replicas_of
from .async_executor import AsyncExecutor
from .executor import Executor, NativeExecutor
from .gradient_sync import GradientSync, broadcast_from_replica_zero, make_gradient_sync
from .init_from import load_initial_weights
from .tied import TiedGradients, find_ties
from .objects import gather_objects
from .loss_exchange import LossExchange
from .loss_scale import LossScaler
from .memory import ActivationMeter, cuda_memory, peak_rss_bytes, static_bytes
from .optim import clip_gradients, learning_rate, make_optimizer, set_learning_rate
from .options import RunOptions, async_problem, is_data_factory
from .p2p import Neighbours
from ..plan_view import PlanView
from .plan import check_precision_matches, check_sync_matches, load_plan
from .progress import TrainingProgress
from .report import RankResult, build_report, print_summary
from .stage import StageChunks, build_stage_chunks, check_layer_params
from .timing import SpanRecorder
from .trace import chrome_trace


# Beyond this factor either way, the machine is not the one the profile measured.
SPEED_TOLERANCE = 1.15


@dataclass(kw_only=True)   # some thirty fields, several of one type: built by name, never by position
class _Training:
    """What one rank holds for its run: set up by :func:`_set_up`, used by the steps and the outputs."""

    options: RunOptions
    world: World
    plan: PlanView
    precision: Precision
    threads: int
    device: torch.device
    context_bytes: int | None
    executor_name: str
    objects: Any               # the process group for Python objects (gloo, also on CUDA)
    joined_here: bool          # this run joined the ranks (and leaves them at the end)
    reporter: bool             # rank 0 prints, gathers and writes the outputs
    warnings: list[str]
    probes: list[tuple[float, float]]   # speed probe (median, spread) before the steps (and after, once done)
    model: LayeredModel
    stage: StageChunks         # this rank's chunks
    replicas: Replicas         # this rank's stage and replica, its pipeline and sync groups
    gradient_sync: GradientSync   # averages the stage's gradients over its replicas
    scaler: LossScaler
    data: BatchSource
    tokens_per_sample: int | None
    optimizer_name: str
    optimizer: torch.optim.Optimizer
    base_lr: float
    recorder: SpanRecorder
    executor: Executor
    needs_norm: bool
    loss_exchange: LossExchange
    tied: TiedGradients
    identity: dict[str, Any]
    folder: Path | None        # --checkpoint-dir
    start: int                 # the first step to run (after a resume, the checkpoint's)
    run_record: dict[str, Any]  # the run its checkpoints belong to (checkpoint_dir.new_run, or the resumed one's)
    adopted: bool              # resumed from a step that named no run: such steps are this run's to prune
    lock: tuple[int, int] | None = None   # the folder's lock as this run took it (checkpoint_dir.lock_identity)
    start_notes: list[str] = field(default_factory=list)   # printed before the first step (rank 0)

    @property
    def async_executor(self) -> AsyncExecutor | None:
        """Under ``pipedream`` or ``pipedream-2bw`` the executor, which runs segments without a
        flush and applies the updates itself (.async_executor); None under the synchronous schedules."""
        return self.executor if isinstance(self.executor, AsyncExecutor) else None


@dataclass
class _History:
    """Per step: the loss, the step's time, the process's CPU time; the memory at the end."""

    losses: dict[int, float] = field(default_factory=dict)
    step_s: dict[int, float] = field(default_factory=dict)
    cpu_s: dict[int, float] = field(default_factory=dict)   # all the process's threads
    memory: dict[str, Any] = field(default_factory=dict)
    host: tuple[hostload.CpuSample, hostload.CpuSample] | None = None   # the host before the first step, after the last


def train(options: RunOptions, world: World) -> None:
    """Set up this rank's chunks, run the steps, write the outputs (rank 0), leave the group."""
    run = _set_up(options, world)
    history = _run_steps(run)
    _write_outputs(run, history)


def _set_up(options: RunOptions, world: World) -> _Training:
    # ------------------------------------------------------------------ where we stand
    plan = load_plan(options.plan)
    check_sync_matches(plan, options.grad_clip)
    placement_warnings = check_world(world, plan)
    precision = Precision(*check_precision_matches(plan, options.precision, options.param_dtype))
    threads = threads_per_rank(options.threads, plan, world.local_world_size)
    torch.set_num_threads(threads)
    device = choose_device(options.device, plan, world.local_rank)
    # On CUDA: what the context takes before we allocate or start NCCL (the report's baseline).
    context_bytes = outside_allocator_bytes(device) if device.type == "cuda" else None
    executor_name = _executor_name(options.executor, device, plan.schedule)
    reason = async_problem(options, plan.schedule, precision.compute, plan.gradient_sync,
                           any(chunk.recompute for chunk in plan.chunks))
    if reason:
        raise BadInput(reason)
    # Join the ranks, unless the caller already did (tests run several trainings in one group).
    joined_here = not dist.is_initialized()
    objects = init(world, device, options.timeout) if joined_here else _objects_group(device)
    reporter = world.rank == 0
    err = Console(stderr=True)
    warnings = placement_warnings + condition_warnings(plan, threads, world.local_world_size, device.type)
    if reporter:
        for line in warnings:  # shown even with --quiet: they say the prediction will not hold
            err.print(f"[yellow]warning:[/] {line}", highlight=False)

    # How fast this machine is now, against the profile's moment (gpipe_plan.speedprobe): each
    # rank in turn, alone like the profile's probe, so that the ratio is the machine's drift and
    # not the ranks slowing each other (that belongs to the run, and calibration keeps it).
    probes = [_probe_in_turn(world, device, objects)]
    profile_probe = profile_probe_s(plan.profile_device)
    ratio = speed_ratio(probes[0][0], profile_probe)
    if reporter and ratio and not 1 / SPEED_TOLERANCE <= ratio <= SPEED_TOLERANCE:
        err.print(f"[yellow]warning:[/] this machine runs {abs(ratio - 1):.0%} {'slower' if ratio > 1 else 'faster'} "
                  f"than when the profile was measured (a fixed reference workload takes {probes[0][0] * 1e3:.1f} ms "
                  f"now, {profile_probe * 1e3:.1f} ms then): expect the prediction to be off by about that much, "
                  f"or re-profile here; the end of the run also compares with the prediction at this speed where "
                  f"the probe held steady", highlight=False)

    # ------------------------------------------------------------------ model, data, optimizer
    # Every rank builds the model on the meta device (no memory for its parameters) and makes
    # only its own chunks' layers real, each from the seed and the layer's place in the model
    # (models/materialize.py): the unsplit model's initial values, no weights sent, a rank's
    # memory its stage's share. Parameters are kept in the plan's dtype; forwards and the loss
    # run in the plan's precision (models.precision).
    factory = plan.model.get("factory") if plan.model.get("source") == "import" else None
    watchdog.phase("building the model" + (f" (calling the plan's model factory '{factory}')" if factory else ""))
    model = build_model(plan.model, seed=options.seed, materialize=())
    precision.cast(model)
    check_layer_params(model, plan)
    whole = built_whole(model)
    if reporter and whole:
        err.print(f"[yellow]note:[/] every rank builds the whole model before keeping its stage ({whole})",
                  highlight=False)
    ties = find_ties(model, plan)  # a parameter several stages use: one copy each (runtime.tied)
    if ties and plan.schedule in ASYNC_SCHEDULES:
        raise BadInput(f"{plan.schedule} does not define weights tied across stages (each stage's copy would be "
                       f"updated at its own version; here {ties[0].key!r}): cut so that the tied layers share a "
                       f"stage, or solve for a synchronous schedule such as 1f1b")
    # Which stage of which replica this rank runs; with d > 1 the device mesh and its groups
    # (collective: every rank builds every group).
    replicas = replicas_of(plan, world.rank, device)
    # A parameter two chunks of this stage use is one object here: one .grad, one optimizer entry.
    stage = build_stage_chunks(model, plan, replicas.stage, precision, device.type)
    stage.module.to(device)
    if plan.data_parallel > 1:   # the replicas start equal, whatever the model's initialisation drew from
        broadcast_from_replica_zero(stage, replicas.dp_group, replicas.dp_ranks[0])
    # --resume looks for its checkpoint before any weights are read: an existing one wins over --init-from.
    folder = Path(options.checkpoint_dir) if options.checkpoint_dir else None
    resume_step = checkpoint.newest_complete_step(folder, objects) if options.resume and folder is not None else None
    if options.init_from and resume_step is None:
        load_initial_weights(options.init_from, stage, model.module)
    loss_fn = precision.with_autocast(model.loss, device.type)
    scaler = LossScaler(enabled=precision.loss_scaling)
    data_factory = options.data if options.data and is_data_factory(options.data) else plan.model.get("data")
    watchdog.phase("making its data source" + (f" (calling the data factory '{data_factory}')" if data_factory else ""))
    data = batch_source(model, options.data, plan.global_batch_size, options.seed)
    watchdog.phase("setting up")
    optimizer_name = options.optimizer_name(plan.optimizer)
    recorder = SpanRecorder(stage.index, device)
    # Before the optimizer is made: fsdp shards the parameters (they become other objects).
    gradient_sync = make_gradient_sync(plan.gradient_sync, plan.data_parallel, replicas.dp_group, replicas.dp_mesh(),
                                       replicas.replica, plan.sync_every)
    places = _parameter_places(stage)   # fsdp replaces the Parameter objects: find them again by name
    gradient_sync.prepare(stage)
    optimizer = make_optimizer(stage.parameters(), optimizer_name, options)
    # The tests' fault injection (GPIPE_PLAN_FAULT), if set and for this rank: it hooks the
    # stage's first chunk and wraps the loss here, once; unset, nothing is installed.
    first_chunk = min(stage.chunks, key=lambda chunk: chunk.index).module
    loss_fn = faults.install_from_env(world.rank, first_chunk, loss_fn, lambda: recorder.step)
    executor = _make_executor(executor_name, stage, plan, loss_fn, device, recorder, options, world, replicas)
    # The global gradient norm is needed to clip by it, and under fp16 to see an overflow.
    needs_norm = options.grad_clip is not None or scaler.enabled
    loss_exchange = LossExchange(world.rank, world.world_size, device, clip=needs_norm, timeout_s=options.timeout,
                                 loss_ranks=tuple(plan.stage_ranks(plan.chunks[-1].stage)))
    tied = TiedGradients(ties, stage.index, {old: stage.chunks[c].module.get_parameter(name)
                                             for old, (c, name) in places.items()},
                         pipelines=[plan.replica_ranks(r) for r in range(plan.data_parallel)], replica=replicas.replica)

    # ------------------------------------------------------------------ resume
    # A checkpoint holds tensors under the unsplit model's keys: this run's stage loads its own,
    # whatever plan saved them (runtime/checkpoint.py). The identity must match; the split may not.
    identity = _identity(plan, options, precision, optimizer_name)
    start = 0
    resumed: dict[str, Any] | None = None
    # The run the checkpoints belong to: this one, or the one it continues (runtime/checkpoint_dir.py).
    run_record, adopted = new_run(plan.sha256, options), False
    if resume_step is not None:
        assert folder is not None
        resumed = checkpoint.load(folder, resume_step, stage, optimizer, identity, options.seed, scaler, device,
                                  objects, layout=(plan.num_stages, plan.data_parallel),
                                  prefix=gradient_sync.checkpoint_prefix())
        start = resume_step
        run_record, adopted = (resumed["run"], False) if isinstance(resumed.get("run"), dict) else (run_record, True)
    if start >= options.steps:
        raise BadInput(f"the checkpoint in '{folder}' is at step {start}: --steps {options.steps} leaves nothing to do")
    gradient_sync.start_at(start)   # localsgd counts its averaging period from the steps done
    run = _Training(options=options, world=world, plan=plan, precision=precision, threads=threads, device=device,
                    context_bytes=context_bytes, executor_name=executor_name, objects=objects,
                    joined_here=joined_here, reporter=reporter, warnings=warnings, probes=probes, model=model,
                    stage=stage, replicas=replicas, gradient_sync=gradient_sync, scaler=scaler, data=data,
                    tokens_per_sample=_tokens_per_sample(model), optimizer_name=optimizer_name, optimizer=optimizer,
                    base_lr=options.learning_rate(optimizer_name), recorder=recorder, executor=executor,
                    needs_norm=needs_norm, loss_exchange=loss_exchange, tied=tied, identity=identity, folder=folder,
                    start=start, run_record=run_record, adopted=adopted,
                    lock=lock_identity(folder) if folder is not None else None)
    run.start_notes = _start_notes(run, resumed)
    if isinstance(executor, AsyncExecutor):   # the loop's own data and update, called when the rules say
        executor.batch_of = lambda step: _read_batch(run, step)
        executor.apply_update = lambda: _apply_update(run)
    return run


def _start_notes(run: _Training, resumed: dict[str, Any] | None) -> list[str]:
    """What the progress shows before the first step: the banner, and where training starts from."""
    options = run.options
    notes = [_banner(run.plan, options, run.optimizer_name, run.base_lr, run.threads, run.device, run.executor_name,
                     run.data.samples_text(), run.start)]
    if options.resume and run.start == 0:
        notes.append(f"no complete checkpoint in '{run.folder}' yet: starting from step 0")
    if resumed is not None:
        note = _resume_note(resumed, run.plan, run.world, asdict(options))
        if options.init_from:
            note = "; ".join(filter(None, [note, "--init-from ignored: the checkpoint wins"]))
        if note:
            notes.append(note)
    elif options.init_from:
        notes.append(f"initial weights from '{options.init_from}'")
    return notes


def _run_steps(run: _Training) -> _History:
    """Steps ``start`` to ``--steps``: the loop of a training script, with checkpoints."""
    options, stage, recorder = run.options, run.stage, run.recorder
    progress = TrainingProgress(options.steps, run.start, run.plan.global_batch_size, run.tokens_per_sample,
                                options.log_every, enabled=run.reporter and not options.quiet)
    if run.reporter:
        for note in run.start_notes:
            progress.note(note)
    meter = ActivationMeter.for_module(stage.module, run.device)
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    history = _History()
    # torch's import leaves a very large object graph; freezing it keeps Python's cyclic
    # garbage collector from walking all of it again and again during the steps.
    gc.collect()
    gc.freeze()
    dist.barrier(group=run.objects)
    recorder.start_clock()  # all ranks leave the barrier together: a common time origin
    before = hostload.sample()   # what the host's other processes use over the steps (gpipe_plan.hostload)
    watchdog.phase("training")
    try:
        # From here on a rank that makes no progress for --timeout stops the run (runtime/watchdog.py).
        with watchdog.watching(run.world.rank, options.timeout):
            for step in range(run.start, options.steps):
                recorder.step = step
                watchdog.at_step(step + 1)
                t0, c0 = recorder.now(), time.process_time()
                pipeline = run.async_executor
                if pipeline is not None and pipeline.segment is None:   # a segment starts: the steps to its drain
                    pipeline.begin_segment(step, _segment_end(run, step) - step)
                loss = _one_step(run, step, meter if step == run.start else None)
                t1 = recorder.now()
                recorder.end_step()
                history.step_s[step] = t1 - t0
                history.cpu_s[step] = time.process_time() - c0
                history.losses[step] = loss
                progress.update(step, loss, t1 - t0)

                if run.folder is not None and _saves_after(run, step):
                    # All ranks save together; when save returns, step+1 is complete and older ones may go.
                    checkpoint.save(run.folder, step + 1, stage, run.optimizer, run.identity,
                                    _saved_by(run.plan, run.world), run.scaler, run.device, run.objects,
                                    run=run.run_record, prefix=run.gradient_sync.checkpoint_prefix(), lock=run.lock)
                    if run.reporter:   # this run's own older steps only
                        checkpoint.prune(run.folder, options.checkpoints_kept, run.run_record["id"], run.adopted)
                # After the optimizer step and the step's checkpoint (which reads the sharded state):
                # fsdp starts gathering the next step's parameters. Not after the last step.
                if step + 1 < options.steps:
                    run.gradient_sync.after_optimizer()
            run.loss_exchange.close()
            history.host = (before, hostload.sample())
            # After the last step: the optimizer's state exists (the first step creates it) and
            # CUDA's peak is over every step, not only the first.
            history.memory = _memory(stage, run.optimizer, meter if run.executor.meters_activations else None,
                                     run.device, run.context_bytes, sharded=run.gradient_sync.mode == "fsdp")
    finally:
        progress.close()
    return history


def _saves_after(run: _Training, step: int) -> bool:
    """Whether a checkpoint is saved after ``step`` (with --checkpoint-dir): every
    --checkpoint-every steps, and after the last."""
    return (step + 1) % run.options.steps_between_checkpoints == 0 or step + 1 == run.options.steps


def _segment_end(run: _Training, step: int) -> int:
    """Where the asynchronous segment starting at ``step`` drains: the step after the next
    checkpoint (a checkpoint holds only the newest weights), or the run's end."""
    end = step + 1
    while end < run.options.steps and not (run.folder is not None and _saves_after(run, end - 1)):
        end += 1
    return end


def _read_batch(run: _Training, step: int) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
    """Step ``step``'s inputs (on the stage holding chunk 0) and targets (on the one holding the
    last chunk), this replica's rows, on the device; None where the stage needs them not."""
    # The whole batch is a function of (seed, step); the stage holding chunk 0 needs its
    # inputs, the one holding the last chunk its targets (under zb-v both are stage 0), the
    # others neither. Replica r takes its rows of it (:func:`replica_rows`).
    stage, recorder = run.stage, run.recorder
    if not (stage.holds_first or stage.holds_last):
        return None, None
    watchdog.doing(f"reading the step's batch ({run.data.samples_text()})")
    t_data = recorder.mark()
    batch_inputs, batch_targets = replica_rows(run.data.batch(step), run.replicas.replica, run.plan.data_parallel)
    inputs = tuple(x.to(run.device) for x in batch_inputs) if stage.holds_first else None
    targets = batch_targets.to(run.device) if stage.holds_last else None
    recorder.add("data", -1, t_data, recorder.mark())
    return inputs, targets


def _apply_update(run: _Training) -> None:
    """An asynchronous stage's update, when weight_versions' rules say: the gradient in ``.grad``
    averaged over the stage's replicas (ddp), then the optimizer step on the newest weights."""
    recorder = run.recorder
    if run.plan.data_parallel > 1:
        watchdog.doing("averaging an update's gradients with the stage's other replicas", waiting=True)
        t_grad = recorder.mark()
        run.gradient_sync.finish()
        recorder.add("gradient_sync", -1, t_grad, recorder.mark())
    watchdog.doing("stepping the optimizer")
    t_opt = recorder.mark()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    recorder.add("optimizer", -1, t_opt, recorder.mark())


def _one_step(run: _Training, step: int, meter: ActivationMeter | None) -> float:
    """One training step of this rank; returns the step's loss (every rank learns it)."""
    options, stage, recorder, plan = run.options, run.stage, run.recorder, run.plan
    lr = learning_rate(step, run.base_lr, options)
    set_learning_rate(run.optimizer, lr)   # asynchronous: every update this step applies is the step's
    run.loss_exchange.begin_step()
    pipeline = run.async_executor
    if pipeline is not None:
        # The segment's actions through this stage's last backward of the step, its updates
        # included (.async_executor); then only the step's loss is left to learn.
        micro_losses = pipeline.step(None, None, meter, step=step)
        local_loss = float(sum(float(v) for v in micro_losses) / plan.micro_batches) if stage.holds_last else 0.0
        watchdog.doing("learning the step's loss from the other ranks", waiting=True)
        t_sync = recorder.mark()
        loss, _ = run.loss_exchange.finish_step(local_loss, 0.0)
        recorder.add("sync", -1, t_sync, recorder.mark())
        if not math.isfinite(loss):
            raise RunFailure(f"the loss is {loss} at step {step + 1}: training diverged; lower --lr (it is {lr:g})")
        return loss
    inputs, targets = _read_batch(run, step)

    # fsdp: the step's parameters whole before the first action (timed as the step's sync).
    if plan.data_parallel > 1:
        watchdog.doing("gathering the stage's parameters from its replicas", waiting=True)
        t_gather = recorder.mark()
        run.gradient_sync.gather()
        recorder.add("gradient_sync", -1, t_gather, recorder.mark())

    # Our share of the pipeline: our actions on our chunks for the M micro-batches.
    scale = run.executor.loss_scale = run.scaler.scale
    micro_losses = run.executor.step(inputs, targets, meter)
    # The stage's last action is done: average its gradients over the replicas.
    if plan.data_parallel > 1:
        watchdog.doing("averaging the gradients with the stage's other replicas", waiting=True)
        t_grad = recorder.mark()
        run.gradient_sync.finish()
        recorder.add("gradient_sync", -1, t_grad, recorder.mark())
    # Then sum tied copies inside the replica: sums and averages commute, and under fsdp each
    # copy's gradient is now its shard, sharded alike on every stage that holds one.
    if run.tied.mine:
        watchdog.doing("summing the tied weights' gradients with the other stages holding them", waiting=True)
        t_tied = recorder.mark()
        run.tied.all_reduce()
        recorder.add("tied", -1, t_tied, recorder.mark())

    # Every rank learns the loss (the stage holding the last chunk has it) and, for clipping or fp16, the global
    # gradient norm; so every rank stops here, together, when the loss is NaN.
    local_loss = float(sum(float(v) for v in micro_losses) / plan.micro_batches) if stage.holds_last else 0.0
    watchdog.doing("learning the step's loss from the other ranks", waiting=True)
    t_sync = recorder.mark()
    loss, grad_norm = run.loss_exchange.finish_step(local_loss, run.gradient_sync.squared_norm_share(
        run.tied.counted(stage.parameters())) if run.needs_norm else 0.0)
    recorder.add("sync", -1, t_sync, recorder.mark())
    if not math.isfinite(loss):
        raise RunFailure(f"the loss is {loss} at step {step + 1}: training diverged; lower --lr "
                         f"(it is {lr:g}) or set --grad-clip")
    # fp16: an overflow anywhere skips this step on every stage (the norm is global).
    take_step = run.scaler.update(grad_norm)
    if take_step:
        run.scaler.unscale_(stage.parameters(), scale)
        if options.grad_clip:
            clip_gradients(stage.parameters(), grad_norm / scale, options.grad_clip)

    watchdog.doing("stepping the optimizer")
    t_opt = recorder.mark()
    if take_step:
        run.optimizer.step()
    recorder.add("optimizer", -1, t_opt, recorder.mark())
    # localsgd: after every H-th step the replicas' parameters are averaged, here, before the
    # gradients are cleared (torch averages the parameters holding one) and before the step's
    # checkpoint (which then holds the weights the next step starts from).
    if plan.data_parallel > 1:
        watchdog.doing("averaging the parameters with the stage's other replicas", waiting=True)
        t_average = recorder.mark()
        if run.gradient_sync.after_update():
            recorder.add("gradient_sync", -1, t_average, recorder.mark())
    run.optimizer.zero_grad(set_to_none=True)
    return loss


def _write_outputs(run: _Training, history: _History) -> None:
    """Gather every rank's figures on rank 0, which writes the model, report and trace; leave."""
    options, world, plan = run.options, run.world, run.plan
    watchdog.phase("gathering and writing the outputs")
    run.probes.append(_probe_in_turn(world, run.device, run.objects))
    result = RankResult(world.rank, run.recorder.spans, history.step_s, history.memory, history.cpu_s,
                        speed_probe_s=[median for median, _ in run.probes],
                        speed_probe_spread=[spread for _, spread in run.probes], host=history.host,
                        stage=run.replicas.stage, replica=run.replicas.replica)
    results = _gather(result, world, run.objects)
    # Every replica of a stage holds the same tensors after the step: replica 0's go into the
    # file, copied to the CPU here, once. (fsdp: gathering them whole is collective over the
    # stage's replicas, so all call it; localsgd: so is the mean of the replicas' parameters,
    # which the file holds.)
    whole = run.gradient_sync.full_state_dict(run.stage) if options.save else None
    mine = None
    if whole is not None and run.replicas.replica == 0:
        mine = {key: tensor.detach().cpu() for key, tensor in whole.items()}
    pieces = _gather(mine, world, run.objects)
    if run.reporter:
        assert results is not None and pieces is not None
        facts = _run_facts(options, run.optimizer_name, run.base_lr, run.threads, run.device, run.executor_name,
                           run.data.samples_text(), world)
        facts["data_parallel"], facts["gradient_sync"] = plan.data_parallel, run.gradient_sync.mode
        facts["precision"], facts["param_dtype"] = run.precision.compute, run.precision.params
        if run.scaler.enabled:
            facts["loss_scale"] = run.scaler.state_dict()
        facts["warnings"] = run.warnings
        report = build_report(plan, results, losses=history.losses, run=facts, tokens_per_sample=run.tokens_per_sample)
        if not options.quiet:
            print_summary(report, Console())
        # Every output is written to its temporary file first, then all are renamed together:
        # a full disk (or a report its schema refuses, our bug) replaces none of the old files.
        with Outputs() as outputs:
            if options.report:
                write_artifact(options.report, report, "report", outputs, "--report")
            if options.trace:
                ordered = sorted(results, key=lambda r: r.rank)
                names = [f"stage {r.stage}, replica {r.replica} (rank {r.rank})" for r in ordered] \
                    if plan.data_parallel > 1 else None
                outputs.add(options.trace, dumps(chrome_trace([r.spans for r in ordered], {
                    "plan": plan.path, "schedule": plan.schedule, "micro_batches": plan.micro_batches,
                    "data_parallel": plan.data_parallel}, names)), "--trace")
            if options.save:
                outputs.add(options.save, _model_file(run.model.module.state_dict().keys(), pieces), "--save")
        if not options.quiet:
            written = [f"{what} {path}" for what, path in (("model", options.save), ("report", options.report),
                                                          ("trace", options.trace)) if path]
            if written:
                Console().print("wrote " + ", ".join(written), highlight=False)
    dist.barrier(group=run.objects)
    if run.joined_here:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- helpers
def _probe_in_turn(world: World, device: torch.device, objects: Any) -> tuple[float, float]:
    """This rank's speed probe (median, spread), run while the other ranks wait: one at a time."""
    probe = (0.0, 0.0)
    for rank in range(world.world_size):
        if rank == world.rank:
            probe = speed_probe(device.type)
        if world.world_size > 1:
            dist.barrier(group=objects)
    return probe


def _objects_group(device: torch.device) -> Any:
    """The gloo group for Python objects, in a process group someone else started."""
    return dist.group.WORLD if device.type == "cpu" else dist.new_group(backend="gloo")


def _executor_name(requested: str, device: torch.device, schedule: str) -> str:
    if schedule in ASYNC_SCHEDULES and device.type == "cuda":
        # torch's executor is synchronous (torch.distributed.pipelining), the native one gloo's.
        raise BadInput(f"{schedule} runs on the native executor, which is CPU (gloo) only: run with --device cpu")
    if requested == "auto":
        return "torch" if device.type == "cuda" else "native"
    if requested == "native" and device.type == "cuda":
        raise BadInput("--executor native runs on gloo (CPU); on CUDA use --executor torch (or auto)")
    return requested


def _make_executor(name: str, stage: StageChunks, plan: PlanView, loss_fn: Any, device: torch.device,
                   recorder: SpanRecorder, options: RunOptions, world: World, replicas: Replicas) -> Executor:
    """Either executor, running this stage's list of the schedule's actions (the same lists).

    Its sends and receives stay inside this rank's replica: to the rank of the neighbouring
    stage there (``replicas.pp_ranks``), never across replicas.
    """
    actions = plan.actions()
    if name == "torch":
        from .torch_executor import TorchExecutor

        group = replicas.pp_group
        group_ranks = [dist.get_group_rank(group, r) for r in replicas.pp_ranks] if group is not None else None
        return TorchExecutor(stage.chunks, actions, replicas.stage, plan.micro_batches, loss_fn, device, recorder,
                             group=group, group_ranks=group_ranks)
    neighbours = Neighbours(world.rank, world.world_size, device, options.timeout, stage_ranks=replicas.pp_ranks)
    if plan.schedule in ASYNC_SCHEDULES:
        return AsyncExecutor(stage.chunks, plan.schedule, replicas.stage, plan.num_stages, plan.micro_batches,
                             loss_fn, neighbours, recorder)
    return NativeExecutor(stage.chunks, actions, replicas.stage, plan.micro_batches, loss_fn, neighbours, recorder)


def replica_rows(batch: tuple[tuple[torch.Tensor, ...], torch.Tensor], replica: int,
                 replicas: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Replica ``replica``'s rows of a global batch: ``[r·B/d, (r+1)·B/d)`` of inputs and targets.

    The d replicas together see exactly the global batch, each its own contiguous slice: the
    mean of their gradients is the gradient of the whole batch, as the unsplit model's.
    """
    inputs, targets = batch
    if replicas == 1:
        return inputs, targets
    rows = targets.shape[0] // replicas
    part = slice(replica * rows, (replica + 1) * rows)
    return tuple(x[part] for x in inputs), targets[part]


def _memory(stage: StageChunks, optimizer: torch.optim.Optimizer, meter: ActivationMeter | None,
            device: torch.device, context_bytes: int | None, sharded: bool = False) -> dict[str, Any]:
    """The rank's memory by part; ``sharded`` (fsdp): parameters and state counted as FSDP holds them."""
    parts: dict[str, Any] = static_bytes(stage.module, optimizer, sharded=sharded)
    parts["activations_bytes"] = meter.total_bytes if meter is not None else None
    parts["peak_rss_bytes"] = peak_rss_bytes()
    if device.type == "cuda":
        parts["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        parts["method"] = "torch.cuda.max_memory_allocated"
        parts.update(cuda_memory(device, context_bytes or 0))
    elif meter is None:
        parts["peak_bytes"] = None
        parts["method"] = "activations not measured by this executor"
    else:
        parts["peak_bytes"] = sum(v for k, v in parts.items() if k in (
            "params_bytes", "gradients_bytes", "optimizer_state_bytes", "buffers_bytes", "activations_bytes"))
        parts["method"] = "tensor accounting: parameters, gradients, optimizer state, buffers, saved activations"
    return parts


def _parameter_places(stage: StageChunks) -> dict[int, tuple[int, str]]:
    """``id(parameter) -> (chunk position in the stage, its name in that chunk's module)``."""
    places: dict[int, tuple[int, str]] = {}
    for c, chunk in enumerate(stage.chunks):
        for name, p in chunk.module.named_parameters():
            places.setdefault(id(p), (c, name))
    return places


def _gather(obj: Any, world: World, group: Any) -> list[Any] | None:
    """``obj`` of every rank, on rank 0 (None elsewhere)."""
    if world.world_size == 1:
        return [obj]
    return gather_objects(obj, group)


def _model_file(keys: Any, pieces: list[dict[str, torch.Tensor]]) -> bytes:
    """The whole model's ``state_dict``, keys and order as the unsplit model's, from every stage's
    part, as the bytes of a ``torch.save`` file."""
    merged: dict[str, torch.Tensor] = {}
    for piece in pieces:
        merged.update(piece or {})
    missing = [k for k in keys if k not in merged]
    if missing:
        raise RunFailure(f"--save: no stage holds '{missing[0]}'")
    ordered = {k: merged[k] for k in keys}
    buffer = io.BytesIO()
    torch.save(ordered, buffer)
    return buffer.getvalue()


def _tokens_per_sample(model: LayeredModel) -> int | None:
    """Tokens in one sample of a language model (for tokens/s), None for other models.

    A language model (the built-in gpt, or one's own under ``--loss lm``, on synthetic ids or a
    data factory's) reads one input of ``seq_len`` token ids per sample."""
    if is_language_model(model.spec):
        return int(model.input_shapes[0][0])
    return None


def _identity(plan: PlanView, options: RunOptions, precision: Precision, optimizer: str) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed by this run.

    The model, its data and seed, its dtypes and the kind of optimizer state: not the split
    (stages, balance), the batch size or the number of micro-batches, which may all change.
    """
    return {"model": plan.model, "seed": options.seed, "data": options.data, "precision": precision.compute,
            "param_dtype": precision.params, "optimizer": optimizer}


def _saved_by(plan: PlanView, world: World) -> dict[str, Any]:
    """The plan a checkpoint was saved under (``ranks`` decides whether RNG states are restored)."""
    return {"plan": plan.path, "stages": plan.num_stages, "balance": plan.balance,
            "global_batch_size": plan.global_batch_size, "micro_batches": plan.micro_batches,
            "ranks": world.world_size, "data_parallel": plan.data_parallel, "gradient_sync": plan.gradient_sync,
            "sync_every": plan.sync_every}


def _resume_note(meta: dict[str, Any], plan: PlanView, world: World, now: dict[str, Any]) -> str | None:
    """How the checkpoint was made, when not under this very split, what became of the RNG, and
    the training options (``now``: this run's) that differ from those the run started with."""
    saved = meta.get("saved_by", {})
    ours = _saved_by(plan, world)
    notes = []
    if (saved.get("stages"), saved.get("balance")) != (ours["stages"], ours["balance"]):
        held = "holding" if len(saved.get("balance") or []) == saved.get("stages") else "whose chunks held"
        notes.append(f"the checkpoint was saved by {saved.get('stages')} stage(s) {held} {saved.get('balance')} "
                     f"layers; each stage loaded its own layers' tensors")
    if saved.get("global_batch_size") != ours["global_batch_size"]:
        notes.append(f"the global batch was {saved.get('global_batch_size')}, it is {ours['global_batch_size']} now")
    if meta.get("rng") == "reseeded":
        notes.append(f"{saved.get('ranks')} rank(s) saved it, {world.world_size} resume it: random generators "
                     f"reseeded from (seed, step, rank)")
    started = (meta.get("run") or {}).get("options") or {}
    changed = [f"--{key.replace('_', '-')} {started[key]} then, {now[key]} now" for key in TRAINING_OPTIONS
               if key in started and started[key] != now.get(key) and key != "steps"]
    if changed:
        notes.append("the run started with other options: " + ", ".join(changed))
    return "; ".join(notes) or None


def _run_facts(options: RunOptions, optimizer: str, lr: float, threads: int, device: torch.device, executor: str,
               data: str, world: World) -> dict[str, Any]:
    return {"steps": options.steps, "seed": options.seed, "optimizer": optimizer, "lr": lr,
            "lr_schedule": options.lr_schedule, "data": data, "executor": executor,
            "backend": "nccl" if device.type == "cuda" else "gloo", "device": device.type,
            "threads_per_rank": threads, "cpu_cores": cpu_cores(), "ranks": world.world_size,
            "launcher": world.launcher, "torch": torch.__version__,
            "started_unix_s": round(time.time(), 3)}


def _banner(plan: PlanView, options: RunOptions, optimizer: str, lr: float, threads: int, device: torch.device,
            executor: str, data: str, start: int) -> str:
    name = plan.model.get("name") or plan.model.get("factory")
    where = f"{device.type}, {threads} thread(s) per rank" if device.type == "cpu" else str(device)
    if plan.precision != "fp32":
        where += f", {precision_label(plan.precision, plan.param_dtype)}"
    schedule = plan.schedule if plan.num_chunks == plan.num_stages else \
        f"{plan.schedule} over {plan.num_chunks} chunks"
    sync = plan.gradient_sync + (f", averaged every {plan.sync_every} step(s)" if plan.gradient_sync == "localsgd"
                                 else "")
    stages = f"{plan.num_stages} stage(s)" if plan.data_parallel == 1 else \
        f"{plan.num_stages} stage(s) x {plan.data_parallel} replicas ({sync})"
    per_step = f"{plan.micro_batches} x {plan.micro_batch_size} samples per step" if plan.data_parallel == 1 else \
        f"{plan.data_parallel} x {plan.micro_batches} x {plan.micro_batch_size} samples per step"
    text = (f"training {name} on {stages} ({where}), {schedule}, "
            f"{per_step}, {optimizer} lr {lr:g}, "
            f"{data}, {executor} executor")
    if start:
        text += f"; resumed at step {start}"
    return text
