"""Malformed artifacts, through the real command line: refused in one line, exit 2, no file.

Issue 17. Every profile, plan, report and PipeDream graph here is written by the test, from a
valid one (a synthetic profile, the plan ``solve`` makes of it, a report of that plan, a
small graph) and one change. Each bad file goes through the commands that read it
(``solve``, ``show``, ``run``, ``calibrate``, ``import-pipedream``), in-process via click's
CliRunner, and must give exit status 2, exactly one line on stderr, no traceback, no new
file, and no hang (a SIGALRM guard stops a command that loops). The hypothesis tests then
mutate the valid artifacts at random (drop a key, change a type, put an extreme value) and
accept only that outcome or a clean success (exit 0) when the change is harmless. The schemas
are gpipe_plan/schema.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpipe_plan.artifacts import BadInput
from gpipe_plan.cli import main
from gpipe_plan.plan_layout import plan_chunks
from gpipe_plan.runtime.plan import load_plan
from gpipe_plan.schema import FORMAT_VERSIONS, PROFILE_FORMAT, REPORT_FORMAT

from helpers.cli_process import gpipe_plan
from helpers.planner import profile_doc

# planner/ilp.py uses pulp APIs that pulp deprecates for its 4.0 (thousands of warnings a run).
pytestmark = pytest.mark.filterwarnings("ignore:.*PuLP 4:DeprecationWarning")

HUGE_INT = 10 ** 400          # valid JSON; float() of it overflows
# A hang guard, not a speed claim: a command on a malformed file that loops (deep nesting, a
# giant int, a huge list) is stopped here and reported as a failure instead of hanging the run.
# Each command ends in well under a second; 20 s is far past that even on a loaded machine.
CASE_SECONDS = 20
NESTED = "[" * 100_000 + "]" * 100_000


# --------------------------------------------------------------------------- valid artifacts
def valid_profile() -> dict[str, Any]:
    """A small profile with every optional key a command reads, so that mutations reach them."""
    doc = profile_doc(L=4, sizes=(1, 2, 4), batch_size=4)
    doc.update(version=FORMAT_VERSIONS[PROFILE_FORMAT], global_batch_size=4,
               link={"backend": "gloo", "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5},
               overhead={"per_microbatch_s": 1e-5},
               contention={"processes": 2, "slowdown": 1.1, "micro_batch_size": 2, "cycle_ratios": [1.1, 1.1]},
               consistency={"layer_sum_s": [0.01, 0.02, 0.04], "model_step_s": [0.01, 0.02, 0.04],
                            "ratio": [1.0, 1.0, 1.0]},
               input_bytes=[64, 128, 256],
               measurement={"speed_probe_s": [0.02, 0.0201],
                            "host_speed": {"fastest_probe_s": 0.02, "layer_tries": [1.005]}})
    doc["device"].update(speed_probe_s=0.02)
    for layer in doc["layers"]:
        layer["optimizer_s"] = 1e-4
    return doc


def _write(path: Path, doc: Any) -> Path:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc, allow_nan=True))
    return path


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The valid profile, the plan ``solve`` makes of it, and a report of a run of that plan."""
    folder = tmp_path_factory.mktemp("valid")
    profile = valid_profile()
    _write(folder / "profile.json", profile)
    result = CliRunner().invoke(main, ["solve", str(folder / "profile.json"), "--stages", "2", "--micro-batches", "2",
                                       "--out", str(folder / "plan.json")])
    assert result.exit_code == 0, result.output
    plan = json.loads((folder / "plan.json").read_text())
    return {"profile": profile, "plan": plan, "report": report_of(plan)}


