"""Profile a model: every layer at every micro-batch size, and the whole model to check the sum.

The planner predicts a pipeline's step time by adding up per-layer figures, so the profile
checks that adding up works on this machine: it times the unsplit model's forward+backward
the same way and records ``consistency`` (sum of layers / whole model). A ratio far from 1
means per-layer timing misses something (per-call overhead, caches) and the plans made from
this profile will be off by about as much.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from .. import __version__
from ..artifacts import FORMAT_VERSIONS, PROFILE_FORMAT
from ..models import LayeredModel, Precision, build_model
from ..speedprobe import speed_probe_s, workload
from .clock import clock_for
from ..cudamemory import outside_allocator_bytes
from .device import describe
from .measure import (Autocast, LayerFigures, Runner, Timing, harness_runner, model_step_runner, optimizer_step_s,
                      peak_transient_bytes, prepare_layer, recompute_harness_runner, recomputing_runner,
                      time_rounds)
from .memory import tensor_bytes, unique_bytes

Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class ProfileRequest:
    """What to profile, where, and how carefully."""

    spec: dict[str, Any]
    micro_batch_sizes: list[int]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    threads: int = 1
    warmup: int = 3
    repeats: int = 10
    seed: int = 0
    measure_link: bool = False
    batch_size: int | None = None
    # CPU only: also time the model with this many processes computing at once (0: do not).
    contention_processes: int = 0
    # Also time every layer under activation checkpointing (what recomputation really costs).
    recompute: bool = True
    precision: Precision = field(default_factory=Precision)
    # Warm up for at least this long (None: 1 s on a GPU, whose clock ramps up under load; 0 on a CPU).
    warmup_s: float | None = None

    @property
    def warmup_duration_s(self) -> float:
        if self.warmup_s is not None:
            return self.warmup_s
        return 1.0 if self.device.type == "cuda" else 0.0

    def autocast(self) -> Any:
        """The context every forward runs in (see models.precision)."""
        return self.precision.autocast(self.device.type)


class Progress(Protocol):
    """Told the number of units of work, then once per unit done (a progress bar)."""

    def begin(self, total: int) -> None: ...

    def step(self, description: str) -> None: ...


class _Silent:
    def begin(self, total: int) -> None:
        pass

    def step(self, description: str) -> None:
        pass


def default_sizes(batch_size: int) -> list[int]:
    """1, 2, 4, ... doubling up to ``batch_size``, which is always included."""
    sizes = []
    b = 1
    while b < batch_size:
        sizes.append(b)
        b *= 2
    sizes.append(batch_size)
    return sizes


def profile_model(request: ProfileRequest, progress: Progress | None = None) -> dict[str, Any]:
    """Measure the model ``request.spec`` describes; return the profile document."""
    progress = progress or _Silent()
    torch.set_num_threads(request.threads)
    if request.device.type == "cuda" and request.device.index is None:   # "cuda": the current GPU
        request = replace(request, device=torch.device("cuda", torch.cuda.current_device()))
    device = request.device
    context_bytes = None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # events and allocations go to this GPU's current stream
        # Before the model is built: the CUDA context (and other processes), which the planner
        # takes off the card's memory (planner/profile.py, usable_memory_bytes).
        context_bytes = outside_allocator_bytes(device)
    model = build_model(request.spec, seed=request.seed)
    request.precision.cast(model)
    model.to(device)
    sizes = sorted(request.micro_batch_sizes)
    with request.autocast():
        model.check(batch_size=sizes[0], device=device)  # a bad --input-shape fails here, in one line

    probe_before = speed_probe_s(device.type)   # see speedprobe: the speed this profile saw
    rounds = request.warmup + request.repeats
    contention = request.contention_processes > 1 and device.type == "cpu"
    runs_per_round = len(model.layers) + 2 + (len(model.layers) + 1 if request.recompute else 0)
    progress.begin(len(sizes) * rounds * 2 * runs_per_round + 1 + (1 if request.measure_link else 0)
                   + (1 if contention else 0))
    # Every size is prepared first and all are timed in the same rounds (see _time_sizes).
    prepared = [_prepare_size(model, *_batch(model, b, request.seed, device), request, b) for b in sizes]
    input_bytes = [p.input_bytes for p in prepared]
    _time_sizes(prepared, request, progress)
    per_size = [p.figures for p in prepared]
    steps = [p.step for p in prepared]
    harnesses = [p.harness for p in prepared]
    recompute_harnesses = [p.recompute_harness for p in prepared if p.recompute_harness is not None]

    progress.step("optimizer steps")
    clock = clock_for(device, request.threads)
    optimizer_s = [optimizer_step_s(_distinct(layer.parameters()), clock, request.warmup, request.repeats)
                   for _, layer in model.layers]

    probes = [probe_before, speed_probe_s(device.type)]
    link = None
    if request.measure_link:
        from .link import measure_link

        progress.step("link between two processes")
        link = measure_link(device)
    doc = _document(model, request, sizes, per_size, steps, harnesses, recompute_harnesses, input_bytes,
                    optimizer_s, link)
    if contention:
        from .contention import measure_contention

        progress.step(f"{request.contention_processes} processes computing side by side")
        doc["contention"] = measure_contention(request.spec, sizes[len(sizes) // 2], request.threads,
                                               request.contention_processes, seed=request.seed,
                                               precision=request.precision)
    if context_bytes is not None:
        doc["device"]["context_bytes"] = context_bytes
    doc["device"]["speed_probe_s"] = sum(probes) / len(probes)
    doc["device"]["speed_probe_workload"] = list(workload(device.type))
    doc["measurement"]["speed_probe_s"] = probes
    return doc


def _batch(model: LayeredModel, size: int, seed: int, device: torch.device) -> tuple[Tensors, torch.Tensor]:
    inputs, targets = model.synthetic_batch(size, torch.Generator().manual_seed(seed))
    return tuple(x.to(device) for x in inputs), targets.to(device)


@dataclass
class _Size:
    """One micro-batch size: its layers' figures, the runners that time them, and the results."""

    size: int
    input_bytes: int
    figures: list[LayerFigures]
    runners: list[Runner]                     # the plain harness, then every layer
    whole: Runner                             # the unsplit model
    recomputing: list[Runner]                 # the checkpointed harness, then every layer; or none
    step: Timing = field(default_factory=lambda: Timing(0.0, 0.0))
    harness: Timing = field(default_factory=lambda: Timing(0.0, 0.0))
    recompute_harness: Timing | None = None

    @property
    def groups(self) -> list[list[Runner]]:
        return [self.runners, [self.whole]] + ([self.recomputing] if self.recomputing else [])


