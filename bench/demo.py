"""`gpipe-plan demo` as a user runs it, and the text recipe a deeper model needs.

    python -m bench demo                      # minutes (docs/benchmarks.md: how long it took)
    python -m bench demo --recipe-steps 100   # quicker, a shorter comparison

1. runs ``gpipe-plan demo`` (the README's first set-up command ends with it) in a fresh folder
   and reads its report: the loss on the shipped text at the first and the last step, the
   step measured against the headline prediction, and the wall time;
2. trains a 12-layer ``gpt`` (the default width) on the same text in one process, one thread,
   with the text recipe the docs gave before (Adam at 3e-3, constant) and the one they give now
   (Adam at 1e-3 after a 30-step linear warm-up, global gradient norm clipped to 1.0): the
   mean loss of the last 10 steps. One process computes what K stages do (the runtime's
   equivalence tests), so the recipe, not the pipeline, is what differs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import BENCH_ENV, RESULTS, ROOT, Ledger, Others, cli, git_revision, machine, table, write_section

# The recipes compared: (name, lr, warm-up steps, gradient clip or None).
RECIPES = [("before: --lr 3e-3", 3e-3, 0, None),
           ("now: --lr 1e-3 --warmup-steps 30 --grad-clip 1.0", 1e-3, 30, 1.0)]


def recipe_worker(layers: int, steps: int, lr: float, warmup: int, clip: float | None) -> None:
    """Train gpt (``layers`` blocks) on the demo's text, one process; print the losses as JSON."""
    import torch

    from gpipe_plan.models import build_model, model_spec
    from gpipe_plan.runtime.data import TextBatches
    from gpipe_plan.demo import DEMO_TEXT, GLOBAL_BATCH

    torch.set_num_threads(1)
    spec = model_spec("gpt", layers=layers)
    model = build_model(spec, seed=0)
    data = TextBatches(str(DEMO_TEXT), spec["options"]["seq_len"], GLOBAL_BATCH, seed=0)
    optimizer = torch.optim.Adam(model.module.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) if warmup else lr
        (x,), y = data.batch(step)
        loss = model.loss(model.forward(x), y)
        optimizer.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.module.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    print(json.dumps(losses))


def byte_entropy(data: bytes) -> float:
    """Nats per byte of the best model that knows only how often each byte occurs."""
    counts = [data.count(bytes([b])) for b in range(256)]
    return -sum(c / len(data) * math.log(c / len(data)) for c in counts if c)


def run_recipe(layers: int, steps: int, lr: float, warmup: int, clip: float | None, ledger: Ledger) -> list[float]:
    code = f"from bench.demo import recipe_worker; recipe_worker({layers}, {steps}, {lr!r}, {warmup}, {clip!r})"
    with Others() as others:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=BENCH_ENV, capture_output=True, text=True,
                              check=True, timeout=3600)
    ledger.add(others.cores)
    return json.loads(done.stdout)


def run_demo(ledger: Ledger) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        started = time.monotonic()
        with Others() as others:
            cli("demo", "--out-dir", tmp, timeout=1800)
        ledger.add(others.cores)
        took = time.monotonic() - started
        report = json.loads((Path(tmp) / "report.json").read_text())
        plan = json.loads((Path(tmp) / "plan.json").read_text())
    return {"seconds": took, "report": report, "plan": plan}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe-layers", type=int, default=12)
    parser.add_argument("--recipe-steps", type=int, default=300)
    args = parser.parse_args(argv)
    ledger = Ledger()
    started = machine()
    demo = run_demo(ledger)
    recipes = [(name, run_recipe(args.recipe_layers, args.recipe_steps, lr, warmup, clip, ledger))
               for name, lr, warmup, clip in RECIPES]
    report, plan = demo["report"], demo["plan"]
    loss = report["loss"]
    head = report.get("headline") or {}
    per_step = {int(k): v for k, v in loss["per_step"].items()}
    samples = [s for s in sorted(per_step) if s in (0, 9, 24, 49, 74) or s == max(per_step)]
    data = {"machine": started, "ledger": ledger.line(), "demo_seconds": demo["seconds"], "loss": loss,
            "headline": head, "recipes": {name: losses for name, losses in recipes},
            "recipe_layers": args.recipe_layers, "recipe_steps": args.recipe_steps}
    (RESULTS / "data").mkdir(parents=True, exist_ok=True)
    (RESULTS / "data" / "demo.json").write_text(json.dumps(data, indent=1) + "\n")
    run = report["run"]
    from gpipe_plan.demo import DEMO_TEXT, GRAD_CLIP

    entropy = byte_entropy(DEMO_TEXT.read_bytes())
    text = "\n".join([
        "## Demo: `gpipe-plan demo` learning the text it ships",
        "",
        f"Machine: {started} (the 2-core development VM, no GPU); revision {git_revision()}. {ledger.line()}",
        "",
        f"`gpipe-plan demo` as the README's first set-up command runs it, in a fresh folder: it took "
        f"{demo['seconds']:.0f} s (profile, solve, run). It trains the built-in gpt "
        f"({', '.join(f'{k}={v}' for k, v in plan['model']['options'].items())}) on {len(plan['stages'])} stages, "
        f"global batch {report['global_batch_size']} = {report['micro_batches']} x {report['micro_batch_size']}, "
        f"{report['schedule']}, for {run.get('steps')} steps on the Declaration of Independence (8.7 KB, public "
        f"domain, runtime/texts/), byte by byte: Adam at {run.get('lr')}, a {max(1, run.get('steps', 0) // 10)}-step "
        f"warm-up, gradients clipped to {GRAD_CLIP} (demo.py).",
        "",
        table(["step", "loss (nats per byte)"], [[s + 1, f"{per_step[s]:.3f}"] for s in samples]),
        "",
        f"First {loss['first']:.3f} (ln 256 = 5.545: a uniform guess), last {loss['last']:.3f}; the entropy of "
        f"the text's byte frequencies is {entropy:.2f} nats (what a model that knows only which bytes are common "
        f"reaches). Step {report['measured_step_s'] * 1e3:.1f} ms measured against "
        f"{head.get('predicted_step_s', 0) * 1e3:.1f} ms predicted "
        f"({'at the run speed the speed probe measured' if head.get('basis') == 'run_speed' else 'the plan'}; "
        f"expected band ±{(head.get('noise_fraction') or 0):.0%}).",
        "",
        f"The text recipe on a deeper model: gpt with {args.recipe_layers} blocks (width 128), one process, one "
        f"thread, {args.recipe_steps} steps, global batch 32 on the same text, the same batches for both.",
        "",
        table(["recipe", "loss at step 1", f"mean of steps {args.recipe_steps - 9}-{args.recipe_steps}"],
              [[name, f"{losses[0]:.3f}", f"{statistics.mean(losses[-10:]):.3f}"] for name, losses in recipes]),
        "",
        f"The first stalls near the entropy of the text's byte frequencies ({entropy:.2f} nats: a model that has "
        "learned which bytes are common, not which follow which); the second keeps learning.",
    ]) + "\n"
    path = write_section("demo", text)
    print(text)
    print(f"wrote {path}")
