"""Documents, padding, windows, softcap, sinks, bidirectional blocks and Ulysses against a float64 dense reference."""
import pytest

from ringseq import LAYOUTS

from . import cases_features as cases


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_features_match_reference(pool, layout, dtype):
    pool.run(cases.feature_matrix, layout, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_autocast_casts_like_sdpa(pool, layout, dtype):
    pool.run(cases.autocast_matrix, layout, dtype)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_features_under_hybrid(pool4, layout):
    pool4.run(cases.feature_matrix, layout, "fp32", ulysses_size=2)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ulysses_and_hybrid_heads(pool2, pool4, layout):
    pool2.run(cases.ulysses_heads, layout)  # Ulysses 2
    pool4.run(cases.ulysses_heads, layout)  # hybrid 2 x 2 and Ulysses 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bidirectional_blocks_match_reference(pool, layout):
    pool.run(cases.block_matrix, layout)


def test_bidirectional_blocks_under_hybrid(pool4):
    pool4.run(cases.block_matrix, "zigzag", ulysses_size=2)


def test_unsupported_features_are_refused(pool):
    pool.run(cases.refuses_features)


def test_window_and_local_documents_skip_ring_steps(pool):
    pool.run(cases.window_skips_ring_steps)


def test_flex_block_masks_forward_match_reference(pool2):
    pool2.run(cases.flex_forward_matrix, ["zigzag", "striped"])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_value_head_dim_of_its_own(pool, pool4, layout):
    pool.run(cases.value_head_dim, layout)
    if layout == "zigzag":
        pool4.run(cases.value_head_dim, layout, 2)  # Ulysses 2 x ring 2
