"""A user's own model, named ``pkg.module:factory``, cut into layers.

``factory()`` returns an ``nn.Module``. An ``nn.Sequential`` is already a sequence: it splits
at its children. Anything else is traced with torch.fx and cut along its dataflow graph
(:mod:`.traced`). The user says what one sample looks like (``input_shape``, ``input_dtype``)
and how many classes the output scores; the model must return logits (batch, num_classes).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..artifacts import BadInput
from .data import Classification
from .layered import AsTuple, LayeredModel
from .traced import NotTraceable, split_traced

# dtypes a user may name for the input; token ids need a vocabulary size to be drawn from.
INPUT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
}


def find_factory(path: str) -> Callable[[], Any]:
    """Import ``pkg.module:factory`` from ``sys.path`` and the current directory."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise BadInput(f"model '{path}' is not a built-in (gpt, resnet) nor of the form pkg.module:factory")
    # The current directory first-class, as `python -m` does: users run from their project.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a module file written moments ago must be found
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, but also whatever the module's own code raises
        raise BadInput(f"cannot import '{module_name}' (from '{path}'): "
                       f"{type(exc).__name__}: {_first_line(exc)}") from None
    try:
        factory = _getattr_path(module, attr)
    except AttributeError:
        raise BadInput(f"module '{module_name}' has no '{attr}' (from '{path}')") from None
    if not callable(factory):
        raise BadInput(f"'{path}' is not callable: it must be a function that returns an nn.Module")
    return factory


def _getattr_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def build(spec: dict[str, Any]) -> LayeredModel:
    path = spec["factory"]
    factory = find_factory(path)
    try:
        module = factory()
    except Exception as exc:
        raise BadInput(f"factory '{path}' raised {type(exc).__name__}: {_first_line(exc)}") from None
    if not isinstance(module, nn.Module):
        raise BadInput(f"factory '{path}' returned a {type(module).__name__}, not a torch.nn.Module")
    layers = split(module, path)
    data = Classification(shape=tuple(spec["input_shape"]), dtype=INPUT_DTYPES[spec["input_dtype"]],
                          num_classes=spec["num_classes"], token_range=spec.get("vocab_size"))
    return LayeredModel(spec, module, layers, data)


def split(module: nn.Module, path: str = "the model") -> list[tuple[str, nn.Module]]:
    """Cut a module into layers: a Sequential at its children, anything else by tracing."""
    if isinstance(module, nn.Sequential):
        if len(module) == 0:
            raise BadInput(f"'{path}' returned an empty nn.Sequential")
        return [(name, AsTuple(child)) for name, child in module.named_children()]
    try:
        return split_traced(module)
    except NotTraceable as exc:
        raise BadInput(f"torch.fx cannot trace '{path}' ({exc}): wrap it as an nn.Sequential of "
                       f"its parts, and gpipe-plan will split it at the children") from None
