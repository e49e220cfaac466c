"""The machine's own speed over time: the reference workload, alone and two at once.

    python -m bench drift                 # (docs/benchmarks.md: how long it took)
    python -m bench drift --seconds 20

Runs gpipe-plan's speed probe workload (speedprobe.py: matrix product, GELU, layer norm;
one thread) back to back for ``--seconds`` in one process, then in two processes at once
(one per core, as two pipeline ranks run), alternating ``--rounds`` times, and reports each
process's time per repeat second by second. This is the background every timed figure on
this machine stands on: how much one process's speed moves, on what time scale, and how much
two busy processes slow each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from .common import (COLOURS, BENCH_ENV, RESULTS, ROOT, Ledger, Others, git_revision, machine, table,
                     write_section, write_svg)


def worker(seconds: float) -> None:
    """Print [wall time, seconds of one probe repeat] pairs as JSON."""
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen)
    w = torch.randn(256, 256, generator=gen) / 16
    norm = torch.nn.LayerNorm(256)

    def once() -> None:
        y = x
        for _ in range(8):
            y = norm(torch.nn.functional.gelu(y @ w))

    out = []
    with torch.no_grad():
        once()
        end = time.time() + seconds
        while time.time() < end:
            t0 = time.perf_counter()
            for _ in range(10):
                once()
            out.append((time.time(), time.perf_counter() - t0))
    print(json.dumps(out))


def launch(n: int, seconds: float, ledger: Ledger) -> list[list[tuple[float, float]]]:
    cmd = [sys.executable, "-c", f"from bench.drift import worker; worker({seconds})"]
    with Others() as others:
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=BENCH_ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True) for _ in range(n)]
        outs = [p.communicate(timeout=seconds + 120)[0] for p in procs]
    ledger.add(others.cores)
    return [json.loads(o) for o in outs]


def per_second(trace: list[tuple[float, float]], origin: float) -> list[tuple[float, float]]:
    bins: dict[int, list[float]] = {}
    for t, d in trace:
        bins.setdefault(int(t - origin), []).append(d)
    return [(k, statistics.median(v)) for k, v in sorted(bins.items())]


def spells(series: list[float], threshold: float) -> list[int]:
    """Lengths (in seconds) of runs of consecutive seconds slower than ``threshold``."""
    out, run = [], 0
    for v in series:
        if v > threshold:
            run += 1
        elif run:
            out.append(run)
            run = 0
    if run:
        out.append(run)
    return out


def chart(panels: list[tuple[str, list[list[tuple[float, float]]]]], fast: float) -> str:
    width, left, right, ph, gap, up = 760, 60, 20, 120, 40, 30
    height = up + len(panels) * (ph + gap) + 20
    ys = [d for _, series in panels for s in series for _, d in s]
    lo, hi = 0.0, max(ys) * 1.1
    tmax = max(t for _, series in panels for s in series for t, _ in s) or 1
    pw = width - left - right
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13" font-weight="bold">Reference workload, ms per repeat, '
           f'median of each second</text>']
    for i, (title, series) in enumerate(panels):
        top = up + i * (ph + gap) + 14
        out.append(f'<text x="{left}" y="{top - 4}">{title}</text>')
        out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        for v in (fast, 1.2 * fast, 1.5 * fast):
            y = top + ph - (v - lo) / (hi - lo) * ph
            out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{v * 1e3:.1f}</text>')
        for j, s in enumerate(series):
            pts = " ".join(f"{left + t / tmax * pw:.1f},{top + ph - (d - lo) / (hi - lo) * ph:.1f}" for t, d in s)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{COLOURS[j]}" stroke-width="1.5"/>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle">seconds</text></svg>')
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench drift", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    ledger = Ledger()
    started = machine()
    alone: list[list[tuple[float, float]]] = []
    pairs: list[list[list[tuple[float, float]]]] = []
    for _ in range(args.rounds):
        alone.append(launch(1, args.seconds, ledger)[0])
        pairs.append(launch(2, args.seconds, ledger))
    every_alone = [d for tr in alone for _, d in tr]
    every_pair = [d for pr in pairs for tr in pr for _, d in tr]
    everything = sorted(every_alone + every_pair)
    fast = everything[len(everything) // 20]          # the 5th percentile: the machine at its best
    rows = []
    panels = []
    for r in range(args.rounds):
        a = per_second(alone[r], alone[r][0][0])
        p = [per_second(tr, min(tr2[0][0] for tr2 in pairs[r])) for tr in pairs[r]]
        secs = [d for _, d in a]
        slow = [v > 1.2 * fast for v in secs]
        rows.append([r + 1, "1 process", f"{statistics.median(secs) * 1e3:.1f}", f"{min(secs) * 1e3:.1f}",
                     f"{max(secs) * 1e3:.1f}", f"{sum(slow) / len(slow):.0%}",
                     ", ".join(map(str, spells(secs, 1.2 * fast))) or "-"])
        for j, s in enumerate(p):
            v = [d for _, d in s]
            sl = [x > 1.2 * fast for x in v]
            rows.append([r + 1, f"2 at once, process {j + 1}", f"{statistics.median(v) * 1e3:.1f}",
                         f"{min(v) * 1e3:.1f}", f"{max(v) * 1e3:.1f}", f"{sum(sl) / len(sl):.0%}",
                         ", ".join(map(str, spells(v, 1.2 * fast))) or "-"])
        panels.append((f"round {r + 1}: one process alone", [a]))
        panels.append((f"round {r + 1}: two processes at once", p))
    write_svg("drift.svg", chart(panels, fast))
    pair_over_alone = statistics.median(every_pair) / statistics.median(every_alone)
    data = {"alone": alone, "pairs": pairs, "machine": started, "ledger": ledger.line()}
    (RESULTS / "data").mkdir(parents=True, exist_ok=True)
    (RESULTS / "data" / "drift.json").write_text(json.dumps(data))
    text = "\n".join([
        "## The machine's speed over time (the background of every timed figure)",
        "",
        f"Machine: {started}; revision {git_revision()}. {ledger.line()}",
        "",
        f"gpipe-plan's speed-probe workload (speedprobe.py), one thread, back to back for {args.seconds:g} s in one "
        f"process, then in two processes at once (as two pipeline ranks run), {args.rounds} round(s). Per second, "
        f"the median time of one repeat; 'slow' = over 1.2 x the 5th percentile of every repeat "
        f"({fast * 1e3:.1f} ms, the machine at its fastest).",
        "",
        "![speed over time](benchmarks/drift.svg)",
        "",
        table(["round", "processes", "median ms", "fastest second", "slowest second", "seconds slow",
               "slow spells (s)"], rows),
        "",
        f"All repeats: one process alone median {statistics.median(every_alone) * 1e3:.1f} ms "
        f"(p10 {sorted(every_alone)[len(every_alone) // 10] * 1e3:.1f}, p90 {sorted(every_alone)[9 * len(every_alone) // 10] * 1e3:.1f}); two at once, "
        f"each: median {statistics.median(every_pair) * 1e3:.1f} ms (p90 "
        f"{sorted(every_pair)[9 * len(every_pair) // 10] * 1e3:.1f}): two busy processes run "
        f"{pair_over_alone:.2f}x the single process's time per repeat.",
    ]) + "\n"
    path = write_section("drift", text)
    print(text)
    print(f"wrote {path}")
