"""Noise a user can act on: the speed probe's steadiness and the host's load, quiet and busy.

    python -m bench noise                    # (docs/benchmarks.md: how long it took)
    python -m bench noise --readings 5 --steps 12

Beside 0, 1 and 2 busy loops (``while True: pass``, each a whole core), three things a run
relies on to tell a busy machine from a wrong cost model:

- **the speed probe** (speedprobe.py), ``--readings`` times in a fresh one-thread process:
  its median and the spread of its repeats (interquartile range over median), and the share of
  readings steady enough for the headline to use (``speedprobe.STEADY``);
- **the host's load** as a run measures it (hostload.py): over a ``--window`` of seconds in
  which this process sleeps, the cores other processes used, against the busy loops started;
- **a run and its calibration**: a 2-stage plan of the built-in gpt (``gpipe-plan profile``,
  ``solve``), run ``--steps`` steps quiet and beside two busy loops: the headline's step
  against the prediction, whether the host was called busy, and whether ``calibrate`` took the
  run or refused it (and what it said).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .common import BENCH_ENV, GPIPE_PLAN, RESULTS, ROOT, Ledger, cli, git_revision, machine, table, write_section

SPIN = "while True: pass"


@contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """``n`` processes, each spinning on a core, for the block's duration."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0.0)          # let them start
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def probe_readings(n: int) -> list[tuple[float, float]]:
    """``n`` (median s, spread) readings of the speed probe, one thread, in a fresh process."""
    code = ("import json, torch\ntorch.set_num_threads(1)\nfrom gpipe_plan.speedprobe import speed_probe\n"
            f"print(json.dumps([speed_probe('cpu') for _ in range({n})]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=BENCH_ENV, capture_output=True, text=True,
                          check=True, timeout=600)
    return [tuple(r) for r in json.loads(done.stdout)]


def measured_load(window_s: float) -> float:
    """The cores other processes used over ``window_s`` seconds while this process slept."""
    from gpipe_plan.hostload import host_load, sample

    before = sample()
    time.sleep(window_s)
    return host_load([(0, before, sample())], threads_per_rank=1)["hosts"][0]["other_cores"]


def run_and_calibrate(folder: Path, plan: Path, steps: int, loops: int) -> dict:
    """Run ``plan`` beside ``loops`` busy loops, then calibrate with its report (no --force)."""
    report = folder / f"report.{loops}.json"
    with busy_loops(loops):
        cli("run", plan, "--steps", steps, "--report", report, "-q")
    doc = json.loads(report.read_text())
    calibrated = subprocess.run([GPIPE_PLAN, "calibrate", str(report), "--out", str(folder / f"cal.{loops}.json")],
                                cwd=ROOT, env=BENCH_ENV, capture_output=True, text=True, timeout=300)
    head = doc["headline"]
    return {"loops": loops, "measured_step_s": doc["measured_step_s"], "predicted_step_s": head["predicted_step_s"],
            "step_time_ratio": head["step_time_ratio"], "noise_fraction": head["noise_fraction"],
            "host_busy": head["host_busy"], "speed_left_out": head["speed_left_out"],
            "at_run_speed": head["at_run_speed"], "other_cores": (doc.get("host_load") or {}).get("other_cores"),
            "calibrate_rc": calibrated.returncode,
            "calibrate_said": (calibrated.stderr.strip() or calibrated.stdout.strip().splitlines()[-1])[:400]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench noise", description=__doc__.split("\n\n")[0])
    parser.add_argument("--readings", type=int, default=10, help="speed-probe readings per setting")
    parser.add_argument("--window", type=float, default=3.0, help="seconds of each host-load window")
    parser.add_argument("--steps", type=int, default=20, help="steps of each run")
    args = parser.parse_args(argv)
    from gpipe_plan.speedprobe import STEADY

    ledger = Ledger()
    started = machine()
    probes, loads = {}, {}
    for loops in (0, 1, 2):
        with busy_loops(loops):
            probes[loops] = probe_readings(args.readings)
            loads[loops] = [measured_load(args.window) for _ in range(3)]
        print(f"{loops} busy loops: probe spreads {[round(s, 3) for _, s in probes[loops]]}, "
              f"others {[round(c, 2) for c in loads[loops]]} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-noise-") as tmp:
        folder = Path(tmp)
        profile, plan = folder / "gpt.json", folder / "plan.json"
        cli("profile", "gpt", "--out", profile, "-q")
        cli("solve", profile, "--stages", "2", "--out", plan, "-q")
        runs = [run_and_calibrate(folder, plan, args.steps, loops) for loops in (0, 2)]
    for r in runs:
        print(json.dumps(r), flush=True)
    rows = []
    for loops in (0, 1, 2):
        spreads = [s for _, s in probes[loops]]
        medians = [m for m, _ in probes[loops]]
        rows.append([loops, f"{statistics.median(medians) * 1e3:.2f}", f"{statistics.median(spreads):.1%}",
                     f"{max(spreads):.1%}", f"{sum(s <= STEADY for s in spreads)}/{len(spreads)}",
                     ", ".join(f"{c:.2f}" for c in loads[loops])])
    run_rows = [[r["loops"], f"{r['measured_step_s'] * 1e3:.1f}", f"{r['predicted_step_s'] * 1e3:.1f}",
                 f"{r['step_time_ratio'] - 1:+.0%}", f"±{r['noise_fraction']:.0%}",
                 "-" if r["other_cores"] is None else f"{r['other_cores']:.2f}", "yes" if r["host_busy"] else "no",
                 "took it" if r["calibrate_rc"] == 0 else "refused"] for r in runs]
    data = {"machine": started, "ledger": ledger.line(), "probes": probes, "loads": loads, "runs": runs}
    (RESULTS / "data").mkdir(parents=True, exist_ok=True)
    (RESULTS / "data" / "noise.json").write_text(json.dumps(data, indent=1))
    refused = [r for r in runs if r["calibrate_rc"] != 0]
    text = "\n".join([
        "## Noise a user can act on: the speed probe and the host's load, quiet and busy",
        "",
        f"Machine: {started}; revision {git_revision()}. {ledger.line()} The busy loops are this part's own; "
        "other processes on the machine add to every figure.",
        "",
        f"The speed probe, {args.readings} readings per setting in a fresh one-thread process (spread: its "
        f"repeats' interquartile range over their median; steady: at most {STEADY:.0%}, what the headline "
        f"needs to use it), and the cores other processes used over {args.window:g}-second windows while this "
        "process slept (gpipe_plan/hostload.py), three windows per setting:",
        "",
        table(["busy loops", "probe median ms", "spread (median)", "spread (max)", "steady", "others' cores"], rows),
        "",
        f"A 2-stage plan of the built-in gpt, {args.steps} steps, quiet and beside two busy loops, then "
        "`gpipe-plan calibrate` on its report (without --force):",
        "",
        table(["busy loops", "step ms", "predicted ms", "error", "band", "others' cores", "host busy", "calibrate"],
              run_rows),
        "",
        *([f"What calibrate said of the run beside {r['loops']} busy loops: `{r['calibrate_said']}`" for r in refused]),
    ]) + "\n"
    path = write_section("noise", text)
    print(text)
    print(f"wrote {path}")
