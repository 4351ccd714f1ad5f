"""model.generate on a patched vision-language model: the multimodal prompt prefilled with the
model's own code and the language model on the ring, the cache sharded, tokens equal to the
unpatched model's on every rank."""
import pytest

from . import cases_vlm_generation as cases
from .vlm_models import VLMS


@pytest.mark.parametrize("family", VLMS)
def test_vlm_greedy_matches_unpatched(pool2, pool4, family):
    """Every family the training path takes: mRoPE with its rope deltas (Qwen), DeepStack (Qwen3-VL),
    a hybrid language model's recurrent state (Qwen3.5), bidirectional image blocks and windows
    (Gemma 3), plain positions (LLaVA, Idefics3, SmolVLM); one row left-padded; a length the
    layout pads."""
    pool2.run(cases.greedy, family)
    pool4.run(cases.greedy, family, S_per_rank=24)


def test_vlm_greedy_with_a_video_and_split_vision(pool2, pool4):
    """Qwen2.5-VL: a video beside the images, each rank encoding a share of them."""
    pool2.run(cases.greedy, "qwen2_5_vl", split=True, video=True)
    pool4.run(cases.greedy, "qwen2_5_vl", S_per_rank=24, split=True, video=True)


def test_vlm_greedy_split_vision_deepstack(pool2):
    pool2.run(cases.greedy, "qwen3_vl", split=True)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_vlm_greedy_under_ulysses_x_ring(pool4, family):
    pool4.run(cases.greedy, family, S_per_rank=24, ulysses=2)


def test_vlm_sampling_agrees_across_ranks(pool2, pool4):
    pool2.run(cases.sampling, "qwen3_vl")
    pool4.run(cases.sampling, "gemma3", S_per_rank=24)


def test_vlm_greedy_at_world_1_and_other_layouts(pool):
    pool.run(cases.greedy, "qwen2_5_vl", S_per_rank=64 // pool.world_size, layout="contiguous")


def test_vlm_generation_refusals(pool):
    pool.run(cases.refusals)
