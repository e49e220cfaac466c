"""The code a plan names, said before ``run`` imports it.

A plan of a model of one's own names Python code: the model's factory (``mypkg.models:make_net``),
and, where the profile was made with them, its data factory and its loss. ``run`` imports them
on every rank from ``sys.path`` and the current directory, as ``python -m`` would: running a
plan is running that code, and a plan should be trusted as a script is (docs/runtime.md, "Trust
model"). So before any rank imports anything, ``run`` says which code it is about to import and
from which file (found without running it: :func:`origin`).

No torch here: the launcher says it before the ranks start.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from typing import Any

from .options import is_data_factory


def code_of(model: dict[str, Any], data: str | None) -> list[tuple[str, str]]:
    """``(what, "pkg.module:attr")`` for each piece of code a run of ``model`` imports; ``data``:
    ``run --data`` (a factory replaces the plan's)."""
    if model.get("source") != "import":
        return []
    named = [("model factory", model.get("factory"))]
    named.append(("data factory", data if data is not None and is_data_factory(data) else model.get("data")))
    loss = model.get("loss")
    named.append(("loss", loss if isinstance(loss, str) and ":" in loss else None))
    return [(what, str(path)) for what, path in named if path]


def origin(path: str) -> str:
    """The file ``pkg.module`` of ``pkg.module:attr`` would be imported from, found as Python's
    import system finds it but without running any of it (not even a package's ``__init__``)."""
    name = path.partition(":")[0]
    if name in sys.builtin_module_names:
        return "built into Python"
    search: list[str] | None = [os.getcwd(), *sys.path]
    spec = None
    parts = name.split(".")
    for i in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), search)
        if spec is None:
            return "not found"
        search = list(spec.submodule_search_locations or [])
    assert spec is not None
    return spec.origin if spec.origin and spec.origin != "namespace" else "a namespace package"


def imports_note(model: dict[str, Any], data: str | None) -> str | None:
    """One line naming the code the run imports and where from; None for a built-in model."""
    code = code_of(model, data)
    if not code:
        return None
    seen: set[str] = set()
    parts = []
    for what, path in code:
        where = origin(path)
        parts.append(f"the {what} '{path}' " + ("(the same file)" if where in seen else f"from {where}"))
        seen.add(where)
    return (f"note: the plan names code, which every rank imports and runs: {', '.join(parts)} "
            f"(trust a plan as you would a script: docs/runtime.md, 'Trust model')")
