"""Checkpoints: each stage saves its own part; a resumed run continues bit for bit.

Layout (one folder per saved step, one file per stage)::

    CHECKPOINT_DIR/
      step-00000040/
        stage-0-of-2.pt
        stage-1-of-2.pt
      step-00000060/
        ...

A stage's file holds what that rank needs to go on as if never stopped: its parameters and
buffers (under the whole model's ``state_dict`` keys), its optimizer's state, the fp16 loss
scale, the number of steps done, and the RNG state of the CPU and of this rank's own GPU
(restoring every GPU's would initialise a CUDA context on each of them, on every rank). The data needs no state: step s's batch is a function of the
seed and s (:mod:`.data`).

Each file is written to a temporary name and renamed, so a file that exists is complete. A
rank killed while saving leaves its stage's file of that step missing, never half-written.
On ``--resume`` the ranks agree on the newest step for which *every* stage has its file, so
a checkpoint only some stages finished is skipped. Nothing needs a shared file system: each
rank reads and writes only its own stage's files (on several machines, each machine keeps
the files of the stages it runs).
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..artifacts import BadInput, write_bytes_atomic
from .loss_scale import LossScaler
from .objects import all_gather_objects
from .stage import Stage

FORMAT = "gpipe-plan.checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"step-(\d{8})")
# Identity keys added after checkpoints existed, with the value every older checkpoint had.
_BEFORE_KEY: dict[str, Any] = {"precision": "fp32", "param_dtype": "fp32"}


def stage_file(folder: Path, step: int, stage: int, stages: int) -> Path:
    return folder / f"step-{step:08d}" / f"stage-{stage}-of-{stages}.pt"


def save(folder: Path, step: int, stage: Stage, optimizer: torch.optim.Optimizer, identity: dict[str, Any],
         scaler: LossScaler | None = None, device: torch.device | None = None) -> None:
    """Write this stage's checkpoint after ``step`` completed steps (atomically)."""
    path = stage_file(folder, step, stage.index, stage.num_stages)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = {"cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    state = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "stage": stage.index,
        "stages": stage.num_stages,
        "identity": identity,
        "model": {k: v.detach().cpu() for k, v in stage.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "rng": rng,
        "loss_scale": scaler.state_dict() if scaler is not None and scaler.enabled else None,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_bytes_atomic(path, buffer.getvalue())


def complete_steps(folder: Path, stage: int, stages: int) -> set[int]:
    """Steps for which this stage's file exists."""
    if not folder.is_dir():
        return set()
    steps = set()
    for child in folder.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and stage_file(folder, int(match.group(1)), stage, stages).is_file():
            steps.add(int(match.group(1)))
    return steps


def newest_common_step(folder: Path, stage: int, stages: int, group: dist.ProcessGroup | None) -> int | None:
    """The newest step every stage has a checkpoint of (ranks agree through ``group``)."""
    mine = complete_steps(folder, stage, stages)
    everyone = all_gather_objects(mine, group) if stages > 1 else [mine]
    common = set.intersection(*everyone) if everyone else set()
    return max(common) if common else None


def load(folder: Path, step: int, stage: Stage, optimizer: torch.optim.Optimizer, identity: dict[str, Any],
         scaler: LossScaler | None = None, device: torch.device | None = None) -> None:
    """Restore this stage's parameters, optimizer state, loss scale and RNG from step ``step``."""
    path = stage_file(folder, step, stage.index, stage.num_stages)
    try:
        # weights_only: a checkpoint is data; unpickling anything else could run code.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a file we did not write, or a torch that cannot read it
        raise BadInput(f"cannot read checkpoint '{path}': {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
        raise BadInput(f"'{path}' is not a gpipe-plan checkpoint of version {VERSION}")
    for key, value in identity.items():
        saved = state["identity"].get(key, _BEFORE_KEY.get(key))
        if saved != value:
            raise BadInput(f"checkpoint '{path}' was made with {key} = {saved!r}, this run has "
                           f"{value!r}: resume with the same plan split and options, or use a new --checkpoint-dir")
    stage.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and scaler.enabled and state.get("loss_scale"):
        scaler.load_state_dict(state["loss_scale"])
    torch.set_rng_state(state["rng"]["cpu"])
    cuda_state = state["rng"].get("cuda")
    if isinstance(cuda_state, list):   # older checkpoints held every GPU's state
        index = device.index if device is not None and device.index is not None else 0
        cuda_state = cuda_state[index] if index < len(cuda_state) else None
    if device is not None and device.type == "cuda" and isinstance(cuda_state, torch.Tensor):
        torch.cuda.set_rng_state(cuda_state, device)


def prune(folder: Path, keep: int, stage: int, stages: int) -> None:
    """Delete this stage's files but the newest ``keep`` (and step folders left empty)."""
    for step in sorted(complete_steps(folder, stage, stages))[:-keep]:
        path = stage_file(folder, step, stage, stages)
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()  # only once every stage's file is gone
        except OSError:
            pass
