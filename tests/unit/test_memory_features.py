"""The parts of the memory features that need no process group: the kept ring outputs' record and
replay, the checkpoint wrapper, the loss slab size and its in-place gradient, and the tiled MLP's
tile counts."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ringseq
from ringseq.attention import keep
from ringseq import loss
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


class _Scaled(torch.nn.Module):
    """A head that is not a plain Linear: the slab loss must not write over its output."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, h):
        return self.linear(h) * 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_kind,softcap", [("linear", None), ("module", None), ("linear", 30.0)])
def test_slab_loss_with_its_gradient_in_place_matches_float64(dtype, head_kind, softcap):
    """Value and gradients (hidden states, head weight and bias) of one checkpointed slab, against
    float64 and within 2x of the plain log-softmax + nll computation's error in the same dtype.
    600 tokens against a 2000-word vocabulary, a seventh of the labels ignored."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 2000).to(dtype)
    head = linear if head_kind == "linear" else _Scaled(linear)
    h = torch.randn(600, 64, dtype=dtype, requires_grad=True)
    y = torch.randint(0, 2000, (600,))
    y[::7] = loss.IGNORE

    def plain(m, x):
        logits = m(x).float() if x.dtype != torch.float64 else m(x)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return F.cross_entropy(logits, y, ignore_index=loss.IGNORE, reduction="none").double().sum()

    def grads(value, m, x):
        return [value.detach(), *torch.autograd.grad(value, [x, *m.parameters()])]

    ref_head = (torch.nn.Linear(64, 2000) if head_kind == "linear" else _Scaled(torch.nn.Linear(64, 2000))).double()
    ref_head.load_state_dict({k: v.double() for k, v in head.state_dict().items()})
    x64 = h.detach().double().requires_grad_(True)
    ref = grads(plain(ref_head, x64), ref_head, x64)
    base = grads(plain(head, h), head, h)
    got = grads(checkpoint(loss._slab_loss, h, y, head, softcap, use_reentrant=False), head, h)
    for name, g, b, r in zip(["value", "hidden", "weight", "bias"], got, base, ref):
        err, plain_err = ((t.double() - r).abs().max().item() for t in (g, b))
        floor = 2 * torch.finfo(dtype).eps * r.abs().max().item()
        assert err <= 2 * plain_err + floor, (name, err, plain_err)


def test_tile_counts():
    assert tiled_mlp.tiles_for(True, 5000, 1024) == 5 and tiled_mlp.tiles_for(True, 10, 1024) == 1
    assert tiled_mlp.tiles_for(3, 5000, 1024) == 3
    for bad in (0, -2, 1.5, False, "2"):
        with pytest.raises(ringseq.RingSeqError, match="tiled_mlp must be"):
            tiled_mlp.check(bad)
