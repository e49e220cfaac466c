"""What the benchmark parts share: where things are, the machine, markdown tables."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
PIPEDREAM = ROOT / "data" / "pipedream-profiles"
RESULTS = ROOT / "docs" / "benchmarks"


def machine() -> str:
    """One line: CPU model, cores, Python; and the load while the benchmark started."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, load average {load:.2f} at start"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def write_section(name: str, text: str) -> Path:
    """docs/benchmarks/NAME.md. Sections link their pictures as ``benchmarks/X.svg`` (right in
    docs/benchmarks.md, which assembles them); in the section's own file that is ``X.svg``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = text.replace("](benchmarks/", "](")
    path = RESULTS / f"{name}.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def git_revision() -> str:
    try:
        # "-dirty": the tree measured had changes not yet committed (a figure then names no commit).
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# --------------------------------------------------------------------------------------------
# Running the product as a user would, and knowing what else ran meanwhile.

import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Iterable  # noqa: E402

from gpipe_plan.hostload import host_cpu_s  # noqa: E402  (busy and stolen time: one home for both)

GPIPE_PLAN = str(Path(sys.executable).parent / "gpipe-plan")
BENCH_ENV = dict(os.environ, PYTHONWARNINGS="ignore")


def load_line() -> str:
    """The three load averages and the steal share since boot, for a 'measured under' line."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load unknown"
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


def own_cpu_s() -> float:
    """CPU seconds this process and its waited-for descendants have used."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Others:
    """How many cores *other* processes used while a block ran (should be near 0).

    with Others() as o: ...;  o.cores
    """

    cores: float = float("nan")

    def __enter__(self) -> "Others":
        self._busy, self._own, self._t = host_cpu_s(), own_cpu_s(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._t
        used = (host_cpu_s() - self._busy) - (own_cpu_s() - self._own)
        self.cores = max(0.0, used / wall) if wall > 0 else float("nan")


class Ledger:
    """What the machine was doing during a part: other processes' cores per run, load."""

    def __init__(self) -> None:
        self.start = load_line()
        self.others: list[float] = []
        self.started = time.monotonic()

    def add(self, cores: float) -> None:
        if math.isfinite(cores):
            self.others.append(cores)

    def line(self) -> str:
        took = time.monotonic() - self.started
        if self.others:
            xs = sorted(self.others)
            quiet = (f"other processes used median {statistics.median(xs):.2f}, max {xs[-1]:.2f} of a core "
                     f"during the {len(xs)} measured runs")
        else:
            quiet = "no measured runs"
        return f"At start: {self.start}; at end: {load_line()}; {quiet}; the part took {took / 60:.0f} min."


