"""Bodies of the mask/feature tests (documents, padding, windows, softcap, sinks, Ulysses).

The reference (``ringseq.reference.attention``) is written from the definitions alone (dense
float64 math on the full sequence), not from ringseq's mask code."""
import contextlib

import itertools

import torch
import torch.distributed as dist

import ringseq
from ringseq.attention.masks import TokenInfo, documents
from ringseq.balance import balanced
from ringseq.layouts import Runs
from ringseq.reference import attention as reference
from ringseq.sharding import shard_tensor
from ringseq.testing import assert_close, assert_shards_close, rounding, shared_init

from .cases import DTYPES, make_qkv


def packed_positions(B, S, seed):
    """[B, S] position ids of randomly packed documents (lengths 1..S/2)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        pos = []
        while len(pos) < S:
            n = int(torch.randint(1, max(2, S // 2), (1,), generator=g))
            pos.extend(range(n))
        rows.append(pos[:S])
    return torch.tensor(rows)


def skewed_positions(B, S, seed):
    """[B, S] position ids of short documents (1-3 tokens) and one of S/4 tokens at the end of
    each row: zigzag's last chunks then hold most of the work, so ``ringseq.balance`` moves it."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        pos = []
        while len(pos) < S - S // 4:
            pos.extend(range(int(torch.randint(1, 4, (1,), generator=g))))
        rows.append((pos[:S - S // 4] + list(range(S // 4))))
    return torch.tensor(rows)


def padding_mask(B, S, seed):
    """[B, S] 1/0: sample 0 left-padded, sample 1 right-padded, others random-length left pads."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, S, dtype=torch.long)
    for b in range(B):
        n = int(torch.randint(1, S // 2, (1,), generator=g))
        if b % 2:
            mask[b, S - n:] = 0
        else:
            mask[b, :n] = 0
    return mask


def image_blocks(B, S, seed):
    """[B, S] bidirectional block ids (-1: none): runs of 2..S/4 tokens at random places, one of
    them across the middle of the row (a chunk edge of every layout at world 2)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.full((B, S), -1, dtype=torch.long)
    for b in range(B):
        at, n = S // 2 - 3, 0
        blocks[b, at:at + 6] = n
        at = 0
        while at < S:
            at += int(torch.randint(1, max(2, S // 4), (1,), generator=g))
            size = int(torch.randint(2, max(3, S // 4), (1,), generator=g))
            if at + size < S and bool((blocks[b, max(0, at - 1):at + size + 1] < 0).all()):
                n += 1
                blocks[b, at:at + size] = n
            at += size
    return blocks


def balanced_layout(sp, pos, pad, blk):
    """The layout ``shard_batch`` gives this batch under zigzag (``ringseq.balance``) and a
    ``token_info`` that carries it; at world 2 and 4 it must be runs of its own, not zigzag."""
    info = TokenInfo(doc=documents(pos), valid=None if pad is None else pad.bool(), block=blk)
    layout = balanced(info, pos.size(1), sp.ring_size)
    assert sp.ring_size == 1 or isinstance(layout, Runs), f"this batch balances as {layout!r}: a case that tests nothing"
    return layout, TokenInfo(doc=info.doc, valid=info.valid, block=info.block,
                             layout=layout if isinstance(layout, Runs) else None)


def check_features(sp, *, dtype, B=2, H=8, K=2, S_per_rank=16, D=32, seed=0, packed=False, padded=False,
                   sinks=False, slab_rows=None, autocast=False, kernel=None, backward=True, blocks=False,
                   balanced=False, **features):
    """ringseq against ``reference`` in float64 and plainly in ``dtype``. ``autocast``: q and k
    in fp32 (as a rotary embedding leaves them), v and dout in ``dtype``, both ringseq and the
    plain SDPA run under ``torch.autocast(dtype=dtype)``. ``backward=False``: the output only,
    computed without autograd (a kernel whose backward needs CUDA). ``balanced``: the packed
    documents laid out by work as ``shard_batch`` lays them out (zigzag groups only), the
    layout carried by ``token_info``."""
    S = S_per_rank * sp.size
    q, k, v, dout = make_qkv(B, H, K, S, D, seed)
    g = torch.Generator().manual_seed(seed + 7)
    sink = torch.randn(H, generator=g, dtype=torch.float64) if sinks else None
    pos = (skewed_positions if balanced else packed_positions)(B, S, seed) if packed else None
    pad = padding_mask(B, S, seed) if padded else None
    blk = image_blocks(B, S, seed) if blocks else None
    kw = dict(causal=True, **features)
    ref = reference(q, k, v, dout, sinks=sink, position_ids=pos, attention_mask=pad, blocks=blk, **kw)
    dtypes = (torch.float32, torch.float32, dtype, dtype) if autocast else (dtype,) * 4
    inputs = [t.to(d) for t, d in zip((q, k, v, dout), dtypes)]
    mixed = torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext()
    with mixed:
        plain = reference(*inputs, sinks=None if sink is None else sink.to(dtype), position_ids=pos,
                          attention_mask=pad, sdpa=True, blocks=blk, **kw)
    layout = sp.layout

    def shard(t, dim):
        return shard_tensor(t, dim, layout, sp.ring_size, sp.rank, sp.ulysses_size)

    local = [shard(t, 2).requires_grad_(True) for t in inputs[:3]]
    sink_in = None if sink is None else sink.to(dtype).requires_grad_(True)
    masks = {"position_ids": None if pos is None else shard(pos, 1),
             "attention_mask": None if pad is None else shard(pad, 1)}
    if blk is not None:  # blocks come only in a TokenInfo
        masks = {"token_info": ringseq.token_info(sp, **masks, blocks=shard(blk, 1))}
    if balanced and sp.layout == "zigzag":
        layout, info = balanced_layout(sp, pos, pad, blk)
        local = [shard(t, 2).requires_grad_(True) for t in inputs[:3]]
        masks = {"token_info": info}
    with mixed, torch.set_grad_enabled(backward):
        out = ringseq.ring_attention(*local, sp=sp, sinks=sink_in, slab_rows=slab_rows, kernel=kernel, **masks, **kw)
    case = (f"rank {sp.rank}/{sp.size} U{sp.ulysses_size} {layout} {dtype} autocast={autocast} H{H} K{K} "
            f"packed={packed} padded={padded} sinks={sinks} blocks={blocks} slab {slab_rows} {kernel} {features}")
    if not backward:
        assert not out.requires_grad
        assert_shards_close(out, plain[0], ref[0], f"out [{case}]", sp=sp, layout=layout)
        return
    out.backward(shard(inputs[3], 2))
    for name, got, p, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), plain, ref):
        assert_shards_close(got, p, r, f"{name} [{case}]", sp=sp, layout=layout)
    if sinks:
        # each rank's sink gradient is its share: summed over the sequence group it is the whole
        # each rank's sink gradient is its share, stored in ``dtype``; summed over the sequence group
        # it is the whole, so the sum carries one rounding of every share (the shares can be much
        # larger than their sum: it cancels)
        dsink = sink_in.grad.double()
        share_roundings = torch.tensor([rounding(dsink, dtype)], dtype=torch.float64)
        dist.all_reduce(dsink, group=sp.group)
        dist.all_reduce(share_roundings, group=sp.group)
        floor = 2 * max(rounding(ref[4], dtype), share_roundings.item())
        assert_close(dsink.to(dtype), plain[4], ref[4], f"dsinks [{case}]", floor=floor)


FEATURES = [
    dict(packed=True),
    dict(padded=True),
    dict(window=5),
    dict(window=40),
    dict(softcap=2.0),
    dict(sinks=True),
    dict(packed=True, window=7),
    dict(window=9, softcap=3.0),
    dict(sinks=True, K=2),
    dict(sinks=True, K=1, window=11),
    dict(packed=True, padded=True, sinks=True),
    dict(packed=True, balanced=True),  # the batch's own layout (zigzag groups; ringseq.balance)
    dict(packed=True, balanced=True, window=7, softcap=2.0, sinks=True, K=1),
]


def feature_matrix(layout, dtype_name, ulysses_size=1):
    sp = shared_init(sp_size=dist.get_world_size(), ulysses_size=ulysses_size, layout=layout)
    for n, features in enumerate(FEATURES):  # odd cases: slabs of 5 rows, so the kernels' slab loops run
        check_features(sp, dtype=DTYPES[dtype_name], seed=n, slab_rows=5 if n % 2 else None, **features)


BLOCK_FEATURES = [dict(blocks=True), dict(blocks=True, window=5, padded=True),
                  dict(blocks=True, packed=True, padded=True, balanced=True),
                  dict(blocks=True, packed=True, sinks=True, softcap=2.0)]


def block_matrix(layout, ulysses_size=1):
    """Bidirectional blocks (Gemma 3's image tokens) inside causal attention: blocks across chunk
    edges, with windows, padding, documents, sinks and softcap; fp32 and bf16 alternate."""
    sp = shared_init(sp_size=dist.get_world_size(), ulysses_size=ulysses_size, layout=layout)
    for n, features in enumerate(BLOCK_FEATURES):
        check_features(sp, dtype=list(DTYPES.values())[n % 2], seed=n, slab_rows=5 if n % 2 else None, **features)


FLEX_FEATURES = [dict(packed=True), dict(window=5, softcap=2.0), dict(sinks=True, K=1, padded=True),
                 dict(blocks=True, window=6, padded=True)]


def flex_forward_matrix(layouts):
    """FlexAttention's block masks and score mods (forced for every call), forward only: its
    backward needs CUDA (``benchmarks/gpu_check.py`` checks that). fp32 and bf16 alternate."""
    for layout in layouts:
        sp = shared_init(sp_size=dist.get_world_size(), layout=layout)
        for n, features in enumerate(FLEX_FEATURES):
            dtype = list(DTYPES.values())[n % 2]
            check_features(sp, dtype=dtype, seed=n, kernel="flex", backward=False, **features)


AUTOCAST_FEATURES = [dict(), dict(packed=True), dict(padded=True, sinks=True), dict(window=7)]


def autocast_matrix(layout, dtype_name):
    """Under torch.autocast (bf16 or fp16) with fp32 q/k and a half v: what SDPA computes."""
    sp = shared_init(sp_size=dist.get_world_size(), layout=layout)
    for n, features in enumerate(AUTOCAST_FEATURES):
        check_features(sp, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name], seed=n, autocast=True,
                       **features)


def ulysses_heads(layout):
    """Ulysses and the hybrid on plain causal attention across head modes (K < U replicates)."""
    world = dist.get_world_size()
    degrees = [u for u in (2, 4) if world % u == 0]
    assert degrees, f"no Ulysses degree fits world {world}: run this at world 2 or 4"
    for U in degrees:
        sp = shared_init(sp_size=world, ulysses_size=U, layout=layout)
        for K in (8, 2, 1):
            for dtype in DTYPES.values():
                check_features(sp, dtype=dtype, K=K, seed=K)


def refuses_features():
    import pytest

    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 2, 4, 16)
    for kwargs, match in [(dict(window=4, causal=False), "causal"), (dict(window=0), "positive integer"),
                          (dict(softcap=-1.0), "softcap"), (dict(sinks=torch.zeros(3)), "one logit per query head"),
                          (dict(kernel="cpu_flash", softcap=2.0), "cannot apply a softcap")]:
        with pytest.raises(ringseq.RingSeqError, match=match):
            ringseq.ring_attention(q, k, k, sp=sp, **kwargs)
    from ringseq.attention.masks import TokenInfo

    with pytest.raises(ringseq.RingSeqError, match="token_info.doc has shape"):  # batch 3, not 1
        ringseq.ring_attention(q, k, k, sp=sp, token_info=TokenInfo(doc=torch.zeros(3, 4 * world, dtype=torch.long)))
    if world % 4 == 0:
        sp4 = shared_init(sp_size=world, ulysses_size=4)
        with pytest.raises(ringseq.RingSeqError, match="query heads cannot be split"):
            ringseq.ring_attention(torch.randn(1, 6, 4, 16), torch.randn(1, 6, 4, 16), torch.randn(1, 6, 4, 16), sp=sp4)
        with pytest.raises(ringseq.RingSeqError, match="kv heads cannot be split"):
            ringseq.ring_attention(torch.randn(1, 12, 4, 16), torch.randn(1, 6, 4, 16), torch.randn(1, 6, 4, 16), sp=sp4)


def window_skips_ring_steps():
    """A window shorter than a shard under the contiguous layout is a neighbour exchange:
    one K/V hop forward; backward one K/V hop, one dK/dV hop and one hop home (per head group: one
    ring for all heads by default, one per kv head with head_groups="kv"). Documents
    that never cross a shard boundary need no transfer at all."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, layout="contiguous")
    B, H, K, s, D = 1, 4, 2, 16, 8
    q, k, v, dout = make_qkv(B, H, K, s * world, D)
    sent, real = [], dist.batch_isend_irecv

    def counting(ops):
        if any(op.op is dist.isend for op in ops):  # a hop's receives are posted apart on gloo
            sent.append(len([op for op in ops if op.op is dist.isend]))
        return real(ops)

    dist.batch_isend_irecv = counting
    try:
        for (kw, fwd_hops, bwd_hops), (head_groups, rings) in itertools.product(
                [(dict(window=s), 1, 3), (dict(position_ids=torch.arange(s * world) % s), 0, 0)],
                [(None, 1), ("kv", K)]):
            sent.clear()
            if "position_ids" in kw:
                kw = dict(position_ids=ringseq.shard(kw["position_ids"][None], 1, sp=sp))
            local = [ringseq.shard(t, 2, sp=sp).requires_grad_(True) for t in (q, k, v)]
            out = ringseq.ring_attention(*local, sp=sp, head_groups=head_groups, **kw)
            n_fwd = len(sent)
            out.backward(ringseq.shard(dout, 2, sp=sp))
            if world == 1:  # a ring of one never transfers
                fwd_hops = bwd_hops = 0
            fwd_hops, bwd_hops = fwd_hops * rings, bwd_hops * rings  # one ring per head group
            assert n_fwd == fwd_hops and len(sent) - n_fwd == bwd_hops, (kw.keys(), head_groups, sent, n_fwd)
    finally:
        dist.batch_isend_irecv = real


def value_head_dim(layout, ulysses_size=1):
    """A value head dim of its own (MLA: Kimi Linear, DeepSeek-V3): smaller and larger than the
    query's, with GQA, packed documents and a window, out and every gradient against the float64
    reference by the 2x rule."""
    sp = shared_init(sp_size=dist.get_world_size(), ulysses_size=ulysses_size, layout=layout)
    B, H, K, D, S = 2, 4, 2, 16, 16 * sp.size
    for Dv, kw in ((8, dict(window=9)), (24, {})):
        q, k, _, _ = make_qkv(B, H, K, S, D, seed=Dv)
        g = torch.Generator().manual_seed(Dv)
        v = torch.randn(B, K, S, Dv, generator=g, dtype=torch.float64)
        dout = torch.randn(B, H, S, Dv, generator=g, dtype=torch.float64)
        pos = packed_positions(B, S, Dv)
        ref = reference(q, k, v, dout, causal=True, position_ids=pos, **kw)
        plain = reference(*(t.float() for t in (q, k, v, dout)), causal=True, position_ids=pos, sdpa=True, **kw)
        local = [ringseq.shard(t.float(), 2, sp=sp).requires_grad_(True) for t in (q, k, v)]
        out = ringseq.ring_attention(*local, sp=sp, position_ids=ringseq.shard(pos, 1, sp=sp), **kw)
        assert out.shape == (B, H, S // sp.size, Dv), out.shape
        out.backward(ringseq.shard(dout.float(), 2, sp=sp))
        for name, got, p, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), plain, ref):
            assert_shards_close(got, p, r, f"{name} Dv={Dv} [{layout} U{ulysses_size} rank {sp.rank}]", sp=sp)
