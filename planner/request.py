"""What a user asks ``solve`` and ``explore`` for: each option declared once (gpipe_plan/options.py).

:class:`SolveRequest` is solve's options as typed (text where the command line gives text:
``"auto"``, ``"16GiB"``, ``"12.5"``); :meth:`SolveRequest.solve_options` checks them together
and parses them into the search's :class:`~.problem.SolveOptions`. :class:`ExploreRequest` is
explore's: its grid (lists of K, M, schedules) and the options it shares with solve, which
are declared once below (:func:`_shared`), with one default and one help text for both.
Nothing here imports torch or click.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..artifacts import BadInput
from ..options import option
from ..plan_layout import GRADIENT_SYNCS, gradient_sync_problem
from ..schedules import PLANNABLE_SCHEDULES
from ..schema import MAX_COUNT, MAX_SECONDS
from ..units import parse_bandwidth, parse_size
from .budgets import EXPLORE_POINT_TIME_BUDGET_S, SOLVE_TIME_BUDGET_S

OPTIMIZERS = ("adam", "sgd", "momentum")       # whose state the memory model counts
RECOMPUTES = ("never", "always", "auto")
# ``--solver dp`` was the exact searches' first name (when GPipe's dynamic programme was all of them).
SOLVER_ALIASES = {"dp": "exact"}


def _shared(name: str) -> Any:
    """The field of an option solve and explore both take: declared here once."""
    if name == "nodes":
        return option("--nodes", default=1, type=int, show_default=True,
                      help="Machines the devices are spread over, N / nodes each (ranks node-major); must divide "
                           "N (--devices).")
    if name == "network_bandwidth":
        return option("--network-bandwidth", metavar="GB/s",
                      help="Bandwidth between nodes in GB/s; required with --nodes > 1.")
    if name == "network_latency_s":
        return option("--network-latency", default=0.0, type=float, metavar="SECONDS", show_default=True,
                      help="Per-message latency between nodes (each ring step of a gradient sync pays it).")
    if name == "gradient_sync":
        return option("--gradient-sync", default="ddp", choices=GRADIENT_SYNCS, show_default=True,
                      help="How a stage's replicas share what they learn: all-reduce the gradients, whole copies "
                           "(ddp), or sharded parameters, gradients and optimizer state (fsdp: less memory, same "
                           "traffic), every step; or each replica steps on its own gradients and the parameters "
                           "are averaged every --sync-every steps (localsgd: 1/H of the traffic, another algorithm).")
    if name == "sync_every":
        return option("--sync-every", type=int, metavar="H",
                      help="With --gradient-sync localsgd: average the replicas' parameters after every H steps "
                           "(H >= 1; a plan records it, and run follows it). Default: 1.")
    if name == "global_batch_size":
        return option("--global-batch-size", "-b", type=int,
                      help="Samples per training step over all replicas. Default: the profile's (its "
                           "--global-batch-size, else its largest micro-batch size).")
    if name == "memory_limit":
        return option("--memory-limit", metavar="SIZE",
                      help="Memory per device, e.g. 16GiB, 512MB, 80GB. Default: what the profile's device can "
                           "use (a CUDA card's memory; a CPU host's memory shared by its ranks), else no limit.")
    if name == "link_bandwidth":
        return option("--link-bandwidth", metavar="GB/s|inf",
                      help="Link bandwidth between stages in GB/s, or 'inf' to ignore communication. "
                           "Default: the profile's measured link, else 'inf'.")
    if name == "optimizer":
        return option("--optimizer", default="adam", choices=OPTIMIZERS, show_default=True,
                      help="Optimizer whose state the memory model counts (Adam 2x params, momentum 1x).")
    raise KeyError(name)


def _int_or_auto(text: str | int, flag: str, least: int, what: str) -> int | str:
    """An integer of at least ``least`` or ``auto``, from the command line or a caller."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif str(text).strip().lower() == "auto":
        return "auto"
    else:
        try:
            value = int(str(text))
        except ValueError:
            raise BadInput(f"{flag} must be {what} or 'auto', got {text!r}") from None
    if value < least:
        raise BadInput(f"{flag} must be at least {least}, got {value}")
    return value


