"""ringseq.plan: inputs (config object, dict, config.json), fields, memory features, errors, CLI."""
import ast
import json
import pathlib
import subprocess
import sys

import pytest

import ringseq
from ringseq.planner import Plan, hardware, presets

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
CLUSTER = dict(seq_len=1_000_000, gpus=64, gpus_per_node=8, hardware="h100")


def test_config_object_dict_and_path_give_the_same_plan(tmp_path):
    from transformers.models.llama.configuration_llama import LlamaConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_8B))
    plans = [ringseq.plan(model=m, **CLUSTER) for m in (LLAMA_8B, LlamaConfig(**LLAMA_8B), str(path), tmp_path)]
    assert all(isinstance(p, Plan) for p in plans)
    assert len({(p.step_time_s, p.memory_per_rank_gb) for p in plans}) == 1


def test_one_mode_per_shape_that_splits_the_heads_and_the_fastest_fitting_one_is_recommended():
    p = ringseq.plan(model=LLAMA_8B, **CLUSTER, checkpointing=True)
    shapes = {(e.ulysses, e.ring) for e in p.modes}
    # 32 query / 8 kv heads: Ulysses 1, 2, 4, 8, 16, 32 (16 and 32 replicate kv heads), never 64
    assert shapes == {(u, 64 // u) for u in (1, 2, 4, 8, 16, 32)}
    fitting = [e for e in p.modes if e.memory_per_rank_gb <= 80]
    best = min(fitting, key=lambda e: e.step_time_s)
    assert (p.recommendation.ulysses, p.recommendation.ring) == (best.ulysses, best.ring)
    assert p.step_time_s == best.step_time_s and p.memory_per_rank_gb == best.memory_per_rank_gb
    assert p.recommendation.mode in p.recommendation.reason and p.fits
    for e in p.modes:
        assert 0 < e.efficiency <= 1 and e.exposed_comm_s >= 0 and e.step_time_s > 0
        assert e["ring"] == e.ring  # readable as a mapping too
    assert json.loads(json.dumps(p.to_dict()))["recommendation"]["mode"] == p.recommendation.mode


def test_memory_features_and_zero_stages_lower_memory_in_order():
    def mem(**kw):
        return ringseq.plan(model=LLAMA_8B, **CLUSTER, **kw).memory_per_rank_gb

    stages = [mem(zero_stage=z) for z in (0, 1, 2, 3)]
    assert stages == sorted(stages, reverse=True) and stages[0] - stages[3] > 100  # 8B x 16 bytes is 120 GB
    plain = mem()
    assert mem(checkpointing=True) < mem(tiled_mlp=4) < plain
    assert mem(checkpointing=True, tiled_mlp=4) < mem(checkpointing=True)  # the last layer's recompute is the peak
    # a step's peak is one moment, not a sum: the loss's backward comes before any layer gradient
    p = ringseq.plan(model=LLAMA_8B, **{**CLUSTER, "gpus": 8}, zero_stage=0, checkpointing=True)
    assert p.modes[0].memory_gb["grads"] < 0.1 * p.modes[0].memory_gb["activations"]
    assert mem(chunked_loss=False) > plain and mem(offload=True) < plain
    assert ringseq.plan(model=LLAMA_8B, **{**CLUSTER, "gpus": 128}).memory_per_rank_gb < plain


def test_head_groups_trade_launches_and_latencies_for_the_ring_backwards_memory():
    """One ring per kv head: each ring step's launches and link latency paid per group (most where
    shards are short), the ring backward's buffers held per group (the peak falls where the ring
    backward is it)."""
    def ring(S, **kw):
        p = ringseq.plan(model=LLAMA_8B, seq_len=S, gpus=8, gpus_per_node=8, hardware="h100", zero_stage=3, **kw)
        return next(e for e in p.modes if e.ulysses == 1)

    for S in (32768, 131072):
        one, per_kv = ring(S), ring(S, head_groups="kv")
        assert per_kv.attention_s > one.attention_s and ring(S, head_groups=2).attention_s < per_kv.attention_s
        assert per_kv.memory_per_rank_gb <= one.memory_per_rank_gb
    short = ring(32768, head_groups="kv").attention_s / ring(32768).attention_s
    long = ring(131072, head_groups="kv").attention_s / ring(131072).attention_s
    assert short > long > 1.0  # the per-step costs weigh where shards are short
    # docs/memory.md's 47M Llama at P = 4 near its longest N: the ring backward is the peak
    bench = dict(model=dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4), seq_len=40448, gpus=4, gpus_per_node=4,
                 hardware="cpu", zero_stage=1, checkpointing=True, tiled_mlp=20)

    def step_gb(**kw):  # what a step adds to the state held between steps (longest.py's step memory)
        parts = ringseq.plan(**bench, **kw).modes[0].memory_gb
        return parts["grads"] + parts["activations"] + parts["transient"]
    assert step_gb(head_groups="kv") < 0.95 * step_gb()
    with pytest.raises(ringseq.RingSeqError, match="head_groups must be"):
        ringseq.plan(model=LLAMA_8B, **CLUSTER, head_groups=0)


def test_replaying_the_ring_keeps_the_layer_input_alone_and_runs_the_ring_forward_again(tmp_path, capsys):
    """``keep_ring_outputs=False`` under checkpointing (``ringseq.patch``'s): each layer keeps its
    input alone instead of its input, ring output and log-sum-exp, and the recompute runs the ring
    forward once more; without checkpointing there is nothing to replay. (Measured against
    longest.py's replay probes in test_planner_measured.py.)"""
    bench = dict(model=dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4), seq_len=24576, gpus=2, gpus_per_node=2,
                 hardware="cpu", zero_stage=1, tiled_mlp=24)

    def mode(**kw):
        return ringseq.plan(**bench, **kw).modes[0]

    keep, replay = mode(checkpointing=True), mode(checkpointing=True, keep_ring_outputs=False)
    m, s = bench["model"], 24576 // 2
    kept_gb = m["num_hidden_layers"] * s * m["num_attention_heads"] * (m["hidden_size"] // 8 * 4 + 8) / 2**30
    assert keep.memory_gb["activations"] - replay.memory_gb["activations"] == pytest.approx(kept_gb, rel=1e-6)
    once = ringseq.plan(**bench, checkpointing=True, training=False).modes[0].attention_s
    assert replay.attention_s - keep.attention_s == pytest.approx(once, rel=1e-6)
    assert mode(keep_ring_outputs=False) == mode()
    from ringseq.launch.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(bench["model"]))
    args = ["plan", "--model", str(config), "--seq-len", "24576", "--gpus", "2", "--gpus-per-node", "2", "--hardware",
            "cpu", "--zero-stage", "1", "--tiled-mlp", "24", "--json"]
    assert main(args + ["--checkpointing", "--replay-ring"]) == 0
    planned = ringseq.plan(**bench, checkpointing=True, keep_ring_outputs=False)
    assert json.loads(capsys.readouterr().out)["memory_per_rank_gb"] == pytest.approx(planned.memory_per_rank_gb)
    assert main(args + ["--replay-ring"]) == 2
    assert "add --checkpointing" in capsys.readouterr().err


