"""Runtime, in one process: schedules, plan checks, stages, data, checkpoints' bookkeeping.

The multi-process behaviour (equivalence with the unsplit model, faults, resume, torchrun)
is in runtime/test_train.py.
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
from gpipe_plan.planner.costmodel import CostModel, Setting
from gpipe_plan.runtime.conditions import condition_warnings
from gpipe_plan.runtime.data import TextBatches, batch_source, step_generator
from gpipe_plan.runtime.distributed import World, check_world
from gpipe_plan.runtime.memory import ActivationMeter
from gpipe_plan.runtime.options import RunOptions, check_options
from gpipe_plan.runtime.plan import load_plan
from gpipe_plan.runtime.stage import build_chunk
from gpipe_plan.runtime.trace import chrome_trace
from gpipe_plan.runtime.timing import Span
from gpipe_plan.tensor_memory import SavedTensors

from helpers.handplan import hand_plan
from helpers.planner import make_figures

TINY_GPT = model_spec("gpt", layers=2, width=16, heads=2, seq_len=8, vocab_size=256)


def write_plan(tmp_path: Path, doc: dict, name: str = "plan.json") -> Path:
    path = tmp_path / name
    write_json_atomic(path, doc)
    return path


# ---------------------------------------------------------------------- schedules
@pytest.mark.parametrize("schedule, balance, stages", [("gpipe", [2, 2], 2), ("interleaved", [1, 1, 1, 1], 2),
                                                       ("zb-h1", [2, 2], 2), ("zb-v", [1, 1, 1, 1], 2)])
def test_a_plan_places_its_chunks_where_its_actions_run_them(tmp_path: Path, schedule: str, balance: list[int],
                                                             stages: int) -> None:
    """Every stage holds exactly the chunks its action list works on, and runs them in the
    schedule's own order: the executors take their lists from the plan."""
    plan = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, balance, micro_batches=4, micro_batch_size=1,
                                                    schedule=schedule)))
    assert plan.num_stages == stages and plan.num_chunks == len(balance)
    for k, actions in enumerate(plan.actions()):
        assert {a.chunk for a in actions} == set(plan.stages[k].chunks)
        assert all(plan.chunks[a.chunk].stage == k for a in actions)
        assert {a.kind for a in actions} == ({"F", "I", "W"} if plan.split_backward else {"F", "B"})
    if schedule == "zb-v":   # the V: stage 0 holds both ends, so it reads the inputs and computes the loss
        assert plan.stages[0].chunks == (0, 3) and plan.stages[1].chunks == (1, 2)


def test_a_schedule_that_cannot_run_these_micro_batches_is_refused(tmp_path: Path) -> None:
    doc = hand_plan(TINY_GPT, [1, 1, 1, 1], micro_batches=4, micro_batch_size=1, schedule="interleaved")
    # Interleaved takes micro-batches in rounds of about K = 2: 5 is not a multiple of 2 rounds.
    bad = {**doc, "micro_batches": 5, "global_batch_size": 5}
    with pytest.raises(BadInput, match="rounds") as info:
        load_plan(write_plan(tmp_path, bad))
    assert "\n" not in str(info.value)


def test_a_param_bytes_list_of_the_wrong_length_is_refused(tmp_path: Path) -> None:
    doc = hand_plan(TINY_GPT, [2, 2], micro_batches=2, micro_batch_size=1)
    doc["chunks"][1]["param_bytes"].append(64)
    with pytest.raises(BadInput, match=r"'chunks\[1\]\.param_bytes' has 3 entries for 2 layers; solve the "
                                       r"profile again"):
        load_plan(write_plan(tmp_path, doc))


