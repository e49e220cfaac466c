"""Measuring the layers, and the whole model, at one micro-batch size.

A layer is timed the way a pipeline stage runs it: its inputs are leaves that require grad
(a stage computes the gradient it sends back to the stage before; the first layer's inputs
are data and do not), its forward runs with autograd recording, and its backward starts from
a gradient of each output, as one arriving from the next stage would. The last layer also
computes the loss, forward and backward, because the last stage does.

Timing goes in rounds (:func:`time_rounds`): a round runs groups of runners in turn, each
group's forwards in order, keeping what each saves for backward, then its backwards in
reverse order, as a model runs its layers; each figure is the median over ``repeats`` rounds
after ``warmup`` rounds. The profiler times one layer at a time (the model is not all in
memory: profiles/profiler.py), one group per micro-batch size, so that a slow spell of a
shared machine lands on all sizes alike instead of on whichever size was being repeated.

What timing a layer alone cannot see: in the model a layer runs after the one before it, with
every earlier layer's activations still alive. Alone, its weights stay in the caches and its
buffers are freed and reused run after run without page faults, so on a CPU the layers add up
to a little less than the whole model's step (the profile's ``consistency`` says by how much;
docs/benchmarks.md, "Models larger than one process").

Parameter gradients accumulate across rounds, as across the micro-batches of one step. The
garbage collector is off while timing so that a collection does not land in one figure.

The backward is also timed split in two, as zero-bubble schedules run it (:func:`split_runner`):
the input gradient I, which the previous stage waits for, then the weight gradient W, which
only the optimizer waits for, through torch.distributed.pipelining's own ``stage_backward_input``
and ``stage_backward_weight``, so that what is timed is what both executors run.

Warm-up is counted in rounds and, where asked, in seconds too: an idle GPU runs at a fraction
of its clock and needs about a second of work before its figures mean anything, while a few
short rounds on a small model take milliseconds.

Every forward runs in ``autocast``, the precision's context (:mod:`..models.precision`): a
no-op in fp32, ``torch.autocast`` in bf16 or fp16, as the stage will run it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import checkpoint

from .clock import Clock, median
from ..models.precision import Autocast, no_autocast
from ..tensor_memory import SavedTensors, storage_key, tensor_bytes

Tensors = tuple[torch.Tensor, ...]


@dataclass
class Timing:
    """Median times of one runner; a split runner's backward also in its two halves."""

    forward_s: float
    backward_s: float                       # the whole backward (a split runner's: median of I + W)
    backward_input_s: float | None = None   # split runners only: I
    backward_weight_s: float | None = None  # split runners only: W


@dataclass
class LayerMeasurement:
    """What one layer was measured to cost at one micro-batch size (a profile layer's figures at
    that size; the planner reads them back as planner.profile.LayerFigures, a frozen table)."""

    forward_s: float
    backward_s: float
    activation_bytes: int
    output_bytes: int
    output_shapes: list[list[int]]        # whole, the micro-batch dimension included
    output_dtypes: list[str]
    peak_transient_bytes: int | None = None
    # What the layer holds after its forward beyond its inputs: the saved tensors that are not
    # its inputs, and its outputs (the baseline of the transient peak; not in the profile).
    held_bytes: int = 0
    # Timed again under activation checkpointing, as a recomputing stage runs it.
    recompute_forward_s: float | None = None
    recompute_backward_s: float | None = None
    # The backward split as zero-bubble schedules run it (see split_runner and record_split).
    backward_input_s: float | None = None
    backward_weight_s: float | None = None
    weight_kept_bytes: int | None = None
    # CUDA: the CPU's time to issue the forward and backward (profiles/issue.py); forward_s
    # and backward_s are then the GPU's time behind a backlog.
    issue_forward_s: float | None = None
    issue_backward_s: float | None = None


@contextmanager
def no_gc() -> Iterator[None]:
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class Runner:
    """One thing to time: ``backward(forward())``, the two halves timed separately.

    A split runner (``backward_weight`` set) runs its backward in two parts, each timed:
    ``backward`` is the input gradient and returns what ``backward_weight`` then takes.
    """

    name: str
    forward: Callable[[], object]
    backward: Callable[[object], object]
    backward_weight: Callable[[object], None] | None = None


