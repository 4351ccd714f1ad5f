"""The planner against runs measured here, predictions recomputed from the stored records (no runs):

- docs/planner_validation.jsonl (benchmarks/planner_validate.py): a tiny Llama's forward+backward
  at P = 1, 2, 4 on CPU gloo, step time and step memory;
- docs/model_memory.jsonl (benchmarks/model_memory.py): the same model's step memory, unpatched
  and ringseq, up to N = 8192;
- docs/longest.jsonl (benchmarks/longest.py): the step memory of every probe of a 47M-parameter
  Llama under ringseq.initialize (ZeRO-1) with the chunked loss, checkpointing and tiled MLP at
  P = 2 and 4, and the unpatched model; and each searched row's longest N against the planner's
  longest N under the same budget (the issue's bar: within 10%).

The "cpu" preset is calibrated apart (benchmarks/planner_calibrate.py), so a change to the cost
model that breaks the agreement fails here. Memory is the resident set with freed tensors
returned (``common.MMAP_THRESHOLD``); glibc's default heap keeps more, stated in docs/planner.md.
The tolerances are what the recorded runs meet (docs/planner.md gives every case's error): the
memory within 5% everywhere; the step time within the issue's 15%, narrowly (-14.6% .. +10.3%:
this shared 2-core VM's speed moves between the calibration and the runs; two earlier sessions
missed by up to 22%, docs/planner.md).
"""
import json
import pathlib
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
sys.path.insert(0, str(DOCS.parent / "benchmarks"))
import planner_validate  # noqa: E402

PINNED = dict(step=0.15, memory=0.05, longest=0.05)  # relative error every recorded case meets (the bar: 15%)
VALIDATION = [json.loads(line) for line in (DOCS / "planner_validation.jsonl").read_text().splitlines()]
MODEL_MEMORY = planner_validate.model_memory_records(str(DOCS / "model_memory.jsonl"))
LONGEST = planner_validate.longest_records(str(DOCS / "longest.jsonl"))


def test_the_validation_covers_p_1_2_4():
    assert {r["P"] for r in VALIDATION} == {1, 2, 4}
    assert {r["P"] for r in MODEL_MEMORY} == {1, 2, 4}


@pytest.mark.parametrize("rec", VALIDATION, ids=lambda r: f"N{r['N']}-P{r['P']}")
def test_step_time_and_memory_against_the_measured_run(rec):
    assert rec["plan"] == planner_validate.plan_inputs(rec["N"], rec["P"])
    pred = planner_validate.predict(rec["plan"])
    assert pred["step_ms"] == pytest.approx(rec["measured"]["step_ms"], rel=PINNED["step"])
    assert pred["peak_mb"] == pytest.approx(rec["measured"]["peak_mb"], rel=PINNED["memory"])


@pytest.mark.parametrize("rec", MODEL_MEMORY, ids=lambda r: f"N{r['N']}-{r['system']}-P{r['P']}")
def test_memory_against_model_memory_benchmark(rec):
    """The unpatched model (full logits) and ringseq (chunked loss) at P = 1, ringseq at P = 2 and 4."""
    assert rec["predicted_mb"] == pytest.approx(rec["peak_mb"], rel=PINNED["memory"])


def test_the_longest_check_covers_p_2_and_4_and_the_memory_features():
    features = {f for r in LONGEST for f in r["system"].split(":")[2].split(",") if f}
    # groups: one ring per kv head (patch(head_groups="kv")); replay: checkpointing that replays the ring;
    # fit: patch(fit=True), each probe costed by the switches it recorded
    assert {r["P"] for r in LONGEST} == {1, 2, 4} and {"loss", "ckpt", "tiled", "replay", "fit", "fsdp2"} <= features <= {
        "loss", "ckpt", "tiled", "groups", "replay", "fit", "fsdp2"}
    # points where activations, not the gradients' floor, set the peak, for each feature set
    systems = {r["system"] for r in LONGEST}
    floor = min(r["measured_mb"] for r in LONGEST if r["P"] > 1)
    ringseq_systems = [s for s in systems if s.startswith("ringseq")]
    assert all(any(r["measured_mb"] > 1.05 * floor for r in LONGEST if r["system"] == s) for s in ringseq_systems)
    # what the planner does not cost is left out, not guessed
    assert planner_validate.longest_inputs("alst:2:", 4096) is None
    replay = planner_validate.longest_inputs("ringseq:2:loss,replay,tiled", 4096)
    assert replay["checkpointing"] and not replay["keep_ring_outputs"]


@pytest.mark.parametrize("rec", LONGEST, ids=lambda r: f"{r['system']}-N{r['N']}")
def test_step_memory_against_the_longest_benchmark(rec):
    assert rec["predicted_mb"] == pytest.approx(rec["measured_mb"], rel=PINNED["longest"])