@pytest.mark.parametrize("declared, cause", [
    ([[8, 32]], "the model's code or configuration changed since it was profiled"),
    ([[8, 16]], None),
])
def test_a_chunks_first_outputs_are_checked_against_the_plan(tmp_path: Path, declared: list[list[int]],
                                                             cause: str | None) -> None:
    """Another shape in the same dtype is a changed model (another dtype: another precision or
    device, tests/models/test_precision.py); what the plan declares passes."""
    doc = hand_plan(TINY_GPT, [2, 2], micro_batches=2, micro_batch_size=1)
    assert doc["chunks"][0]["output_shapes"] == [[8, 16]]
    doc["chunks"][0]["output_shapes"] = declared
    chunk = build_chunk(build_model(TINY_GPT, seed=0), load_plan(write_plan(tmp_path, doc)), 0)
    ids = torch.zeros(1, 8, dtype=torch.long)
    if cause is None:
        chunk.module(ids)
        return
    with pytest.raises(BadInput) as info:
        chunk.module(ids)
    assert str(info.value) == (f"chunk 0's output 0 is float32 [1, 8, 16] but the plan declares float32 [1, 8, 32]: "
                               f"{cause}; profile here, in the precision of the run, and solve again")


class NoNeighbours:
    """One stage: every chunk's neighbour is on it, nothing is sent or received."""

    def finish_sends(self) -> None: ...


@pytest.mark.parametrize("schedule, balance, virtual", [("gpipe", [4], None), ("1f1b", [4], None),
                                                        ("interleaved", [1, 2, 1], 3)])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_the_executors_deepest_stash_is_the_cost_models_in_flight(tmp_path: Path, schedule: str, balance: list[int],
                                                                  virtual: int | None, M: int) -> None:
    """The memory model's in-flight depth (micro-batches whose activations a stage holds at
    once) is what the executor holds, as its activation meter counts it; none is left after
    the step. (The split-backward schedules release at W, where the depth counts to I.)"""
    from gpipe_plan.runtime.executor import NativeExecutor
    from gpipe_plan.runtime.stage import build_stage_chunks
    from gpipe_plan.runtime.timing import SpanRecorder

    plan = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, balance, micro_batches=M, micro_batch_size=1,
                                                    schedule=schedule, virtual_stages=virtual)))
    model = build_model(TINY_GPT, seed=5)
    stage = build_stage_chunks(model, plan, 0)
    meter = ActivationMeter.for_module(stage.module)
    deepest = 0
    hold = meter.hold

    def counting_hold(key: object, nbytes: int) -> None:
        nonlocal deepest
        hold(key, nbytes)
        deepest = max(deepest, len(meter.live))

    meter.hold = counting_hold  # type: ignore[method-assign]
    executor = NativeExecutor(stage.chunks, plan.actions(), 0, M, model.loss, NoNeighbours(),  # type: ignore[arg-type]
                              SpanRecorder(0, torch.device("cpu")))
    inputs, targets = model.synthetic_batch(M, step_generator(0, 0))
    executor.step(inputs, targets, meter)
    cost = CostModel(make_figures([1.0] * len(balance), [1.0] * len(balance)),
                     Setting(stages=1, micro_batches=M, schedule=schedule, virtual_stages=virtual or 1))
    assert deepest == cost.in_flight(0)
    assert meter.live == {}, "every micro-batch's activations released by the end of the step"


@pytest.mark.parametrize("schedule, balance", [("gpipe", [4]), ("zb-h1", [4]), ("interleaved", [1, 2, 1]),
                                               ("zb-v", [2, 2])])