def time_rounds(groups: list[list[Runner]], clock: Clock, warmup: int, repeats: int,
                after_run: Callable[[str], None] | None = None, warmup_s: float = 0.0) -> list[list[Timing]]:
    """Median forward and backward time of every runner, over ``repeats`` rounds after the warm-up.

    The warm-up is ``warmup`` rounds, and more until ``warmup_s`` seconds have passed. Each
    round runs each group in turn: the group's forwards in order (results kept), then its
    backwards in reverse order, then the weight halves of its split runners in reverse order
    (a zero-bubble stage runs its W's after the I's that send gradients on). ``after_run(name)``
    is called after each forward, backward and weight half of the counted rounds, outside the
    timed spans (it drives a progress bar).
    """
    Spans = list[list[list[tuple[object, object]]]]
    forward_spans: Spans = [[[] for _ in group] for group in groups]
    backward_spans: Spans = [[[] for _ in group] for group in groups]
    weight_spans: Spans = [[[] for _ in group] for group in groups]

    def one_round(timed: bool, report: Callable[[str], None] | None) -> None:
        for g, group in enumerate(groups):
            results: list[object] = []
            for k, runner in enumerate(group):
                start = clock.mark()
                results.append(runner.forward())
                end = clock.mark()
                if timed:
                    forward_spans[g][k].append((start, end))
                if report is not None:
                    report(runner.name)
            for k in reversed(range(len(group))):
                start = clock.mark()
                state = group[k].backward(results[k])
                end = clock.mark()
                # Free the graph now, as the backward of training does (a split runner's W
                # still needs what its I returned).
                results[k] = state if group[k].backward_weight is not None else None
                if timed:
                    backward_spans[g][k].append((start, end))
                if report is not None:
                    report(group[k].name)
            for k in reversed(range(len(group))):
                weight = group[k].backward_weight
                if weight is None:
                    continue
                start = clock.mark()
                weight(results[k])
                end = clock.mark()
                results[k] = None
                if timed:
                    weight_spans[g][k].append((start, end))
                if report is not None:
                    report(group[k].name)

    with no_gc():
        started = time.perf_counter()
        for _ in range(warmup):
            one_round(timed=False, report=after_run)
        clock.sync()
        while time.perf_counter() - started < warmup_s:
            one_round(timed=False, report=None)
            clock.sync()
        for _ in range(repeats):
            one_round(timed=True, report=after_run)
        clock.sync()

    def timing(fwd: list[tuple[object, object]], bwd: list[tuple[object, object]],
               wgt: list[tuple[object, object]]) -> Timing:
        backward = [clock.seconds(a, b) for a, b in bwd]
        if not wgt:
            return Timing(median([clock.seconds(a, b) for a, b in fwd]), median(backward))
        weight = [clock.seconds(a, b) for a, b in wgt]
        return Timing(median([clock.seconds(a, b) for a, b in fwd]),
                      median([i + w for i, w in zip(backward, weight)]),
                      backward_input_s=median(backward), backward_weight_s=median(weight))

    return [[timing(*spans) for spans in zip(forward_spans[g], backward_spans[g], weight_spans[g])]
            for g in range(len(groups))]


def as_leaves(xs: Tensors, requires_grad: bool) -> Tensors:
    """Fresh leaf tensors sharing ``xs``'s data; floating ones require grad if asked."""
    return tuple(x.detach().requires_grad_(requires_grad and x.is_floating_point()) for x in xs)


def _backward_from(grads: list[torch.Tensor | None]) -> Callable[[Tensors], None]:
    """Backward from given output gradients, as a stage does with what the next stage sent."""
    def backward(outputs: Tensors) -> None:
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return backward


def _loss_backward(loss: torch.Tensor) -> None:
    loss.backward()


