"""Two machines, simulated: two torchrun launchers on this host, 2 ranks each, one K = 2, d = 2 plan.

On real machines each runs ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d
--rdzv-endpoint HOST:PORT -m gpipe_plan.cli run plan.json`` (docs/runtime.md, "Data parallel");
here both launchers meet at 127.0.0.1. The rendezvous numbers the nodes; ranks are node-major
(node j holds ranks 2j, 2j+1), so under the plan's ``pipeline-inner`` placement each node runs
one whole replica, and the gradient syncs cross the "network". Both must exit 0 and the model
saved must be the unsplit model's training on the global batch.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from gpipe_plan.artifacts import write_json_atomic
from gpipe_plan.runtime.launch import free_port

from helpers.cli_process import BIN
from helpers.ranks import GPT, LR, assert_same_parameters, unsplit_training
from helpers.ranks import data_parallel_plan

STEPS = 2


@pytest.mark.slow
def test_two_torchrun_launchers_train_like_the_unsplit_model(tmp_path: Path) -> None:
    doc = data_parallel_plan(GPT, [2, 2], replicas=2, micro_batches=2, micro_batch_size=2)
    doc["placement"].update(nodes=2, devices_per_node=2)
    plan = tmp_path / "plan.json"
    write_json_atomic(plan, doc)
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("GPIPE_PLAN_FAULT", None)
    command = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "-m", "gpipe_plan.cli", "run", str(plan),
               "--steps", str(STEPS), "--lr", str(LR), "--save", str(tmp_path / "model.pt"), "-q"]
    nodes = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-2000:]
    assert not any("placement is not the one planned" in err for _, err in outputs)
    assert_same_parameters(torch.load(tmp_path / "model.pt"), unsplit_training(GPT, global_batch=8, steps=STEPS),
                           atol=1e-5)
