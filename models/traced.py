"""Cut any traceable module into a sequence of layers, with torch.fx and a dataflow graph.

A model that is not an ``nn.Sequential`` is not a sequence: its forward is a dataflow graph,
where a value made early may be used much later (a skip connection). To pipeline it we

1. trace it with ``torch.fx.symbolic_trace`` into a graph of operations;
2. view that as a networkx ``DiGraph`` (an edge from each value to each operation using it)
   and put it in a topological order (fx's own order, which is one);
3. group the operations into layers: a new layer starts at every operation with weights,
   a call of a submodule that has parameters or buffers, or a function applied to a
   parameter directly; everything else (reshapes, additions, activations, pooling, an
   ``nn.Identity``) joins the layer before it, so glue never becomes a layer of its own;
4. merge the layers between two uses of one parameter (weight sharing cannot be split);
5. for each cut between layers, find the values *live across it*: made at or before the cut
   and used after it. Layer i becomes a small ``fx.GraphModule`` whose inputs are exactly the
   values live across the cut before it and whose outputs are exactly those live across the
   cut after it, values it does not touch passing straight through.

Step 5 is what makes skip connections work: a value used three layers later is an output
of each layer in between, so a stage boundary anywhere in that span sends it, and the
profile's ``output_bytes`` of a layer counts it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import networkx as nx
import torch
from torch import fx, nn

from ..artifacts import first_line


# (value of the whole graph, the layer's graph, the layer's inputs: whole-graph node -> its
# placeholder) -> a node of the layer's graph that stands for the value, or None.
Substitute = Callable[[fx.Node, fx.Graph, dict[fx.Node, fx.Node]], fx.Node | None]


class NotTraceable(Exception):
    """torch.fx cannot trace the module (data-dependent control flow, for example)."""


@dataclass
class _Group:
    """One future layer: its name and its operations, in graph order."""

    name: str
    nodes: list[fx.Node]


def split_traced(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module`` as ``(name, layer)`` pairs following the calling convention of LayeredModel."""
    try:
        traced = fx.symbolic_trace(module)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, ...
        raise NotTraceable(f"{type(exc).__name__}: {first_line(exc)}") from None
    graph = _dataflow(traced.graph)
    order = list(nx.lexicographical_topological_sort(graph, key=lambda n: graph.nodes[n]["index"]))
    nodes = [graph.nodes[n]["node"] for n in order]
    groups = _merge_shared(_group(nodes, traced), traced)
    return _layers(groups, nodes, graph, traced)




def _dataflow(graph: fx.Graph) -> nx.DiGraph:
    """The fx graph as a DiGraph over node names: value -> each operation that uses it."""
    g = nx.DiGraph()
    for index, node in enumerate(graph.nodes):
        g.add_node(node.name, node=node, index=index)
    for node in graph.nodes:
        for source in node.all_input_nodes:
            g.add_edge(source.name, node.name)
    return g


def _starts_layer(node: fx.Node, traced: fx.GraphModule) -> bool:
    """An operation with weights: a stateful submodule, or a function applied to a parameter."""
    if node.op == "call_module":
        sub = traced.get_submodule(str(node.target))
        return any(True for _ in sub.parameters()) or any(True for _ in sub.buffers())
    if node.op in ("call_function", "call_method"):
        return any(arg.op == "get_attr" for arg in node.all_input_nodes)
    return False


def _group(nodes: list[fx.Node], traced: fx.GraphModule) -> list[_Group]:
    groups: list[_Group] = []
    leading: list[fx.Node] = []  # glue before the first layer joins the first layer
    for node in nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue  # inputs and outputs are the cuts; attributes are fetched where used
        if _starts_layer(node, traced):
            name = str(node.target) if node.op == "call_module" else node.name
            groups.append(_Group(name, leading + [node]))
            leading = []
        elif groups:
            groups[-1].nodes.append(node)
        else:
            leading.append(node)
    if leading or not groups:
        # No weights anywhere (or only glue after nothing): one layer for the whole graph.
        groups.append(_Group(type(traced).__name__.lower() or "layer", leading))
    return _unique_names(groups)


def _unique_names(groups: list[_Group]) -> list[_Group]:
    # A parameter-free submodule called twice (one ReLU used everywhere) names two layers.
    seen: dict[str, int] = {}
    for group in groups:
        count = seen.get(group.name, 0)
        seen[group.name] = count + 1
        if count:
            group.name = f"{group.name}_{count}"
    return groups


def _state_used(node: fx.Node, traced: fx.GraphModule) -> set[int]:
    """ids of the parameters and buffers an operation reads."""
    tensors: list[torch.Tensor] = []
    if node.op == "call_module":
        sub = traced.get_submodule(str(node.target))
        tensors += list(sub.parameters()) + list(sub.buffers())
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = _fetch(traced, str(arg.target))
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, nn.Module):
                tensors += list(value.parameters()) + list(value.buffers())
    return {id(t) for t in tensors}