def report_of(plan: dict[str, Any]) -> dict[str, Any]:
    """What ``run --report`` would write for ``plan`` if every chunk ran 10% slower than predicted."""
    chunks = [{"index": c["index"], "stage": c["stage"], "layers": c["layers"], "recompute": c["recompute"],
               "predicted_forward_s": c["forward_s"], "measured_forward_s": c["forward_s"] * 1.1,
               "predicted_backward_s": c["backward_s"], "measured_backward_s": c["backward_s"] * 1.1}
              for c in plan_chunks(plan, "plan")]
    stages = [{"index": s["index"], "chunks": s["chunks"],
               "layers": [name for c in s["chunks"] for name in chunks[c]["layers"]],
               "measured_optimizer_s": s["optimizer_s"] * 1.1, "predicted_memory_bytes": s["memory_bytes"],
               "measured_peak_memory_bytes": s["memory_bytes"], "predicted_idle_fraction": s["idle_fraction"],
               "measured_idle_fraction": s["idle_fraction"], "predicted_memory": s["memory"]}
              for s in plan["stages"]]
    step = plan["predicted"]["step_s"]
    return {"format": REPORT_FORMAT, "version": FORMAT_VERSIONS[REPORT_FORMAT], "model": plan["model"],
            "plan": {"path": "plan.json", "sha256": None}, "run": {"precision": "fp32", "param_dtype": "fp32"},
            "schedule": plan["schedule"], "num_stages": len(stages), "micro_batches": plan["micro_batches"],
            "micro_batch_size": plan["micro_batch_size"], "global_batch_size": plan["global_batch_size"],
            "steps_run": 6, "steps_measured": 5, "predicted_step_s": step, "measured_step_s": step * 1.1,
            "step_time_ratio": 1.1, "speed": {"ratio": 1.0, "per_rank_probe_s": {"0": [0.02, 0.02]}},
            "measured_step_s_per_step": {str(i): step * (1.1 + 0.01 * i) for i in range(6)},
            "predicted_bubble_fraction": 0.2, "measured_bubble_fraction": 0.25, "samples_per_s": 10.0,
            "tokens_per_s": None, "loss": {"first": 5.5, "last": 5.0, "per_step": {"0": 5.5, "5": 5.0}},
            "stages": stages, "chunks": chunks}


GRAPH = """node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=602112.0, parameter_size=0.000
node2 -- Conv2d(3, 64) -- forward_compute_time=1.500, backward_compute_time=3.000, activation_size=[3211264.0; 10.0], parameter_size=37632.000
node3 -- ReLU() -- forward_compute_time=0.200, backward_compute_time=0.300, activation_size=3211264.0, parameter_size=0.000
node4 -- Linear(64, 10) -- forward_compute_time=0.100, backward_compute_time=0.200, activation_size=40.0, parameter_size=2600.000
\tnode1 -- node2
\tnode2 -- node3
\tnode3 -- node4
"""


# --------------------------------------------------------------------------- running a command
class Overran(Exception):
    """A command ran past CASE_SECONDS (raised inside it by SIGALRM)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`Overran` inside whatever runs longer than ``seconds``."""
    def ring(signum: int, frame: Any) -> None:
        raise Overran(f"ran past {seconds} s")
    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def invoke(folder: Path, args: list[str]) -> tuple[Any, set[str], float]:
    """Run ``gpipe-plan ARGS`` in ``folder``: the result, the files it added, the seconds it took."""
    before = set(os.listdir(folder))
    cwd = os.getcwd()
    os.chdir(folder)
    start = time.monotonic()
    try:
        with deadline(CASE_SECONDS):
            result = CliRunner().invoke(main, args, catch_exceptions=True)
    finally:
        os.chdir(cwd)
    return result, set(os.listdir(folder)) - before, time.monotonic() - start


def assert_refused(folder: Path, args: list[str]) -> str:
    """``args`` exits 2 with one line on stderr, no traceback, no file, in bounded time; the line."""
    result, added, seconds = invoke(folder, args)
    assert not isinstance(result.exception, Overran), f"{args}: ran past {CASE_SECONDS} s"
    assert result.exit_code == 2, (args, result.exit_code, result.output, repr(result.exception))
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    assert "Traceback" not in result.output
    assert not added, f"{args} wrote {sorted(added)}"
    return lines[0]


