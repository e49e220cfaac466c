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

Warm-up is counted in rounds and, where asked, in seconds too: an idle GPU runs at a fraction
of its clock and needs about a second of work before its figures mean anything, while a few
short rounds on a small model take milliseconds.

Every forward runs in ``autocast``, the precision's context (:mod:`..models.precision`): a
no-op in fp32, ``torch.autocast`` in bf16 or fp16, as the stage will run it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from torch.utils.checkpoint import checkpoint

from .clock import Clock, median
from ..models.precision import Autocast, no_autocast
from .memory import SavedTensors, storage_key, tensor_bytes

Tensors = tuple[torch.Tensor, ...]


@dataclass
class Timing:
    forward_s: float
    backward_s: float


@dataclass
class LayerFigures:
    """What one layer costs at one micro-batch size."""

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
    """One thing to time: ``backward(forward())``, the two halves timed separately."""

    name: str
    forward: Callable[[], object]
    backward: Callable[[object], None]


def time_rounds(groups: list[list[Runner]], clock: Clock, warmup: int, repeats: int,
                after_run: Callable[[str], None] | None = None, warmup_s: float = 0.0) -> list[list[Timing]]:
    """Median forward and backward time of every runner, over ``repeats`` rounds after the warm-up.

    The warm-up is ``warmup`` rounds, and more until ``warmup_s`` seconds have passed. Each
    round runs each group in turn: the group's forwards in order (results kept), then its
    backwards in reverse order. ``after_run(name)`` is called after each forward and each
    backward of the counted rounds, outside the timed spans (it drives a progress bar).
    """
    forward_spans: list[list[list[tuple[object, object]]]] = [[[] for _ in group] for group in groups]
    backward_spans: list[list[list[tuple[object, object]]]] = [[[] for _ in group] for group in groups]

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
                group[k].backward(results[k])
                end = clock.mark()
                results[k] = None  # free the graph now, as the backward of training does
                if timed:
                    backward_spans[g][k].append((start, end))
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
    return [[Timing(forward_s=median([clock.seconds(a, b) for a, b in fwd]),
                    backward_s=median([clock.seconds(a, b) for a, b in bwd]))
             for fwd, bwd in zip(forward_spans[g], backward_spans[g])] for g in range(len(groups))]


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
                  autocast: Autocast = no_autocast) -> tuple[LayerFigures, Runner]:
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
    figures = LayerFigures(
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


def peak_transient_bytes(runner: Runner, device: torch.device, figures: LayerFigures) -> int:
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
