"""Each command's options, declared once: a dataclass field per option carries its flag, type,
default and help, and the command line is generated from the fields.

[Note: options as data]
A command's options are one frozen dataclass (``ProfileOptions`` in profiles/options.py,
``SolveCommand`` and ``ExploreRequest`` in planner/request.py, ``RunOptions`` in
runtime/options.py, ``TuneOptions`` in tune.py). Each field is declared
with :func:`option`, which puts the flag and help in the field's metadata; the field's default
is the option's default, for the command line and for a Python caller alike, and the field's
name is what click hands back (so ``--time-budget`` is ``time_budget_s``: the unit in the name).
:func:`click_options` turns the fields into click options, in declaration order, so the help
lists them as declared. An option two commands share (the network of ``--devices`` in solve
and explore) is declared once by one function both dataclasses call (planner/request.py,
``_shared``): one flag, default and help text. The checks that need several options at once
live in the dataclass's own method (``SolveRequest.solve_options``,
``ExploreRequest.check``), not in the command layer, so a caller of the Python API is
checked as the command line is.

This module imports nothing heavy: click only when the command line is built, never torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line (its default is the field's)."""

    flags: tuple[str, ...]           # "--stages", "-k"; a "--x/--no-x" pair for an on/off switch
    help: str
    type: Any = None                 # int, float; None: text (or the default's type, as click does)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    show_default: bool = False
    is_flag: bool = False            # a bare --flag, False unless given
    path: str | None = None          # "file" or "dir": a path click checks is not the other kind


def option(*flags: str, default: Any = None, help: str, type: Any = None, choices: tuple[str, ...] | None = None,
           metavar: str | None = None, show_default: bool = False, is_flag: bool = False,
           path: str | None = None) -> Any:
    """A dataclass field that is also a command-line option (see the note above)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(
        tuple(flags), help, type, None if choices is None else tuple(choices), metavar, show_default, is_flag, path)})


def click_options(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding one click option per :func:`option` field of ``cls``, in their order."""
    import click

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for f in reversed([f for f in dataclasses.fields(cls) if "flag" in f.metadata]):
            spec: Flag = f.metadata["flag"]
            kind: Any = spec.type
            if spec.choices is not None:
                kind = click.Choice(spec.choices)
            elif spec.path is not None:
                kind = click.Path(dir_okay=spec.path == "dir", file_okay=spec.path == "file")
            extra: dict[str, Any] = {"is_flag": True} if spec.is_flag else {}
            if kind is not None:
                extra["type"] = kind
            if spec.metavar is not None:
                extra["metavar"] = spec.metavar
            command = click.option(*spec.flags, f.name, default=f.default, show_default=spec.show_default,
                                   help=spec.help, **extra)(command)
        return command

    return decorate


# --seed (profile, run): the data's generator takes seed x 1,000,003 + step (runtime/data.py),
# which torch's 64-bit seeds hold for any step count below 2^40 while |seed| <= MAX_SEED.
MAX_SEED = 2 ** 40


def check_seed(seed: int) -> None:
    """Refuse, in one line, a ``--seed`` torch cannot take (it fails deep in every rank)."""
    if not -MAX_SEED <= seed <= MAX_SEED:
        from .artifacts import BadInput

        raise BadInput(f"--seed must be a whole number from -2^40 to 2^40, got {seed}")


def comma_list(text: str, flag: str, example: str, item: Callable[[str], Any] = int,
               distinct: bool = True) -> list[Any]:
    """``"2,4,8"`` -> ``[2, 4, 8]``: a comma-separated option's items, each read by ``item`` (int,
    or str for names), in the order given. Refused in one line: no items, an empty item
    (``2,,4``, a trailing comma: a value was likely lost), an item ``item`` cannot read, and,
    where the items are a set of choices (``distinct``), one given twice, which would otherwise
    be searched or measured twice or silently merged. ``example`` is a good value of ``flag``."""
    from .artifacts import BadInput

    parts = [part.strip() for part in str(text).split(",")]
    if not any(parts):
        raise BadInput(f"{flag} needs at least one value, e.g. {example}")
    if not all(parts):
        raise BadInput(f"{flag} {text!r} has an empty item (two commas in a row, or one at an end): "
                       f"give a comma-separated list, e.g. {example}")
    try:
        items = [item(part) for part in parts]
    except ValueError:
        raise BadInput(f"{flag} {text!r} is not a comma-separated list of "
                       f"{'integers' if item is int else 'values'}, e.g. {example}") from None
    if distinct:
        twice = sorted({str(x) for x in items if items.count(x) > 1})
        if twice:
            raise BadInput(f"{flag} {text!r} gives {', '.join(twice)} more than once: give each value once")
    return items


__all__ = ["Flag", "option", "click_options", "check_seed", "comma_list"]
