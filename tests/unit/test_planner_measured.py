"""The planner against runs measured here: docs/planner_validation.jsonl (benchmarks/planner_validate.py,
a tiny Llama's forward+backward at P = 1, 2, 4 on CPU gloo) and docs/model_memory.jsonl
(benchmarks/model_memory.py, the same model). Predictions are recomputed from the "cpu" preset,
calibrated apart (benchmarks/planner_calibrate.py), so a change to the cost model that breaks
the agreement fails here. Bar: 15% on step time and memory."""
import json
import pathlib
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
sys.path.insert(0, str(DOCS.parent / "benchmarks"))
import planner_validate  # noqa: E402

TOL = 0.15
VALIDATION = [json.loads(line) for line in (DOCS / "planner_validation.jsonl").read_text().splitlines()]


def test_the_validation_covers_p_1_2_4():
    assert {r["P"] for r in VALIDATION} == {1, 2, 4}


@pytest.mark.parametrize("rec", VALIDATION, ids=lambda r: f"N{r['N']}-P{r['P']}")
def test_step_time_and_memory_within_15_percent_of_the_measured_run(rec):
    assert rec["plan"] == planner_validate.plan_inputs(rec["N"], rec["P"])
    pred = planner_validate.predict(rec["plan"])
    assert pred["step_ms"] == pytest.approx(rec["measured"]["step_ms"], rel=TOL)
    assert pred["peak_mb"] == pytest.approx(rec["measured"]["peak_mb"], rel=TOL)
