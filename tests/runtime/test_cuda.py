"""CUDA: mixed precision, memory accounting and span timing on a real GPU (skipped without one).

bench/gpu_smoke.sh runs these (``pytest -m gpu``) on the GPU machine; on a CPU they are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.cli_process import gpipe_plan
from gpipe_plan.artifacts import write_json_atomic
from gpipe_plan.models import Precision, model_spec
from gpipe_plan.profiles.profiler import ProfileRequest, profile_model
from helpers.handplan import hand_plan
from gpipe_plan.runtime.timing import SpanRecorder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPT = model_spec("gpt", layers=2, width=256, heads=4, seq_len=128, vocab_size=1024)


def profile(precision: Precision) -> dict:
    return profile_model(ProfileRequest(spec=GPT, micro_batch_sizes=[1, 2], device=torch.device("cuda"),
                                        warmup=1, repeats=3, recompute=False, precision=precision, warmup_s=0.2))


def test_bf16_profile_on_cuda_counts_bf16_bytes_and_the_context() -> None:
    fp32, bf16 = profile(Precision()), profile(Precision("bf16"))
    assert bf16["precision"] == "bf16" and bf16["device"]["context_bytes"] > 0
    block32, block16 = fp32["layers"][1], bf16["layers"][1]
    # fp32 activations are exactly proportional to the micro-batch (no CPU tensors counted).
    assert block32["activation_bytes"][1] == 2 * block32["activation_bytes"][0]
    slope32 = block32["activation_bytes"][1] - block32["activation_bytes"][0]
    slope16 = block16["activation_bytes"][1] - block16["activation_bytes"][0]
    assert 0.4 * slope32 <= slope16 <= 0.7 * slope32
    for layer in bf16["layers"]:
        assert all(v >= 0 for v in layer["peak_transient_bytes"])
        assert all(t > 0 for t in layer["forward_s"] + layer["backward_s"])
    assert all(r is not None and r > 0 for r in bf16["consistency"]["ratio"])


def test_span_marks_are_cuda_events_read_once_per_step() -> None:
    recorder = SpanRecorder(0, torch.device("cuda"))
    recorder.start_clock()
    x = torch.randn(4096, 4096, device="cuda")
    for m in range(3):
        start = recorder.mark()
        x = (x @ x).tanh()
        recorder.add("forward", m, start, recorder.mark())
    assert recorder.spans == []            # nothing read before the step ends
    recorder.now()
    recorder.end_step()
    spans = recorder.spans
    assert [s.micro_batch for s in spans] == [0, 1, 2]
    assert all(s.duration_s > 0 for s in spans)
    assert all(a.end_s <= b.start_s + 1e-6 for a, b in zip(spans, spans[1:]))


def test_a_solved_bf16_plan_runs_with_the_profiled_dtypes(tmp_path: Path) -> None:
    """profile -> solve -> run in bf16: every stage's outputs come from the CUDA profile (a
    dtype derived on the CPU would declare fp32 logits for the last stage)."""
    for args in (("profile", "gpt", "--layers", "2", "--width", "256", "--heads", "4", "--seq-len", "128",
                  "--vocab-size", "1024", "--device", "cuda", "--precision", "bf16", "--batch-size", "4",
                  "--repeats", "3", "-o", "profile.json", "-q"),
                 ("solve", "profile.json", "-k", "1", "-o", "plan.json", "-q"),
                 ("run", "plan.json", "--steps", "3", "--report", "report.json", "-q")):
        result = gpipe_plan(*args, cwd=tmp_path)
        assert result.returncode == 0, (args[0], result.stderr)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["precision"] == "bf16" and plan["stages"][-1]["output_dtypes"] == ["bfloat16"]
    assert plan["options"]["memory_limit_source"] == "device"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["run"]["device"] == "cuda" and report["run"]["precision"] == "bf16"


def test_bf16_single_stage_run_reports_reserved_and_outside_memory(tmp_path: Path) -> None:
    plan = hand_plan(GPT, [4], micro_batches=2, micro_batch_size=2, with_shapes=False, precision="bf16")
    write_json_atomic(tmp_path / "plan.json", plan)
    result = gpipe_plan("run", "plan.json", "--steps", "4", "--device", "cuda", "--report", "report.json", "-q",
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["run"]["precision"] == "bf16" and report["run"]["backend"] == "nccl"
    memory = report["stages"][0]["measured_memory"]
    assert memory["peak_reserved_bytes"] >= memory["peak_bytes"] > 0
    assert memory["context_bytes"] > 0 and memory["device_used_bytes"] >= memory["context_bytes"]
    assert report["measured_step_s"] > 0 and report["chunks"][0]["measured_forward_s"] > 0
