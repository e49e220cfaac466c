"""The executor: run one stage's share of a training step, in the order of its action list.

A training step on stage k is the list of actions the schedule gives it
(``gpipe_plan.schedules.all_actions(...)[k]``), each on one of the stage's chunks for one
micro-batch, run one after the other:

- ``F``: take the micro-batch's inputs (the data, for chunk 0; else the activations chunk
  c-1 produced), run the chunk's layers, and hand the outputs to chunk c+1; the last chunk
  instead computes the loss. Keep the inputs and outputs: the backward needs them.
- ``B``: take the gradient of the outputs (from chunk c+1; on the last chunk, of the loss),
  run autograd back through the chunk, which adds into every parameter's ``.grad``, and hand
  the gradient of the inputs back to chunk c-1.
- ``I`` then ``W``: B in two halves, as the zero-bubble schedules run it. ``I`` computes only
  the gradient of the chunk's input (what chunk c-1 waits for) and keeps the graph; ``W``,
  later, the gradients of the chunk's weights from what I left (nobody waits for it, so it
  fills idle time). Both are ``torch.distributed.pipelining``'s own functions
  (``stage_backward_input``, ``stage_backward_weight``), as its executor runs them. Chunk 0
  has no input gradient to send: like torch, its I does nothing and its W runs the whole B.

Chunks next to each other on different stages exchange tensors as messages (:mod:`.p2p`);
on the same stage (the bottom of a ``zb-v`` V) the executor hands them over itself: the
receiving chunk takes them detached, as new leaves, exactly as if they had travelled, and
the gradient comes back the same way.

That is the whole of pipeline parallelism: the stages overlap because stage k+1 runs F m
while stage k runs F m+1. Nothing is averaged across stages: each parameter lives on one
stage, and its ``.grad`` after the last backward is the sum over micro-batches of
d(loss_m / M)/dparam, which is exactly the gradient of the mean loss over the whole batch.
That is why the trained weights do not depend on K, M, the schedule or the chunks.

Two executors share this interface: :class:`NativeExecutor` below (gloo, receives posted
ahead, see :mod:`.p2p`) and :class:`.torch_executor.TorchExecutor`, which runs the same
action lists with ``torch.distributed.pipelining``. The native one is the default on CPU,
where it is the faster (docs/runtime.md: "Executors" says why, "Speed" has the figures); torch's on CUDA, whose
NCCL needs torch's ordering of the sends and receives. The asynchronous schedules
(``pipedream``, ``pipedream-2bw``) run on :class:`.async_executor.AsyncExecutor`, the native
one's subclass, whose steps do not flush and whose backwards use stashed weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from ..schedules import Action, in_flight
from ..tensor_memory import element_bytes
from .memory import ActivationMeter
from .p2p import ACTIVATION, GRADIENT, Neighbours, PendingReceive
from .stage import Chunk, TensorMeta
from .timing import SpanRecorder
from .watchdog import doing

Tensors = tuple[torch.Tensor, ...]
LossFn = Callable[[Tensors, torch.Tensor], torch.Tensor]


class Executor(Protocol):
    meters_activations: bool  # whether step() measures activation memory with a meter
    loss_scale: float         # the last chunk backpropagates loss x loss_scale (fp16; see .loss_scale)

    def step(self, inputs: Tensors | None, targets: torch.Tensor | None,
             meter: ActivationMeter | None = None) -> list[torch.Tensor]:
        """Run one step's actions; return the micro-batch losses (on the stage holding the last chunk)."""
        ...


@dataclass
class _Saved:
    """What a chunk keeps of one micro-batch between its actions."""

    inputs: Tensors                          # the chunk's inputs (leaves that want their gradient)
    outputs: Tensors | torch.Tensor          # its outputs (the loss, for the last chunk)
    output_grads: Tensors | None = None      # I -> W on chunk 0: its W runs the whole backward
    param_groups: list[dict[str, Any]] = field(default_factory=list)   # I -> W: what W starts from


