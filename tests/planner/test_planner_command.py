"""``gpipe-plan solve`` and ``show``: the plan document, determinism, the timeline, bad input,
and that none of it imports torch."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gpipe_plan.schema import FORMAT_VERSIONS, PLAN_FORMAT
from gpipe_plan.planner.plan import MAX_RUNNERS_UP, unproven_warnings
from gpipe_plan.schedules import (SPLIT_BACKWARD, all_actions, chunks_of_stage, chunks_per_stage, in_flight,
                                  stage_of_chunk)

from helpers.plan_docs import as_version_4, chunked_plan
from helpers.cli_process import gpipe_plan
from helpers.planner import cli, REPO, profile_doc, table_rows, write_json

# planner/ilp.py uses pulp APIs that pulp deprecates for its 4.0 (thousands of warnings a run).
pytestmark = pytest.mark.filterwarnings("ignore:.*PuLP 4:DeprecationWarning")

PLAN_KEYS = {"format", "version", "model", "profile", "options", "balance", "micro_batches", "micro_batch_size",
             "global_batch_size", "schedule", "virtual_stages", "chunks", "stages", "predicted", "optimality",
             "runners_up", "data_parallel", "gradient_sync", "placement", "factorisations"}
CHUNK_KEYS = {"index", "stage", "layers", "first_layer", "recompute", "forward_s", "backward_s", "backward_input_s",
              "backward_weight_s", "recompute_s", "send_s"}
STAGE_KEYS = {"index", "chunks", "optimizer_s", "gradient_sync_s", "memory_bytes", "memory", "in_flight", "busy_s", "idle_fraction"}
MEMORY_KEYS = {"params_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "transient_bytes"}
PREDICTED_KEYS = {"step_s", "makespan_s", "bubble_fraction", "samples_per_s", "peak_memory_bytes", "gradient_sync_s"}
OPTIONS_KEYS = {"stages", "global_batch_size", "micro_batches", "schedule", "recompute", "memory_limit_bytes",
                "link_bandwidth_bytes_per_s", "link_latency_s", "optimizer", "solver"}


@pytest.fixture
def profile_path(user_dir: Path) -> Path:
    return write_json(user_dir / "profile.json", profile_doc(L=6, batch_size=8))


# --------------------------------------------------------------------------- the plan document
def test_solve_writes_a_plan_with_the_documented_keys(profile_path: Path):
    result = cli("solve", "profile.json", "--stages", "3", "--out", "plan.json", "--link-bandwidth", "0.000001")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("plan.json").read_text())
    assert PLAN_KEYS <= plan.keys()
    assert plan["format"] == "gpipe-plan.plan" and plan["version"] == FORMAT_VERSIONS[PLAN_FORMAT] == 11
    assert OPTIONS_KEYS <= plan["options"].keys()
    assert PREDICTED_KEYS <= plan["predicted"].keys()
    assert {"proven", "method", "lower_bound_s", "gap"} <= plan["optimality"].keys()
    doc = json.loads(profile_path.read_text())
    assert plan["model"] == doc["model"]
    # What run checks the rebuilt model against (version 10): each layer's profiled bytes, in order.
    assert [b for chunk in plan["chunks"] for b in chunk["param_bytes"]] == [l["param_bytes"] for l in doc["layers"]]
    assert plan["profile"]["path"] == "profile.json"
    assert plan["profile"]["sha256"] == hashlib.sha256(profile_path.read_bytes()).hexdigest()
    assert plan["options"]["link_bandwidth_bytes_per_s"] == pytest.approx(1000.0)   # 1e-6 GB/s

    # balance: layers per chunk, consistent with the chunks; the stages hold the chunks their schedule says
    names = [layer["name"] for layer in doc["layers"]]
    K, M, v, schedule = 3, plan["micro_batches"], plan["virtual_stages"], plan["schedule"]
    chunks = plan["chunks"]
    assert v == chunks_per_stage(schedule, v) and len(plan["balance"]) == len(chunks) == K * v
    assert sum(plan["balance"]) == len(names) and [n for ch in chunks for n in ch["layers"]] == names
    assert plan["micro_batch_size"] * M == plan["global_batch_size"] == 8
    first = 0
    for c, ch in enumerate(chunks):
        assert CHUNK_KEYS <= ch.keys()
        assert ch["index"] == c and ch["stage"] == stage_of_chunk(schedule, c, K)
        assert ch["first_layer"] == first and len(ch["layers"]) == plan["balance"][c]
        first += len(ch["layers"])
        # the link is 1000 B/s and output bytes are 100 (1 + i % 4) per sample (profile_doc)
        last = names.index(ch["layers"][-1])
        crosses = c < len(chunks) - 1 and chunks[c + 1]["stage"] != ch["stage"]
        expected_send = 100 * (1 + last % 4) * plan["micro_batch_size"] / 1000.0 if crosses else 0.0
        assert ch["send_s"] == pytest.approx(expected_send, rel=1e-9)
        if schedule in SPLIT_BACKWARD:
            assert ch["backward_s"] == pytest.approx(ch["backward_input_s"] + ch["backward_weight_s"])
    actions = all_actions(schedule, K, M, v)
    for k, st in enumerate(plan["stages"]):
        assert STAGE_KEYS <= st.keys() and MEMORY_KEYS <= st["memory"].keys()
        assert st["index"] == k and st["chunks"] == chunks_of_stage(schedule, k, K, v)
        assert st["memory_bytes"] == pytest.approx(sum(st["memory"].values()), abs=2)
        assert st["in_flight"] == in_flight(actions[k])
        work = sum(chunks[c]["forward_s"] + chunks[c]["backward_s"] for c in st["chunks"])
        assert st["busy_s"] == pytest.approx(M * work + st["optimizer_s"])
    pred = plan["predicted"]
    busy = sum(st["busy_s"] for st in plan["stages"])
    assert pred["bubble_fraction"] == pytest.approx(1 - busy / (K * pred["step_s"]))
    assert pred["samples_per_s"] == pytest.approx(8 / pred["step_s"])
    assert pred["peak_memory_bytes"] == max(st["memory_bytes"] for st in plan["stages"])
    opt = plan["optimality"]
    assert opt["lower_bound_s"] <= pred["step_s"] * (1 + 1e-12)
    assert opt["gap"] == pytest.approx(pred["step_s"] / opt["lower_bound_s"] - 1, abs=1e-12)
    assert opt["proven"] and opt["gap"] == pytest.approx(0, abs=1e-9)     # nothing timed out here
    assert isinstance(plan["warnings"], list)
    assert not any("--time-budget" in w for w in plan["warnings"])    # proven: nothing to search further
    # runners-up: the other (M, schedule, v) settings, best first, none better than the plan
    runners = plan["runners_up"]
    assert len(runners) == min(opt["settings_searched"] - 1, MAX_RUNNERS_UP)
    settings = {(r["micro_batches"], r["schedule"], r["virtual_stages"]) for r in runners}
    assert len(settings) == len(runners) and (M, schedule, v) not in settings
    for r in runners:
        assert r["micro_batch_size"] * r["micro_batches"] == 8
        if r["fits"]:
            assert {"step_s", "samples_per_s", "bubble_fraction", "peak_memory_bytes", "balance", "recompute",
                    "proven"} <= r.keys()
            assert sum(r["balance"]) == len(names)
    runners = [r for r in runners if r["fits"]]
    steps = [r["step_s"] for r in runners]
    assert steps == sorted(steps) and all(s >= pred["step_s"] for s in steps)


def test_an_unproven_plan_says_how_far_it_may_be_and_what_searches_further():
    proven = {"proven": True, "gap": 0.0}
    assert unproven_warnings(proven, 30.0) == []
    (said,) = unproven_warnings({"proven": False, "gap": 0.0285}, 3.0)
    assert "--time-budget (3 s)" in said and "at most 2.85% slower than the best plan possible" in said
    assert said.endswith("a larger --time-budget searches further")
    (said,) = unproven_warnings({"proven": False, "gap": None}, 0.5)    # no bound at all
    assert "--time-budget (0.5 s)" in said and "at most" not in said


def test_solve_with_dp_and_ilp_agree(profile_path: Path):
    steps = {}
    for solver in ("dp", "ilp"):
        result = cli("solve", "profile.json", "-k", "3", "-m", "4", "--schedule", "1f1b", "--memory-limit", "60KB",
                     "--link-bandwidth", "0.0001", "--solver", solver, "--out", f"{solver}.json", "-q")
        assert result.exit_code == 0, result.output
        plan = json.loads(Path(f"{solver}.json").read_text())
        assert plan["optimality"]["proven"]
        assert all(st["memory_bytes"] <= 60000 for st in plan["stages"])
        steps[solver] = plan["predicted"]["step_s"]
    assert steps["ilp"] == pytest.approx(steps["dp"], rel=1e-7)


# --------------------------------------------------------------------------- determinism
def tie_profile() -> dict:
    """Eight identical layers: many partitions tie, so the tie-breaking decides the plan."""
    return profile_doc(L=8, batch_size=8, forward_per_sample=[1e-3] * 8, backward_per_sample=[2e-3] * 8,
                       activation_per_sample=[1000] * 8, output_per_sample=[100] * 8, param_bytes=[4000] * 8)


def test_solve_twice_gives_byte_identical_plans(user_dir: Path):
    write_json(user_dir / "profile.json", tie_profile())
    for out in ("a.json", "sub/b.json"):
        Path(out).parent.mkdir(exist_ok=True)
        result = cli("solve", "profile.json", "--stages", "3", "--out", out, "-q")
        assert result.exit_code == 0, result.output
    assert Path("a.json").read_bytes() == Path("sub/b.json").read_bytes()
    # and from fresh processes with different hash seeds (set and dict order must not matter)
    for seed in ("0", "4242"):
        proc = gpipe_plan("solve", "profile.json", "--stages", "3", "--out", f"p{seed}.json", "-q", cwd=user_dir,
                          env={"PYTHONHASHSEED": seed}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert Path(f"p{seed}.json").read_bytes() == Path("a.json").read_bytes()


def test_identical_layers_get_an_even_balance(user_dir: Path):
    """With identical layers the optimal GPipe balance is as even as possible, whatever wins the tie."""
    write_json(user_dir / "profile.json", tie_profile())
    for K in (2, 3, 5):
        result = cli("solve", "profile.json", "-k", str(K), "-m", "8", "--schedule", "gpipe", "--out", "p.json", "-q")
        assert result.exit_code == 0, result.output
        balance = json.loads(Path("p.json").read_text())["balance"]
        assert sorted(balance) == sorted([8 // K + (1 if k < 8 % K else 0) for k in range(K)])


# --------------------------------------------------------------------------- timeline and show
def test_timeline_svg(profile_path: Path):
    result = cli("solve", "profile.json", "-k", "2", "-m", "4", "--schedule", "1f1b", "--out", "plan.json",
                 "--timeline", "t.svg")
    assert result.exit_code == 0, result.output
    svg = Path("t.svg").read_text()
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    titles = [t.text for t in root.iter() if t.tag.endswith("title")]
    # one box per forward and per backward of each micro-batch on each stage: 2 * K * M
    assert sum(1 for t in titles if t.startswith("forward micro-batch")) == 2 * 4
    assert sum(1 for t in titles if t.startswith("backward micro-batch")) == 2 * 4
    # show redraws the same picture from the plan alone
    assert cli("show", "plan.json", "--timeline", "again.svg").exit_code == 0
    assert Path("again.svg").read_text() == svg


def test_show_plan_and_profile(profile_path: Path):
    assert cli("solve", "profile.json", "-k", "2", "--out", "plan.json", "-q").exit_code == 0
    shown = cli("show", "plan.json")
    assert shown.exit_code == 0, shown.output
    assert "layer0" in shown.stdout and "predicted step" in shown.stdout
    shown = cli("show", "profile.json")
    assert shown.exit_code == 0, shown.output
    assert all(f"layer{i}" in shown.stdout for i in range(6))


@pytest.mark.parametrize("schedule, v, held", [("zb-v", 2, ["0, 3", "1, 2"]), ("interleaved", 2, ["0, 2", "1, 3"]),
                                                ("zb-h1", 1, ["0", "1"])])
def test_show_prints_each_chunk_and_what_each_stage_holds(user_dir: Path, schedule: str, v: int, held: list[str]):
    write_json(user_dir / "plan.json", chunked_plan(schedule, 2, v))
    shown = cli("show", "plan.json")
    assert shown.exit_code == 0, shown.output
    rows = [line for line in shown.stdout.splitlines() if re.search(r"layer\d", line)]
    assert len(rows) == 2 * v                                  # one row per chunk
    split = schedule.startswith("zb")
    assert ("I: input gradient, W: weight gradient" in shown.stdout) == split
    stage_rows = table_rows(shown.stdout, "stage  chunks")
    assert [cells[1] for cells in stage_rows] == held  # the chunks column of the stages table
    label = "interleaved v=2" if schedule == "interleaved" else schedule
    assert f"schedule {label}" in shown.stdout


def test_a_version_4_plan_is_shown_as_one_chunk_per_stage(user_dir: Path):
    write_json(user_dir / "old.json", as_version_4(chunked_plan("1f1b", 3, send_s=0.002)))
    shown = cli("show", "old.json", "--timeline", "old.svg")
    assert shown.exit_code == 0, shown.output
    rows = table_rows(shown.stdout, "chunk  stage")
    assert [tuple(cells[:3]) for cells in rows] == [("0", "0", "layer0"), ("1", "1", "layer1"), ("2", "2", "layer2")]
    assert "per chunk and micro-batch, in ms" in shown.stdout
    assert [cells[-1] for cells in rows] == ["2.00", "2.00", "-"]     # sends to the next stage, in ms
    titles = [t.text for t in ET.fromstring(Path("old.svg").read_text()).iter() if t.tag.endswith("title")]
    assert sum(1 for t in titles if t.startswith("backward micro-batch")) == 3 * 4


def test_show_refuses_a_plan_whose_chunks_and_stages_disagree(user_dir: Path):
    doc = chunked_plan("interleaved", 2, 2)
    doc["chunks"][1]["stage"] = 0
    write_json(user_dir / "bad.json", doc)
    before = {p.name for p in user_dir.iterdir()}
    assert_one_line_error(cli("show", "bad.json", "--timeline", "t.svg"),
                          r"plan 'bad.json': 'chunks\[1\].stage' is 0, expected 1", user_dir, before)
    doc = chunked_plan("zb-h1", 2)
    doc["chunks"][1]["backward_weight_s"] = None       # a split schedule needs both halves
    write_json(user_dir / "bad.json", doc)
    assert_one_line_error(cli("show", "bad.json", "--timeline", "t.svg"),
                          r"zb-h1 runs the backward as I and W, but 'chunks\[1\].backward_weight_s' is missing",
                          user_dir, before)


def test_timeline_draws_input_and_weight_gradients_apart_and_names_chunks(user_dir: Path):
    K, M = 2, 4
    write_json(user_dir / "plan.json", chunked_plan("zb-v", K, micro_batches=M))
    assert cli("show", "plan.json", "--timeline", "t.svg").exit_code == 0
    root = ET.fromstring(Path("t.svg").read_text())
    titles = [t.text for t in root.iter() if t.tag.endswith("title")]
    for kind in ("forward", "backward_input", "backward_weight"):    # every chunk, every micro-batch
        assert sum(1 for t in titles if t.startswith(f"{kind} micro-batch")) == 2 * K * M
    assert not any(t.startswith("backward micro-batch") for t in titles)
    fills = {r.get("fill") for r in root.iter() if r.tag.endswith("rect") and r.find("{*}title") is not None
             and r.find("{*}title").text.startswith(("backward_input", "backward_weight"))}
    assert len(fills) == 2                                       # I and W in their own colours
    texts = [t.text for t in root.iter() if t.tag.endswith("text")]
    assert "input grad (I)" in texts and "weight grad (W)" in texts
    assert any(re.fullmatch(r"[0-3][FIW][0-3]", t or "") for t in texts)   # two chunks a stage: boxes say which
    write_json(user_dir / "gpipe.json", chunked_plan("gpipe", K, micro_batches=M))
    assert cli("show", "gpipe.json", "--timeline", "g.svg").exit_code == 0
    texts = [t.text for t in ET.fromstring(Path("g.svg").read_text()).iter() if t.tag.endswith("text")]
    assert "input grad (I)" not in texts and not any(re.fullmatch(r"\d[FB]\d", t or "") for t in texts)


# --------------------------------------------------------------------------- bad input
def _drop_field(doc):
    del doc["layers"][3]["backward_s"]
    return doc


BAD_PROFILES = {
    "malformed JSON": ('{"format": "gpipe-plan.profile", "version": 1, "layers": [', r"not valid JSON \(line 1"),
    "missing field": (_drop_field, r"has no 'layers\[3\]\.backward_s'"),
    "wrong format": (lambda d: {**d, "format": "gpipe-plan.plan"}, r"not a gpipe-plan profile.*it is a plan"),
    "wrong version": (lambda d: {**d, "version": 99}, r"version 99.*reads versions 1, 2, 3, 4, 5, 6,? .*or \d+"),
    "wrong list length": (lambda d: (d["layers"][1].update(forward_s=[1.0]), d)[1],
                          r"'layers\[1\]\.forward_s' must be a list of 3 numbers"),
}

BAD_OPTIONS = {
    "stages 0": (["--stages", "0"], r"--stages must be at least 1, got 0"),
    "stages > layers": (["--stages", "7"], r"--stages 7 is more than the profile's 6 layers"),
    "micro-batches not dividing": (["-k", "2", "--micro-batches", "3"],
                                   r"--micro-batches 3 does not divide the global batch of 8.*1, 2, 4, 8"),
    "micro-batches 0": (["-k", "2", "--micro-batches", "0"], r"--micro-batches"),
    "micro-batches text": (["-k", "2", "--micro-batches", "many"], r"--micro-batches"),
    "bad memory limit": (["-k", "2", "--memory-limit", "lots"], r"--memory-limit 'lots' is not a size"),
    "bad memory unit": (["-k", "2", "--memory-limit", "16 parsecs"], r"--memory-limit"),
    "negative memory limit": (["-k", "2", "--memory-limit=-1GiB"], r"--memory-limit must be at least 1 byte, got '-1GiB'"),
    "bad link bandwidth": (["-k", "2", "--link-bandwidth", "fast"], r"--link-bandwidth 'fast' is not a number"),
    "zero link bandwidth": (["-k", "2", "--link-bandwidth", "0"], r"--link-bandwidth must be a positive"),
    "negative latency": (["-k", "2", "--link-latency", "-1"], r"--link-latency"),
    "memory limit too small": (["-k", "2", "--memory-limit", "1KB"], r"no plan fits --memory-limit"),
    # Values a plan cannot record (schema.py's ceilings) are refused as typed, not after the search.
    "memory limit beyond 2^60": (["-k", "2", "--memory-limit", "1e30"], r"--memory-limit '1e30' is more than 1 EiB"),
    "link bandwidth beyond its ceiling": (["-k", "2", "--link-bandwidth", "1e12"],
                                          r"--link-bandwidth '1e12' is more than 1e\+09 GB/s: give 'inf'"),
    "latency beyond its ceiling": (["-k", "2", "--link-bandwidth", "1", "--link-latency", "1e300"],
                                   r"--link-latency must be a number of seconds from 0 to 1e\+07"),
    "latency on a free link": (["-k", "2", "--link-latency", "0.001"],
                               r"--link-latency 0.001 counts only on a link of finite bandwidth"),
    "sync-every beyond 2^40": (["--devices", "2", "-k", "1", "--gradient-sync", "localsgd", "--sync-every",
                                "1099511627777"], r"--sync-every 1099511627777 is more than 2\^40"),
    "devices with no factorisation": (["--devices", "99999999999"],
                                      r"no factorisation of 99999999999 devices gives a plan: .*and \d+ more$"),
}


def assert_one_line_error(result, pattern: str, user_dir: Path, before: set[str]) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert isinstance(result.exception, SystemExit)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in result.output
    assert {p.name for p in user_dir.iterdir()} == before, "a plan (or a temporary file) was written"


def test_missing_profile(user_dir: Path):
    result = cli("solve", "nowhere.json", "--stages", "2", "--out", "plan.json")
    assert_one_line_error(result, r"profile 'nowhere.json' does not exist", user_dir, set())


@pytest.mark.parametrize("case", list(BAD_PROFILES))
def test_bad_profile(user_dir: Path, case: str):
    change, pattern = BAD_PROFILES[case]
    if isinstance(change, str):
        (user_dir / "profile.json").write_text(change)
    else:
        write_json(user_dir / "profile.json", change(profile_doc(L=6, batch_size=8)))
    result = cli("solve", "profile.json", "--stages", "2", "--out", "plan.json")
    assert_one_line_error(result, pattern, user_dir, {"profile.json"})


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_option(profile_path: Path, user_dir: Path, case: str):
    args, pattern = BAD_OPTIONS[case]
    result = cli("solve", "profile.json", *args, "--out", "plan.json")
    assert_one_line_error(result, pattern, user_dir, {"profile.json"})


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _parse_size(text: str) -> float:
    value, unit = text.split()
    return float(value) * _UNITS[unit]


@pytest.mark.parametrize("limit,shown", [("20KB", "19.53 KiB"), ("70000", "68.36 KiB")])
def test_memory_limit_no_plan_meets_says_what_works(profile_path: Path, user_dir: Path, limit: str, shown: str):
    """The message gives the smallest limit that works, and an option that helps: check both by
    solving again. The profile: 6 layers, batch 8. With --recompute never, GPipe, M = 8, K = 2,
    adam, every stage holds 4x its parameter bytes plus 8 micro-batches of its activations.
    At 20 KB no single option is enough; at 70000 B some are (e.g. --stages 4 needs 60000 B)."""
    doc = json.loads(profile_path.read_text())
    base = ["solve", "profile.json", "-k", "2", "-m", "8", "--schedule", "gpipe", "--recompute", "never",
            "--out", "plan.json"]
    result = cli(*base, "--memory-limit", limit)
    assert_one_line_error(result, rf"no plan fits --memory-limit {shown} per device", user_dir, {"profile.json"})
    line = result.stderr.strip()
    need = _parse_size(re.search(r"the smallest limit that works is ([0-9.]+ \w+)", line).group(1))
    # independently: the least over the 5 cuts of the larger stage's memory at micro-batch size 1
    per_layer = [4 * layer["param_bytes"] + 8 * layer["activation_bytes"][0] for layer in doc["layers"]]
    least = min(max(sum(per_layer[:c]), sum(per_layer[c:])) for c in range(1, 6))
    assert least == 100000        # by hand: cut after layer 3, 24000 + 36000 + 32000 vs 32000 + 28000 + 40000
    assert need == pytest.approx(least, rel=0.01)
    assert cli(*base, "--memory-limit", str(int(least))).exit_code == 0
    assert cli(*base, "--memory-limit", str(int(least) - 1)).exit_code == 2
    # the option it names really helps: re-solving with it fits, or needs less
    flag = re.search(r"; (--[a-z-]+(?: \w+)?) would (make it fit|lower it to ([0-9.]+ \w+))", line)
    assert flag, line
    assert flag.group(2) == ("make it fit" if limit == "70000" else "lower it to " + flag.group(3))
    option = flag.group(1).split()
    swapped = list(base)
    if option[0] in swapped:
        swapped[swapped.index(option[0]) + 1] = option[1]
    else:
        swapped += option
    if flag.group(2) == "make it fit":
        fitted = cli(*swapped, "--memory-limit", limit)
        assert fitted.exit_code == 0, fitted.output
        assert all(st["memory_bytes"] <= 70000 for st in json.loads(Path("plan.json").read_text())["stages"])
    else:
        claimed = _parse_size(flag.group(3))
        assert claimed < need
        again = cli(*swapped, "--memory-limit", limit)
        assert again.exit_code == 2
        relaxed = re.search(r"the smallest limit that works is ([0-9.]+ \w+)", again.stderr).group(1)
        assert _parse_size(relaxed) == pytest.approx(claimed, rel=0.01)


def test_bad_input_in_a_real_process_is_one_line_on_stderr(profile_path: Path, user_dir: Path):
    proc = gpipe_plan("solve", "profile.json", "--stages", "9", "--out", "plan.json", cwd=user_dir,
                      env={"PYTHONWARNINGS": ""}, timeout=120)   # Python's own warnings, as a user's stderr
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: --stages 9"), proc.stderr
    assert not (user_dir / "plan.json").exists()


# --------------------------------------------------------------------------- no torch
_NO_TORCH = r"""
import sys
from gpipe_plan.cli import main
for args in ARGS:
    code = None
    try:
        main(args, prog_name="gpipe-plan")
    except SystemExit as exc:
        code = exc.code
    print("RESULT", repr((args[0], code, "torch" in sys.modules)))