def test_one_stage_running_several_chunks_computes_the_whole_models_gradients(tmp_path: Path, schedule: str,
                                                                           balance: list[int]) -> None:
    """Chunks on one stage hand tensors over without messages (the bottom of a V), and I then W
    add up to B: the gradients are the unsplit model's, whatever the schedule."""
    from gpipe_plan.runtime.executor import NativeExecutor
    from gpipe_plan.runtime.stage import build_stage_chunks
    from gpipe_plan.runtime.timing import SpanRecorder

    virtual = 3 if schedule == "interleaved" else None
    plan = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, balance, micro_batches=2, micro_batch_size=2,
                                                    schedule=schedule, virtual_stages=virtual)))
    model = build_model(TINY_GPT, seed=5)
    stage = build_stage_chunks(model, plan, 0)
    assert [c.index for c in stage.chunks] == list(range(len(balance)))
    recorder = SpanRecorder(0, torch.device("cpu"))
    executor = NativeExecutor(stage.chunks, plan.actions(), 0, 2, model.loss, NoNeighbours(),  # type: ignore[arg-type]
                              recorder)
    inputs, targets = model.synthetic_batch(4, step_generator(0, 0))
    executor.step(inputs, targets)
    reference = build_model(TINY_GPT, seed=5)
    reference.loss(reference.forward(*inputs), targets).backward()
    expected = dict(reference.module.named_parameters())
    for key, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, expected[key].grad, rtol=1e-5, atol=1e-7)
    kinds = {s.kind for s in recorder.spans}
    assert kinds >= ({"forward", "backward_input", "backward_weight"} if plan.split_backward else {"forward", "backward"})
    assert "wait" not in kinds   # nothing came from another stage


# ---------------------------------------------------------------------- plans
def test_plan_checks_refuse_bad_plans_in_one_line(tmp_path: Path) -> None:
    good = hand_plan(TINY_GPT, [2, 2], micro_batches=2, micro_batch_size=2)
    assert load_plan(write_plan(tmp_path, good)).num_stages == 2
    cases = {
        "micro_batches 3 x micro_batch_size 2 must equal": {**good, "micro_batches": 3},
        "has no 'schedule'": {k: v for k, v in good.items() if k != "schedule"},
        "balance [3, 1] must have": {**good, "balance": [3, 1]},
        "chunks[1].layers' has 2 names, balance says 1": {**good, "balance": [2, 1]},
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
    doc["chunks"][1]["layers"][0] = "block7"
    plan = load_plan(write_plan(tmp_path, doc))
    with pytest.raises(BadInput, match="layer 2 is 'block7' in the plan but 'block1' in the rebuilt model"):
        build_chunk(build_model(plan.model), plan, 0)


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
    previous = None
    for k in range(3):
        chunk = build_chunk(build_model(spec, seed=3), plan, k)
        part = chunk.state_dict()
        assert not set(part) & set(merged), "a tensor in two chunks"
        merged.update(part)
        # Shapes are static: chunk k receives exactly what chunk k-1 sends.
        if previous is not None:
            assert chunk.input_meta == previous.output_meta
        previous = chunk
    assert list(reference) == [k for k in reference if k in merged] and set(merged) == set(reference)
    for key, value in reference.items():
        assert torch.equal(merged[key], value), key


def test_static_shapes_are_derived_when_the_plan_has_none(tmp_path: Path) -> None:
    with_shapes = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [1, 3], 2, 3), "a.json"))
    without = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [1, 3], 2, 3, with_shapes=False), "b.json"))
    for k in range(2):
        a = build_chunk(build_model(TINY_GPT), with_shapes, k)
        b = build_chunk(build_model(TINY_GPT), without, k)
        assert (a.input_meta, a.output_meta) == (b.input_meta, b.output_meta)
    assert a.input_meta[0].shape == (3, 8, 16)  # micro-batch 3, seq 8, width 16


