"""A profile as the planner sees it: per-layer figures at any micro-batch size.

The profiler measures each layer at a few micro-batch sizes. A plan with M micro-batches of a
global batch B runs at size ``b = B / M``, which usually was not measured, so every per-layer
quantity is interpolated linearly between the two measured sizes around ``b`` and extrapolated
from the two nearest ones outside them (clamped at zero). A profile measured at one size
scales in proportion to ``b``. Linear is the right shape for both time (a layer's work grows
with the rows it processes, plus a fixed launch cost that the intercept carries) and memory
(activations are exactly proportional to ``b``).

The profile is checked against its schema (gpipe_plan/schema.py: every key's type, finiteness
and range) before anything reads it, so that a missing field is reported as "profile 'p.json'
has no 'layers[3].backward_s'" rather than as a KeyError somewhere in the solver; this module
adds the checks that relate keys to one another (ascending sizes, unique names, complete
recompute timings, tied layers that exist).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from ..artifacts import BadInput, precision_of
from .fixedcosts import FixedCosts, between_actions_s, figures_at, optimizer_scale
from ..schema import (ISSUE_FIELDS, PROFILE_FORMAT, RECOMPUTE_FIELDS, SPLIT_FIELDS, check_format, recompute_timed,
                      split_backward_timed, validate)

@dataclass(frozen=True)
class LayerFigures:
    """Every layer's figures at one micro-batch size: the arrays the solvers work on."""

    micro_batch_size: float
    names: tuple[str, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]       # bytes crossing the cut after each layer
    transient_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]
    buffer_bytes: tuple[float, ...]
    optimizer_s: tuple[float, ...]
    input_bytes: float                    # one micro-batch of the model's input
    # A recomputing stage: each layer's backward including its rerun forward and the extra
    # its checkpointed forward costs (None: not measured, taken as backward + forward), and
    # what the checkpoint wrapper itself costs once per stage and micro-batch.
    recompute_backward_s: tuple[float, ...] | None = None
    recompute_call_s: float = 0.0
    # Tied weights: (the layers that use one parameter, its bytes). A stage holding some but
    # not all of those layers exchanges the parameter's gradient every step (runtime.tied).
    tied: tuple[tuple[tuple[int, ...], float], ...] = ()
    # The split backward (profile version 7): each layer's input-gradient half I, weight-gradient
    # half W, and the bytes that stay alive from I to W. None: not measured
    # (then estimated: I = W = B / 2, and W keeps what :meth:`kept_bytes` says).
    backward_input_s: tuple[float, ...] | None = None
    backward_weight_s: tuple[float, ...] | None = None
    weight_kept_bytes: tuple[float, ...] | None = None
    # CUDA (profile version 9): the CPU's time to issue each layer's forward and backward
    # (unsynchronised, the GPU busy), beside its GPU time (forward_s, backward_s, measured behind
    # a backlog). None: not measured (CPU profiles: issuing is computing), so an action takes its
    # layers' time; else the larger of the two sums (planner/costmodel.py, "The CPU-issue bound").
    issue_forward_s: tuple[float, ...] | None = None
    issue_backward_s: tuple[float, ...] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def input_backward_s(self) -> tuple[float, ...]:
        """Each layer's I (half its backward when not measured)."""
        if self.backward_input_s is None:
            return tuple(b / 2 for b in self.backward_s)
        return self.backward_input_s

    def weight_backward_s(self) -> tuple[float, ...]:
        """Each layer's W (half its backward when not measured)."""
        if self.backward_weight_s is None:
            return tuple(b / 2 for b in self.backward_s)
        return self.backward_weight_s

    def kept_bytes(self) -> tuple[float, ...]:
        """What each layer keeps alive from its I to its W. Not measured: everything it saved (the
        retained graph holds it) plus the gradient of its output, which W multiplies with its
        input (docs/profile-format.md, ``weight_kept_bytes``)."""
        if self.weight_kept_bytes is None:
            return tuple(a + o for a, o in zip(self.activation_bytes, self.output_bytes))
        return self.weight_kept_bytes

    def issue_times(self) -> dict[str, tuple[float, ...]] | None:
        """Per layer, the CPU's issue time of each pass (None when not measured): F and B as
        measured; a recomputing B issues the forward again; I and W share B's issue time as
        their GPU times share B's (torch issues each half's kernels as it runs them)."""
        if self.issue_forward_s is None or self.issue_backward_s is None:
            return None
        inputs, weights = self.input_backward_s(), self.weight_backward_s()
        share = [i / (i + w) if i + w > 0 else 0.5 for i, w in zip(inputs, weights)]
        return {"F": self.issue_forward_s, "B": self.issue_backward_s,
                "B recompute": tuple(b + f for b, f in zip(self.issue_backward_s, self.issue_forward_s)),
                "I": tuple(b * x for b, x in zip(self.issue_backward_s, share)),
                "I recompute": tuple(b * x + f for b, x, f in zip(self.issue_backward_s, share, self.issue_forward_s)),
                "W": tuple(b * (1 - x) for b, x in zip(self.issue_backward_s, share))}

    def recomputing_backward_s(self) -> tuple[float, ...]:
        """Each layer's backward in a stage that recomputes (never below its plain backward)."""
        if self.recompute_backward_s is None:
            return tuple(b + f for b, f in zip(self.backward_s, self.forward_s))
        return tuple(max(r, b) for r, b in zip(self.recompute_backward_s, self.backward_s))

    def times_scaled(self, factor: float) -> "LayerFigures":
        """The same figures with every time (forward, backward, recompute, optimizer) times ``factor``."""
        recompute = self.recompute_backward_s

        def scaled(times: tuple[float, ...] | None) -> tuple[float, ...] | None:
            return None if times is None else tuple(t * factor for t in times)

        return replace(self, forward_s=tuple(t * factor for t in self.forward_s),
                       issue_forward_s=scaled(self.issue_forward_s), issue_backward_s=scaled(self.issue_backward_s),
                       backward_input_s=scaled(self.backward_input_s),
                       backward_weight_s=scaled(self.backward_weight_s),
                       backward_s=tuple(t * factor for t in self.backward_s),
                       optimizer_s=tuple(t * factor for t in self.optimizer_s),
                       recompute_backward_s=None if recompute is None else tuple(t * factor for t in recompute),
                       recompute_call_s=self.recompute_call_s * factor)