class NativeExecutor:
    """Runs a stage's action list with asynchronous sends and receives posted ahead."""

    meters_activations = True
    loss_scale = 1.0

    def __init__(self, chunks: list[Chunk], actions: Sequence[Sequence[Action]], stage: int, micro_batches: int,
                 loss_fn: LossFn, neighbours: Neighbours, recorder: SpanRecorder) -> None:
        self.chunks = {chunk.index: chunk for chunk in chunks}
        self.stage = stage
        self.actions = list(actions[stage])
        # Where every chunk runs, read off the lists: whom to send to, whom to receive from.
        self.stage_of = {a.chunk: k for k, stage_list in enumerate(actions) for a in stage_list}
        self.micro_batches = micro_batches
        self.loss_fn = loss_fn
        self.links = neighbours
        self.recorder = recorder
        # Gradients flow only through floating tensors; the others (token ids) need none.
        self.grad_inputs = {c: [m.carries_grad for m in chunk.input_meta] for c, chunk in self.chunks.items()}
        self.grad_outputs = {c: [m.carries_grad for m in chunk.output_meta] for c, chunk in self.chunks.items()}
        self.grad_output_meta = {c: tuple(m for m in chunk.output_meta if m.carries_grad)
                                 for c, chunk in self.chunks.items()}
        # d(what the step's gradient is of)/d(a micro-batch's mean loss): 1/M, the gradient of the
        # batch's mean (pipedream, whose every micro-batch is its own update, sets 1: .async_executor).
        self.loss_weight = 1.0 / micro_batches

    def local(self, a: int, b: int) -> bool:
        """Whether chunks ``a`` and ``b`` run on the same stage (tensors pass without a message)."""
        return self.stage_of.get(a) == self.stage_of.get(b)

    def step(self, inputs: Tensors | None, targets: torch.Tensor | None,
             meter: ActivationMeter | None = None) -> list[torch.Tensor]:
        M = self.micro_batches
        micro_inputs = list(zip(*(x.chunk(M) for x in inputs))) if inputs is not None else []
        micro_targets = list(targets.chunk(M)) if targets is not None else []
        # Receives are posted ahead, per chunk and kind, in the order the actions consume
        # them, so that the data lands while we compute. gloo moves a message only once its
        # receive is posted (the sender's data waits until then), so a receive posted when it
        # is needed costs a round trip on the critical path; posted early, nothing.
        queues = self._receive_queues()
        handed: dict[tuple[int, int, int], Tensors] = {}   # (kind, chunk, m): tensors from a chunk on this stage
        saved: dict[tuple[int, int], _Saved] = {}
        losses: list[torch.Tensor] = []
        for action in self.actions:
            c, m = action.chunk, action.micro_batch
            chunk = self.chunks[c]
            if action.kind == "F":
                if chunk.is_first:
                    xs = micro_inputs[m]
                else:
                    xs = self._take(ACTIVATION, c, m, queues, handed)
                saved[(c, m)] = self._forward(chunk, m, xs, micro_targets[m] if chunk.is_last else None, meter, handed)
                if chunk.is_last:
                    losses.append(saved[(c, m)].outputs.detach())  # type: ignore[union-attr]
                continue
            if action.kind in ("B", "I"):
                grads = None if chunk.is_last else self._take(GRADIENT, c, m, queues, handed)
                if action.kind == "B":
                    self._backward(chunk, m, saved.pop((c, m)), grads, handed)
                else:
                    self._backward_input(chunk, m, saved[(c, m)], grads, handed)
                    continue   # the activations stay held until W
            else:  # W
                self._backward_weight(chunk, m, saved.pop((c, m)))
            if meter is not None:
                meter.release((c, m))
        self.links.finish_sends()
        return losses

    # ------------------------------------------------------------------ receiving
    def _receive_queues(self) -> dict[tuple[int, int], ReceiveQueue]:
        """One queue per (kind, chunk) whose tensors come from another stage."""
        queues: dict[tuple[int, int], ReceiveQueue] = {}
        for c, chunk in self.chunks.items():
            if not chunk.is_first and not self.local(c - 1, c):
                order = [self.message_index(a.micro_batch) for a in self.actions if a.chunk == c and a.kind == "F"]
                queues[(ACTIVATION, c)] = ReceiveQueue(self.links, ACTIVATION, c - 1, self.stage_of[c - 1],
                                                       chunk.input_meta, order, self.activation_lookahead(c))
            if not chunk.is_last and not self.local(c, c + 1):
                order = [self.message_index(a.micro_batch) for a in self.actions
                         if a.chunk == c and a.kind in ("B", "I")]
                queues[(GRADIENT, c)] = ReceiveQueue(self.links, GRADIENT, c, self.stage_of[c + 1],
                                                     self.grad_output_meta[c], order, self.gradient_lookahead)
        return queues

    def message_index(self, micro_batch: int) -> int:
        """The micro-batch number a message's tag carries (:func:`.p2p.tag`): the micro-batch's own."""
        return micro_batch

    def activation_lookahead(self, chunk: int) -> int:
        """Activation receives in flight for ``chunk``: one more than the micro-batches whose
        inputs it holds at its peak anyway (``schedules.in_flight``), at most M.

        A GPipe stage holds the inputs of all M micro-batches until its backwards, so posting
        all M receives at once costs no memory, and the previous stage's forwards, run back to
        back, all go straight through. A 1F1B stage holds K - k; one more is posted ahead.
        """
        return min(self.micro_batches, in_flight(self.actions, chunk) + 1)

    # Gradient receives in flight per chunk: the next one and the one after. Each is a buffer
    # the size of the chunk's output that the plan's memory model does not count, so keep them few.
    gradient_lookahead = 2

    def _take(self, kind: int, c: int, m: int, queues: dict[tuple[int, int], ReceiveQueue],
              handed: dict[tuple[int, int, int], Tensors]) -> Tensors:
        """Chunk ``c``'s activations (or output gradients) of micro-batch ``m``, from wherever they come."""
        if (kind, c) not in queues:
            return handed.pop((kind, c, m))
        start = self.recorder.mark()
        tensors = queues[(kind, c)].take(m)
        self.recorder.add("wait", m, start, self.recorder.mark(), chunk=c)
        return tensors

    def _hand(self, kind: int, c: int, m: int, tensors: Tensors, handed: dict[tuple[int, int, int], Tensors]) -> None:
        """Give chunk ``c``'s activations (to c+1) or input gradients (to c-1) to their receiver."""
        receiver = c + 1 if kind == ACTIVATION else c - 1
        boundary = c if kind == ACTIVATION else c - 1
        if self.local(c, receiver):
            handed[(kind, receiver, m)] = tuple(t.detach() for t in tensors)
        else:
            self.links.send(kind, boundary, m, tensors, self.stage_of[receiver])

    # ------------------------------------------------------------------ actions
    def _forward(self, chunk: Chunk, m: int, xs: Tensors, target: torch.Tensor | None,
                 meter: ActivationMeter | None, handed: dict[tuple[int, int, int], Tensors]) -> _Saved:
        doing(f"computing the forward of micro-batch {m} on chunk {chunk.index}")
        start = self.recorder.mark()
        if not chunk.is_first:
            # The received activations are leaves of this chunk's graph: ask for their
            # gradient, which the backward hands back to the chunk before.
            xs = tuple(x.requires_grad_() if g else x for x, g in zip(xs, self.grad_inputs[chunk.index]))
        with self._metering(meter, chunk, m, xs):
            outputs = chunk.module(*xs)
        if chunk.is_last:
            assert target is not None
            result = _Saved(xs, self.loss_fn(outputs, target))
        else:
            self._hand(ACTIVATION, chunk.index, m, outputs, handed)
            result = _Saved(xs, outputs)
        self.recorder.add("forward", m, start, self.recorder.mark(), chunk=chunk.index)
        return result

    def _roots(self, chunk: Chunk, saved: _Saved,
               grads: Tensors | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Where the chunk's backward starts: its outputs that carry a gradient and those gradients
        (on the last chunk, the loss times ``loss_weight``, 1/M, times the fp16 loss scale, and a
        gradient of one)."""
        if chunk.is_last:
            assert isinstance(saved.outputs, torch.Tensor)
            # d(mean over the batch)/d(loss of micro-batch m) = 1/M (times the fp16 loss scale).
            loss = saved.outputs * (self.loss_scale * self.loss_weight)
            return [loss], [torch.ones_like(loss)]
        assert grads is not None and isinstance(saved.outputs, tuple)
        carrying = [o for o, g in zip(saved.outputs, self.grad_outputs[chunk.index]) if g]
        pairs = [(o, g) for o, g in zip(carrying, grads) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _input_grads(self, chunk: Chunk, xs: Tensors, grads: Sequence[torch.Tensor | None]) -> Tensors:
        # An input the chunk did not use has no gradient: send zeros, the receiver waits for them.
        return tuple(g if g is not None else torch.zeros_like(x)
                     for x, g, carries in zip(xs, grads, self.grad_inputs[chunk.index]) if carries)

    def _backward(self, chunk: Chunk, m: int, saved: _Saved, grads: Tensors | None,
                  handed: dict[tuple[int, int, int], Tensors]) -> None:
        doing(f"computing the backward of micro-batch {m} on chunk {chunk.index}")
        start = self.recorder.mark()
        roots, root_grads = self._roots(chunk, saved, grads)
        if roots:
            torch.autograd.backward(roots, root_grads)
        if not chunk.is_first:
            self._hand(GRADIENT, chunk.index, m, self._input_grads(chunk, saved.inputs,
                                                                    [x.grad for x in saved.inputs]), handed)
        self.recorder.add("backward", m, start, self.recorder.mark(), chunk=chunk.index)

    def _backward_input(self, chunk: Chunk, m: int, saved: _Saved, grads: Tensors | None,
                        handed: dict[tuple[int, int, int], Tensors]) -> None:
        doing(f"computing the input gradient of micro-batch {m} on chunk {chunk.index}")
        start = self.recorder.mark()
        roots, root_grads = self._roots(chunk, saved, grads)
        if chunk.is_first:
            # No input gradient to compute: W runs the whole backward (torch does the same).
            saved.outputs, saved.output_grads = tuple(roots), tuple(root_grads)
        else:
            # stage_backward_input detaches the roots in place when done, which a view refuses:
            # give it a copy of those (the copy's gradient is the identity).
            roots = [r.clone() if r._is_view() else r for r in roots]
            dinputs, saved.param_groups = stage_backward_input(roots, root_grads, list(saved.inputs),
                                                               chunk.module.parameters())
            self._hand(GRADIENT, chunk.index, m, self._input_grads(chunk, saved.inputs, dinputs), handed)
            saved.outputs = ()
        saved.inputs = ()   # W needs only what I kept
        self.recorder.add("backward_input", m, start, self.recorder.mark(), chunk=chunk.index)

    def _backward_weight(self, chunk: Chunk, m: int, saved: _Saved) -> None:
        doing(f"computing the weight gradient of micro-batch {m} on chunk {chunk.index}")
        start = self.recorder.mark()
        if chunk.is_first:
            roots = list(saved.outputs)
            if roots:
                torch.autograd.backward(roots, list(saved.output_grads or ()))
        else:
            stage_backward_weight(chunk.module.parameters(), saved.param_groups)
        self.recorder.add("backward_weight", m, start, self.recorder.mark(), chunk=chunk.index)

    def _metering(self, meter: ActivationMeter | None, chunk: Chunk, m: int,
                  xs: Tensors) -> contextlib.AbstractContextManager[None]:
        if meter is None:
            return contextlib.nullcontext()
        if chunk.module.recompute:
            # Checkpointing keeps only the inputs; while it recomputes one micro-batch in the
            # backward, that one's activations are live too: measure them once.
            meter.hold((chunk.index, m), sum(element_bytes(x) for x in xs))
            if meter.transient_bytes == 0:
                meter.transient_bytes = meter.measure_once(chunk.module.run_layers, *xs)
            return contextlib.nullcontext()
        return meter.forward((chunk.index, m))


class ReceiveQueue:
    """Receives of one kind for one chunk, from one peer stage, posted ``depth`` ahead of their use."""

    def __init__(self, links: Neighbours, kind: int, boundary: int, peer: int, metas: tuple[TensorMeta, ...],
                 order: list[int], depth: int) -> None:
        self.links, self.kind, self.boundary, self.peer, self.metas = links, kind, boundary, peer, metas
        self.order = order
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
            self.posted[m] = self.links.post_receive(self.kind, self.boundary, m, self.metas, self.peer)
            self.next += 1
