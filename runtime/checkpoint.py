"""Checkpoints keyed like the unsplit model, so that a run resumes under another plan.

Each saved step is one ``torch.distributed.checkpoint`` (DCP) checkpoint, written by all ranks
together::

    CHECKPOINT_DIR/
      step-00000040/
        checkpoint.json        what was saved, by which plan, with which identity (rank 0)
        .metadata              DCP's index: every tensor's key, shape, dtype and file (rank 0)
        __0_0.distcp           rank 0's tensors
        __1_0.distcp           rank 1's tensors
      step-00000060/
        ...

The tensors are named after the unsplit model, never after a stage:

- ``model/<key>``: a parameter or buffer, ``<key>`` as in the unsplit model's ``state_dict``;
- ``optim/<key>/<name>``: the optimizer's per-parameter state (``exp_avg``, ``exp_avg_sq``,
  ``step`` for Adam, ``momentum_buffer`` for momentum), ``<key>`` the parameter's unsplit key;
  a state kept as a Python number would be saved as a 0-dimensional tensor (Adam's ``step`` is one);
- ``rng/rank-<r>/cpu`` (and ``.../cuda``): rank r's random number generator states.

So a checkpoint does not know how the model was split. A rank that resumes asks DCP for the
keys *its* stage holds, under *its* plan, and DCP reads them from whichever rank's file holds
them: a run saved by 2 stages holding 2 + 2 layers resumes on 1 stage, or on 2 holding 1 + 3.
Adam, SGD and momentum are per-parameter rules, so per-parameter state moves with its
parameter and the resumed run steps as the uninterrupted one would.

With d replicas (data parallel) every rank saves its stage's keys: under ``ddp`` the d
replicas of a stage hold the same tensors, and DCP's planner writes each replicated key once;
under ``fsdp`` the parameters and their optimizer state are DTensors, each rank holding a
shard, which DCP saves and loads shard by shard (a state shaped like its parameter is loaded
into a DTensor laid out like it). Either way the keys are the unsplit model's, so a checkpoint
resumes under any d, either sync, or any split. RNG states stay per rank.

Under ``localsgd`` the replicas of a stage hold their own weights between two averagings, and a
resumed run must go on from each replica's own: replica 0 saves under the plain keys (what any
other run resumes), and replica r > 0 under ``replica-<r>/model/<key>`` and
``replica-<r>/optim/<key>/<name>`` (its ``prefix``, :meth:`.gradient_sync.GradientSync.checkpoint_prefix`).
A replica that resumes loads its own keys where the checkpoint has them (a localsgd run of at
least as many replicas saved it), else replica 0's plain ones.

What is not a tensor sits in ``checkpoint.json``: the number of steps done, the fp16 loss scale
(the same on every stage), the identity the resuming run must match, and the plan that saved it.

Completeness: DCP writes into ``step-XXXXXXXX.partial/``; when every rank has written its
tensors (DCP's save returns on all ranks only after rank 0 wrote ``.metadata``), rank 0 writes
``checkpoint.json`` and renames the folder to ``step-XXXXXXXX``. A rename is atomic, so a step
folder that exists is complete; a step some rank never finished stays ``.partial`` and is never
resumed. Rank 0 picks the newest complete step and every rank must see it: resharding means any
rank may read any rank's file, so on several machines the folder must be on a shared file system.
A save that fails (a full disk) removes its ``.partial`` folder and stops every rank in one line.

Whose steps they are, which a run may prune, and the one run that may write the folder at a
time: :mod:`.checkpoint_dir` (no torch there, so the launcher checks the folder first).

A checkpoint is data: DCP reads its tensors with ``torch.load(weights_only=True)`` and its
``.metadata`` with a plain ``pickle.load``, which could run code, so :func:`safe_reader` reads
``.metadata`` with an unpickler that builds only DCP's own records.

``torch.distributed.checkpoint`` is imported when a checkpoint is saved or loaded, not with this
module: it costs every rank about 0.6 s at start, and most runs never checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import errno
import hashlib
import importlib
import json
import os
import pickle
import shutil
import zlib
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import torch
import torch.distributed as dist

from ..artifacts import BadInput, fsync_folder, named_first_line, write_json_atomic
from ..units import format_bytes
from .checkpoint_dir import (META_FILE, check_still_held, complete_steps, partial_folder,  # noqa: F401
                             prune, step_folder)   # (prune: train's)
from .p2p import PeerLost, looks_like_lost_peer
from . import watchdog
from .loss_scale import LossScaler
from .objects import all_gather_objects
from .stage import StageChunks

FORMAT = "gpipe-plan.checkpoint"
# Version 2: one DCP checkpoint per step, keyed like the unsplit model (resumable under any
# plan). Version 1 wrote one torch.save file per stage (step-N/stage-k-of-K.pt); it is refused.
# ``run`` (the run the step belongs to: runtime/checkpoint_dir.py) was added within version 2;
# a step without it belongs to the run that resumes it. So were localsgd's ``replica-<r>/`` keys:
# a reader that does not ask for them resumes every replica from replica 0's plain keys.
VERSION = 2


# ---------------------------------------------------------------------- saving
def save(folder: Path, step: int, stage: StageChunks, optimizer: torch.optim.Optimizer, identity: dict[str, Any],
         saved_by: dict[str, Any], scaler: LossScaler | None = None, device: torch.device | None = None,
         group: dist.ProcessGroup | None = None, run: dict[str, Any] | None = None, prefix: str = "",
         lock: tuple[int, int] | None = None) -> Path:
    """Save the state after ``step`` completed steps; every rank calls this, together.

    ``run``: the record of the run this step belongs to (:func:`.checkpoint_dir.new_run`).
    ``prefix``: before this rank's ``model/`` and ``optim/`` keys ("" but for localsgd's replicas r > 0).
    ``lock``: the folder's lock as the run took it (:func:`.checkpoint_dir.lock_identity`): a
    folder that lost it is refused (:func:`.checkpoint_dir.check_still_held`).
    Returns the complete step folder once every rank has written (on every rank). Weights or
    optimizer state holding a NaN or an infinity are not saved (:func:`_refuse_non_finite`). A
    save that fails (a full disk) leaves no ``.partial`` folder and raises :class:`BadInput` on every rank,
    in one line that names the folder and, for a full disk, the lack of space; a rank lost
    meanwhile is :class:`.p2p.PeerLost` (the launcher names the rank that went).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    rank = _rank(group)
    partial, final = partial_folder(folder, step), step_folder(folder, step)
    together = f"saving checkpoint '{final}' with the other ranks"
    watchdog.doing(together, waiting=True)
    if rank == 0:
        check_still_held(folder, lock, step)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # what a killed run left at this step
    _barrier(group)  # nobody writes into the folder before rank 0 has emptied it
    tensors = {f"{prefix}model/{key}": tensor.detach() for key, tensor in stage.state_dict().items()}
    tensors |= {prefix + name: tensor for name, tensor in _optimizer_tensors(stage, optimizer).items()}
    _refuse_non_finite(folder, step, tensors, group)
    tensors |= _rng_tensors(rank, device)

    class Writer(dcp.FileSystemWriter):
        """DCP's writer, telling the watchdog when this rank writes and when it waits for the others,
        and handing DCP the operating system's error of a failed write (:func:`_os_error`): DCP
        sends every rank's failure to every rank pickled, which keeps an ``OSError``'s errno but
        drops the ``__context__`` where torch's ``unexpected pos 704 vs 598`` hides it."""

        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            watchdog.doing(f"writing its tensors into '{partial}'")
            try:
                return super().write_data(*args, **kwargs)
            except Exception as exc:
                cause = _os_error(exc)
                if cause is None or cause is exc:
                    raise
                raise OSError(cause.errno, cause.strerror, cause.filename) from None
            finally:
                watchdog.doing(together, waiting=True)

    try:
        # DCP gathers every rank's failure and raises it on all of them (CheckpointException is a
        # BaseException: an `except Exception` would let it through as a 50-line traceback).
        dcp.save(tensors, storage_writer=Writer(partial), process_group=group, no_dist=not _distributed())
        # Each rank's files' checksums, which a resume checks: DCP reads damaged bytes as numbers.
        watchdog.doing(f"checksumming its tensors in '{partial}'")
        mine = {path.name: _crc32(path) for path in sorted(partial.glob(f"__{rank}_*.distcp"))}
        watchdog.doing(together, waiting=True)
        files: dict[str, int] = {}
        for theirs in (all_gather_objects(mine, group) if _world_size(group) > 1 else [mine]):
            files.update(theirs)
        if rank == 0:
            write_json_atomic(partial / META_FILE, {
                "format": FORMAT, "version": VERSION, "step": step, "identity": identity, "saved_by": saved_by,
                "run": run, "loss_scale": scaler.state_dict() if scaler is not None and scaler.enabled else None,
                "files_crc32": files})
            _replace_folder(partial, final)
    except (Exception, CheckpointException) as exc:
        lost = [e for e in ([error for _, error in _failures(exc)] or [exc]) if looks_like_lost_peer(e)]
        failure = _save_failure(exc, partial, sum(_nbytes(t) for t in tensors.values()))   # the space still taken
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if lost:   # a rank went away mid-save (killed): its own failure is the news, not this save's
            raise PeerLost(f"cannot save checkpoint '{partial}': {named_first_line(lost[0])}") from None
        raise failure from None
    _barrier(group)  # every rank returns knowing the step is complete
    return final