class Profile:
    """A validated profile document, able to give :class:`LayerFigures` at any size."""

    def __init__(self, doc: Any, where: str = "profile"):
        check_format(doc, PROFILE_FORMAT, where)
        validate(doc, "profile", where)
        self.doc = doc
        self.where = where
        self.sizes = _sizes(doc, where)
        self.layers = _layers(doc, where)
        self.names = tuple(layer["name"] for layer in self.layers)
        self.input_bytes: list[float] | None = doc.get("input_bytes")
        link = doc.get("link") or {}
        self.link_bandwidth_bytes_per_s: float | None = _positive_or_none(link.get("bandwidth_bytes_per_s"))
        self.link_latency_s: float = float(link.get("latency_s") or 0.0)
        # The measured all-reduce between this node's devices (profile format 8; optional): the
        # bus bandwidth and per-ring-step latency that gpipe_plan.collectives.ring_allreduce_s takes.
        self.allreduce_bandwidth_bytes_per_s: float | None = _positive_or_none(
            link.get("allreduce_bandwidth_bytes_per_s"))
        latency = link.get("allreduce_latency_s")
        self.allreduce_latency_s: float | None = (float(latency) if isinstance(latency, (int, float))
                                                  and not isinstance(latency, bool) and latency >= 0 else None)
        overhead = doc.get("overhead") or {}
        self.per_microbatch_overhead_s: float = float(overhead.get("per_microbatch_s") or 0.0)
        calibrated = overhead.get("per_microbatch_s")
        self.calibrated_overhead_s: float | None = float(calibrated) if calibrated is not None else None
        # The runtime's fixed costs per action and message, measured at profile time (version 9;
        # planner/fixedcosts.py), per micro-batch size from version 11 (:meth:`fixed_costs_at`):
        # None when the profile measured none.
        fixed = doc.get("fixed_costs")
        self.fixed_costs_record: dict | None = fixed if isinstance(fixed, dict) else None
        self.fixed_costs: FixedCosts | None = FixedCosts.from_record(fixed) if isinstance(fixed, dict) else None
        # How much slower every action runs where ranks share cores (version 10; None: not measured).
        shared = fixed.get("shared_cores") if isinstance(fixed, dict) else None
        self.shared_core_slowdown: float | None = float(shared["slowdown"]) if isinstance(shared, dict) else None
        self.shared_core_action_s: float = float(shared.get("per_action_s") or 0.0) if isinstance(shared, dict) else 0.0
        self.contention_slowdown, self.contention_processes = _contention(doc, where)
        # How far that reading's cycles disagreed (version 12; 0: not recorded): above
        # hostload.STEADY_SPREAD the host's speed swung while it was taken, and a plan says so.
        contention = doc.get("contention") or {}
        spread = contention.get("spread")
        self.contention_spread: float = float(spread) if isinstance(spread, (int, float)) else 0.0
        self.contention_readings: int = contention.get("readings") or 1     # how many it took
        # How much slower than the host's own speed the layers were timed, by the speed probe,
        # and in how many tries (version 13; 1.0 and 1: not read): a plan says when it is above
        # speedprobe.STEADY ([Note: layers timed at the host's own speed]).
        host_speed = (doc.get("measurement") or {}).get("host_speed") or {}
        tries = [t for t in host_speed.get("layer_tries") or [] if isinstance(t, (int, float)) and t > 0]
        self.layer_slowness: float = min(tries) if tries else 1.0
        self.layer_tries: int = len(tries) or 1
        self.recompute_call_s = _recompute_call(doc, where, self.layers)
        self.precision, self.param_dtype = precision_of(doc, where)
        self.usable_memory_bytes = usable_memory_bytes(self.device, where)
        self.host_memory_bytes = host_memory_bytes(self.device, where)
        # A CPU profile's cores (version 9), which the ranks of a plan on that host share
        # (planner/timeshare.py); None: not recorded (older profiles; a GPU per rank).
        cores = self.device.get("cores") if self.device.get("type") == "cpu" else None
        self.host_cores: int | None = cores if isinstance(cores, int) and not isinstance(cores, bool) else None
        threads = self.device.get("threads")
        self.threads_per_rank: int = threads if isinstance(threads, int) and threads >= 1 else 1
        self.tied = _tied(doc, where, self.names)
        self.split_measured = _split_measured(self.layers, where)
        self._cache: dict[float, LayerFigures] = {}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def fixed_costs_at(self, micro_batch_size: float | None) -> FixedCosts | None:
        """The fixed costs a plan of micro-batches of ``micro_batch_size`` is charged (None: the
        profile measured none; planner/fixedcosts.py, ``figures_at``)."""
        figures = figures_at(self.fixed_costs_record, micro_batch_size)
        return None if figures is None else FixedCosts.from_record(figures)

    @property
    def optimizer_scale(self) -> float:
        """What an optimizer step of the layers takes in a pipeline over their ``optimizer_s``, as the
        fixed-cost probe measured it (profile version 14; [Note: the optimizer timed where it runs],
        profiles/fixedcosts.py); 1 where it measured none."""
        return optimizer_scale(self.fixed_costs_record)

    def per_action_overhead_s(self, stages: int, micro_batch_size: float | None = None) -> float:
        """The cost between actions a plan of ``stages`` and micro-batches of ``micro_batch_size``
        is charged (planner/fixedcosts.py)."""
        figures = figures_at(self.fixed_costs_record, micro_batch_size)
        return between_actions_s(self.calibrated_overhead_s, figures["between_actions_s"] if figures else None, stages)

    @property
    def model(self) -> dict:
        return self.doc["model"]

    @property
    def device(self) -> dict:
        return self.doc.get("device") or {}

    def at(self, micro_batch_size: float) -> LayerFigures:
        """Per-layer figures at ``micro_batch_size`` (interpolated; see the module docstring)."""
        b = float(micro_batch_size)
        if b not in self._cache:
            sizes = self.sizes

            def series(values: Sequence[float]) -> float:
                return interpolate(sizes, values, b)

            optimizer_scale = self.optimizer_scale

            self._cache[b] = LayerFigures(
                micro_batch_size=b,
                names=self.names,
                forward_s=tuple(series(l["forward_s"]) for l in self.layers),
                backward_s=tuple(series(l["backward_s"]) for l in self.layers),
                activation_bytes=tuple(series(l["activation_bytes"]) for l in self.layers),
                output_bytes=tuple(series(l["output_bytes"]) for l in self.layers),
                transient_bytes=tuple(
                    series(l["peak_transient_bytes"]) if l.get("peak_transient_bytes") is not None else 0.0
                    for l in self.layers
                ),
                param_bytes=tuple(float(l["param_bytes"]) for l in self.layers),
                buffer_bytes=tuple(float(l.get("buffer_bytes") or 0.0) for l in self.layers),
                optimizer_s=tuple(float(l.get("optimizer_s") or 0.0) * optimizer_scale for l in self.layers),
                input_bytes=series(self.input_bytes) if self.input_bytes is not None else 0.0,
                **self._recompute_at(series),
                **self._split_at(series),
                **self._issue_at(series),
                tied=self.tied,
            )
        return self._cache[b]

    def _recompute_at(self, series: Any) -> dict[str, Any]:
        """A recomputing layer's backward at one size: its measured backward under checkpointing
        plus what checkpointing added to its forward (the cost model charges a recomputing
        stage's whole extra work to its backward; its forward stays the plain one)."""
        if self.recompute_call_s is None:
            return {}
        return {
            "recompute_backward_s": tuple(
                max(0.0, series(l["recompute_backward_s"]) + series(l["recompute_forward_s"]) - series(l["forward_s"]))
                for l in self.layers),
            "recompute_call_s": series(self.recompute_call_s),
        }

    def _issue_at(self, series: Any) -> dict[str, Any]:
        """The CPU's issue times at one size, when every layer has them (CUDA profiles, version 9)."""
        if not all(l.get(key) is not None for l in self.layers for key in ISSUE_FIELDS):
            return {}
        return {key: tuple(series(l[key]) for l in self.layers) for key in ISSUE_FIELDS}

    def _split_at(self, series: Any) -> dict[str, Any]:
        """The split backward at one size, when every layer has it (else the estimate is used)."""
        if not self.split_measured:
            return {}
        return {key: tuple(series(l[key]) for l in self.layers) for key in SPLIT_FIELDS}

    def measured_range(self) -> tuple[int, int]:
        return self.sizes[0], self.sizes[-1]


