"""``--init-from FILE``: start training from weights of the unsplit model, each rank reading its own.

The file holds the unsplit model's ``state_dict``, keyed as ``model.state_dict()`` (and as
``gpipe-plan run --save`` writes it): a ``torch.save``'d dict (``.pt``, ``.bin``) or a
``.safetensors`` file. A pipeline never needs the whole of it in one process: each rank opens
the file lazily (``torch.load(mmap=True)`` maps it, ``safetensors.safe_open`` reads one tensor
on request) and copies only its stage's tensors into its layers; stage 0 also takes the
tensors no layer uses (``Chunk.unowned``), which it keeps for ``--save``.

Before any tensor is copied, every rank checks the file's keys against the whole model's, so
that all ranks refuse a file of another model with the same one line. Keys that the model ties
together (one tensor under two names, as GPT-2's embedding and output weights) need only one of
their names in the file: ``safetensors`` stores a shared tensor once.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..artifacts import BadInput, named_first_line
from .stage import StageChunks

_EXAMPLES = 3  # keys named in a mismatch message


class WeightFile(Protocol):
    """What the loader needs of a file: its keys, a tensor's shape, and a tensor."""

    def keys(self) -> set[str]: ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def tensor(self, key: str) -> torch.Tensor: ...


def load_initial_weights(path: str, stage: StageChunks, whole_model: nn.Module) -> int:
    """Copy this stage's tensors from ``path`` into it; return how many were copied.

    ``whole_model`` is the unsplit model (its layers of other stages may be released: only its
    ``state_dict`` keys, and which of them share a tensor, are read).
    """
    with open_weights(path) as weights:
        names = _check_keys(path, weights.keys(), whole_model)
        targets = stage.state_dict()  # unsplit key -> this stage's live tensor (storage shared)
        for key, target in targets.items():
            if tuple(weights.shape(names[key])) != tuple(target.shape):
                raise BadInput(f"--init-from '{path}': '{names[key]}' is {list(weights.shape(names[key]))} in the file "
                               f"but {list(target.shape)} in the model; save the weights of this very model spec")
        with torch.no_grad():
            for key, target in targets.items():
                target.copy_(weights.tensor(names[key]))  # casts to the parameter dtype
    return len(targets)


@contextmanager
def open_weights(path: str) -> Iterator[WeightFile]:
    """The file at ``path``, opened lazily: ``.safetensors`` by safetensors, anything else by torch.load."""
    if Path(path).suffix == ".safetensors":
        with _SafetensorsFile.open(path) as weights:
            yield weights
    else:
        yield _TorchFile(path)


class _TorchFile:
    """A ``torch.save``'d state_dict, memory-mapped: a tensor's bytes are read when it is used."""

    def __init__(self, path: str) -> None:
        try:
            # weights_only: a weights file is data; unpickling anything else could run code.
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - not a torch file, an old format, a crafted pickle
            if not zipfile.is_zipfile(path):
                # (torch's own line then speaks of mmap and _use_new_zipfile_serialization, whatever the file)
                raise BadInput(f"--init-from '{path}' is neither a file torch.save writes (a zip archive) nor a "
                               f".safetensors file: give weights saved with torch.save(model.state_dict(), path) "
                               f"(torch 1.6 or later), or a .safetensors file") from None
            raise BadInput(f"cannot read --init-from '{path}': {named_first_line(exc)}") from None
        if not isinstance(state, dict):
            raise BadInput(f"--init-from '{path}' holds a {type(state).__name__}, not a state_dict: save it with "
                           f"torch.save(model.state_dict(), path)")
        self.path = path
        self.state: dict[Any, Any] = state

    def keys(self) -> set[str]:
        return {key for key in self.state if isinstance(key, str)}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensor(key).shape)

    def tensor(self, key: str) -> torch.Tensor:
        value = self.state[key]
        if not isinstance(value, torch.Tensor):
            raise BadInput(f"--init-from '{self.path}': '{key}' holds a {type(value).__name__}, not a tensor")
        return value


class _SafetensorsFile:
    """A ``.safetensors`` file: its header gives keys and shapes; a tensor is read on request."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    @classmethod
    @contextmanager
    def open(cls, path: str) -> Iterator["_SafetensorsFile"]:
        try:
            from safetensors import safe_open
        except ImportError:
            raise BadInput(f"--init-from '{path}' is a .safetensors file: install safetensors "
                           f"(pip install safetensors)") from None
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as exc:  # noqa: BLE001 - not a safetensors file, or a damaged header
            raise BadInput(f"cannot read --init-from '{path}': {named_first_line(exc)}") from None
        with handle:
            yield cls(handle)

    def keys(self) -> set[str]:
        return set(self.handle.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handle.get_slice(key).get_shape())

    def tensor(self, key: str) -> torch.Tensor:
        return self.handle.get_tensor(key)


def _check_keys(path: str, have: set[str], whole_model: nn.Module) -> dict[str, str]:
    """Refuse a file whose keys are not the model's; return model key -> the file's key for it."""
    aliases: dict[int, list[str]] = {}  # one tensor -> every key the model saves it under
    for key, tensor in whole_model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(key)
    names: dict[str, str] = {}
    missing: list[str] = []
    for keys in aliases.values():
        present = [key for key in keys if key in have]
        if present:
            names.update({key: present[0] for key in keys})
        else:
            missing.append(keys[0])
    unexpected = sorted(have - {key for keys in aliases.values() for key in keys})
    if missing or unexpected:
        raise BadInput(f"--init-from '{path}' does not match the model: {len(missing)} of the model's "
                       f"{len(aliases)} tensors missing{_examples(missing)}, {len(unexpected)} of the file's "
                       f"{len(have)} keys unexpected{_examples(unexpected)}{_prefix_hint(missing, unexpected)}; "
                       f"save the unsplit model's state_dict with these keys (as `gpipe-plan run --save` writes it)")
    return names


def _examples(keys: list[str]) -> str:
    if not keys:
        return ""
    shown = ", ".join(f"'{key}'" for key in keys[:_EXAMPLES])
    return f" ({shown}{', ...' if len(keys) > _EXAMPLES else ''})"


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """Name a prefix every unexpected key has and the model's keys lack (``module.``, ``model.``)."""
    if not missing or not unexpected:
        return ""
    prefix = unexpected[0].split(".", 1)[0] + "."
    if all(key.startswith(prefix) for key in unexpected) and {key[len(prefix):] for key in unexpected} >= set(missing):
        return f" (the file's keys carry the prefix '{prefix}': strip it)"
    return ""