def _save_failure(exc: BaseException, partial: Path, nbytes: int) -> BadInput:
    """One line for a failed save: no space (torch says only ``unexpected pos 704 vs 598``), or
    the first rank's error."""
    if isinstance(exc, BadInput):   # rank 0's checkpoint.json (artifacts.cannot_write said why)
        return BadInput(f"{exc}; removed the unfinished '{partial}'")
    inner = [_os_error(error) or error for _, error in _failures(exc)] or [_os_error(exc) or exc]
    codes = {e.errno for e in inner if isinstance(e, OSError)}
    free = shutil.disk_usage(partial.parent).free if partial.parent.exists() else None
    removed = f"removed the unfinished '{partial.name}'"
    if errno.EDQUOT in codes:
        return BadInput(f"cannot save checkpoint '{partial.parent}': over the disk quota of its file system "
                        f"(this rank's tensors alone take {format_bytes(nbytes)}); {removed}; free some of your "
                        f"space there (or raise the quota) or choose another --checkpoint-dir, then --resume")
    if errno.EFBIG in codes:
        return BadInput(f"cannot save checkpoint '{partial.parent}': File too large, over {_largest_file()} "
                        f"(this rank's tensors take {format_bytes(nbytes)}); {removed}; raise that limit or choose "
                        f"another --checkpoint-dir, then --resume")
    if errno.ENOSPC in codes or (free is not None and free < nbytes):
        return BadInput(f"cannot save checkpoint '{partial.parent}': no space left on its device "
                        f"({format_bytes(free)} free, this rank's tensors alone take {format_bytes(nbytes)}); "
                        f"{removed}; free some space or choose another --checkpoint-dir, then --resume")
    return BadInput(f"cannot save checkpoint '{partial}': {named_first_line(inner[0])}; removed the unfinished "
                    f"folder")


