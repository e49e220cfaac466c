"""The exports against what the targets' own code does with them (torchtitan 0.3.0, megatron-core
0.19.2, DeepSpeed 0.19.8, torch's ``torch.distributed.pipelining``), where a check needs no more
than torch: each test names the upstream code whose behaviour it mirrors.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from gpipe_plan.models import build_model
from helpers.exports import GPT, write
from helpers.handplan import hand_plan
from helpers.planner import cli


# --------------------------------------------------------------------------- torchtitan
@pytest.mark.parametrize("schedule, balance, v", [("zb-h1", [3, 3], None), ("1f1b", [3, 3], None),
                                                   ("interleaved", [1, 2, 1, 2], 2), ("zb-v", [1, 2, 1, 2], None)])
def test_torchtitan_resolves_the_schedule_name_and_places_chunks_as_the_plan(user_dir: Path, schedule, balance,
                                                                             v) -> None:
    """torchtitan resolves ``pipeline_parallel_schedule`` with torch's ``get_schedule_class`` even
    with a CSV (0.3.0: ``_get_pipeline_metadata`` and ``_get_pp_rank_to_stage_indices_mapping``;
    later: ``ParallelismConfig.__post_init__``), and places the parts in a V for ZBVZeroBubble and
    DualPipeV, round-robin for every other class: ``_PipelineScheduleRuntime`` is no such name."""
    from torch.distributed.pipelining.schedules import (PipelineScheduleSingle, ScheduleDualPipeV,
                                                        ScheduleZBVZeroBubble, get_schedule_class)

    plan = write(user_dir / "plan.json", hand_plan(GPT, balance, micro_batches=4, micro_batch_size=2,
                                                   schedule=schedule, virtual_stages=v))
    result = cli("export", plan, "--to", "torchtitan")
    assert result.exit_code == 0, result.output
    parallelism = tomllib.loads((user_dir / "plan.torchtitan.toml").read_text())["parallelism"]
    cls = get_schedule_class(parallelism["pipeline_parallel_schedule"])
    assert issubclass(cls, PipelineScheduleSingle) == (len(balance) == 2)
    assert (cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV)) == (schedule == "zb-v")
    assert ("pipeline_parallel_schedule_csv" in parallelism) == (schedule == "zb-h1")
    text = (user_dir / "plan.torchtitan.toml").read_text()
    assert "_PipelineScheduleRuntime" not in text.split("[parallelism]")[1]


@pytest.mark.parametrize("schedule, v", [("zb-h1", 1), ("1f1b", 1), ("interleaved", 2), ("zb-v", 2)])
def test_the_schedule_csv_line_for_torchtitan_names_a_class_it_resolves(user_dir: Path, schedule: str, v: int) -> None:
    from torch.distributed.pipelining.schedules import (PipelineScheduleSingle, ScheduleDualPipeV,
                                                        ScheduleZBVZeroBubble, get_schedule_class)

    from helpers.plan_docs import chunked_plan

    (user_dir / "plan.json").write_text(json.dumps(chunked_plan(schedule, 2, v, micro_batches=4)))
    result = cli("export", "plan.json", "--schedule-csv", "s.csv")
    assert result.exit_code == 0, result.output
    name = re.search(r"--parallelism\.pipeline_parallel_schedule (\S+)", result.output).group(1)
    cls = get_schedule_class(name)
    assert issubclass(cls, PipelineScheduleSingle) == (v == 1)
    assert (cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV)) == (schedule == "zb-v")


def test_torchtitan_is_told_when_the_plan_recomputes(user_dir: Path) -> None:
    plan = write(user_dir / "plan.json", hand_plan(GPT, [3, 3], micro_batches=2, micro_batch_size=1,
                                                   schedule="1f1b", recompute=[True, False]))
    for target in ("torchtitan", "megatron"):
        result = cli("export", plan, "--to", target)
        assert result.exit_code == 0 and "recompute" in result.output, (target, result.output)


# --------------------------------------------------------------------------- Megatron-LM
def megatron_flags(text: str) -> dict[str, str]:
    body = " ".join(line.rstrip("\\ ") for line in text.splitlines() if line and not line.startswith("#"))
    return {flag: value.strip('"') for flag, value in re.findall(r"--([\w-]+) (\"[^\"]*\"|\S+)", body)}


def test_megatron_gets_one_way_of_saying_virtual_stages(user_dir: Path) -> None:
    """megatron/training/arguments.py (validate_args): 'No more than one of the following arguments
    can be set at the same time: --num-layers-per-virtual-pipeline-stage,
    --num-virtual-stages-per-pipeline-rank, --pipeline-model-parallel-layout'; the layout's own
    length gives v (``get_num_stages_from_str`` / pipeline size)."""
    plan = write(user_dir / "plan.json", hand_plan(GPT, [1, 2, 1, 2], micro_batches=4, micro_batch_size=2,
                                                   schedule="interleaved", virtual_stages=2))
    assert cli("export", plan, "--to", "megatron", "--out", "plan.args").exit_code == 0
    flags = megatron_flags(Path("plan.args").read_text())
    said = [f for f in ("num-layers-per-virtual-pipeline-stage", "num-virtual-stages-per-pipeline-rank",
                        "pipeline-model-parallel-layout") if f in flags]
    assert said == ["pipeline-model-parallel-layout"], flags
    layout = flags["pipeline-model-parallel-layout"]
    assert len(layout.split("|")) // int(flags["pipeline-model-parallel-size"]) == 2


@pytest.mark.parametrize("balance", [[1, 2, 3], [2, 2, 2], [3, 2, 1]])
def test_megatrons_first_and_last_stage_counts_are_ones_it_accepts(user_dir: Path, balance: list[int]) -> None:
    """TransformerConfig.__post_init__: num_layers_in_first/last_pipeline_stage 'must be larger
    than 0', and the middle stages share the rest evenly; a split Megatron cannot say that way
    gets no such line."""
    plan = write(user_dir / "plan.json", hand_plan(GPT, balance, micro_batches=4, micro_batch_size=1,
                                                   schedule="1f1b"))
    assert cli("export", plan, "--to", "megatron", "--out", "plan.args").exit_code == 0
    text = Path("plan.args").read_text()
    found = re.search(r"--decoder-first-pipeline-num-layers (\d+) --decoder-last-pipeline-num-layers (\d+)", text)
    layout = megatron_flags(text)["pipeline-model-parallel-layout"]
    per_stage = [stage.count("t") + sum(int(n) - 1 for n in re.findall(r"\*(\d+)", stage)) for stage in layout.split("|")]
    if found:
        first, last = int(found.group(1)), int(found.group(2))
        assert first > 0 and last > 0 and (first, last) == (per_stage[0], per_stage[-1])
        assert len(set(per_stage[1:-1])) <= 1
    else:
        assert 0 in (per_stage[0], per_stage[-1])


# --------------------------------------------------------------------------- torch
def test_split_spec_is_what_torchs_pipeline_accepts(user_dir: Path) -> None:
    """torch.distributed.pipelining._IR.annotate_split_points compares each value with
    ``SplitPoint.BEGINNING`` / ``END`` and raises 'Unknown split point type.' for anything else
    (a string included)."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import annotate_split_points

    plan = write(user_dir / "plan.json", hand_plan(GPT, [3, 3], micro_batches=2, micro_batch_size=2))
    assert cli("export", plan, "--to", "torch", "--out", "train.py").exit_code == 0
    namespace: dict = {}
    exec(compile(Path("train.py").read_text().split("def build_layers")[0], "script", "exec"), namespace)
    assert namespace["SPLIT_SPEC"] == {"blocks.2": SplitPoint.BEGINNING}
    annotate_split_points(build_model(GPT, seed=0).module, namespace["SPLIT_SPEC"])