def _prepare_size(model: LayeredModel, inputs: Tensors, targets: torch.Tensor, request: ProfileRequest,
                  b: int) -> _Size:
    """Weigh every layer at micro-batch size ``b`` and make the runners that will time them."""
    # Every layer's inputs at this size: run the layers once, without autograd (in the
    # precision's autocast, so that each layer receives the dtypes it will in training).
    layer_inputs: list[Tensors] = []
    autocast: Autocast = request.autocast
    with torch.no_grad(), autocast():
        xs = inputs
        for _, layer in model.layers:
            layer_inputs.append(xs)
            xs = layer(*xs)
    last = len(model.layers) - 1
    figures: list[LayerFigures] = []
    # The first runner times the harness itself around a trivial layer; see harness_runner.
    # Runner names carry the size: they are what the progress bar shows.
    runners: list[Runner] = [harness_runner(request.device, autocast)]
    # The same layers under checkpointing, as a third group of every round (same drift).
    recomputing: list[Runner] = [recompute_harness_runner(request.device, autocast)] if request.recompute else []
    for i, (name, layer) in enumerate(model.layers):
        loss = (lambda outputs: model.loss(outputs, targets)) if i == last else None
        weighed, runner = prepare_layer(f"b={b} {name}", layer, layer_inputs[i], first=(i == 0), loss=loss,
                                        autocast=autocast)
        figures.append(weighed)
        runners.append(runner)
        if request.recompute:
            recomputing.append(recomputing_runner(f"b={b} {name} (recompute)", runner, layer, layer_inputs[i],
                                                  first=(i == 0), loss=loss, autocast=autocast))
    whole = model_step_runner(lambda: model.loss(model.forward(*inputs), targets), autocast)
    whole.name = f"b={b} {whole.name}"
    return _Size(b, tensor_bytes(inputs), figures, runners, whole, recomputing)


