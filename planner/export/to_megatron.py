"""Megatron-Core: the plan as ``pretrain_gpt.py`` arguments.

Megatron builds a transformer language model from three kinds of part: the embedding (``E``),
decoder layers (``t``) and the output layer with the loss (``L``). Its
``--pipeline-model-parallel-layout`` says which parts each (virtual) pipeline stage holds, in
the order of the chunks, stages separated by ``|`` (``"Et*3|t*4|t*3L"``: three stages); a
string of K·v stages makes v virtual stages per rank, chunk c on rank c mod K, as gpipe-plan's
``interleaved``. The layout alone says v: Megatron refuses it beside
``--num-virtual-stages-per-pipeline-rank`` or ``--num-layers-per-virtual-pipeline-stage`` (at
most one of the three, megatron/training/arguments.py). Without a layout Megatron spreads the
decoder layers evenly, except for ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers`` (each at least 1, the middle stages even).

A plan maps onto those parts through its layers' module names: a decoder layer is a module
named ``...layers.N``, ``...h.N`` or ``...blocks.N`` (Hugging Face's Llama and GPT-2, the
built-in ``gpt``); what comes before the first is the embedding, what comes after the last
(final norm, output projection) the output. Megatron cannot cut inside any of those parts: a
plan whose chunk boundary falls inside one (between the final norm and the output layer, or
in the middle of a decoder layer cut finer) exports the nearest split that cuts between
parts, and says so with its predicted cost. Megatron runs 1F1B, interleaved when v > 1; it
has no GPipe or zero-bubble schedule: their balance exports, their order does not.
"""

from __future__ import annotations

import re

from ...artifacts import BadInput
from . import Exported
from .expressible import bounds_of, nearest_split
from ...plan_view import PlanView
from .view import placement_note, unnamed

# A decoder layer's module name: a numbered child of a list of layers.
DECODER_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def parts_of(view: PlanView) -> list[tuple[str, int]]:
    """Per layer, the Megatron part it belongs to: ``("E", 0)``, ``("t", n)`` (decoder layer n),
    ``("L", 0)``. A layer that is a piece of decoder layer n belongs to ``("t", n)``."""
    modules = [m for chunk in view.chunks for m in chunk.modules]
    numbers = [_decoder_number(m) for m in modules]
    decoder = [i for i, n in enumerate(numbers) if n is not None]
    if not decoder:
        raise BadInput(f"plan '{view.path}': megatron exports transformer language models, and no layer of this "
                       f"plan is a decoder layer (a module named ...layers.N, ...h.N or ...blocks.N)"
                       + ("; its layers have no module names (solve a profile of format 8)" if unnamed(view) else ""))
    first, last = decoder[0], decoder[-1]
    parts = []
    for i, n in enumerate(numbers):
        if i < first:
            parts.append(("E", 0))
        elif i > last:
            parts.append(("L", 0))
        elif n is not None:
            parts.append(("t", n))
        else:  # a layer between decoder layers that is none of them (a traced piece): with the one before
            parts.append(parts[-1])
    return parts


def _decoder_number(module: str | None) -> int | None:
    if module is None:
        return None
    match = DECODER_LAYER.search(module)
    return int(match.group(1)) if match else None


