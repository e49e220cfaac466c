"""gpipe-plan explore: the what-if grid and the capacity table (issue 6)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gpipe_plan.schema import FORMAT_VERSIONS, PROFILE_FORMAT
from gpipe_plan.cli import main
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.planner.explore import explore, find_repeated_block
from gpipe_plan.planner.objective import evaluate
from gpipe_plan.planner.profile import Profile
from gpipe_plan.schedules import SCHEDULES

from helpers.planner import profile_doc

SIZES = [1, 2, 4, 8, 16]


def transformer_like(blocks: int = 6, intercept: float = 0.0, seed: int = 0) -> dict:
    """embed, `blocks` identical blocks, head; times exactly linear in the micro-batch size
    (plus an optional fixed cost); every layer saves at least its input for backward."""
    def layer(name, fwd, act, out, params):
        return {"name": name,
                "forward_s": [intercept + fwd * b for b in SIZES],
                "backward_s": [2 * (intercept + fwd * b) for b in SIZES],
                "activation_bytes": [act * b for b in SIZES],
                "output_bytes": [out * b for b in SIZES],
                "param_bytes": params}
    layers = [layer("embed", 1e-4, 1000, 4000, 400_000)]
    layers += [layer(f"block{i}", 1e-3, 20_000, 4000, 3_000_000) for i in range(blocks)]
    layers += [layer("head", 4e-4, 8000, 1000, 500_000)]
    return {"format": PROFILE_FORMAT, "version": FORMAT_VERSIONS[PROFILE_FORMAT],
            "model": {"source": "synthetic", "name": "transformer-like"},
            "device": {"type": "cpu", "name": "test", "threads": 1},
            "micro_batch_sizes": SIZES, "batch_size": 16, "input_bytes": [64 * b for b in SIZES],
            "layers": layers}


def test_throughput_never_decreases_with_more_micro_batches_when_times_are_linear():
    ex = explore(Profile(transformer_like()), [1, 2, 4, 8], "auto", 16, schedules=("gpipe", "1f1b"),
                 recomputes=("never", "always"), time_budget_s=5.0)
    series: dict[tuple, list[tuple[int, float]]] = {}
    for c in ex.cells:
        assert c.proven, c
        series.setdefault((c.stages, c.schedule, c.recompute), []).append((c.micro_batches, c.throughput_per_s))
    assert len(series) == 4 * 2 * 2
    for key, points in series.items():
        points.sort()
        assert [m for m, _ in points] == [1, 2, 4, 8, 16]
        for (m0, t0), (m1, t1) in zip(points, points[1:]):
            assert t1 >= t0 * (1 - 1e-9), (key, m0, t0, m1, t1)
    # and pipelining pays: 8 stages at M = 16 beat one device
    best8 = max(c.normalized_throughput for c in ex.cells if c.stages == 8)
    assert best8 > 3.0


def test_recomputation_never_raises_activation_memory():
    profile = Profile(transformer_like())
    ex = explore(profile, [1, 2, 4], "auto", 16, recomputes=("never",), time_budget_s=5.0)
    checked = 0
    for c in ex.cells:
        fig = profile.at(c.micro_batch_size)
        bounds = [0]
        for n in c.balance:
            bounds.append(bounds[-1] + n)
        plain = evaluate(CostModel(fig, Setting(c.stages, c.micro_batches, c.schedule, "never")), bounds)
        recomputed = evaluate(CostModel(fig, Setting(c.stages, c.micro_batches, c.schedule, "always")), bounds)
        for p, r in zip(plain.stages, recomputed.stages):
            assert r.activations_bytes <= p.activations_bytes
            checked += 1
        # and it buys memory only by paying time
        assert recomputed.step_s > plain.step_s
    assert checked > 20


def test_capacity_grows_with_stages_and_with_recomputation():
    profile = Profile(transformer_like(blocks=6))
    block = find_repeated_block(profile)
    assert block == {"first_layer": 1, "layers_per_block": 1, "blocks": 6, "names": ["block0"]}
    limit = 60_000_000
    ex = explore(profile, [1, 2, 4, 8], [1, 4, 16], 16, memory_limit_bytes=limit, time_budget_s=2.0)
    by = {(c.stages, c.recompute): c for c in ex.capacity}
    for recompute in ("never", "always"):
        blocks = [by[(K, recompute)].blocks for K in (1, 2, 4, 8)]
        assert blocks == sorted(blocks) and blocks[-1] > blocks[0], blocks
    for K in (1, 2, 4, 8):
        assert by[(K, "always")].blocks >= by[(K, "never")].blocks
    # one device: the static memory of a block is 3e6 params x 4 (param + grad + 2 Adam) = 12 MB,
    # so no more than 60 MB / 12 MB = 5 blocks can fit, whatever the activations
    assert by[(1, "never")].blocks <= 5


def test_cells_that_do_not_fit_are_marked_not_hidden():
    profile = Profile(transformer_like())
    ex = explore(profile, [1, 4], [1, 16], 16, memory_limit_bytes=30_000_000, recomputes=("never",),
                 time_budget_s=2.0)
    assert len(ex.cells) == 2 * 2 * 2
    one_device = [c for c in ex.cells if c.stages == 1]
    assert all(not c.fits and c.peak_memory_bytes > 30_000_000 and c.step_s for c in one_device)
    assert any(c.fits for c in ex.cells if c.stages == 4)


def test_cli_writes_json_rows_and_chart(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(transformer_like()))
    out, chart = tmp_path / "grid.json", tmp_path / "grid.svg"
    result = CliRunner().invoke(main, ["explore", str(path), "--stages", "1,2,4", "--micro-batches", "1,2,4,8",
                                       "--memory-limit", "60MB", "--json", str(out), "--chart", str(chart)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 3 * 4 * 2 * len(SCHEDULES)          # auto: every schedule
    for key in ("stages", "micro_batches", "schedule", "recompute", "throughput_per_s", "normalized_throughput",
                "bubble_fraction", "peak_memory_bytes", "fits"):
        assert all(key in r for r in rows)
    ref = [r for r in rows if r["stages"] == 1 and r["micro_batches"] == 1 and r["schedule"] == "gpipe"
           and r["recompute"] == "never"][0]
    assert ref["normalized_throughput"] == pytest.approx(1.0)
    assert doc["capacity"] and chart.read_text().startswith("<svg")


@pytest.mark.parametrize("args, message", [
    (["--stages", "1,x"], "--stages"),
    (["--micro-batches", "3"], "does not divide"),
    (["--recompute", "sometimes"], "--recompute"),
    (["--memory-limit", "lots"], "--memory-limit"),
    # every cell skipped: a grid of dashes is no answer (solve refuses the same request)
    (["--stages", "99"], "no cell of the grid can be planned (more stages than the"),
])
def test_cli_bad_input(tmp_path, args, message):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(transformer_like()))
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(main, ["explore", str(path), *args, "--json", str(out)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert result.output.startswith("error: ")       # the one line, no bar's empty line before it
    assert not out.exists()


def test_the_tables_show_the_new_schedules_and_interleaveds_chunks_per_stage():
    from rich.console import Console

    from gpipe_plan.planner.explore_view import render_exploration

    ex = explore(Profile(transformer_like()), [2], [4, 8], 16, schedules=("1f1b", "interleaved", "zb-h1", "zb-v"),
                 recomputes=("never",), time_budget_s=2.0)
    console = Console(record=True, width=200)
    render_exploration(ex, console, None)
    text = console.export_text()
    for schedule in ("1f1b", "interleaved", "zb-h1", "zb-v"):
        assert f"{schedule}, recompute never" in text
    interleaved = [c for c in ex.cells if c.schedule == "interleaved" and c.step_s is not None]
    assert interleaved and all(f"v={c.virtual_stages}" in text for c in interleaved)
    assert text.count(" v=") == len(interleaved)             # only interleaved cells say their v


# --------------------------------------------------------------------------- --devices: K x d = N
def _replica_options(**over):
    from gpipe_plan.planner.problem import SolveOptions

    base = dict(stages=None, devices=4, data_parallel="auto", nodes=2, global_batch_size=16, schedule="1f1b",
                recompute="never", link_bandwidth_bytes_per_s=2e9, link_latency_s=1e-5,
                network_bandwidth_bytes_per_s=0.2e9, network_latency_s=5e-5, time_budget_s=30.0)
    return SolveOptions(**{**base, **over})


@pytest.mark.parametrize("gradient_sync, limit", [("ddp", None), ("ddp", 55_000_000), ("fsdp", 55_000_000)])
def test_a_factorisations_row_agrees_with_search_devices(gradient_sync, limit):
    """Each K x d's best cell is the plan `solve --devices` makes for that K x d: same step, same M."""
    from gpipe_plan.planner.replicas import search_devices

    profile = Profile(transformer_like())
    options = _replica_options(gradient_sync=gradient_sync, memory_limit_bytes=limit)
    ex = explore(profile, None, "auto", 16, memory_limit_bytes=limit, schedules=("1f1b",), recomputes=("never",),
                 link_bandwidth_bytes_per_s=2e9, link_latency_s=1e-5, time_budget_s=30.0, devices=4, nodes=2,
                 network_bandwidth_bytes_per_s=0.2e9, network_latency_s=5e-5, gradient_sync=gradient_sync)
    result = search_devices(profile, options)
    ours = {(f.stages, f.data_parallel): f for f in ex.factorisations}
    theirs = {(f.stages, f.data_parallel): f for f in result.factorisations}
    assert set(ours) == set(theirs) == {(1, 4), (2, 2), (4, 1)}
    for key, f in theirs.items():
        row = ours[key]
        if f.result is None or not f.fits:
            assert row.best is None, key
            continue
        assert row.best is not None, (key, row.reason)
        assert row.best.step_s == pytest.approx(f.step_s, rel=1e-9), key
        assert row.best.micro_batches == f.result.best.setting.micro_batches, key
        assert row.best.proven
    # both rank the factorisations alike, and the replicas really pay for their gradient sync
    fitting = [f for f in result.factorisations if f.fits]
    assert [(f.stages, f.data_parallel) for f in ex.factorisations if f.best][:len(fitting)] == \
        [(f.stages, f.data_parallel) for f in fitting]
    assert all(c.slowest_stage_gradient_sync_s > 0 for c in ex.cells if c.data_parallel > 1 and c.step_s is not None)
    assert all(c.slowest_stage_gradient_sync_s == 0 for c in ex.cells if c.data_parallel == 1 and c.step_s is not None)
    # 55 MB holds the whole model (18.9 MB of parameters) on one device only sharded over 4: fsdp keeps
    # 18.9 x (1 + 1/4 + 1 + 2/4) = 52.0 MB, ddp 18.9 x (1 + 1 + 2) = 75.6 MB, before activations
    if limit is not None:
        assert (ours[(1, 4)].best is not None) == (gradient_sync == "fsdp")


