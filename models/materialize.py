"""Models larger than one process: build on the ``meta`` device, make only chosen layers real.

A pipeline exists because a model does not fit one device, yet the plain way to start one
(build the whole model, then keep a stage) needs the whole model in every process for a
moment, and so does profiling it. So a model is built in two steps:

1. **Build on meta.** The model's own constructor runs, but every parameter it registers is
   moved to PyTorch's ``meta`` device: a tensor with a shape and a dtype and no storage (as
   accelerate's ``init_empty_weights(include_buffers=False)`` does, by patching
   ``nn.Module.register_parameter``). Buffers stay real: they are small, and some are computed
   at construction (rotary tables) where nothing could compute them again. The module tree,
   the layers, every name and shape are there; a 3 GB model takes kilobytes.
2. **Materialise chosen layers.** For every module that owns some of a layer's parameters
   directly, real tensors are allocated and the module is initialised again, the random
   generator seeded from ``(seed, the module's path)`` (``blocks.3.attn.qkv``). The Parameter
   objects stay the same (``torch.utils.swap_tensors``): the layers hold the root module's very
   objects (see :mod:`.layered`).

**The rule that makes this safe**: a parameter's initial value depends only on the seed and on
the module that owns it, never on which other modules are materialised, nor in what order. So
the rank that materialises stage 2 gets exactly the values a process holding the whole model
has there, a K-stage run starts from a 1-stage run's parameters, and ``build_model(spec, seed)``
(which materialises every layer the same way) is that model. Releasing a layer swaps its
parameters back to meta; materialising it again gives the same initial values.

How a module is initialised again (its *init rule*), decided once per model:

- a root with ``_init_weights(module)`` (Hugging Face models; the built-in gpt) declares its
  initialisation: that is called per module, after the module's own ``reset_parameters()``
  where ``_init_weights`` alone leaves one of its parameters unwritten (gpt's LayerNorms);
- otherwise each module's ``reset_parameters()`` (every ``torch.nn`` layer has one), but only
  where it reproduces what the constructor did: the in-place writes every parameter received
  while the model was built (``nn.init.normal_``, ``weight.data.fill_``, ...) are recorded and
  compared with what ``reset_parameters()`` writes. A constructor that initialises a module its
  own way (``nn.init.zeros_(self.out.bias)``) would otherwise be silently replaced.

A model with a module that owns parameters and has no such rule, or that cannot be built on
meta at all, is **built whole**, the old way (every parameter real, drawn after
``torch.manual_seed(seed)``): everything works as before, at the old memory cost, and
:func:`built_whole` says why. Materialising is then a no-op and releasing still frees memory.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

from .layered import LayeredModel

META = torch.device("meta")
Tensors = tuple[torch.Tensor, ...]
InitStep = Callable[[nn.Module], None]


# --------------------------------------------------------------------------- building on meta
@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block, every parameter a module registers is moved to the meta device.

    The constructor still creates each parameter's tensor (``torch.empty`` reserves address
    space and touches no page), then it is replaced by a meta tensor of the same shape, dtype
    and Parameter class. Buffers are left alone.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        real = module._parameters.get(name)
        if real is not None and not real.is_meta and not isinstance(real, nn.parameter.UninitializedParameter):
            module._parameters[name] = _like(real, torch.empty(real.shape, dtype=real.dtype, device=META))

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _like(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A Parameter of ``param``'s class and ``requires_grad`` over ``data``, with its attributes."""
    new = type(param)(data, requires_grad=param.requires_grad)
    # Attributes some code sets on parameters (sharding hints, no-weight-decay marks) stay; a
    # Hugging Face "already initialised" mark does not: it would make _init_weights skip it.
    new.__dict__.update({k: v for k, v in param.__dict__.items() if k != "_is_hf_initialized"})
    return new


def _swap(param: nn.Parameter, new: nn.Parameter) -> None:
    """Give ``param`` the data of ``new`` (a fresh Parameter), keeping the object: swap_tensors.

    ``torch.utils.swap_tensors`` refuses a tensor that has weak references. A ``torch.export``
    that gave up (the model is then traced with torch.fx instead) leaves its fake-tensor mode
    alive in torch's global caches (an ``lru_cache`` keyed by its shape environment), and that
    mode holds weak references to every parameter it saw. They describe a capture that is over,
    so here the swap goes ahead without them, as ``swap_tensors`` does it otherwise: when
    nothing but the module holds the tensor (no autograd graph, no other tensor).
    """
    if not weakref.getweakrefs(param):
        torch.utils.swap_tensors(param, new)
        return
    if param._use_count() != 1 or new._use_count() != 1 or type(param) is not type(new):
        raise RuntimeError(f"cannot swap a parameter of shape {list(param.shape)} in place: something else "
                           f"holds it (an autograd graph, a view)")
    param.__dict__, new.__dict__ = new.__dict__, param.__dict__
    torch._C._swap_tensor_impl(param, new)


