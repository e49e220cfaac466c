"""Each command's options are declared once (gpipe_plan/options.py): the command line is
generated from the dataclass, so its defaults are the Python API's."""

from __future__ import annotations

import dataclasses
import math

from pathlib import Path

import click
import pytest

from gpipe_plan.artifacts import BadInput
from gpipe_plan.cli import main
from gpipe_plan.options import comma_list
from gpipe_plan.planner.request import ExploreRequest, SolveCommand, SolveRequest
from gpipe_plan.profiles.options import MODEL_OPTIONS, ProfileOptions
from gpipe_plan.runtime.options import RunOptions

from helpers.planner import cli, profile_doc, write_json

COMMANDS = {"profile": ProfileOptions, "solve": SolveCommand, "explore": ExploreRequest, "run": RunOptions}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_of_a_command_is_a_field_of_its_dataclass(command: str):
    """No option is declared in cli.py by hand: each is a field, with the field's default."""
    fields = {f.name: f for f in dataclasses.fields(COMMANDS[command]) if "flag" in f.metadata}
    options = {p.name: p for p in main.commands[command].params if isinstance(p, click.Option) and p.name != "help"}
    assert set(options) == set(fields)
    for name, param in options.items():
        assert param.default == fields[name].default, name
        assert param.opts[0] == fields[name].metadata["flag"].flags[0].split("/")[0], name


def test_the_options_solve_and_explore_share_have_one_declaration():
    shared = {f.name for f in dataclasses.fields(SolveRequest)} & {f.name for f in dataclasses.fields(ExploreRequest)}
    assert {"nodes", "network_latency_s", "gradient_sync", "sync_every", "optimizer"} <= shared
    for name in ("nodes", "network_bandwidth", "network_latency_s", "gradient_sync", "sync_every",
                 "global_batch_size", "link_bandwidth", "optimizer"):
        solve, explore = (next(f for f in dataclasses.fields(cls) if f.name == name)
                          for cls in (SolveRequest, ExploreRequest))
        assert solve.default == explore.default and solve.metadata["flag"] == explore.metadata["flag"], name


def test_the_model_options_are_profile_options():
    assert set(MODEL_OPTIONS) <= {f.name for f in dataclasses.fields(ProfileOptions)}


def test_a_request_is_checked_as_a_whole_for_a_python_caller_too():
    from gpipe_plan.artifacts import BadInput

    with pytest.raises(BadInput, match="--network-latency"):
        SolveRequest(stages=2, network_latency_s=-1.0).solve_options()
    with pytest.raises(BadInput, match="give --devices too"):
        ExploreRequest(nodes=2).check()
    for budget in (0.0, -1.0, math.nan):       # explore took these and ran (NaN never ran out)
        with pytest.raises(BadInput, match="--time-budget must be a positive number of seconds"):
            ExploreRequest(time_budget_s=budget).check()
    with pytest.raises(BadInput, match="--gradient-sync fsdp shards each stage over its d >= 2 replicas"):
        SolveRequest(stages=2, gradient_sync="fsdp").solve_options()
    with pytest.raises(BadInput, match="--network-bandwidth and --network-latency describe the links between nodes"):
        SolveRequest(stages=2, network_bandwidth="10").solve_options()
    options = SolveRequest(stages=2, memory_limit="1GiB", link_bandwidth="12.5", time_budget_s=3.0).solve_options()
    assert (options.memory_limit_bytes, options.link_bandwidth_bytes_per_s, options.time_budget_s) == (1 << 30, 12.5e9, 3.0)


def test_a_comma_list_reads_its_items_in_order() -> None:
    assert comma_list("8, 2,4", "--stages", "2,4") == [8, 2, 4]
    assert comma_list("3,32,32", "--input-shape", "3,32,32", distinct=False) == [3, 32, 32]
    assert comma_list("1f1b", "--schedule", "1f1b", item=str) == ["1f1b"]


@pytest.mark.parametrize("text, says", [
    ("", "needs at least one value, e.g. 2,4"),
    (" , ", "needs at least one value"),
    ("2,,4", "has an empty item (two commas in a row, or one at an end)"),
    ("2,4,", "has an empty item"),
    ("2,x", "is not a comma-separated list of integers, e.g. 2,4"),
    ("2,4,2", "gives 2 more than once: give each value once"),
])
def test_a_comma_list_refuses_what_would_be_lost_or_repeated(text: str, says: str) -> None:
    with pytest.raises(BadInput) as caught:
        comma_list(text, "--stages", "2,4")
    assert says in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("args, says", [
    (["--stages", "2,,4"], "--stages '2,,4' has an empty item"),
    (["--stages", "2", "--micro-batches", "4,4"], "--micro-batches '4,4' gives 4 more than once"),
    (["--stages", "2", "--schedule", "1f1b,1F1B"], "--schedule '1f1b,1F1B' gives 1f1b more than once"),
    (["--stages", "2", "--recompute", "never,"], "--recompute 'never,' has an empty item"),
])
def test_explore_refuses_a_list_with_a_blank_or_a_repeat(user_dir: Path, args: list[str], says: str) -> None:
    write_json(user_dir / "profile.json", profile_doc(L=4, sizes=(1, 2, 4), batch_size=4))
    result = cli("explore", "profile.json", *args)
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