def test_a_slower_network_never_buys_more_replicas():
    """Gradient syncs between nodes only get slower with the network: the best d cannot rise."""
    profile = Profile(transformer_like())
    best_d = []
    for network in (1e12, 1e9, 1e7):
        ex = explore(profile, None, "auto", 16, schedules=("1f1b",), recomputes=("never",), time_budget_s=5.0,
                     link_bandwidth_bytes_per_s=1e10, devices=8, nodes=2, network_bandwidth_bytes_per_s=network)
        best_d.append(ex.factorisations[0].data_parallel)
    assert best_d == sorted(best_d, reverse=True) and best_d[0] > best_d[-1], best_d


def test_cli_devices_writes_a_row_per_factorisation(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(transformer_like()))
    out = tmp_path / "grid.json"
    result = CliRunner().invoke(main, ["explore", str(path), "--devices", "4", "--nodes", "2",
                                       "--network-bandwidth", "1", "--link-bandwidth", "10", "--schedule",
                                       "gpipe,1f1b", "--recompute", "never", "--memory-limit", "60MB",
                                       "--json", str(out)], terminal_width=200)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["version"] == 2 and doc["devices"] == 4
    assert {(r["stages"], r["data_parallel"]) for r in doc["rows"]} == {(4, 1), (2, 2), (1, 4)}
    assert len(doc["rows"]) == 3 * 5 * 2                  # K x d, M in 1..16, two schedules
    for r in doc["rows"]:                                  # a replica's batch is 16 / d: M must divide it
        assert (r["step_s"] is None) == (16 // r["data_parallel"] % r["micro_batches"] != 0), r
    assert [f["stages"] * f["data_parallel"] for f in doc["factorisations"]] == [4, 4, 4]
    # one device holds the whole model: 18.9 MB of parameters x 4 (Adam) does not fit 60 MB
    by = {(f["stages"], f["data_parallel"]): f for f in doc["factorisations"]}
    assert by[(4, 1)]["fits"] and by[(2, 2)]["fits"] and not by[(1, 4)]["fits"]
    assert "over the memory limit" in by[(1, 4)]["reason"] and by[(1, 4)]["step_s"] is None
    assert [f["fits"] for f in doc["factorisations"]] == [True, True, False]       # best first
    assert doc["factorisations"][0]["step_s"] <= doc["factorisations"][1]["step_s"]
    for shape in ("4x1", "2x2", "1x4"):
        assert shape in result.output
    assert doc["capacity"] == [] and "capacity" not in result.output      # a one-replica question


@pytest.mark.parametrize("args, message", [
    (["--nodes", "2"], "give --devices"),
    (["--gradient-sync", "fsdp"], "give --devices"),
    (["--devices", "4", "--nodes", "3"], "--nodes 3"),
    (["--devices", "0"], "--devices"),
    (["--devices", "4", "--stages", "3"], "none divides --devices 4"),
    (["--devices", "4", "--network-bandwidth", "fast"], "--network-bandwidth"),
    (["--devices", "4", "--network-latency", "-1"], "--network-latency"),
    (["--devices", "4", "--nodes", "2"], "needs --network-bandwidth"),
    (["--devices", "4", "--nodes", "4", "--network-bandwidth", "1", "--network-latency", "1e300"],
     "--network-latency must be a number of seconds from 0 to 1e+07"),
    (["--devices", "2", "--gradient-sync", "localsgd", "--sync-every", "1099511627777"],
     "--sync-every 1099511627777 is more than 2^40"),
    (["--devices", "4", "--nodes", "2", "--network-bandwidth", "inf", "--network-latency", "0.001"],
     "--network-latency 0.001 counts only on a network of finite bandwidth"),
])
def test_cli_devices_bad_input(tmp_path, args, message):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(transformer_like()))
    out = tmp_path / "grid.json"
    result = CliRunner().invoke(main, ["explore", str(path), *args, "--json", str(out)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_the_progress_reaches_its_total_when_cells_are_skipped() -> None:
    """Cells that cannot run (more stages than layers, interleaved at K = 1) are noted, and
    count as done: the bar ends full."""
    calls: list[tuple[int, int]] = []
    explore(Profile(profile_doc(4, batch_size=8)), stages=[1, 2, 6], micro_batches=[2, 4],
            schedules=("gpipe", "interleaved"), recomputes=("never",), capacity=False,
            progress=lambda done, total, what: calls.append((done, total)))
    total = calls[-1][1]
    assert total == 3 * 2 * 2 * 1
    assert [done for done, _ in calls] == list(range(1, total + 1))
