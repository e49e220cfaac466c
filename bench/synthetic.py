"""Synthetic profiles for the planner's benchmarks: any number of layers, reproducible.

Layers look like a transformer's or a CNN's: a few kinds of layer repeat with some jitter,
each with a fixed launch cost plus work proportional to the micro-batch size, activations
and outputs proportional to it, and parameters of their own. The numbers are made up; what
matters for a solver benchmark is the size and the unevenness, not the model.
"""

from __future__ import annotations

import random
from typing import Any

from gpipe_plan.schema import FORMAT_VERSIONS, PROFILE_FORMAT


def synthetic_profile(layers: int, seed: int = 0, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                      optimizer: bool = True, link: bool = False) -> dict[str, Any]:
    rng = random.Random(seed)
    kinds = [  # (per-sample forward seconds, fixed seconds, backward/forward, activation, output, params)
        (2.0e-4, 2e-5, 2.0, 3.0e6, 1.0e6, 4e6),
        (6.0e-4, 3e-5, 2.1, 8.0e6, 1.0e6, 16e6),
        (1.0e-4, 1e-5, 1.6, 1.0e6, 1.0e6, 0.0),
        (3.0e-4, 2e-5, 2.4, 4.0e6, 2.0e6, 8e6),
    ]
    out = []
    for i in range(layers):
        per, fixed, ratio, act, outb, params = kinds[rng.randrange(len(kinds))]
        jitter = rng.uniform(0.7, 1.3)
        fwd = [fixed + per * jitter * b for b in sizes]
        layer: dict[str, Any] = {
            "name": f"layer{i}",
            "forward_s": fwd,
            "backward_s": [t * ratio for t in fwd],
            "activation_bytes": [int(act * jitter * b) for b in sizes],
            "output_bytes": [int(outb * b) for b in sizes],
            "param_bytes": int(params * jitter),
        }
        if optimizer:
            layer["optimizer_s"] = params * jitter * 3 / 20e9   # Adam: ~3 passes at 20 GB/s
        out.append(layer)
    doc: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "version": FORMAT_VERSIONS[PROFILE_FORMAT],
        "model": {"source": "synthetic", "name": f"synthetic{layers}", "seed": seed},
        "device": {"type": "gpu", "name": "synthetic", "threads": None},
        "micro_batch_sizes": list(sizes),
        "batch_size": sizes[-1],
        "input_bytes": [int(1e6 * b) for b in sizes],
        "layers": out,
    }
    if link:
        doc["link"] = {"backend": "synthetic", "bandwidth_bytes_per_s": 25e9, "latency_s": 2e-5}
    return doc