def _bandwidth(value: str | float | None, flag: str) -> float | None:
    """GB/s as typed (or a caller's number of GB/s) -> bytes per second."""
    if value is None:
        return None
    return float(value) * 1e9 if isinstance(value, (int, float)) else parse_bandwidth(value, flag)


def _check_time_budget(seconds: float) -> None:
    if not (math.isfinite(seconds) and seconds > 0):
        raise BadInput(f"--time-budget must be a positive number of seconds, got {seconds}")


def _check_latency(value: float | None, flag: str) -> None:
    # (the plan records it: within its format's ceiling, schema.MAX_SECONDS)
    if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
        raise BadInput(f"{flag} must be a number of seconds from 0 to {MAX_SECONDS:g}, got {value}")


def _check_counts(**counts: int | None) -> None:
    """Counts the plan records (--devices, --nodes, --sync-every: flag name with _ for -) within
    its format's ceiling (schema.MAX_COUNT); their least values are checked where they are read."""
    for name, value in counts.items():
        if isinstance(value, int) and value > MAX_COUNT:
            raise BadInput(f"--{name.replace('_', '-')} {value} is more than 2^40, more than any run has: "
                           "check the value")


@dataclass(frozen=True)
class SolveRequest:
    """``gpipe-plan solve``'s options, as typed; :meth:`solve_options` checks and parses them."""

    stages: int | None = option("--stages", "-k", type=int,
                                help="Number of pipeline stages K (one device each). Required unless --devices "
                                     "is given.")
    devices: int | None = option("--devices", type=int, metavar="N",
                                 help="Plan N devices as K stages x d replicas (K x d = N): the best K and d "
                                      "unless fixed.")
    data_parallel: str | int | None = option(
        "--data-parallel", "-d", metavar="d|auto",
        help="Replicas d of the pipeline, each on global batch / d samples, gradients synced once a step "
             "(weights every H steps under localsgd). "
             "Default: 1 without --devices, 'auto' (every d dividing N) with it.")
    nodes: int = _shared("nodes")
    network_bandwidth: str | float | None = _shared("network_bandwidth")
    network_latency_s: float = _shared("network_latency_s")
    gradient_sync: str = _shared("gradient_sync")
    sync_every: int | None = _shared("sync_every")
    micro_batches: str | int = option("--micro-batches", "-m", default="auto", show_default=True,
                                      help="Micro-batches per step M (per replica), or 'auto' to search the "
                                           "divisors of its batch.")
    global_batch_size: int | None = _shared("global_batch_size")
    schedule: str = option("--schedule", default="auto", choices=(*PLANNABLE_SCHEDULES, "auto"), show_default=True,
                           help="Pipeline schedule (docs/planner.md, 'Schedules'); 'auto' picks the fastest "
                                "synchronous one that fits (never pipedream or pipedream-2bw, which train with "
                                "stale weights: ask for them).")
    virtual_stages: str | int = option("--virtual-stages", default="auto", metavar="N|auto", show_default=True,
                                       help="interleaved: chunks per stage (each stage holds N runs of layers); "
                                            "'auto' tries 2, 3 and 4.")
    recompute: str = option("--recompute", default="auto", choices=RECOMPUTES, show_default=True,
                            help="Activation recomputation; 'auto' decides per stage, only where memory needs it.")
    memory_limit: str | int | None = _shared("memory_limit")
    link_bandwidth: str | float | None = _shared("link_bandwidth")
    link_latency_s: float | None = option("--link-latency", type=float, metavar="SECONDS",
                                          help="Per-message link latency in seconds. Default: the profile's "
                                               "measured link, else 0.")
    optimizer: str = _shared("optimizer")
    solver: str = option("--solver", default="exact", choices=("exact", "ilp", *SOLVER_ALIASES), show_default=True,
                         help="exact: the exact searches (GPipe's dynamic programme; for the other schedules a branch "
                              "and bound, a local search where it stops open, then a MILP on HiGHS through highspy, "
                              "pulp's CBC without it, the branch and bound alone without either; 'dp' is its old "
                              "name); ilp: "
                              "an integer linear programme alone (pulp/CBC for gpipe and 1f1b, the schedule MILP for "
                              "the others).")
    time_budget_s: float = option("--time-budget", default=SOLVE_TIME_BUDGET_S, type=float, show_default=True,
                                  help="Seconds the search may take in all, counted as work so that a plan is the "
                                       "same on every run; past it the best plan found is kept, with its gap to the "
                                       "proven lower bound. A loaded or slower machine may take up to about 3 times "
                                       "as long.")

    def solve_options(self):
        """The request checked as a whole and parsed into the search's options (one-line errors)."""
        from .problem import SolveOptions   # the search loads when a solve runs, not for --help

        _check_time_budget(self.time_budget_s)
        if self.stages is None and self.devices is None:
            raise BadInput("give --stages K (one pipeline of K devices) or --devices N (K stages x d replicas)")
        if self.devices is not None and self.devices < 1:
            raise BadInput(f"--devices must be at least 1, got {self.devices}")
        _check_counts(devices=self.devices, nodes=self.nodes, sync_every=self.sync_every)
        if self.network_latency_s is None:
            raise BadInput("--network-latency must be a finite number of seconds >= 0, got None")
        _check_latency(self.network_latency_s, "--network-latency")
        _check_latency(self.link_latency_s, "--link-latency")
        replicas = ("auto" if self.devices is not None else 1) if self.data_parallel is None else \
            _int_or_auto(self.data_parallel, "--data-parallel", 1, "a positive integer")
        # One replica for certain: d = 1, or K = N (search_devices checks the rest, once d is known).
        one = 1 if replicas == 1 or (self.stages is not None and self.stages == self.devices) else None
        reason = gradient_sync_problem(self.gradient_sync, self.sync_every, one)
        if reason:
            raise BadInput(reason)
        network = _bandwidth(self.network_bandwidth, "--network-bandwidth")
        if self.nodes == 1 and (network is not None or self.network_latency_s):
            raise BadInput("--network-bandwidth and --network-latency describe the links between nodes, and this "
                           "plan is on one: give --nodes 2 or more (with --devices N), or leave them out")
        limit = self.memory_limit
        return SolveOptions(
            stages=self.stages,
            global_batch_size=self.global_batch_size,
            micro_batches=_int_or_auto(self.micro_batches, "--micro-batches", 1, "a positive integer"),
            schedule=self.schedule,
            virtual_stages=_int_or_auto(self.virtual_stages, "--virtual-stages", 2, "an integer of at least 2"),
            recompute=self.recompute,
            memory_limit_bytes=None if limit is None else (limit if isinstance(limit, int) else parse_size(limit)),
            link_bandwidth_bytes_per_s=_bandwidth(self.link_bandwidth, "--link-bandwidth"),
            link_latency_s=self.link_latency_s,
            optimizer=self.optimizer,
            solver=SOLVER_ALIASES.get(self.solver, self.solver),
            time_budget_s=self.time_budget_s,
            devices=self.devices,
            data_parallel=replicas,
            nodes=self.nodes,
            network_bandwidth_bytes_per_s=network,
            network_latency_s=self.network_latency_s,
            gradient_sync=self.gradient_sync,
            sync_every=self.sync_every if self.sync_every is not None else 1,
        )