def assert_clean(folder: Path, args: list[str]) -> bool:
    """``args`` either succeeds (exit 0) or is refused as :func:`assert_refused` says: True if refused."""
    result, added, seconds = invoke(folder, args)
    assert not isinstance(result.exception, Overran), f"{args}: ran past {CASE_SECONDS} s"
    if result.exit_code == 0:
        return False
    assert result.exit_code == 2, (args, result.exit_code, result.output, repr(result.exception))
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    assert not added, f"{args} wrote {sorted(added)}"
    return True


# The commands that read each artifact, with the file at ``{f}`` and the valid companions beside it.
COMMANDS: dict[str, list[list[str]]] = {
    "profile": [["solve", "{f}", "--stages", "2", "--out", "plan.out.json"], ["show", "{f}"]],
    "plan": [["show", "{f}"], ["run", "{f}", "--steps", "1", "--report", "report.out.json"]],
    "report": [["calibrate", "{f}", "--profile", "profile.json", "--out", "calibrated.out.json"], ["show", "{f}"]],
    "graph": [["import-pipedream", "{f}", "--batch-size", "1", "--out", "profile.out.json"]],
}


def put(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """A copy of ``doc`` with the key at ``path`` set to ``value`` (or removed: ``DROP``)."""
    out = copy.deepcopy(doc)
    target = out
    for key in path[:-1]:
        target = target[key]
    if value is DROP:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value
    return out


DROP = object()


# --------------------------------------------------------------------------- the corpus
def _corpus(artifacts: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """name -> (kind, the bad file's content: a document or a text)."""
    profile, plan, report = artifacts["profile"], artifacts["plan"], artifacts["report"]
    P, L, R = (lambda path, v: ("profile", put(profile, path, v))), (lambda path, v: ("plan", put(plan, path, v))), \
        (lambda path, v: ("report", put(report, path, v)))
    cases: dict[str, tuple[str, Any]] = {
        # profiles
        "profile: huge int param_bytes": P(("layers", 0, "param_bytes"), HUGE_INT),
        "profile: huge int in forward_s": P(("layers", 1, "forward_s", 1), HUGE_INT),
        "profile: overflowing activation_bytes": P(("layers", 2, "activation_bytes"), [1e308, 1e308, 1e308]),
        "profile: infinite time (1e400)": ("profile", json.dumps(profile).replace('"param_bytes": 4000', '"param_bytes": 1e400', 1)),
        "profile: NaN time": P(("layers", 0, "backward_s", 0), math.nan),
        "profile: NaN as a string": P(("layers", 0, "backward_s", 0), "NaN"),
        "profile: deep nesting": ("profile", NESTED),
        "profile: deep nesting in a key": ("profile", json.dumps(profile)[:-1] + ', "x": ' + NESTED + "}"),
        "profile: huge integer literal": ("profile", json.dumps(profile).replace('"param_bytes": 4000', '"param_bytes": ' + "9" * 5000, 1)),
        "profile: device a string": P(("device",), "cpu"),
        "profile: device missing": P(("device",), DROP),
        "profile: device memory a string": P(("device", "memory_bytes"), "16GB"),
        "profile: link a string": P(("link",), "fast"),
        "profile: link bandwidth a string": P(("link", "bandwidth_bytes_per_s"), "1e9"),
        "profile: negative link bandwidth": P(("link", "bandwidth_bytes_per_s"), -1e9),
        "profile: negative link latency": P(("link", "latency_s"), -1e-3),
        "profile: overhead a number": P(("overhead",), 0.001),
        "profile: overhead a string": P(("overhead", "per_microbatch_s"), "1ms"),
        "profile: negative overhead": P(("overhead", "per_microbatch_s"), -0.5),
        "profile: contention a list": P(("contention",), [2, 1.1]),
        "profile: micro-batch size 1.5": P(("micro_batch_sizes",), [1, 1.5, 4]),
        "profile: micro-batch size 0": P(("micro_batch_sizes",), [0, 2, 4]),
        "profile: micro-batch size true": P(("micro_batch_sizes",), [True, 2, 4]),
        "profile: layers an object": P(("layers",), {"layer0": {}}),
        "profile: layer a string": P(("layers", 1), "layer1"),
        "profile: name a number": P(("layers", 1, "name"), 7),
        "profile: consistency ratio a string": P(("consistency", "ratio"), "1.0"),
        "profile: cycle ratios of strings": P(("contention", "cycle_ratios"), ["1.1"]),
        "profile: tied parameters a string": P(("tied_parameters",), "all"),
        "profile: host_speed a string": P(("measurement", "host_speed"), "x"),
        "profile: layer_tries a number": P(("measurement", "host_speed", "layer_tries"), 3),
        "profile: layer_tries of strings": P(("measurement", "host_speed", "layer_tries"), ["1.5"]),
        "profile: fastest probe a string": P(("measurement", "host_speed", "fastest_probe_s"), "6ms"),
        "profile: speed probes a number": P(("measurement", "speed_probe_s"), 0.02),
        "profile: model name a list": P(("model", "name"), ["gpt"]),
        "profile: a JSON list": ("profile", "[1, 2, 3]"),
        "profile: empty file": ("profile", ""),
        "profile: invalid UTF-8": ("profile", b"\xff\xfe{}"),
        # plans (hand-edited)
        "plan: output_shapes a string": L(("chunks", 0, "output_shapes"), "[2, 16]"),
        "plan: output_shapes negative dim": L(("chunks", 0, "output_shapes"), [[-1, 16]]),
        "plan: output_shapes huge dim": L(("chunks", 0, "output_shapes"), [[HUGE_INT]]),
        "plan: output_shapes float dim": L(("chunks", 0, "output_shapes"), [[2.5]]),
        "plan: output_dtypes unknown": L(("chunks", 0, "output_dtypes"), ["float8"]),
        "plan: output_shapes without dtypes": L(("chunks", 0), {**plan["chunks"][0], "output_shapes": [[2, 16]],
                                                                "output_dtypes": None}),
        "plan: memory a list": L(("stages", 0, "memory"), [1, 2]),
        "plan: memory part a string": L(("stages", 0, "memory", "params_bytes"), "4KB"),
        "plan: memory part infinite": L(("stages", 1, "memory", "activations_bytes"), HUGE_INT),
        "plan: micro_batch_size 1.5": L(("micro_batch_size",), 1.5),
        "plan: balance of strings": L(("balance",), ["2", "2"]),
        "plan: stages an object": L(("stages",), {"0": {}}),
        "plan: chunk layers a string": L(("chunks", 1, "layers"), "layer2"),
        "plan: chunks an object": L(("chunks",), {"0": {}}),
        "plan: a chunk on another stage": L(("chunks", 1, "stage"), 0),
        "plan: a stage holding another chunk": L(("stages", 0, "chunks"), [1]),
        "plan: chunk index out of order": L(("chunks", 0, "index"), 1),
        "plan: balance one short": L(("balance",), [2]),
        "plan: virtual_stages a string": L(("virtual_stages",), "2"),
        "plan: virtual_stages 2 for gpipe": L(("virtual_stages",), 2),
        "plan: a schedule it cannot run": L(("schedule",), "zb-v"),
        "plan: predicted step a string": L(("predicted", "step_s"), "fast"),
        "plan: profile device a string": L(("profile", "device"), "cpu"),
        "plan: deep nesting": ("plan", NESTED),
        # reports (for calibrate and show)
        "report: stages not a list": R(("stages",), {"0": {}}),
        "report: stage without index": R(("stages", 0, "index"), DROP),
        "report: stage index a string": R(("stages", 1, "index"), "1"),
        "report (calibrate): stage indices repeated": R(("stages", 1, "index"), 0),
        "report: a time as a string": R(("stages", 0, "measured_forward_s"), "12ms"),
        "report: a chunk's time as a string": R(("chunks", 0, "measured_forward_s"), "12ms"),
        "report (calibrate): a chunk on another stage": R(("chunks", 1, "stage"), 0),
        "report (calibrate): a chunk's layers not its stage's": R(("chunks", 1, "layers"), ["layer0"]),
        "report: a time huge": R(("stages", 0, "measured_backward_s"), HUGE_INT),
        "report: speed a string": R(("speed",), "fast"),
        "report: speed ratio a string": R(("speed", "ratio"), "1.0"),
        "report: step times keyed by words": R(("measured_step_s_per_step",), {"first": 0.1}),
        "report: step time a string": R(("measured_step_s_per_step", "3"), "0.1"),
        "report: layers of numbers": R(("stages", 0, "layers"), [0, 1]),
        "report (calibrate): layer repeated": R(("stages", 1, "layers"), artifacts["report"]["stages"][0]["layers"]),
        "report: loss a number": R(("loss",), 5.0),
        "report: headline basis unknown": R(("headline",), {"predicted_step_s": 0.1, "basis": "guess",
                                                            "noise_fraction": None, "step_time_ratio": 1.0,
                                                            "within_noise": None}),
        "report: deep nesting": ("report", NESTED),
        "report: model missing": R(("model",), DROP),
        # PipeDream graphs
        "graph: infinite time": ("graph", GRAPH.replace("forward_compute_time=1.500", "forward_compute_time=1e999")),
        "graph: two dots": ("graph", GRAPH.replace("forward_compute_time=1.500", "forward_compute_time=1.5.0")),
        "graph: negative size": ("graph", GRAPH.replace("parameter_size=2600.000", "parameter_size=-2600")),
        "graph: empty activation list": ("graph", GRAPH.replace("[3211264.0; 10.0]", "[]")),
        "graph: huge activation": ("graph", GRAPH.replace("activation_size=40.0", "activation_size=1e300")),
        "graph: edge to nowhere": ("graph", GRAPH + "\tnode4 -- node9\n"),
        "graph: a cycle": ("graph", GRAPH + "\tnode4 -- node2\n"),
        "graph: not a graph": ("graph", "hello\n"),
        "graph: empty": ("graph", ""),
    }
    return cases


def _case_names() -> list[str]:
    """The corpus's names, from a stand-in of the artifacts (the real ones need a solve)."""
    stand_in = {"profile": valid_profile(),
                "plan": {"stages": [{"memory": {}}, {"memory": {}}], "chunks": [{}, {}], "predicted": {},
                         "profile": {}},
                "report": {"stages": [{"layers": []}, {}], "chunks": [{}, {}], "speed": {},
                           "measured_step_s_per_step": {}}}
    return sorted(_corpus(stand_in))


def setup_folder(folder: Path, artifacts: dict[str, Any]) -> None:
    """The valid companions a command needs beside the bad file (calibrate's profile)."""
    _write(folder / "profile.json", artifacts["profile"])


def write_case(folder: Path, kind: str, content: Any) -> Path:
    path = folder / f"bad.{kind}.{'txt' if kind == 'graph' else 'json'}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        _write(path, content)
    return path


@pytest.mark.parametrize("case", _case_names())
def test_malformed_file_is_refused_in_one_line(case: str, artifacts: dict[str, Any], tmp_path: Path) -> None:
    kind, content = _corpus(artifacts)[case]
    setup_folder(tmp_path, artifacts)
    bad = write_case(tmp_path, kind, content)
    only = case.split("(")[1].split(")")[0] if "(" in case.split(":")[0] else None   # "report (calibrate): ..."
    for command in COMMANDS[kind]:
        if only and command[0] != only:
            continue
        args = [a.replace("{f}", bad.name) for a in command]
        line = assert_refused(tmp_path, args)
        assert bad.name in line or "bad." in line, line   # the message names the file


def test_messages_name_the_key_path(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """The line names the file, the key's path and what is wrong with it."""
    setup_folder(tmp_path, artifacts)
    expected = {
        "profile: huge int in forward_s": "'layers[1].forward_s[1]' is an integer too large to use",
        "profile: device missing": "has no 'device'",
        "profile: negative link bandwidth": "'link.bandwidth_bytes_per_s' must be a number (>= 0",
        "profile: micro-batch size 1.5": "'micro_batch_sizes[1]' must be an integer",
        "profile: negative overhead": "'overhead.per_microbatch_s' must be a number (>= 0",
        "report: speed a string": "'speed' must be an object, found 'fast'",
        "report: stage without index": "has no 'stages[0].index'",
        "plan: output_shapes negative dim": "'chunks[0].output_shapes[0][0]' must be an integer (>= 0",
        "plan: a stage holding another chunk": "'stages[0].chunks' is [1], expected [0]",
        "profile: deep nesting": "nests its JSON too deeply",
        "profile: host_speed a string": "'measurement.host_speed' must be an object, found 'x'",
        "profile: layer_tries a number": "'measurement.host_speed.layer_tries' must be a list, found 3",
    }
    corpus = _corpus(artifacts)
    for case, wanted in expected.items():
        kind, content = corpus[case]
        bad = write_case(tmp_path, kind, content)
        line = assert_refused(tmp_path, [a.replace("{f}", bad.name) for a in COMMANDS[kind][0]])
        assert wanted in line and bad.name in line, (case, line)


def test_a_real_process_refuses_in_one_line(tmp_path: Path) -> None:
    """The same through the installed entry point in its own process (the recursion limit and
    the stderr a user sees are the real ones, not the test runner's)."""
    _write(tmp_path / "deep.json", NESTED)
    _write(tmp_path / "huge.json", put(valid_profile(), ("layers", 0, "param_bytes"), HUGE_INT))
    for name in ("deep.json", "huge.json"):
        done = gpipe_plan("solve", name, "--stages", "2", "--out", "p.json", cwd=tmp_path,
                          env={"PYTHONWARNINGS": ""}, timeout=60)   # Python's own warnings, as a user's stderr
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, (name, done.returncode, done.stderr)
        assert name in done.stderr and not (tmp_path / "p.json").exists()


def test_the_valid_artifacts_pass(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """The starting points are valid: every command that reads them succeeds (``run`` aside)."""
    setup_folder(tmp_path, artifacts)
    for kind in ("profile", "plan", "report"):
        good = write_case(tmp_path, kind, artifacts[kind])
        for command in COMMANDS[kind]:
            if command[0] == "run":
                assert load_plan(good).num_stages == 2
                continue
            result, _, _ = invoke(tmp_path, [a.replace("{f}", good.name) for a in command])
            assert result.exit_code == 0, (kind, command, result.output, repr(result.exception))
    graph = write_case(tmp_path, "graph", GRAPH)
    result, _, _ = invoke(tmp_path, [a.replace("{f}", graph.name) for a in COMMANDS["graph"][0]])
    assert result.exit_code == 0, result.output


# --------------------------------------------------------------------------- mutations (hypothesis)
def paths_of(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in ``doc`` (objects and lists, the first 3 items of a list)."""
    found = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc[:3]) if isinstance(doc, list) else ()
    for key, value in items:
        path = prefix + (key,)
        found.append(path)
        found.extend(paths_of(value, path))
    return found


EXTREMES = st.sampled_from([None, HUGE_INT, -HUGE_INT, -1, 0, 1, 0.5, -1e-9, 1e308, -1e308, math.inf, math.nan,
                            "NaN", "Infinity", "", "x", True, False, [], {}, [[[[[]]]]], {"a": {"b": 1}},
                            [HUGE_INT], ["1"], [None], 2 ** 63, 10 ** 30])


@st.composite
def mutation(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
    """A path of ``doc`` and what to put there: drop it, an extreme value, or a huge list."""
    path = draw(st.sampled_from(paths_of(doc)))
    how = draw(st.sampled_from(["drop", "extreme", "extreme", "huge list"]))
    if how == "drop":
        return path, DROP
    if how == "huge list":
        return path, [0] * 20_000
    return path, draw(EXTREMES)


def _mutated(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    if value is DROP and isinstance(path[-1], int):
        out = copy.deepcopy(doc)
        target = out
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return out
    return put(doc, path, value)


def _check_mutations(kind: str, artifacts: dict[str, Any], data: st.DataObject, tally: Counter[tuple[str, str]],
                     accepted: set[str]) -> None:
    """One mutation of the valid ``kind`` through each command that reads it: refused in one line
    or harmless. ``tally`` counts (command, "refused" or "accepted"); ``accepted`` gathers the key
    paths some mutation of which a command accepted."""
    path, value = data.draw(mutation(artifacts[kind]), label="mutation")
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        setup_folder(folder, artifacts)
        bad = write_case(folder, kind, _mutated(artifacts[kind], path, value))
        for command in COMMANDS[kind]:
            if command[0] == "run":   # a harmless change would train: check the plan as run reads it
                try:
                    load_plan(bad)
                    tally["run", "accepted"] += 1
                except BadInput as exc:
                    assert "\n" not in str(exc)
                    tally["run", "refused"] += 1
                continue
            try:
                refused = assert_clean(folder, [a.replace("{f}", bad.name) for a in command])
            except AssertionError as exc:
                shown = "DROP" if value is DROP else repr(value)[:60]
                raise AssertionError(f"{kind} with {'.'.join(map(str, path))} = {shown}: {str(exc)[:600]}") from None
            tally[command[0], "refused" if refused else "accepted"] += 1
            if not refused:
                accepted.add(f"{kind} {command[0]}: " + ".".join("N" if isinstance(k, int) else k for k in path))


def check_mutations(kind: str, artifacts: dict[str, Any]) -> None:
    """MUTATION_SETTINGS' examples of mutations of ``kind``, each refused or harmless, and both
    outcomes seen for every command: a command that refused none of them was never reached by
    them (or checks nothing), and one that accepted none was never given a harmless change, so
    half of :func:`assert_clean` went untried. Counted here, within one test, so that the check
    holds however pytest-xdist spreads the tests over its workers."""
    tally: Counter[tuple[str, str]] = Counter()
    accepted: set[str] = set()

    @MUTATION_SETTINGS
    @given(data=st.data())
    def each(data: st.DataObject) -> None:
        _check_mutations(kind, artifacts, data, tally, accepted)

    each()
    print(f"\n{kind} mutations: {dict(tally)}; accepted mutations of: {'; '.join(sorted(accepted))}")
    for command in COMMANDS[kind]:
        assert tally[command[0], "refused"] > 0, f"{command[0]} refused no mutation of a {kind}: {dict(tally)}"
        assert tally[command[0], "accepted"] > 0, f"{command[0]} accepted no mutation of a {kind}: {dict(tally)}"


# 300 examples per artifact keep this file near 10 s; MALFORMED_EXAMPLES=3000 MALFORMED_RANDOM=1
# searches wider (new random examples each time) when the schemas change.
MUTATION_SETTINGS = settings(max_examples=int(os.environ.get("MALFORMED_EXAMPLES", "300")), deadline=None,
                             derandomize=os.environ.get("MALFORMED_RANDOM") is None, database=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_mutated_profiles_are_refused_or_harmless(artifacts: dict[str, Any]) -> None:
    check_mutations("profile", artifacts)


def test_mutated_plans_are_refused_or_harmless(artifacts: dict[str, Any]) -> None:
    check_mutations("plan", artifacts)


def test_mutated_reports_are_refused_or_harmless(artifacts: dict[str, Any]) -> None:
    check_mutations("report", artifacts)


def test_a_writer_never_writes_a_document_its_schema_refuses(tmp_path: Path) -> None:
    """The one way an artifact is written (schema.write_artifact) checks it first: a profile with
    one figure per size fewer than it has sizes is our bug, raised loudly, and no file appears."""
    from gpipe_plan.schema import InvalidOutput, write_artifact

    good = profile_doc(L=3)
    write_artifact(tmp_path / "good.json", good, "profile")
    assert json.loads((tmp_path / "good.json").read_text())["layers"] == good["layers"]
    bad = copy.deepcopy(good)
    bad["layers"][1]["forward_s"] = bad["layers"][1]["forward_s"][:-1]
    with pytest.raises(InvalidOutput, match=r"layers\[1\]\.forward_s"):
        write_artifact(tmp_path / "bad.json", bad, "profile")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.json"]


def test_a_file_from_a_newer_gpipe_plan_is_not_told_to_be_re_created() -> None:
    # (re-profiling would throw its measurements away; the reader is what is too old)
    from gpipe_plan.schema import check_format

    newer = {"format": PROFILE_FORMAT, "version": FORMAT_VERSIONS[PROFILE_FORMAT] + 1}
    with pytest.raises(BadInput, match="a newer gpipe-plan wrote it: read it with that version, or upgrade this one$"):
        check_format(newer, PROFILE_FORMAT, "p.json")
    with pytest.raises(BadInput, match="re-create it with this version of gpipe-plan$"):
        check_format({"format": PROFILE_FORMAT, "version": 0}, PROFILE_FORMAT, "p.json")
    with pytest.raises(BadInput, match=r"expected 'gpipe-plan.profile'$"):     # no "(it is a profil)"
        check_format({"format": "gpipe-plan.profil", "version": 1}, PROFILE_FORMAT, "p.json")


@pytest.mark.parametrize("case", ["profile: host_speed a string", "profile: layer_tries a number"])
def test_a_malformed_host_speed_is_refused_by_every_reader(case: str, artifacts: dict[str, Any],
                                                           tmp_path: Path) -> None:
    # (solve, explore and show read measurement.host_speed, undeclared: an AttributeError or a
    # TypeError with its traceback)
    kind, content = _corpus(artifacts)[case]
    bad = write_case(tmp_path, kind, content)
    for args in (["solve", bad.name, "--stages", "2", "-q", "--out", "plan.out.json"],
                 ["explore", bad.name, "--stages", "2", "--micro-batches", "2"], ["show", bad.name]):
        line = assert_refused(tmp_path, args)
        assert line.startswith(f"error: profile '{bad.name}': 'measurement.host_speed"), (args, line)


@pytest.mark.parametrize("version, advice", [
    (14.0, "a newer gpipe-plan wrote it: read it with that version, or upgrade this one"),  # 14 in a float
    (10 ** 400, "a newer gpipe-plan wrote it: read it with that version, or upgrade this one"),
    (2.5, "the version must be an integer, as gpipe-plan writes it"),
    (11.0, "the version must be an integer, as gpipe-plan writes it"),
    ("11", "the version must be an integer, as gpipe-plan writes it"),
    (True, "the version must be an integer, as gpipe-plan writes it"),
    (math.nan, "the version must be an integer, as gpipe-plan writes it"),
    (-1, "re-create it with this version of gpipe-plan"),
])
def test_a_version_that_is_not_a_readable_integer_is_told_what_it_is(version: Any, advice: str,
                                                                      artifacts: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    # (14.0 was told to be re-created, which would throw a newer gpipe-plan's work away)
    bad = write_case(tmp_path, "plan", put(artifacts["plan"], ("version",), version))
    line = assert_refused(tmp_path, ["show", bad.name])
    assert line.startswith(f"error: '{bad.name}' is plan format version ") and line.endswith(f": {advice}"), line


def test_a_plan_of_format_5_or_later_without_chunks_is_told_so() -> None:
    # (it was read as a plan before format 5, and refused for a key it never had: 'stages[0].layers')
    from gpipe_plan.schema import PLAN_FORMAT, validate

    for version in (5, FORMAT_VERSIONS[PLAN_FORMAT]):
        with pytest.raises(BadInput, match=rf"^plan 'p.json' has no 'chunks' \(a plan of format {version} keeps"):
            validate({"format": PLAN_FORMAT, "version": version, "stages": [{"index": 0}]}, "plan", "plan 'p.json'")
