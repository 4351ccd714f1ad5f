"""``ringseq.planner.fit``: the set of switches fit picks, its buckets and its refusals (pure Python)."""
import dataclasses

import pytest

import ringseq
from ringseq.planner import fit, hardware, model_spec

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
BENCH = dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)  # benchmarks/longest.py's Llama
MB = 2**20


def cpu(P=2, **kw):
    return fit.Setting(spec=model_spec(BENCH), hw=hardware("cpu"), zero_stage=1, ring=P, gpus=P, per_node=P, **kw)


def gpu(P=8):
    return fit.Setting(spec=model_spec(LLAMA_8B), hw=hardware("h100"), zero_stage=3, ring=P, gpus=P, per_node=8,
                       may_offload=True)


@pytest.mark.parametrize("S", [2048, 8192, 16384, 22528])
def test_the_choice_is_the_fastest_set_that_fits(S):
    setting, budget = cpu(), 448 * MB
    every = fit.costed(setting, S, 1)
    best = fit.choose(setting, S, 1, budget)
    fitting = [c for c in every if c.predicted_peak_bytes <= budget * (1 - fit.HEADROOM)]  # the planner's error
    assert best is not None and best.predicted_peak_bytes <= budget * 0.96 and fit.HEADROOM == 0.04
    assert fit.choose(setting, S, 1, best.predicted_peak_bytes) != best  # a budget of its prediction leaves no room
    assert all(best.predicted_step_s <= c.predicted_step_s for c in fitting)
    assert len({c.switches for c in every}) == len(every) == len(fit.candidates(setting))


def test_longer_sequences_turn_on_more_switches():
    setting, budget = cpu(), 448 * MB
    chosen = [fit.choose(setting, S, 1, budget) for S in (2048, 16384, 22528)]
    assert not chosen[0].switches.checkpointing and not chosen[0].switches.tiled_mlp
    assert chosen[1].switches.checkpointing and chosen[1].switches.keep_ring_outputs
    assert not chosen[2].switches.keep_ring_outputs  # only the replayed ring fits there
    assert [c.predicted_step_s for c in chosen] == sorted(c.predicted_step_s for c in chosen)
    roomy = fit.choose(setting, 24576, 1, 1e12)
    assert roomy.switches == fit.Switches()  # with memory to spare: chunked loss alone, the fastest


def test_a_budget_no_set_fits_is_refused_with_the_longest_that_fits():
    setting, budget = cpu(), 448 * MB
    assert fit.choose(setting, 65536, 1, budget) is None
    longest = fit.longest(setting, 1, budget, 65536)
    g = fit.grain(setting)
    assert longest % g == 0 and fit.choose(setting, longest, 1, budget) is not None
    assert fit.choose(setting, longest + g, 1, budget) is None
    text = fit.refusal(setting, 65536, 1, budget)
    assert f"The longest length that fits is {longest} tokens" in text
    need = fit.least(setting, 65536, 1).predicted_peak_bytes
    assert f"a memory_budget of at least {need / 0.96 / MB:.0f} MiB" in text and "sp_size 8" in text
    assert "4% of it kept free for the planner's error" in text


def test_offload_of_kept_tensors_only_where_the_host_is_apart():
    assert not any(s.offload_activations for s in fit.candidates(cpu()))
    setting, S = gpu(), 1 << 20
    lean = dataclasses.replace(fit.least(setting, S, 1).switches, offload_activations=False)
    on = fit.cost(setting, dataclasses.replace(lean, offload_activations=True), S, 1)
    off = fit.cost(setting, lean, S, 1)
    assert on.predicted_peak_bytes < off.predicted_peak_bytes and on.predicted_step_s > off.predicted_step_s
    chosen = fit.choose(setting, S, 1, (on.predicted_peak_bytes + off.predicted_peak_bytes) / 2)
    assert chosen.switches.offload_activations


def test_the_planner_costs_offload_and_tiles():
    common = dict(model=LLAMA_8B, seq_len=262144, gpus=8, hardware="h100", checkpointing=True)
    kept = ringseq.plan(**common)
    gone = ringseq.plan(**common, offload_activations=True)
    assert gone.modes[0].memory_gb["activations"] < kept.modes[0].memory_gb["activations"]
    assert gone.step_time_s > kept.step_time_s
    tiled = ringseq.plan(**common, tiled_mlp=8)
    assert tiled.step_time_s > kept.step_time_s  # the MLP's forward once more


@pytest.mark.parametrize("grain", [1, 4, 16])
def test_buckets_cover_each_length_within_an_eighth_of_a_doubling(grain):
    tops = []
    for S in range(1, 70000, 37):
        top = fit.bucket(S, grain)
        assert top >= S and top % grain == 0 and fit.bucket(top, grain) == top
        assert top <= max(grain, -(-int(S * 2 ** (1 / fit.STEPS) + 1) // grain) * grain), (S, top)
        tops.append(top)
    assert tops == sorted(tops) and len(set(tops)) < len(tops) / 10


def _budget_of(setting, memory_budget=None):
    import types

    from ringseq.patches import fit as fitting

    model = types.SimpleNamespace(_ringseq_patch=types.SimpleNamespace(fit=fitting.Fit(memory_budget=memory_budget)))
    return fitting._own_budget(model, setting)


def test_the_default_budget_on_a_gpu_is_free_memory_less_the_stated_margin(monkeypatch):
    """No GPU here: CUDA's memory queries stood in for. Free memory (with the caching allocator's
    unused blocks) less 5% of the device and the Adam state torch makes at its first step."""
    import torch

    from ringseq.patches import fit as fitting
    from ringseq.planner.memory import states

    GiB = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 7 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 5 * GiB)
    setting = gpu()
    adam = states(setting.spec, setting.features(fit.Switches(), 1, 1), setting.hw.bytes, setting.gpus)["optimizer"]
    assert adam > 0
    assert _budget_of(setting) == pytest.approx(62 * GiB - fitting.MARGIN * 80 * GiB - adam)
    assert _budget_of(setting, 12345) == 12345.0  # memory_budget wins
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert fitting._preset() == "h200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    assert fitting._preset() == "h100"


def test_the_default_budget_on_cpu_shares_the_available_memory():
    from ringseq.patches import fit as fitting

    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    got = _budget_of(cpu(P=2))
    assert got == pytest.approx(available * (1 - fitting.MARGIN) / 2, rel=0.05)  # the host's memory moves a little