def _time_sizes(prepared: list[_Size], request: ProfileRequest, progress: Progress) -> None:
    """Time every size's runners in the same rounds; fill in the figures' times.

    One round runs every size in turn, smallest first. The machine's speed drifts over
    seconds (docs/benchmarks.md, "The machine's speed over time"): timed one after the
    other, a slow spell could land on one size only and make it look as slow as the next
    (the planner would then pick its micro-batch count from noise). Timed in the same rounds,
    a slow spell lands on every size alike. The cost: the inputs of every size are alive at
    once (about twice the largest size's), not only the largest's.
    """
    clock = clock_for(request.device, request.threads)
    groups = [group for p in prepared for group in p.groups]
    timed = iter(time_rounds(groups, clock, request.warmup, request.repeats,
                             after_run=lambda name: progress.step(name), warmup_s=request.warmup_duration_s))
    for p in prepared:
        harness, *layer_timings = next(timed)
        (p.step,) = next(timed)
        p.harness = harness
        for weighed, timing in zip(p.figures, layer_timings):
            weighed.forward_s = max(0.0, timing.forward_s - harness.forward_s)
            weighed.backward_s = max(0.0, timing.backward_s - harness.backward_s)
        if p.recomputing:
            recompute_harness, *recompute_timings = next(timed)
            p.recompute_harness = recompute_harness
            for weighed, timing in zip(p.figures, recompute_timings):
                weighed.recompute_forward_s = max(0.0, timing.forward_s - recompute_harness.forward_s)
                weighed.recompute_backward_s = max(0.0, timing.backward_s - recompute_harness.backward_s)
        if request.device.type == "cuda":
            for weighed, runner in zip(p.figures, p.runners[1:]):
                weighed.peak_transient_bytes = peak_transient_bytes(runner, request.device, weighed)


def _distinct(params: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _document(model: LayeredModel, request: ProfileRequest, sizes: list[int],
              per_size: list[list[LayerFigures]], steps: list[Timing], harnesses: list[Timing],
              recompute_harnesses: list[Timing], input_bytes: list[int],
              optimizer_s: list[float], link: dict[str, Any] | None) -> dict[str, Any]:
    layers = []
    for i, (name, layer) in enumerate(model.layers):
        at = [figures[i] for figures in per_size]
        largest = at[-1]
        entry: dict[str, Any] = {
            "name": name,
            "forward_s": [f.forward_s for f in at],
            "backward_s": [f.backward_s for f in at],
            "activation_bytes": [f.activation_bytes for f in at],
            "output_bytes": [f.output_bytes for f in at],
            "param_bytes": unique_bytes(layer.parameters()),
            "buffer_bytes": unique_bytes(layer.buffers()),
            "optimizer_s": optimizer_s[i],
            "output_shapes": largest.output_shapes,
            "output_dtypes": largest.output_dtypes,
        }
        if request.device.type == "cuda":
            entry["peak_transient_bytes"] = [f.peak_transient_bytes for f in at]
        if request.recompute:
            entry["recompute_forward_s"] = [f.recompute_forward_s for f in at]
            entry["recompute_backward_s"] = [f.recompute_backward_s for f in at]
        layers.append(entry)

    layer_sum = [sum(f.forward_s + f.backward_s for f in figures) for figures in per_size]
    model_step = [t.forward_s + t.backward_s for t in steps]
    doc: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "version": FORMAT_VERSIONS[PROFILE_FORMAT],
        "model": model.spec,
        "device": describe(request.device, request.threads),
        "micro_batch_sizes": sizes,
        "batch_size": request.batch_size or sizes[-1],
        "precision": request.precision.compute,
        "param_dtype": request.precision.params,
        "input": {"shapes": model.input_shapes, "dtypes": [_dtype_name(d) for d in model.input_dtypes]},
        "input_bytes": input_bytes,
        "layers": layers,
        "consistency": {
            "layer_sum_s": layer_sum,
            "model_step_s": model_step,
            "ratio": [s / m if m > 0 else None for s, m in zip(layer_sum, model_step)],
            "model_forward_s": [t.forward_s for t in steps],
            "model_backward_s": [t.backward_s for t in steps],
        },
        "measurement": {"warmup": request.warmup, "repeats": request.repeats, "statistic": "median",
                        "timer": clock_for(request.device, request.threads).name, "seed": request.seed,
                        "harness_forward_s": [t.forward_s for t in harnesses],
                        "harness_backward_s": [t.backward_s for t in harnesses]},
        "tool": {"name": "gpipe-plan", "version": __version__, "torch": torch.__version__},
    }
    if recompute_harnesses:
        # The checkpoint wrapper's own cost, forward + backward, beyond the plain harness's.
        doc["recompute_call_s"] = [max(0.0, r.forward_s + r.backward_s - h.forward_s - h.backward_s)
                                   for r, h in zip(recompute_harnesses, harnesses)]
        doc["measurement"]["recompute_harness_forward_s"] = [t.forward_s for t in recompute_harnesses]
        doc["measurement"]["recompute_harness_backward_s"] = [t.backward_s for t in recompute_harnesses]
    if link is not None:
        doc["link"] = link
    return doc

