"""Mixed precision end to end on the CPU (bf16 and fp16 autocast run there too), and the CUDA
measurement rules that can be checked without a GPU.

GPU users train in bf16; a plan from an fp32 profile would be off in time and memory, so the
precision is measured, recorded in the profile and the plan, and enforced by ``run``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers.cli_process import gpipe_plan
from gpipe_plan.artifacts import BadInput, check_precision, write_json_atomic
from gpipe_plan.models import AsTuple, Precision, model_spec
from gpipe_plan.planner.command import solve_file
from gpipe_plan.profiles.measure import Runner, prepare_layer, time_rounds
from gpipe_plan.profiles.clock import CpuClock
from gpipe_plan.tensor_memory import SavedTensors
from gpipe_plan.profiles.profiler import ProfileRequest, profile_model
from helpers.handplan import hand_plan
from helpers.ranks import run_in_one_group
from gpipe_plan.runtime.loss_scale import LossScaler

from helpers.planner import cli, profile_doc

TINY = model_spec("gpt", layers=2, width=32, heads=2, seq_len=16, vocab_size=256)
TEXT = "the quick brown fox jumps over the lazy dog; " * 400


def profile(spec: dict, precision: Precision, sizes: list[int] = [1, 2]) -> dict:  # noqa: B006
    return profile_model(ProfileRequest(spec=spec, micro_batch_sizes=sizes, warmup=0, repeats=1,
                                        recompute=False, precision=precision))


_TINY_PROFILES: dict[Precision, dict] = {}


def tiny_profile(precision: Precision) -> dict:
    """``profile(TINY, precision)``, measured once per precision for the module (each takes
    seconds; three tests read the fp32 and bf16 ones), a copy to each caller."""
    if precision not in _TINY_PROFILES:
        _TINY_PROFILES[precision] = profile(TINY, precision)
    return copy.deepcopy(_TINY_PROFILES[precision])


# --------------------------------------------------------------------------- the pairs
@pytest.mark.parametrize("pair", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32")])
def test_pairs_that_train(pair: tuple[str, str]) -> None:
    assert check_precision(*pair) == pair


@pytest.mark.parametrize("pair, message", [
    (("fp32", "bf16"), "parameters in bf16 need bf16 compute"),
    (("fp16", "fp16"), "fp16 parameters cannot be trained safely"),
    (("bf16", "fp16"), "fp16 parameters"),
    (("fp64", "fp32"), "is not one of fp32, bf16, fp16"),
])
def test_pairs_that_do_not(pair: tuple[str, str], message: str) -> None:
    with pytest.raises(BadInput, match=message):
        check_precision(*pair)


# --------------------------------------------------------------------------- the profile
def test_bf16_profile_counts_each_tensor_at_its_dtype() -> None:
    fp32 = tiny_profile(Precision())
    bf16 = tiny_profile(Precision("bf16"))
    pure = tiny_profile(Precision("bf16", "bf16"))
    assert (fp32["precision"], fp32["param_dtype"]) == ("fp32", "fp32")
    assert (bf16["precision"], bf16["param_dtype"]) == ("bf16", "fp32")
    assert (pure["precision"], pure["param_dtype"]) == ("bf16", "bf16")
    for l32, l16, lpure in zip(fp32["layers"], bf16["layers"], pure["layers"]):
        # Parameters: fp32 master weights are fp32; bf16 parameters half the bytes.
        assert l16["param_bytes"] == l32["param_bytes"]
        assert lpure["param_bytes"] * 2 == l32["param_bytes"]
    block32, block16 = fp32["layers"][1], bf16["layers"][1]
    assert block32["name"] == "block0"
    # Saved activations per sample: the matrix products save bf16 inputs (about half)...
    slope32 = block32["activation_bytes"][1] - block32["activation_bytes"][0]
    slope16 = block16["activation_bytes"][1] - block16["activation_bytes"][0]
    assert 0.4 * slope32 <= slope16 <= 0.7 * slope32
    # ...and each micro-batch also keeps autocast's bf16 copy of the weights it used: the
    # constant part of the line, at most half the fp32 weights' bytes.
    intercept16 = block16["activation_bytes"][0] - slope16
    assert 0 < intercept16 <= block32["param_bytes"] / 2
    assert block32["activation_bytes"][0] - slope32 == 0
    # The logits leave the head in bf16; the loss still trains (finite times measured).
    assert bf16["layers"][-1]["output_dtypes"] == ["bfloat16"]
    assert fp32["layers"][-1]["output_dtypes"] == ["float32"]
    assert all(t >= 0 for layer in bf16["layers"] for t in layer["forward_s"] + layer["backward_s"])


def test_the_plan_records_the_profiles_precision(tmp_path: Path) -> None:
    doc = tiny_profile(Precision("bf16"))
    write_json_atomic(tmp_path / "profile.json", doc)
    plan = solve_file(str(tmp_path / "profile.json"), str(tmp_path / "plan.json"), stages=2, global_batch_size=4)
    assert (plan["precision"], plan["param_dtype"]) == ("bf16", "fp32")
    shown = gpipe_plan("show", "plan.json", cwd=tmp_path)
    assert shown.returncode == 0 and "bf16 autocast, fp32 parameters" in " ".join(shown.stdout.split())


def test_run_refuses_a_precision_other_than_the_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused by the launcher, before any rank starts: checked in this process (click's runner,
    stdout and stderr together: the one line is all it says). The real process's refusal, its
    exit status and stderr, is runtime/test_async_executor.py's test_the_command_refuses_the_torch_executor_before_starting_ranks."""
    plan = hand_plan(TINY, [2, 2], micro_batches=2, micro_batch_size=2, precision="bf16")
    write_json_atomic(tmp_path / "plan.json", plan)
    monkeypatch.chdir(tmp_path)
    result = cli("run", "plan.json", "--precision", "fp32", "--steps", "1", "--report", "r.json")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: --precision fp32 differs from plan '{tmp_path / 'plan.json'}', made from a profile measured with "
        "--precision bf16: re-profile with --precision fp32 --param-dtype fp32 and solve again, or drop --precision"]
    assert not (tmp_path / "r.json").exists()
    # A plan older than precision ran fp32, and says so.
    write_json_atomic(tmp_path / "old.json", {**plan, "version": 2, "precision": "fp32"})
    result = cli("run", "old.json", "--precision", "bf16", "--steps", "1")
    assert result.exit_code == 2 and "measured with --precision fp32" in result.output


