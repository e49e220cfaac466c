"""The same stage, driven by ``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``).

PyTorch's pipelining package runs a ``PipelineStage`` under a schedule object. Three things
make it work on gloo/CPU, each learnt the hard way (docs/runtime.md, "Executors"):

- static metadata: left to infer shapes, stages exchange them with blocking sends that
  deadlock on gloo. We pass ``input_args`` (requiring gradients on every stage but the first)
  and ``output_args``; torch 2.13 also takes the gradients' metadata, ``output_grads`` (every
  stage but the last) and ``input_grads`` (every stage but the first), and without them its
  first stage receives ``None`` gradients;
- ``loss_fn`` on every rank: a schedule built without it skips that stage's backward;
- the schedule splits the batch itself and divides the gradients by M at the end
  (``scale_grads``), which is the same mean-over-the-batch gradient as the native executor's.

The torch that runs us is not always the one we develop with (a GPU image may ship an older
one), so we read which of these arguments its classes take (:func:`pipelining_features`)
and pass only those, refusing in one line what a plan needs and it lacks.

We time each stage's forward and backward by overriding the stage's ``forward_one_chunk`` and
``backward_one_chunk``: the spans cover the computation, not the waits for neighbours.

This is the executor the CUDA/NCCL path uses: its schedules pair each send with the matching
receive in one batch (``batch_isend_irecv``), which NCCL needs.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ..artifacts import BadInput
from .executor import LossFn, Tensors
from .faults import Fault
from .memory import ActivationMeter, element_bytes
from .stage import Stage
from .timing import SpanRecorder


class _TimedStage(PipelineStage):
    """A ``PipelineStage`` that records a span for every forward and backward it runs."""

    recorder: SpanRecorder
    fault: Fault | None
    meter: ActivationMeter | None = None
    step_index: int = 0

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):  # type: ignore[override]
        start = self.recorder.mark()
        if self.fault is not None and fwd_chunk_id == 0 and self.fault.due(self.stage_index, self.step_index):
            self.fault.fire(self.stage_index, self.step_index)
        with self._metering(fwd_chunk_id, args):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.recorder.add("forward", fwd_chunk_id, start, self.recorder.mark())
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):  # type: ignore[override]
        start = self.recorder.mark()
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if self.meter is not None:
            self.meter.release(bwd_chunk_id)
        self.recorder.add("backward", bwd_chunk_id, start, self.recorder.mark())

    def _metering(self, chunk: int, args: Tensors) -> contextlib.AbstractContextManager[None]:
        if self.meter is None:
            return contextlib.nullcontext()
        if self.submod.recompute:  # as in the native executor: inputs kept, one rerun live
            xs = args if self.is_first else tuple(info.buffer for info in self.args_recv_info[chunk])
            self.meter.hold(chunk, sum(element_bytes(x) for x in xs if isinstance(x, torch.Tensor)))
            if self.meter.transient_bytes == 0:
                self.meter.transient_bytes = self.meter.measure_once(self.submod.run_layers, *xs)
            return contextlib.nullcontext()
        return self.meter.forward(chunk)


@dataclass(frozen=True)
class PipeliningFeatures:
    """What the installed ``torch.distributed.pipelining`` takes, read off its signatures."""

    static_shapes: bool   # PipelineStage(input_args=, output_args=): no shape inference at run time
    grad_metas: bool      # PipelineStage(output_grads=, input_grads=): torch 2.13's gradient metadata
    scale_grads: bool     # Schedule*(scale_grads=): the gradient of the mean, not the sum
    losses: bool          # schedule.step(losses=, return_outputs=)


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return set()


def pipelining_features(stage_class: type = PipelineStage, schedule_class: type = Schedule1F1B) -> PipeliningFeatures:
    """Which of the arguments this executor relies on the installed torch has."""
    stage = _parameters(stage_class.__init__)
    schedule = _parameters(schedule_class.__init__)
    step = _parameters(schedule_class.step)
    return PipeliningFeatures(static_shapes={"input_args", "output_args"} <= stage,
                              grad_metas={"output_grads", "input_grads"} <= stage,
                              scale_grads="scale_grads" in schedule,
                              losses={"losses", "return_outputs"} <= step)


def stage_arguments(stage: Stage, device: torch.device, features: PipeliningFeatures) -> dict[str, Any]:
    """The keyword arguments of ``PipelineStage`` for ``stage``, as far as this torch takes them.

    Refuses in one line (:class:`BadInput`) when torch lacks what any run needs.
    """
    missing = [what for what, have in (("PipelineStage(input_args=, output_args=)", features.static_shapes),
                                       ("Schedule1F1B(scale_grads=)", features.scale_grads),
                                       ("schedule.step(losses=, return_outputs=)", features.losses)) if not have]
    if missing:
        raise BadInput(f"the installed torch {torch.__version__} lacks {missing[0]}, which --executor torch needs: "
                       f"upgrade torch (2.11 and 2.13 are tested), or use --executor native (CPU)")

    def example(metas: tuple[Any, ...], grad: bool) -> Tensors:
        return tuple(m.empty(device).requires_grad_(grad and m.carries_grad) for m in metas)

    arguments: dict[str, Any] = {"input_args": example(stage.input_meta, grad=not stage.is_first),
                                 "output_args": example(stage.output_meta, grad=False)}
    if features.grad_metas:
        arguments["output_grads"] = None if stage.is_last else example(stage.output_meta, grad=False)
        arguments["input_grads"] = None if stage.is_first else example(stage.input_meta, grad=False)
    return arguments


class TorchExecutor:
    """Runs a stage with ``torch.distributed.pipelining``'s GPipe or 1F1B schedule."""

    meters_activations = True
    loss_scale = 1.0

    def __init__(self, stage: Stage, schedule: str, micro_batches: int, loss_fn: LossFn,
                 device: torch.device, recorder: SpanRecorder, fault: Fault | None = None,
                 features: PipeliningFeatures | None = None) -> None:
        if schedule == "1f1b" and micro_batches < stage.num_stages:
            raise BadInput(f"torch's Schedule1F1B needs at least as many micro-batches as stages "
                           f"({micro_batches} < {stage.num_stages}): use --executor native or a GPipe plan")
        self.stage = stage
        arguments = stage_arguments(stage, device, features or pipelining_features())
        pipe_stage = _TimedStage(stage.module, stage.index, stage.num_stages, device, **arguments)
        pipe_stage.recorder = recorder
        pipe_stage.fault = fault
        self.pipe_stage = pipe_stage
        self.fault = fault
        self.loss_fn = loss_fn
        self.poison_step: int | None = None

        def loss(outputs: Tensors, target: torch.Tensor) -> torch.Tensor:
            value = loss_fn(outputs, target)
            if self.fault is not None and self.poison_step is not None:
                value = self.fault.poison(value)
            return value * self.loss_scale if self.loss_scale != 1.0 else value

        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(pipe_stage, micro_batches, loss_fn=loss, scale_grads=True)

    def step(self, step: int, inputs: Tensors | None, targets: torch.Tensor | None,
             meter: ActivationMeter | None = None) -> list[torch.Tensor]:
        self.pipe_stage.meter = meter
        self.pipe_stage.step_index = step
        self.poison_step = step if self.fault is not None and self.fault.due(self.stage.index, step) else None
        losses: list[torch.Tensor] = []
        args = inputs if self.stage.is_first and inputs is not None else ()
        self.schedule.step(*args, target=targets if self.stage.is_last else None, losses=losses,
                           return_outputs=False)
        return [loss.detach() / self.loss_scale for loss in losses]
