"""The exports read by the targets' own code, where it runs on a CPU (``pip install -e ".[export-check]"``).

- Megatron-Core: ``PipelineParallelLayerLayout``, the class ``--pipeline-model-parallel-layout``
  becomes, parses the exported layout; its own validation accepts it, and its own offsets give
  each chunk the plan's decoder layers, the embedding the first chunk, the loss the last.
- DeepSpeed: ``PipelineModule`` built on 2 gloo processes from the exported settings cuts the
  layer list at ``partition_method``'s boundaries, the exported ``PlannedPipelineModule`` at the
  plan's own; ``DeepSpeedConfig`` accepts the batch keys.

Each test skips, saying so, where its package is not installed (the ``test`` extra leaves them
out: they are large and need nothing else of the project). torchtitan's own config classes read
its export in tests/planner/export/test_export_targets.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from gpipe_plan.models import build_model, model_spec
from helpers.handplan import hand_plan
from helpers.planner import cli
from helpers.exports import GPT, _llama, write

NOT_INSTALLED = "not installed: pip install -e '.[export-check]' to check the export with its own code"


# --------------------------------------------------------------------------- Megatron-Core
@pytest.fixture(scope="module")
def megatron() -> Any:
    with warnings.catch_warnings():    # without Transformer Engine or Apex it says it falls back to torch
        warnings.simplefilter("ignore")
        layout = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout",
                                     reason=f"megatron-core {NOT_INSTALLED}")
        from megatron.core import parallel_state
        from megatron.core.transformer.enums import LayerType
    return layout.PipelineParallelLayerLayout, parallel_state, LayerType


def megatron_args(text: str) -> dict[str, str]:
    """``--flag value`` pairs of the exported arguments (comments left out)."""
    body = " ".join(line.rstrip("\\ ") for line in text.splitlines() if line and not line.startswith("#"))
    return {flag: value.strip('"') for flag, value in re.findall(r"--([\w-]+) (\"[^\"]*\"|\S+)", body)}


def decoder_numbers(modules: list[str | None]) -> list[int]:
    from gpipe_plan.planner.export.to_megatron import DECODER_LAYER

    return sorted({int(m.group(1)) for name in modules if name and (m := DECODER_LAYER.search(name))})


CASES = {  # model, balance (layers per chunk), schedule
    "gpt 1f1b": ("gpt", [2, 2, 2], "1f1b"),
    "gpt interleaved": ("gpt", [1, 2, 1, 2], "interleaved"),
    "llama 1f1b": ("llama", [2, 2, 3], "1f1b"),
    "llama interleaved": ("llama", [2, 2, 1, 2], "interleaved"),
}


@pytest.mark.parametrize("case", CASES)
def test_megatrons_own_layout_class_reads_the_exported_layout(user_dir: Path, megatron: Any, case: str) -> None:
    Layout, parallel_state, LayerType = megatron
    which, balance, schedule = CASES[case]
    spec = GPT if which == "gpt" else _llama()
    modules = build_model(spec).module_names()
    doc = hand_plan(spec, balance, micro_batches=4, micro_batch_size=2, schedule=schedule,
                    virtual_stages=2 if schedule == "interleaved" else None)
    plan = write(user_dir / "plan.json", doc)
    result = cli("export", plan, "--to", "megatron", "--out", "plan.args")
    assert result.exit_code == 0, result.output
    args = megatron_args(Path("plan.args").read_text())
    # The layout alone says v (Megatron refuses a second way beside it): its stages over K.
    assert "num-virtual-stages-per-pipeline-rank" not in args and "num-layers-per-virtual-pipeline-stage" not in args
    K = int(args["pipeline-model-parallel-size"])
    v = len(balance) // K
    layout = Layout(args["pipeline-model-parallel-layout"], K)      # Megatron's parse, its asserts
    assert (layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size) == (K, v)
    layout.validate_layer_layout(num_layers=int(args["num-layers"]), mtp_num_layers=None)
    bounds = [sum(balance[:c]) for c in range(len(balance) + 1)]
    if v > 1:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(v)
    try:
        for c in range(len(balance)):          # Megatron's chunk c: virtual stage c // K of rank c % K
            pp, vp = c % K, c // K
            assert doc["chunks"][c]["stage"] == pp
            ids = layout.get_layer_id_list(LayerType.decoder, vp_stage=vp, pp_rank=pp)
            assert ids == decoder_numbers(modules[bounds[c]:bounds[c + 1]]), (c, ids)
            held = layout.layout[pp][vp]
            assert held.count(LayerType.embedding) == (c == 0)
            assert held.count(LayerType.loss) == (c == len(balance) - 1)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def test_megatron_reads_the_nearest_split_where_the_plans_own_is_not_expressible(user_dir: Path,
                                                                                 megatron: Any) -> None:
    """Llama's final norm apart from its output layer: Megatron's 'L' holds both, so the export
    moves the cut, and Megatron's class reads the split it moved to."""
    Layout, _, LayerType = megatron
    pytest.importorskip("transformers")
    from hf_models import SEQ, VOCAB

    spec = model_spec("hf_models:make_llama", input_shape=[SEQ], vocab_size=VOCAB, loss="lm")
    assert build_model(spec).module_names() == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                                "model.norm", "lm_head"]
    plan = write(user_dir / "plan.json", hand_plan(spec, [4, 1], micro_batches=2, micro_batch_size=1))
    result = cli("export", plan, "--to", "megatron", "--out", "plan.args")
    assert result.exit_code == 0 and "[3, 2] layers per chunk instead of [4, 1]" in result.output, result.output
    args = megatron_args(Path("plan.args").read_text())
    layout = Layout(args["pipeline-model-parallel-layout"], 2)
    layout.validate_layer_layout(num_layers=2, mtp_num_layers=None)
    assert layout.layout[0][0] == [LayerType.embedding, LayerType.decoder, LayerType.decoder]
    assert layout.layout[1][0] == [LayerType.loss]


