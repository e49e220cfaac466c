"""``gpipe-plan export --to torch|torchtitan|megatron|deepspeed``: the plan in each trainer's terms."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe_plan.models import build_model
from gpipe_plan.planner.export.expressible import nearest_split
from gpipe_plan.planner.baselines import uniform
from helpers.handplan import hand_plan

from helpers.planner import cli
from helpers.ranks import LR, assert_same_parameters, run_in_one_group, unsplit_training
from helpers.exports import _llama, GPT, write

TARGETS = ("torch", "torchtitan", "megatron", "deepspeed")


def layout_parts(layout: str) -> list[list[str]]:
    """A Megatron layout string as symbols per stage: ``Et*2|tL`` -> [[E, t, t], [t, L]]."""
    stages = []
    for stage in layout.split("|"):
        symbols: list[str] = []
        for symbol, count in re.findall(r"([EtL])(?:\*(\d+))?", stage):
            symbols += [symbol] * int(count or 1)
        stages.append(symbols)
    return stages


def exports(plan: str, targets: tuple[str, ...] = TARGETS) -> dict[str, str]:
    """Each target's main file for ``plan``, exported through the command line."""
    texts = {}
    for target in targets:
        result = cli("export", plan, "--to", target, "--out", f"out.{target}")
        assert result.exit_code == 0, (target, result.output)
        texts[target] = Path(f"out.{target}").read_text()
    return texts


# Layers per chunk for each model (gpt: embed, 4 blocks, head; Llama: embeddings, 4 layers, norm, lm_head).
BALANCES = {("gpt", "1f1b"): [2, 2, 2], ("gpt", "interleaved"): [1, 2, 1, 2],
            ("llama", "1f1b"): [2, 2, 3], ("llama", "interleaved"): [2, 2, 1, 2]}


@pytest.mark.parametrize("which", ["gpt", "llama"])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_every_export_lists_every_layer_once_in_order(user_dir: Path, which: str, schedule: str) -> None:
    spec = GPT if which == "gpt" else _llama()
    balance = BALANCES[which, schedule]
    model = build_model(spec, seed=0)
    names, modules = [n for n, _ in model.layers], model.module_names()
    assert None not in modules and len(names) == sum(balance)
    doc = hand_plan(spec, balance, micro_batches=4, micro_batch_size=2, schedule=schedule,
                    virtual_stages=2 if schedule == "interleaved" else None)
    plan = write(user_dir / "plan.json", doc)
    # DeepSpeed holds one chunk per stage: an interleaved plan is refused (below).
    texts = exports(plan, TARGETS if schedule == "1f1b" else TARGETS[:3])

    # torch: CHUNKS holds every layer, in order, chunk c on the schedule's rank; its top says what it imports
    assert ("gpipe-plan imports 'hf_models' from the current directory or PYTHONPATH" in texts["torch"]) == \
        (which == "llama")
    namespace: dict[str, Any] = {}
    exec(compile(texts["torch"].split("def build_layers")[0], "script", "exec"), namespace)
    assert [n for chunk in namespace["CHUNKS"] for n in chunk["layers"]] == names
    assert [chunk["rank"] for chunk in namespace["CHUNKS"]] == [c["stage"] for c in doc["chunks"]]
    assert namespace["N_MICROBATCHES"] == 4
    # torchtitan: the model parts name every module once, in order, one part per chunk
    titan = tomllib.loads(texts["torchtitan"])["parallelism"]
    parts = titan["module_fqns_per_model_part"]
    assert [len(p) for p in parts] == balance and [m for p in parts for m in p] == modules
    # megatron: one embedding, every decoder layer, the output, cut where the plan cuts
    layout = re.search(r'--pipeline-model-parallel-layout "([^"]+)"', texts["megatron"]).group(1)
    stages = layout_parts(layout)
    assert len(stages) == len(balance)
    decoder = sum(1 for m in modules if re.search(r"(layers|blocks)\.\d+$", m))
    assert [s for stage in stages for s in stage] == ["E"] + ["t"] * decoder + ["L"]
    # deepspeed: every layer once, its parts the plan's boundaries
    if "deepspeed" in texts:
        ds = json.loads(texts["deepspeed"])
        assert ds["gpipe_plan"]["layers"] == names and ds["gradient_accumulation_steps"] == 4
        assert ds["gpipe_plan"]["parts"] == [sum(balance[:c]) for c in range(len(balance) + 1)]
        assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["train_batch_size"] == 8
    else:
        result = cli("export", plan, "--to", "deepspeed")
        assert result.exit_code == 2 and "one chunk per stage" in result.output