# --------------------------------------------------------------------------- training
def _write_plan(tmp_path: Path, name: str, balance: list[int], precision: str) -> None:
    """The plan every training run of this file trains: TINY, 2 micro-batches of 4."""
    write_json_atomic(tmp_path / f"{name}.json",
                      hand_plan(TINY, balance, micro_batches=2, micro_batch_size=4, precision=precision))


def _train(tmp_path: Path, name: str, balance: list[int], precision: str, steps: int, executor: str = "native",
           lr: str = "3e-3") -> dict[str, Any]:
    _write_plan(tmp_path, name, balance, precision)
    result = gpipe_plan("run", f"{name}.json", "--steps", str(steps), "--lr", lr, "--data", "text.txt",
                        "--executor", executor, "--save", f"{name}.pt", "--report", f"{name}-report.json", "-q",
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return {"params": torch.load(tmp_path / f"{name}.pt"),
            "report": json.loads((tmp_path / f"{name}-report.json").read_text())}


def _two_stages_and_one(tmp_path: Path, precision: str, steps: int) -> dict[str, Any]:
    """K = 2 and K = 1 trained alike in ``precision``; asserts they end within bf16 tolerance.

    The same operations in the same dtypes, only on two processes (one bf16 ulp of the largest
    weights is ~4e-3); on this CPU they agree bit for bit. Returns the K = 2 run.
    """
    (tmp_path / "text.txt").write_text(TEXT)
    two = _train(tmp_path, "k2", [2, 2], precision, steps)
    one = _train(tmp_path, "k1", [4], precision, steps)
    assert list(two["params"]) == list(one["params"])
    worst = max(float((two["params"][k].float() - one["params"][k].float()).abs().max()) for k in one["params"])
    assert worst <= 1e-2, worst
    return two


@pytest.mark.slow
def test_bf16_pipeline_learns_and_matches_one_stage(tmp_path: Path) -> None:
    report = _two_stages_and_one(tmp_path, "bf16", steps=30)["report"]
    assert report["run"]["precision"] == "bf16" and report["version"] == 6
    first, last = report["loss"]["first"], report["loss"]["last"]
    assert first > math.log(256) - 0.3 and last < first - 1.0, (first, last)
    # A matching fp32 run learns about as well: bf16 is not training something else; and
    # torch.distributed.pipelining runs the same bf16 stages (it scales the summed gradients by
    # 1/M where the native executor scales each loss: bf16 tolerance, not bit for bit). Both on
    # the session's two ranks (the runs above came in by the command line).
    jobs = []
    for name, precision, executor in (("k2-fp32", "fp32", "native"), ("k2-torch", "bf16", "torch")):
        _write_plan(tmp_path, name, [2, 2], precision)
        jobs.append({"plan": f"{name}.json", "steps": 30, "lr": 3e-3, "data": "text.txt", "executor": executor,
                     "save": f"{name}.pt", "report": f"{name}-report.json", "quiet": True})
    outcome = run_in_one_group(jobs, tmp_path)
    assert all(outcome[job["save"]] == "ok" for job in jobs), outcome
    fp32, torch_run = (json.loads((tmp_path / job["report"]).read_text()) for job in jobs)
    assert abs(fp32["loss"]["last"] - last) < 0.25
    assert torch_run["run"]["executor"] == "torch"
    assert abs(torch_run["loss"]["last"] - last) < 0.05


def test_a_stage_computing_other_dtypes_than_the_plan_declares_is_refused(tmp_path: Path) -> None:
    """A plan's cut dtypes come from its profile; a run that computes others (another precision
    or device) stops at the first forward in one line, instead of gloo aborting the next rank."""
    plan = hand_plan(TINY, [2, 2], micro_batches=2, micro_batch_size=2, precision="bf16")
    assert plan["chunks"][0]["output_dtypes"] == ["float32"]      # the residual stream stays fp32
    plan["chunks"][0]["output_dtypes"] = ["bfloat16"]              # as if profiled elsewhere
    write_json_atomic(tmp_path / "plan.json", plan)
    result = gpipe_plan("run", "plan.json", "--steps", "1", "--report", "r.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "chunk 0's output 0 is float32 [2, 16, 32] but the plan declares bfloat16 [2, 16, 32]" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "r.json").exists()


def test_a_checkpoint_resumes_only_in_its_own_precision(tmp_path: Path) -> None:
    (tmp_path / "text.txt").write_text(TEXT)
    for precision in ("fp16", "bf16"):
        write_json_atomic(tmp_path / f"{precision}.json",
                          hand_plan(TINY, [4], micro_batches=2, micro_batch_size=2, precision=precision))
    saved = gpipe_plan("run", "fp16.json", "--steps", "2", "--checkpoint-dir", "ckpt", "-q", cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    resumed = gpipe_plan("run", "bf16.json", "--steps", "3", "--checkpoint-dir", "ckpt", "--resume", cwd=tmp_path)
    assert resumed.returncode == 2
    assert "was made with precision = 'fp16', this run has 'bf16'" in resumed.stderr


@pytest.mark.slow
def test_fp16_pipeline_scales_the_loss_and_matches_one_stage(tmp_path: Path) -> None:
    report = _two_stages_and_one(tmp_path, "fp16", steps=6)["report"]
    scale = report["run"]["loss_scale"]
    assert scale["scale"] == 2.0 ** 16 and scale["skipped_steps"] == 0
    assert report["loss"]["last"] < report["loss"]["first"]


def test_the_last_stage_backpropagates_the_scaled_loss() -> None:
    """fp16: the gradients a backward leaves are the loss scale times the unscaled ones (the
    optimizer then divides them back); Adam would hide a missing scale, so check it here."""
    from gpipe_plan.models import build_model
    from gpipe_plan.runtime.executor import NativeExecutor
    from gpipe_plan.runtime.plan import load_plan
    from gpipe_plan.runtime.stage import build_chunk
    from gpipe_plan.runtime.timing import SpanRecorder

    class NoNeighbours:   # one stage: nothing to send or receive
        def finish_sends(self) -> None: ...

    def gradients(loss_scale: float) -> list[torch.Tensor]:
        model = build_model(TINY)
        plan = load_plan(plan_path)
        stage = build_chunk(model, plan, 0)
        executor = NativeExecutor([stage], plan.actions(), 0, 2, model.loss, NoNeighbours(),  # type: ignore[arg-type]
                                  SpanRecorder(0, torch.device("cpu")))
        executor.loss_scale = loss_scale
        inputs, targets = model.synthetic_batch(4, torch.Generator().manual_seed(0))
        executor.step(inputs, targets)
        return [p.grad.clone() for p in stage.parameters()]

    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        plan_path = Path(folder) / "plan.json"
        write_json_atomic(plan_path, hand_plan(TINY, [4], micro_batches=2, micro_batch_size=2))
        plain, scaled = gradients(1.0), gradients(1024.0)
    for g, s in zip(plain, scaled):
        torch.testing.assert_close(s, g * 1024.0, rtol=1e-5, atol=1e-6)


def test_a_probe_of_another_workload_is_not_compared() -> None:
    from gpipe_plan.speedprobe import profile_probe_s, workload

    assert profile_probe_s({"type": "cpu", "speed_probe_s": 0.01}) == 0.01              # unchanged on a CPU
    assert profile_probe_s({"type": "cuda", "speed_probe_s": 0.001}) is None           # before version 5
    assert profile_probe_s({"type": "cuda", "speed_probe_s": 0.05,
                            "speed_probe_workload": list(workload("cuda"))}) == 0.05
    assert profile_probe_s({"type": "cuda", "speed_probe_s": 0.05, "speed_probe_workload": [64, 256]}) is None


def test_calibrate_refuses_a_run_in_another_precision(tmp_path: Path) -> None:
    doc = tiny_profile(Precision())
    write_json_atomic(tmp_path / "profile.json", doc)
    report = {"format": "gpipe-plan.report", "version": 2, "model": doc["model"], "stages": [],
              "run": {"precision": "bf16", "param_dtype": "fp32"}}
    write_json_atomic(tmp_path / "report.json", report)
    result = gpipe_plan("calibrate", "report.json", "--profile", "profile.json", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: 'report.json' ran bf16 autocast, fp32 parameters but 'profile.json' "
                                     "was measured fp32: calibrate with the profile the run's plan was made from")


def test_loss_scaler_skips_overflowing_steps_and_grows_after_clean_ones() -> None:
    scaler = LossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    assert scaler.update(5.0) and scaler.scale == 1024.0
    assert not scaler.update(math.inf) and scaler.scale == 512.0
    assert not scaler.update(math.nan) and scaler.scale == 256.0
    assert [scaler.update(1.0) for _ in range(3)] == [True] * 3 and scaler.scale == 512.0
    assert scaler.skipped_steps == 2
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 512.0)
    scaler.unscale_([p], 512.0)
    assert torch.equal(p.grad, torch.ones(3))
    off = LossScaler(enabled=False)
    assert off.scale == 1.0 and off.update(math.inf)


# --------------------------------------------------------------------------- measurement rules
def test_held_bytes_count_saved_inputs_and_outputs_once() -> None:
    """Transient memory is the peak above what a layer holds by design; what it holds must
    count neither its saved inputs (already allocated before) nor its saved outputs twice."""
    layer = AsTuple(nn.Sequential(nn.Linear(8, 16), nn.ReLU()))   # saves its input, and its output (ReLU)
    x = torch.randn(4, 8)
    figures, _ = prepare_layer("layer", layer, (x,), first=False, loss=None)
    out_bytes = 4 * 16 * 4
    assert figures.activation_bytes == x.numel() * 4 + out_bytes
    assert figures.output_bytes == out_bytes
    assert figures.held_bytes == out_bytes


def test_saved_tensors_off_the_profiled_device_do_not_count() -> None:
    """On CUDA the attention kernels save two 8-byte CPU tensors: not GPU memory, not counted."""
    x = torch.randn(3, 5, requires_grad=True)
    on_gpu = SavedTensors(device=torch.device("cuda"))
    with on_gpu.recording():
        (x * x).sum()
    on_cpu = SavedTensors(device=torch.device("cpu"))
    with on_cpu.recording():
        (x * x).sum()
    assert on_gpu.nbytes == 0 and on_cpu.nbytes == 60


def test_warm_up_runs_for_its_seconds_as_well_as_its_rounds() -> None:
    calls = {"forward": 0}

    def forward() -> None:
        calls["forward"] += 1
        time.sleep(0.005)

    runner = Runner("sleep", forward, lambda _: None)
    time_rounds([[runner]], CpuClock(), warmup=1, repeats=2)
    assert calls["forward"] == 3
    calls["forward"] = 0
    started = time.perf_counter()
    time_rounds([[runner]], CpuClock(), warmup=1, repeats=2, warmup_s=0.1)
    assert time.perf_counter() - started >= 0.1
    assert calls["forward"] >= 1 + 2 + 5


# --------------------------------------------------------------------------- the GPU's memory
def _cuda_profile(tmp_path: Path, **device: Any) -> Path:
    doc = profile_doc(6, batch_size=8, activation_per_sample=[2 << 20] * 6, param_bytes=[4 << 20] * 6)
    doc["device"] = {"type": "cuda", "name": "NVIDIA H200", "index": 0, "threads": 1, **device}
    path = tmp_path / "cuda.json"
    write_json_atomic(path, doc)
    return path


def test_a_cuda_plan_fits_the_card_less_context_and_headroom(tmp_path: Path) -> None:
    path = _cuda_profile(tmp_path, memory_bytes=200 << 20, context_bytes=20 << 20)
    plan = solve_file(str(path), None, stages=2)
    usable = (180 << 20) * 0.9
    assert plan["options"]["memory_limit_source"] == "device"
    assert plan["options"]["memory_limit_bytes"] == int(usable)
    assert all(stage["memory_bytes"] <= usable for stage in plan["stages"])
    # --memory-limit overrides the card.
    plan = solve_file(str(path), None, stages=2, memory_limit="1GiB")
    assert plan["options"]["memory_limit_bytes"] == 1 << 30 and plan["options"]["memory_limit_source"] == "option"


def test_a_card_too_small_says_so_in_one_line(tmp_path: Path) -> None:
    _cuda_profile(tmp_path, memory_bytes=40 << 20, context_bytes=10 << 20)
    result = gpipe_plan("solve", "cuda.json", "-k", "1", "--recompute", "never", cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "usable memory of the profiled NVIDIA H200" in result.stderr and not (tmp_path / "plan.json").exists()


# --------------------------------------------------------------------------- what checkpoints run
class _Planted:
    """Unpickling this creates a file: what a crafted checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_a_crafted_checkpoint_runs_no_code(tmp_path: Path) -> None:
    from gpipe_plan.runtime import checkpoint
    from gpipe_plan.runtime.stage import build_chunk
    from gpipe_plan.runtime.plan import load_plan
    from gpipe_plan.models import build_model

    write_json_atomic(tmp_path / "plan.json", hand_plan(TINY, [4], micro_batches=1, micro_batch_size=1))
    plan = load_plan(tmp_path / "plan.json")
    stage = build_chunk(build_model(TINY), plan, 0)
    planted = tmp_path / "planted"
    # A complete step folder whose DCP index (.metadata, a pickle) would run code when unpickled.
    folder = checkpoint.step_folder(tmp_path / "ckpt", 2)
    folder.mkdir(parents=True)
    write_json_atomic(folder / checkpoint.META_FILE, {"format": checkpoint.FORMAT, "version": checkpoint.VERSION,
                                                      "step": 2, "identity": {}, "saved_by": {}})
    (folder / ".metadata").write_bytes(pickle.dumps({"format": _Planted(str(planted))}, protocol=2))
    with pytest.raises(BadInput, match="cannot read checkpoint"):
        checkpoint.load(tmp_path / "ckpt", 2, stage, torch.optim.Adam(stage.parameters()), {}, seed=0)
    assert not planted.exists()
    # Every file of the step replaced by the pickle (the index, each rank's tensors, and the
    # JSON facts): still refused, in one line, and still no code run.
    bomb = pickle.dumps({"format": _Planted(str(planted))}, protocol=2)
    for name in (checkpoint.META_FILE, ".metadata", "__0_0.distcp", "__1_0.distcp"):
        (folder / name).write_bytes(bomb)
    with pytest.raises(BadInput) as refused:
        checkpoint.load(tmp_path / "ckpt", 2, stage, torch.optim.Adam(stage.parameters()), {}, seed=0)
    assert len(str(refused.value).splitlines()) == 1
    assert not planted.exists()


# --------------------------------------------------------------------------- the GPU machine's image
def test_gpu_tests_collect_without_pulp(tmp_path: Path) -> None:
    """The GPU machine's image has no pulp: `pytest -m gpu` must still collect every module."""
    tests = Path(__file__).parents[1]
    code = ("import sys; sys.modules['pulp'] = None; import pytest; "
            f"sys.exit(pytest.main(['--collect-only', '-q', '-m', 'gpu', '-p', 'no:cacheprovider', {str(tests)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=120)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "test_profile_gpt_on_cuda" in result.stdout and "error" not in result.stdout.lower()


def test_ilp_without_pulp_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_json_atomic(path, profile_doc(4))
    code = ("import sys; sys.modules['pulp'] = None; from gpipe_plan.cli import main; "
            f"sys.argv = ['gpipe-plan', 'solve', {str(path)!r}, '-k', '2', '--solver', 'ilp']; main()")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: --solver ilp needs the pulp package, which is not installed here: "
                                     "pip install pulp, or use --solver exact")