def test_recomputing_stage_computes_the_same_gradients(tmp_path: Path) -> None:
    plain = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [4], 1, 2), "a.json"))
    recompute = load_plan(write_plan(tmp_path, hand_plan(TINY_GPT, [4], 1, 2, recompute=True), "b.json"))
    grads = []
    for plan in (plain, recompute):
        model = build_model(TINY_GPT)
        stage = build_chunk(model, plan, 0)
        assert stage.module.recompute == plan.chunks[0].recompute
        (x,), y = model.synthetic_batch(2, step_generator(0, 0))
        meter = ActivationMeter.for_module(stage.module)
        with meter.forward((0, 0)):
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
                         ({"data": str(tmp_path / "missing.txt")}, "is not a file"), ({"lr": -1.0}, "--lr"),
                         ({"weight_decay": -1.0}, r"^--weight-decay must be >= 0, got -1.0$"),
                         ({"momentum": 1.0}, r"^--momentum must be in \[0, 1\), got 1.0$"),
                         ({"keep_checkpoints": 0}, r"^--keep-checkpoints must be at least 1, got 0$"),
                         ({"seed": 2 ** 63}, r"^--seed must be a whole number from -2\^40 to 2\^40"),
                         # options that only mean something beside another, given alone, did nothing
                         ({"checkpoint_every": 5}, r"^--checkpoint-every .* saves none without --checkpoint-dir"),
                         ({"keep_checkpoints": 3}, r"^--keep-checkpoints .* saves none without --checkpoint-dir")]:
        with pytest.raises(BadInput, match=message):
            check_options(RunOptions(plan=plan, **bad))
    with pytest.raises(BadInput, match=r"^--momentum is --optimizer momentum's, and this run steps adam"):
        check_options(RunOptions(plan=plan, momentum=0.5)).optimizer_name("adam")
    assert check_options(RunOptions(plan=plan, momentum=0.5)).optimizer_name("momentum") == "momentum"
    defaults = check_options(RunOptions(plan=plan))
    assert (defaults.momentum_factor, defaults.steps_between_checkpoints, defaults.checkpoints_kept) == (0.9, 100, 2)


def test_no_output_replaces_the_profile_the_plan_was_made_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """calibrate reads the run's report with that profile: a --report (or --trace, --save) over
    it would lose it. Found where the plan records it, or beside the plan."""
    from gpipe_plan.planner.command import solve_file
    from helpers.planner import profile_doc, write_json

    write_json(tmp_path / "profile.json", profile_doc(8))
    monkeypatch.chdir(tmp_path)
    solve_file("profile.json", "plan.json", stages=2)
    for flag in ("report", "trace", "save"):
        with pytest.raises(BadInput, match=f"^cannot write --{flag} '.*profile.json': it is the file this command"):
            check_options(RunOptions(plan="plan.json", **{flag: str(tmp_path / "profile.json")}))
    assert json.loads((tmp_path / "profile.json").read_text())["format"] == "gpipe-plan.profile"
    assert check_options(RunOptions(plan="plan.json", report="report.json")).report.endswith("report.json")


