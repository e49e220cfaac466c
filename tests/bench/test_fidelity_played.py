"""bench/fidelity.py's played step ([Note: a miss split in two]): a run's actions played out again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpipe_plan.cli import main
from gpipe_plan.plan_view import read_plan
from gpipe_plan.planner.costmodel import CostModel
from gpipe_plan.planner.export.setting import plan_setting
from gpipe_plan.planner.profile import Profile
from helpers.planner import profile_doc

ROOT = Path(__file__).resolve().parents[2]
FIXED = {"forward_s": 3e-4, "backward_s": 3e-4, "backward_input_s": 4e-4, "backward_weight_s": 1e-4,
         "send_s": 1e-4, "receive_s": 2e-4, "between_actions_s": 2e-5}


@pytest.fixture
def fidelity(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT))    # bench/ is the repository's, not the package's
    from bench import fidelity

    return fidelity


def _plan(tmp_path: Path, schedule: str) -> Path:
    doc = profile_doc(L=8, batch_size=8)
    doc["fixed_costs"] = FIXED
    for i, layer in enumerate(doc["layers"]):
        layer["optimizer_s"] = 1e-4 * (1 + i % 2)
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(doc))
    out = tmp_path / f"{schedule}.plan.json"
    result = CliRunner().invoke(main, ["solve", str(profile), "--stages", "2", "--micro-batches", "4",
                                       "--schedule", schedule, "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    return out


def _report(plan_path: Path, stretch: dict[int, float] | None = None) -> dict:
    """What a run of the plan reports if each action's span took the model's time for it, less
    what the model charges outside the span (the cost between actions and taking a message),
    chunk c's times ``stretch[c]`` times that."""
    plan = json.loads(plan_path.read_text())
    cm = CostModel(Profile(json.loads((plan_path.parent / "p.json").read_text())).at(plan["micro_batch_size"]),
                   plan_setting(read_plan(str(plan_path))))
    chunks = []
    for c in plan["chunks"]:
        received = cm.messages[c["index"]]
        outside = {"forward": cm.overhead + received.forward_receives * cm.receive_fixed,
                   "backward": cm.overhead + received.backward_receives * cm.receive_fixed,
                   "backward_input": cm.overhead + received.backward_receives * cm.receive_fixed,
                   "backward_weight": cm.overhead}
        factor = (stretch or {}).get(c["index"], 1.0)
        chunks.append({f"measured_{kind}_s": (c[f"{kind}_s"] - away) * factor for kind, away in outside.items()})
    return {"schedule": plan["schedule"], "num_stages": len(plan["stages"]), "micro_batches": plan["micro_batches"],
            "virtual_stages": plan.get("virtual_stages", 1), "chunks": chunks,
            "stages": [{"measured_optimizer_s": s["optimizer_s"]} for s in plan["stages"]]}


@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1", "1f1b"])
def test_a_run_whose_actions_took_the_model_s_times_plays_back_its_prediction(fidelity, tmp_path: Path,
                                                                               schedule: str) -> None:
    plan = _plan(tmp_path, schedule)
    predicted = json.loads(plan.read_text())["predicted"]["step_s"]
    assert fidelity.played_step_s(_report(plan), plan) == pytest.approx(predicted, rel=1e-9)
    # slower actions play a longer step, and all the difference is the actions' (waits: none)
    slower = fidelity.played_step_s(_report(plan, {c: 1.2 for c in range(8)}), plan)
    assert predicted * 1.02 < slower <= predicted * 1.2 * (1 + 1e-9)


def test_a_run_missing_a_time_or_on_shared_cores_plays_nothing(fidelity, tmp_path: Path) -> None:
    plan = _plan(tmp_path, "zb-h1")
    report = _report(plan)
    report["chunks"][1]["measured_backward_weight_s"] = None    # the torch executor times no halves
    assert fidelity.played_step_s(report, plan) is None
    report = _report(plan)
    report["stages"][0]["measured_optimizer_s"] = None
    assert fidelity.played_step_s(report, plan) is None
    # ranks that shared the host's cores: their times hold the sharing a play would count again
    assert fidelity.played_step_s({**_report(plan), "concurrent_ranks": 1}, plan) is None


def test_the_page_says_where_the_misses_come_from(fidelity) -> None:
    plan = {"predicted_step_s": 0.050, "schedule": "1f1b", "virtual_stages": 1, "micro_batches": 2, "balance": [3, 3]}
    cell = {"plans": {"1f1b": {**plan, "same_as": "1f1b"}, "zb-h1": {**plan, "same_as": "zb-h1"}},
            "measured_step_s": {"1f1b": [0.055, 0.056, 0.054], "zb-h1": [0.050, 0.051, 0.052]},
            "played_step_s": {"1f1b": [0.050, None, 0.050], "zb-h1": [0.055, 0.055, 0.055]}}
    rows = fidelity.cells({"models": {"gpt": {"2": cell}}})
    by_plan = {r["plan"]: r for r in rows}
    assert by_plan["1f1b"]["played"] == 0.050 and by_plan["zb-h1"]["played"] == 0.055
    text = fidelity._split_text(rows)
    # 1f1b: the actions ran as predicted (1.00), the waiting added 1.10; zb-h1 the other way round
    assert "played / predicted 1.05 in the median (1.00..1.10)" in text
    assert "measured / played 1.01 (0.93..1.10) over 2 plans" in text
    assert fidelity._split_text(fidelity.cells({"models": {"gpt": {"2": {**cell, "played_step_s": {}}}}})) == ""
