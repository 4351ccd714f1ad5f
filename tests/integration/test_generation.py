"""model.generate on a patched model: prompts prefilled through the ring, the cache sharded,
tokens equal to the unpatched model's on every rank."""
import pytest

from . import cases_generation as cases


@pytest.mark.parametrize("family,layout", [("llama", "zigzag"), ("mistral", "contiguous"), ("gemma2", "zigzag"),
                                           ("gpt_oss", "striped"), ("qwen3_5", "zigzag"), ("bamba", "contiguous")])
def test_greedy_matches_unpatched(pool2, pool4, family, layout):
    """GQA (llama), a window on every layer (mistral), softcaps and alternating windows (gemma2),
    sinks (gpt-oss), hybrids (gated DeltaNet, Mamba2): prompts of a few hundred tokens, one row
    left-padded, at world 2 and 4."""
    pool2.run(cases.greedy, family, layout, 301)
    pool4.run(cases.greedy, family, layout, 257)


def test_greedy_under_ulysses_x_ring(pool4):
    pool4.run(cases.greedy, "llama", "zigzag", 203, 6, 2)


def test_sampling_agrees_across_ranks(pool2, pool4):
    pool2.run(cases.sampling, "llama", 150)
    pool4.run(cases.sampling, "qwen3_5", 130)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_training_step_after_generate_is_exact(pool2, family):
    pool2.run(cases.train_after_generate, family)


def test_what_cannot_be_generated_exactly_is_refused(pool2):
    pool2.run(cases.refusals)


@pytest.mark.parametrize("order", ["patch_then_peft", "peft_then_patch"])
def test_peft_models_generate_as_unpatched(pool2, order):
    pool2.run(cases.peft_generate, order)