class _WriteLog(TorchDispatchMode):
    """Records, per meta storage, the in-place writes it receives, in order (by operation name).

    Keyed by storage, not tensor, so that writes through a view or ``.data`` (``w.data.normal_()``)
    count for the parameter they change.
    """

    def __init__(self) -> None:
        super().__init__()
        self.writes: dict[int, list[str]] = defaultdict(list)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                target = args[i] if i < len(args) else kwargs.get(argument.name)
                if isinstance(target, torch.Tensor) and target.is_meta:
                    self.writes[_storage_key(target)].append(func.__name__)
        return func(*args, **kwargs)

    def of(self, param: torch.Tensor) -> list[str]:
        return self.writes.get(_storage_key(param), [])


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


# --------------------------------------------------------------------------- the init rule
def _owners(root: nn.Module) -> dict[int, str]:
    """``id(parameter) -> path of the module that owns it``: the first module, in the root's
    order, that holds it directly (a tied parameter belongs to one module only)."""
    owners: dict[int, str] = {}
    for path, module in root.named_modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), path)
    return owners


def _owned(module: nn.Module, path: str, owners: dict[int, str]) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None and owners.get(id(p)) == path]


def _probe(module: nn.Module, steps: list[InitStep], params: list[nn.Parameter]) -> list[list[str]] | None:
    """What ``steps`` write into each of ``params`` (all on meta: nothing is computed); None if they raise."""
    try:
        with _WriteLog() as log, torch.no_grad():
            for step in steps:
                step(module)
    except Exception:
        return None
    return [log.of(p) for p in params]


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _init_rule(root: nn.Module, owners: dict[int, str],
               construction: _WriteLog | None) -> dict[str, list[InitStep]] | str:
    """Per module path, the steps that initialise its parameters again; or why there is no rule."""
    declared = getattr(root, "_init_weights", None)
    rule: dict[str, list[InitStep]] = {}
    for path, module in root.named_modules():
        params = [p for p in _owned(module, path, owners) if p.is_meta]
        if not params:
            continue
        label = f"'{path or type(root).__name__}' ({type(module).__name__})"
        resettable = callable(getattr(module, "reset_parameters", None))
        if callable(declared):
            candidates: list[list[InitStep]] = [[declared]] + ([[_reset, declared]] if resettable else [])
            chosen = next((steps for steps in candidates
                           if all(w for w in (_probe(module, steps, params) or [[]]))), None)
            if chosen is None:
                return f"{label} is initialised neither by the model's _init_weights() nor by its reset_parameters()"
            rule[path] = chosen
            continue
        if not resettable:
            return f"{label} has parameters and no reset_parameters() to initialise them again"
        probed = _probe(module, [_reset], params)
        if probed is None or not all(probed):
            return f"{label}: reset_parameters() does not initialise all its parameters"
        if construction is not None:
            names = {id(p): name for name, p in module._parameters.items() if p is not None}
            for param, writes in zip(params, probed):
                if construction.of(param) != writes:
                    return (f"the model's constructor initialises {label}.{names[id(param)]} otherwise than its "
                            f"reset_parameters() (define _init_weights(module) on the model to say how)")
        rule[path] = [_reset]
    return rule


def _meta_left_behind(model: LayeredModel) -> str | None:
    """Why some layer would still touch the meta device with every parameter real; or None.

    A graph captured while the parameters were on meta can have recorded the meta device
    itself (``x.to(weight.device)`` in the model's code) or a constant computed from a
    parameter; materialising the parameters cannot reach those.
    """
    for name, layer in model.layers:
        for module in layer.modules():
            for attr, value in vars(module).items():
                if isinstance(value, torch.Tensor) and value.is_meta and attr not in ("_parameters",):
                    return f"layer '{name}' holds a constant on the meta device ({attr})"
            for buffer_name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    return f"layer '{name}' holds a buffer on the meta device ({buffer_name})"
            if isinstance(module, fx.GraphModule):
                for node in module.graph.nodes:
                    found: list[object] = []
                    fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(a) or a)
                    if any(isinstance(a, torch.device) and a.type == "meta" for a in found):
                        return f"layer '{name}' was captured naming the meta device ({node.name})"
    return None


