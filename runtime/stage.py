"""One chunk: a contiguous run of the plan's layers, cut out of the whole model.

A stage (a device, one rank) holds one chunk, or several (``interleaved``, ``zb-v``): a
:class:`Chunk` is what ``torch.distributed.pipelining`` calls a ``PipelineStage``, and
:class:`StageChunks` is everything one rank holds, seen as one model (its parameters, state
dict, the optimizer's parameters).

Every rank builds the model from the plan's spec and the seed on the meta device (no memory
for its parameters), and makes only its own chunks' layers real: each layer's initial values
depend on the seed and the layer's place in the model only (models/materialize.py), so every
rank starts from the very parameters the unsplit model would (no weights travel) and holds
its stage's share of them. The layers' parameters are the whole model's own Parameter objects
(a parameter two chunks of one rank use, a tied embedding, is one object there); the chunk
only remembers which ``state_dict`` keys they are, so that a trained pipeline saves as the
user's unsplit model.

A chunk receives a tuple of tensors and sends a tuple of tensors. Their shapes are static:
the plan carries them per sample (from the profile); without them we run one micro-batch
through the layers here, once, and read them off. Knowing the shapes up front is what lets a
stage post its receives before the data is sent (no shape handshake per micro-batch), and is
what ``torch.distributed.pipelining`` needs to avoid deadlocks on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..artifacts import BadInput
from ..models import LayeredModel, Precision, forward_streamed, materialize_layers, release_layers
from ..models.precision import Autocast, no_autocast
from ..plan_view import ChunkPlan, PlanView
from ..tensor_memory import unique_bytes

Tensors = tuple[torch.Tensor, ...]

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class TensorMeta:
    """Shape (with the micro-batch dimension) and dtype of one tensor crossing a cut."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def carries_grad(self) -> bool:
        """Only floating tensors have gradients; token ids and masks pass through without."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


class ChunkModule(nn.Module):
    """A contiguous run of layers, called as ``chunk(*xs) -> tuple``, like each layer.

    With ``recompute``, the forward keeps only the chunk's inputs and runs again during the
    backward to rebuild the activations it needs (``torch.utils.checkpoint``): memory for
    one micro-batch's activations instead of every in-flight one's, paid for with one more
    forward per micro-batch.

    The layers run in ``autocast``, the plan's precision (models.precision; a no-op in fp32):
    inside the checkpoint too, so that the rerun computes in the same dtypes.
    """

    def __init__(self, layers: list[tuple[str, nn.Module]], recompute: bool = False,
                 autocast: Autocast = no_autocast) -> None:
        super().__init__()
        self.names = [name for name, _ in layers]
        # A ModuleList registers the layers as submodules: parameters(), to() and
        # state_dict() of the chunk see exactly the chunk's layers.
        self.layers = nn.ModuleList(layer for _, layer in layers)
        self.recompute = recompute
        self.autocast = autocast
        # What the first forward must return (set by build_chunk; see check_outputs).
        self.expected_outputs: tuple[TensorMeta, ...] | None = None
        self.label = "the chunk"

    def run_layers(self, *xs: torch.Tensor) -> Tensors:
        with self.autocast():
            for layer in self.layers:
                xs = layer(*xs)
        return xs

    def forward(self, *xs: torch.Tensor) -> Tensors:
        if self.recompute and torch.is_grad_enabled():
            # Non-reentrant checkpointing: works when some inputs need no gradient (token ids)
            # and restores the RNG state for the rerun, so the rerun computes the same values.
            outputs = checkpoint(self.run_layers, *xs, use_reentrant=False)
        else:
            outputs = self.run_layers(*xs)
        if self.expected_outputs is not None:
            self.check_outputs(outputs)
        return outputs

    def check_outputs(self, outputs: Tensors) -> None:
        """Refuse, in one line, a first forward whose outputs are not what the plan declared.

        The plan's shapes and dtypes were measured by the profile, in its precision and on its
        device; run elsewhere (another precision, a CPU's autocast rules for a CUDA plan) the
        chunk computes others, and the next chunk would receive bytes it cannot read (gloo
        aborts the process). Checked once: shapes do not change from step to step.
        """
        expected, self.expected_outputs = self.expected_outputs or (), None
        got = tuple(TensorMeta(tuple(o.shape), o.dtype) for o in outputs)
        for i, (have, want) in enumerate(zip(got, expected)):
            if have != want:
                # Another dtype: another precision's or device's autocast rules; another shape
                # in the same dtype: the model itself changed (a width, a sequence length).
                cause = ("the model's code or configuration changed since it was profiled" if have.dtype == want.dtype
                         else "the plan was profiled in another precision or on another device")
                raise BadInput(f"{self.label}'s output {i} is {_describe(have)} but the plan declares "
                               f"{_describe(want)}: {cause}; profile here, in the precision of the run, and solve "
                               f"again")
        if len(got) != len(expected):
            raise BadInput(f"{self.label} returns {len(got)} tensors but the plan declares {len(expected)}: "
                           f"profile the model again and solve again")


@dataclass
class Chunk:
    """One chunk: its layers, what it receives and sends, and its parameters' names."""

    index: int                             # place in the pipeline order (torch's stage_index)
    num_chunks: int
    stage: int                             # the stage (rank) that runs it
    module: ChunkModule
    input_meta: tuple[TensorMeta, ...]     # what chunk index-1 sends (the batch, for chunk 0)
    output_meta: tuple[TensorMeta, ...]    # what this chunk sends (the logits, for the last)
    global_to_local: dict[str, str]        # whole-model state_dict key -> key in module.state_dict()
    unowned: dict[str, torch.Tensor]       # chunk 0 only: whole-model state no layer uses

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_chunks - 1

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Parameters under their whole-model names (what checkpoints and ``--save`` use)."""
        local_to_global: dict[str, str] = {}
        for key, local in self.global_to_local.items():   # a tied weight: its first whole-model key
            local_to_global.setdefault(local, key)
        return [(local_to_global[name], p) for name, p in self.module.named_parameters()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This chunk's part of the whole model's ``state_dict``, under the whole model's keys."""
        local = self.module.state_dict()
        return {key: local[name] for key, name in self.global_to_local.items()} | dict(self.unowned)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this chunk's part from a dict keyed like the whole model (extra keys ignored)."""
        missing = [key for key in (*self.global_to_local, *self.unowned) if key not in state]
        if missing:
            raise BadInput(f"checkpoint has no '{missing[0]}' for chunk {self.index}")
        local = {name: state[key] for key, name in self.global_to_local.items()}
        self.module.load_state_dict(local, strict=False)
        for key, tensor in self.unowned.items():
            tensor.data.copy_(state[key])


class StageChunks:
    """Everything one stage (rank) holds: its chunks, seen as one model.

    A parameter two of its chunks share (a tied embedding, both ends of a ``zb-v`` V on stage
    0) is one Parameter object: it is listed, optimized and saved once, and both chunks'
    backwards add into its one ``.grad``, as in the unsplit model.
    """

    def __init__(self, index: int, chunks: list[Chunk]) -> None:
        self.index = index
        self.chunks = chunks
        # A ModuleList lists each shared parameter once (parameters(), buffers(), to()).
        self.module = nn.ModuleList(chunk.module for chunk in chunks)

    @property
    def holds_first(self) -> bool:
        """Whether it holds chunk 0 (it reads the batch's inputs)."""
        return any(chunk.is_first for chunk in self.chunks)

    @property
    def holds_last(self) -> bool:
        """Whether it holds the last chunk (it computes the loss, and reads the targets)."""
        return any(chunk.is_last for chunk in self.chunks)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Each parameter once, under its first chunk's whole-model name, in parameters()' order."""
        seen: set[int] = set()
        out = []
        for chunk in self.chunks:
            for key, p in chunk.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((key, p))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's part of the whole model's ``state_dict``, under the whole model's keys."""
        merged: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            merged.update(chunk.state_dict())
        return merged

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for chunk in self.chunks:
            chunk.load_state_dict(state)


def _describe(meta: TensorMeta) -> str:
    return f"{str(meta.dtype).replace('torch.', '')} {list(meta.shape)}"


def check_layer_names(model: LayeredModel, plan: PlanView) -> None:
    """Refuse a plan whose layers are not the rebuilt model's, in order."""
    have = [name for name, _ in model.layers]
    want = plan.layer_names
    if have == want:
        return
    for i, (h, w) in enumerate(zip(have, want)):
        if h != w:
            raise BadInput(f"plan '{plan.path}' does not match its model: layer {i} is '{w}' in the plan "
                           f"but '{h}' in the rebuilt model; re-run `gpipe-plan profile` and `solve`")
    raise BadInput(f"plan '{plan.path}' does not match its model: the plan has {len(want)} layers, the "
                   f"rebuilt model {len(have)}; re-run `gpipe-plan profile` and `solve`")


def check_layer_params(model: LayeredModel, plan: PlanView) -> None:
    """Refuse a plan whose layers' parameters are not the rebuilt model's, before any step.

    A model whose code or configuration changed since its profile (a width, a vocabulary) keeps
    its layer names but not its parameters' sizes: the plan's times and memory are another
    model's, and the first forward would fail inside a rank. Each layer is counted as the
    profile counted it (its distinct parameters, in the plan's parameter dtype: the model is
    cast first), and only where the plan records it (plan format 10)."""
    check_layer_names(model, plan)
    for chunk in plan.chunks:
        if chunk.param_bytes is None:
            continue
        for i, want in zip(_layer_range(chunk), chunk.param_bytes):
            name, layer = model.layers[i]
            have = unique_bytes(layer.parameters())
            if have != want:
                raise BadInput(f"plan '{plan.path}' does not match its model: layer {i} ('{name}') has {have:,} bytes "
                               f"of parameters in the rebuilt model but {want:,} in the profile the plan was solved "
                               f"from: the model's code or configuration changed since; re-run `gpipe-plan profile` "
                               f"and `solve`")


def build_chunk(model: LayeredModel, plan: PlanView, index: int, precision: Precision | None = None,
                device_type: str = "cpu") -> Chunk:
    """Cut chunk ``index`` out of ``model``, on the CPU (``chunk.module.to(device)`` moves it).

    The chunk's layers run in ``precision``'s autocast for ``device_type`` (default: fp32).
    The layers of the other chunks its stage holds stay as they are (build those next); the
    other stages' layers go back to meta.
    """
    check_layer_names(model, plan)
    precision = precision or Precision()
    cp = plan.chunks[index]
    layers = [model.layers[i] for i in _layer_range(cp)]
    # This chunk's parameters become real (the others may stay on meta); chunk 0 also keeps
    # what no layer uses (below).
    materialize_layers(model, _layer_range(cp), unused=index == 0)
    module = ChunkModule(layers, recompute=cp.recompute, autocast=lambda: precision.autocast(device_type))
    # Without shapes in the plan they are read off a run on the CPU, in the CPU's autocast of
    # the same dtype, earlier chunks' layers each real only while they run. Its rules can differ
    # from CUDA's (a CUDA layer norm returns fp32, a CPU one bf16): plans from `solve` carry the
    # profiled ones.
    input_meta, output_meta = _cut_metas(model, plan, index, lambda: precision.autocast("cpu"))
    module.expected_outputs, module.label = output_meta, f"chunk {index}"
    whole = model.module.state_dict(keep_vars=True)
    # A tensor under two local names (a weight tied inside the chunk): the first, the one
    # named_parameters() gives it.
    local_name: dict[int, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        local_name.setdefault(id(t), name)
    global_to_local = {key: local_name[id(t)] for key, t in whole.items() if id(t) in local_name}
    unowned: dict[str, torch.Tensor] = {}
    if index == 0:
        # Whatever no layer uses (an unused parameter, a stray buffer) still belongs in the
        # saved model: chunk 0 keeps it, at its initial value.
        used = {id(t) for _, layer in model.layers for t in _state_tensors(layer)}
        unowned = {key: t.detach() for key, t in whole.items() if id(t) not in used}
    _release_other_stages(model, plan, cp.stage)
    return Chunk(index=index, num_chunks=plan.num_chunks, stage=cp.stage, module=module, input_meta=input_meta,
                 output_meta=output_meta, global_to_local=global_to_local, unowned=unowned)


def build_stage_chunks(model: LayeredModel, plan: PlanView, stage: int, precision: Precision | None = None,
                       device_type: str = "cpu") -> StageChunks:
    """Every chunk stage ``stage`` holds, in pipeline order."""
    return StageChunks(stage, [build_chunk(model, plan, c, precision, device_type) for c in plan.stages[stage].chunks])


def _layer_range(cp: ChunkPlan) -> range:
    return range(cp.first_layer, cp.first_layer + len(cp.layers))


def _state_tensors(module: nn.Module) -> list[torch.Tensor]:
    return list(module.parameters()) + list(module.buffers())


def _release_other_stages(model: LayeredModel, plan: PlanView, stage: int) -> None:
    """Put the parameters of the layers other stages hold on meta: this rank never runs them.

    Those of a model built on meta are there already; a model built whole frees them here.
    """
    own = [i for cp in plan.chunks_of(stage) for i in _layer_range(cp)]
    keep = [t for i in own for t in _state_tensors(model.layers[i][1])]
    release_layers(model, range(len(model.layers)), keep=keep)


def _cut_metas(model: LayeredModel, plan: PlanView, index: int,
               autocast: Autocast) -> tuple[tuple[TensorMeta, ...], tuple[TensorMeta, ...]]:
    """Shapes and dtypes entering and leaving chunk ``index``, micro-batch dimension included."""
    b = plan.micro_batch_size
    first = tuple(TensorMeta((b, *shape), dtype) for shape, dtype in zip(model.input_shapes, model.input_dtypes))
    planned = [cp.output_shapes is not None for cp in plan.chunks]
    if all(planned[max(index - 1, 0):index + 1]):
        # A tensor the same for every micro-batch (output_batched false) crosses in its own shape.
        metas = [tuple(TensorMeta((b, *s) if batched else s, _dtype(d, plan))
                       for s, d, batched in zip(cp.output_shapes or (), cp.output_dtypes or (),
                                                cp.output_batched or (True,) * len(cp.output_shapes or ())))
                 for cp in plan.chunks]
    else:
        metas = _measure_cut_metas(model, plan, index, autocast)
    inputs = first if index == 0 else metas[index - 1]
    return inputs, metas[index]


def _measure_cut_metas(model: LayeredModel, plan: PlanView, index: int,
                       autocast: Autocast) -> list[tuple[TensorMeta, ...]]:
    """Run one micro-batch through chunks 0..index (no gradients) and record what crosses.

    A layer whose parameters are on meta is made real while it runs, then given back.
    """
    metas: list[tuple[TensorMeta, ...]] = []
    with torch.random.fork_rng(devices=[]), torch.no_grad(), autocast():
        xs, _ = model.synthetic_batch(plan.micro_batch_size, torch.Generator().manual_seed(0))
        for cp in plan.chunks[:index + 1]:
            xs = forward_streamed(model, xs, _layer_range(cp))
            metas.append(tuple(TensorMeta(tuple(x.shape), x.dtype) for x in xs))
    return metas


def _dtype(name: str, plan: PlanView) -> torch.dtype:
    key = name.replace("torch.", "")
    if key not in _DTYPES:
        raise BadInput(f"plan '{plan.path}': unknown dtype '{name}' in output_dtypes")
    return _DTYPES[key]