# --------------------------------------------------------------------------- DeepSpeed
# Run by each of K gloo processes: DeepSpeed's PipelineModule cuts a list of as many layers as
# the plan's by the exported rule and by the exported subclass, and DeepSpeedConfig reads the
# batch keys with the module's grid (its data-parallel size); each process writes what it got.
DEEPSPEED_CHECK = '''
import importlib, json, sys
import torch
from torch import nn
import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.config import DeepSpeedConfig

# On a CPU DeepSpeed compiles a shared-memory all-reduce op (a C++ build, minutes) when it
# starts its communication; nothing here all-reduces, so it is left unbuilt.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")
config_path, snippet_path, out = sys.argv[1:4]
config = json.load(open(config_path))
layers = [LayerSpec(nn.Linear, 2, 2) for _ in config["gpipe_plan"]["layers"]]
stages = config["pipeline"]["stages"]
by_rule = PipelineModule(layers=layers, num_stages=stages, partition_method=config["pipeline"]["partition_method"])
found = {"rule_parts": list(by_rule.parts), "rule_local": [by_rule._local_start, by_rule._local_stop]}
checked = DeepSpeedConfig(config, mpu=by_rule.mpu())
found["batch"] = [checked.train_batch_size, checked.train_micro_batch_size_per_gpu,
                  checked.gradient_accumulation_steps]
if snippet_path != "-":
    namespace = {}
    exec(compile(open(snippet_path).read(), snippet_path, "exec"), namespace)
    planned = namespace["PlannedPipelineModule"](layers=layers, num_stages=stages, parts=namespace["PARTS"])
    found["planned_parts"] = list(planned.parts)
    found["planned_local"] = [planned._local_start, planned._local_stop]
json.dump(found, open(f"{out}.{torch.distributed.get_rank()}", "w"))
'''


@pytest.mark.slow
@pytest.mark.parametrize("balance", [[3, 3], [2, 4]])
def test_deepspeeds_own_pipeline_module_cuts_where_the_export_says(user_dir: Path, balance: list[int]) -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip(f"deepspeed {NOT_INSTALLED}")
    plan = write(user_dir / "plan.json", hand_plan(GPT, balance, micro_batches=4, micro_batch_size=2, schedule="1f1b"))
    result = cli("export", plan, "--to", "deepspeed", "--out", "ds.json")
    assert result.exit_code == 0, result.output
    config = json.loads(Path("ds.json").read_text())
    snippet = Path("ds.partition.py")
    assert snippet.exists() == (balance != [3, 3])
    (user_dir / "check_deepspeed.py").write_text(DEEPSPEED_CHECK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "check_deepspeed.py", "ds.json", str(snippet) if snippet.exists() else "-", "found"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    parts = config["gpipe_plan"]["parts"]
    for rank in range(2):
        found = json.loads((user_dir / f"found.{rank}").read_text())
        assert found["batch"] == [8, 2, 4]
        assert found["rule_parts"] == [0, 3, 6]                  # 'uniform', as the export says it cuts
        if snippet.exists():                                     # the plan's own boundaries, as exported
            assert found["planned_parts"] == parts == [0, 2, 6]
            assert found["planned_local"] == parts[rank:rank + 2]
        else:
            assert parts == found["rule_parts"] and config["gpipe_plan"]["exact_with_partition_method"]