ROWS = planner_validate.longest_rows(str(DOCS / "longest.jsonl"))


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["system"])
def test_predicted_longest_n_against_the_searched_one(row):
    """The planner's longest N under the same budget, on the search's grid: within the issue's 10%
    of each searched row; a search that hit its cap only bounds it from below."""
    if row["capped"]:
        assert row["predicted_N"] >= row["measured_N"]
    else:
        assert row["predicted_N"] == pytest.approx(row["measured_N"], rel=0.10)


SPEED = [r for r in map(json.loads, (DOCS / "longest.jsonl").read_text().splitlines()) if r["kind"] == "tokens_per_s"]


@pytest.mark.parametrize("run", sorted({r["run"] for r in SPEED if "replay" in r["system"]}))
def test_replaying_the_ring_costs_what_the_planner_says(run):
    """The step time of checkpointing that replays the ring against keeping its outputs, at the
    speed rows' N on the same run of longest.py: the planner's ratio (one more ring forward per
    layer) within 0.07 of the measured one (these rows' own samples spread by about that much)."""
    import ringseq

    by = {r["system"]: r for r in SPEED if r["run"] == run}
    pairs = [(s, s.replace("replay", "ckpt")) for s in by if "replay" in s and s.replace("replay", "ckpt") in by]
    assert pairs, sorted(by)

    def step_s(system, N):
        p = ringseq.plan(**planner_validate.longest_inputs(system, N))
        return next(e for e in p.modes if e.ulysses == p.recommendation.ulysses).step_time_s

    for replay, keep in pairs:
        N = by[replay]["N"]
        measured = by[replay]["seconds"] / by[keep]["seconds"]
        predicted = step_s(replay, N) / step_s(keep, N)
        assert predicted > 1 and abs(predicted - measured) <= 0.07, (replay, predicted, measured)


def test_the_longest_n_check_covers_the_memory_features():
    systems = {r["system"] for r in ROWS if not r["capped"]}
    assert {"ringseq:2:loss", "ringseq:2:loss,ckpt,tiled", "ringseq:2:loss,replay,tiled", "unpatched:1:"} <= systems


RECORDS = [json.loads(line) for line in (DOCS / "longest.jsonl").read_text().splitlines()]
FIT = [r for r in RECORDS if r.get("run") == "fit"]
WITHIN = [r for r in RECORDS if r.get("run") == "fit_headroom"]


def test_fit_is_near_the_longest_manual_rows_and_their_speed():
    """longest.py's fit contender: at each P its longest N (run "fit_headroom", after fit kept 4% of the budget
    for the planner's error) is within 10% of the longest searched manual row in the same budget (run "fit" reached
    them, twice 0.5% over the budget); at N = 4096 its tokens/s (run "fit": the same choice there) is at least
    0.95x the fastest manual row timed beside it."""
    best = {r["system"]: r for r in RECORDS if r["kind"] == "longest"}  # a system's latest search
    for P in (2, 4):
        manual = max(r["longest_N"] for s, r in best.items() if s.startswith(f"ringseq:{P}:") and "fit" not in s)
        assert best[f"ringseq:{P}:fit"]["run"] == "fit_headroom", best[f"ringseq:{P}:fit"]
        assert best[f"ringseq:{P}:fit"]["longest_N"] >= 0.9 * manual, (P, manual, best[f"ringseq:{P}:fit"])
    speed = {r["system"]: r["tokens_per_s"] for r in FIT if r["kind"] == "tokens_per_s"}
    fastest = max(v for s, v in speed.items() if "fit" not in s)
    assert speed.pop("ringseq:2:fit") >= 0.95 * fastest and len(speed) >= 3, speed


def test_fit_never_measures_over_its_budget():
    """Issue 59: at every length fit accepts, from 4k to the longest, at P = 2 and 4 (at least 12 probes), the
    measured step is within the budget; the length one grain above its longest it refuses before the step; each
    probe's recorded prediction is its switches' cost now."""
    probes = [r for r in WITHIN if r["kind"] == "probe"]
    stepped = [r for r in probes if r.get("step_mb")]
    assert len(stepped) >= 12 and {r["P"] for r in stepped} == {2, 4}, stepped
    for P in (2, 4):
        ns = sorted(r["N"] for r in stepped if r["P"] == P)
        longest = next(r for r in WITHIN if r["kind"] == "longest" and r["P"] == P)
        assert ns[0] <= 8192 and ns[-1] == longest["longest_N"] == longest["fit_limit"], (P, ns, longest)
        refused = [r for r in probes if r["P"] == P and not r.get("step_mb")]
        assert [r["N"] for r in refused] == [longest["fit_limit"] + 512] and not refused[0]["fits"], refused
    for r in stepped:
        assert r["fits"] and r["step_mb"] <= 448.0, r  # longest.py's budget
        inputs = planner_validate.longest_inputs(r["system"], r["N"], r["switches"])
        assert planner_validate.predict_step_mb(inputs) == pytest.approx(r["predicted_mb"], abs=0.2), r
