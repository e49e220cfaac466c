"""torch.distributed.pipelining used by hand: what a user writes without gpipe-plan.

    python bench/torch_by_hand.py --model gpt --balance 3,3 --micro-batches 8 --batch 32 --steps 20

Two (or K) processes on gloo, one thread each, a split of the user's choosing (uniform by
default), ``PipelineStage`` with static shapes and ``ScheduleGPipe`` (or ``Schedule1F1B``),
Adam. None of gpipe-plan's runtime is used: only its model zoo, so that the model is the very
one ``gpipe-plan run`` trains. What a careful user has to get right:

- static metadata on every stage: ``input_args`` (requiring grad on every stage but the
  first), ``output_args``, ``output_grads`` (every stage but the last), ``input_grads``
  (every stage but the first); left to infer shapes, the stages deadlock on gloo;
- ``loss_fn`` given to the schedule on *every* rank (without it the first rank silently
  skips its backward).

The step time is rank 0's wall time from before ``schedule.step`` to after its optimizer step
(rank 0 runs the first forward and the last backward); prints one JSON line with the median
over the steps after the first, like ``gpipe-plan run``'s report.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

from gpipe_plan.models import build_model, model_spec  # noqa: E402


class Part(nn.Module):
    """A run of the model's layers; takes and returns what the layers pass on."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *xs: torch.Tensor):
        for layer in self.layers:
            xs = layer(*xs)
        return xs[0] if len(xs) == 1 else xs


def spec_of(args: argparse.Namespace) -> dict:
    options = json.loads(args.options) if args.options else {}
    return model_spec(args.model, **options)


def worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    K = len(args.balance)
    dist.init_process_group("gloo", rank=rank, world_size=K)
    model = build_model(spec_of(args), seed=args.seed)
    first = sum(args.balance[:rank])
    layers = [layer for _, layer in model.layers[first:first + args.balance[rank]]]
    part = Part(layers)
    b = args.batch // args.micro_batches
    # Static shapes: run the model once on one micro-batch to learn what crosses each cut.
    with torch.no_grad():
        inputs, _ = model.synthetic_batch(b, torch.Generator().manual_seed(0))
        xs = tuple(inputs)
        for _, layer in model.layers[:first]:
            xs = layer(*xs)
        stage_in = xs
        for layer in layers:
            xs = layer(*xs)
        stage_out = xs
    cpu = torch.device("cpu")

    def like(ts, grad):
        return tuple(torch.empty_like(t).requires_grad_(grad and t.is_floating_point()) for t in ts)

    is_first, is_last = rank == 0, rank == K - 1
    stage = PipelineStage(
        part, rank, K, cpu,
        input_args=like(stage_in, grad=not is_first),
        output_args=like(stage_out, grad=False) if len(stage_out) > 1 else like(stage_out, grad=False)[0],
        output_grads=None if is_last else like(stage_out, grad=False),
        input_grads=None if is_first else like(stage_in, grad=False),
    )

    def loss_fn(output, target):
        outs = output if isinstance(output, tuple) else (output,)
        return model.loss(outs, target)

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = kind(stage, args.micro_batches, loss_fn=loss_fn, scale_grads=True)
    optimizer = torch.optim.Adam(part.parameters(), lr=1e-3)
    times, losses = [], []
    dist.barrier()
    for step in range(args.steps):
        inputs, targets = model.synthetic_batch(args.batch, torch.Generator().manual_seed(args.seed * 100003 + step))
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        out: list = []
        if is_first:
            schedule.step(*inputs, target=targets if is_last else None, losses=out, return_outputs=False)
        else:
            schedule.step(target=targets if is_last else None, losses=out, return_outputs=False)
        optimizer.step()
        times.append(time.perf_counter() - started)
        if out:
            losses.append(float(sum(float(x) for x in out) / len(out)))
    dist.barrier()
    queue.put((rank, times, losses))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--options", default="", help="model options as JSON, e.g. '{\"layers\": 4}'")
    parser.add_argument("--balance", default="", help="layers per stage; default: uniform over --stages")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.balance:
        args.balance = [int(x) for x in args.balance.split(",")]
    else:
        L = len(build_model(spec_of(args)).layers)
        base, extra = divmod(L, args.stages)
        args.balance = [base + (1 if k < extra else 0) for k in range(args.stages)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(len(args.balance))]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, times, losses = queue.get(timeout=1800)
        got[rank] = (times, losses)
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"rank exited with {p.exitcode}")
    times = got[0][0]
    measured = times[1:] if len(times) > 1 else times
    last_losses = got[len(args.balance) - 1][1]
    result = {"balance": args.balance, "micro_batches": args.micro_batches, "batch": args.batch,
              "schedule": args.schedule, "steps": args.steps, "measured_step_s": statistics.median(measured),
              "step_s": times, "samples_per_s": args.batch / statistics.median(measured),
              "loss_first": last_losses[0] if last_losses else None,
              "loss_last": last_losses[-1] if last_losses else None}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
