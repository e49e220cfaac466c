"""torch: a short training script that runs the plan with ``torch.distributed.pipelining``.

For a user who trains in their own loop. The script holds the plan's split twice:

- ``CHUNKS``: per chunk (torch's ``PipelineStage``, ``stage_index`` = chunk), the rank that
  holds it and its layers, which the script builds into one module per chunk and wraps in a
  ``PipelineStage`` with static shapes (from the plan: no shape inference, which deadlocks on
  gloo);
- ``SPLIT_SPEC``: the same cuts as module names for ``pipeline(model, mb_args,
  split_spec=...)``, for a model torch's tracer can capture (Hugging Face models cannot:
  use ``CHUNKS``), each ``SplitPoint.BEGINNING`` itself (torch's ``annotate_split_points``
  compares with the enum and refuses a string). Present only when every chunk starts at a
  named module.

and the schedule both ways: ``SCHEDULE_CSV``, the plan's very action lists, which
``_PipelineScheduleRuntime._load_csv`` runs (what the script uses: exactly what the planner
simulated), and ``SCHEDULE_CLASS``, torch's class for the schedule where one exists, with
``N_MICROBATCHES``. It trains with Adam (or the plan's optimizer) at a constant learning rate,
runs one replica of the pipeline (``data_parallel`` 1: the world size must be K), and with
``--save`` writes the unsplit model's ``state_dict``, as ``gpipe-plan run --save`` does.

**What it imports.** All of it is torch but three functions, ``build_layers()``, ``batches()``
and ``loss_fn()``, which import gpipe-plan: the model cut into the plan's layers (for a captured
model, by gpipe-plan's cut of the ``torch.export`` graph), at the initial parameters ``run``
starts from, its data and its loss, all from the plan's model spec; so the script trains as
``run`` does, first loss and all. Writing them out instead would make a second home for the
cut, the per-layer initialisation and the data. The script's docstring says so, and which of
the user's modules the spec imports through them; without gpipe-plan it stops at once in one
line; replace the three and it needs torch alone (tests/planner/export/test_export_targets.py runs both ways).
"""

from __future__ import annotations

import pprint

from ...artifacts import BadInput
from ...schedules import to_csv
from . import Exported
from .to_torchtitan import TORCH_SCHEDULE_CLASS
from ...plan_view import PlanView
from .view import model_name


def split_spec(view: PlanView) -> dict[str, str] | None:
    """``{module name: "BEGINNING"}`` at the first layer of every chunk after the first (the
    ``SplitPoint`` member's name: :func:`split_spec_source` writes the member); None when one of
    those layers is not a named module."""
    spec = {}
    for chunk in view.chunks[1:]:
        if chunk.modules[0] is None:
            return None
        spec[chunk.modules[0]] = "BEGINNING"
    return spec


def split_spec_source(spec: dict[str, str] | None) -> str:
    """The spec as the script's Python: ``{'blocks.2': SplitPoint.BEGINNING}``."""
    if spec is None:
        return "None"
    return "{" + ", ".join(f"{name!r}: SplitPoint.{point}" for name, point in spec.items()) + "}"


def chunk_table(view: PlanView) -> list[dict[str, object]]:
    """What the script needs of each chunk: its rank, layers, recomputation and the tensors it sends."""
    table = []
    for chunk in view.chunks:
        if chunk.output_shapes is None:
            raise BadInput(f"plan '{view.path}': chunk {chunk.index} has no output_shapes; the script gives torch "
                           f"static shapes: solve a profile that recorded them (format 5 or later)")
        shapes = [list(shape) for shape in chunk.output_shapes]
        table.append({"index": chunk.index, "rank": chunk.stage, "layers": list(chunk.layers),
                      "recompute": chunk.recompute, "output_shapes": shapes, "output_dtypes": list(chunk.output_dtypes),
                      "output_batched": list(chunk.output_batched or [True] * len(shapes))})
    return table