def test_a_data_file_that_cannot_be_read_is_refused_before_the_ranks_start(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # (a rank used to fail on it with a traceback; root reads any file, so the refusal is simulated)
    plan = str(write_plan(tmp_path, hand_plan(TINY_GPT, [4], 1, 2)))
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    real_open = Path.open

    def refuse(self, *args, **kwargs):
        if self == text:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(BadInput, match=r"^cannot read --data '.*t\.txt': Permission denied$"):
        check_options(RunOptions(plan=plan, data=str(text)))


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


def test_trace_names_each_action_as_the_schedule_csv_does() -> None:
    """Chunk, kind, micro-batch: I and W of a split backward are spans of their own."""
    spans = [[Span(0, 0, "forward", 3, 0.0, 1.0, chunk=2), Span(0, 0, "backward_input", 3, 1.0, 2.0, chunk=2),
              Span(0, 0, "backward_weight", 3, 2.0, 3.0, chunk=2), Span(0, 0, "wait", 1, 3.0, 4.0, chunk=1),
              Span(0, 0, "optimizer", -1, 4.0, 5.0)]]
    events = [e for e in chrome_trace(spans, {})["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["2F3", "2I3", "2W3", "wait 1", "optimizer"]
    assert events[1]["cat"] == "backward_input" and events[1]["args"]["chunk"] == 2


def test_show_report_reads_per_chunk_times_and_older_per_stage_ones() -> None:
    """Version 3 keeps the times per chunk (a zb-v stage 0 holds chunks 0 and 3); a version-2
    report kept them on its stages, each one chunk: both show as rows per chunk."""
    stage = {"measured_peak_memory_bytes": 2**20, "measured_idle_fraction": 0.25}
    v3 = {"schedule": "zb-v", "virtual_stages": 2, "num_stages": 2, "measured_step_s": 0.01,
          "chunks": [{"index": c, "stage": s, "layers": [f"l{c}"], "measured_forward_s": 0.001 * (c + 1),
                      "measured_backward_s": 0.002, "measured_backward_input_s": 0.001,
                      "measured_backward_weight_s": 0.001} for c, s in enumerate([0, 1, 1, 0])],
          "stages": [{"index": 0, "chunks": [0, 3], "layers": ["l0", "l3"], **stage},
                     {"index": 1, "chunks": [1, 2], "layers": ["l1", "l2"], **stage}]}
    v2 = {"schedule": "1f1b", "num_stages": 2, "measured_step_s": 0.01,
          "stages": [{"index": k, "layers": [f"l{k}"], "measured_forward_s": 0.005, "measured_backward_s": 0.007,
                      **stage} for k in range(2)]}
    rows = {3: [("0", "0", "l0"), ("0", "3", "l3"), ("1", "1", "l1"), ("1", "2", "l2")], 2: [("0", "0", "l0"),
                                                                                          ("1", "1", "l1")]}
    for version, report in ((3, v3), (2, v2)):
        text = _shown(report)
        shown = [tuple(line.split()[:3]) for line in text.splitlines()]
        assert [row for row in shown if row in rows[version]] == rows[version], text
    assert "I+W ms" in _shown(v3) and "4.00 /" in _shown(v3) and "7.00 /" in _shown(v2)


def _shown(report: dict) -> str:
    import io

    from rich.console import Console

    from gpipe_plan.runtime.report import show_report

    out = io.StringIO()
    show_report(report, "r.json", Console(file=out, width=100))
    return out.getvalue()


def test_run_help_does_not_import_torch() -> None:
    code = ("import sys; from click.testing import CliRunner; from gpipe_plan.cli import main; "
            "r = CliRunner().invoke(main, ['run', '--help']); assert r.exit_code == 0, r.output; "
            "assert '--checkpoint-dir' in r.output; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_demo_draws_the_predicted_timeline() -> None:
    from gpipe_plan.demo import text_timeline
    from gpipe_plan.plan_view import view_of

    plan = {"model": {}, "schedule": "gpipe", "micro_batches": 2, "micro_batch_size": 1, "global_batch_size": 2,
            "balance": [1, 1],
            "chunks": [{"layers": ["a"], "forward_s": 1.0, "backward_s": 2.0},
                       {"layers": ["b"], "forward_s": 1.0, "backward_s": 2.0}],
            "stages": [{"optimizer_s": 0.0}, {}]}
    _, first, second = text_timeline(view_of(plan, "plan"), width=18).splitlines()  # 9 s: 2 characters a second
    # Stage 1 starts one forward late; stage 0 waits for stage 1's backwards: the bubble.
    assert first == "stage 0 |F0F1......B0==B1==|"
    assert second == "stage 1 |..F0F1B0==B1==....|"


def test_the_run_counts_saved_bytes_as_the_profile_does():
    """One meter for the profile and the run (gpipe_plan/tensor_memory.py): a buffer autograd
    saves is the module's, held whatever the micro-batch, not an activation; nor is a weight."""
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.register_buffer("scale", torch.full((8,), 2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * self.scale   # mul saves the buffer for its backward

    module = Scaled()
    x = torch.randn(4, 8, requires_grad=True)
    meter = ActivationMeter.for_module(module)
    with meter.forward((0, 0)):
        module(x)
    profiled = SavedTensors(exclude=[*module.parameters(), *module.buffers()])
    with profiled.recording():
        module(x)
    assert meter.peak_bytes == profiled.nbytes == x.numel() * x.element_size()   # the input alone


def test_a_text_too_short_for_one_window_says_how_long_it_must_be(tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_bytes(b"x" * 10)
    with pytest.raises(BadInput, match=r"has 10 bytes; the model reads windows of 65: give a text of at least 66 bytes"):
        TextBatches(str(text), 64, 2, 0)
    text.write_bytes(b"x" * 66)
    assert TextBatches(str(text), 64, 2, 0).path == str(text)
