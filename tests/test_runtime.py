"""Runtime, in one process: schedules, plan checks, stages, data, checkpoints' bookkeeping.

The multi-process behaviour (equivalence with the unsplit model, faults, resume, torchrun)
is in test_runtime_multiproc.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpipe_plan.artifacts import BadInput, write_json_atomic
from gpipe_plan.models import build_model, model_spec
from gpipe_plan.runtime.conditions import condition_warnings
from gpipe_plan.runtime.data import TextBatches, batch_source, step_generator
from gpipe_plan.runtime.distributed import World, check_world
from gpipe_plan.runtime.handplan import hand_plan
from gpipe_plan.runtime.memory import ActivationMeter
from gpipe_plan.runtime.options import RunOptions, check_options
from gpipe_plan.runtime.plan import load_plan
from gpipe_plan.runtime.schedule import max_in_flight, stage_ops
from gpipe_plan.runtime.stage import build_stage
from gpipe_plan.runtime.trace import chrome_trace
from gpipe_plan.runtime.timing import Span

TINY_GPT = model_spec("gpt", layers=2, width=16, heads=2, seq_len=8, vocab_size=256)


def write_plan(tmp_path: Path, doc: dict, name: str = "plan.json") -> Path:
    path = tmp_path / name
    write_json_atomic(path, doc)
    return path


# ---------------------------------------------------------------------- schedules
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_stage_runs_each_forward_then_its_backward_once(schedule: str) -> None:
    for K in range(1, 5):
        for M in range(1, 7):
            for k in range(K):
                ops = stage_ops(schedule, k, K, M)
                assert sorted((op.kind, op.micro_batch) for op in ops) == sorted(
                    [("F", m) for m in range(M)] + [("B", m) for m in range(M)])
                done = set()
                for op in ops:
                    if op.kind == "B":
                        assert op.micro_batch in done, "backward before its forward"
                    done.add(op.micro_batch)


def test_in_flight_is_what_the_memory_model_charges() -> None:
    """The executor's deepest stash of micro-batches is the cost model's in-flight depth."""
    from gpipe_plan.planner.costmodel import CostModel, Setting
    from planner_helpers import make_figures

    for schedule in ("gpipe", "1f1b"):
        for K in range(1, 5):
            for M in range(1, 9):
                cost = CostModel(make_figures([1.0] * K, [1.0] * K), Setting(stages=K, micro_batches=M,
                                                                              schedule=schedule))
                for k in range(K):
                    assert max_in_flight(stage_ops(schedule, k, K, M)) == cost.in_flight(k), (schedule, K, M, k)


def test_orders_are_the_planners() -> None:
    from gpipe_plan.planner import schedule as planner
    for schedule in ("gpipe", "1f1b"):
        for K in range(1, 5):
            for M in range(1, 7):
                for k in range(K):
                    ours = [(op.kind, op.micro_batch) for op in stage_ops(schedule, k, K, M)]
                    assert ours == planner.operation_order(schedule, K, M, k)


# ---------------------------------------------------------------------- plans
def test_plan_checks_refuse_bad_plans_in_one_line(tmp_path: Path) -> None:
    good = hand_plan(TINY_GPT, [2, 2], micro_batches=2, micro_batch_size=2)
    assert load_plan(write_plan(tmp_path, good)).num_stages == 2
    cases = {
        "micro_batches 3 x micro_batch_size 2 must equal": {**good, "micro_batches": 3},
        "has no 'schedule'": {k: v for k, v in good.items() if k != "schedule"},
        "balance [3, 1] must have": {**good, "balance": [3, 1]},
        "stages[1].layers has 2 names, balance says 1": {**good, "balance": [2, 1]},
        "schedule 'zb' is not one of": {**good, "schedule": "zb"},
        "no PyTorch model to run": {**good, "model": {"source": "pipedream", "name": "resnet50"}},
        "is not a gpipe-plan plan": {**good, "format": "gpipe-plan.profile"},
    }
    for i, (message, doc) in enumerate(cases.items()):
        with pytest.raises(BadInput, match=message.split("[")[0].split("'")[0]) as info:
            load_plan(write_plan(tmp_path, doc, f"p{i}.json"))
        assert "\n" not in str(info.value)


def test_layer_names_that_do_not_match_the_model_are_refused(tmp_path: Path) -> None:
    doc = hand_plan(TINY_GPT, [2, 2], micro_batches=2, micro_batch_size=2)
    doc["stages"][1]["layers"][0] = "block7"
    plan = load_plan(write_plan(tmp_path, doc))
    with pytest.raises(BadInput, match="layer 2 is 'block7' in the plan but 'block1' in the rebuilt model"):
        build_stage(build_model(plan.model), plan, 0)


def test_world_size_must_be_the_number_of_stages(tmp_path: Path) -> None:
    plan = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [2, 2], micro_batches=2, micro_batch_size=2)))
    check_world(World(0, 2, 0, 2, "torchrun"), plan)
    with pytest.raises(BadInput, match="has 2 stages but 3 processes"):
        check_world(World(0, 3, 0, 3, "torchrun"), plan)


# ---------------------------------------------------------------------- stages
def test_stages_partition_the_model_and_save_as_the_unsplit_model(tmp_path: Path) -> None:
    spec = model_spec("resnet", blocks=[1, 1], width=8, image_size=8, num_classes=5)
    doc = hand_plan(spec, [2, 1, 1], micro_batches=2, micro_batch_size=2)
    plan = load_plan(write_plan(tmp_path, doc))
    reference = build_model(spec, seed=3).module.state_dict()
    merged: dict[str, torch.Tensor] = {}
    for k in range(3):
        stage = build_stage(build_model(spec, seed=3), plan, k)
        part = stage.state_dict()
        assert not set(part) & set(merged), "a tensor in two stages"
        merged.update(part)
        # Shapes are static: stage k receives exactly what stage k-1 sends.
        if k:
            assert stage.input_meta == previous.output_meta  # noqa: F821
        previous = stage  # noqa: F841
    assert list(reference) == [k for k in reference if k in merged] and set(merged) == set(reference)
    for key, value in reference.items():
        assert torch.equal(merged[key], value), key


def test_static_shapes_are_derived_when_the_plan_has_none(tmp_path: Path) -> None:
    with_shapes = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [1, 3], 2, 3), "a.json"))
    without = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [1, 3], 2, 3, with_shapes=False), "b.json"))
    for k in range(2):
        a = build_stage(build_model(TINY_GPT), with_shapes, k)
        b = build_stage(build_model(TINY_GPT), without, k)
        assert (a.input_meta, a.output_meta) == (b.input_meta, b.output_meta)
    assert a.input_meta[0].shape == (3, 8, 16)  # micro-batch 3, seq 8, width 16


def test_recomputing_stage_computes_the_same_gradients(tmp_path: Path) -> None:
    plain = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [4], 1, 2), "a.json"))
    recompute = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [4], 1, 2, recompute=True), "b.json"))
    grads = []
    for plan in (plain, recompute):
        model = build_model(TINY_GPT)
        stage = build_stage(model, plan, 0)
        assert stage.module.recompute == plan.stages[0].recompute
        (x,), y = model.synthetic_batch(2, step_generator(0, 0))
        meter = ActivationMeter.for_module(stage.module)
        with meter.forward(0):
            out = stage.module(x)
        model.loss(out, y).backward()
        grads.append([p.grad.clone() for p in stage.parameters()])
        if plan is plain:
            assert meter.peak_bytes > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- data
def test_batches_depend_on_seed_and_step_only(tmp_path: Path) -> None:
    model = build_model(TINY_GPT)
    source = batch_source(model, None, 4, seed=1)
    (a,), ta = source.batch(5)
    (b,), tb = source.batch(5)
    assert torch.equal(a, b) and torch.equal(ta, tb)
    assert not torch.equal(a, source.batch(6)[0][0])


def test_text_batches_are_bytes_with_next_byte_targets(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    (x,), y = TextBatches(str(text), seq_len=8, batch_size=3, seed=0).batch(0)
    assert x.shape == y.shape == (3, 8) and x.dtype == torch.int64
    assert torch.equal((x[:, 1:] + 0), y[:, :-1]) and torch.equal((x + 1) % 256, y)


def test_text_data_needs_a_byte_level_language_model(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    small = build_model(model_spec("gpt", layers=1, width=16, heads=2, seq_len=8, vocab_size=64))
    with pytest.raises(BadInput, match="has a vocabulary of 64"):
        batch_source(small, str(text), 2, 0)
    resnet = build_model(model_spec("resnet", blocks=[1], width=8, image_size=8, num_classes=3))
    with pytest.raises(BadInput, match="trains a language model on bytes.*'resnet' is not one"):
        batch_source(resnet, str(text), 2, 0)


# ---------------------------------------------------------------------- options, conditions, trace
def test_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    plan = str(write_plan(tmp_path, hand_plan(TINY_GPT, [4], 1, 2)))
    assert Path(check_options(RunOptions(plan=plan)).plan).is_absolute()
    for bad, message in [({"steps": 0}, "--steps"), ({"resume": True}, "--resume needs --checkpoint-dir"),
                         ({"save": str(tmp_path / "no" / "m.pt")}, "does not exist"),
                         ({"data": str(tmp_path / "missing.txt")}, "is not a file"), ({"lr": -1.0}, "--lr")]:
        with pytest.raises(BadInput, match=message):
            check_options(RunOptions(plan=plan, **bad))


def test_warns_when_run_outside_the_profiled_conditions(tmp_path: Path) -> None:
    plan = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [2, 2], 2, 2, threads=1)))
    assert condition_warnings(plan, threads=1, local_ranks=1, device_type="cpu") == []
    assert any("measured 1 thread(s)" in w for w in condition_warnings(plan, 2, local_ranks=1, device_type="cpu"))
    oversubscribed = condition_warnings(plan, threads=1, local_ranks=4096, device_type="cpu")
    assert any("compete for cores" in w for w in oversubscribed)
    assert any("measured on cpu" in w for w in condition_warnings(plan, 1, 1, "cuda"))


def test_trace_is_chrome_trace_format() -> None:
    spans = [[Span(0, 0, "forward", 0, 0.0, 0.001), Span(0, 0, "backward", 0, 0.002, 0.004)],
             [Span(1, 0, "forward", 0, 0.001, 0.002)]]
    doc = chrome_trace(spans, {})
    json.dumps(doc)
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["ts"], e["dur"]) for e in events] == [
        ("F0", 0, 0.0, 1000.0), ("B0", 0, 2000.0, 2000.0), ("F0", 1, 1000.0, 1000.0)]


def test_run_help_does_not_import_torch() -> None:
    code = ("import sys; from click.testing import CliRunner; from gpipe_plan.cli import main; "
            "r = CliRunner().invoke(main, ['run', '--help']); assert r.exit_code == 0, r.output; "
            "assert '--checkpoint-dir' in r.output; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_demo_draws_the_predicted_timeline() -> None:
    from gpipe_plan.runtime.demo import text_timeline

    plan = {"schedule": "gpipe", "micro_batches": 2, "stages": [
        {"forward_s": 1.0, "backward_s": 2.0, "optimizer_s": 0.0}, {"forward_s": 1.0, "backward_s": 2.0}]}
    _, first, second = text_timeline(plan, width=18).splitlines()  # 9 s: 2 characters a second
    # Stage 1 starts one forward late; stage 0 waits for stage 1's backwards: the bubble.
    assert first == "stage 0 |F0F1......B0==B1==|"
    assert second == "stage 1 |..F0F1B0==B1==....|"
