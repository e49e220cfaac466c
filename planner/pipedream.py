"""Import PipeDream's profiled graphs (``graph.txt``) as gpipe-plan profiles.

PipeDream (msr-fiddle/pipedream) profiled each operator of a model on a GPU and wrote one
line per node (forward and backward time in milliseconds for a whole mini-batch, output
bytes, parameter bytes) and one line per data-flow edge. Those graphs are DAGs: ResNet's
skips, Inception's branches, GNMT's two inputs. A pipeline needs a sequence, so the DAG is
linearised in a topological order that stays close to the order in which the operators were
created (node numbers), and the cut after each position carries every tensor produced at or
before it and consumed after it, skips included: that is what the stage boundary sends.

``Input`` nodes (``Input0``, ``Input1``... when a model has several) are the data loader, not a layer: their "compute time" is loading time, so
they contribute only their bytes (the model input, and any input still needed further on).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import networkx as nx

from ..artifacts import BadInput
from ..schema import FORMAT_VERSIONS, MAX_BYTES, MAX_SECONDS, PROFILE_FORMAT, validate

MAX_MS = MAX_SECONDS * 1e3   # PipeDream's times are in milliseconds

_NODE = re.compile(
    r"^(node\d+) -- (.*) -- forward_compute_time=([0-9.eE+-]+), backward_compute_time=([0-9.eE+-]+), "
    r"activation_size=(\[[^\]]*\]|[0-9.eE+-]+), parameter_size=([0-9.eE+-]+)\s*$")
_EDGE = re.compile(r"^\s+(node\d+) -- (node\d+)\s*$")

# Per-sample input bytes of the ImageNet-style models (3 x side x side float32) by side.
_IMAGE_SIDES = (224, 299, 331)
_INPUT = re.compile(r"^Input\d*$")


def is_input(op: str) -> bool:
    return bool(_INPUT.match(op))


def parse_graph(text: str, where: str) -> nx.DiGraph:
    graph = nx.DiGraph()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        node = _NODE.match(line)
        if node:
            name, op, fwd, bwd, act, params = node.groups()
            at = f"{where}, line {number}"
            if name in graph and "op" in graph.nodes[name]:
                # (a second line for one node would silently replace the first's figures)
                raise BadInput(f"{at}: {name} has a node line already; each node has one")
            sizes = act.strip("[]").split(";") if act.startswith("[") else [act]
            output_bytes = sum(_figure(x, "activation_size", at, MAX_BYTES) for x in sizes)
            graph.add_node(name, op=op.strip(), forward_ms=_figure(fwd, "forward_compute_time", at, MAX_MS),
                           backward_ms=_figure(bwd, "backward_compute_time", at, MAX_MS),
                           output_bytes=output_bytes, param_bytes=_figure(params, "parameter_size", at, MAX_BYTES))
            continue
        edge = _EDGE.match(line)
        if edge:
            graph.add_edge(*edge.groups())
            continue
        raise BadInput(f"{where}, line {number}: not a PipeDream node or edge line: {line.strip()[:80]!r}")
    missing = [n for n in graph.nodes if "op" not in graph.nodes[n]]
    if missing:
        raise BadInput(f"{where}: edges mention {missing[0]}, which has no node line")
    if not graph.number_of_nodes():
        raise BadInput(f"{where}: no nodes found; is this a PipeDream graph.txt?")
    if all(graph.nodes[n]["forward_ms"] == 0 and graph.nodes[n]["backward_ms"] == 0 for n in graph.nodes):
        raise BadInput(f"{where}: every node's forward and backward time is 0: there is nothing to plan")
    if not nx.is_directed_acyclic_graph(graph):
        raise BadInput(f"{where}: the graph has a cycle, so it cannot be cut into a pipeline")
    return graph


def _figure(text: str, key: str, at: str, ceiling: float) -> float:
    """One number of a node line: finite, non-negative and below ``ceiling`` (else one line)."""
    try:
        value = float(text)
    except ValueError:
        raise BadInput(f"{at}: {key}={text.strip()[:40]!r} is not a number") from None
    if not 0.0 <= value <= ceiling:   # also refuses inf (1e999) and nan
        raise BadInput(f"{at}: {key}={text.strip()[:40]} must be a number from 0 to {ceiling:g}")
    return value


def linearise(graph: nx.DiGraph) -> list[str]:
    """A topological order, ties broken by node number (creation order)."""
    return list(nx.lexicographical_topological_sort(graph, key=lambda n: int(n[4:])))


def infer_batch_size(graph: nx.DiGraph) -> int | None:
    """The mini-batch PipeDream profiled with, when the input is an ImageNet-style image."""
    inputs = [n for n in graph.nodes if is_input(graph.nodes[n]["op"])]
    if len(inputs) != 1:
        return None
    total = graph.nodes[inputs[0]]["output_bytes"]
    for side in _IMAGE_SIDES:
        per_sample = 3 * side * side * 4
        if total % per_sample == 0:
            return int(total // per_sample)
    return None


def import_pipedream(path: str, batch_size: int | None = None, name: str | None = None) -> dict[str, Any]:
    """A PipeDream graph.txt -> a profile document (one micro-batch size: the mini-batch).

    The document is checked against the profile schema where it is made, whether it is written
    (``import-pipedream``) or planned in memory: its figures are the graph's, so one the schema
    refuses (cut bytes that add up past the ceiling) is refused as the graph's, in one line.
    """
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"PipeDream graph '{p}' does not exist")
    graph = parse_graph(p.read_text(encoding="utf-8", errors="replace"), f"'{p}'")
    batch = batch_size if batch_size is not None else infer_batch_size(graph)   # (0 is refused, not inferred)
    if batch is None:
        raise BadInput(f"cannot tell the batch size '{p}' was profiled with: pass --batch-size N")
    if batch < 1:
        raise BadInput(f"--batch-size must be at least 1, got {batch}")
    order = linearise(graph)
    source = {n: is_input(graph.nodes[n]["op"]) for n in order}
    layers_order = [n for n in order if not source[n]]
    if not layers_order:
        raise BadInput(f"'{p}' has only input nodes")
    layer_index = {n: i for i, n in enumerate(layers_order)}
    # Each value lives from its producer's layer to its last consumer's layer; inputs from -1.
    last_use: dict[str, int] = {}
    for n in order:
        consumers = [layer_index[c] for c in graph.successors(n) if c in layer_index]
        if consumers:
            last_use[n] = max(consumers)
    produced_at = {n: (-1 if source[n] else layer_index[n]) for n in order}
    L = len(layers_order)
    # crossing[i]: bytes of values produced at or before layer i and used after it.
    delta = [0.0] * (L + 1)
    for n, last in last_use.items():
        start = produced_at[n]
        if last > start:
            delta[start + 1] += graph.nodes[n]["output_bytes"]
            delta[last + 1] -= graph.nodes[n]["output_bytes"]
    crossing, running = [], 0.0
    for i in range(L):
        running += delta[i]
        crossing.append(running)
    # crossing[i] now holds bytes live *into* layer i; the cut after i is what is live into i+1.
    cut_after = crossing[1:] + [graph.nodes[layers_order[-1]]["output_bytes"]]
    input_bytes = sum(graph.nodes[n]["output_bytes"] for n in order if source[n])
    layers = []
    for i, n in enumerate(layers_order):
        attrs = graph.nodes[n]
        layers.append({
            "name": f"{n}:{attrs['op'].split('(')[0]}",
            "forward_s": [attrs["forward_ms"] / 1e3],
            "backward_s": [attrs["backward_ms"] / 1e3],
            # PipeDream records outputs only: take a layer's output as what it saves for backward.
            "activation_bytes": [int(attrs["output_bytes"])],
            "output_bytes": [int(cut_after[i])],
            "param_bytes": int(attrs["param_bytes"]),
            "op": attrs["op"],
        })
    model_name = name or p.name.split(".")[0]
    doc: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "version": FORMAT_VERSIONS[PROFILE_FORMAT],
        "model": {"source": "pipedream", "name": model_name},
        "device": {"type": "gpu", "name": "GPU (PipeDream profile)", "threads": None},
        "micro_batch_sizes": [batch],
        "batch_size": batch,
        "input_bytes": [int(input_bytes)],
        "layers": layers,
        "source": {
            "kind": "pipedream graph.txt",
            "file": p.name,
            "nodes": graph.number_of_nodes(),
            "edges": graph.number_of_edges(),
            "note": "times are PipeDream's GPU measurements for the whole mini-batch; activation_bytes "
                    "approximated by each node's output; the Input node's time (data loading) is dropped",
        },
    }
    validate(doc, "profile", f"the profile made from PipeDream graph '{p}'")
    return doc
