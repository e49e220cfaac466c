"""A fixed corpus of gpipe-plan outputs, to check that a refactor leaves every output byte-identical.

    python -m bench.corpus --tree PATH --out DIR [--inputs DIR] [--only REGEX]
    python -m bench.corpus --compare A B

The first form runs the gpipe-plan command line *of the tree at PATH* (a checkout of this
repository, whose root is the package ``gpipe_plan``; not whatever is installed): it makes a
temporary folder holding a link ``gpipe_plan -> PATH``, puts that folder alone on PYTHONPATH
(checking once that ``gpipe_plan.__file__`` lies inside PATH), and runs ``python -m gpipe_plan.cli
...`` from inside DIR, so that what the commands write lands in DIR, under the names the corpus
gives them. Each command NAME also leaves NAME.out: a first line ``rc=N`` (its exit status), then
its standard output and its standard error, each under a header line. Nothing is stripped: the
files are the commands' own bytes. 427 commands, 681 files: solve with every schedule and the
main options on gpt (2 stages), alexnet and vgg16 (4 stages), resnet18 and gnmt (61 plans); show of
every plan and profile; export of every plan to every target and as a schedule CSV, refusals
included; three explore grids; the imports; twenty error cases. About 3 minutes of one core (the
commands run one at a time); the progress, CPU seconds per command and a summary go to this
tool's own output, not into DIR.

Inputs (DIR/inputs): the PipeDream graphs of data/pipedream-profiles (alexnet, vgg16, resnet18,
gnmt) and their imports (gnmt at batch 64), the built-in gpt's profile measured once and kept in
this repository (bench/data/corpus-gpt-profile.json and its bf16 twin,
corpus-gpt-bf16-profile.json: profiling measures times, so a new one would change every output),
and a few malformed files. Without ``--inputs`` they are built in DIR/inputs (the imports by the
tree under test) where absent, and reused where present; ``--inputs SRC`` builds them in SRC
where absent and copies them into DIR/inputs, so that two trees can be run on the very same
inputs (``--inputs A/inputs`` for the second run). The imports are also commands of the corpus
(import-*), so a change to import-pipedream shows even when the inputs are reused. Commands name
their inputs by the relative path inputs/NAME, so that no absolute path enters the outputs.

Determinism: every plan of the corpus is proven optimal, and by searches whose stop does not
depend on the clock: the branch and bound and the MILP are budgeted in work (planner/budgets.py:
the plan depends on --time-budget, the same 10 s for every solve, not on the machine's speed or
load, unless it is over 3 times slower), and GPipe's dynamic programme and --solver ilp, which
the clock budgets, get only problems they prove in a fraction of a second. Left out as not
proven within the budget: the PipeDream models at their own big batches with auto micro-batches
(alexnet at 256, vgg16 at 128), and vgg16 with --schedule auto on 4 stages. After the run the
tool lists any plan or explore cell not proven optimal: such an output may differ between runs.

The second form compares two such folders (A the baseline, B the tree after the change) file by
file and prints ``N files, K differ`` and the differing names (a file in one only differs). It
ignores exactly two things: the elapsed time that ``solve`` states on its last line ("wrote
plan.json in 0.46 s": the number is replaced before comparing), and each folder's absolute tree
path (and its temporary link folder), recorded in DIR/TREE (occurrences are replaced by <TREE>).
The file COMMIT, which one may write into a baseline to say which commit it comes from, is not
compared. Exit status 1 when any file differs. The same check by hand, without this tool:
``diff -r -x COMMIT -x TREE -I '^wrote .* in [0-9.]* s$' A B``.

A baseline: python -m bench.corpus --tree /path/to/checkout --out /tmp/corpus/a, then git -C
/path/to/checkout rev-parse HEAD > /tmp/corpus/a/COMMIT; after a change, python -m bench.corpus
--tree /path/to/checkout --out /tmp/corpus/b --inputs /tmp/corpus/a/inputs and python -m
bench.corpus --compare /tmp/corpus/a /tmp/corpus/b.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIPEDREAM = HERE.parent / "data" / "pipedream-profiles"
GPT_PROFILES = {"gpt.json": HERE / "data" / "corpus-gpt-profile.json",
                "gpt-bf16.json": HERE / "data" / "corpus-gpt-bf16-profile.json"}
IMPORTS = {"alexnet": [], "vgg16": [], "resnet18": [], "gnmt": ["--batch-size", "64"]}

# The compare's two exceptions. Elapsed time: solve's last line, "wrote FILE[ and SVG] in 1.23 s".
ELAPSED = re.compile(r"^(wrote .* in )[0-9]+(?:\.[0-9]+)? s$", re.MULTILINE)
NOT_COMPARED = {"COMMIT"}
COMMAND_TIMEOUT_S = 600   # a command past it is recorded as such (rc=timeout)

# Malformed inputs for the error cases (written into DIR/inputs, fixed bytes).
MALFORMED = {
    "truncated-plan.json": '{"format": "gpipe-plan.plan", "version": 8, "model": {"source": "builtin", ',
    "wrong-format.json": '{"format": "something-else", "version": 1}\n',
    "future-plan.json": '{"format": "gpipe-plan.plan", "version": 99}\n',
    "not-json.txt": "this is not JSON\n",
    "bad-graph.txt": "node1 -- Input -- forward_compute_time=nope\n",
}

# Every solve's budget. The branch and bound and the MILP are budgeted in work, not wall time
# (planner/budgets.py), so their plans depend on this number, not on the machine's load (the
# wall clock is a safety net at 3x); GPipe's dynamic programme and --solver ilp are budgeted by
# the clock, and the corpus gives them only problems they prove in a fraction of it. Every plan
# below is proven optimal: most in under a second of CPU; the chunked schedules (interleaved,
# zb-v, auto) on 4 stages of alexnet and vgg16 hand over to the MILP after the branch and bound's
# quarter of the budget and take 5-15 s of CPU each (a larger budget only makes them slower:
# the branch and bound then proves them itself, after up to 100 s).
BUDGET = ["--time-budget", "10"]


@dataclass
class Item:
    name: str
    args: list[str]


def corpus() -> list[Item]:
    """The commands, in the order they run (a show or export follows the solve it reads)."""
    items: list[Item] = []
    plans: list[str] = []

    def add(name: str, *args: str) -> None:
        items.append(Item(name, list(args)))

    def solve(name: str, profile: str, *args: str, timeline: bool = False) -> None:
        extra = ["--timeline", f"{name}.svg"] if timeline else []
        add(name, "solve", f"inputs/{profile}", *args, *BUDGET, "-o", f"{name}.json", *extra)
        plans.append(name)

    for model, args in IMPORTS.items():
        add(f"import-{model}", "import-pipedream", f"inputs/{model}.graph.txt", *args,
            "-o", f"import-{model}.json")

    schedules = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "pipedream", "pipedream-2bw", "auto"]
    # gpt (batch 16, 6 layers) on 2 stages: M auto is proven quickly.
    g = ["-k", "2"]
    for s in schedules:
        solve(f"gpt-{s}", "gpt.json", *g, "--schedule", s, timeline=s in ("zb-v", "interleaved"))
    solve("gpt-interleaved-v3", "gpt.json", *g, "--schedule", "interleaved", "--virtual-stages", "3")
    solve("gpt-recompute", "gpt.json", *g, "--schedule", "1f1b", "--recompute", "always")
    solve("gpt-memlimit", "gpt.json", *g, "--memory-limit", "20MiB")
    solve("gpt-bf16", "gpt-bf16.json", *g)
    solve("gpt-bf16-zb-v", "gpt-bf16.json", *g, "--schedule", "zb-v")
    solve("gpt-ilp", "gpt.json", *g, "--solver", "ilp", "--schedule", "1f1b")
    solve("gpt-m4", "gpt.json", *g, "-m", "4", "--link-bandwidth", "inf")
    solve("gpt-d4-ddp", "gpt.json", "--devices", "4", "--gradient-sync", "ddp")
    solve("gpt-d4-fsdp", "gpt.json", "--devices", "4", "--gradient-sync", "fsdp")
    solve("gpt-d4-localsgd", "gpt.json", "--devices", "4", "--gradient-sync", "localsgd", "--sync-every", "4")
    solve("gpt-d8-nodes2", "gpt.json", "--devices", "8", "--nodes", "2", "--network-bandwidth", "12.5",
          "--network-latency", "0.00001", "--link-bandwidth", "25", "--link-latency", "0.000005", "-b", "32")
    solve("gpt-d8-k2-nodes2", "gpt.json", "--devices", "8", "-k", "2", "--nodes", "2", "--network-bandwidth", "12.5",
          "--schedule", "1f1b", "-b", "32", "-m", "2")

    # alexnet and vgg16 (PipeDream's GPU profiles, no link, no memory limit) on 4 stages, at a
    # global batch of 64 in 8 micro-batches: proven quickly where auto M at batch 256 is not.
    for model, limit in (("alexnet", "1GiB"), ("vgg16", "3GiB")):
        p = f"{model}.json"
        c = ["-k", "4", "-b", "64", "-m", "8"]
        for s in schedules:
            if (model, s) == ("vgg16", "auto"):
                continue   # not proven within the budget (its other schedules are, one by one)
            solve(f"{model}-{s}", p, *c, "--schedule", s, timeline=(model, s) == ("alexnet", "1f1b"))
        solve(f"{model}-interleaved-v3", p, *c, "--schedule", "interleaved", "--virtual-stages", "3")
        solve(f"{model}-recompute", p, *c, "--schedule", "1f1b", "--recompute", "always")
        solve(f"{model}-memlimit", p, *c, "--schedule", "1f1b", "--memory-limit", limit)
        solve(f"{model}-ilp", p, *c, "--solver", "ilp", "--schedule", "1f1b")
        solve(f"{model}-link", p, *c, "--schedule", "1f1b", "--link-bandwidth", "10", "--link-latency", "0.00002")
        d = ["--devices", "4", "-b", "64", "-m", "8", "--schedule", "1f1b"]
        solve(f"{model}-d4-ddp", p, *d, "--gradient-sync", "ddp")
        solve(f"{model}-d4-fsdp", p, *d, "--gradient-sync", "fsdp")
        solve(f"{model}-d4-localsgd", p, *d, "--gradient-sync", "localsgd", "--sync-every", "4")
        solve(f"{model}-d8-nodes2", p, "--devices", "8", "--nodes", "2", "--network-bandwidth", "12.5",
              "--network-latency", "0.00001", "--link-bandwidth", "25", "--link-latency", "0.000005",
              "-b", "64", "-m", "8", "--schedule", "1f1b")

    solve("resnet18-sgd", "resnet18.json", "-k", "4", "-b", "64", "-m", "8", "--schedule", "1f1b",
          "--optimizer", "sgd")
    solve("resnet18-momentum", "resnet18.json", "-k", "2", "-b", "32", "-m", "4", "--schedule", "gpipe",
          "--optimizer", "momentum")
    solve("gnmt-1f1b", "gnmt.json", "-k", "4", "-m", "8", "--schedule", "1f1b")

    # Every plan and profile shown; every plan exported to every target and as a schedule CSV
    # (where the target refuses a plan, the refusal is the output).
    for name in ("gpt.json", "gpt-bf16.json", "alexnet.json", "vgg16.json", "resnet18.json", "gnmt.json"):
        add(f"show-profile-{name[:-5]}", "show", f"inputs/{name}")
    for plan in plans:
        add(f"show-{plan}", "show", f"{plan}.json")
    add("show-timeline-gpt-1f1b", "show", "gpt-1f1b.json", "--timeline", "show-gpt-1f1b.svg")
    for plan in plans:
        for target in ("torchtitan", "torch", "megatron", "deepspeed"):
            add(f"export-{plan}-{target}", "export", f"{plan}.json", "--to", target)
        add(f"export-{plan}-csv", "export", f"{plan}.json", "--schedule-csv", f"{plan}.schedule.csv")
    add("export-gpt-1f1b-torch-out", "export", "gpt-1f1b.json", "--to", "torch", "-o", "gpt-1f1b-train.py")

    # explore: three small grids.
    add("explore-gpt", "explore", "inputs/gpt.json", "-k", "1,2", "-m", "2,4", "--schedule", "gpipe,1f1b,zb-h1",
        "--time-budget", "20", "--json", "explore-gpt.json", "--chart", "explore-gpt.svg")
    add("explore-alexnet", "explore", "inputs/alexnet.json", "-k", "2,4", "-b", "64", "-m", "4,8",
        "--schedule", "1f1b", "--recompute", "never,always", "--memory-limit", "1GiB", "--time-budget", "20",
        "--json", "explore-alexnet.json")
    add("explore-gpt-devices", "explore", "inputs/gpt.json", "--devices", "4", "-m", "2,4", "--schedule", "1f1b",
        "--gradient-sync", "fsdp", "--time-budget", "20", "--json", "explore-gpt-devices.json")

    # Errors: each one line and a non-zero status, or click's usage error.
    add("error-no-stages", "solve", "inputs/gpt.json", "-o", "error-no-stages.json")
    add("error-zero-stages", "solve", "inputs/gpt.json", "-k", "0", "-o", "error-zero-stages.json")
    add("error-too-many-stages", "solve", "inputs/gpt.json", "-k", "9", "-o", "error-too-many-stages.json")
    add("error-m-not-dividing", "solve", "inputs/gpt.json", "-k", "2", "-m", "3", "-o", "error-m.json")
    add("error-bad-schedule", "solve", "inputs/gpt.json", "-k", "2", "--schedule", "fastest")
    add("error-unknown-flag", "solve", "inputs/gpt.json", "-k", "2", "--stagez", "2")
    add("error-bad-memory", "solve", "inputs/gpt.json", "-k", "2", "--memory-limit", "lots")
    add("error-too-little-memory", "solve", "inputs/gpt.json", "-k", "2", "--memory-limit", "1MiB",
        "-o", "error-too-little-memory.json")
    add("error-nodes-no-network", "solve", "inputs/gpt.json", "--devices", "4", "--nodes", "2",
        "-o", "error-nodes.json")
    add("error-nodes-not-dividing", "solve", "inputs/gpt.json", "--devices", "4", "--nodes", "3",
        "--network-bandwidth", "10", "-o", "error-nodes3.json")
    add("error-missing-profile", "solve", "inputs/missing.json", "-k", "2", "-o", "error-missing.json")
    add("error-show-missing", "show", "missing.json")
    add("error-show-truncated", "show", "inputs/truncated-plan.json")
    add("error-show-wrong-format", "show", "inputs/wrong-format.json")
    add("error-show-future-version", "show", "inputs/future-plan.json")
    add("error-export-truncated", "export", "inputs/truncated-plan.json", "--to", "torch")
    add("error-export-bad-target", "export", "gpt-1f1b.json", "--to", "jax")
    add("error-solve-not-json", "solve", "inputs/not-json.txt", "-k", "2", "-o", "error-not-json.json")
    add("error-import-bad-graph", "import-pipedream", "inputs/bad-graph.txt", "-o", "error-graph.json")
    add("error-explore-bad-k", "explore", "inputs/gpt.json", "-k", "two")
    return items


def environment(link_dir: Path) -> dict[str, str]:
    """The commands' environment: this one's, with PYTHONPATH the link folder alone and nothing
    that changes how output looks (the terminal's width: rich writes 80 columns to a file)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "FORCE_COLOR", "NO_COLOR", "CLICOLOR", "COLUMNS", "LINES", "TERM"))}
    env.update(PYTHONPATH=str(link_dir), PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1", COLUMNS="80",
               LINES="25", TZ="UTC", LC_ALL="C.UTF-8", LANG="C.UTF-8")
    return env


def run_command(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, bytes, bytes]:
    try:
        done = subprocess.run([sys.executable, "-m", "gpipe_plan.cli", *args], check=False, cwd=cwd, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return "timeout", e.stdout or b"", e.stderr or b""
    return str(done.returncode), done.stdout, done.stderr


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def record(path: Path, args: list[str], rc: str, out: bytes, err: bytes) -> None:
    path.write_bytes(f"rc={rc}\n".encode() + b"$ gpipe-plan " + " ".join(args).encode() + b"\n"
                     + b"--- stdout\n" + out + b"--- stderr\n" + err)


def build_inputs(where: Path, env: dict[str, str]) -> None:
    """The profiles the corpus reads, in WHERE: built where absent (imports by the tree under test)."""
    where.mkdir(parents=True, exist_ok=True)
    for name, source in GPT_PROFILES.items():
        if not (where / name).exists():
            shutil.copyfile(source, where / name)
    for model, args in IMPORTS.items():
        if not (where / f"{model}.graph.txt").exists():
            shutil.copyfile(PIPEDREAM / f"{model}.graph.txt", where / f"{model}.graph.txt")
        if not (where / f"{model}.json").exists():
            cmd = ["import-pipedream", f"{model}.graph.txt", *args, "-o", f"{model}.json"]
            rc, out, err = run_command(cmd, where, env)
            if rc != "0":
                sys.exit(f"building the input {model}.json failed (rc={rc}):\n{(out + err).decode()}")
    for name, text in MALFORMED.items():
        (where / name).write_text(text)


def unproven(out: Path) -> list[str]:
    """Outputs whose search was not proven optimal: these may vary from run to run."""
    found = []
    for path in sorted(out.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("format") == "gpipe-plan.plan":
            if not doc.get("optimality", {}).get("proven", True):
                found.append(path.name)
        elif isinstance(doc, (list, dict)):
            rows = doc if isinstance(doc, list) else doc.get("rows", doc.get("cells", []))
            if any(isinstance(r, dict) and r.get("proven") is False for r in rows):
                found.append(path.name)
    return found


def run(tree: Path, out: Path, inputs: Path | None, only: str | None) -> int:
    tree = tree.resolve()
    if not (tree / "cli.py").is_file():
        sys.exit(f"{tree} is not a gpipe-plan tree (no cli.py at its root)")
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    link_dir = Path(tempfile.mkdtemp(prefix="gpipe-corpus-"))
    try:
        (link_dir / "gpipe_plan").symlink_to(tree, target_is_directory=True)
        env = environment(link_dir)
        probe = "import gpipe_plan, os; print(os.path.realpath(gpipe_plan.__file__))"
        where = subprocess.run([sys.executable, "-c", probe], check=False, env=env, cwd=out,
                               capture_output=True, text=True)
        loaded = Path(where.stdout.strip() or "?")
        if where.returncode != 0 or tree not in loaded.parents:
            sys.exit(f"gpipe_plan does not load from {tree}: {loaded}\n{where.stderr}")
        (out / "TREE").write_text(f"{tree}\n{link_dir}\n")
        target = out / "inputs"
        if inputs is None or inputs.resolve() == target:
            build_inputs(target, env)
        else:
            build_inputs(inputs.resolve(), env)
            target.mkdir(exist_ok=True)
            for f in sorted(inputs.resolve().iterdir()):
                if f.is_file():
                    shutil.copyfile(f, target / f.name)
        items = corpus()
        if only:
            items = [i for i in items if re.search(only, i.name)]
        started = time.perf_counter()
        times = []
        failed = []
        refused = 0
        for n, item in enumerate(items, 1):
            t, cpu = time.perf_counter(), children_cpu_s()
            rc, stdout, stderr = run_command(item.args, out, env)
            record(out / f"{item.name}.out", item.args, rc, stdout, stderr)
            times.append((children_cpu_s() - cpu, item.name))
            if rc == "0":
                pass
            elif b"Traceback" in stderr or rc not in ("1", "2"):
                failed.append(f"{item.name} (rc={rc})")   # a crash or a timeout, not a refusal
            else:
                refused += 1
            print(f"[{n}/{len(items)}] {item.name}: rc={rc}, {time.perf_counter() - t:.1f} s "
                  f"({times[-1][0]:.1f} s CPU)", flush=True)
    finally:
        shutil.rmtree(link_dir, ignore_errors=True)
    files = sum(1 for p in out.rglob("*") if p.is_file())
    print(f"{len(items)} commands, {files} files in {out}, {time.perf_counter() - started:.0f} s "
          f"({sum(s for s, _ in times):.0f} s CPU)")
    print("most CPU: " + ", ".join(f"{name} {s:.1f} s" for s, name in sorted(times, reverse=True)[:8]))
    print(f"{refused} commands refused, with a one-line error (the error cases and the exports a target "
          f"cannot take: outputs too)")
    if failed:
        print(f"crashed or timed out ({len(failed)}): " + ", ".join(failed))
    shaky = unproven(out)
    if shaky:
        print(f"not proven optimal, may vary between runs ({len(shaky)}): " + ", ".join(shaky))
    return 0


def normalised(path: Path, trees: list[str]) -> bytes:
    data = path.read_bytes()
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return data
    for tree in trees:
        text = text.replace(tree, "<TREE>")
    return ELAPSED.sub(r"\g<1><T> s", text).encode()


def compare(a: Path, b: Path) -> int:
    def tree_paths(d: Path) -> list[str]:
        lines = (d / "TREE").read_text().split() if (d / "TREE").exists() else []
        return sorted((x for x in lines if x), key=len, reverse=True)   # the longer first

    def names(d: Path) -> set[str]:
        return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name not in NOT_COMPARED}

    ta, tb = tree_paths(a), tree_paths(b)
    left, right = names(a), names(b)
    differ = []
    for name in sorted(left | right):
        if name not in left or name not in right:
            differ.append(f"{name} (only in {'B' if name not in left else 'A'})")
        elif normalised(a / name, ta) != normalised(b / name, tb):
            differ.append(name)
    print(f"{len(left | right)} files, {len(differ)} differ")
    for name in differ:
        print(f"  {name}")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.corpus", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, help="the checkout whose gpipe-plan to run (its root is the package)")
    parser.add_argument("--out", type=Path, help="the folder the outputs go to")
    parser.add_argument("--inputs", type=Path, help="take the inputs from here (built here where absent), "
                                                    "copied into OUT/inputs; default: OUT/inputs")
    parser.add_argument("--only", metavar="REGEX", help="run only the commands whose name matches (while tuning)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"),
                        help="compare two output folders instead: N files, K differ")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.tree is None or args.out is None:
        parser.error("give --tree PATH --out DIR, or --compare A B")
    return run(args.tree, args.out, args.inputs, args.only)


if __name__ == "__main__":
    sys.exit(main())