def checkpointed(layer: nn.Module) -> Callable[..., Tensors]:
    """``layer`` as a recomputing stage runs it: ``torch.utils.checkpoint``, non-reentrant.

    The forward keeps only the inputs (each tensor the layer would save for backward goes
    through a hook instead); the backward first reruns the forward to rebuild them. Both cost
    more than the plain passes beyond the rerun itself, which is why the profiler times them.
    """
    def run(*xs: torch.Tensor) -> Tensors:
        return checkpoint(layer, *xs, use_reentrant=False)
    return run


def prepare_layer(name: str, layer: nn.Module, xs: Tensors, *, first: bool,
                  loss: Callable[[Tensors], torch.Tensor] | None,
                  autocast: Autocast = no_autocast) -> tuple[LayerMeasurement, Runner]:
    """Weigh ``layer`` on inputs ``xs`` (one micro-batch) and make the runner that times it.

    The figures are complete but for the times, which :func:`time_rounds` measures.
    ``loss``: for the last layer, the loss of its outputs, computed inside its forward and
    differentiated in its backward (outside the checkpoint, as in a stage).
    """
    state = [*layer.parameters(), *layer.buffers()]
    device = xs[0].device if xs else None

    # One untimed pass to see what the layer keeps for backward and what it sends on.
    saved = SavedTensors(exclude=state, device=device)
    leaves = as_leaves(xs, requires_grad=not first)
    with saved.recording(), autocast():
        outputs = layer(*leaves)
        tail = loss(outputs) if loss is not None else None
    outputs_kept = {storage_key(o): tensor_bytes([o]) for o in outputs}
    figures = LayerMeasurement(
        forward_s=0.0, backward_s=0.0,
        activation_bytes=saved.nbytes,
        output_bytes=tensor_bytes(outputs),
        output_shapes=[list(o.shape) for o in outputs],
        output_dtypes=[str(o.dtype).replace("torch.", "") for o in outputs],
        held_bytes=saved.nbytes_except([*leaves, *outputs]) + sum(outputs_kept.values()),
    )
    # Gradients like the ones the next stage would send: same shape, arbitrary values.
    grads = [torch.ones_like(o) if o.requires_grad else None for o in outputs]
    del outputs, tail, leaves

    backward = _loss_backward if loss is not None else _backward_from(grads)
    return figures, Runner(name, _forward(layer, xs, first, loss, autocast), backward)


def recomputing_runner(name: str, plain: Runner, layer: nn.Module, xs: Tensors, *, first: bool,
                       loss: Callable[[Tensors], torch.Tensor] | None, autocast: Autocast = no_autocast) -> Runner:
    """``plain``'s twin with the layer under activation checkpointing (same inputs, same gradients)."""
    return Runner(name, _forward(checkpointed(layer), xs, first, loss, autocast), plain.backward)


def split_runner(name: str, layer: nn.Module, xs: Tensors, figures: LayerMeasurement, *, first: bool,
                 loss: Callable[[Tensors], torch.Tensor] | None, autocast: Autocast = no_autocast) -> Runner | None:
    """The runner that times ``layer``'s backward split in two, as a zero-bubble stage runs it.

    I is ``stage_backward_input``: the gradient of the layer's inputs, from the same output
    gradients as the plain runner's (the last layer: from its loss), keeping the graph; it
    drops the part of the graph above the operations that have weights and returns what
    the weight half needs. W is ``stage_backward_weight``: the weights' gradients from there.
    Both are torch.distributed.pipelining's functions, so what is timed is what runs.

    Also weighs ``figures.weight_kept_bytes``, in one untimed pass: the saved tensors still
    held after I, plus the gradients I left for W (each storage once, on the profiled device).

    The first layer gets no runner (None): torch's pipeline stage runs no I on the first
    chunk, whose inputs are data without gradients, and runs its W as the whole backward,
    keeping every saved tensor until then (see :func:`record_split`).
    """
    if first:
        figures.weight_kept_bytes = figures.activation_bytes
        return None
    state = [*layer.parameters(), *layer.buffers()]
    device = xs[0].device if xs else None
    forward, backward_input, backward_weight = _split_halves(layer, xs, loss, autocast)
    saved = SavedTensors(exclude=state, device=device)
    with saved.recording():
        result = forward()
    groups = backward_input(result)
    del result   # the inputs and the (now detached) outputs: the stage's own, not the graph's
    figures.weight_kept_bytes = saved.nbytes_alive() + _gradient_bytes(groups, device)
    backward_weight(groups)
    return Runner(name, forward, backward_input, backward_weight)


