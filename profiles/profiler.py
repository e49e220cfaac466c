"""Profile a model: per layer and micro-batch size, time and bytes; the whole model, to check the sum.

Two methods, chosen by the model's size (``ProfileRequest.layer_by_layer``):

- **whole** (parameters up to :data:`WHOLE_MODEL_CHECK_BYTES`): the model in memory, every
  layer timed in the same rounds, one after the other as in the model, beside the whole
  model's step (:func:`_profile_in_memory`). Layers see the caches the layer before them
  left, as in training, and their sum matches the whole step.
- **layer by layer** (larger models): one layer real at a time, each kind measured once.

Memory, layer by layer: the model is built on the meta device (models/materialize.py) and only
the layer being measured is real, so profiling needs about the largest layer with its
activations, not the whole model: a model larger than this machine's memory can be profiled. First a walk runs the
synthetic batches through the layers, one real at a time, to get every layer's real inputs
at every micro-batch size (:mod:`.walk`).

Time: layers of one kind (same code, parameter shapes, input and output shapes: :mod:`.kinds`)
cost the same, so only the first of each kind is measured and the others take its figures
(``measured_as`` in the profile). A transformer's 32 blocks are measured as one.

Each measured layer is timed in rounds (:mod:`.measure`): every micro-batch size in turn,
the plain layer, then the layer under checkpointing, then the layer with its backward split
into the input and the weight gradient (as zero-bubble schedules run it), each next to an
empty layer (the harness) whose cost is taken off; a slow spell of the machine lands on all
sizes alike.

The planner predicts a pipeline's step time by adding up per-layer figures, so the profile
checks that adding up works on this machine: it times the unsplit model's forward+backward
the same way and records ``consistency`` (sum of layers / whole model). A ratio far from 1
means per-layer timing misses something (per-call overhead, caches, a layer timed alone
running hotter than in the model) and the plans made from this profile will be off by about
as much. That needs the whole model in memory, so by default it is done only for models whose
parameters take at most :data:`WHOLE_MODEL_CHECK_BYTES`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import torch

from .. import __version__
from ..models import (LayeredModel, Precision, build_model, built_whole, layer_materialized, materialize_layers,
                      release_layers)
from ..models.layered import batch_dimensions
from ..models.materialize import streamed
from ..schema import FORMAT_VERSIONS, PROFILE_FORMAT
from .. import speedprobe
from ..speedprobe import STEADY, speed_probe_s, workload
from .clock import Clock, clock_for
from ..cudamemory import outside_allocator_bytes
from ..hostload import CpuSample, sample as host_sample, window_load
from .device import describe
from .measure import (Autocast, LayerMeasurement, Runner, Timing, distinct_parameters, harness_runner, model_step_runner,
                      optimizer_step_s, peak_transient_bytes, prepare_layer, record_split, recompute_harness_runner,
                      recomputing_runner, has_weights, split_harness_runner, split_runner, time_rounds)
from ..tensor_memory import tensor_bytes, unique_bytes
from .phases import announce, counted
from .walk import walk_layers

Tensors = tuple[torch.Tensor, ...]

# Whole-model check by default up to this many bytes of parameters: below it a whole training
# step is cheap in memory and time next to the layers; above it, profiling stays at one layer.
WHOLE_MODEL_CHECK_BYTES = 1 << 30


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
    # CPU only: also time a layer with this many processes computing at once (0: do not).
    contention_processes: int = 0
    # Also time every layer under activation checkpointing (what recomputation really costs).
    recompute: bool = True
    # Also time every layer's backward split into the input and the weight gradient, and
    # weigh what stays alive between the two (what zero-bubble schedules need).
    split_backward: bool = True
    # Also run a short 2-process pipeline of the model's layers to measure the runtime's fixed
    # costs per action and message (profiles/fixedcosts.py; the CLI's default, off here).
    fixed_costs: bool = False
    # ... and, on a CPU host that runs at most 4 ranks at once, again on twice as many processes
    # as it runs at once: how much slower ranks run where they share cores (the CLI's default).
    shared_cores: bool = False
    precision: Precision = field(default_factory=Precision)
    # Warm up for at least this long (None: 1 s on a GPU, whose clock ramps up under load; 0 on a CPU).
    warmup_s: float | None = None
    # One layer real at a time, each kind measured once (None: when the model's parameters take
    # more than WHOLE_MODEL_CHECK_BYTES; below that the whole model is timed layer by layer in the
    # same rounds, the method whose sums match the whole model's step).
    layer_by_layer: bool | None = None
    # Layer by layer: measure the first layer of each kind only, the others sharing its figures
    # (False: every layer).
    share_figures: bool = True
    # Time the whole model too, for `consistency` (None: when its parameters take at most
    # WHOLE_MODEL_CHECK_BYTES).
    whole_model_check: bool | None = None

    @property
    def warmup_duration_s(self) -> float:
        if self.warmup_s is not None:
            return self.warmup_s
        return 1.0 if self.device.type == "cuda" else 0.0

    def autocast(self) -> Any:
        """The context every forward runs in (see models.precision)."""
        return self.precision.autocast(self.device.type)


class Progress(Protocol):
    """Told the number of units of work, then once per unit done (a progress bar); told the
    number again where the work grew (the layers timed again)."""

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
    # The host's speed as the profile starts, read again below before the layers are timed
    # ([Note: layers timed at the host's own speed], gpipe_plan/speedprobe.py).
    host_readings = [speed_probe_s(device.type)]
    # Every parameter on meta: a layer is made real while it is walked or measured, then
    # given back (a model that cannot be built so is built whole, and stays real).
    announce(f"building model '{request.spec.get('name') or request.spec.get('factory')}'")
    model = build_model(request.spec, seed=request.seed, materialize=(), announce=announce)
    request.precision.cast(model)
    whole = built_whole(model)
    if whole is not None:
        model.to(device)
    if not _layer_by_layer(request, model):
        return _profile_in_memory(model, request, progress, context_bytes, whole, host_readings)
    sizes = sorted(request.micro_batch_sizes)
    announce(f"checking the {counted(len(model.layers), 'layer')} on a micro-batch, one at a time")
    with request.autocast():
        # A bad --input-shape fails here, in one line, one layer real at a time.
        streamed(model, device).check(batch_size=sizes[0], device=device)
    for note in model.notes:
        announce(f"note: {note}", key=note)
    batches = [_batch(model, b, request.seed, device) for b in sizes]
    announce(f"running {len(sizes)} micro-batch sizes through the layers")
    host_readings.append(speed_probe_s(device.type))
    walk = walk_layers(model, [inputs for inputs, _ in batches], device, request.autocast, request.share_figures)

    layers_from = host_sample(children=True)    # what else ran while the layers were timed (_finish)
    rounds = request.warmup + request.repeats
    check_whole = _checks_whole_model(request, model)
    contention = request.contention_processes > 1 and device.type == "cpu"
    # Units per size and round: forward and backward of the harness and the layer; the same
    # checkpointed; forward, I and W of both split (not for the first layer: see split_runner).
    units_per_size = 4 + (4 if request.recompute else 0)
    split_units = 6 * len(sizes) * rounds * sum(1 for i in walk.measured if i > 0) if request.split_backward else 0
    layer_units = len(walk.measured) * (len(sizes) * rounds * units_per_size + 1) + split_units
    total = [layer_units + (len(sizes) * rounds * 2 if check_whole else 0)
             + (1 if request.measure_link else 0) + (1 if contention else 0) + _fixed_cost_phases(request, model)]
    progress.begin(total[0])
    clock = clock_for(device, request.threads)

    def time_layers() -> dict[int, Any]:
        nonlocal walk
        if not walk.inputs:      # a try after the first: each layer's inputs again
            walk = walk_layers(model, [inputs for inputs, _ in batches], device, request.autocast,
                               request.share_figures)
        return {i: _measure_layer(model, i, walk.inputs.pop(i), [t for _, t in batches], sizes, request, clock,
                                  progress) for i in walk.measured}

    measured, probes, host_speed = _timed_at_speed(time_layers, device.type, host_readings,
                                                   lambda: _grow(progress, total, layer_units))
    per_size = [[replace(measured[walk.measured_as[i]].figures[s]) for i in range(len(model.layers))]
                for s in range(len(sizes))]
    steps = _time_whole_model(model, batches, sizes, request, clock, progress) if check_whole else None
    harnesses = [_median_timing([m.harness[s] for m in measured.values()]) for s in range(len(sizes))]
    recompute_harnesses = ([_median_timing([m.recompute_harness[s] for m in measured.values()])
                            for s in range(len(sizes))] if request.recompute else [])
    split_timed = [m for m in measured.values() if m.split_harness]    # all but a first layer
    split_harnesses = [_median_timing([m.split_harness[s] for m in split_timed]) for s in range(len(sizes))] \
        if split_timed else []
    optimizer_s = [measured[walk.measured_as[i]].optimizer_s for i in range(len(model.layers))]

    link = _measure_link(request, progress)
    doc = _document(model, request, sizes, per_size, steps, harnesses, recompute_harnesses, split_harnesses,
                    [tensor_bytes(inputs) for inputs, _ in batches], optimizer_s, link)
    for entry, rep in zip(doc["layers"], walk.measured_as):
        entry["measured_as"] = None if model.layers[rep][0] == entry["name"] else model.layers[rep][0]
    doc["measurement"]["shared_figures"] = request.share_figures
    doc["measurement"]["host_speed"] = host_speed
    return _finish(doc, request, progress, probes, context_bytes, whole, True, contention, layers_from)


def _grow(progress: Progress, total: list[int], units: int) -> None:
    """Tell ``progress`` its work grew by ``units`` (the layers timed again): ``total[0]`` updated."""
    total[0] += units
    progress.begin(total[0])


def _timed_at_speed(time_layers: Callable[[], Any], device_type: str, readings: list[float],
                    again: Callable[[], None]) -> tuple[Any, list[float], dict[str, Any]]:
    """``time_layers()``'s answer from a try at the host's own speed, the speed probes around that
    try, and the record (``measurement.host_speed``): the host's own speed and each try's
    slowness ([Note: layers timed at the host's own speed], gpipe_plan/speedprobe.py).

    ``readings``: the probe read as the profile started; ``again``: called before a try after
    the first (its progress units). Each try is bracketed by probes; its
    slowness is the slower of them over the host's own speed (the fastest reading, those of the
    tries included). A try more than STEADY slow is timed again, at most LAYER_TRIES in all; the
    least slow is kept."""
    fastest = min(readings)
    answers: list[Any] = []
    probes: list[list[float]] = []
    tries_at_most = speedprobe.LAYER_TRIES
    for attempt in range(tries_at_most):
        before = speed_probe_s(device_type)
        answers.append(time_layers())
        after = speed_probe_s(device_type)
        probes.append([before, after])
        fastest = min(fastest, before, after)
        slowness = max(before, after) / fastest
        if slowness <= 1 + STEADY:
            break
        if attempt + 1 < tries_at_most:
            announce(f"the host ran {slowness - 1:.0%} slower than its own speed while the layers were timed "
                     f"(the speed probe around them): timing them again, try {attempt + 2} of {tries_at_most}")
            again()
    # Each try against the fastest reading of all (a later try's may be faster than any before it).
    tries = [max(pair) / fastest for pair in probes]
    kept = min(range(len(tries)), key=tries.__getitem__)
    return answers[kept], probes[kept], {"fastest_probe_s": fastest, "layer_tries": tries}


def _measure_link(request: ProfileRequest, progress: Progress) -> dict[str, Any] | None:
    """The link's ping-pong and all-reduce figures where the request asks for them (both methods), else None."""
    if not request.measure_link:
        return None
    from .link import measure_link

    progress.step("link: ping-pong and all-reduce")
    return measure_link(request.device)


def _finish(doc: dict[str, Any], request: ProfileRequest, progress: Progress, probes: list[float],
            context_bytes: int | None, whole: str | None, layer_by_layer: bool, contention: bool,
            layers_from: CpuSample) -> dict[str, Any]:
    """What both methods add to the document: how it was measured, contention, the device's
    figures, and what else ran on the host meanwhile (``host_load``: from ``layers_from``, the
    reading taken before the layers were timed)."""
    doc["measurement"]["layer_by_layer"] = layer_by_layer
    doc["measurement"]["built_whole"] = whole
    loads = _HostLoad()
    loads.add("layers", layers_from, request.threads)
    if contention:
        from .contention import measure_contention

        progress.step(f"{request.contention_processes} processes computing side by side")
        sizes = doc["micro_batch_sizes"]
        # The measured layer that takes longest at the middle size stands for the model
        # (see profiles/contention.py).
        middle = len(sizes) // 2
        busiest = max((i for i, layer in enumerate(doc["layers"]) if layer["measured_as"] is None),
                      key=lambda i: doc["layers"][i]["forward_s"][middle] + doc["layers"][i]["backward_s"][middle])
        started = host_sample(children=True)
        doc["contention"] = measure_contention(request.spec, sizes[middle], request.threads,
                                               request.contention_processes, seed=request.seed,
                                               precision=request.precision, layer=busiest)
        loads.add("contention", started, request.contention_processes * request.threads)
    if request.fixed_costs:
        from .fixedcosts import STAGES

        started = host_sample(children=True)
        _measure_fixed_costs(doc, request, progress)
        loads.add("fixed_costs", started, STAGES * request.threads)
        processes = _shared_processes(request, len(doc["layers"]))
        if processes:
            started = host_sample(children=True)
            _measure_shared_cores(doc, request, progress, processes)
            loads.add("shared_cores", started, processes * request.threads)
    if loads.phases:
        doc["host_load"] = {"phases": loads.phases}
    if context_bytes is not None:
        doc["device"]["context_bytes"] = context_bytes
    doc["device"]["speed_probe_s"] = sum(probes) / len(probes)
    doc["device"]["speed_probe_workload"] = list(workload(request.device.type))
    doc["measurement"]["speed_probe_s"] = probes
    return doc


class _HostLoad:
    """The profile's ``host_load``: per phase of the measurement, what other processes used of
    the host's cores and took from the ones it needed (gpipe_plan/hostload.py), so that a plan
    made from a profile measured on a busy host can say so (planner/profile.py)."""

    def __init__(self) -> None:
        self.phases: list[dict[str, Any]] = []

    def add(self, phase: str, started: CpuSample, needed_cores: int) -> None:
        """The phase that began at ``started`` and ends now, needing ``needed_cores`` (its
        processes, the profiler's own and its finished helpers, are its own CPU time)."""
        entry = window_load(started, host_sample(children=True), needed_cores)
        if entry is not None:
            self.phases.append({"phase": phase, **entry})


def _measure_fixed_costs(doc: dict[str, Any], request: ProfileRequest, progress: Progress) -> None:
    """The runtime's fixed costs, from a short pipeline of the layers just measured (profiles/fixedcosts.py).

    The phase is announced as it starts (the progress lines print a phase the first time it
    runs), since the pipeline's processes take seconds to start."""
    from .fixedcosts import MAX_LAYERS, STAGES, measure_fixed_costs

    progress.step(f"fixed costs: a {STAGES}-process pipeline of at most {MAX_LAYERS} layers at several chunk counts, "
                  "at every micro-batch size")
    doc["fixed_costs"] = measure_fixed_costs(request.spec, doc, request.threads, request.seed, request.precision,
                                             request.device)


def _shared_processes(request: ProfileRequest, layers: int) -> int:
    """The processes the shared-cores measurement runs (profiles/fixedcosts.py,
    ``shared_processes``); 0: it does not run (not asked, not a CPU, or a host or model it does
    not fit)."""
    if not (request.fixed_costs and request.shared_cores) or request.device.type != "cpu":
        return 0
    from ..hostload import usable_cores
    from .fixedcosts import shared_processes

    return shared_processes(usable_cores(), request.threads, layers)


def _fixed_cost_phases(request: ProfileRequest, model: LayeredModel) -> int:
    """The progress units of the fixed-cost measurements: one per pipeline they run."""
    if not request.fixed_costs:
        return 0
    return 1 + (1 if _shared_processes(request, len(model.layers)) else 0)


def _measure_shared_cores(doc: dict[str, Any], request: ProfileRequest, progress: Progress, processes: int) -> None:
    """How much slower ranks run where they share the host's cores (profiles/fixedcosts.py), after
    the fixed costs: the same pipeline on ``processes`` processes, twice what the host runs at once."""
    from .fixedcosts import measure_shared_cores

    progress.step(f"shared cores: the pipeline again on {processes} processes, twice what this host runs at once")
    doc["fixed_costs"]["shared_cores"] = measure_shared_cores(request.spec, doc, processes, request.threads,
                                                              request.seed, request.precision)


def _layer_by_layer(request: ProfileRequest, model: LayeredModel) -> bool:
    if request.layer_by_layer is not None:
        return request.layer_by_layer
    return unique_bytes(model.module.parameters()) > WHOLE_MODEL_CHECK_BYTES


# ---------------------------------------------------------------------- the whole model in memory
def _profile_in_memory(model: LayeredModel, request: ProfileRequest, progress: Progress, context_bytes: int | None,
                       whole: str | None, host_readings: list[float]) -> dict[str, Any]:
    """Every layer measured, all in the same rounds, with the whole model's step beside them.

    For a model that fits: its layers run one after another in each round, as they do in the
    model (what a layer leaves in the caches is what the next one finds), so their sum matches
    the whole model's step (``consistency`` near 1; timed alone, a layer runs a few percent
    faster than in the model).
    """
    device = request.device
    materialize_layers(model, range(len(model.layers)), unused=True)
    model.to(device)
    sizes = sorted(request.micro_batch_sizes)
    announce(f"checking the {counted(len(model.layers), 'layer')} on a micro-batch")
    with request.autocast():
        model.check(batch_size=sizes[0], device=device)  # a bad --input-shape fails here, in one line
    for note in model.notes:
        announce(f"note: {note}", key=note)
    host_readings = [*host_readings, speed_probe_s(device.type)]
    layers_from = host_sample(children=True)    # what else ran while the layers were timed (_finish)
    rounds = request.warmup + request.repeats
    contention = request.contention_processes > 1 and device.type == "cpu"
    runs_per_round = len(model.layers) + 2 + (len(model.layers) + 1 if request.recompute else 0)
    split_runs_per_round = len(model.layers) if request.split_backward else 0   # the harness, layers 1..
    layer_units = len(sizes) * rounds * (2 * runs_per_round + 3 * split_runs_per_round) + 1    # and the optimizer's
    total = [layer_units + (1 if request.measure_link else 0) + (1 if contention else 0)
             + _fixed_cost_phases(request, model)]
    progress.begin(total[0])
    # Every size is prepared first and all are timed in the same rounds (see _time_sizes).
    announce(f"measuring {counted(len(model.layers), 'layer')} at sizes {','.join(map(str, sizes))}: memory, "
             f"then {rounds} timed round{'s' if rounds != 1 else ''}")
    prepared = [_prepare_size(model, *_batch(model, b, request.seed, device), request, b) for b in sizes]
    clock = clock_for(device, request.threads)

    def time_layers() -> tuple[list[tuple], list[float]]:
        _time_sizes(prepared, model, request, progress)
        progress.step("optimizer steps")
        optimizer_s = [optimizer_step_s(distinct_parameters(layer.parameters()), clock, request.warmup, request.repeats)
                       for _, layer in model.layers]
        # What _time_sizes wrote, copied: a later try writes over it.
        return [(p.step, p.harness, p.recompute_harness, p.split_harness, [replace(f) for f in p.figures])
                for p in prepared], optimizer_s

    (timed, optimizer_s), probes, host_speed = _timed_at_speed(time_layers, device.type, host_readings,
                                                               lambda: _grow(progress, total, layer_units))
    for p, (step, harness, recompute_harness, split_harness, figures) in zip(prepared, timed):
        p.step, p.harness, p.recompute_harness, p.split_harness, p.figures = (step, harness, recompute_harness,
                                                                              split_harness, figures)
    link = _measure_link(request, progress)
    doc = _document(model, request, sizes, [p.figures for p in prepared], [p.step for p in prepared],
                    [p.harness for p in prepared],
                    [p.recompute_harness for p in prepared if p.recompute_harness is not None],
                    [p.split_harness for p in prepared if p.split_harness is not None],
                    [p.input_bytes for p in prepared], optimizer_s, link)
    for entry in doc["layers"]:
        entry["measured_as"] = None
    doc["measurement"]["shared_figures"] = False
    doc["measurement"]["host_speed"] = host_speed
    return _finish(doc, request, progress, probes, context_bytes, whole, False, contention, layers_from)


@dataclass
class _Size:
    """One micro-batch size: its layers' figures, the runners that time them, and the results."""

    size: int
    input_bytes: int
    figures: list[LayerMeasurement]
    runners: list[Runner]                     # the plain harness, then every layer
    whole: Runner                             # the unsplit model
    recomputing: list[Runner]                 # the checkpointed harness, then every layer; or none
    # The split harness, then every layer's split runner (None: the first layer's, which has
    # none); or nothing when the split is not timed.
    splitting: list[Runner | None]
    step: Timing = field(default_factory=lambda: Timing(0.0, 0.0))
    harness: Timing = field(default_factory=lambda: Timing(0.0, 0.0))
    recompute_harness: Timing | None = None
    split_harness: Timing | None = None

    @property
    def groups(self) -> list[list[Runner]]:
        split = [r for r in self.splitting if r is not None]
        return [self.runners, [self.whole]] + ([self.recomputing] if self.recomputing else []) + \
            ([split] if split else [])


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
    figures: list[LayerMeasurement] = []
    # The first runner times the harness itself around a trivial layer; see harness_runner.
    # Runner names carry the size: they are what the progress bar shows.
    runners: list[Runner] = [harness_runner(request.device, autocast)]
    # The same layers under checkpointing, as a third group of every round (same drift).
    recomputing: list[Runner] = [recompute_harness_runner(request.device, autocast)] if request.recompute else []
    # The same layers with the backward split, as a fourth group (same drift again).
    splitting: list[Runner | None] = [split_harness_runner(request.device, autocast)] if request.split_backward else []
    for i, (name, layer) in enumerate(model.layers):
        loss = (lambda outputs: model.loss(outputs, targets)) if i == last else None
        weighed, runner = prepare_layer(f"b={b} {name}", layer, layer_inputs[i], first=(i == 0), loss=loss,
                                        autocast=autocast)
        figures.append(weighed)
        runners.append(runner)
        if request.recompute:
            recomputing.append(recomputing_runner(f"b={b} {name} (recompute)", runner, layer, layer_inputs[i],
                                                  first=(i == 0), loss=loss, autocast=autocast))
        if request.split_backward:
            splitting.append(split_runner(f"b={b} {name} (split)", layer, layer_inputs[i], weighed, first=(i == 0),
                                          loss=loss, autocast=autocast))
    whole = model_step_runner(lambda: model.loss(model.forward(*inputs), targets), autocast)
    whole.name = f"b={b} {whole.name}"
    return _Size(b, tensor_bytes(inputs), figures, runners, whole, recomputing, splitting)


def _time_sizes(prepared: list[_Size], model: LayeredModel, request: ProfileRequest, progress: Progress) -> None:
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
        if p.splitting:
            split_harness, *split_timings = next(timed)
            p.split_harness = split_harness
            timings = iter(split_timings)
            for weighed, runner, (_, layer) in zip(p.figures, p.splitting[1:], model.layers):
                record_split(weighed, None if runner is None else next(timings), split_harness, has_weights(layer))
        if request.device.type == "cuda":
            _time_issue(p.figures, p.runners, request)
            for weighed, runner in zip(p.figures, p.runners[1:]):
                weighed.peak_transient_bytes = peak_transient_bytes(runner, request.device, weighed)


def _time_issue(figures: list[LayerMeasurement], runners: list[Runner], request: ProfileRequest) -> None:
    """CUDA: each layer's GPU time behind a backlog and the CPU's issue time (profiles/issue.py);
    ``runners``: the harness, then the layers of ``figures``."""
    from .issue import backlog_timings, cuda_backlog, record_issue

    harness, *timings = backlog_timings(runners, clock_for(request.device), cuda_backlog(request.device),
                                        request.warmup, request.repeats)
    record_issue(figures, timings, harness)


def _batch(model: LayeredModel, size: int, seed: int, device: torch.device) -> tuple[Tensors, torch.Tensor]:
    inputs, targets = model.synthetic_batch(size, torch.Generator().manual_seed(seed))
    return tuple(x.to(device) for x in inputs), targets.to(device)


def _checks_whole_model(request: ProfileRequest, model: LayeredModel) -> bool:
    if request.whole_model_check is not None:
        return request.whole_model_check
    return unique_bytes(model.module.parameters()) <= WHOLE_MODEL_CHECK_BYTES


@dataclass
class _Measured:
    """One measured layer: its figures at every size, the harnesses timed beside it, its optimizer step."""

    figures: list[LayerMeasurement]
    harness: list[Timing]
    recompute_harness: list[Timing]
    split_harness: list[Timing]         # empty for the first layer, which has no split runner
    optimizer_s: float


def _measure_layer(model: LayeredModel, i: int, inputs: list[Tensors], targets: list[torch.Tensor],
                   sizes: list[int], request: ProfileRequest, clock: Clock, progress: Progress) -> _Measured:
    """Time layer ``i`` at every size, real only meanwhile (see :func:`time_rounds` for the rounds).

    Per size, one group runs the harness and the layer (the harness is taken off the layer's
    times: per-call costs a stage pays once, not per layer); with recompute timing, a second
    group runs both again under checkpointing; with split-backward timing, a third runs both
    with the backward split in two.
    """
    name = model.layers[i][0]
    last = i == len(model.layers) - 1
    announce(f"measuring layer {i + 1} of {len(model.layers)}: {name}", key=name)
    autocast: Autocast = request.autocast
    with layer_materialized(model, i, request.device) as layer:
        figures: list[LayerMeasurement] = []
        plain: list[Runner] = []
        groups: list[list[Runner]] = []
        for b, xs, y in zip(sizes, inputs, targets):
            loss = (lambda outputs, y=y: model.loss(outputs, y)) if last else None
            weighed, runner = prepare_layer(f"b={b} {name}", layer, xs, first=(i == 0), loss=loss, autocast=autocast)
            figures.append(weighed)
            plain.append(runner)
            groups.append([harness_runner(request.device, autocast), runner])
            if request.recompute:
                groups.append([recompute_harness_runner(request.device, autocast),
                               recomputing_runner(f"b={b} {name} (recompute)", runner, layer, xs, first=(i == 0),
                                                  loss=loss, autocast=autocast)])
            if request.split_backward:
                split = split_runner(f"b={b} {name} (split)", layer, xs, weighed, first=(i == 0), loss=loss,
                                     autocast=autocast)
                if split is not None:
                    groups.append([split_harness_runner(request.device, autocast), split])
        timed = iter(time_rounds(groups, clock, request.warmup, request.repeats,
                                 after_run=lambda what: progress.step(what), warmup_s=request.warmup_duration_s))
        harnesses, recompute_harnesses, split_harnesses = [], [], []
        for weighed, runner in zip(figures, plain):
            harness, timing = next(timed)
            harnesses.append(harness)
            weighed.forward_s = max(0.0, timing.forward_s - harness.forward_s)
            weighed.backward_s = max(0.0, timing.backward_s - harness.backward_s)
            if request.recompute:
                recompute_harness, recomputed = next(timed)
                recompute_harnesses.append(recompute_harness)
                weighed.recompute_forward_s = max(0.0, recomputed.forward_s - recompute_harness.forward_s)
                weighed.recompute_backward_s = max(0.0, recomputed.backward_s - recompute_harness.backward_s)
            if request.split_backward:
                if i == 0:
                    record_split(weighed, None, None, has_weights(layer))
                else:
                    split_harness, split_timing = next(timed)
                    split_harnesses.append(split_harness)
                    record_split(weighed, split_timing, split_harness, has_weights(layer))
            if request.device.type == "cuda":
                _time_issue([weighed], [groups[0][0], runner], request)
                weighed.peak_transient_bytes = peak_transient_bytes(runner, request.device, weighed)
        del groups, plain, timed
        layer.zero_grad(set_to_none=True)   # gradients of the timing rounds: freed before the next layer
        progress.step(f"{name} optimizer step")
        optimizer_s = optimizer_step_s(distinct_parameters(layer.parameters()), clock, request.warmup, request.repeats)
    return _Measured(figures, harnesses, recompute_harnesses, split_harnesses, optimizer_s)


def _time_whole_model(model: LayeredModel, batches: list[tuple[Tensors, torch.Tensor]], sizes: list[int],
                      request: ProfileRequest, clock: Clock, progress: Progress) -> list[Timing]:
    """The unsplit model's training step at every size, in the same rounds; the model real meanwhile."""
    everything = range(len(model.layers))
    was_meta = [i for i in everything if any(p.is_meta for p in model.layers[i][1].parameters())]
    materialize_layers(model, everything, unused=True)
    model.to(request.device)
    groups = []
    for (inputs, targets), b in zip(batches, sizes):
        whole = model_step_runner(lambda inputs=inputs, targets=targets: model.loss(model.forward(*inputs), targets),
                                  request.autocast)
        whole.name = f"b={b} {whole.name}"
        groups.append([whole])
    timed = time_rounds(groups, clock, request.warmup, request.repeats,
                        after_run=lambda what: progress.step(what), warmup_s=request.warmup_duration_s)
    del groups
    model.module.zero_grad(set_to_none=True)
    release_layers(model, was_meta)
    return [step for (step,) in timed]


def _median_timing(timings: list[Timing]) -> Timing:
    """Each field's median over ``timings`` (the split halves too, when every one has them)."""
    def of(values: list[float | None]) -> float | None:
        return None if None in values else statistics.median(v for v in values if v is not None)

    return Timing(statistics.median(t.forward_s for t in timings), statistics.median(t.backward_s for t in timings),
                  backward_input_s=of([t.backward_input_s for t in timings]),
                  backward_weight_s=of([t.backward_weight_s for t in timings]))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _document(model: LayeredModel, request: ProfileRequest, sizes: list[int],
              per_size: list[list[LayerMeasurement]], steps: list[Timing] | None, harnesses: list[Timing],
              recompute_harnesses: list[Timing], split_harnesses: list[Timing], input_bytes: list[int],
              optimizer_s: list[float], link: dict[str, Any] | None) -> dict[str, Any]:
    layers = []
    modules = model.module_names()
    for i, (name, layer) in enumerate(model.layers):
        at = [figures[i] for figures in per_size]
        largest = at[-1]
        entry: dict[str, Any] = {
            "name": name,
            "module": modules[i],
            "forward_s": [f.forward_s for f in at],
            "backward_s": [f.backward_s for f in at],
            "activation_bytes": [f.activation_bytes for f in at],
            "output_bytes": [f.output_bytes for f in at],
            "param_bytes": unique_bytes(layer.parameters()),
            "buffer_bytes": unique_bytes(layer.buffers()),
            "optimizer_s": optimizer_s[i],
            "output_dtypes": largest.output_dtypes,
        }
        # What crosses the cut after this layer: per sample when it carries the batch, whole
        # when it is the same for every micro-batch (a table handed along): runtime/stage.py.
        batched = batch_dimensions(name, at[0].output_shapes, sizes[0], largest.output_shapes, sizes[-1])
        entry["output_shapes"] = [s[1:] if b else s for s, b in zip(largest.output_shapes, batched)]
        if not all(batched):
            entry["output_batched"] = batched
        if request.device.type == "cuda":
            entry["peak_transient_bytes"] = [f.peak_transient_bytes for f in at]
            if all(f.issue_forward_s is not None for f in at):
                entry["issue_forward_s"] = [f.issue_forward_s for f in at]
                entry["issue_backward_s"] = [f.issue_backward_s for f in at]
        if request.recompute:
            entry["recompute_forward_s"] = [f.recompute_forward_s for f in at]
            entry["recompute_backward_s"] = [f.recompute_backward_s for f in at]
        if request.split_backward:
            entry["backward_input_s"] = [f.backward_input_s for f in at]
            entry["backward_weight_s"] = [f.backward_weight_s for f in at]
            entry["weight_kept_bytes"] = [f.weight_kept_bytes for f in at]
        layers.append(entry)

    layer_sum = [sum(f.forward_s + f.backward_s for f in figures) for figures in per_size]
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
        "measurement": {"warmup": request.warmup, "repeats": request.repeats, "statistic": "median",
                        "timer": clock_for(request.device, request.threads).name, "seed": request.seed,
                        "harness_forward_s": [t.forward_s for t in harnesses],
                        "harness_backward_s": [t.backward_s for t in harnesses]},
        "tool": {"name": "gpipe-plan", "version": __version__, "torch": torch.__version__},
    }
    if steps is not None:
        model_step = [t.forward_s + t.backward_s for t in steps]
        doc["consistency"] = {
            "layer_sum_s": layer_sum,
            "model_step_s": model_step,
            "ratio": [s / m if m > 0 else None for s, m in zip(layer_sum, model_step)],
            "model_forward_s": [t.forward_s for t in steps],
            "model_backward_s": [t.backward_s for t in steps],
        }
    if recompute_harnesses:
        # The checkpoint wrapper's own cost, forward + backward, beyond the plain harness's.
        doc["recompute_call_s"] = [max(0.0, r.forward_s + r.backward_s - h.forward_s - h.backward_s)
                                   for r, h in zip(recompute_harnesses, harnesses)]
        doc["measurement"]["recompute_harness_forward_s"] = [t.forward_s for t in recompute_harnesses]
        doc["measurement"]["recompute_harness_backward_s"] = [t.backward_s for t in recompute_harnesses]
    if split_harnesses:
        doc["measurement"]["split_harness_backward_input_s"] = [t.backward_input_s for t in split_harnesses]
        doc["measurement"]["split_harness_backward_weight_s"] = [t.backward_weight_s for t in split_harnesses]
    if link is not None:
        doc["link"] = link
    tied = model.tied_parameters()
    if tied:
        doc["tied_parameters"] = tied
    return doc

