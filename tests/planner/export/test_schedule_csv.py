"""``gpipe-plan export PLAN --schedule-csv FILE``: the plan's action lists as torch's schedule CSV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpipe_plan.schedules import all_actions, check_actions, from_csv

from helpers.plan_docs import as_version_4, chunked_plan
from helpers.planner import cli

SHAPES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("zb-v", 2)]


def write_plan(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("schedule, v", SHAPES)
@pytest.mark.parametrize("stages", [2, 4])
def test_the_csv_holds_the_plans_own_action_lists(user_dir: Path, schedule: str, v: int, stages: int) -> None:
    M = 2 * stages
    write_plan(user_dir / "plan.json", chunked_plan(schedule, stages, v, micro_batches=M))
    result = cli("export", "plan.json", "--schedule-csv", "schedule.csv")
    assert result.exit_code == 0, result.output
    text = (user_dir / "schedule.csv").read_text()
    actions = from_csv(text)
    assert actions == all_actions(schedule, stages, M, v)
    check_actions(schedule, stages, M, v, actions)          # complete, each chunk on its stage, in order
    assert len(text.splitlines()) == stages
    kinds = {a.kind for row in actions for a in row}
    assert kinds == ({"F", "I", "W"} if schedule in ("zb-h1", "zb-v") else {"F", "B"})
    count = sum(len(row) for row in actions)
    assert f"{stages} stages (a row each)" in result.stdout and f"{count} actions" in result.stdout
    assert "_load_csv('schedule.csv')" in result.stdout
    assert "pipeline_parallel_schedule_csv schedule.csv" in result.stdout


@pytest.mark.parametrize("schedule, v", SHAPES)
def test_torch_reads_every_cell_as_the_same_action(user_dir: Path, schedule: str, v: int) -> None:
    from torch.distributed.pipelining import schedules   # ships with every torch gpipe-plan supports
    kind_of = {"F": schedules._ComputationType.FORWARD, "B": schedules._ComputationType.FULL_BACKWARD,
               "I": schedules._ComputationType.BACKWARD_INPUT, "W": schedules._ComputationType.BACKWARD_WEIGHT}
    write_plan(user_dir / "plan.json", chunked_plan(schedule, 3, v, micro_batches=6))
    assert cli("export", "plan.json", "--schedule-csv", "s.csv").exit_code == 0
    ours = from_csv((user_dir / "s.csv").read_text())
    rows = (user_dir / "s.csv").read_text().splitlines()
    for row, expected in zip(rows, ours, strict=True):
        parsed = [schedules._Action.from_str(cell) for cell in row.split(",")]
        assert [(a.stage_index, a.computation_type, a.microbatch_index) for a in parsed] == \
            [(e.chunk, kind_of[e.kind], e.micro_batch) for e in expected]


@pytest.mark.parametrize("schedule, v", SHAPES)
@pytest.mark.parametrize("stages", [2, 4])
def test_torchs_runtime_loads_the_csv_and_pairs_every_send(user_dir: Path, schedule: str, v: int,
                                                          stages: int) -> None:
    """torch's own loader: its schedule check, its placement of chunks on ranks, and its lowering
    to sends and receives (which replays the lists and fails on an unmatched or deadlocked one)."""
    from torch.distributed.pipelining import schedules   # ships with every torch gpipe-plan supports
    M = 2 * stages
    write_plan(user_dir / "plan.json", chunked_plan(schedule, stages, v, micro_batches=M))
    assert cli("export", "plan.json", "--schedule-csv", "s.csv").exit_code == 0
    runtime = object.__new__(schedules._PipelineScheduleRuntime)   # no process group: only the loading
    plan = json.loads((user_dir / "plan.json").read_text())
    runtime.__dict__.update(pipeline_order={}, pp_group_size=stages, _num_stages=len(plan["chunks"]),
                            _n_microbatches=M, _stages=[], _defer_pp_recv=False)
    try:
        runtime._load_csv("s.csv")
    except AttributeError as exc:   # another torch: its loader reads state this test does not set up
        pytest.skip(f"this torch's _PipelineScheduleRuntime needs more to load a CSV: {exc}")
    assert runtime.stage_index_to_group_rank == {c["index"]: c["stage"] for c in plan["chunks"]}
    sends = [a for row in runtime.pipeline_order_with_comms.values() for a in row if "SEND" in str(a)]
    crossings = sum(1 for c, nxt in zip(plan["chunks"], plan["chunks"][1:]) if c["stage"] != nxt["stage"])
    assert len(sends) == 2 * crossings * M       # each cut between stages: activations and gradients


def test_a_version_4_plan_exports_one_chunk_per_stage(user_dir: Path) -> None:
    write_plan(user_dir / "old.json", as_version_4(chunked_plan("1f1b", 3, micro_batches=5)))
    assert cli("export", "old.json", "--schedule-csv", "s.csv").exit_code == 0
    assert from_csv((user_dir / "s.csv").read_text()) == all_actions("1f1b", 3, 5)


def assert_refused(result, message: str, user_dir: Path, before: set[str]) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert {p.name for p in user_dir.iterdir()} == before, "something was written"


def test_bad_plans_and_paths_are_refused_in_one_line_and_nothing_is_written(user_dir: Path) -> None:
    good = chunked_plan("zb-v", 2, micro_batches=4)
    write_plan(user_dir / "swapped.json", {**good, "stages": [{"chunks": [0, 1]}, {"chunks": [2, 3]}]})
    write_plan(user_dir / "odd.json", {**chunked_plan("interleaved", 2, 2), "micro_batches": 5,
                                       "global_batch_size": 5})
    write_plan(user_dir / "profile.json", {"format": "gpipe-plan.profile", "version": 6})
    write_plan(user_dir / "plan.json", good)
    before = {p.name for p in user_dir.iterdir()}
    assert_refused(cli("export", "absent.json", "--schedule-csv", "s.csv"), "'absent.json' does not exist",
                   user_dir, before)
    assert_refused(cli("export", "swapped.json", "--schedule-csv", "s.csv"),
                   "'stages[0].chunks' is [0, 1], expected [0, 3]", user_dir, before)
    assert_refused(cli("export", "odd.json", "--schedule-csv", "s.csv"), "is not a multiple of its", user_dir, before)
    assert_refused(cli("export", "profile.json", "--schedule-csv", "s.csv"), "is not a gpipe-plan plan",
                   user_dir, before)
    assert_refused(cli("export", "plan.json", "--schedule-csv", "nowhere/s.csv"), "folder 'nowhere' does not exist",
                   user_dir, before)
    assert cli("export", "plan.json").exit_code == 2     # the CSV's path is required


def test_out_without_to_is_refused_in_one_line_and_nothing_is_written(user_dir: Path) -> None:
    """``--out`` names the file of a ``--to`` export; with the CSV alone it would be ignored, so it
    is refused (the CSV goes to --schedule-csv), before either file is written."""
    write_plan(user_dir / "plan.json", chunked_plan("1f1b", 2, micro_batches=4))
    before = {p.name for p in user_dir.iterdir()}
    assert_refused(cli("export", "plan.json", "--schedule-csv", "s.csv", "--out", "x.toml"),
                   "--out goes with --to TARGET; the schedule's CSV is written to --schedule-csv FILE", user_dir, before)
    assert cli("export", "plan.json", "--schedule-csv", "s.csv").exit_code == 0     # the same without --out
