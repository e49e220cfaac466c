"""torchtitan's config classes as data: what ``export --to torchtitan`` is checked against
when torchtitan is not installed.

torchtitan (and the 49 more packages it installs, 0.5 GB: datasets, pandas, pyarrow, wandb,
...) is not in the ``test`` extra; its own parser reads the export in the ``export-check``
extra's tests. What
the default suite keeps is its config classes' fields and their annotations, recorded from
torchtitan by :func:`record` into tests/data/torchtitan-config.json: every key the export writes
must be a field of the class its section is, with a value of that field's type. Where torchtitan
is installed, a test checks the record against it (``python tests/helpers/torchtitan_config.py`` writes
a new one).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

RECORD = Path(__file__).parents[1] / "data" / "torchtitan-config.json"
# The TOML section the export writes -> the config class torchtitan reads it into.
SECTIONS = {"parallelism": "ParallelismConfig", "training": "TrainingConfig"}


def _annotation(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def record() -> dict[str, Any]:
    """The installed torchtitan's config classes: per class, each field's annotation."""
    import importlib.metadata

    from torchtitan import config

    return {"torchtitan": importlib.metadata.version("torchtitan"),
            **{name: {f.name: _annotation(f.type) for f in dataclasses.fields(getattr(config, name))}
               for name in SECTIONS.values()}}


def recorded() -> dict[str, Any]:
    return json.loads(RECORD.read_text())


def annotation_type(text: str) -> Any:
    """The type an annotation of the record says (``list[list[str]] | None``, ``Literal['a', 'b']``)."""
    return eval(text, {"__builtins__": {}}, {"list": list, "dict": dict, "str": str, "int": int, "float": float,
                                              "bool": bool, "None": None, "Literal": typing.Literal})


def conforms(value: Any, tp: Any) -> bool:
    """Whether a TOML value is of the type ``tp`` (as a dataclass field of torchtitan's would take it)."""
    if tp is None or tp is type(None):
        return value is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(conforms(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


if __name__ == "__main__":
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record(), indent=1) + "\n")
    print(f"wrote {RECORD}")