def cli(*args: object, check: bool = True, cwd: Path | None = None, capture: bool = True,
        timeout: float | None = 900) -> subprocess.CompletedProcess:
    """Run ``gpipe-plan ARGS`` and return the finished process (stdout/stderr captured)."""
    cmd = [GPIPE_PLAN, *(str(a) for a in args)]
    done = subprocess.run(cmd, cwd=cwd or ROOT, env=BENCH_ENV, capture_output=capture, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def run_plan(plan: Path, steps: int, *extra: object, report: Path | None = None,
             ledger: Ledger | None = None, env_path: str | None = None) -> dict[str, Any]:
    """``gpipe-plan run PLAN --steps N --report R``; the report, with ``_others_cores`` added."""
    report = report or plan.with_suffix(".report.json")
    env = dict(BENCH_ENV)
    if env_path:
        env["PYTHONPATH"] = env_path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [GPIPE_PLAN, "run", str(plan), "--steps", str(steps), "--report", str(report), "-q",
           *(str(e) for e in extra)]
    with Others() as others:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    doc = json.loads(report.read_text())
    doc["_others_cores"] = others.cores
    doc["_stderr"] = done.stderr.strip()
    if ledger is not None:
        ledger.add(others.cores)
    return doc


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def med(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(xs) if xs else None


def rng(values: Iterable[float | None], fmt: str = "{:.2f}") -> str:
    """'lo..hi' of the values (the spread over rounds), or '' for one value."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if len(xs) < 2:
        return ""
    return f"{fmt.format(min(xs))}..{fmt.format(max(xs))}"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


# --------------------------------------------------------------------------------------------
# Pictures: small SVGs drawn by hand (no matplotlib).

COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D"]


def _esc(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_svg(name: str, svg: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(svg)
    return path


def scatter_svg(title: str, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
                log: bool = True, bands: Sequence[float] = (0.10, 0.25), unit_scale: float = 1e3,
                unit: str = "ms") -> str:
    """Predicted (x) against measured (y), one colour per series, the diagonal and +-bands."""
    width, height, left, right, up, down = 620, 460, 70, 190, 34, 50
    pw, ph = width - left - right, height - up - down
    pts = [p for ps in series.values() for p in ps]
    lo = min(min(x, y) for x, y in pts) * 0.85
    hi = max(max(x, y) for x, y in pts) * 1.15
    f = (lambda v: math.log10(v)) if log else (lambda v: v)
    a, b = f(lo), f(hi)

    def px(v: float) -> float:
        return left + (f(v) - a) / (b - a) * pw

    def py(v: float) -> float:
        return up + ph - (f(v) - a) / (b - a) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="13" font-weight="bold">{_esc(title)}</text>',
           f'<rect x="{left}" y="{up}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    ticks = _log_ticks(lo, hi) if log else _lin_ticks(lo, hi)
    for t in ticks:
        out.append(f'<line x1="{px(t):.1f}" y1="{up}" x2="{px(t):.1f}" y2="{up + ph}" stroke="#eee"/>')
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + pw}" y2="{py(t):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{px(t):.1f}" y="{up + ph + 15}" text-anchor="middle">{t * unit_scale:g}</text>')
        out.append(f'<text x="{left - 5}" y="{py(t) + 4:.1f}" text-anchor="end">{t * unit_scale:g}</text>')
    for band, dash in zip(bands, ("4,3", "2,4")):
        for s in (1 + band, 1 / (1 + band) if log else 1 - band):
            out.append(f'<line x1="{px(lo):.1f}" y1="{py(lo * s):.1f}" x2="{px(hi / s if s > 1 else hi):.1f}" '
                       f'y2="{py(hi if s > 1 else hi * s):.1f}" stroke="#bbb" stroke-dasharray="{dash}"/>')
    out.append(f'<line x1="{px(lo):.1f}" y1="{py(lo):.1f}" x2="{px(hi):.1f}" y2="{py(hi):.1f}" stroke="#333"/>')
    for i, (name, ps) in enumerate(series.items()):
        c = COLOURS[i % len(COLOURS)]
        for x, y in ps:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{c}" fill-opacity="0.75"/>')
        out.append(f'<circle cx="{left + pw + 14}" cy="{up + 16 * i + 6}" r="4" fill="{c}"/>')
        out.append(f'<text x="{left + pw + 22}" y="{up + 16 * i + 10}">{_esc(name)}</text>')
    legend_y = up + 16 * len(series) + 16
    out.append(f'<text x="{left + pw + 10}" y="{legend_y}">solid: measured = predicted</text>')
    out.append(f'<text x="{left + pw + 10}" y="{legend_y + 14}">dashed: {"/".join(f"{b:.0%}" for b in bands)} off</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 12}" text-anchor="middle">{_esc(xlabel)} ({unit})</text>')
    out.append(f'<text x="16" y="{up + ph / 2}" text-anchor="middle" transform="rotate(-90 16 {up + ph / 2})">'
               f'{_esc(ylabel)} ({unit})</text></svg>')
    return "\n".join(out) + "\n"


def bars_svg(title: str, rows: Sequence[tuple[str, float, float, float, str]], xlabel: str,
             reference: float | None = None, reference_label: str = "") -> str:
    """Horizontal bars: (label, median, low, high, colour) each; whiskers from low to high."""
    left, right, up, bar, gap = 230, 60, 34, 16, 6
    width = 720
    height = up + len(rows) * (bar + gap) + 50
    pw = width - left - right
    top = max(max(r[3] for r in rows), reference or 0) * 1.08 or 1.0

    def px(v: float) -> float:
        return left + v / top * pw

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="13" font-weight="bold">{_esc(title)}</text>']
    for t in _lin_ticks(0, top):
        out.append(f'<line x1="{px(t):.1f}" y1="{up}" x2="{px(t):.1f}" y2="{height - 40}" stroke="#eee"/>')
        out.append(f'<text x="{px(t):.1f}" y="{height - 26}" text-anchor="middle">{t:g}</text>')
    for i, (label, value, low, high, colour) in enumerate(rows):
        y = up + i * (bar + gap)
        out.append(f'<text x="{left - 6}" y="{y + bar - 4}" text-anchor="end">{_esc(label)}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{max(0.0, px(value) - left):.1f}" height="{bar}" fill="{colour}"/>')
        if high > low:
            mid = y + bar / 2
            out.append(f'<line x1="{px(low):.1f}" y1="{mid}" x2="{px(high):.1f}" y2="{mid}" stroke="#222"/>')
            for v in (low, high):
                out.append(f'<line x1="{px(v):.1f}" y1="{mid - 4}" x2="{px(v):.1f}" y2="{mid + 4}" stroke="#222"/>')
        out.append(f'<text x="{px(max(value, high)) + 4:.1f}" y="{y + bar - 4}">{value:.3g}</text>')
    if reference is not None:
        out.append(f'<line x1="{px(reference):.1f}" y1="{up - 4}" x2="{px(reference):.1f}" y2="{height - 40}" '
                   f'stroke="#E45756" stroke-dasharray="4,3"/>')
        out.append(f'<text x="{px(reference):.1f}" y="{up - 8}" text-anchor="middle" fill="#E45756">'
                   f'{_esc(reference_label)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle">{_esc(xlabel)}</text></svg>')
    return "\n".join(out) + "\n"


def _log_ticks(lo: float, hi: float) -> list[float]:
    ticks = []
    e = math.floor(math.log10(lo))
    while 10 ** e <= hi:
        for m in (1, 2, 5):
            t = m * 10 ** e
            if lo <= t <= hi:
                ticks.append(t)
        e += 1
    return ticks


def _lin_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / n
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if step * m >= raw:
            step *= m
            break
    start = math.ceil(lo / step) * step
    return [round(start + i * step, 12) for i in range(int((hi - start) / step) + 1)]


def measured_or_saved(name: str, args: Any, measure: Callable[[Ledger], dict[str, Any]]) -> dict[str, Any]:
    """A timing part's raw figures: re-read from ``--from-json``, or measured now.

    Measured figures are stamped with the machine, the revision, what else ran meanwhile and the
    part's options, and saved as docs/benchmarks/data/NAME.json, so that the section can be
    re-rendered later without measuring again.
    """
    if args.from_json:
        return read_json(args.from_json)
    ledger = Ledger()
    started = machine()
    data = measure(ledger)
    data.update(machine=started, revision=git_revision(), ledger=ledger.line(),
                args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "from_json"})
    (RESULTS / "data").mkdir(parents=True, exist_ok=True)
    (RESULTS / "data" / f"{name}.json").write_text(json.dumps(data, indent=1))
    return data


def publish(name: str, text: str) -> None:
    """Write the part's section (docs/benchmarks/NAME.md) and show it."""
    path = write_section(name, text)
    print(text)
    print(f"wrote {path}")
