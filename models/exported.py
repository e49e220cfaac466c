"""Cut a real model (a Hugging Face causal LM, any ``nn.Module``) into layers, with torch.export.

``torch.fx.symbolic_trace`` runs the model's Python on proxies and gives up at the first
``if`` on a value, an iterator over a config, a cache object: real models are full of those.
``torch.export.export(..., strict=False)`` runs the Python for real, on fake tensors, and
records the ATen operations that come out, so control flow on shapes and configs simply
happens. What it records is an ``fx.Graph`` like the one :mod:`.traced` cuts, with two gifts:

- every operation carries ``meta["nn_module_stack"]``, the module path it ran in
  (``model.layers.3.mlp.down_proj``), so layers can be cut at module boundaries and named by
  the unsplit model's own paths;
- parameters are ``get_attr`` nodes of the very ``Parameter`` objects of the model, so a
  pipeline trains the user's model and saves it under the user's ``state_dict`` keys.

How the graph becomes layers:

1. **Units.** Consecutive operations that ran in the same module make a run. A run inside an
   element of a *repeated block list* (an ``nn.ModuleList`` of at least two modules of one
   class, with parameters: ``transformer.h``, ``model.layers``) belongs to that block,
   ``model.layers.3``; ``cut_at`` (a regular expression over module paths) replaces that
   default. Any other run belongs to its own module (``lm_head``).
2. **Layers.** A new layer starts at the first operation of each block, and at the first
   operation of any other module run that uses weights; everything else (glue, activations,
   residual additions) joins the layer before it. A transformer becomes embedding(s), one
   layer per block, final norm, head.
3. **Values that depend on no input** (position ids, rotary ``cos``/``sin`` tables, a mask of
   fixed size) are computed again in each layer that uses them instead of crossing a cut: they
   have no batch dimension, and a pipeline only sends what is made per micro-batch.
4. **Tied weights** (GPT-2's input embedding and output projection are one ``Parameter``) are
   *not* merged into one layer: each stage that uses the parameter holds a copy, and the
   runtime sums the copies' gradients every step (Megatron's rule), which keeps them equal.
5. The model's outputs: a tensor, a tuple, or a ``ModelOutput``/dict, trained on its
   ``logits`` (or its first tensor); the others ride along after it.

The batch dimension of every input is exported as dynamic, so one capture serves every
micro-batch size; a device named in the graph (``arange(..., device=cpu)``) is rewritten to
follow the layer's first input, so a layer runs wherever its inputs are.
"""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..artifacts import BadInput
from .layered import loss_output_note
from .traced import _dataflow, _fetch, _Group, _layers, _unique_names

# Operations that only check (shapes, dtypes, guards) and compute nothing: dropped, since an
# assertion on a dtype would fail under autocast, and they have no users.
_CHECKS = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range", "_assert_async")


class NotCapturable(Exception):
    """torch.export cannot capture the model; the message names the construct."""


