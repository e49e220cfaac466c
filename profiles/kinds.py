"""Which layers are alike: the same work on the same shapes, so measured once for all of them.

A transformer is mostly one block repeated: 32 blocks of a 7 B model cost the same, and
timing each is 31 times the work for figures the planner cannot tell apart from the first's.
So the profiler gives every layer a *kind* and measures the first layer of each kind only;
the others take its figures (the profile says so in ``measured_as``).

Two layers are of one kind when nothing that decides their cost differs:

- their code: for an ``fx.GraphModule`` (a traced or exported layer) its graph, operation by
  operation, with parameter names replaced by the shapes and dtypes they hold (block 3's
  ``model.layers.3.mlp.up_proj.weight`` and block 4's are one thing); for any other module the
  class of every submodule, its ``extra_repr()`` (a convolution's stride) and its plain
  attributes (an attention's head count), in order;
- their parameters and buffers: shapes, dtypes, ``requires_grad``;
- what flows in and out at every profiled micro-batch size: shapes and dtypes (a stride that
  halves the image shows here too);
- their place: the first layer's inputs need no gradient, the last layer computes the loss.

What does not count: parameter *values*, and attributes that are not plain numbers, strings
or flags. Anything the description misses can only make two layers look different (a layer
index kept as an attribute), never alike: a missed sharing costs time, not accuracy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

Tensors = tuple[torch.Tensor, ...]

_PLAIN = (bool, int, float, str, type(None))


def layer_kind(layer: nn.Module, inputs: list[Tensors], outputs: list[Tensors], first: bool, last: bool) -> str:
    """A text that is equal for two layers exactly when they are of one kind (see the module docstring)."""
    parts = [f"first={first} last={last}",
             "in " + _metas(inputs), "out " + _metas(outputs),
             _describe(layer)]
    return "\n".join(parts)


def _metas(per_size: list[Tensors]) -> str:
    return "; ".join(", ".join(f"{list(t.shape)} {t.dtype} grad={t.requires_grad}" for t in xs) for xs in per_size)


def _tensor(t: torch.Tensor) -> str:
    return f"tensor{list(t.shape)} {t.dtype} grad={t.requires_grad}"


def _describe(module: nn.Module, path: str = "") -> str:
    """The module and its children, in order: place in the layer, class, settings and tensors.

    A GraphModule is described by its graph instead: its children are copies of the model's
    module tree, whose paths (``model.layers.3``) differ between two blocks that are alike.
    """
    if isinstance(module, fx.GraphModule):
        return f"{path}: GraphModule\n{_graph(module)}"
    kind = type(module)
    settings = {k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, _PLAIN)}
    tensors = [f"{n}={_tensor(t)}" for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None]
    lines = [f"{path}: {kind.__module__}.{kind.__qualname__}({module.extra_repr()}) {settings} {tensors}"]
    lines += [_describe(child, f"{path}.{name}") for name, child in module.named_children()]
    return "\n".join(lines)


def _graph(graph_module: fx.GraphModule) -> str:
    """The graph's operations, values named by position and attributes by what they hold."""
    index = {node: i for i, node in enumerate(graph_module.graph.nodes)}

    def arg(a: Any) -> str:
        if isinstance(a, fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return "(" + ", ".join(arg(x) for x in a) + ")"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k}: {arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, (*_PLAIN, torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return repr(a)
        return type(a).__qualname__

    lines = []
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            target = _attribute(graph_module, str(node.target))
        elif node.op == "call_module":
            target = _describe(graph_module.get_submodule(str(node.target)))
        elif node.op == "call_function":
            target = getattr(node.target, "__qualname__", None) or str(node.target)
            target = f"{getattr(node.target, '__module__', '')}.{target}"
        elif node.op == "placeholder":
            target = "input"
        else:
            target = str(node.target)
        lines.append(f"  {node.op} {target} {arg(node.args)} {arg(node.kwargs)}")
    return "\n".join(lines)


def _attribute(root: nn.Module, target: str) -> str:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, nn.Module):
        return _describe(value)
    return type(value).__qualname__
