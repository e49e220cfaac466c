"""The link between two pipeline stages: latency and bandwidth, measured with two processes.

Stages are processes that send activations forward and gradients back with
``torch.distributed`` (gloo between CPU processes, NCCL between GPUs). We start two such
processes, bounce messages of several sizes between them (ping-pong: rank 0 sends, rank 1
sends the same back), and take half the median round trip as the one-way time of that size.
A straight line through those points, ``time = latency + bytes / bandwidth``, fitted by least
squares, gives the two numbers the cost model uses for every cut.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from .spawn import run_workers

# Message sizes in bytes: from latency-bound (4 B) to bandwidth-bound. Between GPUs (NVLink
# moves hundreds of GB/s) a 16 MiB message is still partly latency, so CUDA goes to 256 MiB,
# the size of a large model's activations at a cut.
DEFAULT_SIZES = (4, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
CUDA_SIZES = DEFAULT_SIZES + (1 << 26, 1 << 28)


def measure_link(device: torch.device, sizes: tuple[int, ...] | None = None, repeats: int = 20,
                 warmup: int = 3, timeout_s: float = 120.0) -> dict[str, Any]:
    """Latency and bandwidth between two processes on ``device``'s type: the profile's ``link``.

    On CUDA the two processes use the profiled GPU and the next one (``cuda:i``, ``cuda:i+1``).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if sizes is None:
        sizes = CUDA_SIZES if device.type == "cuda" else DEFAULT_SIZES
    first_gpu = (device.index or 0) if device.type == "cuda" else 0
    port = _free_port()
    measured = run_workers(_worker, 2, (port, backend, sizes, repeats, warmup, first_gpu), timeout_s,
                           f"measuring the link ({backend})")
    if not measured:
        raise RuntimeError(f"the two {backend} processes measuring the link returned nothing")
    one_way = measured[0]
    latency, bandwidth = fit_line(list(sizes), one_way)
    link: dict[str, Any] = {"backend": backend, "bandwidth_bytes_per_s": bandwidth, "latency_s": latency,
                            "message_bytes": list(sizes), "one_way_s": one_way}
    if device.type == "cuda":
        link["devices"] = [first_gpu, (first_gpu + 1) % torch.cuda.device_count()]
    return link


def fit_line(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, backend: str, sizes: tuple[int, ...], repeats: int, warmup: int,
            first_gpu: int, results: Any) -> None:
    torch.set_num_threads(1)
    if backend == "gloo" and "lo" in {name for _, name in socket.if_nameindex()}:
        # Both processes are on this machine: talk over loopback, whatever the hostname says.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    device = (torch.device("cuda", (first_gpu + rank) % torch.cuda.device_count()) if backend == "nccl"
              else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    one_way = []
    try:
        for size in sizes:
            buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
            trips = []
            for r in range(warmup + repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)
                else:
                    dist.recv(buffer, 0)
                    dist.send(buffer, 0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if r >= warmup:
                    trips.append(time.perf_counter() - start)
            one_way.append(statistics.median(trips) / 2)
        if rank == 0:
            results.put(one_way)
    finally:
        dist.destroy_process_group()
