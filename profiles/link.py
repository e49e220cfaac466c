"""The link between pipeline stages and between replicas: measured with a few processes.

Stages are processes that send activations forward and gradients back with
``torch.distributed`` (gloo between CPU processes, NCCL between GPUs). We start such processes,
bounce messages of several sizes between the first two (ping-pong: rank 0 sends, rank 1 sends
the same back), and take half the median round trip as the one-way time of that size. A
straight line through those points, ``time = latency + bytes / bandwidth``, fitted by least
squares, gives the two numbers the cost model uses for every cut.

Replicas of a stage (data parallel) average their gradients once a step with an all-reduce,
whose cost is not a point-to-point send: a ring all-reduce over d processes takes 2(d-1) steps
and moves 2(d-1)/d of the message through every process (the planner's
:func:`gpipe_plan.collectives.ring_allreduce_s`). So the same processes, all of them
(2 on the CPU; on CUDA every GPU of the machine, at most 8), also time ``dist.all_reduce`` of
several sizes, and the ring formula is fitted to those times: its latency is per ring step
and its bandwidth the *bus* bandwidth, the rate at which each process moves its share, so that
the planner's formula with these two figures gives back the measured times.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import ring_allreduce_s
from .spawn import run_workers

# Message sizes in bytes: from latency-bound (4 B) to bandwidth-bound. Between GPUs (NVLink
# moves hundreds of GB/s) a 16 MiB message is still partly latency, so CUDA goes to 256 MiB,
# the size of a large model's activations at a cut.
DEFAULT_SIZES = (4, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
CUDA_SIZES = DEFAULT_SIZES + (1 << 26, 1 << 28)
# All-reduce sizes: a stage's gradients are megabytes to gigabytes, so the bandwidth end
# matters most; fewer small sizes than the ping-pong (the intercept needs two or three), and
# on the CPU no more than 16 MiB, which gloo reduces in tens of milliseconds.
ALLREDUCE_SIZES = (4, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
CUDA_ALLREDUCE_SIZES = ALLREDUCE_SIZES + (1 << 26, 1 << 28)
# The most GPUs one all-reduce measurement uses: one node's worth on the common 8-GPU server,
# since the planner uses these figures for the syncs inside a node.
MAX_ALLREDUCE_PROCESSES = 8


def measure_link(device: torch.device, sizes: tuple[int, ...] | None = None, repeats: int = 20,
                 warmup: int = 3, timeout_s: float = 120.0, allreduce_sizes: tuple[int, ...] | None = None,
                 allreduce_repeats: int = 10) -> dict[str, Any]:
    """Latency and bandwidth between two processes on ``device``'s type, and of an all-reduce
    over all the processes measured: the profile's ``link``.

    On CUDA the processes use the profiled GPU and the next ones (``cuda:i``, ``cuda:i+1``, ...):
    all GPUs, at most :data:`MAX_ALLREDUCE_PROCESSES`; the ping-pong runs between the first two.
    On the CPU two processes do both. ``allreduce_sizes=()`` skips the all-reduce.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if sizes is None:
        sizes = CUDA_SIZES if device.type == "cuda" else DEFAULT_SIZES
    if allreduce_sizes is None:
        allreduce_sizes = CUDA_ALLREDUCE_SIZES if device.type == "cuda" else ALLREDUCE_SIZES
    first_gpu = (device.index or 0) if device.type == "cuda" else 0
    processes = min(torch.cuda.device_count(), MAX_ALLREDUCE_PROCESSES) if device.type == "cuda" else 2
    port = _free_port()
    measured = run_workers(_worker, processes,
                           (processes, port, backend, sizes, repeats, warmup, allreduce_sizes, allreduce_repeats,
                            first_gpu), timeout_s, f"measuring the link ({backend})")
    if not measured:
        raise RuntimeError(f"the {backend} processes measuring the link returned nothing")
    one_way, allreduce_s = measured[0]
    latency, bandwidth = fit_line(list(sizes), one_way)
    link: dict[str, Any] = {"backend": backend, "bandwidth_bytes_per_s": bandwidth, "latency_s": latency,
                            "message_bytes": list(sizes), "one_way_s": one_way}
    if device.type == "cuda":
        link["devices"] = [first_gpu, (first_gpu + 1) % torch.cuda.device_count()]
    if allreduce_sizes:
        ring_latency, bus_bandwidth = fit_ring(list(allreduce_sizes), allreduce_s, processes)
        link.update({"allreduce_bandwidth_bytes_per_s": bus_bandwidth, "allreduce_latency_s": ring_latency,
                     "allreduce_processes": processes, "allreduce_message_bytes": list(allreduce_sizes),
                     "allreduce_s": allreduce_s})
    return link


