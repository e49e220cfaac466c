"""One steady host allocator for every process that times or trains: profile's and run's.

[Note: glibc's moving mmap threshold]
On Linux, torch's CPU tensors come from glibc's ``malloc``. A block above the *mmap threshold*
is mapped fresh from the kernel and unmapped when freed, so each new one pays a page fault per
4 KiB page, zeroed; below it, blocks are reused from the heap. glibc moves that threshold as a
process runs (freeing a mapped block raises it to that block's size) and trims the heap's top
back to the kernel past ``M_TRIM_THRESHOLD``. Which allocations fault then depends on what the
process did before, not on the layer: in a profile of the built-in gpt at micro-batch sizes
2, 4 and 8 on the 2-core development VM, four identical blocks' forwards at size 8 read 2.9,
2.8, 3.1 and 4.3 ms and the head 1.0 ms; with the threshold fixed and trimming held back, 2.7,
2.6, 2.7, 2.9 and 0.6 ms (docs/benchmarks/fidelity.md). A run's stages, which allocate in
their own order, meet yet another history. The planner adds such times up across a stage, so
this noise is a systematic error in every plan.

Fixing both figures (:data:`SETTINGS`) ends the drift: blocks up to 32 MiB (glibc's largest
dynamic threshold) are reused from the heap once a step has run, and up to 256 MiB freed at
its top stays there. The cost is memory the process keeps between steps, at most the trim
threshold above its peak; nothing the planner counts, which is tensors' bytes.

Each process sets them for itself (``mallopt``, which takes effect at once) and in its
environment (``MALLOC_*_``, which glibc reads when a process starts), so that the processes it
starts (profile's probes, run's ranks) start the same way. A figure the user set in the
environment is kept. Elsewhere (macOS, musl, a preloaded jemalloc or tcmalloc, which do not
move a threshold) it does nothing. Pure Python, no torch.
"""

from __future__ import annotations

import ctypes
import os
import sys

# (mallopt parameter, environment variable, value): glibc's malloc.h numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
SETTINGS = ((M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 32 << 20),
            (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 256 << 20))


def steady_allocator() -> dict[str, int]:
    """Fix glibc's mmap and trim thresholds in this process and the ones it starts (the
    module's note); returns what is in force by variable name (empty where nothing applies)."""
    if not sys.platform.startswith("linux") or _preloaded_allocator():
        return {}
    libc = _glibc()
    if libc is None:
        return {}
    applied = {}
    for parameter, variable, value in SETTINGS:
        chosen = os.environ.get(variable)
        try:
            value = int(chosen) if chosen is not None else value
        except ValueError:
            continue                  # the user's own figure, which glibc reads as it will
        try:
            accepted = libc.mallopt(parameter, value) == 1
        except ctypes.ArgumentError:  # a figure beyond a C int
            continue
        if accepted:
            os.environ.setdefault(variable, str(value))
            applied[variable] = value
    return applied


def _glibc():
    """glibc's handle, or None where the C library is another (only glibc has
    ``gnu_get_libc_version``). The process's own symbols (``CDLL(None)``) hold the C library it
    runs on, without ``ctypes.util.find_library``, which starts ``ldconfig`` to find it."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


def _preloaded_allocator() -> bool:
    preload = os.environ.get("LD_PRELOAD", "")
    return any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc"))