@pytest.mark.parametrize("schedule, balance, v", [("1f1b", [2, 4], None), ("interleaved", [1, 2, 1, 2], 2),
                                               ("zb-h1", [2, 4], None)])
def test_the_torchtitan_export_is_torchtitans_config_key_for_key(user_dir: Path, schedule, balance, v) -> None:
    """Without torchtitan installed: every key the TOML writes is a field of the torchtitan
    class its section is (tests/data/torchtitan-config.json, recorded from torchtitan), with a
    value of that field's type, and the schedule is one torch's registry resolves by name (as
    torchtitan does, a CSV beside it or not)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from helpers.torchtitan_config import SECTIONS, annotation_type, conforms, recorded

    fields = recorded()
    plan = write(user_dir / "plan.json", hand_plan(GPT, balance, micro_batches=4, micro_batch_size=2,
                                                   schedule=schedule, virtual_stages=v))
    assert cli("export", plan, "--to", "torchtitan").exit_code == 0
    fragment = tomllib.loads((user_dir / "plan.torchtitan.toml").read_text())
    assert set(fragment) == set(SECTIONS)
    for section, cls in SECTIONS.items():
        for key, value in fragment[section].items():
            assert key in fields[cls], f"torchtitan's {cls} has no field {key!r}"
            assert conforms(value, annotation_type(fields[cls][key])), (key, value, fields[cls][key])
    get_schedule_class(fragment["parallelism"]["pipeline_parallel_schedule"])
    if "pipeline_parallel_schedule_csv" in fragment["parallelism"]:
        assert (user_dir / fragment["parallelism"]["pipeline_parallel_schedule_csv"]).exists()


def test_the_types_check_refuses_what_torchtitan_would() -> None:
    from helpers.torchtitan_config import annotation_type, conforms

    assert conforms([["embed", "blocks.0"]], annotation_type("list[list[str]] | None"))
    assert conforms(None, annotation_type("list[list[str]] | None"))
    assert not conforms(["embed", "blocks.0"], annotation_type("list[list[str]] | None"))
    assert conforms(2, annotation_type("int")) and not conforms(True, annotation_type("int"))
    assert not conforms("2", annotation_type("int")) and conforms(1, annotation_type("float | int"))
    assert conforms("always", annotation_type("Literal['default', 'always', 'never']"))
    assert not conforms("sometimes", annotation_type("Literal['default', 'always', 'never']"))


def test_the_torchtitan_record_is_the_installed_torchtitans() -> None:
    """Where torchtitan is installed (the export-check extra): the record the default suite
    checks against is its config classes (else: python tests/helpers/torchtitan_config.py)."""
    pytest.importorskip("torchtitan.config")
    from helpers.torchtitan_config import record, recorded

    assert record() == recorded()


def test_torchtitans_own_parser_reads_the_export(user_dir: Path) -> None:
    config = pytest.importorskip("torchtitan.config")
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    from gpipe_plan.planner.export.to_torchtitan import cli_overrides

    ConfigManager()   # registers torchtitan's own parsing rules (a list[str] as a,b,c) on its registry
    doc = hand_plan(GPT, [2, 4], micro_batches=4, micro_batch_size=2, schedule="1f1b")
    plan = write(user_dir / "plan.json", doc)
    assert cli("export", plan, "--to", "torchtitan").exit_code == 0
    fragment = tomllib.loads((user_dir / "plan.torchtitan.toml").read_text())
    # The TOML sections are torchtitan's dataclasses, key for key.
    parallelism = config.ParallelismConfig(**fragment["parallelism"])
    training = config.TrainingConfig(**fragment["training"])
    assert parallelism.module_fqns_per_model_part == [["embed", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "head"]]
    assert training.local_batch_size == 8 and parallelism.pipeline_parallel_microbatch_size == 2
    # ... and the overrides, parsed by torchtitan's command line with its rules, give the same values.
    args = cli_overrides(fragment["parallelism"], fragment["training"])
    parsed = tyro.cli(config.ParallelismConfig, registry=custom_registry,
                      args=[a.replace("--parallelism.", "--") for a in args[:args.index("--training.local_batch_size")]])
    assert parsed == parallelism


def test_megatron_cannot_cut_between_the_final_norm_and_the_output(user_dir: Path) -> None:
    spec = _llama()
    names = [n for n, _ in build_model(spec, seed=0).layers]          # embed, 4 layers, norm, lm_head
    doc = hand_plan(spec, [6, 1], micro_batches=2, micro_batch_size=1, schedule="1f1b")
    plan = write(user_dir / "plan.json", doc)
    result = cli("export", plan, "--to", "megatron")
    assert result.exit_code == 0, result.output
    assert "not exact" in result.output and "[5, 2]" in result.output
    assert "its cost is unknown" in result.output            # a hand-written plan has no profile
    layout = re.search(r'layout "([^"]+)"', (user_dir / "plan.megatron.args").read_text()).group(1)
    assert layout_parts(layout) == [["E", "t", "t", "t", "t"], ["L"]] and names[-2:] == ["model.norm", "lm_head"]


def test_nearest_split_moves_each_cut_to_the_closest_allowed_place() -> None:
    assert nearest_split([3, 3], allowed=[2, 4]) == [2, 4]                 # 3 ties between 2 and 4: earlier
    assert nearest_split([1, 1, 4], allowed=[1, 3, 5]) == [1, 2, 3]
    assert nearest_split([2, 2], allowed=[]) is None
    assert nearest_split([1, 1, 1], allowed=[2]) is None


def test_deepspeed_uniform_is_deepspeeds_own_rule() -> None:
    # deepspeed.runtime.utils.partition_uniform's boundaries (layers per stage [3, 3, 2, 2], ...).
    assert uniform(10, 4) == (0, 3, 6, 8, 10)
    assert uniform(8, 4) == (0, 2, 4, 6, 8)
    assert uniform(3, 4) == (0, 1, 2, 3, 3)


def test_deepspeed_says_what_it_cannot_express(user_dir: Path) -> None:
    plan = write(user_dir / "plan.json", hand_plan(GPT, [1, 5], micro_batches=2, micro_batch_size=1, schedule="gpipe"))
    result = cli("export", plan, "--to", "deepspeed")
    assert result.exit_code == 0 and "not exact" in result.output and "1F1B only" in result.output
    ds = json.loads((user_dir / "plan.deepspeed.json").read_text())
    assert ds["pipeline"]["partition_method"] == "uniform" and ds["gpipe_plan"]["parts"] == [0, 1, 6]
    snippet = (user_dir / "plan.deepspeed.partition.py").read_text()
    assert "PARTS = [0, 1, 6]" in snippet
    compile(snippet, "snippet", "exec")


@pytest.mark.parametrize("args, message", [
    (["--to", "keras"], "unknown export target 'keras'"),
    (["--to", "torchtitan", "--out", "missing/dir/x.toml"], "--out"),
    ([], "say what to export"),
])
def test_bad_requests_are_one_line_and_write_nothing(user_dir: Path, args: list[str], message: str) -> None:
    plan = write(user_dir / "plan.json", hand_plan(GPT, [3, 3], micro_batches=2, micro_batch_size=1))
    before = set(os.listdir(user_dir))
    result = cli("export", plan, *args)
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert set(os.listdir(user_dir)) == before


@pytest.mark.parametrize("target", ["torch", "torchtitan", "megatron"])
def test_a_pipedream_plan_has_no_module_names_to_export(user_dir: Path, target: str) -> None:
    from helpers.plan_docs import chunked_plan

    doc = chunked_plan("1f1b", 2)
    doc["model"] = {"source": "pipedream", "name": "vgg16"}
    plan = write(user_dir / "plan.json", doc)
    result = cli("export", plan, "--to", target)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and not list(user_dir.glob("plan.*.*"))


@pytest.mark.slow
def test_the_torch_script_trains_as_gpipe_plan_run_does(user_dir: Path) -> None:
    """The exported script, under torchrun on gloo with 2 processes, ends at the parameters of
    `gpipe-plan run` of the same plan (and of the unsplit model)."""
    doc = hand_plan(GPT, [2, 1, 1, 2], micro_batches=4, micro_batch_size=2, schedule="interleaved", virtual_stages=2)
    plan = write(user_dir / "plan.json", doc)
    assert cli("export", plan, "--to", "torch", "--out", "train.py").exit_code == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    steps = ["--steps", "3"]
    script = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "train.py", *steps, "--lr", str(LR), "--save", "script.pt"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert script.returncode == 0, script.stderr[-3000:]
    # gpipe-plan run's trainer on the session's two ranks (the command line's own path has its tests)
    outcome = run_in_one_group([{"plan": plan, "steps": 3, "lr": LR, "save": "run.pt", "quiet": True}], user_dir)
    assert outcome["run.pt"] == "ok", outcome
    by_script, by_run = torch.load("script.pt"), torch.load("run.pt")
    assert_same_parameters(by_script, by_run, atol=1e-6)
    assert_same_parameters(by_script, unsplit_training(GPT, 8, steps=3), atol=1e-5)


# Three functions of one's own for the script, torch alone: layers of the plan's names and shapes
# (GPT's: embed, block0..3, head; width 32, 8 tokens, 64 symbols), batches, and the loss.
OWN_FUNCTIONS = '''
def build_layers(seed):
    torch.manual_seed(seed)

    class Layer(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *xs):
            return (self.module(xs[0]),)

    layers = [("embed", Layer(nn.Embedding(64, 32)))]
    layers += [(f"block{i}", Layer(nn.Sequential(nn.Linear(32, 32), nn.Tanh()))) for i in range(4)]
    layers += [("head", Layer(nn.Linear(32, 64)))]

    class Model:
        module = nn.ModuleDict(dict(layers))

    return layers, Model()


def batches(model, seed):
    class Text:
        def batch(self, step):
            ids = torch.randint(0, 64, (BATCH_SIZE, 9), generator=torch.Generator().manual_seed(seed * 1000 + step))
            return (ids[:, :-1],), ids[:, 1:]

    return Text()


def loss_fn(model):
    return lambda outputs, targets: torch.nn.functional.cross_entropy(outputs[0].reshape(-1, 64), targets.reshape(-1))


'''


@pytest.mark.slow
def test_the_torch_script_needs_gpipe_plan_in_its_three_functions_only(user_dir: Path) -> None:
    """Where only torch imports (``python -S``: no site, so no editable gpipe-plan; torch's own
    folder on PYTHONPATH), the script as exported stops at once in one line, and with its three
    functions replaced by torch-only ones it trains."""
    plan = write(user_dir / "plan.json", hand_plan(GPT, [3, 3], micro_batches=2, micro_batch_size=2))
    assert cli("export", plan, "--to", "torch", "--out", "train.py").exit_code == 0
    text = Path("train.py").read_text()
    start, end = text.index("def build_layers("), text.index("def gpipe_plan(")
    Path("own.py").write_text(text[:start] + OWN_FUNCTIONS + text[end:])
    site = str(Path(torch.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": site, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    bare = [sys.executable, "-S"]
    probe = subprocess.run([*bare, "-c", "import torch, importlib.util as u; print(u.find_spec('gpipe_plan'))"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "None", probe.stdout + probe.stderr       # torch imports, gpipe_plan does not
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
                *bare]
    as_exported = subprocess.run([*torchrun, "train.py", "--steps", "2"], env=env, capture_output=True, text=True,
                                 timeout=300)
    assert as_exported.returncode != 0
    assert "error: this script builds the plan's model, data and loss with gpipe-plan, which this Python cannot " \
           "import (No module named 'gpipe_plan')" in as_exported.stderr, as_exported.stderr[-3000:]
    ranks_said = as_exported.stderr.split("failed (exitcode")[0]        # before torchrun's own report
    # Each rank says it in its one line; torchrun stops the other rank as soon as one fails, so the
    # slower one may be stopped before it gets there (CI saw one line of two).
    assert 1 <= ranks_said.count("error: this script") <= 2 and "Traceback" not in ranks_said, ranks_said
    own = subprocess.run([*torchrun, "own.py", "--steps", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stderr[-3000:]
    assert re.search(r"step 2: loss \d+\.\d+", own.stdout), own.stdout


@pytest.mark.parametrize("replicas", [[], ["--devices", "4", "--data-parallel", "2", "--link-bandwidth", "1"]])
def test_the_nearest_split_comes_with_the_planners_prediction(user_dir: Path, replicas: list[str]) -> None:
    """A plan that cuts between Llama's final norm and its output layer: Megatron keeps them
    together, so the export moves the cut and prices the split it exported with the profile."""
    from helpers.planner import profile_doc, write_json

    names = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    doc = profile_doc(L=5, forward_per_sample=[1e-3, 1e-3, 1e-3, 1e-3, 4e-3],
                      backward_per_sample=[2e-3, 2e-3, 2e-3, 2e-3, 8e-3])
    doc["model"] = {"source": "import", "factory": "hf_models:make_llama", "input_shape": [8], "loss": "lm"}
    for layer, name in zip(doc["layers"], names):
        layer["name"] = layer["module"] = name
    write_json(user_dir / "profile.json", doc)
    shape = replicas or ["--stages", "2", "--link-bandwidth", "inf"]
    solved = cli("solve", "profile.json", *shape, "-b", str(8 * (1 + bool(replicas))), "-m", "4",
                 "--schedule", "1f1b", "-o", "plan.json")
    assert solved.exit_code == 0, solved.output
    plan = json.loads((user_dir / "plan.json").read_text())
    assert plan["balance"] == [4, 1], "the heavy output layer alone on the last stage"
    result = cli("export", "plan.json", "--to", "megatron")
    assert result.exit_code == 0, result.output
    assert "[3, 2] layers per chunk instead of [4, 1]" in result.output
    predicted = re.search(r"predicted at ([\d.]+) ms per step.* against the plan's ([\d.]+) ms \(\+", result.output)
    assert predicted and float(predicted.group(1)) > float(predicted.group(2)), result.output
    # The planner's own evaluation of [3, 2] under the plan's setting, independently.
    from gpipe_plan.planner.command import load_profile
    from gpipe_plan.planner.costmodel import CostModel, Setting
    from gpipe_plan.planner.objective import evaluate

    profile = load_profile("profile.json")
    sync = {"data_parallel": 2, "sync_bandwidth_bytes_per_s": 1e9} if replicas else {}
    comm = {"link_bandwidth_bytes_per_s": 1e9} if replicas else {}
    ev = evaluate(CostModel(profile.at(2), Setting(stages=2, micro_batches=4, schedule="1f1b", **comm, **sync,
                                                   overhead_s=profile.per_microbatch_overhead_s)), [0, 3, 5], [False, False])
    assert f"{ev.step_s * 1e3:.3g}" == predicted.group(1)


def test_export_never_replaces_the_plan_it_reads_nor_leaves_a_file_when_refused(user_dir: Path) -> None:
    plan = write(user_dir / "plan.json", hand_plan(GPT, [3, 3], micro_batches=2, micro_batch_size=1))
    before = (user_dir / "plan.json").read_text()
    for args in (["--to", "torch", "-o", "plan.json"], ["--schedule-csv", "plan.json"]):
        result = cli("export", plan, *args)
        assert result.exit_code == 2 and "it is the file this command reads" in result.output, result.output
        assert (user_dir / "plan.json").read_text() == before
    # deepspeed refuses an interleaved plan: the CSV asked for in the same call is not written either.
    doc = hand_plan(GPT, [1, 2, 1, 2], micro_batches=4, micro_batch_size=1, schedule="interleaved", virtual_stages=2)
    inter = write(user_dir / "inter.json", doc)
    result = cli("export", inter, "--to", "deepspeed", "--schedule-csv", "s.csv")
    assert result.exit_code == 2 and not (user_dir / "s.csv").exists()


def test_a_plan_whose_replicas_do_not_add_up_is_refused(user_dir: Path) -> None:
    doc = hand_plan(GPT, [3, 3], micro_batches=2, micro_batch_size=2)
    doc.update(data_parallel=3)           # 3 x 2 x 2 is not the global batch of 4
    plan = write(user_dir / "plan.json", doc)
    result = cli("export", plan, "--to", "torchtitan")
    assert result.exit_code == 2 and "must equal global_batch_size" in result.output
    assert not list(user_dir.glob("plan.*.*"))


def test_a_zb_v_plan_is_not_exact_in_megatron(user_dir: Path) -> None:
    """Megatron's virtual stages go round-robin: the V's chunks land on other ranks."""
    spec = _llama()
    plan = write(user_dir / "plan.json", hand_plan(spec, [2, 1, 2, 2], micro_batches=4, micro_batch_size=1,
                                                   schedule="zb-v"))
    result = cli("export", plan, "--to", "megatron")
    assert result.exit_code == 0 and "not exact" in result.output and "places chunks in a V" in result.output


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adamw"])
def test_the_torch_script_trains_with_the_plans_optimizer(user_dir: Path, optimizer: str) -> None:
    """The plan keeps its optimizer in ``options.optimizer``, as run reads it; the script makes the same one."""
    doc = hand_plan(GPT, [3, 3], micro_batches=2, micro_batch_size=2)
    doc["options"]["optimizer"] = optimizer
    plan = write(user_dir / "plan.json", doc)
    assert cli("export", plan, "--to", "torch", "--out", "train.py").exit_code == 0
    text = Path("train.py").read_text()
    assert f"OPTIMIZER = {optimizer!r}" in text
    made = re.search(r"make = (\{.*?\})\[OPTIMIZER\]", text, re.S)
    assert made and f'"{optimizer}"' in made.group(1)