"""


def test_solve_show_export_and_help_do_not_import_torch(profile_path: Path, user_dir: Path):
    if importlib.util.find_spec("torch") is None:   # the check means something only where torch exists
        pytest.skip("torch is not installed")
    runs = [["--help"], ["solve", "--help"], ["solve", "profile.json", "-k", "2", "--out", "plan.json", "-q",
                                              "--timeline", "t.svg"],
            ["show", "plan.json"], ["show", "profile.json"], ["solve", "profile.json", "-k", "9"],
            ["import-pipedream", str(REPO / "data" / "pipedream-profiles" / "alexnet.graph.txt"),
             "--out", "alexnet.json"], ["export", "plan.json", "--schedule-csv", "s.csv"]]
    script = _NO_TORCH.replace("ARGS", repr(runs))
    proc = subprocess.run([sys.executable, "-c", script], cwd=user_dir, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = [eval(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]  # noqa: S307
    assert [code for _, code, _ in seen] == [0, 0, 0, 0, 0, 2, 0, 0], proc.stdout + proc.stderr
    assert not any(torch for _, _, torch in seen), seen
    assert (user_dir / "plan.json").exists() and (user_dir / "alexnet.json").exists() and (user_dir / "s.csv").exists()


def test_show_refuses_what_it_cannot_show(user_dir: Path):
    write_json(user_dir / "other.json", {"format": "something.else", "version": 1})
    newer = FORMAT_VERSIONS[PLAN_FORMAT] + 1
    write_json(user_dir / "old.json", {"format": "gpipe-plan.plan", "version": newer})
    before = {p.name for p in user_dir.iterdir()}
    assert_one_line_error(cli("show", "other.json"), r"not a gpipe-plan profile, plan or report", user_dir, before)
    assert_one_line_error(cli("show", "old.json"), rf"version {newer}", user_dir, before)
    assert_one_line_error(cli("show", "absent.json"), r"'absent.json' does not exist", user_dir, before)


# --------------------------------------------------------------------------- found by these tests, fixed
def test_memory_limit_that_overflows_is_bad_input(profile_path: Path, user_dir: Path):
    result = cli("solve", "profile.json", "-k", "2", "--memory-limit", "1e400", "--out", "plan.json")
    assert_one_line_error(result, r"--memory-limit", user_dir, {"profile.json"})


@pytest.mark.parametrize("latency", ["nan", "inf", "-1"])
def test_link_latency_must_be_finite(profile_path: Path, user_dir: Path, latency: str):
    result = cli("solve", "profile.json", "-k", "2", "--link-bandwidth", "1", "--link-latency", latency,
                 "--out", "plan.json")
    assert_one_line_error(result, r"--link-latency", user_dir, {"profile.json"})


def test_zero_time_profile_solves_and_shows(user_dir: Path):
    doc = profile_doc(L=4, batch_size=4)
    for layer in doc["layers"]:
        layer["forward_s"] = [0.0, 0.0, 0.0]
        layer["backward_s"] = [0.0, 0.0, 0.0]
    write_json(user_dir / "profile.json", doc)
    result = cli("solve", "profile.json", "-k", "2", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    assert json.loads(Path("plan.json").read_text())["predicted"]["step_s"] == 0
    assert cli("show", "plan.json").exit_code == 0


def test_b_is_the_global_batch_size_in_every_command() -> None:
    """``-b`` has one meaning: ``--global-batch-size`` (the samples of a step), in profile as in
    solve and explore. Profile's ``--batch-size`` (the largest micro-batch it measures) has no
    short form: ``profile -b 16`` records a global batch of 16, it does not measure up to 16."""
    from gpipe_plan.cli import main

    short = {name: [p.name for p in command.params if "-b" in getattr(p, "opts", [])]
             for name, command in main.commands.items()}
    assert {name: names for name, names in short.items() if names} == {
        "profile": ["global_batch_size"], "solve": ["global_batch_size"], "explore": ["global_batch_size"]}
    profile = {p.name: p for p in main.commands["profile"].params}
    assert profile["batch_size"].opts == ["--batch-size"] and not profile["batch_size"].secondary_opts
    assert "-b, --global-batch-size" in cli("profile", "--help").output