def _split_halves(layer: nn.Module, xs: Tensors, loss: Callable[[Tensors], torch.Tensor] | None,
                  autocast: Autocast) -> tuple[Callable[[], object], Callable[[object], object],
                                               Callable[[object], None]]:
    """Forward, I and W of ``layer`` on ``xs``, with torch pipelining's split backward."""
    grads: list[torch.Tensor | None] | None = None

    def forward() -> tuple[Tensors, Tensors]:
        leaves = as_leaves(xs, requires_grad=True)
        with autocast():
            outputs = layer(*leaves)
            if loss is not None:
                return (loss(outputs),), leaves
        # stage_backward_input detaches the outputs in place, which a view refuses: a view
        # is copied into an output of its own (its backward passes the gradient through).
        return tuple(o.clone() if o._is_view() else o for o in outputs), leaves

    def backward_input(result: object) -> object:
        nonlocal grads
        outputs, leaves = result  # type: ignore[misc]
        if grads is None and loss is None:   # like the next stage's: same shapes, arbitrary values
            grads = [torch.ones_like(o) if o.requires_grad else None for o in outputs]
        _, groups = stage_backward_input(list(outputs), grads, list(leaves), layer.parameters())
        return groups

    def backward_weight(groups: object) -> None:
        stage_backward_weight(layer.parameters(), groups)  # type: ignore[arg-type]

    return forward, backward_input, backward_weight


def _gradient_bytes(param_groups: object, device: torch.device | None) -> int:
    """Bytes of the gradients ``stage_backward_input`` left in its parameter groups for W."""
    storages: dict[tuple[str, int], int] = {}
    for group in param_groups:  # type: ignore[attr-defined]
        for grads in group.get("grads") or ():
            for g in grads:
                if isinstance(g, torch.Tensor) and (device is None or g.device.type == device.type):
                    storages[storage_key(g)] = g.untyped_storage().nbytes()
    return sum(storages.values())


def record_split(figures: LayerMeasurement, split: Timing | None, split_harness: Timing | None,
                 has_weights: bool) -> None:
    """Set ``figures``' I and W times from a split runner's timing, the split harness's taken off.

    ``split`` None: the first layer, for which torch runs no I and whose W is its whole
    backward: the plain runner's ``figures.backward_s`` (already net of the plain harness).
    A layer without weights has nothing for W to do: 0, not a harness-sized remainder of noise.
    """
    if split is None or split_harness is None:
        figures.backward_input_s = 0.0
        figures.backward_weight_s = figures.backward_s
        return
    assert split.backward_input_s is not None and split.backward_weight_s is not None
    assert split_harness.backward_input_s is not None and split_harness.backward_weight_s is not None
    figures.backward_input_s = max(0.0, split.backward_input_s - split_harness.backward_input_s)
    figures.backward_weight_s = (max(0.0, split.backward_weight_s - split_harness.backward_weight_s)
                                 if has_weights else 0.0)


def _forward(call: Callable[..., Tensors], xs: Tensors, first: bool,
             loss: Callable[[Tensors], torch.Tensor] | None, autocast: Autocast) -> Callable[[], object]:
    if loss is not None:
        def forward_and_loss() -> object:
            with autocast():
                return loss(call(*as_leaves(xs, requires_grad=not first)))
        return forward_and_loss

    def forward() -> object:
        with autocast():
            return call(*as_leaves(xs, requires_grad=not first))
    return forward


def peak_transient_bytes(runner: Runner, device: torch.device, figures: LayerMeasurement) -> int:
    """CUDA: the peak of one forward+backward above what the layer holds by design.

    The baseline is what is allocated before (inputs, parameters, gradients) plus what the
    layer holds after its forward by design (``held_bytes``: the saved tensors other than its
    inputs, which the baseline has already, and its outputs, counted once even when saved
    too). The rest of the peak is workspace and temporaries the planner must leave room for.
    """
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.backward(runner.forward())
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return max(0, peak - base - figures.held_bytes)


