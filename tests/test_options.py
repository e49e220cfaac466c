"""Each command's options are declared once (gpipe_plan/options.py): the command line is
generated from the dataclass, so its defaults are the Python API's."""

from __future__ import annotations

import dataclasses
import math

import click
import pytest

from gpipe_plan.cli import main
from gpipe_plan.planner.request import ExploreRequest, SolveCommand, SolveRequest
from gpipe_plan.profiles.options import MODEL_OPTIONS, ProfileOptions
from gpipe_plan.runtime.options import RunOptions

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
