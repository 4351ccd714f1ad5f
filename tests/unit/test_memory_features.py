"""The parts of the memory features that need no process group: the kept ring outputs' record and
replay, the checkpoint wrapper, the loss slab size and its in-place gradient, and the tiled MLP's
tile counts."""
import types
import weakref

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


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_fused_linear_loss_matches_float64(monkeypatch, dtype, autocast):
    """The chunked loss of a plain Linear head forms its gradients in forward: value and gradients
    (hidden states, weight, bias) against float64, within 2x the full-logits loss's error in the
    same dtype (under bf16 autocast too), with the incoming gradient 3 (the scale is applied in
    backward); 600 tokens in slabs of 128 (the last partial), a seventh of the labels ignored; each
    slab's logits are computed once (the checkpointed slabs compute them twice), and one slab's
    at a time."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 2000).to(dtype)
    h = torch.randn(600, 64, dtype=dtype, requires_grad=True)
    y = torch.randint(0, 2000, (600,))
    y[::7] = loss.IGNORE
    count = (y != loss.IGNORE).sum()
    sp = types.SimpleNamespace(size=1)

    def grads(value, m, x):
        return [value.detach(), *torch.autograd.grad(3 * value, [x, *m.parameters()])]

    def plain(m, x):
        logits = m(x).float() if x.dtype != torch.float64 else m(x)
        return F.cross_entropy(logits, y, ignore_index=loss.IGNORE, reduction="sum") / count

    ref_head = torch.nn.Linear(64, 2000).double()
    ref_head.load_state_dict({k: v.double() for k, v in head.state_dict().items()})
    x64 = h.detach().double().requires_grad_(True)
    ref = grads(plain(ref_head, x64), ref_head, x64)
    calls = []
    linear = F.linear

    def counted(*args, **kwargs):  # and no earlier slab's logits alive when the next are computed
        assert all(ref() is None for ref in calls), "two slabs of logits alive at once"
        out = linear(*args, **kwargs)
        calls.append(weakref.ref(out))
        return out

    monkeypatch.setattr(F, "linear", counted)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        base = grads(plain(head, h), head, h)
        calls.clear()
        got = grads(loss.chunked_cross_entropy(h, y, head, sp=sp, count=count, chunk=128), head, h)
    assert len(calls) == 5
    for name, g, b, r in zip(["value", "hidden", "weight", "bias"], got, base, ref):
        assert g.dtype == b.dtype, name
        err, plain_err = ((t.double() - r).abs().max().item() for t in (g, b))
        floor = 2 * torch.finfo(b.dtype).eps * r.abs().max().item()
        assert err <= 2 * plain_err + floor, (name, err, plain_err)


def test_fused_linear_loss_only_for_plain_heads_and_backpropagates_once():
    head = torch.nn.Linear(8, 50)
    assert loss._fusable(head, None)
    assert not loss._fusable(head, 30.0) and not loss._fusable(_Scaled(head), None)
    handle = head.register_forward_pre_hook(lambda m, a: None)  # as ZeRO-3 gathers a weight
    assert not loss._fusable(head, None)
    handle.remove()
    h = torch.randn(10, 8, requires_grad=True)
    value = loss.chunked_cross_entropy(h, torch.randint(0, 50, (10,)), head, sp=types.SimpleNamespace(size=1),
                                       count=10, chunk=4)
    value.backward(retain_graph=True)
    with pytest.raises(ringseq.RingSeqError, match="ran twice"):
        value.backward()


def test_tile_counts():
    assert tiled_mlp.tiles_for(True, 5000, 1024) == 5 and tiled_mlp.tiles_for(True, 10, 1024) == 1
    assert tiled_mlp.tiles_for(3, 5000, 1024) == 3
    for bad in (0, -2, 1.5, False, "2"):
        with pytest.raises(ringseq.RingSeqError, match="tiled_mlp must be"):
            tiled_mlp.check(bad)