@dataclass(frozen=True)
class SolveCommand(SolveRequest):
    """``gpipe-plan solve``'s options: the request, and where and how its answer goes."""

    out: str = option("--out", "-o", default="plan.json", path="file", show_default=True,
                      help="Where to write the plan JSON.")
    timeline: str | None = option("--timeline", path="file", help="Also draw the predicted schedule as an SVG timeline.")
    quiet: bool = option("--quiet", "-q", default=False, is_flag=True,
                         help="Print only the plan's path, predicted step time and batch.")


@dataclass(frozen=True)
class ExploreRequest:
    """``gpipe-plan explore``'s options: the grid, and the options it shares with solve."""

    stages: str | None = option("--stages", "-k",
                                help="Comma-separated stage counts K (rows). Default: 1,2,4,8; with --devices, every "
                                     "K dividing it.")
    micro_batches: str = option("--micro-batches", "-m", default="auto", show_default=True,
                                help="Comma-separated micro-batch counts M (columns), or 'auto': the powers of two "
                                     "dividing the batch.")
    devices: int | None = option("--devices", type=int, metavar="N",
                                 help="Explore N devices as K stages x d replicas (every K x d = N): rows are the "
                                      "factorisations, each replica takes the global batch / d. Default: one "
                                      "replica, rows K.")
    nodes: int = _shared("nodes")
    network_bandwidth: str | None = _shared("network_bandwidth")
    network_latency_s: float = _shared("network_latency_s")
    gradient_sync: str = _shared("gradient_sync")
    sync_every: int | None = _shared("sync_every")
    global_batch_size: int | None = _shared("global_batch_size")
    memory_limit: str | None = option("--memory-limit", metavar="SIZE",
                                      help="Memory per device (e.g. 80GB): marks cells that do not fit and enables "
                                           "the capacity table. Default: a CUDA profile's card, else no limit.")
    schedule: str = option("--schedule", default="auto", show_default=True,
                           help="gpipe, 1f1b, interleaved, zb-h1, zb-v, pipedream, pipedream-2bw, a comma list, or "
                                "auto (the five synchronous ones; interleaved with its best of 2, 3, 4 chunks per "
                                "stage).")
    recompute: str = option("--recompute", default="never,always", show_default=True,
                            help="Comma list of never, always, auto (per stage).")
    link_bandwidth: str | None = _shared("link_bandwidth")
    optimizer: str = _shared("optimizer")
    json_out: str | None = option("--json", path="file", help="Write every cell as JSON rows.")
    chart: str | None = option("--chart", path="file", help="Draw throughput vs M (SVG).")
    time_budget_s: float = option("--time-budget", default=EXPLORE_POINT_TIME_BUDGET_S, type=float, show_default=True,
                                  help="Seconds per cell before a search settles for its best plan so far "
                                       "(marked *).")

    def check(self) -> None:
        """What can be refused before the profile is read (one line each): the budget, and the
        options that describe the devices of --devices, refused without it, checked with it."""
        _check_time_budget(self.time_budget_s)
        if self.devices is None and (self.nodes != 1 or self.network_bandwidth is not None
                                     or self.network_latency_s != 0.0 or self.gradient_sync != "ddp"
                                     or self.sync_every is not None):
            raise BadInput("--nodes, --network-bandwidth, --network-latency, --gradient-sync and --sync-every "
                           "describe the devices of --devices N: give --devices too")
        reason = gradient_sync_problem(self.gradient_sync, self.sync_every, 1 if self.devices == 1 else None)
        if reason:
            raise BadInput(reason)
        if self.devices is not None and self.devices < 1:
            raise BadInput(f"--devices must be at least 1, got {self.devices}")
        _check_counts(devices=self.devices, nodes=self.nodes, sync_every=self.sync_every)
        if self.nodes < 1 or (self.devices is not None and self.devices % self.nodes):
            raise BadInput(f"--nodes {self.nodes} must be at least 1 and divide --devices {self.devices} (each "
                           f"node holds the same number of devices)")
        _check_latency(self.network_latency_s, "--network-latency")


__all__ = ["SolveRequest", "SolveCommand", "ExploreRequest", "SOLVER_ALIASES"]