def _os_error(exc: BaseException) -> OSError | None:
    """The operating system's error behind ``exc``: itself, or one it was raised from or while handling.

    torch's writer turns a failed write into ``RuntimeError: unexpected pos 704 vs 598``; the
    write's own ``OSError`` (which says *why*: no space, a quota, a size limit) survives only as
    that error's ``__context__``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _largest_file() -> str:
    """What refused a file too large: this process's ``ulimit -f`` if it has one, else the file system."""
    import resource

    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY:
        return f"this process's file-size limit, ulimit -f {format_bytes(limit)}"
    return "the largest file its file system allows"


def _refuse_non_finite(folder: Path, step: int, tensors: dict[str, torch.Tensor],
                       group: dist.ProcessGroup | None) -> None:
    """Refuse, on every rank alike, to save weights or optimizer state holding a NaN or an infinity.

    A learning rate far too high can leave a step's loss finite and its update infinite: the
    run stops only at the next step's loss, and a checkpoint saved in between holds the
    diverged weights. It would be the newest, which ``--resume`` picks (lowering ``--lr`` then
    meets a NaN at once), and pruning would delete the last good one to make room for it. So
    the step is not saved, the older ones stay, and the line says where to go on from.
    """
    from ..artifacts import RunFailure

    mine = next((name for name, tensor in tensors.items() if _non_finite(tensor)), None)
    found = all_gather_objects(mine, group) if _world_size(group) > 1 else [mine]
    bad = [(rank, name) for rank, name in enumerate(found) if name]
    if not bad:
        return
    rank, name = bad[0]
    older = sorted(s for s in complete_steps(folder) if s < step)
    kept = f"the newest checkpoint, step {older[-1]}, is kept" if older else "no checkpoint was saved before it"
    raise RunFailure(f"the weights are not finite after step {step} ('{name}' on rank {rank} holds a NaN or an "
                     f"infinity): training diverged in that step's update, so step {step} was not saved and "
                     f"{kept}; lower --lr or set --grad-clip, then --resume")


