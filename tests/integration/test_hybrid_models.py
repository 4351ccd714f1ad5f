"""Hybrid models (gated DeltaNet, KDA, Mamba2 and short-convolution layers beside attention) patched
against the unpatched model on the whole sequence: loss and SP-averaged gradients by the 2x rule."""
import pytest

from . import cases_batches, cases_hybrid, cases_memory, cases_parity
from .hybrid_configs import CHUNK, HYBRIDS


def per_rank(family: str) -> int:
    """Tokens per rank: two kernel chunks in each zigzag run at world 4 (delta rule: 64-token chunks)."""
    return 4 * CHUNK.get(family, 16)


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_matches_unpatched(pool2, pool4, family):
    """zigzag at world 2 and 4 (each rank's two runs far apart: folded separately)."""
    pool2.run(cases_parity.parity, family, "zigzag", "plain", per_rank(family))
    pool4.run(cases_parity.parity, family, "zigzag", "plain", per_rank(family))


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_packed_contiguous_and_padded(pool2, pool4, family):
    """Packed documents (attention keeps them apart; the recurrent layers run across them, as the
    unpatched model's PyTorch path does) in the contiguous layout at world 4; padding at world 2
    (the recurrent layers zero it with this rank's shard of the mask)."""
    pool4.run(cases_parity.parity, family, "contiguous", "packed", per_rank(family) // 2)
    pool2.run(cases_parity.parity, family, "zigzag", "padded", per_rank(family) // 2)


@pytest.mark.parametrize("family", ["qwen3_5", "bamba", "lfm2"])
def test_hybrid_at_world_1_2_4_with_a_length_the_layout_cannot_split(pool, family):
    pool.run(cases_parity.parity, family, "zigzag", "plain", 32, 5)


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_hybrid_under_ulysses_x_ring(pool4, family):
    """Ulysses 2 x ring 2: a rank's tokens are still one or two runs of the sequence."""
    pool4.run(cases_parity.parity, family, "zigzag", "packed", 64, 0, 2)


@pytest.mark.parametrize("family,kind", [("qwen3_5", "plain"), ("kimi_linear", "packed"), ("bamba", "padded"),
                                         ("lfm2", "plain"),
                                         ("nemotron_h", "padded")])
def test_hybrid_under_bf16_autocast(pool2, family, kind):
    pool2.run(cases_parity.autocast_parity, family, "bf16", kind, 64)


@pytest.mark.parametrize("family,reentrant", [("qwen3_5", False), ("falcon_h1", True),
                                              ("kimi_linear", False)])
def test_hybrid_gradient_checkpointing(pool2, family, reentrant):
    """Checkpointed hybrid layers: the recompute exchanges the recurrent summaries again (cheap), the
    ring is still never replayed; exact."""
    pool2.run(cases_memory.gradient_checkpointing, family, None, reentrant, False, False, True)


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_hybrid_manual_path(pool2, family):
    pool2.run(cases_batches.manual_path, family, 64)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "kimi_linear", "nemotron_h", "falcon_h1", "lfm2"])
def test_every_layer_runs_on_its_shard(pool2, pool4, family):
    pool2.run(cases_hybrid.every_layer_runs_on_its_shard, family)
    if family == "qwen3_5_moe":
        pool4.run(cases_hybrid.every_layer_runs_on_its_shard, family)


@pytest.mark.parametrize("family,part", [("qwen3_5", "delta rule"), ("kimi_linear", "delta rule"),
                                         ("bamba", "mamba2"), ("lfm2", "halo")])
def test_a_lost_state_fails_the_parity_check(pool2, family, part):
    pool2.run(cases_hybrid.a_lost_state_is_seen, family, part)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "granitemoehybrid", "gpt_oss"])
def test_the_router_loss_is_that_of_the_whole_sequence(pool2, pool4, family):
    pool2.run(cases_hybrid.router_loss_of_the_whole_sequence, family, "padded")
    if family == "qwen3_5_moe":  # a length the layout pads: its padding is never counted as tokens
        pool4.run(cases_hybrid.router_loss_of_the_whole_sequence, family, "packed", 5)


def test_hybrids_refuse_what_they_cannot_do(pool2):
    pool2.run(cases_hybrid.hybrid_refusals)
