"""Vision-language models (``patches.vision``): the vision tower on the whole batch, the language
model on the ring; exact against the unpatched model at world 2 and 4."""
import pytest

from . import cases_vlm
from .vlm_models import VLMS


@pytest.mark.parametrize("family", VLMS)
def test_vlm_matches_unpatched(pool2, pool4, family):
    """Images on different ranks and across chunk edges (Gemma 3: bidirectional image blocks
    across them; Qwen3-VL: deepstack features of the image tokens each rank holds)."""
    pool2.run(cases_vlm.parity, family)
    pool4.run(cases_vlm.parity, family)


SPLIT = [f for f in VLMS if f not in ("idefics3", "smolvlm")]  # those two: pixels [rows, images, ...], refused


@pytest.mark.parametrize("family", SPLIT)
def test_split_vision_matches_unpatched(pool2, pool4, family):
    """Each rank encodes a share of the images; the gathered features and the vision tower's
    averaged gradients are the unpatched model's."""
    pool2.run(cases_vlm.parity, family, split=True)
    pool4.run(cases_vlm.parity, family, split=True)


def test_split_vision_shares_a_videos_frames(pool):
    """Qwen2.5-VL: a video's temporal patches go to different ranks beside the images; padding,
    and a length the layout pads at world 1 and 2. (Qwen3-VL puts timestamps between a video's
    frames, which these code-made rows do not.)"""
    pool.run(cases_vlm.parity, "qwen2_5_vl", S_per_rank=96 // pool.world_size, split=True, video=True, padded=True,
             short=0 if pool.world_size == 4 else 3)


def test_vlm_at_world_1_2_4_padded_with_a_length_the_layout_pads(pool):
    pool.run(cases_vlm.parity, "qwen3_vl", S_per_rank=64 // pool.world_size, padded=True, short=3)


def test_vlm_refusals(pool):
    pool.run(cases_vlm.refusals)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_vlm_under_ulysses_x_ring(pool4, family):
    """Ulysses 2 x ring 2: mRoPE rows and Gemma 3's image blocks over the hybrid group."""
    pool4.run(cases_vlm.parity, family, ulysses=2)