def _module_seed(seed: int, path: str) -> int:
    """A seed for the module at ``path``: stable across processes, Python versions and runs."""
    digest = hashlib.blake2b(f"{seed}/{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """The CPU generator seeded with ``seed`` inside the block, and as it was after."""
    state = torch.default_generator.get_state()
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        torch.default_generator.set_state(state)


# --------------------------------------------------------------------------- materialising
class Materializer:
    """Makes the layers of one model real, or meta again; see the module docstring.

    ``rule`` is None for a model built whole (``whole`` says why): its parameters are real
    from the start, and a released one cannot be made real again.
    """

    def __init__(self, model: LayeredModel, seed: int, rule: dict[str, list[InitStep]] | None,
                 whole: str | None) -> None:
        # The model's parts, not the model: the registry below maps the model to this weakly,
        # and a reference back to it would keep every model alive.
        self.root, self.layers = model.module, [layer for _, layer in model.layers]
        self.seed, self.rule, self.whole = seed, rule, whole
        self.modules = dict(self.root.named_modules())
        self.owners = _owners(self.root)
        # The dtype each parameter was built in: a parameter cast since (models.precision) is
        # initialised in it, then cast, so that every process rounds the same values alike.
        self.built_dtype = {id(p): p.dtype for p in self.root.parameters()}

    def layer_parameters(self, indices: Iterable[int]) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for i in indices:
            for p in self.layers[i].parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def unused_parameters(self) -> list[nn.Parameter]:
        """Parameters of the whole model that no layer uses (the runtime's stage 0 keeps them)."""
        used = {id(p) for p in self.layer_parameters(range(len(self.layers)))}
        return [p for p in self.root.parameters() if id(p) not in used]

    def materialize(self, params: Iterable[nn.Parameter]) -> None:
        """Give every meta parameter in ``params`` its initial value, on the CPU."""
        paths: dict[str, None] = {}
        for p in params:
            if p.is_meta:
                if self.rule is None or id(p) not in self.owners:
                    raise RuntimeError(f"a parameter of shape {list(p.shape)} is on the meta device and this model "
                                       f"cannot initialise it again ({self.whole or 'no module of the model owns it'})")
                paths[self.owners[id(p)]] = None
        for path in paths:
            self._initialise(path)

    def _initialise(self, path: str) -> None:
        """Initialise the module at ``path``: its meta parameters get values, its real ones keep theirs.

        The init steps write every parameter the module holds directly, so each one that must
        not change gets a stand-in for the duration: a real scratch tensor for a parameter that
        is already real (the random stream is consumed exactly as when it was meta, so the others
        get the same values either way), a meta one for a parameter another module owns (tied).
        """
        assert self.rule is not None
        module = self.modules[path]
        stand_ins: dict[str, nn.Parameter] = {}
        fresh: list[tuple[nn.Parameter, torch.dtype]] = []   # and the dtype it has on meta now
        for name, p in module._parameters.items():
            if p is None:
                continue
            if self.owners.get(id(p)) != path:
                stand_ins[name] = _like(p, torch.empty(p.shape, dtype=p.dtype, device=META))
            elif p.is_meta:
                fresh.append((p, p.dtype))
                _swap(p, _like(p, torch.empty(p.shape, dtype=self.built_dtype[id(p)])))
            else:
                stand_ins[name] = _like(p, torch.empty(p.shape, dtype=self.built_dtype[id(p)]))
        originals = {name: module._parameters[name] for name in stand_ins}
        module._parameters.update(stand_ins)
        try:
            with _seeded(_module_seed(self.seed, path)), torch.no_grad():
                for step in self.rule[path]:
                    step(module)
        finally:
            module._parameters.update(originals)
        for p, dtype in fresh:
            if p.dtype != dtype:   # cast on meta since it was built (models.precision): cast it alike
                p.data = p.data.to(dtype)

    def release(self, params: Iterable[nn.Parameter]) -> None:
        """Swap ``params`` back to meta: their memory is freed; the objects stay."""
        # Inside torch.autocast, the low-precision copies of weights are cached until the
        # outermost autocast block ends, under weak references to the weights, which forbid a
        # swap. Dropping the cache only costs the other layers a fresh cast.
        torch.clear_autocast_cache()
        for p in params:
            if not p.is_meta:
                p.grad = None
                _swap(p, _like(p, torch.empty(p.shape, dtype=p.dtype, device=META)))


# --------------------------------------------------------------------------- per model
_MATERIALIZERS: weakref.WeakKeyDictionary[LayeredModel, Materializer] = weakref.WeakKeyDictionary()


def build_on_meta(build: Callable[[], LayeredModel], seed: int) -> LayeredModel:
    """Run a model's builder with every parameter on meta; build it whole where that cannot work.

    ``torch.manual_seed(seed)`` comes first either way (buffers drawn at construction, and
    a model built whole, take their values from it). No parameter is real afterwards unless
    the model was built whole (:func:`built_whole`); :func:`materialize_layers` makes them so.
    """
    whole: str
    try:
        torch.manual_seed(seed)
        with parameters_on_meta():
            model = build()
        construction = None
        if not callable(getattr(model.module, "_init_weights", None)):
            # No declared initialisation: build again, recording what the constructor writes
            # into each parameter, to check that reset_parameters() writes the same.
            torch.manual_seed(seed)
            with parameters_on_meta(), _WriteLog() as construction:
                model = build()
        rule = _meta_left_behind(model) or _init_rule(model.module, _owners(model.module), construction)
        # A graph capture that gave up (torch.export, then torch.fx instead) can leave a fake
        # tensor mode behind in a reference cycle, holding weak references to the parameters:
        # swap_tensors refuses a parameter that has any.
        gc.collect()
        if not isinstance(rule, str):
            _MATERIALIZERS[model] = Materializer(model, seed, rule, None)
            return model
        whole = rule
    except Exception as exc:   # whatever it is, building it whole raises it again if it is the model's
        lines = str(exc).strip().splitlines()
        whole = f"it cannot be built on the meta device ({type(exc).__name__}: {lines[0] if lines else ''})"
    torch.manual_seed(seed)
    model = build()
    _MATERIALIZERS[model] = Materializer(model, seed, None, whole)
    return model


def _materializer(model: LayeredModel) -> Materializer:
    found = _MATERIALIZERS.get(model)
    if found is None:   # a LayeredModel made by hand: real as it is
        found = _MATERIALIZERS[model] = Materializer(model, 0, None, "it was not made by build_model")
    return found


def built_whole(model: LayeredModel) -> str | None:
    """Why ``model`` was built with every parameter real; None if it was built on meta."""
    return _materializer(model).whole


def materialize_layers(model: LayeredModel, indices: Iterable[int], unused: bool = False) -> None:
    """Make the parameters of layers ``indices`` real, on the CPU, at their initial values.

    ``unused``: also the parameters no layer uses (stage 0 of a run keeps them). Parameters
    already real are left as they are; a later ``precision.cast`` or ``layer.to(device)``
    applies to them as to any. See the module docstring for which values they get.
    """
    m = _materializer(model)
    params = m.layer_parameters(indices)
    m.materialize(params + (m.unused_parameters() if unused else []))


def release_layers(model: LayeredModel, indices: Iterable[int], keep: Iterable[torch.Tensor] = ()) -> None:
    """Put the parameters of layers ``indices`` back on meta (freeing them), except ``keep``.

    Their gradients go too. A model built on meta can materialise them again, to their
    initial values; a model built whole cannot.
    """
    m = _materializer(model)
    kept = {id(t) for t in keep}
    m.release(p for p in m.layer_parameters(indices) if id(p) not in kept)


@contextlib.contextmanager
def layer_materialized(model: LayeredModel, index: int,
                       device: torch.device | str | None = None) -> Iterator[nn.Module]:
    """Layer ``index`` real (on ``device``) inside the block; what was meta before is meta after.

    The way to run a model larger than memory through, one layer at a time: only the layer
    in the block is real, besides whatever the caller keeps real.
    """
    m = _materializer(model)
    params = m.layer_parameters([index])
    was_meta = [p for p in params if p.is_meta]
    m.materialize(was_meta)
    layer = model.layers[index][1]
    if device is not None:
        layer.to(device)
    try:
        yield layer
    finally:
        m.release(was_meta)


def forward_streamed(model: LayeredModel, xs: Tensors, indices: Collection[int],
                     device: torch.device | str | None = None) -> Tensors:
    """Run ``xs`` through layers ``indices`` in order, each real only while it runs.

    Runs as the caller's context says (wrap it in ``torch.no_grad()`` and an autocast).
    """
    for i in indices:
        with layer_materialized(model, i, device) as layer:
            xs = layer(*xs)
    return xs


class _Streamed(nn.Module):
    """Layer ``index`` of ``model`` as a layer that is real only while it runs."""

    def __init__(self, model: LayeredModel, index: int, device: torch.device | str | None) -> None:
        super().__init__()
        # Plain attributes, not submodules: this wrapper owns no parameters of its own.
        self.model, self.index, self.device = model, index, device

    def forward(self, *xs: torch.Tensor) -> Tensors:
        with layer_materialized(self.model, self.index, self.device) as layer:
            return layer(*xs)


def streamed(model: LayeredModel, device: torch.device | str | None = None) -> LayeredModel:
    """The same model whose layers are each real only while they run (on ``device``).

    ``streamed(model).check(b)`` checks a model larger than memory against its inputs; its
    ``forward_layers`` runs one through it without gradients (the forwards of a training step
    would keep every layer's activations, and the parameters with them).
    """
    layers = [(name, _Streamed(model, i, device)) for i, (name, _) in enumerate(model.layers)]
    return LayeredModel(model.spec, model.module, layers, model.data, notes=model.notes)
