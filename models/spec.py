"""The model spec: a small JSON object that rebuilds a model anywhere.

Profiles and plans carry the spec of the model they were made for, so ``gpipe-plan run
plan.json`` rebuilds the very same model (with the seed, bit for bit) on every rank without
the user repeating any option. ``model_spec`` fills in defaults and checks everything a user
can get wrong, so that a bad option is one line at the start, not a traceback later.
"""

from __future__ import annotations

import re
from typing import Any

from ..artifacts import LOSSES, BadInput
from ..options import comma_list
from . import gpt, resnet
from .hooks import DECLARED
from .user import INPUT_DTYPES, find_factory

BUILTINS: dict[str, dict[str, Any]] = {"gpt": gpt.DEFAULTS, "resnet": resnet.DEFAULTS}
_CHECKS = {"gpt": gpt.check_options, "resnet": resnet.check_options}
IMPORT_OPTIONS = ("input_shape", "num_classes", "input_dtype", "vocab_size", "loss", "cut_at", "data")
_BUILTIN_LOSS = {"gpt": "lm", "resnet": "classify"}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def model_spec(model: str, **options: Any) -> dict[str, Any]:
    """The spec for a built-in name or ``pkg.module:factory`` with ``options``.

    Options that are ``None`` are left at their defaults. Raises :class:`BadInput` (one line)
    for an unknown model, an option that does not apply, a bad value, or a factory that does
    not import.
    """
    given = {k: v for k, v in options.items() if v is not None}
    loss = given.get("loss")
    if loss is not None and loss not in LOSSES and ":" not in str(loss):
        raise BadInput(f"--loss '{loss}' is not one of {', '.join(LOSSES)}, nor your own as pkg.module:fn")
    if model in BUILTINS:
        if loss is not None and loss != _BUILTIN_LOSS[model]:
            raise BadInput(f"the built-in '{model}' trains with --loss {_BUILTIN_LOSS[model]}, not {loss}")
        if given.get("data") is not None:
            raise BadInput(f"--data pkg.module:factory feeds a model of your own; the built-in '{model}' has its "
                           f"own data (gpt: `run --data FILE.txt` for text)")
        given.pop("loss", None)
        given.pop("data", None)
        return _builtin_spec(model, given)
    if ":" not in model:
        raise BadInput(f"unknown model '{model}': the built-ins are {', '.join(BUILTINS)}; "
                       f"give your own as pkg.module:factory")
    return _import_spec(model, given)


def is_language_model(spec: dict[str, Any]) -> bool:
    """Whether ``spec`` is a language model: the built-in gpt, or a model of one's own trained with
    ``--loss lm``. Its one input per sample is ``seq_len`` token ids, so a run counts tokens/s
    for it and ``run --data FILE.txt`` can feed it bytes as tokens; the one place that says so."""
    if spec.get("source") == "builtin":
        return _BUILTIN_LOSS.get(spec.get("name")) == "lm"
    return spec.get("source") == "import" and spec.get("loss") == "lm"


def _builtin_spec(name: str, given: dict[str, Any]) -> dict[str, Any]:
    defaults = BUILTINS[name]
    unknown = [k for k in given if k not in defaults]
    if unknown:
        allowed = ", ".join(_flag(k) for k in defaults)
        raise BadInput(f"{_flag(unknown[0])} does not apply to the built-in '{name}' (its options: {allowed})")
    merged = {**defaults, **given}
    if "blocks" in merged:
        merged["blocks"] = _int_list(merged["blocks"], "--blocks", "2,2,2")
    try:
        _CHECKS[name](merged)
    except ValueError as exc:
        raise BadInput(f"{name}: {exc}") from None
    return {"source": "builtin", "name": name, "options": merged}