def _chunk_parts(balance: list[int], parts: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """Per chunk of ``balance`` layers, the parts of its layers."""
    bounds = bounds_of(balance)
    return [parts[a:b] for a, b in zip(bounds, bounds[1:])]


def layout(balance: list[int], parts: list[tuple[str, int]]) -> str:
    """The layout string of chunks holding ``balance`` layers, in Megatron's symbols."""
    stages = []
    for chunk in _chunk_parts(balance, parts):
        symbols, previous = [], None
        for part in chunk:
            if part != previous:
                symbols.append(part[0])
            previous = part
        stages.append(_compress("".join(symbols)))
    return "|".join(stages)


def _compress(symbols: str) -> str:
    """``Ettt`` -> ``Et*3``: runs of decoder layers as Megatron's multiplication."""
    return re.sub(r"t{2,}", lambda m: f"t*{len(m.group(0))}", symbols)


def export(view: PlanView, out: str) -> Exported:
    parts = parts_of(view)
    allowed = [i for i in range(1, len(parts)) if parts[i] != parts[i - 1]]
    balance = view.balance
    notes: list[str] = []
    # The plan's own balance when every cut is one Megatron can make.
    exported = nearest_split(balance, allowed)
    if exported is None:
        raise BadInput(f"plan '{view.path}': Megatron cannot cut this model into {len(balance)} chunks at its "
                       f"embedding, decoder-layer and output boundaries; solve with fewer stages")
    if exported != balance:
        changed = [c for c, (a, b) in enumerate(zip(balance, exported)) if a != b]
        notes.append(f"chunks {changed} cut inside a part Megatron keeps whole (embedding, decoder layer, output): "
                     f"exported the nearest split it can express, {exported} layers per chunk instead of {balance}")
    if view.schedule not in ("1f1b", "interleaved"):
        notes.append(f"Megatron has no {view.schedule} schedule: it runs this balance with 1F1B"
                     + (" (interleaved over the chunks)" if view.virtual_stages > 1 else ""))
    if view.schedule == "zb-v":
        notes.append("zb-v places chunks in a V (stage k holds chunks k and 2K-1-k); Megatron's virtual stages are "
                     "round-robin, so its ranks hold other chunks than the plan's")
    placement = placement_note(view, "Megatron")
    if placement:
        notes.append(placement)
    if any(chunk.recompute for chunk in view.chunks):
        notes.append(f"the plan recomputes chunks {[c.recompute for c in view.chunks]}: not exported; Megatron's own "
                     f"--recompute-granularity / --recompute-method apply to every stage alike")
    decoder_layers = len({n for kind, n in parts if kind == "t"})
    exported_layout = layout(exported, parts)
    args = [f"--pipeline-model-parallel-size {view.num_stages}",
            f"--num-layers {decoder_layers}",
            f"--pipeline-model-parallel-layout \"{exported_layout}\""]
    # v is the layout's stages over K: Megatron allows no second way of saying it beside the layout.
    args += [f"--micro-batch-size {view.micro_batch_size}", f"--global-batch-size {view.global_batch_size}"]
    text = "\n".join([f"# Megatron-Core arguments from the gpipe-plan plan '{view.path}'",
                      *[f"# note: {n}" for n in notes],
                      f"# data parallel: Megatron makes it world size / (pipeline x tensor x context): start "
                      f"{view.num_stages * view.data_parallel} ranks for {view.data_parallel} replica(s)",
                      *[f"# {line}" for line in _without_layout(exported, parts, view.virtual_stages)],
                      " \\\n".join(args), ""])
    # The same split, and each rank the same chunks in the same order as the plan's.
    exact = exported == balance and view.schedule != "zb-v" and not placement
    return Exported("megatron", {out: text}, exact=exact, notes=notes, exported_balance=exported,
                    summary=f"megatron: {view.num_stages} pipeline ranks, layout {exported_layout}")


def _without_layout(balance: list[int], parts: list[tuple[str, int]], virtual_stages: int) -> list[str]:
    """The same split in the arguments of a Megatron without ``--pipeline-model-parallel-layout``,
    where they can say it: the embedding on the first chunk, the output on the last, and the
    decoder layers even (``--num-layers-per-virtual-pipeline-stage``), or even but for the first
    and last stage (``--decoder-first/last-pipeline-num-layers``, one chunk per stage, each of
    the two holding a decoder layer at least: Megatron refuses a count of 0)."""
    if _part_chunks(balance, parts, "E") != {0} or _part_chunks(balance, parts, "L") != {len(balance) - 1}:
        return []
    per_chunk = _decoder_layers_per_chunk(balance, parts)
    if virtual_stages > 1:
        if len(set(per_chunk)) == 1:
            return [f"equivalently, without the layout: --num-layers-per-virtual-pipeline-stage {per_chunk[0]}"]
        return []
    # Megatron's TransformerConfig: each of the two counts at least 1, the rest even over the middle stages.
    if len(balance) > 1 and min(per_chunk[0], per_chunk[-1]) > 0 and len(set(per_chunk[1:-1])) <= 1:
        return [f"equivalently, without the layout: --decoder-first-pipeline-num-layers {per_chunk[0]} "
                f"--decoder-last-pipeline-num-layers {per_chunk[-1]}"]
    return []


def _part_chunks(balance: list[int], parts: list[tuple[str, int]], kind: str) -> set[int]:
    """The chunks holding layers of the part ``kind``."""
    return {c for c, chunk in enumerate(_chunk_parts(balance, parts)) if any(p[0] == kind for p in chunk)}


def _decoder_layers_per_chunk(balance: list[int], parts: list[tuple[str, int]]) -> list[int]:
    return [len({n for kind, n in chunk if kind == "t"}) for chunk in _chunk_parts(balance, parts)]
