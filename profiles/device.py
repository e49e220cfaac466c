"""Which device to profile on, checked before anything is measured."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from ..artifacts import BadInput
from ..hostload import usable_cores


def resolve_device(text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` -> a device that exists here, or :class:`BadInput`."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise BadInput(f"--device '{text}' is not one of cpu, cuda, cuda:N")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BadInput(f"--device {text}: no CUDA GPU is available here (torch {torch.__version__}); "
                           f"use --device cpu")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise BadInput(f"--device {text}: there are only {torch.cuda.device_count()} GPUs (cuda:0 .. "
                           f"cuda:{torch.cuda.device_count() - 1})")
        device = torch.device("cuda", index)
    return device


def describe(device: torch.device, threads: int) -> dict[str, Any]:
    """The profile's ``device`` object: what the numbers were measured on."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "index": device.index,
                "memory_bytes": int(props.total_memory), "threads": threads}
    # Version 9: the CPUs this process may run on, which the ranks of a plan share (planner/timeshare.py).
    device = {"type": "cpu", "name": _cpu_name(), "threads": threads, "cores": usable_cores()}
    memory = host_memory_bytes()
    if memory is not None:   # version 9: the memory the plans' ranks share (planner/profile.py)
        device["memory_bytes"] = memory
    return device


def host_memory_bytes() -> int | None:
    """This host's memory: its RAM, or the container's limit (cgroup v2 ``memory.max``) if lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    return min(total, int(limit)) if limit.isdigit() else total


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