def split_exported(module: nn.Module, example_inputs: tuple[torch.Tensor, ...],
                   cut_at: str | None = None, notes: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """``module`` as ``(name, layer)`` pairs following the calling convention of LayeredModel.

    ``example_inputs`` have a batch dimension of at least 2 (export specialises a size of 1).
    ``cut_at``: a regular expression over module paths whose matches are the layers; default:
    the elements of the model's repeated block lists. ``notes`` gets which output of a dict
    without ``logits`` the loss takes.
    """
    pattern = re.compile(cut_at) if cut_at else block_pattern(module)
    if cut_at and not any(pattern.fullmatch(path) for path, _ in module.named_modules() if path):
        raise BadInput(f"--cut-at '{cut_at}' matches no module of the model (it must match a module's whole path, "
                       f"as named_modules() gives it, e.g. 'model\\.layers\\.\\d+')")
    graph_module, logits_first, note = capture(module, example_inputs)
    if note is not None and notes is not None and note not in notes:
        notes.append(note)
    nodes = [n for n in graph_module.graph.nodes]
    recomputed = _recomputed(nodes, graph_module)
    groups = _group(nodes, recomputed, pattern, graph_module)
    graph = _dataflow(graph_module.graph)
    output = next(n for n in nodes if n.op == "output")
    outputs = _reorder(list(output.args[0]), logits_first)
    layers = _layers(groups, nodes, graph, graph_module, frozenset(recomputed), outputs, _batch_size_from_inputs)
    for _, layer in layers:
        _follow_input_device(layer)  # type: ignore[arg-type]
        _forget_fake_values(layer)  # type: ignore[arg-type]
        _real_buffers(layer, module)
    del graph_module, graph, nodes, output, outputs, groups, recomputed
    _release_export_state()
    return layers


# ---------------------------------------------------------------------- capture
def capture(module: nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> tuple[fx.GraphModule, int, str | None]:
    """The model as a flat ``fx.GraphModule``, the index of the output the loss trains on, and
    the note that says which one it is when the model returns a dict without ``logits``."""
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False  # a KV cache is for generation; export refuses it as an output
    on_meta = any(p.is_meta for p in module.parameters())
    if on_meta:
        # A model built on `meta` (too big to hold) is captured on meta inputs and buffers:
        # export needs shapes only, and devices written into the graph follow the inputs later.
        example_inputs = tuple(x.to("meta") for x in example_inputs)
    batch = torch.export.Dim("batch", min=1)
    dynamic = tuple({0: batch} for _ in example_inputs)
    try:
        with _quiet_torch(), _buffers_on_meta(module, on_meta):
            program = torch.export.export(module, tuple(example_inputs), dynamic_shapes=dynamic, strict=False)
    except Exception as exc:  # export raises many types; all mean "cannot capture"
        raise NotCapturable(describe_export_error(exc)) from None
    graph_module = program.module()
    for node in list(graph_module.graph.nodes):
        if not node.users and _is_check(node):
            graph_module.graph.erase_node(node)
    graph_module.graph.lint()
    return (graph_module, *_logits_index(program))


@contextmanager
def _buffers_on_meta(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Meta copies of the (real) buffers while a meta model is exported; the real ones after.

    The layers export makes then hold the meta copies: :func:`_real_buffers` points them back.
    """
    if not enabled:
        yield
        return
    saved = []
    for owner in module.modules():
        for name, buffer in list(owner._buffers.items()):
            if buffer is not None and not buffer.is_meta:
                saved.append((owner, name, buffer))
                owner._buffers[name] = buffer.to("meta")
    try:
        yield
    finally:
        for owner, name, buffer in saved:
            owner._buffers[name] = buffer


def _real_buffers(layer: nn.Module, root: nn.Module) -> None:
    """A layer's buffers are the model's own (buffer names in a layer are the model's paths)."""
    real = dict(root.named_buffers())
    for name, buffer in list(layer.named_buffers()):
        if buffer.is_meta and name in real:
            owner_path, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(owner_path) if owner_path else layer
            owner._buffers[leaf] = real[name]


def _is_check(node: fx.Node) -> bool:
    if node.op == "call_module":
        return str(node.target).startswith("_guards")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return any(check in name for check in _CHECKS)
    return False


@contextmanager
def _quiet_torch() -> Iterator[None]:
    """Export logs warnings and whole graphs on failure; the user gets our one line instead."""
    names = ["torch"] + [n for n in logging.root.manager.loggerDict if n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 10)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def describe_export_error(exc: BaseException) -> str:
    """torch's first line, and the user's line of code it names ("The following call raised")."""
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    first = lines[0].strip().split("  (")[0] if lines else type(exc).__name__
    where = ""
    marker = "The following call raised this error:"
    if marker in text:
        after = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
        if len(after) >= 2 and after[0].startswith("File "):
            match = re.match(r'File "([^"]+)", line (\d+)', after[0])
            place = f"{match.group(1)}:{match.group(2)}" if match else after[0]
            where = f" at {place}: {after[1]}"
    return f"{type(exc).__name__}: {first}{where}"


def _logits_index(program: torch.export.ExportedProgram) -> tuple[int, str | None]:
    """Which flat output is the logits: ``outputs["logits"]`` of a ModelOutput or dict, else 0;
    and, for a dict without ``logits``, the note naming the value taken instead."""
    spec = program.call_spec.out_spec
    if spec is None:
        return 0, None
    leaves = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    if not isinstance(leaves, Mapping):
        return 0, None
    if isinstance(leaves.get("logits"), int):
        return leaves["logits"], None
    # The keys in the order of their flat outputs: flat output 0 is the first key's first leaf.
    keys = [key for key, leaf in leaves.items() if pytree.tree_leaves(leaf)]
    return 0, loss_output_note([str(key) for key in keys])


def _reorder(outputs: list[fx.Node], first: int) -> list[fx.Node]:
    """The outputs with the loss's one first; the others keep their order after it."""
    if not outputs:
        raise NotCapturable("the model returns no tensor")
    return [outputs[first]] + outputs[:first] + outputs[first + 1:]


# ---------------------------------------------------------------------- units and layers
def block_pattern(module: nn.Module) -> re.Pattern[str] | None:
    """A regex matching the elements of the model's outermost repeated block lists.

    A block list is an ``nn.ModuleList`` or ``nn.Sequential`` of at least two children of one
    class that hold parameters: the ``N`` transformer blocks of an LM. Lists nested inside an
    element of another (the experts of a block) are the block's business.
    """
    lists: list[str] = []
    for path, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) < 2:
            continue
        kinds = {type(c) for c in child}
        if len(kinds) != 1 or not any(True for _ in child.parameters()):
            continue
        if any(path.startswith(outer + ".") for outer in lists):
            continue
        lists.append(path)
    if not lists:
        return None
    return re.compile("|".join(rf"{re.escape(p)}\.\d+" if p else r"\d+" for p in lists))


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    return "" if path.startswith("_") else path  # export's own hooks are glue, not modules


def _unit(path: str, pattern: re.Pattern[str] | None) -> tuple[str, bool]:
    """(unit name, is a chosen block): the shortest prefix of ``path`` that ``pattern`` matches."""
    if pattern is not None and path:
        parts = path.split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if pattern.fullmatch(prefix):
                return prefix, True
    return path, False


def _recomputed(nodes: list[fx.Node], graph_module: fx.GraphModule) -> set[fx.Node]:
    """Values each layer computes again rather than receive across a cut (rule 3).

    - values computed from buffers and constants only (no input, no parameter: a value made
      from a parameter has a gradient, and belongs to the layer that makes it);
    - sizes (``x.shape[0]`` and arithmetic on it: the graph's symbolic ints), which are
      read again off the layer's own inputs by :func:`_batch_size_from_inputs`.
    """
    free: set[fx.Node] = set()
    for node in nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if _is_size(node):
            free.add(node)
            continue
        sources = node.all_input_nodes
        if all((s.op == "get_attr" and not isinstance(_fetch(graph_module, str(s.target)), nn.Parameter))
               or s in free for s in sources):
            free.add(node)
    return free


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat))


def _batch_size_from_inputs(value: fx.Node, graph: fx.Graph, inputs: dict[fx.Node, fx.Node]) -> fx.Node | None:
    """In a layer, a size equal to some input's dimension is read off that input.

    The batch dimension is the only dynamic one, so every symbolic size is the batch size or
    arithmetic on it; the arithmetic is copied, the batch size itself is ``sym_size`` of the
    first of the layer's inputs that has it.
    """
    val = value.meta.get("val")
    if not isinstance(val, torch.SymInt) or not val.node.expr.is_symbol:
        return None
    for source, placeholder in inputs.items():
        shape = getattr(source.meta.get("val"), "shape", ())
        for dim, size in enumerate(shape):
            if isinstance(size, torch.SymInt) and size.node.expr == val.node.expr:
                return graph.call_function(torch.ops.aten.sym_size.int, (placeholder, dim))
    return None


def _uses_weights(node: fx.Node, recomputed: set[fx.Node], graph_module: fx.GraphModule) -> bool:
    """Reads a parameter: directly, or through an input-free value computed from one."""
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        arg = stack.pop()
        if arg in seen:
            continue
        seen.add(arg)
        if arg.op == "get_attr":
            if isinstance(_fetch(graph_module, str(arg.target)), nn.Parameter):
                return True
        elif arg in recomputed:
            stack.extend(arg.all_input_nodes)
    return False


def _group(nodes: list[fx.Node], recomputed: set[fx.Node], pattern: re.Pattern[str] | None,
           graph_module: fx.GraphModule) -> list[_Group]:
    """Operations -> runs of one unit -> layers (rule 2 of the module docstring)."""
    runs: list[tuple[str, bool, list[fx.Node]]] = []
    for node in nodes:
        if node.op in ("placeholder", "output", "get_attr") or node in recomputed:
            continue
        unit, is_block = _unit(_module_path(node), pattern)
        if runs and runs[-1][0] == unit:
            runs[-1][2].append(node)
        else:
            runs.append((unit, is_block, [node]))
    groups: list[_Group] = []
    leading: list[fx.Node] = []  # glue before the first layer joins the first layer
    for unit, is_block, run in runs:
        weighted = bool(unit) and any(_uses_weights(n, recomputed, graph_module) for n in run)
        if is_block or weighted:
            groups.append(_Group(unit, leading + run))
            leading = []
        elif groups:
            groups[-1].nodes.extend(run)
        else:
            leading.extend(run)
    if leading or not groups:
        groups.append(_Group("layer", leading))  # no weights anywhere: one layer
    return _unique_names(groups)


def _release_export_state() -> None:
    """Let the export's fake-tensor mode go, and with it its weak references to the parameters.

    After it returns, torch.export still reaches its mode from a module-level map of fake
    tensors to graph nodes and from the fake-tensor dispatch cache (torch 2.13:
    ``proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT``, ``FakeTensorMode.cache``);
    emptying both, with the meta values of :func:`_forget_fake_values` gone, frees the mode.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental import proxy_tensor

    leftover = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if isinstance(leftover, dict):
        leftover.clear()
    cache = getattr(FakeTensorMode, "cache", None)  # its keys hold the export's symbolic sizes
    if isinstance(cache, dict):
        cache.clear()
    gc.collect()


def _forget_fake_values(layer: fx.GraphModule) -> None:
    """Drop the fake tensors export left in each node's meta (they keep its fake mode alive,
    which holds weak references to the model's parameters: those would forbid swapping a
    parameter's storage in place, as materialising a layer built on ``meta`` does)."""
    for node in layer.graph.nodes:
        node.meta = {key: value for key, value in node.meta.items() if key in ("nn_module_stack", "stack_trace")}


def _follow_input_device(layer: fx.GraphModule) -> None:
    """Replace every device written into the graph (``arange(..., device=cpu)``,
    ``x.to(meta)``) by the device of the layer's first input."""
    graph = layer.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    targets = [n for n in graph.nodes if _has_device((n.args, n.kwargs))]
    if not placeholders or not targets:
        return
    with graph.inserting_after(placeholders[-1]):
        device = graph.call_function(getattr, (placeholders[0], "device"))

    def follow(value: object) -> object:
        return device if isinstance(value, torch.device) else value

    for node in targets:
        node.args = fx.node.map_aggregate(node.args, follow)  # type: ignore[assignment]
        node.kwargs = fx.node.map_aggregate(node.kwargs, follow)  # type: ignore[assignment]
    layer.recompile()


def _has_device(value: object) -> bool:
    found = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.device) else None)
    return bool(found)


__all__ = ["NotCapturable", "block_pattern", "capture", "describe_export_error", "split_exported"]
