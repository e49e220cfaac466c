"""A user's own model, named ``pkg.module:factory``, cut into layers.

``factory()`` returns an ``nn.Module``. An ``nn.Sequential`` is already a sequence: it splits
at its children. Anything else (a Hugging Face causal LM, a tower of blocks) is captured with
``torch.export`` and cut along its dataflow graph at module boundaries (:mod:`.exported`);
``torch.fx`` (:mod:`.traced`) is the fallback for what export cannot capture. The user says
what one sample looks like (``input_shape``, ``input_dtype``) and the objective: with
``loss="classify"`` the model returns logits (batch, num_classes), with ``loss="lm"`` logits
(batch, seq, vocab) trained on next-token targets. A model returning a ``ModelOutput`` or a
dict is trained on its ``logits``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..artifacts import BadInput, first_line
from .data import Classification, NextToken, SyntheticData
from .exported import NotCapturable, split_exported
from .hooks import DECLARED, FactoryData, user_loss
from .layered import AsTuple, LayeredModel
from .traced import NotTraceable, split_traced

# dtypes a user may name for the input; token ids need a vocabulary size to be drawn from.
INPUT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
}


def find_factory(path: str, what: str = "model") -> Callable[..., Any]:
    """Import ``pkg.module:factory`` from ``sys.path`` and the current directory.

    ``what`` names it in errors: the model, the data factory, the loss.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        if what == "model":
            raise BadInput(f"model '{path}' is not a built-in (gpt, resnet) nor of the form pkg.module:factory")
        raise BadInput(f"{what} '{path}' is not of the form pkg.module:function")
    # The current directory first-class, as `python -m` does: users run from their project.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a module file written moments ago must be found
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, but also whatever the module's own code raises
        raise BadInput(f"cannot import '{module_name}' (from '{path}'): "
                       f"{type(exc).__name__}: {first_line(exc)}{_import_hint(module_name, exc)}") from None
    try:
        factory = _getattr_path(module, attr)
    except AttributeError:
        raise BadInput(f"module '{module_name}' has no '{attr}' (from '{path}')") from None
    if not callable(factory):
        raise BadInput(f"'{path}' is not callable: the {what} must be a function")
    return factory


def _import_hint(module_name: str, exc: Exception) -> str:
    """What to do about a module that is not found: the user's own is looked for in the current
    directory and on PYTHONPATH; a package it imports is installed, or not."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return ""
    top = module_name.split(".")[0]
    if module_name == exc.name or module_name.startswith(exc.name + "."):
        holds = f"the package {top}/" if "." in module_name else f"{top}.py"
        return (f": run from the folder that holds {holds}, or add that folder to PYTHONPATH "
                f"(PYTHONPATH=/path/to/folder gpipe-plan ...)")
    return f": '{module_name}' imports '{exc.name}', which this Python does not have: install it (pip install ...)"


def _getattr_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj




def build(spec: dict[str, Any], announce: Callable[[str], None] | None = None) -> LayeredModel:
    """The user's model cut into layers; ``announce`` is told of a capture as it begins."""
    path = spec["factory"]
    factory = find_factory(path)
    try:
        module = factory()
    except Exception as exc:
        raise BadInput(f"factory '{path}' raised {type(exc).__name__}: {first_line(exc)}") from None
    if not isinstance(module, nn.Module):
        name = type(module).__name__
        raise BadInput(f"factory '{path}' returned {'an' if name[:1].lower() in 'aeiou' else 'a'} {name}, "
                       "not a torch.nn.Module")
    loss = spec.get("loss") or "classify"
    data: SyntheticData | FactoryData
    if spec.get("data"):
        declared = {k: spec[k] for k in DECLARED if spec.get(k) is not None}
        if "input_dtype" in declared:
            declared["input_dtype"] = INPUT_DTYPES[declared["input_dtype"]]
        data = FactoryData(find_factory(spec["data"], "data factory"), spec["data"], loss, declared)
    elif loss == "lm":
        data = NextToken(seq_len=spec["input_shape"][0], vocab_size=spec["vocab_size"])
    else:
        data = Classification(shape=tuple(spec["input_shape"]), dtype=INPUT_DTYPES[spec["input_dtype"]],
                              num_classes=spec["num_classes"], token_range=spec.get("vocab_size"))
    loss_fn = user_loss(find_factory(loss, "loss"), loss) if ":" in loss else None
    notes: list[str] = []
    with torch.random.fork_rng(devices=[]):  # capturing must not move the seeded stream
        example, _ = data.batch(2, torch.Generator().manual_seed(0))
        if announce is not None and not isinstance(module, nn.Sequential):
            announce(f"capturing '{path}' with torch.export")
        layers = split(module, path, example, spec.get("cut_at"), notes)
    return LayeredModel(spec, module, layers, data, loss_fn, notes=notes)


def split(module: nn.Module, path: str = "the model", example_inputs: tuple[torch.Tensor, ...] = (),
          cut_at: str | None = None, notes: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """Cut a module into layers: a Sequential at its children, anything else by graph capture.

    ``example_inputs`` (a batch of at least 2 samples) are what torch.export runs the model
    on; without them only torch.fx is tried. ``notes`` gets what the user should know of the
    cut (which output of a dict the loss takes: :func:`~.layered.loss_output_note`).
    """
    if isinstance(module, nn.Sequential):
        if len(module) == 0:
            raise BadInput(f"'{path}' returned an empty nn.Sequential")
        if cut_at is not None and notes is not None:
            notes.append(f"--cut-at is not used: '{path}' is an nn.Sequential, cut at its children")
        return [(name, AsTuple(child, notes=notes)) for name, child in module.named_children()]
    export_error = None
    if example_inputs:
        try:
            return split_exported(module, example_inputs, cut_at, notes)
        except NotCapturable as exc:
            export_error = str(exc)
    try:
        return split_traced(module)
    except NotTraceable as exc:
        reason = f"torch.export cannot capture it ({export_error})" if export_error else f"torch.fx cannot trace it ({exc})"
        raise BadInput(f"cannot cut '{path}' into layers: {reason}; change that code, or wrap the model as "
                       f"an nn.Sequential of its parts and gpipe-plan will split it at the children") from None