def export(view: PlanView, out: str) -> Exported:
    if view.model.get("source") not in ("builtin", "import"):
        raise BadInput(f"plan '{view.path}': the script builds the model from the plan's model spec, and a "
                       f"{view.model.get('source')} profile has none (its layers are only figures); export "
                       f"--to torchtitan, megatron or deepspeed from a profile of the model itself")
    if view.data_parallel != 1:
        notes = [f"the script runs one replica of the pipeline; the plan's {view.data_parallel} replicas need "
                 f"each stage's modules wrapped for data parallel (gpipe-plan run does it)"]
    else:
        notes = []
    if view.precision != "fp32":
        notes.append(f"the script trains in fp32; the plan was measured in {view.precision}")
    spec = split_spec(view)
    if spec is None:
        notes.append("SPLIT_SPEC is left out: a chunk starts at a layer that is not one module of the model; "
                     "CHUNKS says the split")
    schedule_class = TORCH_SCHEDULE_CLASS.get(view.schedule)
    text = TEMPLATE.format(
        model=model_name(view), plan=view.path, stages=view.num_stages, user_code=_user_code(view.model),
        spec=pprint.pformat(view.model, width=110, sort_dicts=False), chunks=pprint.pformat(chunk_table(view), indent=1, width=110, sort_dicts=False),
        split_spec=split_spec_source(spec),
        schedule=view.schedule, schedule_class=repr(schedule_class), csv=to_csv(view.actions()).strip(),
        micro_batches=view.micro_batches, micro_batch_size=view.micro_batch_size,
        batch=view.micro_batches * view.micro_batch_size, optimizer=repr(view.optimizer or "adam"))
    return Exported("torch", {out: text}, exact=True, notes=notes,
                    summary=f"torch: a script for torchrun --nproc-per-node {view.num_stages}, {len(view.chunks)} "
                            f"PipelineStages, {view.schedule} from its action lists, n_microbatches "
                            f"{view.micro_batches}")


def _user_code(model: dict[str, object]) -> str:
    """The sentence of the script's docstring naming the user's own modules the spec imports."""
    if model.get("source") != "import":
        return ""
    named = [f"{what} '{model[key]}'" for key, what in (("factory", "the model"), ("data", "the data"),
                                                         ("loss", "the loss")) if ":" in str(model.get(key) or "")]
    modules = sorted({str(model[key]).partition(":")[0] for key in ("factory", "data", "loss")
                      if ":" in str(model.get(key) or "")})
    return (f"\n  MODEL names your own code ({', '.join(named)}): gpipe-plan imports "
            f"{', '.join(repr(m) for m in modules)} from the current directory or PYTHONPATH.")


