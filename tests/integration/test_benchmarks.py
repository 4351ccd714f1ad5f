"""The benchmarks still run, at toy sizes: JSON lines, a plot, and accurate results."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# fp32 attention is within ~1e-7 of float64; 1e-5 only says a benchmark computed attention and not
# something else (exactness itself is tested in tests/dist)
SANE = 1e-5


def bench(script, *args, out):
    run = subprocess.run([sys.executable, f"benchmarks/{script}", *args, "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # three process trees; ring attention against the reference is tested in tests/dist
def test_attention_benchmark(tmp_path):
    # DeepSpeed's Ulysses (--impls ulysses) is left out here: its start alone costs half a minute of CI
    records = bench("attention.py", "--lengths", "1024", "--kv-heads", "2", "--reps", "1", "--impls", "ringseq",
                    "torch_ring", "sdpa", out=tmp_path)
    assert [r["impl"] for r in records] == ["ringseq", "torch_ring", "sdpa"]
    assert all(r["max_err"] < SANE and r["fwd_bwd_ms"] > 0 and r["peak_mb"] >= 0 for r in records)
    assert (tmp_path / "attention.png").exists() and (tmp_path / "attention.jsonl").exists()


@pytest.mark.slow  # a process tree per mode; Ulysses x ring attention is tested in tests/dist
def test_modes_benchmark(tmp_path):
    # pure Ulysses (--ulysses-sizes 4) is the same script with one more process tree; its attention is in tests/dist
    records = bench("modes.py", "modes", "--modes-n", "512", "--kv-heads", "4", "--ulysses-sizes", "1", "2",
                    "--reps", "1", out=tmp_path)
    assert [(r["kv_heads"], r["ulysses_size"], r["ring_steps"]) for r in records] == [(4, 1, 4), (4, 2, 2)]
    assert records[1]["ratio_to_ring"] > 0
    assert all(r["max_err"] < SANE for r in records) and (tmp_path / "modes.png").exists()


@pytest.mark.slow  # three process trees; the memory features it measures are tested in test_hf_models
def test_model_memory_benchmark(tmp_path):
    records = bench("model_memory.py", "--lengths", "256", "--sizes", "1", "2", out=tmp_path)
    assert [(r["system"], r["P"]) for r in records] == [("unpatched", 1), ("ringseq", 1), ("ringseq", 2)]
    assert max(r["loss"] for r in records) - min(r["loss"] for r in records) < SANE
    assert records[1]["scaling_efficiency"] == 1.0 and records[2]["scaling_efficiency"] > 0
    assert (tmp_path / "model_memory.png").exists()


def test_schedule_benchmark(tmp_path):
    one = bench("schedule.py", "--P", "16", "--S", "65536", "--docs", "100", "--reps", "1", out=tmp_path)
    assert len(one) == 1 and one[0]["P"] == 16 and one[0]["plan_ms"] > 0
    sweep = bench("schedule.py", "--P", "2", "4", "--docs", "1", "10", "--reps", "1", out=tmp_path)
    assert {(r["P"], r["docs"]) for r in sweep} == {(2, 1), (2, 10), (4, 1), (4, 10)}
    assert (tmp_path / "schedule.png").exists() and (tmp_path / "schedule.jsonl").exists()


def test_lockstep_benchmark(tmp_path):
    records = bench("lockstep.py", "--sizes", "2", "--S", "512", "--reps", "2", "--layouts", "contiguous",
                    out=tmp_path)
    (r, summary) = records
    assert r["P"] == 2 and r["call_ms"] > 0 and 0 < r["agree_share"] < 1 and r["delayed_slowest_rank"] == 1, r
    assert "median_agree_share" in summary and (tmp_path / "lockstep.png").exists()


@pytest.mark.slow  # a DeepSpeed process tree; what it reports is evidence, not a figure
def test_memory_terms_benchmark(tmp_path):
    records = bench("memory_terms.py", "--model", "tiny", "--systems", "ringseq:2:loss,ckpt,tiled", "--N", "512",
                    "--top", "5", out=tmp_path)
    (r,) = records
    assert r["system"] == "ringseq:2:loss,ckpt,tiled" and r["N"] == 512 and r["live_mb"] > 0 and r["peak_op"]
    assert 0 < len(r["terms"]) <= 5 and all(t["mb"] >= 0 and t["node"] and t["op"] for t in r["terms"])
    assert (tmp_path / "memory_terms.jsonl").exists()


@pytest.mark.slow  # two DeepSpeed process trees; the features it drives are tested in test_hf_models / test_deepspeed
def test_longest_benchmark(tmp_path):
    """The search, the watchdog-free path and the plot at a toy size (ALST through DeepSpeed and
    ringseq with every memory feature): both fit the cap of 1024 tokens in a generous budget."""
    records = bench("longest.py", "--model", "tiny", "--systems", "ringseq:2:loss,ckpt,tiled", "alst:2",
                    "--budget-mb", "2048", "--start", "512", "--grain", "512", "--max-n", "1024", "--common", "0",
                    out=tmp_path)
    best = {r["system"]: r for r in records if r["kind"] == "longest"}
    assert set(best) == {"ringseq:2:loss,ckpt,tiled", "alst:2:"}
    assert all(r["longest_N"] == 1024 and r["capped"] for r in best.values()), best
    probes = [r for r in records if r["kind"] == "probe"]
    assert [r["N"] for r in probes] == [512, 1024, 512, 1024] and all(r["fits"] and r["step_mb"] > 0 for r in probes)
    assert (tmp_path / "longest.png").exists()


@pytest.mark.slow  # process trees per probe; fit itself is tested in tests/integration/test_fit.py
def test_longest_benchmark_fit_contender(tmp_path):
    """longest.py's fit contender at a toy size, in a budget (16 MB) that fit's planner fits up to
    12288 tokens on the 512 grid: probes at 4096 and 8192, then down from 12288 until a step fits,
    then at 12800, which fit refuses before the step; a probe that ran records fit's choice (no
    checkpointing at 4096, checkpointing at 12288) and its prediction at N."""
    records = bench("longest.py", "--model", "tiny", "--systems", "ringseq:2:fit", "--budget-mb", "16",
                    "--start", "4096", "--grain", "512", "--max-n", "16384", "--common", "0", out=tmp_path)
    probes = [r for r in records if r["kind"] == "probe"]
    best = next(r for r in records if r["kind"] == "longest")
    assert best["fit_limit"] == 12288 and [r["N"] for r in probes[:3]] == [4096, 8192, 12288], probes
    refused = probes[-1]
    assert refused["N"] == 12800 and refused["step_mb"] is None and not refused["fits"], refused
    assert "no set of memory switches fits a step of 1 x 12800 tokens" in refused["refused"], refused
    assert not probes[0]["switches"]["checkpointing"] and probes[2]["switches"]["checkpointing"], probes
    assert all(r["predicted_mb"] <= r["predicted_top_mb"] <= 16 and r["planned_at"] >= r["N"] for r in probes[:-1])
    assert best["longest_N"] in [r["N"] for r in probes if r["fits"]] or best["longest_N"] == 0, (best, probes)


@pytest.mark.slow  # two process trees; fit on changing lengths is tested in tests/integration/test_fit.py
def test_fit_mixed_benchmark(tmp_path):
    """fit_mixed.py at a toy size: both systems take the same lengths and give the same losses (the
    switches change memory and time, not results); fit re-plans at most once per length and
    records what it chose and predicted."""
    records = bench("fit_mixed.py", "--model", "small", "--steps", "3", "--max-n", "4096", "--budget-mb", "64",
                    out=tmp_path)
    setup = records[0]
    steps = {name: [r for r in records if r.get("system") == name and r["kind"] == "step"] for name in ("fit", "fixed")}
    assert [r["N"] for r in steps["fit"]] == [r["N"] for r in steps["fixed"]] == setup["lengths"]
    for a, b in zip(steps["fit"], steps["fixed"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)
    summary = {r["system"]: r for r in records if r["kind"] == "summary"}
    assert 1 <= summary["fit"]["replans"] <= summary["fit"]["distinct_lengths"] == len(set(setup["lengths"]))
    assert all(r["predicted_mb"] <= 64 and r["fit"] for r in steps["fit"]) and summary["fit"]["planning_s"] > 0
    assert records[-1]["kind"] == "ratio" and (tmp_path / "fit_mixed.png").exists()


# in the default run: the script a device run spends its time on must not break unseen (it did once, under -m slow)
def test_gpu_check_runs_its_cpu_part():
    """benchmarks/gpu_check.py --device cpu (through its shell wrapper): every check that applies
    off CUDA runs, is exact, and the script exits 0; the CUDA-only backends are not in it."""
    run = subprocess.run(["sh", "benchmarks/gpu_check.sh", "--device", "cpu"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    summary = rows.pop()
    assert summary["summary"] and summary["failures"] == 0 and summary["checks"] == len(rows)
    # the clients' FSDP2 rows need a GPU in one process (their CPU runs: test_trainer.py's, test_matrix.py's)
    assert all(r["ok"] for r in rows) and {r["check"] for r in rows if r.get("skipped")} == {"trainer_fsdp2", "entry_bf16"}
    assert {r["check"] for r in rows} == {"where", "ring", "blocks", "kernels", "model", "compiled", "trainer_fsdp2",
                                          "fsdp2_bf16", "entry_bf16", "memory"}
    (memory,) = [r for r in rows if r["check"] == "memory"]  # the GPU's memory row's code, run (not judged) here
    # its budget is what the leanest set needs at 2048 tokens: fit's headroom takes 4% of it
    assert 0.9 * 2048 <= memory["predicted_longest"] < 2048 and not memory["judged"] and len(memory["probes"]) == 3
    assert memory["probes"][0]["tokens"] == memory["predicted_longest"]
    assert all(p["measured_mb"] > 0 and p["predicted_mb"] > 0 for p in memory["probes"])
    fsdp2 = [r for r in rows if r["check"] == "fsdp2_bf16"]  # torchtitan's bf16 policy, eager and compiled layers
    assert [r["compiled_layers"] for r in fsdp2] == [False, True] and not any(r.get("skipped") for r in fsdp2)
    assert {(r["entry"], r["compiled"]) for r in rows if r["check"] == "entry_bf16"} == {
        (e, c) for e in ("trainer", "accelerate", "sft", "grpo") for c in (False, True)}
    kernels = [r for r in rows if r["check"] == "kernels" and "layout" not in r]
    assert {r["kernel"] for r in kernels} == {"cpu_flash", "flex", "torch", "auto"}
    assert {r["feature"] for r in kernels} == {"dense causal", "documents", "padding", "window", "softcap", "sinks", "GQA"}
    assert [r for r in kernels if "refused" in r] == [r for r in kernels if r["kernel"] == "cpu_flash"
                                                      and r["feature"] == "softcap"]
    assert all("max_error" in r for r in kernels if "refused" not in r)
    layouts = [(r["layout"], r["head_groups"]) for r in rows if r["check"] == "kernels" and "layout" in r]
    assert sorted(layouts) == sorted((x, g) for x in ("zigzag", "contiguous", "striped") for g in (1, 2))
    ring = [r for r in rows if r["check"] == "ring"]
    assert {(r["mask"], r["P"], r["head_groups"]) for r in ring} == {
        (m, P, g) for m in ("dense", "documents", "window=128") for P in (2, 4) for g in ("one ring", "one per kv head")}
    assert all(r["efficiency"] > 0 and r["ops_per_rank_step"] > 0 and r["sync_free"] is None for r in ring)
    blocks = [r for r in rows if r["check"] == "blocks"]
    assert {r["mask"] for r in blocks} == {"dense", "documents", "window=128", "window=1024", "window=4096"}
    assert all(r["kernel"] == "cpu_flash" and r["ratio"] > 0 for r in blocks)
    compiled = [r for r in rows if r["check"] == "compiled"]
    assert {r["model"] for r in compiled} == {"tiny llama", "tiny qwen3_5"}  # the ring op, and the recurrent op
    assert all(r["graphs"] >= 1 for r in compiled)


@pytest.mark.slow  # three process trees; the state passing it measures is tested in test_hybrid_models
def test_hybrid_benchmark(tmp_path):
    """State passing and the head all-to-all on a gated DeltaNet layer, both against the unpatched
    layer on the same weights, their bytes counted."""
    records = bench("hybrid.py", "--N", "512", "--sizes", "2", "--reps", "1", out=tmp_path)
    assert [r["kind"] for r in records] == ["unpatched", "state", "heads"]
    assert all(r["max_err"] < SANE and r["ms"] > 0 and r["step_mb"] > 0 for r in records), records
    assert 0 < records[1]["sent_mb"] < records[2]["sent_mb"], records
    assert (tmp_path / "hybrid.png").exists()


@pytest.mark.slow  # two process trees; sharded generation and its cache are tested in test_generation
def test_generation_benchmark(tmp_path):
    # --longest (a doubling search of process trees) is left out here: the sharded cache's bytes are tested in
    # test_generation, and the search is the same measure() at other lengths
    records = bench("generation.py", "--N", "512", "--sizes", "2", "--reps", "1", "--new", "2", out=tmp_path)
    assert [(r["kind"], r["P"]) for r in records] == [("unpatched", 1), ("ringseq", 2)]
    assert records[1]["same_tokens"] and records[1]["kv_mb_per_rank"] * 2 == records[0]["kv_mb_per_rank"]
    assert all(r["prefill_ms"] > 0 and r["decode_tok_s"] > 0 for r in records)
    assert (tmp_path / "generation.png").exists()


@pytest.mark.slow  # two process trees; VLM generation is tested in test_vlm_generation
def test_generation_benchmark_on_a_vlm(tmp_path):
    records = bench("generation.py", "--model", "vlm", "--N", "512", "--sizes", "2", "--reps", "1", "--new", "2",
                    out=tmp_path)
    assert [(r["kind"], r["model"], r["P"]) for r in records] == [("unpatched", "vlm", 1), ("ringseq", "vlm", 2)]
    assert records[1]["same_tokens"] and records[1]["kv_mb_per_rank"] * 2 == records[0]["kv_mb_per_rank"]
    assert (tmp_path / "generation_vlm.png").exists()


@pytest.mark.slow  # three process trees; the VLM paths it times are tested in test_vlm
def test_vision_benchmark(tmp_path):
    records = bench("vision.py", "--N", "256", "--images", "2", "--sizes", "2", "--reps", "1", out=tmp_path)
    assert [(r["kind"], r["P"]) for r in records] == [("unpatched", 1), ("all", 2), ("split", 2)]
    assert all(r["ms"] > 0 and r["vision_ms"] > 0 for r in records)
    assert all(r["loss_diff"] <= 1e-5 * abs(records[0]["loss"]) for r in records[1:])
    assert (tmp_path / "vision.png").exists()


def test_balance_benchmark(tmp_path):
    records = bench("balance.py", "--N", "4096", "--sizes", "2", "4", "--rows", "2", out=tmp_path)
    assert {(r["mix"], r["P"], r["layout"]) for r in records} == {
        (m, P, lay) for m in ("pile", "prolong64k", "prolong512k") for P in (2, 4)
        for lay in ("balanced", "zigzag", "contiguous", "striped")}
    assert all(r["max_over_mean"] >= 1.0 and r["documents_per_row"] > 1 for r in records)
    for r in records:  # the row's own layout is never worse than zigzag
        if r["layout"] == "balanced":
            zigzag = next(x for x in records if x["layout"] == "zigzag" and (x["mix"], x["P"]) == (r["mix"], r["P"]))
            assert r["max_over_mean"] <= min(1.05, zigzag["max_over_mean"]), r
    assert (tmp_path / "balance.png").exists()


@pytest.mark.slow  # a process tree per mix and layout
def test_balance_benchmark_times_the_steps(tmp_path):
    records = bench("balance.py", "--N", "4096", "--sizes", "2", "--rows", "1", "--step-N", "1024", "--reps", "1",
                    out=tmp_path)
    steps = [r for r in records if "step_ms" in r]
    assert {(r["mix"], r["layout"]) for r in steps} == {
        (m, lay) for m in ("pile", "prolong64k", "prolong512k") for lay in ("balanced", "zigzag", "striped")}
    assert all(r["step_ms"] > 0 and r["work_max_over_mean"] >= 1.0 for r in steps)
    assert all(r["step_over_zigzag"] == 1.0 for r in steps if r["layout"] == "zigzag")
    assert (tmp_path / "balance_step.jsonl").exists()


@pytest.mark.slow  # six inductor compiles in three process trees (about 2 minutes); exactness: test_compiled.py
def test_compiled_benchmark(tmp_path):
    records = bench("compiled.py", "--n", "256", "--sizes", "2", "--reps", "1", "--rows", "2", out=tmp_path)
    speed = [r for r in records if "tokens_per_s" in r]
    assert [(r["system"], r["mode"]) for r in speed] == [(s, m) for s in ("unpatched", "ringseq")
                                                         for m in ("eager", "layers", "model")]
    assert all(r["tokens_per_s"] > 0 and r["graph_breaks"] == 0 and r["loss_vs_eager"] < 1e-4 for r in speed)
    lengths = [r for r in records if "graphs_after_each_row" in r]
    assert len(lengths) == 4 and all(r["graph_breaks"] == 0 and r["graphs_after_each_row"][-1] <= 2 for r in lengths)
    assert (tmp_path / "compiled.png").exists() and (tmp_path / "compiled.jsonl").exists()


@pytest.mark.slow  # the unpatched hybrid's inductor compiles unroll its chunked delta rule (about 3 minutes)
def test_compiled_benchmark_on_a_hybrid(tmp_path):
    records = bench("compiled.py", "speed", "--family", "qwen3_5", "--n", "256", "--sizes", "2", "--reps", "1",
                    out=tmp_path)
    assert [(r["system"], r["family"], r["mode"]) for r in records] == [
        (s, "qwen3_5", m) for s in ("unpatched", "ringseq") for m in ("eager", "layers", "model")]
    assert all(r["tokens_per_s"] > 0 and r["graph_breaks"] == 0 and r["loss_vs_eager"] < 1e-4 for r in records)
    assert all(r["graphs"] == (2 if r["mode"] == "layers" else 1) for r in records if r["mode"] != "eager")
    assert (tmp_path / "compiled_qwen3_5.png").exists()
