"""Figures for the GPU checks (bench/gpu_smoke.sh, bench/gpu.sh), printed and kept as JSON.

    python bench/gpu_figures.py versions              # torch, CUDA, GPUs, the pipelining API we use
    python bench/gpu_figures.py profile FILE          # consistency and per-layer figures of a profile
    python bench/gpu_figures.py report FILE           # a run's measured against predicted
    python bench/gpu_figures.py events-vs-wall        # CUDA events against wall time on one wide layer
    python bench/gpu_figures.py compare FP32 BF16     # bf16 against fp32: profiles, or reports

Each command prints its figures and adds them under its own key to the JSON file named by
``GPU_FIGURES`` (default: figures.json in the current folder), so that one file holds a whole
check's numbers. Runs on a CPU too (the scripts' ``--dry-run``), where CUDA-only figures say so.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _keep(key: str, value: Any) -> None:
    path = Path(os.environ.get("GPU_FIGURES", "figures.json"))
    figures = json.loads(path.read_text()) if path.exists() else {}
    figures[key] = value
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(figures, indent=2) + "\n")
    tmp.replace(path)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2 ** 20:.1f} MiB"


def versions() -> None:
    import torch

    from gpipe_plan.runtime.torch_executor import pipelining_features

    facts: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                             "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                             "gpus": [], "pipelining": pipelining_features().__dict__}
    try:   # the GPU machine's image may lack pulp (its wheel is carried there): say which
        import pulp  # noqa: F401

        facts["pulp"] = pulp.__version__
    except ImportError:
        facts["pulp"] = None
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            facts["gpus"].append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                                  "capability": f"{p.major}.{p.minor}"})
        facts["bf16_supported"] = torch.cuda.is_bf16_supported()
        from gpipe_plan.cudamemory import outside_allocator_bytes

        facts["context_bytes_at_start"] = outside_allocator_bytes(torch.device("cuda", 0))
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for key, value in facts.items():
        print(f"  {key:22s} {value}")
    _keep("versions", facts)


def profile(path: str) -> None:
    doc = json.loads(Path(path).read_text())
    device = doc["device"]
    c = doc.get("consistency") or {}
    print(f"  {Path(path).name}: {device.get('name')} ({device['type']}), {doc.get('precision', 'fp32')} "
          f"autocast / {doc.get('param_dtype', 'fp32')} params, timer {doc['measurement']['timer']}, "
          f"speed probe {_ms(device.get('speed_probe_s'))}, context {_mib(device.get('context_bytes'))}")
    rows = []
    for b, s, m, r in zip(doc["micro_batch_sizes"], c.get("layer_sum_s", []), c.get("model_step_s", []),
                          c.get("ratio", [])):
        print(f"    consistency b={b}: sum of layers {_ms(s)}, whole model {_ms(m)}, ratio {r:.3f}")
        rows.append({"micro_batch_size": b, "layer_sum_s": s, "model_step_s": m, "ratio": r})
    for layer in doc["layers"]:
        transient = max(layer.get("peak_transient_bytes") or [0])
        print(f"    {layer['name']:8s} fwd {' '.join(f'{t * 1e3:7.3f}' for t in layer['forward_s'])} ms  "
              f"bwd {' '.join(f'{t * 1e3:7.3f}' for t in layer['backward_s'])} ms  "
              f"act {' '.join(_mib(a) for a in layer['activation_bytes'])}  transient {_mib(transient)}")
    _keep(f"profile:{Path(path).name}", {
        "device": device, "precision": doc.get("precision"), "param_dtype": doc.get("param_dtype"),
        "consistency": rows, "model_step_s": c.get("model_step_s"),
        "activation_bytes": {l["name"]: l["activation_bytes"] for l in doc["layers"]},
        "peak_transient_bytes": {l["name"]: l.get("peak_transient_bytes") for l in doc["layers"]}})


def report(path: str) -> None:
    r = json.loads(Path(path).read_text())
    ratio = r.get("step_time_ratio")
    print(f"  {Path(path).name}: K={r['num_stages']} M={r['micro_batches']}x{r['micro_batch_size']} {r['schedule']} "
          f"{r['run']['backend']}/{r['run']['executor']} {r['run'].get('precision', 'fp32')}: step measured "
          f"{_ms(r['measured_step_s'])} / predicted {_ms(r['predicted_step_s'])}"
          + (f" = {ratio:.3f}" if ratio else "") + f"; {r['samples_per_s']:.1f} samples/s; "
          f"loss {r['loss']['first']:.3f} -> {r['loss']['last']:.3f}")
    from gpipe_plan.schema import report_chunks

    stages = []
    for s in ({**st, **ch} for st, ch in zip(r["stages"], report_chunks(r))):   # one chunk per stage
        memory = s.get("measured_memory") or {}
        print(f"    stage {s['index']}: fwd {_ms(s['measured_forward_s'])} / {_ms(s['predicted_forward_s'])}, "
              f"bwd {_ms(s['measured_backward_s'])} / {_ms(s['predicted_backward_s'])}, memory: allocated peak "
              f"{_mib(s['measured_peak_memory_bytes'])} / predicted {_mib(s['predicted_memory_bytes'])}; reserved "
              f"peak {_mib(memory.get('peak_reserved_bytes'))}, context {_mib(memory.get('context_bytes'))}, "
              f"outside the allocator beyond it {_mib(memory.get('outside_allocator_bytes'))}, device used "
              f"{_mib(memory.get('device_used_bytes'))}")
        stages.append({k: s.get(k) for k in ("index", "measured_forward_s", "predicted_forward_s",
                                             "measured_backward_s", "predicted_backward_s",
                                             "measured_peak_memory_bytes", "predicted_memory_bytes",
                                             "measured_memory", "predicted_memory")})
    _keep(f"report:{Path(path).name}", {"measured_step_s": r["measured_step_s"],
                                         "predicted_step_s": r["predicted_step_s"], "step_time_ratio": ratio,
                                         "samples_per_s": r["samples_per_s"], "loss": r["loss"],
                                         "run": r["run"], "stages": stages, "speed": r.get("speed")})


def events_vs_wall(width: int = 8192, rows: int = 8192, repeats: int = 20) -> None:
    """One wide bf16 linear layer, forward and backward, timed by CUDA events and by the wall clock
    around a synchronize: the two should agree within launch overhead once the layer is big."""
    import torch

    if not torch.cuda.is_available():
        print("  no CUDA: events against wall time not checked")
        _keep("events_vs_wall", None)
        return
    layer = torch.nn.Linear(width, width, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def once() -> None:
        layer(x).sum().backward()

    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:   # warm up by time: the clock ramps up under load
        once()
    torch.cuda.synchronize()
    events, walls = [], []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        began = time.perf_counter()
        start.record()
        once()
        stop.record()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - began)
        events.append(start.elapsed_time(stop) / 1e3)
    event_s, wall_s = statistics.median(events), statistics.median(walls)
    flops = 3 * 2 * rows * width * width
    print(f"  Linear({width}, {width}) bf16, {rows} rows, forward+backward: events {_ms(event_s)}, wall "
          f"{_ms(wall_s)}, ratio wall/events {wall_s / event_s:.3f}; {flops / event_s / 1e12:.0f} TFLOP/s")
    _keep("events_vs_wall", {"event_s": event_s, "wall_s": wall_s, "ratio": wall_s / event_s,
                             "tflops": flops / event_s / 1e12, "width": width, "rows": rows})


def compare(fp32_path: str, bf16_path: str) -> None:
    """bf16 against fp32: whole-model step per size (profiles) or measured step (reports)."""
    a, b = json.loads(Path(fp32_path).read_text()), json.loads(Path(bf16_path).read_text())
    if a.get("format") == "gpipe-plan.profile":
        sizes = a["micro_batch_sizes"]
        steps32, steps16 = a["consistency"]["model_step_s"], b["consistency"]["model_step_s"]
        ratios = [s16 / s32 for s32, s16 in zip(steps32, steps16)]
        for size, s32, s16, r in zip(sizes, steps32, steps16, ratios):
            print(f"  whole model b={size}: fp32 {_ms(s32)}, bf16 {_ms(s16)}, bf16/fp32 {r:.3f}")
        act32 = sum(l["activation_bytes"][-1] for l in a["layers"])
        act16 = sum(l["activation_bytes"][-1] for l in b["layers"])
        print(f"  saved activations at b={sizes[-1]}: fp32 {_mib(act32)}, bf16 {_mib(act16)}, ratio {act16 / act32:.3f}")
        _keep("compare:profiles", {"sizes": sizes, "fp32_step_s": steps32, "bf16_step_s": steps16,
                                   "bf16_over_fp32": ratios, "activation_bytes_ratio": act16 / act32})
    else:
        s32, s16 = a["measured_step_s"], b["measured_step_s"]
        print(f"  measured step: fp32 {_ms(s32)}, bf16 {_ms(s16)}, bf16/fp32 {s16 / s32:.3f}")
        _keep("compare:reports", {"fp32_step_s": s32, "bf16_step_s": s16, "bf16_over_fp32": s16 / s32})


def main() -> None:
    commands = {"versions": versions, "profile": profile, "report": report, "events-vs-wall": events_vs_wall,
                "compare": compare}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](*sys.argv[2:])


if __name__ == "__main__":
    main()