class _PassThrough(nn.Module):
    """A layer that does no work: its output is its input, a leaf that requires grad.

    Its backward still starts autograd's engine and accumulates the input's gradient, as a
    real layer's does, and runs no operation of its own to be mistaken for overhead.
    """

    def forward(self, x: torch.Tensor) -> Tensors:
        return (x,)


class _Touch(nn.Module):
    """The least layer checkpointing has something to rerun for: one multiply."""

    def forward(self, x: torch.Tensor) -> Tensors:
        return (x * 1.0,)


def recompute_harness_runner(device: torch.device, autocast: Autocast = no_autocast) -> Runner:
    """A checkpointed one-multiply layer: what checkpointing costs per call, whatever it wraps.

    Saving the RNG state, setting up the saved-tensor hooks and, in the backward, starting the
    rerun cost a fixed ~0.1-0.5 ms per call on a CPU. A stage checkpoints all its layers as
    one call, so the profiler subtracts this runner from every checkpointed layer and records
    it once (``recompute_call_s``), for the planner to charge once per stage.
    """
    layer, xs = _Touch(), (torch.zeros(1, device=device),)
    _, plain = prepare_layer("recompute harness", layer, xs, first=False, loss=None, autocast=autocast)
    return recomputing_runner("recompute harness", plain, layer, xs, first=False, loss=None, autocast=autocast)


def has_weights(layer: nn.Module) -> bool:
    """Whether ``layer`` has parameters to train, i.e. whether a weight gradient has work to do."""
    return any(p.requires_grad for p in layer.parameters())


def split_harness_runner(device: torch.device, autocast: Autocast = no_autocast) -> Runner:
    """The harness's twin for the split backward: an empty layer through I and W.

    I starts autograd's engine once, as the plain backward does; W over a layer without
    weights only walks the (empty) parameter groups. Taken off every split runner's halves.
    """
    figures, _ = prepare_layer("split harness", _PassThrough(), (torch.zeros(1, device=device),), first=False,
                               loss=None, autocast=autocast)
    runner = split_runner("split harness", _PassThrough(), (torch.zeros(1, device=device),), figures, first=False,
                          loss=None, autocast=autocast)
    assert runner is not None
    return runner


def harness_runner(device: torch.device, autocast: Autocast = no_autocast) -> Runner:
    """A runner for an empty layer: what timing a layer costs beyond the layer's own work.

    Making leaves, calling the layer, and above all starting autograd's engine for a backward
    of its own cost tens of microseconds per layer. The whole model pays that once, a stage
    once per micro-batch, but a sum of separately timed layers pays it per layer: the
    profiler subtracts this runner's median from every layer's, so that per-layer figures
    add up to the whole (and a model cut into many small layers is not overcharged).
    """
    _, runner = prepare_layer("harness", _PassThrough(), (torch.zeros(1, device=device),), first=False, loss=None,
                              autocast=autocast)
    return runner


def model_step_runner(run: Callable[[], torch.Tensor], autocast: Autocast = no_autocast) -> Runner:
    """The whole, unsplit model: forward including the loss, then backward."""
    def forward() -> torch.Tensor:
        with autocast():
            return run()
    return Runner("whole model", forward, _loss_backward)


def distinct_parameters(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` each once (a tied parameter is one tensor however many layers name it), in order:
    what one optimizer steps over."""
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def optimizer_step_s(params: list[torch.Tensor], clock: Clock, warmup: int, repeats: int) -> float:
    """Median time of one Adam step over tensors shaped like ``params`` (copies: the model is untouched)."""
    if not params:
        return 0.0
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c in copies:
        c.grad = torch.ones_like(c)
    optimizer = torch.optim.Adam(copies, lr=1e-3)
    spans = []
    with no_gc():
        for r in range(warmup + repeats):
            start = clock.mark()
            optimizer.step()
            end = clock.mark()
            if r >= warmup:
                spans.append((start, end))
        clock.sync()
    return median([clock.seconds(a, b) for a, b in spans])
