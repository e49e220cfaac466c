"""The same chunks and the same action lists, run by ``torch.distributed.pipelining``.

torch's pipelining package runs ``PipelineStage`` objects (one per chunk: torch's "stage" is
our chunk) under a schedule object. Its ``_PipelineScheduleRuntime`` executes any per-rank
list of compute actions (F, B, I, W on a chunk and micro-batch): it adds the sends and
receives itself (``_prepare_schedule_with_comms``), hands tensors between two adjacent chunks
of one rank without a message, and splits the backward with ``stage_backward_input`` and
``stage_backward_weight``. We give it the planner's own lists (gpipe_plan.schedules), not one
of torch's built-in schedule classes, so that what runs is what the planner simulated, for
every schedule, whatever orders torch's classes would build.

Three things make it run, and train the right weights, on gloo/CPU (docs/runtime.md, "Executors"):

- static metadata: left to infer shapes, chunks exchange them with blocking sends that
  deadlock on gloo. We pass ``input_args`` (requiring gradients on every chunk but the first)
  and ``output_args``; torch 2.13 also takes the gradients' metadata, ``output_grads`` (every
  chunk but the last) and ``input_grads`` (every chunk but the first), and without them its
  first chunk receives ``None`` gradients;
- ``loss_fn`` on every rank: a schedule built without it skips the backward;
- the gradient of the mean over the batch: the loss each last-chunk backward starts from is
  the micro-batch's loss / M, as in the native executor, and torch's own division by M is
  off (``scale_grads=False``). torch divides each chunk's ``.grad`` after its last backward,
  so a parameter two chunks of one rank share (a tied embedding at both ends of a ``zb-v``
  V) would be divided twice.

The torch that runs us is not always the one we develop with (a GPU image may ship an older
one), so we read which of these arguments and classes it has (:func:`pipelining_features`),
pass only those, and refuse in one line what a run needs and it lacks.

We time each chunk's forward, backward and, under a split backward, input and weight halves
by overriding ``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk``:
the spans cover the computation, not the waits for neighbours.

This is the executor the CUDA/NCCL path uses: torch orders every rank's sends and receives
so that matching pairs meet, which NCCL needs.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from ..artifacts import BadInput
from ..schedules import Action
from .executor import LossFn, Tensors
from ..tensor_memory import element_bytes
from .memory import ActivationMeter
from .stage import Chunk
from .timing import SpanRecorder
from .watchdog import doing

# The runtime that executes a given per-rank action list: private in torch, so looked up
# rather than imported (an older torch lacks it; pipelining_features says so).
_RUNTIME = getattr(torch_schedules, "_PipelineScheduleRuntime", None)


class _TimedChunk(PipelineStage):
    """A ``PipelineStage`` (one chunk) that records a span for every computation it runs."""

    recorder: SpanRecorder
    meter: ActivationMeter | None = None
    measured_transient_for: ActivationMeter | None = None

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):  # type: ignore[override]
        what = self._computing("forward", fwd_chunk_id)
        start = self.recorder.mark()
        with self._metering(fwd_chunk_id, args):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.recorder.add("forward", fwd_chunk_id, start, self.recorder.mark(), chunk=self.stage_index)
        self._done(what)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):  # type: ignore[override]
        what = self._computing("backward" if full_backward else "input gradient", bwd_chunk_id)
        start = self.recorder.mark()
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if full_backward and self.meter is not None:
            self.meter.release((self.stage_index, bwd_chunk_id))
        kind = "backward" if full_backward else "backward_input"
        self.recorder.add(kind, bwd_chunk_id, start, self.recorder.mark(), chunk=self.stage_index)
        self._done(what)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):  # type: ignore[override]
        what = self._computing("weight gradient", bwd_chunk_id)
        start = self.recorder.mark()
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        # The graph the input half leaves for the weight half holds the activations until now.
        if self.meter is not None:
            self.meter.release((self.stage_index, bwd_chunk_id))
        self.recorder.add("backward_weight", bwd_chunk_id, start, self.recorder.mark(), chunk=self.stage_index)
        self._done(what)

    def _computing(self, kind: str, micro_batch: int) -> str:
        """Tell the watchdog (runtime/watchdog.py) what this rank computes now; return that."""
        what = f"the {kind} of micro-batch {micro_batch} on chunk {self.stage_index}"
        doing(f"computing {what}")
        return what

    @staticmethod
    def _done(what: str) -> None:
        # Until the next computation, torch's schedule sends and waits for the neighbours' messages.
        doing(f"in torch's schedule after {what}: sending or waiting for a neighbour", waiting=True)

    def perform_reduce_grad(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # Under fsdp torch reduce-scatters here after the chunk's last backward: the step's sync.
        start = self.recorder.mark()
        super().perform_reduce_grad(*args, **kwargs)
        if isinstance(self.submod, FSDPModule):
            self.recorder.add("gradient_sync", -1, start, self.recorder.mark(), chunk=self.stage_index)

    def _metering(self, micro_batch: int, args: Tensors) -> contextlib.AbstractContextManager[None]:
        meter, key = self.meter, (self.stage_index, micro_batch)
        if meter is None:
            return contextlib.nullcontext()
        if self.submod.recompute:  # as in the native executor: inputs kept, one rerun live
            xs = args if self.is_first else tuple(info.buffer for info in self.args_recv_info[micro_batch])
            meter.hold(key, sum(element_bytes(x) for x in xs if isinstance(x, torch.Tensor)))
            if self.measured_transient_for is not meter:   # once per chunk: the largest rerun counts
                self.measured_transient_for = meter
                meter.transient_bytes = max(meter.transient_bytes, meter.measure_once(self.submod.run_layers, *xs))
            return contextlib.nullcontext()
        return meter.forward(key)


@dataclass(frozen=True)
class PipeliningFeatures:
    """What the installed ``torch.distributed.pipelining`` has, read off its classes."""

    action_runtime: bool  # _PipelineScheduleRuntime._prepare_schedule_with_comms: runs a given action list
    static_shapes: bool   # PipelineStage(input_args=, output_args=): no shape inference at run time
    grad_metas: bool      # PipelineStage(output_grads=, input_grads=): torch 2.13's gradient metadata
    scale_grads: bool     # the runtime takes scale_grads= (we turn torch's division by M off)
    return_outputs: bool  # step(return_outputs=): the last chunk need not keep every output


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return set()


def _init_parameters(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` takes, up its bases (the runtime's own ``__init__``
    takes ``*args, **kwargs`` and passes them on)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            names |= _parameters(vars(klass)["__init__"])
    return names


def pipelining_features(stage_class: type = PipelineStage, runtime_class: type | None = _RUNTIME) -> PipeliningFeatures:
    """Which of the classes and arguments this executor relies on the installed torch has."""
    stage = _parameters(stage_class.__init__)
    runtime = _init_parameters(runtime_class) if runtime_class is not None else set()
    step = _parameters(runtime_class.step) if runtime_class is not None else set()
    lowering = getattr(runtime_class, "_prepare_schedule_with_comms", None) if runtime_class is not None else None
    return PipeliningFeatures(
        action_runtime=callable(lowering),
        static_shapes={"input_args", "output_args"} <= stage,
        grad_metas={"output_grads", "input_grads"} <= stage,
        scale_grads="scale_grads" in runtime,
        return_outputs="return_outputs" in step)


def check_features(features: PipeliningFeatures) -> None:
    """Refuse in one line (:class:`BadInput`) a torch that lacks what every run needs."""
    missing = [what for what, have in (
        ("_PipelineScheduleRuntime._prepare_schedule_with_comms (it runs a given action list)", features.action_runtime),
        ("PipelineStage(input_args=, output_args=)", features.static_shapes)) if not have]
    if missing:
        raise BadInput(f"the installed torch {torch.__version__} lacks {missing[0]}, which --executor torch needs: "
                       f"upgrade torch (2.13 is tested), or use --executor native (CPU)")


def pipeline_stage_arguments(chunk: Chunk, device: torch.device, features: PipeliningFeatures) -> dict[str, Any]:
    """The keyword arguments of ``PipelineStage`` for ``chunk``, as far as this torch takes them."""

    def example(metas: tuple[Any, ...], grad: bool) -> Tensors:
        return tuple(m.empty(device).requires_grad_(grad and m.carries_grad) for m in metas)

    arguments: dict[str, Any] = {"input_args": example(chunk.input_meta, grad=not chunk.is_first),
                                 "output_args": example(chunk.output_meta, grad=False)}
    if features.grad_metas:
        arguments["output_grads"] = None if chunk.is_last else example(chunk.output_meta, grad=False)
        arguments["input_grads"] = None if chunk.is_first else example(chunk.input_meta, grad=False)
    return arguments


def torch_actions(actions: Sequence[Sequence[Action]],
                  group_ranks: Sequence[int] | None = None) -> dict[int, list[Any]]:
    """Every stage's list as torch's compute-only schedule: ``{rank: [_Action, ...]}``.

    The two spell an action alike (chunk, kind F/B/I/W, micro-batch: torch's stage_index is
    our chunk), so this is a change of type only. torch keys the lists by the rank *in the
    pipeline's process group*: stage k's is ``group_ranks[k]`` (data parallel: the place of
    rank ``ranks[k][r]`` in replica r's ``pp`` group), stage k's own index with one replica.
    """
    kind = torch_schedules._ComputationType
    key = list(group_ranks) if group_ranks is not None else list(range(len(actions)))
    return {key[k]: [torch_schedules._Action(a.chunk, kind(a.kind), a.micro_batch) for a in row]
            for k, row in enumerate(actions)}


def _action_list_runtime(chunks: list[_TimedChunk], micro_batches: int, loss_fn: LossFn,
                         actions: Sequence[Sequence[Action]], features: PipeliningFeatures,
                         group_ranks: Sequence[int] | None = None) -> Any:
    """torch's runtime, set to run ``actions`` (every rank's list: torch lowers them all, to
    place each receive against its send)."""
    assert _RUNTIME is not None  # check_features refused a torch without it
    options: dict[str, Any] = {"loss_fn": loss_fn}
    if features.scale_grads:
        options["scale_grads"] = False
    runtime = _RUNTIME(chunks, micro_batches, **options)
    order = torch_actions(actions, group_ranks)
    runtime.pipeline_order = {rank: list(row) for rank, row in order.items()}   # what _dump_csv writes
    runtime._prepare_schedule_with_comms(order)
    return runtime


class TorchExecutor:
    """Runs one stage's chunks under ``torch.distributed.pipelining``, in the planner's order."""

    meters_activations = True
    loss_scale = 1.0

    def __init__(self, chunks: list[Chunk], actions: Sequence[Sequence[Action]], stage: int, micro_batches: int,
                 loss_fn: LossFn, device: torch.device, recorder: SpanRecorder,
                 features: PipeliningFeatures | None = None, group: dist.ProcessGroup | None = None,
                 group_ranks: Sequence[int] | None = None) -> None:
        """``group``: the pipeline's process group (data parallel: this replica's ``pp`` group; None:
        the world), ``group_ranks[k]``: stage k's rank in it."""
        features = features or pipelining_features()
        check_features(features)
        # In pipeline order: torch's start-up exchange between ranks walks the chunks that way.
        self.chunks = sorted(chunks, key=lambda c: c.index)
        self.stage = stage
        self.micro_batches = micro_batches
        self.holds_first = any(c.is_first for c in self.chunks)
        self.holds_last = any(c.is_last for c in self.chunks)
        self.return_outputs = features.return_outputs
        self.pipe_chunks: list[_TimedChunk] = []
        for chunk in self.chunks:
            arguments = pipeline_stage_arguments(chunk, device, features)
            if group is not None:
                arguments["group"] = group
            pipe_chunk = _TimedChunk(chunk.module, chunk.index, chunk.num_chunks, device, **arguments)
            pipe_chunk.recorder = recorder
            self.pipe_chunks.append(pipe_chunk)
        self.losses: list[torch.Tensor] = []

        def loss(outputs: Tensors, target: torch.Tensor) -> torch.Tensor:
            value = loss_fn(outputs, target)
            self.losses.append(value.detach())
            # What the backward starts from: the mean over the batch (see the module's docstring).
            return value * (self.loss_scale / self.micro_batches)

        self.runtime = _action_list_runtime(self.pipe_chunks, micro_batches, loss, actions, features, group_ranks)

    def step(self, inputs: Tensors | None, targets: torch.Tensor | None,
             meter: ActivationMeter | None = None) -> list[torch.Tensor]:
        for pipe_chunk in self.pipe_chunks:
            pipe_chunk.meter = meter
        self.losses = []
        args = inputs if self.holds_first and inputs is not None else ()
        options: dict[str, Any] = {"return_outputs": False} if self.return_outputs else {}
        self.runtime.step(*args, target=targets if self.holds_last else None, **options)
        return self.losses