TEMPLATE = '''\
"""Train {model} as the gpipe-plan plan '{plan}' says, with torch.distributed.pipelining.

    torchrun --standalone --nproc-per-node {stages} THIS_FILE.py --steps 10 [--lr 1e-3] [--save model.pt]

Written by `gpipe-plan export --to torch`. What it imports, and why:

- torch: all of the script but the three functions below marked "yours" (a PipelineStage per
  chunk, the plan's schedule run by _PipelineScheduleRuntime, the optimizer, --save);
- gpipe_plan (gpipe-plan installed: pip install -e PATH_TO_GPIPE_PLAN), in those three only: build_layers() rebuilds the plan's
  model from MODEL, cut into the plan's layers at the parameters `gpipe-plan run` starts from;
  batches() gives its data, loss_fn() its loss. So this script trains as `gpipe-plan run` does.{user_code}
  Without gpipe_plan the script stops at once, saying so.

Bring your own model, data and loss by replacing the three: CHUNKS names the layers in order,
and nothing else then needs gpipe-plan.
"""

import argparse
import importlib
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, SplitPoint
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

MODEL = {spec}

# Chunk c is torch's PipelineStage with stage_index c, on the rank given; its layers in order.
CHUNKS = {chunks}

# The same cuts for pipeline(model, mb_args=..., split_spec=...) (SplitPoint.BEGINNING at each
# module), for a model torch's tracer can capture.
SPLIT_SPEC = {split_spec}

# The plan's schedule, {schedule}: its per-rank action lists ({{chunk}}{{F|B|I|W}}{{micro-batch}}), which
# _PipelineScheduleRuntime runs as they are; torch's own class for it (None: the CSV only).
SCHEDULE_CSV = """\\
{csv}
"""
SCHEDULE_CLASS = {schedule_class}
N_MICROBATCHES = {micro_batches}
MICRO_BATCH_SIZE = {micro_batch_size}
BATCH_SIZE = {batch}   # samples per step of the script's one pipeline: N_MICROBATCHES x MICRO_BATCH_SIZE
OPTIMIZER = {optimizer}


def build_layers(seed):
    """Yours: the unsplit model's layers, in order, as (name, module) pairs (each module called as
    layer(*tensors) returns a tuple of tensors), and the model (for batches() and loss_fn())."""
    model = gpipe_plan("gpipe_plan.models").build_model(MODEL, seed=seed)
    return model.layers, model


def batches(model, seed):
    """Yours: an object whose batch(step) gives step's (inputs, targets): the whole batch of the
    step, a tuple of input tensors and the targets, the same on every rank."""
    return gpipe_plan("gpipe_plan.runtime.data").batch_source(model, None, BATCH_SIZE, seed)


def loss_fn(model):
    """Yours: loss(outputs, targets), outputs the last chunk's tuple, the mean over the micro-batch."""
    return model.loss


def gpipe_plan(module):
    """gpipe-plan's module, or a one-line exit: what the three functions above need of it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"error: this script builds the plan's model, data and loss with gpipe-plan, which this "
                         f"Python cannot import ({{exc}}): install it (pip install -e PATH_TO_GPIPE_PLAN), or replace "
                         f"build_layers(), batches() and loss_fn() with your own") from None


class ChunkModule(nn.Module):
    """A run of layers called as chunk(*tensors) -> tuple of tensors."""

    def __init__(self, layers, recompute):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.recompute = recompute

    def run(self, *xs):
        for layer in self.layers:
            xs = layer(*xs)
        return xs

    def forward(self, *xs):
        if self.recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.run, *xs, use_reentrant=False)
        return self.run(*xs)


def examples(shapes, dtypes, batched, grad):
    """Tensors of the shapes crossing a cut, for one micro-batch (PipelineStage's static shapes)."""
    out = []
    for shape, dtype, with_batch in zip(shapes, dtypes, batched):
        full = [MICRO_BATCH_SIZE, *shape] if with_batch else list(shape)
        tensor = torch.zeros(full, dtype=getattr(torch, dtype))
        out.append(tensor.requires_grad_(grad and tensor.is_floating_point()))
    return tuple(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    # The model and data come before the process group: a rank that cannot build them exits in
    # one line on its own, instead of leaving a peer that is still joining the group to fail in
    # gloo's handshake (connectFullMesh: "connection closed by peer").
    torch.manual_seed(args.seed)
    try:
        layers, model = build_layers(args.seed)
        data = batches(model, args.seed)
    except Exception as exc:
        if type(exc).__name__ != "BadInput":   # gpipe-plan's one-line errors: a module it cannot import, ...
            raise
        raise SystemExit(f"error: {{exc}}") from None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != {stages}:
        raise SystemExit(f"this plan has {stages} stages: start it with torchrun --nproc-per-node {stages}")
    by_name = dict(layers)
    loss = loss_fn(model)
    inputs, _ = data.batch(0)
    first_input = tuple(x[:MICRO_BATCH_SIZE] for x in inputs)

    stages, modules = [], []
    for chunk in CHUNKS:
        if chunk["rank"] != rank:
            continue
        c = chunk["index"]
        module = ChunkModule([by_name[name] for name in chunk["layers"]], chunk["recompute"])
        if c == 0:
            input_args = first_input
        else:
            before = CHUNKS[c - 1]
            input_args = examples(before["output_shapes"], before["output_dtypes"], before["output_batched"], True)
        output_args = examples(chunk["output_shapes"], chunk["output_dtypes"], chunk["output_batched"], False)
        last = c == len(CHUNKS) - 1
        stages.append(PipelineStage(module, c, len(CHUNKS), torch.device("cpu"), input_args=input_args,
                                    output_args=output_args, output_grads=None if last else output_args,
                                    input_grads=None if c == 0 else input_args))
        modules.append(module)

    # The gradient of the step's mean loss: each micro-batch's loss / M, torch's own division off.
    def micro_batch_loss(outputs, targets):
        return loss(outputs if isinstance(outputs, tuple) else (outputs,), targets) / N_MICROBATCHES

    schedule = _PipelineScheduleRuntime(stages, N_MICROBATCHES, loss_fn=micro_batch_loss, scale_grads=False)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "schedule.csv")
        with open(path, "w") as f:
            f.write(SCHEDULE_CSV)
        schedule._load_csv(path)

    parameters = [p for m in modules for p in m.parameters()]
    # The plan's optimizer, as gpipe-plan run makes it (runtime/optim.py).
    make = {{"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
             "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)}}[OPTIMIZER]
    optimizer = make(parameters, lr=args.lr)
    holds_first = any(chunk["index"] == 0 and chunk["rank"] == rank for chunk in CHUNKS)
    holds_last = any(chunk["index"] == len(CHUNKS) - 1 and chunk["rank"] == rank for chunk in CHUNKS)
    for step in range(args.steps):
        inputs, targets = data.batch(step)
        losses = []
        schedule.step(*(inputs if holds_first else ()), target=targets if holds_last else None, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if holds_last:
            print(f"step {{step + 1}}: loss {{sum(float(x.detach()) for x in losses):.4f}}", flush=True)

    if args.save:
        mine = {{}}
        names = {{id(p): k for k, p in model.module.named_parameters()}}
        names.update({{id(b): k for k, b in model.module.named_buffers()}})
        for m in modules:
            for t in list(m.parameters()) + list(m.buffers()):
                mine[names[id(t)]] = t.detach().clone()
        pieces = [None] * world
        dist.all_gather_object(pieces, mine)
        if rank == 0:
            whole = {{}}
            for piece in pieces:
                whole.update(piece)
            torch.save({{k: whole[k] for k in model.module.state_dict() if k in whole}}, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''