# --------------------------------------------------------------------------- DeepSpeed
def test_deepspeed_recomputes_every_stage_whole_where_the_plan_does(user_dir: Path) -> None:
    """deepspeed/runtime/pipe/engine.py: the config's ``pipeline.activation_checkpoint_interval``
    (when > 0) becomes the PipelineModule's; its forward checkpoints runs of that many of a stage's
    layers, so the largest stage's count makes each stage one recomputed run, as the plan's chunks."""
    plan = write(user_dir / "plan.json", hand_plan(GPT, [2, 4], micro_batches=2, micro_batch_size=1,
                                                   schedule="1f1b", recompute=True))
    result = cli("export", plan, "--to", "deepspeed")
    assert result.exit_code == 0, result.output
    ds = json.loads((user_dir / "plan.deepspeed.json").read_text())
    assert ds["pipeline"]["activation_checkpoint_interval"] == 4
    assert "applies to every stage alike" not in result.output
    mixed = write(user_dir / "mixed.json", hand_plan(GPT, [2, 4], micro_batches=2, micro_batch_size=1,
                                                     schedule="1f1b", recompute=[True, False]))
    result = cli("export", mixed, "--to", "deepspeed")
    assert result.exit_code == 0 and "applies to every stage alike" in result.output
    assert "activation_checkpoint_interval" not in json.loads((user_dir / "mixed.deepspeed.json").read_text())["pipeline"]