def test_slower_links_expose_more_communication_and_faster_chips_need_longer_blocks():
    ring = dict(model=LLAMA_8B, seq_len=131072, gpus=64, gpus_per_node=8, ulysses_size=1)
    fast, slow = ringseq.plan(**ring), ringseq.plan(**ring, inter_gbps=2)
    assert slow.step_time_s > fast.step_time_s and slow.modes[0].exposed_comm_s > fast.modes[0].exposed_comm_s
    assert slow.min_tokens_per_rank_for_overlap > 10 * fast.min_tokens_per_rank_for_overlap
    assert ringseq.plan(**ring, tflops=2000).min_tokens_per_rank_for_overlap > fast.min_tokens_per_rank_for_overlap
    # zigzag computes half a block per step: twice the block a full (non-causal) step would need
    import dataclasses

    from ringseq.planner.cost import overlap_block

    hw = dataclasses.replace(hardware("h100"), inter_latency_us=0)

    assert overlap_block(hw, 32, 8, 128, share=0.5, inter=True, training=False) == pytest.approx(
        2 * overlap_block(hw, 32, 8, 128, share=1.0, inter=True, training=False), rel=0.01)


@pytest.mark.parametrize("kwargs, words", [
    (dict(gpus=12), "whole number of nodes"),
    (dict(hardware="tpu-v9"), "unknown hardware"),
    (dict(ulysses_size=64), "ulysses_size 64 cannot split"),
    (dict(sp_size=48), "does not divide gpus"),
    (dict(layout="spiral"), "unknown layout"),
    (dict(zero_stage=4), "zero_stage"),
    (dict(inter_gbps=-1), "must be a positive finite number"),
    (dict(seq_len=0), "positive integer"),
])
def test_bad_inputs_raise_ringseq_error_saying_what_to_change(kwargs, words):
    with pytest.raises(ringseq.RingSeqError, match=words):
        ringseq.plan(model=LLAMA_8B, **{**CLUSTER, **kwargs})


def test_configs_without_the_needed_fields_are_refused(tmp_path):
    with pytest.raises(ringseq.RingSeqError, match="lacks"):
        ringseq.plan(model={"hidden_size": 64}, **CLUSTER)
    with pytest.raises(ringseq.RingSeqError, match="no model config"):
        ringseq.plan(model=str(tmp_path / "missing.json"), **CLUSTER)


