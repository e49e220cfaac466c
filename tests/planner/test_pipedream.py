"""Importing PipeDream's profiled graphs (data/pipedream-profiles/*.graph.txt) as profiles.

The expected figures are computed here from the graph text with a parser of our own, not
from the importer: node and Input counts, topological order, and the bytes each cut carries
(every value produced at or before the cut and used after it, skips included)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpipe_plan.artifacts import BadInput
from gpipe_plan.cli import main
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.gpipe_solver import GPipeSolver
from gpipe_plan.planner.ilp import solve_ilp
from gpipe_plan.planner.onefoneb import OneFOneBSolver
from gpipe_plan.planner.pipedream import import_pipedream
from gpipe_plan.planner.profile import Profile

from helpers.planner import PIPEDREAM_DIR, close

# planner/ilp.py uses pulp APIs that pulp deprecates for its 4.0 (thousands of warnings a run).
pytestmark = pytest.mark.filterwarnings("ignore:.*PuLP 4:DeprecationWarning")

GRAPHS = sorted(PIPEDREAM_DIR.glob("*.graph.txt"))
NAMES = [p.name.split(".")[0] for p in GRAPHS]
# GNMT's input is token ids, not an image: its batch cannot be inferred and must be given.
BATCH = {"gnmt": 64, "gnmt_large": 64}

_NODE = re.compile(r"^(node\d+) -- (.+?) -- forward_compute_time=([^,]+), backward_compute_time=([^,]+), "
                   r"activation_size=(\[[^\]]*\]|[^,]+), parameter_size=(.+)$")
_EDGE = re.compile(r"^\s+(node\d+) -- (node\d+)\s*$")


def read_graph(path: Path) -> tuple[dict, list[tuple[str, str]]]:
    nodes, edges = {}, []
    for line in path.read_text().splitlines():
        if m := _NODE.match(line):
            name, op, fwd, bwd, act, par = m.groups()
            out = sum(float(x) for x in act.strip("[]").split(";"))
            nodes[name] = {"op": op, "forward_ms": float(fwd), "backward_ms": float(bwd), "out": out,
                           "params": float(par), "input": re.fullmatch(r"Input\d*", op) is not None}
        elif m := _EDGE.match(line):
            edges.append(m.groups())
        else:
            assert not line.strip(), line
    return nodes, edges


def test_all_fourteen_graphs_are_vendored():
    assert len(GRAPHS) == 14


@pytest.mark.parametrize("path", GRAPHS, ids=NAMES)
def test_vendored_graph_imports_into_a_valid_profile(path: Path):
    name = path.name.split(".")[0]
    doc = import_pipedream(str(path), batch_size=BATCH.get(name))
    profile = Profile(doc)                           # raises if the document is not a valid profile
    nodes, edges = read_graph(path)
    assert doc["source"]["nodes"] == len(nodes) and doc["source"]["edges"] == len(edges)
    assert doc["model"] == {"source": "pipedream", "name": name}
    batch = doc["batch_size"]
    assert doc["micro_batch_sizes"] == [batch]
    if name not in BATCH:     # ImageNet-style input: 3 x side x side float32 per sample
        (image,) = [n for n in nodes.values() if n["input"]]
        assert any(batch * 3 * side * side * 4 == image["out"] for side in (224, 299, 331)), batch
    layers = [n for n in nodes.values() if not n["input"]]
    # the Input nodes' time (data loading) is dropped; everything else is kept, in seconds
    assert sum(layer["forward_s"][0] for layer in doc["layers"]) == pytest.approx(
        sum(n["forward_ms"] for n in layers) / 1e3, rel=1e-9)
    assert sum(layer["backward_s"][0] for layer in doc["layers"]) == pytest.approx(
        sum(n["backward_ms"] for n in layers) / 1e3, rel=1e-9)
    assert sum(layer["param_bytes"] for layer in doc["layers"]) == pytest.approx(
        sum(n["params"] for n in layers), abs=len(layers))
    assert profile.num_layers == len(doc["layers"])


@pytest.mark.parametrize("path", GRAPHS, ids=NAMES)
def test_layer_count_is_nodes_minus_input_nodes(path: Path):
    name = path.name.split(".")[0]
    doc = import_pipedream(str(path), batch_size=BATCH.get(name))
    nodes, _ = read_graph(path)
    assert len(doc["layers"]) == len(nodes) - sum(n["input"] for n in nodes.values())
    assert not any(layer["op"].startswith("Input") for layer in doc["layers"])


@pytest.mark.parametrize("path", GRAPHS, ids=NAMES)
def test_order_is_topological_and_cuts_carry_every_crossing_value(path: Path):
    doc = import_pipedream(str(path), batch_size=BATCH.get(path.name.split(".")[0]))
    nodes, edges = read_graph(path)
    order = [layer["name"].split(":")[0] for layer in doc["layers"]]
    position = {n: i for i, n in enumerate(order)}
    for n, info in nodes.items():
        if info["input"]:
            position[n] = -1
    assert len(set(order)) == len(order)
    for u, v in edges:
        assert position[u] < position[v], (u, v)      # a topological order of the DAG
    last_use: dict[str, int] = {}
    for u, v in edges:
        last_use[u] = max(last_use.get(u, -1), position[v])
    L = len(order)
    # cut after position i: every node produced at or before i whose last consumer is after i
    live = sorted((position[u], last, nodes[u]["out"]) for u, last in last_use.items() if last > position[u])
    for i, layer in enumerate(doc["layers"][:-1]):
        expected = sum(out for start, last, out in live if start <= i < last)
        assert layer["output_bytes"][0] == pytest.approx(expected, abs=1), (i, layer["name"])
    assert doc["layers"][-1]["output_bytes"][0] == pytest.approx(nodes[order[L - 1]]["out"], abs=1)
    assert doc["input_bytes"][0] == pytest.approx(sum(n["out"] for n in nodes.values() if n["input"]), abs=1)


# --------------------------------------------------------------------------- a graph by hand
# Node lines out of order, and node numbers that are not a topological order (the vendored
# graphs happen to number nodes topologically, so only this graph tests the linearisation):
# the chain is Input node1 -> Conv node5 -> ReLU node3 -> Add node4 -> Linear node2, with a skip
# node5 -> node4 over the ReLU, and the input used again by node2.
TINY = """\
node3 -- ReLU() -- forward_compute_time=1.000, backward_compute_time=1.500, activation_size=20.0, parameter_size=0.000
node1 -- Input -- forward_compute_time=50.000, backward_compute_time=0.000, activation_size=100.0, parameter_size=0.000
node5 -- Conv2d(3, 8, kernel_size=(3, 3)) -- forward_compute_time=2.000, backward_compute_time=4.000, activation_size=10.0, parameter_size=64.000
node2 -- Linear(in_features=8, out_features=2) -- forward_compute_time=0.500, backward_compute_time=0.500, activation_size=[3.000; 5.000], parameter_size=16.000
node4 -- Add(inplace) -- forward_compute_time=0.250, backward_compute_time=0.000, activation_size=30.0, parameter_size=0.000
\tnode1 -- node5
\tnode5 -- node3
\tnode3 -- node4
\tnode5 -- node4
\tnode4 -- node2
\tnode1 -- node2
"""


def test_hand_written_graph_with_a_skip(tmp_path: Path):
    graph = tmp_path / "tiny.graph.txt"
    graph.write_text(TINY)
    doc = import_pipedream(str(graph), batch_size=4)
    Profile(doc)
    assert [layer["name"] for layer in doc["layers"]] == ["node5:Conv2d", "node3:ReLU", "node4:Add", "node2:Linear"]
    # By hand. After the Conv: its output (10, used by the ReLU and the Add) + the input (100,
    # used by the Linear) = 110. After the ReLU: its output (20) + the Conv's skip (10) + the
    # input (100) = 130. After the Add: its output (30) + the input (100) = 130. After the
    # Linear: the model output, 3 + 5 = 8.
    assert [layer["output_bytes"] for layer in doc["layers"]] == [[110], [130], [130], [8]]
    assert [layer["activation_bytes"] for layer in doc["layers"]] == [[10], [20], [30], [8]]
    assert [layer["param_bytes"] for layer in doc["layers"]] == [64, 0, 0, 16]
    # the Input node's 50 ms of loading is not a layer's time
    assert [layer["forward_s"] for layer in doc["layers"]] == [[2e-3], [1e-3], [0.25e-3], [0.5e-3]]
    assert [layer["backward_s"] for layer in doc["layers"]] == [[4e-3], [1.5e-3], [0.0], [0.5e-3]]
    assert doc["input_bytes"] == [100] and doc["micro_batch_sizes"] == [4] and doc["batch_size"] == 4
    assert doc["model"] == {"source": "pipedream", "name": "tiny"}


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_import_command_writes_a_profile_that_solves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.graph.txt").write_text(TINY)
    result = cli("import-pipedream", "tiny.graph.txt", "--batch-size", "4")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "tiny.profile.json").read_text()) == import_pipedream("tiny.graph.txt", batch_size=4)
    result = cli("import-pipedream", str(PIPEDREAM_DIR / "resnet18.graph.txt"), "--out", "r18.json")
    assert result.exit_code == 0, result.output
    # A plan within 1 s of search: that the imported profile solves, not how well (the default
    # budget searched for 20 s here).
    result = cli("solve", "r18.json", "--stages", "4", "--out", "plan.json", "-q", "--time-budget", "1")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    # balance is per chunk (plan format 5): 4 stages of virtual_stages chunks each
    assert sum(plan["balance"]) == 70 and len(plan["balance"]) == 4 * plan["virtual_stages"] == len(plan["chunks"])


@pytest.mark.parametrize("text,pattern", [
    (TINY.replace("node4 -- Add(inplace)", "node4 - Add(inplace)"), r"line 5: not a PipeDream node or edge line"),
    (TINY + "this is not a graph line\n", r"line 12: not a PipeDream node or edge line"),
    (TINY + "\tnode2 -- node9\n", r"edges mention node9, which has no node line"),
    (TINY + "\tnode2 -- node5\n", r"cycle"),
    ("", r"no nodes found"),
    (TINY + TINY.splitlines()[0] + "\n", r"line 12: node3 has a node line already"),
    (re.sub(r"compute_time=[0-9.]+", "compute_time=0.000", TINY), r"every node's forward and backward time is 0"),
])
def test_malformed_graph_exits_2_with_the_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text, pattern):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.graph.txt").write_text(text)
    line = one_line_error(cli("import-pipedream", "bad.graph.txt", "--batch-size", "4", "--out", "bad.json"))
    assert re.search(pattern, line), line
    assert not (tmp_path / "bad.json").exists()


def test_missing_batch_size_and_missing_file_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.graph.txt").write_text(TINY)
    assert "pass --batch-size" in one_line_error(cli("import-pipedream", "tiny.graph.txt"))
    assert "does not exist" in one_line_error(cli("import-pipedream", "nothing.graph.txt"))
    for bad in (-1, 0):           # (0 was taken as "not given", and the batch inferred)
        with pytest.raises(BadInput, match=f"--batch-size must be at least 1, got {bad}"):
            import_pipedream("tiny.graph.txt", batch_size=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.graph.txt"]


# --------------------------------------------------------------------------- real data, both exact methods
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dp_and_ilp_agree_on_vgg16(schedule: str):
    """A real profile (40 layers), K = 4, M = 4, a 10 GB/s link, a memory limit that forces
    recomputation somewhere: the fast solver and the ILP find the same optimum."""
    profile = Profile(import_pipedream(str(PIPEDREAM_DIR / "vgg16.graph.txt")))
    fig = profile.at(profile.sizes[0] / 4)
    setting = Setting(stages=4, micro_batches=4, schedule=schedule, recompute="auto",
                      memory_limit_bytes=3 * 2**30, link_bandwidth_bytes_per_s=10e9, link_latency_s=1e-5)
    cm = CostModel(fig, setting)
    fast = (GPipeSolver(cm) if schedule == "gpipe" else OneFOneBSolver(cm)).solve()
    ilp = solve_ilp(cm)
    assert fast.proven and ilp.proven and fast.evaluation.fits and ilp.evaluation.fits
    assert any(fast.evaluation.recompute)
    assert close(fast.evaluation.step_s, ilp.evaluation.step_s, 1e-7)