def _fetch(root: nn.Module, target: str) -> object:
    value: object = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _merge_shared(groups: list[_Group], traced: fx.GraphModule) -> list[_Group]:
    """Merge the run of layers between the first and last use of any parameter or buffer.

    Two stages holding one parameter would each train their own copy of it; one layer that
    holds every use keeps the pipeline equal to the unsplit model.
    """
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, group in enumerate(groups):
        for node in group.nodes:
            for key in _state_used(node, traced):
                first.setdefault(key, i)
                last[key] = i
    # reach[i]: the last layer that must be merged with layer i.
    reach = list(range(len(groups)))
    for key, start in first.items():
        reach[start] = max(reach[start], last[key])
    merged: list[_Group] = []
    i = 0
    while i < len(groups):
        end = reach[i]
        j = i
        while j <= end:  # a layer inside the run may extend it further
            end = max(end, reach[j])
            j += 1
        run = groups[i:end + 1]
        name = run[0].name if len(run) == 1 else f"{run[0].name}..{run[-1].name}"
        merged.append(_Group(name, [node for g in run for node in g.nodes]))
        i = end + 1
    return _unique_names(merged)


def _layers(groups: list[_Group], nodes: list[fx.Node], graph: nx.DiGraph, traced: fx.GraphModule,
            recomputed: frozenset[fx.Node] = frozenset(), outputs: list[fx.Node] | None = None,
            substitute: Substitute | None = None) -> list[tuple[str, nn.Module]]:
    """Build one GraphModule per group, its inputs and outputs the values live at its cuts.

    ``recomputed``: values that depend on no model input (position ids, rotary tables, a
    causal mask of fixed size). They belong to no layer and never cross a cut: each layer that
    uses one computes it again. ``outputs``: the model's outputs, in the order the loss wants
    them (default: as the graph returns them). ``substitute(value, graph, inputs)``: a node of
    the layer's graph standing for ``value`` (e.g. the batch size, read off the layer's own
    inputs), or None to copy ``value`` as usual.
    """
    # Where each value is made: -1 for the model inputs, i for layer i. get_attr nodes have
    # no position: every layer that needs a parameter fetches it itself.
    position: dict[str, int] = {}
    for i, group in enumerate(groups):
        for node in group.nodes:
            position[node.name] = i
    inputs = [n for n in nodes if n.op == "placeholder"]
    for node in inputs:
        position[node.name] = -1
    output = next(n for n in nodes if n.op == "output")
    position[output.name] = len(groups)

    def live_after(cut: int) -> list[fx.Node]:
        """Values made at or before layer ``cut`` and used after it, in graph order."""
        if cut == len(groups) - 1:
            return outputs if outputs is not None else _flat_outputs(output)
        return [n for n in nodes if n.name in position and position[n.name] <= cut
                and any(position.get(user, -2) > cut for user in graph.successors(n.name))]

    layers: list[tuple[str, nn.Module]] = []
    crossing = inputs  # the model inputs cross the cut before layer 0
    for i, group in enumerate(groups):
        after = live_after(i)
        layers.append((group.name, _subgraph(traced, group, crossing, after, recomputed, substitute)))
        crossing = after
    return layers


def _flat_outputs(output: fx.Node) -> list[fx.Node]:
    """The model's outputs in order: one value, or the values of a (nested) tuple or list."""
    flat: list[fx.Node] = []

    def visit(arg: object) -> None:
        if isinstance(arg, fx.Node):
            flat.append(arg)
        elif isinstance(arg, (tuple, list)):
            for a in arg:
                visit(a)
        else:
            raise NotTraceable(f"the model returns a {type(arg).__name__}; it must return tensors")

    visit(output.args[0])
    return flat


def _subgraph(traced: fx.GraphModule, group: _Group, inputs: list[fx.Node], outputs: list[fx.Node],
              recomputed: frozenset[fx.Node] = frozenset(), substitute: Substitute | None = None) -> fx.GraphModule:
    """A GraphModule computing ``group``'s operations: ``inputs`` in, ``outputs`` out, as a tuple."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[value] = graph.placeholder(value.name)

    def fetch(arg: fx.Node) -> None:
        """Copy an attribute, or a value computed from attributes and constants only, once."""
        if arg in env or not (arg.op == "get_attr" or arg in recomputed):
            return
        replacement = substitute(arg, graph, {v: env[v] for v in inputs}) if substitute else None
        if replacement is not None:
            env[arg] = replacement
            return
        for source in arg.all_input_nodes:
            fetch(source)
        env[arg] = graph.node_copy(arg, lambda n: env[n])

    for node in group.nodes:
        for arg in node.all_input_nodes:
            fetch(arg)
        env[node] = graph.node_copy(node, lambda n: env[n])
    for value in outputs:  # an output may be a recomputed value (a model returning a constant)
        fetch(value)
    graph.output(tuple(env[v] for v in outputs))
    # The traced module is the root: it holds the user's submodules and parameters (the very
    # objects) and the constants tracing made. GraphModule copies references, not tensors.
    return fx.GraphModule(traced, graph, class_name=_class_name(group.name))


def _class_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() else "_" for c in name)
    return f"Layer_{cleaned}"
