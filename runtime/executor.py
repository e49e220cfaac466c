"""The executor: run one stage's share of a training step, in the schedule's order.

A training step on stage k is the list of operations the schedule gives it (:mod:`.schedule`),
run one after the other:

- ``F m``: take micro-batch m's inputs (from the data on stage 0, else the activations stage
  k-1 sent), run the stage's layers, and send the outputs to stage k+1; the last stage
  instead computes the loss. Keep the inputs and outputs: the backward needs them.
- ``B m``: take the gradient of the outputs (from stage k+1; on the last stage, of the loss),
  run autograd back through the stage, which adds into every parameter's ``.grad``, and send
  the gradient of the inputs back to stage k-1.

That is the whole of pipeline parallelism: the stages overlap because stage k+1 runs F m
while stage k runs F m+1. Nothing is averaged across stages: each parameter lives on one
stage, and its ``.grad`` after the last backward is the sum over micro-batches of
d(loss_m / M)/dparam, which is exactly the gradient of the mean loss over the whole batch.
That is why the trained weights do not depend on K or M (GPipe is synchronous).

Two executors share this interface: :class:`NativeExecutor` below (gloo, receives posted
ahead, see :mod:`.p2p`) and :class:`.torch_executor.TorchExecutor`, which drives the same
stage with ``torch.distributed.pipelining``. ``docs/runtime.md`` has the measurements that
chose the default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch

from .faults import Fault
from .memory import ActivationMeter, element_bytes
from .p2p import ACTIVATION, GRADIENT, Neighbours, PendingReceive
from .schedule import stage_ops
from .stage import Stage, TensorMeta
from .timing import SpanRecorder

Tensors = tuple[torch.Tensor, ...]
LossFn = Callable[[Tensors, torch.Tensor], torch.Tensor]


class Executor(Protocol):
    meters_activations: bool  # whether step() measures activation memory with a meter
    loss_scale: float         # the last stage backpropagates loss x loss_scale (fp16; see .loss_scale)

    def step(self, step: int, inputs: Tensors | None, targets: torch.Tensor | None,
             meter: ActivationMeter | None = None) -> list[torch.Tensor]:
        """Run one step's forwards and backwards; return the micro-batch losses (last stage)."""
        ...


