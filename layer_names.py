"""Layer names as tables print them: short, unique, and a run of layers as one range.

A profile names each layer by its module path, as the model spells it. For a Hugging Face
model that is ``model.layers.17`` beside ``model.norm`` and ``lm_head``: every name but the
head repeats ``model.``, and a chunk of six blocks, ``model.layers.12 .. model.layers.17``,
takes half an 80-column table before a single figure is shown. So every table that prints
layers names them through :class:`LayerNames`:

- the first path component that **every dotted name shares** is dropped (``model.``;
  ``transformer.`` for GPT-2; ``model.decoder.`` in two rounds), so long as the names stay
  unique and none is left a bare number (``layers.0`` keeps its ``layers.``: ``0`` would
  read as a count). A prefix only some dotted names share (``encoder.`` beside ``decoder.``)
  stays: dropping it would make ``conv1`` mean two things;
- a range of numbered blocks is written with the number alone at its end: ``layers.0 .. 3``,
  ``block4 .. 7``; any other range names both ends, ``layers.7 .. lm_head``, and says how
  many layers it holds where the ends do not (``(3)``).

The files keep the full names: this is only what a reader sees. Pure Python, no torch.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

# A name that ends in a block's number: ``layers.12`` -> (``layers.``, 12), ``block3`` -> (``block``, 3).
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


class LayerNames:
    """The short names of a model's layers (``names``: all of them, so that the shortening is the
    same in every row of a table and two layers never print alike)."""

    def __init__(self, names: Iterable[str]) -> None:
        full = list(dict.fromkeys(names))        # in order, each once
        short = list(full)
        self.dropped: list[str] = []             # the prefixes taken off, outermost first
        while True:
            prefix = _shared_first_component(short)
            if prefix is None:
                break
            trimmed = [name[len(prefix) + 1:] if name.startswith(prefix + ".") else name for name in short]
            if len(set(trimmed)) < len(trimmed) or any(t.isdigit() for t in trimmed):
                break
            short = trimmed
            self.dropped.append(prefix + ".")
        self._short = dict(zip(full, short))

    def short(self, name: str) -> str:
        """``model.layers.3`` -> ``layers.3``; a name the model does not have, as it is."""
        return self._short.get(name, name)

    def span(self, names: Sequence[str], count: bool = True) -> str:
        """A contiguous run of layers in one cell: ``layers.0 .. 3``, ``norm .. lm_head``,
        ``layers.7 .. lm_head (3)`` (``count``: say how many where the ends do not), ``-`` for none."""
        if not names:
            return "-"
        first, last = self.short(names[0]), self.short(names[-1])
        if len(names) == 1:
            return first
        a, b = _NUMBERED.match(first), _NUMBERED.match(last)
        if a and b and a.group(1) == b.group(1) and int(b.group(2)) - int(a.group(2)) == len(names) - 1:
            return f"{first} .. {b.group(2)}"      # the numbers say how many
        text = f"{first} .. {last}"
        return f"{text} ({len(names)})" if count and len(names) > 2 else text

    def note(self) -> str | None:
        """What a table's caption says was taken off the names (None: nothing was)."""
        if not self.dropped:
            return None
        return f"layer names without '{''.join(self.dropped)}'"


def _shared_first_component(names: Sequence[str]) -> str | None:
    """The first path component every dotted name has (None: they differ, or fewer than two have one)."""
    dotted = [name.split(".", 1)[0] for name in names if "." in name]
    if len(dotted) < 2 or len(set(dotted)) != 1:
        return None
    return dotted[0]