def fit_line(sizes: list[int] | list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares ``seconds = latency + size / bandwidth``; returns ``(latency, bandwidth)``.

    The latency is clamped at zero and, if the fit's slope is not positive (all messages
    equally fast), the bandwidth is infinite.
    """
    n = len(sizes)
    mean_x = sum(sizes) / n
    mean_y = sum(seconds) / n
    sxx = sum((x - mean_x) ** 2 for x in sizes)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds))
    slope = sxy / sxx if sxx else 0.0
    intercept = mean_y - slope * mean_x
    # The intercept of a fit dominated by large messages is noisy; the smallest message's
    # time is a direct measurement of latency and bounds it from above.
    latency = min(max(0.0, intercept), min(seconds))
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    return latency, bandwidth


def fit_ring(sizes: list[int], seconds: list[float], processes: int) -> tuple[float, float]:
    """The ring model fitted to all-reduce times over ``processes``: ``(latency per ring step,
    bus bandwidth)``, such that ``ring_allreduce_s(size, processes, bandwidth, latency)`` gives
    the measured times back (least squares).

    The ring formula is linear in the latency and in 1 / bandwidth, with coefficients that
    depend on ``processes`` only: ``steps`` (2(d-1)) per unit of latency, ``share`` (2(d-1)/d)
    of the message through each process. Both are read off the planner's one formula, so the
    fit and the planner cannot disagree (gpipe_plan/collectives.py). In terms of the bytes each process moves
    (``share * size``) the model is a straight line whose intercept is ``steps * latency`` and
    whose slope is ``1 / bandwidth``: :func:`fit_line` fits it.
    """
    if processes < 2:
        raise ValueError(f"an all-reduce fit needs at least 2 processes, got {processes}")
    steps = ring_allreduce_s(1, processes, float("inf"), 1.0)      # one byte at infinite bandwidth
    share = ring_allreduce_s(1, processes, 1.0, 0.0)               # one byte per second, no latency
    intercept, bandwidth = fit_line([share * size for size in sizes], seconds)
    return intercept / steps, bandwidth


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, processes: int, port: int, backend: str, sizes: tuple[int, ...], repeats: int, warmup: int,
            allreduce_sizes: tuple[int, ...], allreduce_repeats: int, first_gpu: int, results: Any) -> None:
    torch.set_num_threads(1)
    if backend == "gloo" and "lo" in {name for _, name in socket.if_nameindex()}:
        # The processes are on this machine: talk over loopback, whatever the hostname says.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=processes)
    device = (torch.device("cuda", (first_gpu + rank) % torch.cuda.device_count()) if backend == "nccl"
              else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        one_way = _ping_pong(rank, device, sizes, repeats, warmup)
        allreduce_s = [_allreduce_s(device, size, allreduce_repeats, warmup) for size in allreduce_sizes]
        if rank == 0:
            results.put((one_way, allreduce_s))
    finally:
        dist.destroy_process_group()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ping_pong(rank: int, device: torch.device, sizes: tuple[int, ...], repeats: int, warmup: int) -> list[float]:
    """One-way seconds per size between ranks 0 and 1 (half the median round trip); other
    ranks wait at the barrier that ends it."""
    one_way = []
    if rank < 2:
        for size in sizes:
            buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
            trips = []
            for r in range(warmup + repeats):
                _synchronize(device)
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)
                else:
                    dist.recv(buffer, 0)
                    dist.send(buffer, 0)
                _synchronize(device)
                if r >= warmup:
                    trips.append(time.perf_counter() - start)
            one_way.append(statistics.median(trips) / 2)
    _barrier(device)
    return one_way


def _allreduce_s(device: torch.device, size: int, repeats: int, warmup: int) -> float:
    """Median seconds of one ``all_reduce`` of ``size`` bytes, as this rank sees it.

    Every repeat starts from a barrier, so no process's lateness is counted as the collective's;
    on rank 0 (whose figure the profile keeps) the call returns once every process contributed.
    """
    buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
    times = []
    for r in range(warmup + repeats):
        _synchronize(device)
        _barrier(device)
        start = time.perf_counter()
        dist.all_reduce(buffer)
        _synchronize(device)
        if r >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _barrier(device: torch.device) -> None:
    """All processes meet (NCCL: on this process's GPU, which it would otherwise have to guess)."""
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