def _non_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds a NaN or an infinity (fsdp's DTensor: this rank's shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.is_floating_point() and local.numel() > 0 and not bool(torch.isfinite(local).all())


def _failures(exc: BaseException) -> list[tuple[int, BaseException]]:
    """The per-rank errors inside DCP's ``CheckpointException`` (rank order); [] for any other error."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [(rank, pair[0] if isinstance(pair, tuple) else pair) for rank, pair in sorted(failures.items())]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _optimizer_tensors(stage: StageChunks, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``optim/<unsplit key>/<name>`` for every per-parameter state; numbers become 0-d tensors."""
    out: dict[str, torch.Tensor] = {}
    for key, param in stage.named_parameters():
        for name, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{key}/{name}"] = value.detach()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"optim/{key}/{name}"] = torch.tensor(value)
    return out


def _rng_tensors(rank: int, device: torch.device | None) -> dict[str, torch.Tensor]:
    # This rank's own GPU only: reading every GPU's state would open a CUDA context on each.
    out = {f"rng/rank-{rank}/cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        out[f"rng/rank-{rank}/cuda"] = torch.cuda.get_rng_state(device)
    return out


def _replace_folder(partial: Path, final: Path) -> None:
    """Rename ``partial`` to ``final``; a folder already there (an older run's) is set aside first."""
    if final.exists():
        aside = final.with_name(final.name + ".replaced")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(partial, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(partial, final)
    fsync_folder(final.parent)


# ---------------------------------------------------------------------- finding
def newest_complete_step(folder: Path, group: dist.ProcessGroup | None = None) -> int | None:
    """The step to resume from: rank 0's newest complete one, which every rank must see."""
    mine = complete_steps(folder)
    everyone = all_gather_objects(mine, group) if _world_size(group) > 1 else [mine]
    if not everyone[0]:
        return None
    newest = max(everyone[0])
    blind = [rank for rank, seen in enumerate(everyone) if newest not in seen]
    if blind:
        raise BadInput(f"rank(s) {', '.join(map(str, blind))} cannot see checkpoint '{step_folder(folder, newest)}': "
                       f"every rank reads the whole checkpoint folder, so across machines put --checkpoint-dir on "
                       f"a shared file system")
    if everyone[0][newest] != VERSION:
        raise BadInput(f"checkpoint '{step_folder(folder, newest)}' is of version 1 (one file per stage), which this "
                       f"gpipe-plan cannot resume: start again with a new --checkpoint-dir, or finish the run with "
                       f"the gpipe-plan version that wrote it")
    return newest


# ---------------------------------------------------------------------- loading
def load(folder: Path, step: int, stage: StageChunks, optimizer: torch.optim.Optimizer, identity: dict[str, Any],
         seed: int, scaler: LossScaler | None = None, device: torch.device | None = None,
         group: dist.ProcessGroup | None = None, layout: tuple[int, int] | None = None,
         prefix: str = "") -> dict[str, Any]:
    """Restore this stage's parameters, buffers and optimizer state, the loss scale and the RNG.

    ``prefix``: this rank's own keys (localsgd's replica r > 0), read where the checkpoint has
    them, else the plain keys (replica 0's).

    Every rank calls this, together. Returns the checkpoint's ``checkpoint.json``, and under
    ``"rng"`` whether the generators were ``"restored"`` (the same ranks, each the same stage
    of the same replica: ``layout`` is this run's (stages, data parallel)) or ``"reseeded"``
    (any other layout: rank r seeds from (seed, step, r), :func:`reseed`).
    """
    path = step_folder(folder, step)
    try:
        meta = read_meta(path)
        reader = safe_reader(path)
        entries = reader.metadata().state_dict_metadata
    except Unreadable as exc:
        raise _damaged(folder, step, exc.detail) from None
    for key, value in identity.items():
        saved = meta.get("identity", {}).get(key)
        if saved != value:
            raise BadInput(f"checkpoint '{path}' was made with {key} = {saved!r}, this run has {value!r}: resume "
                           f"with the same {key}, or use a new --checkpoint-dir")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    rank, ranks = _rank(group), _world_size(group)

    # What this rank asks DCP for: its stage's tensors, under the unsplit model's keys.
    state = stage.state_dict()
    if prefix and not all(f"{prefix}model/{key}" in entries for key in state):
        prefix = ""    # saved without this replica's own weights: it starts from replica 0's
    wanted = {f"{prefix}model/{key}": tensor for key, tensor in state.items()}
    for name, tensor in wanted.items():
        saved_entry = entries.get(name)
        if not isinstance(saved_entry, TensorStorageMetadata):
            raise BadInput(f"checkpoint '{path}' has no '{name}': it was saved from another model; "
                           f"use a new --checkpoint-dir")
        if tuple(saved_entry.size) != tuple(tensor.shape):
            raise BadInput(f"checkpoint '{path}': '{name}' is {list(saved_entry.size)} there but "
                           f"{list(tensor.shape)} in this model; use a new --checkpoint-dir")
    # The optimizer's state does not exist before its first step: make tensors of the saved shapes.
    # Indices are the parameters' places in the optimizer (stage.parameters()' order), as torch's
    # Optimizer.load_state_dict expects them.
    index_of = {key: index for index, (key, _) in enumerate(stage.named_parameters())}
    param_of = dict(stage.named_parameters())
    optim_state: dict[int, dict[str, torch.Tensor]] = {}
    for name, entry in entries.items():
        root = f"{prefix}optim/"
        if not name.startswith(root) or "/" not in name[len(root):] or \
                not isinstance(entry, TensorStorageMetadata):
            continue
        key, state_name = name[len(root):].rsplit("/", 1)
        if key in index_of:
            tensor = _state_like(param_of[key], tuple(entry.size), entry.properties.dtype)
            optim_state.setdefault(index_of[key], {})[state_name] = wanted[name] = tensor
    saved = meta.get("saved_by", {})
    # Rank r's generator belongs to the stage and replica r ran: the same count of ranks under
    # another K x d gives r another (stage, replica), so only the same layout restores it.
    restore_rng = saved.get("ranks") == ranks and (
        layout is None or (saved.get("stages"), saved.get("data_parallel", 1)) == layout)
    rng_keys = [f"rng/rank-{rank}/cpu"] + ([f"rng/rank-{rank}/cuda"] if device is not None and device.type == "cuda"
                                           else [])
    if restore_rng:
        for name in rng_keys:
            entry = entries.get(name)
            if isinstance(entry, TensorStorageMetadata):
                wanted[name] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)

    _check_files(folder, step, meta, rank, ranks, group)
    try:
        dcp.load(wanted, storage_reader=reader, process_group=group, no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a damaged file: one line, whatever DCP raised
        raise _damaged(folder, step, exc) from None

    # torch's own loader puts each state where its parameter is, in its dtype (``step`` stays put).
    optimizer.load_state_dict({"state": optim_state, "param_groups": optimizer.state_dict()["param_groups"]})
    if scaler is not None and scaler.enabled and meta.get("loss_scale"):
        scaler.load_state_dict(meta["loss_scale"])
    if restore_rng and f"rng/rank-{rank}/cpu" in wanted:
        torch.set_rng_state(wanted[f"rng/rank-{rank}/cpu"])
        if f"rng/rank-{rank}/cuda" in wanted and device is not None:
            torch.cuda.set_rng_state(wanted[f"rng/rank-{rank}/cuda"], device)
        meta["rng"] = "restored"
    else:
        reseed(seed, step, rank)
        meta["rng"] = "reseeded"
    return meta


def _crc32(path: Path) -> int:
    """The file's CRC-32, read in 16 MiB pieces (a check against damage, not against tampering)."""
    value = 0
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            value = zlib.crc32(piece, value)
    return value


def _check_files(folder: Path, step: int, meta: dict[str, Any], rank: int, ranks: int,
                 group: dist.ProcessGroup | None) -> None:
    """Refuse a step whose tensor files are not what was saved (their ``files_crc32`` in
    ``checkpoint.json``; a step saved before it has none and is not checked), on every rank.

    Each rank checks a share of the files; all learn the first damaged one."""
    recorded = meta.get("files_crc32")
    if not isinstance(recorded, dict):
        return
    path = step_folder(folder, step)
    watchdog.doing(f"checking the checksums of '{path}'")
    bad = None
    for i, (name, crc) in enumerate(sorted(recorded.items())):
        if i % ranks == rank and bad is None:
            try:
                found = _crc32(path / name)
            except OSError as exc:
                bad = f"{name}: {named_first_line(exc)}"
                continue
            if found != crc:
                bad = f"{name} is not the file that was saved (its checksum differs)"
    found_bad = [b for b in (all_gather_objects(bad, group) if ranks > 1 else [bad]) if b]
    if found_bad:
        raise _damaged(folder, step, found_bad[0])


def _damaged(folder: Path, step: int, exc: BaseException | str) -> BadInput:
    """One line for a step that cannot be read (its tensors, its index, its ``checkpoint.json``):
    which file, what DCP said (or ``exc``, said already), and the way on."""
    failures = _failures(exc) if isinstance(exc, BaseException) else []
    detail = (f"rank {failures[0][0]}: {named_first_line(failures[0][1])}" if failures
              else named_first_line(exc) if isinstance(exc, BaseException) else exc)
    older = sorted(s for s in complete_steps(folder) if s < step)
    way = (f"move '{step_folder(folder, step).name}' out of the folder to resume from step {older[-1]}, the newest "
           f"complete step before it" if older else "start over in an empty --checkpoint-dir")
    return BadInput(f"cannot read checkpoint '{step_folder(folder, step)}' (damaged?): {detail}; {way}")


def _state_like(param: torch.Tensor, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor for a saved optimizer state of ``param``, for DCP to load into.

    A state shaped like its parameter takes the parameter's layout: under fsdp the parameter
    is a DTensor holding 1/d of it, and so is its state (``exp_avg``), so DCP loads only this
    replica's shard. Any other state (Adam's 0-d ``step``) is a plain tensor of the saved size.
    """
    if tuple(param.shape) == size and type(param.data) is not torch.Tensor:   # a DTensor (fsdp)
        return torch.empty_like(param.detach(), dtype=dtype)
    return torch.empty(size, dtype=dtype)


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed rank ``rank``'s generators (CPU and every GPU) from (seed, step, rank), deterministically.

    Used when the number of ranks changed: the saved per-rank states have no counterpart then.
    """
    digest = hashlib.sha256(f"gpipe-plan/{seed}/{step}/{rank}".encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))


class Unreadable(BadInput):
    """A step folder whose ``checkpoint.json`` or DCP index cannot be read (``detail`` says why):
    :func:`load` names the step to resume from instead (:func:`_damaged`)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def read_meta(path: Path) -> dict[str, Any]:
    """``checkpoint.json`` of a complete step folder, checked to be this format and version."""
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise Unreadable(f"cannot read checkpoint '{path}': {named_first_line(exc)}", named_first_line(exc)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise Unreadable(f"'{path}' is not a gpipe-plan checkpoint",
                         f"its {META_FILE} is not a gpipe-plan checkpoint's")
    if meta.get("version") != VERSION:
        raise BadInput(f"checkpoint '{path}' is of version {meta.get('version')!r}; this gpipe-plan resumes version "
                       f"{VERSION} only: start again with a new --checkpoint-dir, or use the version that wrote it")
    return meta


# ---------------------------------------------------------------------- reading DCP's index safely
def safe_reader(path: Path) -> Any:
    """DCP's file reader for ``path``, but reading ``.metadata`` once, by :class:`_MetadataUnpickler`.

    Its ``metadata()`` raises :class:`BadInput` (one line) for a missing, damaged or crafted index.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def __init__(self, path: Path) -> None:
            super().__init__(str(path))
            self._checked: Metadata | None = None

        def metadata(self) -> Metadata:
            if self._checked is None:
                try:
                    with open(Path(self.path) / ".metadata", "rb") as f:
                        found = _MetadataUnpickler(f).load()
                except Exception as exc:  # noqa: BLE001 - a missing, damaged or crafted index
                    raise Unreadable(f"cannot read checkpoint '{self.path}': {named_first_line(exc)}",
                                     f".metadata: {named_first_line(exc)}") from None
                if not isinstance(found, Metadata):
                    raise Unreadable(f"cannot read checkpoint '{self.path}': its .metadata is not DCP's index",
                                     "its .metadata is not DCP's index")
                if getattr(found, "storage_meta", None) is None:
                    found.storage_meta = StorageMeta()
                found.storage_meta.load_id = getattr(self, "load_id", None)
                self._checked = found
            return self._checked

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return self.metadata()

    return SafeReader(path)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP writes into ``.metadata``; any other global is refused.

    DCP's records (dataclasses and enums of its metadata and filesystem modules), ``torch.Size``,
    dtypes and layouts, and a ``pathlib`` path: none of them runs code when built.
    """

    _DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)

    def find_class(self, module: str, name: str) -> Any:
        if module in self._DCP_MODULES and "." not in name:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module and (
                    dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        if module == "torch" and "." not in name:
            found = getattr(torch, name, None)
            if found is torch.Size or isinstance(found, self._TORCH_VALUES):
                return found
        if (module, name) == ("torch.serialization", "_get_layout"):
            from torch.serialization import _get_layout  # looks a name up among torch's layouts

            return _get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):
            return {"PosixPath": PosixPath, "PurePosixPath": PurePosixPath}[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"'{module}.{name}' has no place in a checkpoint's index")


# ---------------------------------------------------------------------- helpers
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if _distributed() else 0


def _world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if _distributed() else 1


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _world_size(group) > 1:
        dist.barrier(group=group)


