"""The asynchronous pipelines on the native executor: PipeDream's 1F1B without a flush.

The rules are :mod:`gpipe_plan.weight_versions`' (which weights each micro-batch meets, when
a stage updates); the order is :func:`gpipe_plan.schedules.segment_actions` (1F1B over a
whole segment's micro-batches). This module only carries them out, step after step, on the
one chunk each stage holds. The one-process :func:`.async_reference.reference_run` computes
the same numbers without a pipeline, and the tests hold a run to it (1e-5).

[Note: segments and steps]
A *segment* is the steps between two drains: the run's start (or a resume) to the next
checkpoint, checkpoint to checkpoint, the last one to the run's end (docs/runtime.md,
"Asynchronous pipelines"). Inside a segment nothing flushes, so one step's actions are not a
list of their own: stage k's call for step s runs the segment's list from where the call for
step s-1 stopped up to and including its backward of step s's last micro-batch. On the way it
runs forwards of the next step's first micro-batches (the 1F1B warm-up of stage k is K - k
forwards deep), so the batch of step s+1 (of s+2, when M < K - 1) is drawn early on stage 0:
batches are a function of (seed, step), so drawing early changes nothing. Each call holds
exactly step s's backwards, so every update it applies is step s's (its learning rate, its
loss), and the last stage, whose warm-up is one forward, has all of step s's losses at its end.

What lives across the calls of a segment is :class:`_Segment`: the cursor into the list,
the receive queues (posted ahead over the whole segment, so a step's first messages are
already landing while the last step finishes: the queues never restart inside a segment), the
micro-batches in flight (forward done, backward not) with the weights they used, the stashed
versions, and the count of updates. Sends are not waited for at a step's end (the receiver
may post its receive only in its next step, after the step's loss exchange: waiting would
deadlock); they complete as the peers go on, and are all waited for at the segment's end,
where every message of the segment has been consumed by its receiver's own last step.
Message tags number the micro-batches from the segment's start, modulo what a tag holds.

[Note: weight stashing]
The module's parameters are always the *newest* weights: the run's own optimizer updates
them in place. A micro-batch's forward uses ``version_used(...)``, the weights after that
many of the segment's updates of this stage, and its backward must use the very same
tensors. A forward that no update separates from its backward (the last stage under
``pipedream``, and the first step's under ``pipedream-2bw``) uses the live parameters; every
other forward uses a stashed copy, run through ``torch.func.functional_call`` with the
module's buffers its own. A copy of the newest weights is taken when a forward first needs it,
or just before an update when a later forward will still meet the weights the update is about
to change (2bw's step t uses t - 1 updates while t are done on the last stage). A version is
dropped as soon as no forward to come uses it (``version_used`` never decreases with the
micro-batch); the micro-batches in flight hold their own reference until their backward.
Backwards compute their weights' gradients with ``torch.autograd.grad`` against the tensors
the forward used and add them to the live parameters' ``.grad``, so the update (gradient
sync across replicas, optimizer step) is the synchronous path's, per micro-batch or per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..schedules import Action, segment_actions
from ..tensor_memory import storage_key
from ..weight_versions import updates_per_step, version_used
from .executor import LossFn, NativeExecutor, ReceiveQueue, Tensors, _Saved
from .memory import ActivationMeter
from .p2p import ACTIVATION, GRADIENT, MAX_MICRO_BATCHES, Neighbours
from .stage import Chunk
from .timing import SpanRecorder
from .watchdog import doing

# (inputs, targets) of one step, either None on a stage that does not read it.
StepBatch = tuple[Tensors | None, torch.Tensor | None]


@dataclass
class _InFlight(_Saved):
    """One micro-batch between its forward and its backward on this stage: what the synchronous
    executor keeps (its inputs, its outputs or loss), and the weights it met."""

    weights: list[torch.Tensor] = field(default_factory=list)   # the forward's tensors: the backward's too


@dataclass
class _Segment:
    """What a stage carries from one step to the next, until the drain (see the Notes)."""

    first_step: int
    steps: int
    actions: list[Action]                  # segment_actions: micro-batches numbered from the segment's start
    updates_at_backward: dict[int, int]    # micro-batch -> this stage's updates done when its backward runs
    queues: dict[tuple[int, int], ReceiveQueue]
    cursor: int = 0                        # the next action to run
    forwards_done: int = 0                 # forwards run: the next forward's micro-batch
    updates: int = 0                       # this stage's updates since the segment's start
    in_flight: dict[int, _InFlight] = field(default_factory=dict)
    versions: dict[int, list[torch.Tensor]] = field(default_factory=dict)   # update count -> stashed weights
    batches: dict[int, tuple[list[Tensors], list[torch.Tensor]]] = field(default_factory=dict)   # step -> micro


class AsyncExecutor(NativeExecutor):
    """Runs ``pipedream`` / ``pipedream-2bw`` on one chunk per stage, one segment at a time.

    Two functions of the train loop, which sets them before the first step: ``batch_of(step)``
    draws a step's batch (this replica's rows, on the device), and ``apply_update()`` applies
    the gradient in the live parameters' ``.grad`` to them (the replicas' gradient sync, the
    optimizer step, zeroing), called when the rules say: after each backward under
    ``pipedream``, after the step's last under ``pipedream-2bw``.
    """

    def __init__(self, chunks: list[Chunk], schedule: str, stage: int, stages: int, micro_batches: int,
                 loss_fn: LossFn, neighbours: Neighbours, recorder: SpanRecorder,
                 batch_of: Callable[[int], StepBatch] | None = None,
                 apply_update: Callable[[], None] | None = None) -> None:
        (self.chunk,) = chunks   # the asynchronous schedules keep one chunk per stage (plan_layout)
        super().__init__(chunks, [segment_actions(k, stages, micro_batches, 1) for k in range(stages)], stage,
                         micro_batches, loss_fn, neighbours, recorder)
        self.schedule, self.stages = schedule, stages
        self.batch_of: Callable[[int], StepBatch] = batch_of or _unset
        self.apply_update: Callable[[], None] = apply_update or _unset
        # pipedream: each micro-batch is its own update, of its own mean loss; 2bw: one update of
        # the step's mean loss (1/M of each micro-batch's), as the synchronous schedules.
        self.update_every_micro_batch = updates_per_step(schedule, micro_batches) == micro_batches
        self.loss_weight = 1.0 if self.update_every_micro_batch else 1.0 / micro_batches
        self.names = [name for name, _ in self.chunk.module.named_parameters()]
        self.live = [p for _, p in self.chunk.module.named_parameters()]
        self.segment: _Segment | None = None

    # ------------------------------------------------------------------ segments
    def begin_segment(self, first_step: int, steps: int) -> None:
        """Start a segment of ``steps`` steps at ``first_step``, from the newest weights."""
        assert self.segment is None, "the previous segment did not drain"
        actions = segment_actions(self.stage, self.stages, self.micro_batches, steps)
        self.actions = actions   # what activation_lookahead reads (schedules.in_flight)
        self.segment = _Segment(first_step, steps, actions, self._updates_at_backward(actions),
                                self._receive_queues())

    def _updates_at_backward(self, actions: Sequence[Action]) -> dict[int, int]:
        """Replay the order: how many updates precede each backward; check the rules' versions
        are ones the stage holds by each forward (not a version yet to be computed)."""
        done, at_backward = 0, {}
        for a in actions:
            if a.kind == "F" and self._version(a.micro_batch) > done:
                raise RuntimeError(f"{self.schedule}: micro-batch {a.micro_batch} on stage {self.stage} needs update "
                                   f"{self._version(a.micro_batch)}, but its forward comes after {done}")
            if a.kind == "B":
                at_backward[a.micro_batch] = done
                done += int(self._updates_after(a.micro_batch))
        return at_backward

    def message_index(self, micro_batch: int) -> int:
        # Tags number a segment's micro-batches modulo what a tag holds: messages of one kind
        # on one link that share a tag are MAX_MICRO_BATCHES micro-batches apart, never in flight together.
        return micro_batch % MAX_MICRO_BATCHES

    def _version(self, micro_batch: int) -> int:
        return version_used(self.schedule, self.stage, self.stages, self.micro_batches, micro_batch)

    def _updates_after(self, micro_batch: int) -> bool:
        """Whether this stage updates right after the backward of ``micro_batch``."""
        return self.update_every_micro_batch or micro_batch % self.micro_batches == self.micro_batches - 1

    # ------------------------------------------------------------------ one step
    def step(self, inputs: Tensors | None, targets: torch.Tensor | None,
             meter: ActivationMeter | None = None, *, step: int = 0) -> list[torch.Tensor]:
        """Run the segment's actions through this stage's backward of step ``step``'s last
        micro-batch; return step ``step``'s micro-batch losses (on the last stage).

        ``inputs`` and ``targets`` are ignored: batches come from ``batch_of``, which may be
        asked for later steps (see the Notes)."""
        seg = self.segment
        assert seg is not None and seg.first_step <= step < seg.first_step + seg.steps, "no segment holds this step"
        M = self.micro_batches
        last = (step - seg.first_step + 1) * M - 1
        losses: list[torch.Tensor] = []
        while seg.cursor < len(seg.actions):
            action = seg.actions[seg.cursor]
            seg.cursor += 1
            i = action.micro_batch
            if action.kind == "F":
                xs, target = self._micro_batch(seg, i)
                flight = self._forward_stashed(seg, i, xs, target, meter)
                seg.in_flight[i] = flight
                seg.forwards_done += 1
                if self.chunk.is_last:
                    losses.append(flight.outputs.detach())   # type: ignore[union-attr]
                continue
            grads = None if self.chunk.is_last else self._take(GRADIENT, self.chunk.index, self.message_index(i),
                                                                 seg.queues, {})
            self._backward_stashed(i, seg.in_flight.pop(i), grads)
            if meter is not None:
                meter.release((self.chunk.index, i))
            if self._updates_after(i):
                self._update(seg)
            if i == last:
                break
        if seg.cursor == len(seg.actions):   # the drain: every message of the segment is consumed
            assert not seg.in_flight
            self.links.finish_sends()
            self.segment = None
        else:
            self.links.forget_completed_sends()
        return losses

    def _micro_batch(self, seg: _Segment, i: int) -> tuple[Tensors, torch.Tensor | None]:
        """Micro-batch ``i``'s inputs (received, or from the data on stage 0) and targets (last stage)."""
        step, m = seg.first_step + i // self.micro_batches, i % self.micro_batches
        if (self.chunk.is_first or self.chunk.is_last) and step not in seg.batches:
            for old in [s for s in seg.batches if s < step]:
                del seg.batches[old]
            inputs, targets = self.batch_of(step)
            M = self.micro_batches
            seg.batches[step] = (list(zip(*(x.chunk(M) for x in inputs))) if inputs is not None else [],
                                 list(targets.chunk(M)) if targets is not None else [])
        if self.chunk.is_first:
            xs = seg.batches[step][0][m]
        else:
            xs = self._take(ACTIVATION, self.chunk.index, self.message_index(i), seg.queues, {})
        return xs, seg.batches[step][1][m] if self.chunk.is_last else None

    # ------------------------------------------------------------------ versions
    def _weights_for(self, seg: _Segment, i: int) -> list[torch.Tensor]:
        """The tensors micro-batch ``i``'s forward (and so its backward) uses on this stage."""
        v = self._version(i)
        if v == seg.updates == seg.updates_at_backward[i]:
            return self.live          # no update comes between its forward and its backward
        if v not in seg.versions:
            if v != seg.updates:
                raise RuntimeError(f"stage {self.stage} dropped version {v} that micro-batch {i} needs")
            seg.versions[v] = self._snapshot()
        return seg.versions[v]

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone().requires_grad_(p.requires_grad) for p in self.live]

    def _update(self, seg: _Segment) -> None:
        """Apply the gradient in ``.grad`` to the newest weights, keeping what later forwards meet."""
        coming = seg.forwards_done < len(seg.updates_at_backward)
        if coming and seg.updates not in seg.versions and self._version(seg.forwards_done) <= seg.updates:
            seg.versions[seg.updates] = self._snapshot()   # a later forward meets the weights about to change
        self.apply_update()
        seg.updates += 1
        oldest = self._version(seg.forwards_done) if coming else seg.updates + 1
        for v in [v for v in seg.versions if v < oldest]:
            del seg.versions[v]

    # ------------------------------------------------------------------ actions
    def _forward_stashed(self, seg: _Segment, i: int, xs: Tensors, target: torch.Tensor | None,
                         meter: ActivationMeter | None) -> _InFlight:
        chunk = self.chunk
        doing(f"computing the forward of micro-batch {i} of the segment on chunk {chunk.index}")
        start = self.recorder.mark()
        if not chunk.is_first:
            xs = tuple(x.requires_grad_() if g else x for x, g in zip(xs, self.grad_inputs[chunk.index]))
        weights = self._weights_for(seg, i)
        if meter is not None and weights is not self.live:   # stashed weights are not activations
            meter.exclude |= {storage_key(w) for w in weights}
        with self._metering(meter, chunk, i, xs):
            if weights is self.live:
                outputs = chunk.module(*xs)
            else:
                outputs = torch.func.functional_call(chunk.module, dict(zip(self.names, weights)), xs, strict=False)
        if chunk.is_last:
            assert target is not None
            flight = _InFlight(xs, self.loss_fn(outputs, target), weights=weights)
        else:
            self.links.send(ACTIVATION, chunk.index, self.message_index(i), outputs, self.stage_of[chunk.index + 1])
            flight = _InFlight(xs, outputs, weights=weights)
        self.recorder.add("forward", i, start, self.recorder.mark(), chunk=chunk.index)
        return flight

    def _backward_stashed(self, i: int, flight: _InFlight, grads: Tensors | None) -> None:
        """Backpropagate micro-batch ``i`` through the weights its forward used; add their
        gradients to the live parameters' ``.grad``; send the inputs' gradient back."""
        chunk = self.chunk
        doing(f"computing the backward of micro-batch {i} of the segment on chunk {chunk.index}")
        start = self.recorder.mark()
        roots, root_grads = self._roots(chunk, flight, grads)
        wants_input = [x for x, g in zip(flight.inputs, self.grad_inputs[chunk.index]) if g] if not chunk.is_first \
            else []
        weights = [w for w in flight.weights if w.requires_grad]
        found = torch.autograd.grad(roots, wants_input + weights, root_grads, allow_unused=True) if roots else \
            (None,) * (len(wants_input) + len(weights))
        by_weight = dict(zip(map(id, weights), found[len(wants_input):]))
        for live, used in zip(self.live, flight.weights):
            g = by_weight.get(id(used))
            if g is not None:
                live.grad = g if live.grad is None else live.grad.add_(g)
        if not chunk.is_first:
            input_grads = iter(found[:len(wants_input)])
            per_input = [next(input_grads) if g else None for g in self.grad_inputs[chunk.index]]
            self.links.send(GRADIENT, chunk.index - 1, self.message_index(i),
                            self._input_grads(chunk, flight.inputs, per_input), self.stage_of[chunk.index - 1])
        self.recorder.add("backward", i, start, self.recorder.mark(), chunk=chunk.index)


def _unset(*_: object) -> None:
    raise RuntimeError("the train loop did not give the executor its batch_of and apply_update")
