"""The planner at GPU scale: host memory per node as a bound, ``--offload-activations``, the longest sequence that
fits (``ringseq.planner.longest``, ``ringseq plan --longest``)."""
import dataclasses
import json

import pytest

import ringseq
from ringseq.planner import fit, hardware, longest, model_spec, presets

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
NODE = dict(model=LLAMA_8B, gpus=8, gpus_per_node=8, hardware="h100")
LEAN = dict(checkpointing=True, keep_ring_outputs=False, tiled_mlp=64, offload=True)
GIB = 2**30


def test_every_preset_bounds_the_host():
    for name, preset in presets().items():
        assert 0 < preset["host_memory_gb"] < float("inf"), name
    mine = hardware("cpu", host_memory_gb=100)
    assert mine.host_memory_gb == 100 and mine.name == "cpu"  # the node's memory: the device's rates stay the preset's
    for bad in (0, -1, float("inf"), float("nan"), "64"):
        with pytest.raises(ringseq.RingSeqError, match="host_memory_gb must be a positive finite number"):
            hardware("h100", host_memory_gb=bad)
    unbounded = dataclasses.replace(hardware("h100"), host_memory_gb=float("inf"))
    p = ringseq.plan(**{**NODE, "hardware": unbounded}, seq_len=1 << 20, checkpointing=True)
    assert p.host_limit_gb == float("inf") and p.to_dict()["host_limit_gb"] is None
    json.dumps(p.to_dict(), allow_nan=False)


def test_host_memory_is_what_the_node_offloads():
    """Counted by hand: a pure ring of 8 (one node), replaying the ring, so each layer keeps its input alone
    (d elements per token, bf16); ZeRO-Offload keeps the fp32 master weights, Adam's m and v and the fp32 gradients
    of a rank's shard (16 bytes per parameter) and under ZeRO-3 the shard's bf16 weights."""
    S = 1 << 20
    p = ringseq.plan(**NODE, seq_len=S, ulysses_size=1, offload_activations=True, **LEAN)
    ring = next(e for e in p.modes if e.ulysses == 1)
    N, d, L = model_spec(LLAMA_8B).params, 4096, 32
    per_rank = L * d * 2 * (S / 8) + 16 * N / 8 + 2 * N / 8
    assert ring.host_memory_per_node_gb == pytest.approx(8 * per_rank / GIB, rel=1e-9)
    assert ringseq.plan(**NODE, seq_len=S, **{**LEAN, "offload": False}).host_memory_per_node_gb == 0


def test_a_step_that_overfills_the_host_does_not_fit_and_says_why():
    S = 5 << 20
    kw = dict(NODE, seq_len=S, offload_activations=True, **LEAN)
    roomy = ringseq.plan(**kw, host_memory_gb=10_000)
    assert roomy.fits and roomy.host_memory_per_node_gb > 1000
    tight = ringseq.plan(**kw, host_memory_gb=1000)
    assert not tight.fits and tight.memory_per_rank_gb == roomy.memory_per_rank_gb
    assert "1000 GiB of host memory per node" in tight.recommendation.reason
    # a fix offloads kept tensors only under checkpointing (asked, or in the same fix), and only where the host
    # holds them
    for asked in (dict(checkpointing=True), dict()):
        rec = ringseq.plan(**NODE, seq_len=3 << 20, **asked).recommendation
        offloading = [f.changes for f in rec.fixes if "offload_activations" in f.changes]
        assert offloading and all(asked or "checkpointing" in c for c in offloading), rec.fixes
        for f in rec.fixes:
            fixed = ringseq.plan(**{**NODE, "seq_len": 3 << 20, **asked, **f.changes})
            assert fixed.fits and fixed.host_memory_per_node_gb <= fixed.host_limit_gb
    with pytest.raises(ringseq.RingSeqError, match="add checkpointing=True"):
        ringseq.plan(**NODE, seq_len=S, offload_activations=True)
    with pytest.raises(ringseq.RingSeqError, match="a forward alone"):
        ringseq.plan(**NODE, seq_len=S, offload_activations=True, checkpointing=True, training=False)


@pytest.mark.parametrize("switches", [dict(checkpointing=True), dict(LEAN, offload_activations=True),
                                      dict(checkpointing=True, ulysses_size=1, zero_stage=1)],
                         ids=["checkpointing", "offload_all", "ring_zero1"])
def test_longest_is_the_last_length_that_fits(switches):
    got = longest(**NODE, **switches)
    S = got.seq_len
    grain = 16  # the zigzag ring of 8 splits multiples of 2 x 8 tokens, whatever the Ulysses degree
    assert got.fits and S == round(got.tokens_per_rank * got.sp_size) and S % grain == 0
    assert all(S % (2 * e.ring * e.ulysses) == 0 for e in got.modes)
    assert not ringseq.plan(**NODE, **switches, seq_len=S + grain).fits
    capped = longest(**NODE, **switches, up_to=S // 3)
    assert capped.seq_len == S // 3 // grain * grain
    assert longest(**NODE, **switches, up_to=grain - 1) is None  # not even one grain
    assert longest(**{**NODE, "hardware": hardware("h100", host_memory_gb=1e-3)}, **LEAN) is None
    for bad in (1e6, 0, True):
        with pytest.raises(ringseq.RingSeqError, match="up_to must be a positive whole number"):
            longest(**NODE, **switches, up_to=bad)
    with pytest.raises(TypeError, match="needs the keywords"):
        longest(model=LLAMA_8B)


def test_fit_never_offloads_past_the_host():
    """``patch(fit=True)`` on a GPU: a set that offloads its kept tensors is chosen only while the node's host holds
    them."""
    def setting(host_gb):
        return fit.Setting(spec=model_spec(LLAMA_8B), hw=hardware("h100", host_memory_gb=host_gb), zero_stage=3,
                           ring=8, gpus=8, per_node=8, may_offload=True)

    S, budget = 1 << 21, 60 * GIB
    chosen = fit.choose(setting(1e6), S, 1, budget)
    assert chosen.switches.offload_activations
    kept = fit.cost(setting(1e6), dataclasses.replace(chosen.switches, offload_activations=False), S, 1)
    assert kept.predicted_peak_bytes > budget  # offloading is what fits it
    assert fit.choose(setting(10), S, 1, budget) is None


def test_cli_longest_and_offload_flags(tmp_path, capsys):
    from ringseq.launch.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    base = ["plan", "--model", str(config), "--gpus", "8", "--checkpointing"]
    assert main(base + ["--longest", "--replay-ring", "--tiled-mlp", "64", "--offload", "--offload-activations"]) == 0
    out = capsys.readouterr().out
    want = longest(**NODE, **LEAN, offload_activations=True)
    assert f"longest sequence that fits: {want.seq_len} tokens" in out
    assert "host GiB/node" in out and want.recommendation.cli_reason in out
    assert main(base + ["--longest", "--host-memory-gb", "200", "--offload", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_limit_gb"] == 200
    assert main(base + ["--longest", "--host-memory-gb", "64", "--offload", "--json"]) == 1  # 18 B x 8B parameters
    got = capsys.readouterr()
    assert json.loads(got.out) is None and "not even the shortest sequence" in got.err
    for wrong, says in ((["--seq-len", "1M", "--longest"], "not both"), ([], "give --seq-len"),
                        (["--seq-len", "1M", "--offload-activations"], None)):
        args = base + wrong if says else ["plan", "--model", str(config), "--gpus", "8"] + wrong
        assert main(args) == 2
        assert (says or "add --checkpointing") in capsys.readouterr().err
