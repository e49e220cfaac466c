"""Which rule does a CUDA stage obey: its kernels' time, the CPU's issue time, or the larger?

    python bench/gpu_issue.py             # on a GPU (bench/gpu_issue.sh runs it); --dry-run on a CPU

UNVALIDATED: written without a GPU; the later session that has one runs it and reads the verdict.

The planner charges a pass over layers [s, e) ``max(sum GPU, sum issue)`` plus its fixed part
(planner/costmodel.py, "The CPU-issue bound"), with each layer's two times measured by the
profiler behind a backlog (profiles/issue.py). This checks the rule where it matters (bf16,
small micro-batches, a transformer block, where the CPU issues slower than an H200 computes):

1. each block's GPU time and issue time (profiles/issue.py's own measurement);
2. a stage's actions as the runtime runs them: M forwards then M backwards of a chunk of n
   blocks (n = 1, 2, 4, 8), no synchronisation between the actions, CUDA events around each,
   as runtime/timing.py records them; per action, the median;
3. each action's time against four rules: the GPU's sum, the issue sum, the larger of the two
   sums (the planner's), and the sum of each layer's larger (a stricter one).

Prints a table and writes ``GPU_FIGURES`` (JSON) under ``issue_rule``; the verdict is the rule
whose ratio is closest to 1 over the chunks.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path


def main(dry_run: bool) -> None:
    import torch

    from gpipe_plan.models import build_model, model_spec
    from gpipe_plan.models.precision import Precision
    from gpipe_plan.profiles.clock import CpuClock, clock_for
    from gpipe_plan.profiles.issue import backlog_timings, cuda_backlog
    from gpipe_plan.profiles.measure import prepare_layer

    device = torch.device("cpu" if dry_run else "cuda")
    precision = Precision("fp32" if dry_run else "bf16")
    spec = model_spec("gpt", layers=2 if dry_run else 8, width=64 if dry_run else 1024, heads=2 if dry_run else 16,
                      seq_len=32 if dry_run else 256, vocab_size=256)
    model = build_model(spec, seed=0)
    precision.cast(model)
    model.to(device)
    blocks = [(name, layer) for name, layer in model.layers if name.startswith("block")]
    micro = 2
    inputs, _ = model.synthetic_batch(micro, torch.Generator().manual_seed(0))
    with torch.no_grad(), precision.autocast(device.type):
        xs = model.layers[0][1](*(x.to(device) for x in inputs))
    if dry_run:
        clock, wall = CpuClock(), None

        def backlog(seconds: float) -> None:
            pass
    else:
        clock, backlog = clock_for(device), cuda_backlog(device)
    runners = []
    for name, layer in blocks:
        _, runner = prepare_layer(name, layer, xs, first=False, loss=None,
                                  autocast=lambda: precision.autocast(device.type))
        runners.append(runner)
    kwargs = {} if wall is None else {"wall": wall}
    per_layer = backlog_timings(runners, clock, backlog, warmup=3, repeats=10, **kwargs)
    rows = []
    for n in (1, 2, 4, 8):
        if n > len(blocks):
            break
        chunk = torch.nn.Sequential(*(layer for _, layer in blocks[:n]))

        def action_times(M: int = 8, rounds: int = 5) -> tuple[float, float]:
            forwards, backwards = [], []
            for _ in range(rounds):
                clock.sync()
                saved = []
                for m in range(M):
                    x = xs[0].detach().requires_grad_()
                    a = clock.mark()
                    with precision.autocast(device.type):
                        y = x
                        for layer in chunk:
                            (y,) = layer(y)
                    b = clock.mark()
                    saved.append((y, a, b))
                marks = []
                for y, a, b in reversed(saved):
                    c = clock.mark()
                    y.backward(torch.ones_like(y))
                    marks.append((a, b, c, clock.mark()))
                clock.sync()
                for a, b, c, d in marks:
                    forwards.append(clock.seconds(a, b))
                    backwards.append(clock.seconds(c, d))
            return statistics.median(forwards), statistics.median(backwards)

        action_times(rounds=1)          # warm-up
        forward, backward = action_times()
        mine = per_layer[:n]
        rules = {
            "gpu": (sum(t.gpu_forward_s for t in mine), sum(t.gpu_backward_s for t in mine)),
            "issue": (sum(t.issue_forward_s for t in mine), sum(t.issue_backward_s for t in mine)),
        }
        rules["max of sums (planner)"] = (max(rules["gpu"][0], rules["issue"][0]), max(rules["gpu"][1], rules["issue"][1]))
        rules["sum of maxima"] = (sum(max(t.gpu_forward_s, t.issue_forward_s) for t in mine),
                                  sum(max(t.gpu_backward_s, t.issue_backward_s) for t in mine))
        rows.append({"blocks": n, "action_forward_s": forward, "action_backward_s": backward,
                     "ratios": {rule: [forward / f if f > 0 else None, backward / b if b > 0 else None]
                                for rule, (f, b) in rules.items()}})
    closeness = {rule: statistics.median(abs(r - 1) for row in rows for r in row["ratios"][rule] if r is not None)
                 for rule in rows[0]["ratios"]}
    verdict = min(closeness, key=closeness.get)
    out = {"device": str(device), "precision": precision.compute, "micro_batch_size": micro,
           "layers": [{"gpu_forward_s": t.gpu_forward_s, "gpu_backward_s": t.gpu_backward_s,
                       "issue_forward_s": t.issue_forward_s, "issue_backward_s": t.issue_backward_s,
                       "synchronised": t.synchronised} for t in per_layer],
           "chunks": rows, "median_distance_from_1": closeness, "closest_rule": verdict, "dry_run": dry_run}
    for row in rows:
        print(f"{row['blocks']} blocks: action F {row['action_forward_s'] * 1e3:.3f} ms, B "
              f"{row['action_backward_s'] * 1e3:.3f} ms; measured / rule: "
              + ", ".join(f"{rule} {f:.2f}/{b:.2f}" for rule, (f, b) in row["ratios"].items() if f and b))
    print(f"closest rule: {verdict} (median |ratio - 1|: "
          + ", ".join(f"{k} {v:.3f}" for k, v in closeness.items()) + ")")
    path = Path(os.environ.get("GPU_FIGURES", "figures.json"))
    figures = json.loads(path.read_text()) if path.exists() else {}
    figures["issue_rule"] = out
    path.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main("--dry-run" in sys.argv[1:])
