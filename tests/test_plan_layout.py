"""plan_layout.plan_chunks: the chunks of a plan of any version, and the ways their parts can disagree."""

from __future__ import annotations

from typing import Any

import pytest

from gpipe_plan.artifacts import BadInput
from gpipe_plan.plan_layout import CHUNK_KEYS, plan_chunks
from gpipe_plan.schema import validate

from helpers.plan_docs import chunked_plan


def version_4_plan() -> dict[str, Any]:
    return {
        "model": {"source": "builtin", "name": "toy"}, "schedule": "1f1b",
        "balance": [2, 1], "micro_batches": 2, "micro_batch_size": 1, "global_batch_size": 2,
        "stages": [{"index": 0, "layers": ["a", "b"], "forward_s": 1.0, "send_s": 0.5},
                   {"index": 1, "layers": ["c"], "forward_s": 2.0}],
    }


def chunks_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    validate(doc, "plan", "plan 'p.json'")
    return plan_chunks(doc, "plan 'p.json'")


def test_a_version_4_plan_is_one_chunk_per_stage() -> None:
    chunks = chunks_of(version_4_plan())
    assert [(c["index"], c["stage"], c["layers"], c["first_layer"]) for c in chunks] == \
        [(0, 0, ["a", "b"], 0), (1, 1, ["c"], 2)]
    assert [c["forward_s"] for c in chunks] == [1.0, 2.0]
    assert chunks[0]["send_s"] == 0.5 and chunks[1]["backward_input_s"] is None
    assert all(set(c) == set(CHUNK_KEYS) for c in chunks)


@pytest.mark.parametrize("schedule, v, placement", [
    ("interleaved", 2, [0, 1, 2, 0, 1, 2]),      # round-robin
    ("zb-v", 2, [0, 1, 2, 2, 1, 0]),             # a V: the last stage holds the middle chunks
    ("zb-h1", 1, [0, 1, 2]),
])
def test_chunks_run_on_the_stage_their_schedule_puts_them(schedule: str, v: int, placement: list[int]) -> None:
    chunks = chunks_of(chunked_plan(schedule, 3, v, micro_batches=6))
    assert [c["stage"] for c in chunks] == placement
    assert [c["first_layer"] for c in chunks] == list(range(len(placement)))


def test_inconsistent_plans_are_refused_in_one_line() -> None:
    good = chunked_plan("interleaved", 2, 2)
    swapped = dict(good, stages=[{"chunks": [0, 1]}, {"chunks": [2, 3]}])
    wrong_stage = dict(good, chunks=[{"layers": [f"l{c}"], "stage": 0} for c in range(4)])
    twice = dict(good, chunks=[{"layers": ["same"]} for _ in range(4)])
    cases = {
        "'stages[0].chunks' is [0, 1], expected [0, 2]": swapped,
        "'chunks[1].stage' is 0, expected 1": wrong_stage,
        "balance [1, 1, 1] must have one layer count per chunk": dict(good, balance=[1, 1, 1]),
        "'chunks[2].layers' has 1 names, balance says 2": dict(good, balance=[1, 1, 2, 1]),
        "'chunks' has 3 entries": dict(good, chunks=good["chunks"][:3]),
        "'virtual_stages' is 3, but zb-v runs 2 chunks per stage": dict(good, schedule="zb-v", virtual_stages=3),
        "interleaved needs at least 2 virtual stages": dict(good, virtual_stages=1),
        "not a multiple of its": dict(good, micro_batches=5),
        "layer 'same' appears in more than one chunk": twice,
        "'chunks[0].first_layer' is 3, expected 0": dict(good, chunks=[{"layers": ["x"], "first_layer": 3}]
                                                         + good["chunks"][1:]),
        "schedule zb-v needs 'chunks'": dict(version_4_plan(), schedule="zb-v", virtual_stages=2),
    }
    for message, doc in cases.items():
        with pytest.raises(BadInput) as info:
            chunks_of(doc)
        assert message in str(info.value) and "\n" not in str(info.value)


def test_output_dtypes_must_match_the_shapes() -> None:
    doc = chunked_plan("zb-v", 1, 2)
    doc["chunks"][0].update(output_shapes=[[4], [2]], output_dtypes=["float32"])
    with pytest.raises(BadInput, match=r"'chunks\[0\].output_dtypes' must give one dtype per output shape"):
        chunks_of(doc)