# The share of a GPU's memory left free for the allocator's fragmentation and for what the
# profile does not see (NCCL's buffers, the data): PyTorch's caching allocator reserves more
# than it hands out, by up to a few percent of a busy card, and a stage that fills the card to
# the last byte fails with "out of memory" on the first odd-sized request.
DEVICE_MEMORY_HEADROOM = 0.10


def usable_memory_bytes(device: Any, where: str) -> int | None:
    """What a plan may fill on a device of this profile: its memory less the CUDA context
    (``device.context_bytes``, measured by the profiler) and :data:`DEVICE_MEMORY_HEADROOM`.
    None when the profile does not say how much memory the device has (imported profiles), and
    for a CPU, whose memory its ranks share (:func:`host_share_bytes`): then only
    ``--memory-limit`` bounds a plan."""
    if not isinstance(device, dict) or device.get("type") != "cuda" or device.get("memory_bytes") is None:
        return None
    total, context = device.get("memory_bytes"), device.get("context_bytes", 0)
    for key, value in (("memory_bytes", total), ("context_bytes", context)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise BadInput(f"{where}: 'device.{key}' must be a non-negative number of bytes, found {value!r}")
    return int(max(0.0, (float(total) - float(context)) * (1.0 - DEVICE_MEMORY_HEADROOM)))


def host_memory_bytes(device: Any, where: str) -> int | None:
    """A CPU profile's host memory (version 9: ``device.memory_bytes``); None before it, or off a CPU."""
    if not isinstance(device, dict) or device.get("type") != "cpu" or device.get("memory_bytes") is None:
        return None
    total = device["memory_bytes"]
    if not isinstance(total, (int, float)) or isinstance(total, bool) or not math.isfinite(total) or total <= 0:
        raise BadInput(f"{where}: 'device.memory_bytes' must be a positive number of bytes, found {total!r}")
    return int(total)


def host_share_bytes(host_bytes: int, ranks: int) -> int:
    """What each of ``ranks`` processes on one host may fill: the host's memory less
    :data:`DEVICE_MEMORY_HEADROOM` (the processes' own libraries, the data, the system), shared
    evenly: the stages of a CPU plan run side by side on the host that was profiled."""
    return int(host_bytes * (1.0 - DEVICE_MEMORY_HEADROOM)) // max(1, ranks)


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past the ends, never below zero."""
    if len(xs) == 1:
        return max(0.0, float(ys[0]) * x / xs[0])
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = 0
        while xs[i + 1] < x:
            i += 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], float(ys[i]), float(ys[i + 1])
    if x == x0:
        return max(0.0, y0)
    if x == x1:
        return max(0.0, y1)
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _sizes(doc: dict, where: str) -> list[int]:
    """The profiled micro-batch sizes (the schema made them positive integers), ascending."""
    sizes = doc["micro_batch_sizes"]
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise BadInput(f"{where}: 'micro_batch_sizes' must be strictly ascending, got {sizes}")
    return list(sizes)


def _layers(doc: dict, where: str) -> list[dict]:
    """The layers (the schema checked each one's keys); their names must be unique."""
    layers = doc["layers"]
    seen: set[str] = set()
    for i, layer in enumerate(layers):
        name = layer["name"]
        if name in seen:
            raise BadInput(f"{where}: layer {i} ({name!r}): the name {name!r} is used twice; layer names must be unique")
        seen.add(name)
    return layers


def _contention(doc: dict, where: str) -> tuple[float, int]:
    """(slowdown, processes) from the optional ``contention`` object; (1.0, 2) without one.

    The schema made ``slowdown`` a number >= 1 and ``processes`` an integer >= 2."""
    contention = doc.get("contention")
    if contention is None:
        return 1.0, 2
    return float(contention["slowdown"]), contention["processes"]


def _recompute_call(doc: dict, where: str, layers: list[dict]) -> list[float] | None:
    """The optional ``recompute_call_s`` series, only with every layer's recompute figures."""
    if recompute_timed(doc):
        return doc["recompute_call_s"]
    timed_layers = [l for l in layers if all(l.get(key) is not None for key in RECOMPUTE_FIELDS)]
    if doc.get("recompute_call_s") is not None or timed_layers:
        raise BadInput(f"{where}: recompute timings are partial ('recompute_call_s' and every layer's "
                       "'recompute_forward_s' and 'recompute_backward_s' go together); re-profile, or "
                       "delete them all to plan recomputation as one more forward")
    return None


def _split_measured(layers: list[dict], where: str) -> bool:
    """Whether every layer has the split backward (profile version 7); some but not all is refused."""
    if split_backward_timed(layers):
        return True
    if any(l.get(key) is not None for l in layers for key in SPLIT_FIELDS):
        raise BadInput(f"{where}: the split backward is partial ('backward_input_s', 'backward_weight_s' and "
                       "'weight_kept_bytes' go together, on every layer); re-profile, or delete them all to "
                       "plan with the estimate I = W = backward_s / 2")
    return False


def _tied(doc: dict, where: str, names: tuple[str, ...]) -> tuple[tuple[tuple[int, ...], float], ...]:
    """The profile's ``tied_parameters`` as (layer indices, bytes); absent: none."""
    entries = doc.get("tied_parameters") or []
    index = {name: i for i, name in enumerate(names)}
    tied = []
    for entry in entries:
        layers, size = entry["layers"], entry["bytes"]
        if any(name not in index for name in layers):
            missing = next(name for name in layers if name not in index)
            raise BadInput(f"{where}: a tied_parameters entry names the layer {missing!r}, which this profile "
                           "does not have")
        tied.append((tuple(sorted(index[name] for name in layers)), float(size)))
    return tuple(tied)


def _positive_or_none(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    return None