def _import_spec(path: str, given: dict[str, Any]) -> dict[str, Any]:
    unknown = [k for k in given if k not in IMPORT_OPTIONS]
    if unknown:
        raise BadInput(f"{_flag(unknown[0])} applies to the built-ins only; a model of your own takes "
                       f"{', '.join(_flag(k) for k in IMPORT_OPTIONS)}")
    loss = given.get("loss", "classify")
    data = given.get("data")
    if data is not None:
        return _data_spec(path, given, loss, data)
    if "input_shape" not in given:
        raise BadInput(f"a model of your own ('{path}') needs --input-shape (or --data pkg.module:factory)")
    if ":" in loss:
        raise BadInput(f"--loss {loss} needs --data pkg.module:factory: your loss's targets come from your data")
    values = _checked_values(given, loss)
    shape, num_classes = values["input_shape"], values.get("num_classes")
    if loss == "lm":
        if len(shape) != 1 or values.get("input_dtype", "int64") not in ("int64", "int32"):
            raise BadInput("--loss lm takes token ids: --input-shape SEQ_LEN (one number) and --input-dtype int64")
        values.setdefault("input_dtype", "int64")
        if values.get("vocab_size") is None:
            raise BadInput("--loss lm needs --vocab-size: the range of the token ids, and the logits' last dimension")
    elif num_classes is None:
        raise BadInput(f"a model of your own ('{path}') needs --num-classes (or --loss lm for a language model)")
    dtype = values.get("input_dtype", "float32")
    vocab_size = values.get("vocab_size")
    is_float = dtype.startswith(("float", "bfloat"))
    if not is_float and vocab_size is None:
        raise BadInput(f"--input-dtype {dtype} (token ids) needs --vocab-size: the range to draw them from")
    if is_float and vocab_size is not None:
        raise BadInput(f"--vocab-size applies to integer inputs (--input-dtype int64), not {dtype}")
    find_factory(path)  # fail now, in one line, if it does not import
    spec = {"source": "import", "factory": path, "input_shape": shape, "input_dtype": dtype,
            "num_classes": num_classes, "vocab_size": vocab_size, "loss": loss}
    if values.get("cut_at") is not None:
        spec["cut_at"] = values["cut_at"]  # absent by default: specs written before it existed stay equal
    return spec


def _data_spec(path: str, given: dict[str, Any], loss: str, data: str) -> dict[str, Any]:
    """A model fed by the user's data factory: the inputs' shapes come from its batches.

    Any loss: ``classify`` and ``lm`` where the batches have their shapes (checked on the
    first batch when the model is built: models/hooks.py), or the user's own. Flags that
    describe the batches too (``--input-shape``, ``--input-dtype``, ``--num-classes``,
    ``--vocab-size``) are kept in the spec, only when given, and held against the batches
    at every build: they document the data, and a contradiction is one line.
    """
    values = _checked_values(given, loss)
    find_factory(data, "data factory")
    if ":" in loss:
        find_factory(loss, "loss")
    find_factory(path)
    spec = {"source": "import", "factory": path, "data": data, "loss": loss}
    # Only what was given: specs written before these were accepted stay equal.
    spec.update({k: values[k] for k in DECLARED if k in values})
    if values.get("cut_at") is not None:
        spec["cut_at"] = values["cut_at"]
    return spec


def _checked_values(given: dict[str, Any], loss: str) -> dict[str, Any]:
    """The given ``input_shape``, ``input_dtype``, ``num_classes``, ``vocab_size`` and ``cut_at``,
    each checked on its own (a list of positive integers, a known dtype, ...); absent ones stay absent."""
    values: dict[str, Any] = {}
    if given.get("input_shape") is not None:
        values["input_shape"] = _int_list(given["input_shape"], "--input-shape", "3,32,32")
    num_classes = given.get("num_classes")
    if num_classes is not None:
        if loss == "lm":
            raise BadInput("--num-classes does not apply to --loss lm: the classes are the vocabulary (--vocab-size)")
        if ":" in loss:
            raise BadInput(f"--num-classes says what --loss classify scores; your loss {loss} reads the outputs itself")
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 2:
            raise BadInput(f"--num-classes must be an integer of at least 2, got {num_classes!r}")
        values["num_classes"] = num_classes
    cut_at = given.get("cut_at")
    if cut_at is not None:
        try:
            re.compile(cut_at)
        except re.error as exc:
            raise BadInput(f"--cut-at '{cut_at}' is not a regular expression: {exc}") from None
        values["cut_at"] = cut_at
    dtype = given.get("input_dtype")
    if dtype is not None:
        if dtype not in INPUT_DTYPES:
            raise BadInput(f"--input-dtype '{dtype}' is not one of {', '.join(INPUT_DTYPES)}")
        values["input_dtype"] = dtype
    vocab_size = given.get("vocab_size")
    if vocab_size is not None:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise BadInput(f"--vocab-size must be a positive integer, got {vocab_size!r}")
        values["vocab_size"] = vocab_size
    return values


def _int_list(value: Any, flag: str, example: str) -> list[int]:
    """``"3,32,32"``, ``"64"``, ``[3, 32, 32]`` or ``(3, 32, 32)`` -> ``[3, 32, 32]``, all positive;
    ``example``: a value of ``flag`` the refusal shows."""
    if isinstance(value, str):
        items = comma_list(value, flag, example, distinct=False)
    elif isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    else:
        items = list(value)
    if not items or not all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in items):
        raise BadInput(f"{flag} must be positive integers, got {value!r}")
    return items
