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
