"""Memory features of a patched model: checkpointing that keeps ring outputs, tiled MLPs, the chunked loss."""
import copy
import inspect

import torch
import torch.distributed as dist

import ringseq
from ringseq.testing import shared_init

from .hf_models import check_against, make_batch, references, tiny_model


class RingCounter:
    """Counts the ring's point-to-point posts and its ring forwards while active."""

    def __init__(self):
        from ringseq.attention import comm, ring

        self.posts = self.forwards = 0
        self._patches = [(comm.RingComm, "post"), (ring, "ring_forward")]

    def __enter__(self):
        from ringseq.attention import comm, ring

        post, forward = comm.RingComm.post, ring.ring_forward

        def counted_post(*a, **k):
            self.posts += 1
            return post(*a, **k)

        def counted_forward(*a, **k):
            self.forwards += 1
            return forward(*a, **k)

        self._saved = (post, forward)
        comm.RingComm.post, ring.ring_forward = counted_post, counted_forward
        return self

    def __exit__(self, *exc):
        from ringseq.attention import comm, ring

        comm.RingComm.post, ring.ring_forward = self._saved


def backward_counts(model, batch):
    """(loss, grads, ring posts made by the backward, ring forwards run by the backward)."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    with RingCounter() as counter:
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter.posts, counter.forwards


def gradient_checkpointing(family, tiled_mlp=None, reentrant=False, offload=False, enable_first=True, keep=True,
                           head_groups=None):
    """A checkpointed patched model against the unpatched, non-checkpointed model; its backward
    makes exactly the ring posts of the non-checkpointed patched model's backward (the recompute
    replays no ring) and runs no ring forward. ``enable_first``: checkpointing enabled before
    patching (else after, as the Trainer does). ``keep=False`` (patch's keep_ring_outputs):
    the recompute replays every layer's ring forward instead, and stays exact. ``head_groups`` (patch's):
    every ring call of the forward, the recompute and the backward runs one ring per group."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, 16 * world, "plain")
    base, refs = references(family, batch)
    plain = ringseq.patch(copy.deepcopy(base), sp=sp, tiled_mlp=tiled_mlp, head_groups=head_groups)
    _, _, plain_posts, plain_forwards = backward_counts(plain, batch)
    model = copy.deepcopy(base)
    model.train()
    enable_fn = getattr(type(model), "activation_checkpointing_enable", None)
    offload = offload and enable_fn is not None and "offload" in inspect.signature(enable_fn).parameters
    extra = {"offload": True} if offload else {}  # older transformers 5.x have no offload option

    def enable():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant}, **extra)

    if enable_first:
        enable()
    ringseq.patch(model, sp=sp, tiled_mlp=tiled_mlp, keep_ring_outputs=keep, head_groups=head_groups)
    if not enable_first:
        enable()
    assert model._ringseq_patch.offload == offload
    loss, grads, posts, forwards = backward_counts(model, batch)
    where = f"{family} checkpointed tiled_mlp={tiled_mlp} reentrant={reentrant} rank {sp.rank}/{world}"
    config = model.config.get_text_config()
    groups = {None: 1, "kv": config.num_key_value_heads}.get(head_groups, head_groups)
    rings = config.num_hidden_layers * groups  # per attention layer one ring for all heads, or one per group
    replayed = (world - 1) * rings if keep is False else 0  # a causal ring forward posts P-1 times
    assert (posts, forwards, plain_forwards) == (plain_posts + replayed, 0 if keep else rings, 0), \
        (where, posts, plain_posts, forwards)
    assert world == 1 or posts > 0, where
    check_against(refs, loss, grads, sp, where)


def tiled_mlp_refusals():
    """Mixture-of-experts MLPs and bad tile counts are refused before anything changes."""
    import pytest

    sp = shared_init(sp_size=dist.get_world_size())
    moe = tiny_model("gpt_oss")
    with pytest.raises(ringseq.RingSeqError, match="tiled_mlp tiles dense MLPs"):
        ringseq.patch(moe, sp=sp, tiled_mlp=2)
    assert not hasattr(moe, "_ringseq_patch") and "forward" not in vars(moe.model.layers[0].mlp)
    for bad in (0, -1, 2.5, False, "4"):
        with pytest.raises(ringseq.RingSeqError, match="tiled_mlp must be"):
            ringseq.patch(tiny_model("llama"), sp=sp, tiled_mlp=bad)
    model = ringseq.patch(tiny_model("llama"), sp=sp, tiled_mlp=4)
    assert all("forward" in vars(layer.mlp) for layer in model.model.layers)
    ringseq.patch(model, sp=sp, tiled_mlp=None)  # re-patching changes the option
    assert not any("forward" in vars(layer.mlp) for layer in model.model.layers)


def chunked_loss_is_exact():
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(8, 11, bias=False).double()
    hidden = torch.randn(2, 13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 13), generator=g)
    labels[0, :5] = -100
    count = (labels != -100).sum()
    dist.all_reduce(count, group=sp.group)
    whole = ringseq.loss.cross_entropy(head(hidden), labels, sp=sp)
    gh, gw = torch.autograd.grad(whole, (hidden, head.weight))
    for chunk in (1, 5, 26, 100):
        part = ringseq.loss.chunked_cross_entropy(hidden, labels, head, sp=sp, count=count, chunk=chunk)
        ch, cw = torch.autograd.grad(part, (hidden, head.weight))
        # float64 throughout: slab sums reordered, so equal to a few float64 roundings
        assert torch.allclose(part, whole, rtol=1e-14) and torch.allclose(ch, gh) and torch.allclose(cw, gw)