class NativeExecutor:
    """Runs a stage's operations with asynchronous sends and receives posted one ahead."""

    meters_activations = True
    loss_scale = 1.0

    def __init__(self, stage: Stage, schedule: str, micro_batches: int, loss_fn: LossFn,
                 neighbours: Neighbours, recorder: SpanRecorder, fault: Fault | None = None) -> None:
        self.stage = stage
        self.schedule = schedule
        self.ops = stage_ops(schedule, stage.index, stage.num_stages, micro_batches)
        self.micro_batches = micro_batches
        self.loss_fn = loss_fn
        self.links = neighbours
        self.recorder = recorder
        self.fault = fault
        # Gradients flow only through floating tensors; the others (token ids) need none.
        self.grad_inputs = [m.carries_grad for m in stage.input_meta]
        self.grad_outputs = [m.carries_grad for m in stage.output_meta]
        self.grad_output_meta = tuple(m for m in stage.output_meta if m.carries_grad)

    def step(self, step: int, inputs: Tensors | None, targets: torch.Tensor | None,
             meter: ActivationMeter | None = None) -> list[torch.Tensor]:
        stage, M = self.stage, self.micro_batches
        input_chunks = list(zip(*(x.chunk(M) for x in inputs))) if inputs is not None else []
        target_chunks = list(targets.chunk(M)) if targets is not None else []
        # Receives are posted ahead, in the order the schedule consumes them, so that the data
        # lands while we compute. gloo moves a message only once its receive is posted (the
        # sender's data waits until then), so a receive posted when it is needed costs a
        # round trip on the critical path; posted early, nothing.
        activations = ReceiveQueue(self.links, ACTIVATION, stage.input_meta, self._order("F"),
                                   self.activation_lookahead, active=not stage.is_first)
        gradients = ReceiveQueue(self.links, GRADIENT, self.grad_output_meta, self._order("B"),
                                 self.gradient_lookahead, active=not stage.is_last)
        saved: dict[int, tuple[Tensors, Tensors | torch.Tensor]] = {}
        losses: list[torch.Tensor] = []
        for op in self.ops:
            m = op.micro_batch
            if op.kind == "F":
                xs = input_chunks[m] if stage.is_first else self._wait(m, activations)
                saved[m] = self._forward(step, m, xs, target_chunks[m] if stage.is_last else None, meter)
                if stage.is_last:
                    losses.append(saved[m][1].detach())  # type: ignore[union-attr]
            else:
                grads = None if stage.is_last else self._wait(m, gradients)
                self._backward(m, *saved.pop(m), grads)
                if meter is not None:
                    meter.release(m)
        self.links.finish_sends()
        return losses

    @property
    def activation_lookahead(self) -> int:
        """Activation receives in flight: as many as the stage keeps inputs of anyway.

        A GPipe stage holds the inputs of all M micro-batches until its backwards, so posting
        all M receives at once costs no memory, and the previous stage's forwards, run back to
        back, all go straight through. A 1F1B stage holds K - k; one more is posted ahead.
        """
        stage, M = self.stage, self.micro_batches
        if self.schedule == "gpipe":
            return M
        return min(M, stage.num_stages - stage.index + 1)

    # Gradient receives in flight: the next one and the one after. Each is a buffer the size of
    # the stage's output that the plan's memory model does not count, so keep them few.
    gradient_lookahead = 2

    def _order(self, kind: str) -> list[int]:
        return [op.micro_batch for op in self.ops if op.kind == kind]

    # ------------------------------------------------------------------ operations
    def _wait(self, m: int, queue: "ReceiveQueue") -> Tensors:
        start = self.recorder.mark()
        tensors = queue.take(m)
        self.recorder.add("wait", m, start, self.recorder.mark())
        return tensors

    def _forward(self, step: int, m: int, xs: Tensors, target: torch.Tensor | None,
                 meter: ActivationMeter | None) -> tuple[Tensors, Tensors | torch.Tensor]:
        stage = self.stage
        start = self.recorder.mark()
        if self.fault is not None and m == 0 and self.fault.due(stage.index, step):
            self.fault.fire(stage.index, step)
        if not stage.is_first:
            # The received activations are leaves of this stage's graph: ask for their
            # gradient, which the backward sends back to the stage before.
            xs = tuple(x.requires_grad_() if g else x for x, g in zip(xs, self.grad_inputs))
        with self._metering(meter, m, xs):
            outputs = stage.module(*xs)
        if stage.is_last:
            assert target is not None
            loss = self.loss_fn(outputs, target)
            if self.fault is not None and self.fault.due(stage.index, step):
                loss = self.fault.poison(loss)
            result: tuple[Tensors, Tensors | torch.Tensor] = (xs, loss)
        else:
            self.links.send(ACTIVATION, m, outputs)
            result = (xs, outputs)
        self.recorder.add("forward", m, start, self.recorder.mark())
        return result

    def _backward(self, m: int, xs: Tensors, out: Tensors | torch.Tensor, grads: Tensors | None) -> None:
        stage = self.stage
        start = self.recorder.mark()
        if stage.is_last:
            assert isinstance(out, torch.Tensor)
            # d(mean over the batch)/d(loss of micro-batch m) = 1/M (times the fp16 loss scale).
            (out * (self.loss_scale / self.micro_batches)).backward()
        else:
            assert grads is not None and isinstance(out, tuple)
            carrying = [o for o, g in zip(out, self.grad_outputs) if g]
            pairs = [(o, g) for o, g in zip(carrying, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not stage.is_first:
            # An input the stage did not use has no gradient: send zeros, the sender waits.
            input_grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x)
                                for x, g in zip(xs, self.grad_inputs) if g)
            self.links.send(GRADIENT, m, input_grads)
        self.recorder.add("backward", m, start, self.recorder.mark())

    def _metering(self, meter: ActivationMeter | None, m: int, xs: Tensors) -> contextlib.AbstractContextManager[None]:
        if meter is None:
            return contextlib.nullcontext()
        if self.stage.module.recompute:
            # Checkpointing keeps only the inputs; while it recomputes one micro-batch in the
            # backward, that one's activations are live too: measure them once.
            meter.hold(m, sum(element_bytes(x) for x in xs))
            if meter.transient_bytes == 0:
                meter.transient_bytes = meter.measure_once(self.stage.module.run_layers, *xs)
            return contextlib.nullcontext()
        return meter.forward(m)


class ReceiveQueue:
    """Receives of one kind (activations or gradients), posted ``depth`` ahead of their use."""

    def __init__(self, links: Neighbours, kind: int, metas: tuple[TensorMeta, ...], order: list[int], depth: int,
                 active: bool) -> None:
        self.links, self.kind, self.metas = links, kind, metas
        self.order = order if active else []
        self.depth = depth
        self.posted: dict[int, PendingReceive] = {}
        self.next = 0
        self._refill()

    def take(self, micro_batch: int) -> Tensors:
        """Wait for ``micro_batch``'s tensors (the next in order), and post one more receive."""
        pending = self.posted.pop(micro_batch)
        self._refill()
        return self.links.wait(pending)

    def _refill(self) -> None:
        while self.next < len(self.order) and len(self.posted) < self.depth:
            m = self.order[self.next]
            self.posted[m] = self.links.post_receive(self.kind, m, self.metas)
            self.next += 1
