"""The parts of the memory features that need no process group: the kept ring outputs' record and
replay, the checkpoint wrapper, the loss slab size and the tiled MLP's tile counts."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ringseq
from ringseq.attention import keep
from ringseq.loss import SLAB_BYTES, slab_tokens
from ringseq.slabs import MIN_TOKENS
from ringseq.patches import tiled_mlp


def test_kept_outputs_replay_in_call_order_and_are_released():
    kept = keep.Kept()
    q = torch.zeros(1, 2, 3, 4)
    outs = [torch.full_like(q, float(i)) for i in range(3)]
    with kept.run():
        assert keep.current() is kept and kept.take(q) is None  # the first run records
        for o in outs:
            kept.put(o, torch.zeros(1, 2, 3), None)
    assert keep.current() is None
    with kept.run():
        got = [kept.take(q)[0] for _ in outs]
        assert kept.take(q) is None  # nothing more was kept: that call runs the ring again
    assert all(torch.equal(g, o) for g, o in zip(got, outs))
    assert kept.entries == []  # the recompute's autograd nodes hold what they took


def test_a_recompute_that_differs_from_its_forward_is_refused():
    kept = keep.Kept()
    with kept.run():
        kept.put(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3), None)
    with kept.run(), pytest.raises(ringseq.RingSeqError, match="must compute the same thing twice"):
        kept.take(torch.zeros(1, 2, 5, 4))


def test_the_checkpoint_wrapper_runs_the_function_once_then_replays_it():
    runs = []

    def layer(x):
        kept = keep.current()
        runs.append(kept.replaying)
        return (x * 2).sin()

    wrapped = keep.checkpoint_keeping_ring(checkpoint)
    assert keep.checkpoint_keeping_ring(wrapped) is wrapped and wrapped.wrapped is checkpoint
    x = torch.randn(5, requires_grad=True)
    wrapped(layer, x, use_reentrant=False).sum().backward()
    assert runs == [False, True]
    assert torch.allclose(x.grad, 2 * (2 * x.detach()).cos())
    offloaded = keep.checkpoint_keeping_ring(checkpoint, offload=True)  # on CPU: save_on_cpu, a no-op copy
    y = torch.randn(5, requires_grad=True)
    offloaded(layer, y, use_reentrant=False).sum().backward()
    assert torch.allclose(y.grad, 2 * (2 * y.detach()).cos())


def test_loss_slabs_hold_a_fixed_amount_of_logits():
    for vocab in (2_048, 32_000):
        assert slab_tokens(vocab) * 4 * vocab <= SLAB_BYTES < (slab_tokens(vocab) + 1) * 4 * vocab
    assert slab_tokens(128_256) == slab_tokens(10**9) == MIN_TOKENS


def test_tile_counts():
    assert tiled_mlp.tiles_for(True, 5000, 1024) == 5 and tiled_mlp.tiles_for(True, 10, 1024) == 1
    assert tiled_mlp.tiles_for(3, 5000, 1024) == 3
    for bad in (0, -2, 1.5, False, "2"):
        with pytest.raises(ringseq.RingSeqError, match="tiled_mlp must be"):
            tiled_mlp.check(bad)