def test_presets_are_data_and_the_planner_imports_no_torch():
    assert {"h100", "h200", "a100", "cpu"} <= set(presets())
    assert hardware("h200").memory_gb > hardware("h100").memory_gb
    for path in pathlib.Path(ringseq.planner.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path.name} imports torch"
    assert ringseq.plan is ringseq.planner.predict.plan and "plan" in ringseq.__all__


def test_cli_prints_the_plan_as_json_in_a_real_subprocess(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    out = subprocess.run([sys.executable, "-m", "ringseq.launch.cli", "plan", "--model", str(config), "--seq-len",
                          "1000000", "--gpus", "64", "--gpus-per-node", "8", "--hardware", "h100", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    expect = ringseq.plan(model=str(config), **CLUSTER)
    assert got["step_time_s"] == pytest.approx(expect.step_time_s)
    assert got["recommendation"]["mode"] == expect.recommendation.mode
    assert len(got["modes"]) == len(expect.modes)


def test_cli_table_overrides_and_errors(tmp_path, capsys):
    from ringseq.launch.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    args = ["plan", "--model", str(config), "--seq-len", "1000000", "--gpus", "64"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert ringseq.plan(model=LLAMA_8B, **CLUSTER).recommendation.cli_reason in table
    assert main(args + ["--inter-gbps", "1", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["hardware"] == "h100+custom"
    assert slow["step_time_s"] > ringseq.plan(model=LLAMA_8B, **CLUSTER).step_time_s
    assert main(args + ["--gpus", "12"]) == 2
    assert "whole number of nodes" in capsys.readouterr().err


def test_a_plan_that_does_not_fit_names_each_fix_that_alone_is_enough():
    """Llama-3-8B at 1M tokens on 64 H100: no shape fits as asked, checkpointing alone is enough."""
    p = ringseq.plan(model=LLAMA_8B, **CLUSTER)
    assert not p.fits and p.memory_per_rank_gb > 80
    rec = p.recommendation
    assert rec.reason.startswith("no shape fits in 80 GiB per rank") and "recommended" not in rec.reason
    assert "checkpointing=True alone is enough" in rec.reason and "--" not in rec.reason
    assert "--checkpointing alone is enough" in rec.cli_reason and "=True" not in rec.cli_reason
    singles = [f.changes for f in rec.fixes if "gpus" not in f.changes]
    assert {"checkpointing": True} in singles and all(len(c) == 1 for c in singles)
    for fix in rec.fixes:  # each fix, applied, fits at the memory and with the shape it states
        fixed = ringseq.plan(model=LLAMA_8B, **{**CLUSTER, **fix.changes})
        assert fixed.fits and fixed.recommendation.mode == fix.mode
        assert fixed.memory_per_rank_gb == pytest.approx(fix.memory_per_rank_gb)
    assert [f.changes for f in rec.fixes if "gpus" in f.changes] == [{"gpus": 128}]  # 64 alone fits no shape
    assert json.loads(json.dumps(p.to_dict()))["recommendation"]["fixes"][0]["changes"]
    assert ringseq.plan(model=LLAMA_8B, **CLUSTER, checkpointing=True).recommendation.fixes == ()


def test_when_nothing_fits_no_shape_is_called_recommended(tmp_path, capsys):
    from ringseq.launch.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    huge = dict(seq_len=2**27, gpus=8, gpus_per_node=8)
    p = ringseq.plan(model=LLAMA_8B, **huge)
    assert not p.fits and p.recommendation.fixes == ()
    assert main(["plan", "--model", str(config), "--seq-len", "128M", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "recommended" not in out and "no shape fits in 80 GiB per rank" in out
    assert "shorten the sequence or use devices with more memory" in out
    # fitting as asked, the same words say "recommended"
    assert main(["plan", "--model", str(config), "--seq-len", "1M", "--gpus", "64", "--checkpointing"]) == 0
    assert "\nrecommended: " in capsys.readouterr().out


def test_cli_advice_names_its_flags_and_the_one_flag_that_is_enough(tmp_path, capsys):
    from ringseq.launch.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    assert main(["plan", "--model", str(config), "--seq-len", "1000000", "--gpus", "64", "--gpus-per-node", "8",
                 "--hardware", "h100"]) == 0
    advice = capsys.readouterr().out.splitlines()[-1]
    assert advice == ringseq.plan(model=LLAMA_8B, **CLUSTER).recommendation.cli_reason
    assert "--checkpointing alone is enough" in advice and "--gpus 128 is enough" in advice
    assert not any(word in advice for word in ("checkpointing=", "tiled_mlp", "recommended"))
    # the flags it names are this command's: with the one it says is enough, the plan fits
    assert main(["plan", "--model", str(config), "--seq-len", "1000000", "--gpus", "64", "--checkpointing"]) == 0
    assert "recommended: " in capsys.readouterr().out


def test_fixes_are_spelled_as_keywords_for_python_and_as_flags_for_the_command():
    from ringseq.planner.predict import flags, keywords

    changes = {"checkpointing": True, "tiled_mlp": 4, "zero_stage": 3, "gpus": 256, "sp_size": 64}
    assert keywords(changes) == "checkpointing=True, tiled_mlp=4, zero_stage=3, gpus=256, sp_size=64"
    assert flags(changes) == "--checkpointing --tiled-mlp 4 --zero-stage 3 --gpus 256 --sp-size 64"


def test_no_single_switch_enough_names_the_fewest_together():
    """Llama-3-8B at 1M (binary) tokens on 8 H100 under ZeRO-1: only two switches together fit."""
    from ringseq.planner.predict import flags

    p = ringseq.plan(model=LLAMA_8B, **{**CLUSTER, "seq_len": 2**20, "gpus": 8}, zero_stage=1)
    together = [f.changes for f in p.recommendation.fixes if "gpus" not in f.changes]
    assert not p.fits and together and all(len(c) == 2 for c in together)
    assert "no single switch is enough" in p.recommendation.cli_reason
    assert f"; {flags(together[0])} together are enough" in p.recommendation.cli_reason
    assert ringseq.plan(model=LLAMA_8B, **{**CLUSTER, "seq_len": 2**20, "gpus": 8}, zero_stage=1,
                        **together[0]).fits


def _qwen35(**extra):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                             num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                             linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, **extra)


def test_a_hybrid_is_costed_both_ways_from_its_layer_pattern():
    """Qwen3.5's pattern (three gated DeltaNet layers in four): the planner reads layer_types, costs
    the recurrent layers by state passing (what ringseq runs) and by the head all-to-all, whose bytes
    grow with the sequence and which needs P to divide the 16 key heads."""
    from ringseq.planner import model_spec

    spec = model_spec(_qwen35())
    assert (spec.recurrent.kind, spec.recurrent.layers, spec.attention_layers) == ("delta", 18, 6)
    best = {}
    for S in (262_144, 1_048_576):
        for P in (8, 64):
            p = ringseq.plan(model=_qwen35(), seq_len=S, gpus=P, gpus_per_node=8, checkpointing=True)
            e = next(m for m in p.modes if m.name == p.recommendation.mode)
            best[S, P] = e.recurrent
            assert e.recurrent_s == e.recurrent["state"]["time_s"] > 0
    assert best[262_144, 8]["heads"]["possible"] and not best[262_144, 64]["heads"]["possible"]
    state = [best[S, 8]["state"]["sent_gb_per_rank"] for S in (262_144, 1_048_576)]
    heads = [best[S, 8]["heads"]["sent_gb_per_rank"] for S in (262_144, 1_048_576)]
    assert state[0] == pytest.approx(state[1]) and heads[1] == pytest.approx(4 * heads[0], rel=0.01)
    assert state[1] < heads[1] / 10


def test_mamba_and_short_convolution_hybrids_are_read_too():
    from transformers import BambaConfig, Lfm2Config

    from ringseq.planner import model_spec

    bamba = model_spec(BambaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=8, attn_layer_indices=[3, 7], mamba_n_heads=16,
                                   mamba_d_state=64))
    assert (bamba.recurrent.kind, bamba.recurrent.layers, bamba.recurrent.rows) == ("mamba2", 6, 64)
    lfm2 = model_spec(Lfm2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=8, layer_types=["conv", "conv", "full_attention", "conv"]))
    assert (lfm2.recurrent.kind, lfm2.recurrent.layers) == ("conv", 3)
    p = ringseq.plan(model=lfm2, seq_len=65_536, gpus=4, gpus_per_node=4)
    assert all(m.recurrent_s > 0 for m in p.modes)


def test_a_prefill_holds_the_cache_it_fills():
    """training=False: the prefill's memory includes the generation cache of the rank's tokens
    (keys and values of every attention layer; the formula is checked against the cache generate
    leaves in tests/integration/test_generation.py)."""
    llama = dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                 num_key_value_heads=8, vocab_size=128256)
    p = ringseq.plan(model=llama, seq_len=1 << 20, gpus=128, gpus_per_node=8, hardware="h100", training=False)
    per_rank_tokens = (1 << 20) // 128
    for mode in p.modes:
        assert mode.memory_gb["kv_cache"] == pytest.approx(126 * 2 * 8 * 128 * 2 * per_rank_tokens / 2**30)
    trained = ringseq.plan(model=llama, seq_len=1 << 20, gpus=128, gpus_per_node=8, hardware="h100")
    assert all(mode.memory_gb["kv_cache"] == 0.0 for mode in trained.modes)
