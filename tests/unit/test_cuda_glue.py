"""The CUDA backends' own code on the CPU: everything around the GPU kernel itself.

``cuda_varlen``'s packing, log-sum-exp layout, empty-row handling and merged-lse backward run
here against a CPU stand-in for aten's flash varlen ops, written from flash-attn's documented
rule (cumulative lengths, bottom-right window, lse +inf for a row without keys); ``flex``'s
backward (the block recomputed under autograd, fed the merge's gradients) runs against a dense
stand-in for FlexAttention. Both go through ringseq's ring loop on 4 virtual ranks
(``ringseq.attention.virtual``) in float64, where the result must match the reference
(``ringseq.reference``) to 1e-9: any slip in the glue shows up as an O(1) error. The kernels
themselves run in benchmarks/gpu_check.py.
"""
import pytest
import torch

from ringseq.attention.kernels import cuda_varlen, flex
from ringseq.attention.masks import TokenInfo, documents
from ringseq.attention.virtual import virtual_ring
from ringseq.balance import chunk_layout
from ringseq.reference import attention


def _segments(cu_q, cu_k):
    return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())


def _visible(n, m, left, right, max_k, causal):
    right = 0 if causal else right
    r, c = torch.arange(n)[:, None], torch.arange(m)[None, :]
    ok = torch.ones(n, m, dtype=torch.bool)
    if 0 <= left < max_k:
        ok &= c >= r + m - n - left
    if 0 <= right < max_k:
        ok &= c <= r + m - n + right
    return ok


def _scores(q, k, a, b, c, d, scale):
    G = q.size(1) // k.size(1)
    return torch.einsum("nhd,mhd->hnm", q[a:b], k[c:d].repeat_interleave(G, 1)) * scale


def fake_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale, window_size_left,
                 window_size_right):
    """aten._flash_attention_forward on packed [T, heads, D] inputs, by flash-attn's rule."""
    H, G = q.size(1), q.size(1) // k.size(1)
    out = torch.zeros_like(q)
    lse = torch.full((H, q.size(0)), float("inf"), dtype=q.dtype)
    for a, b, c, d in _segments(cu_q, cu_k):
        if b == a or d == c:
            continue
        s = _scores(q, k, a, b, c, d, scale)
        s = s.masked_fill(~_visible(b - a, d - c, window_size_left, window_size_right, max_k, causal), float("-inf"))
        lse_seg = torch.logsumexp(s, -1)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[a:b] = torch.einsum("hnm,mhd->nhd", p, v[c:d].repeat_interleave(G, 1))
        lse[:, a:b] = lse_seg.masked_fill(lse_seg == float("-inf"), float("inf"))
    return out, lse, None, None, None


def fake_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, *, scale,
                  window_size_left, window_size_right):
    """aten._flash_attention_backward with the given (merged) out and lse."""
    G = q.size(1) // k.size(1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b, c, d in _segments(cu_q, cu_k):
        if b == a or d == c:
            continue
        s = _scores(q, k, a, b, c, d, scale)
        vis = _visible(b - a, d - c, window_size_left, window_size_right, max_k, causal)
        p = torch.exp(s - lse[:, a:b, None].to(s.dtype)).masked_fill(~vis, 0.0)  # [H, n, m]
        do, vv, kk = dout[a:b], v[c:d].repeat_interleave(G, 1), k[c:d].repeat_interleave(G, 1)
        dp = torch.einsum("nhd,mhd->hnm", do, vv)
        delta = (do * out[a:b]).sum(-1).transpose(0, 1)[..., None]  # [H, n, 1]
        ds = p * (dp - delta)
        dq[a:b] = torch.einsum("hnm,mhd->nhd", ds, kk) * scale
        dk[c:d] = torch.einsum("hnm,nhd->mhd", ds, q[a:b]).unflatten(1, (-1, G)).sum(2) * scale
        dv[c:d] = torch.einsum("hnm,nhd->mhd", p, do).unflatten(1, (-1, G)).sum(2)
    return dq, dk, dv


def fake_flex_run(q, k, v, spec):
    """Flex._run as dense autograd-able math: (out, lse) of the block under its mask and softcap."""
    B, H, n, D = q.shape
    m, G = k.size(2), H // k.size(1)
    s = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * spec.scale
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    if spec.mask is not None:
        vis = spec.mask.rows(0, n)[:, None]
    else:
        vis = torch.ones(n, m, dtype=torch.bool).tril() if spec.causal else torch.ones(n, m, dtype=torch.bool)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v.repeat_interleave(G, 1), lse


@pytest.fixture
def cuda_on_cpu(monkeypatch):
    monkeypatch.setattr(cuda_varlen, "_forward", fake_forward)
    monkeypatch.setattr(cuda_varlen, "_backward", fake_backward)
    monkeypatch.setattr(cuda_varlen.CudaVarlen, "applies", staticmethod(lambda device, dtype, D: True))
    monkeypatch.setattr(flex.Flex, "_run", staticmethod(fake_flex_run))
    monkeypatch.setattr(flex, "backward_runs_on", lambda device: True)
    monkeypatch.setattr(flex.Flex, "applies", staticmethod(lambda device, dtype, D: True))


RUNS = chunk_layout([0, 1, 2, 3, 3, 2, 1, 0, 1, 1, 3, 2, 2, 3, 0, 0], 4, 4)
"""A batch's own layout (``ringseq.balance``): 64 tokens in chunks of 4 over 4 ranks, some merged into runs."""

CASES = {"documents": dict(packed=True), "left padding": dict(padded=True), "window": dict(window=11),
         "documents + window + GQA + sinks": dict(packed=True, window=19, sinks=True)}


@pytest.mark.parametrize("feature", CASES)
@pytest.mark.parametrize("kernel", ["cuda_varlen", "flex"])
def test_ring_with_the_cuda_backends_glue_is_exact(cuda_on_cpu, kernel, feature):
    kw = dict(CASES[feature])
    if kernel == "flex":
        kw["softcap"] = 3.0
    B, H, K, S, D = 2, 4, 2 if "GQA" in feature else 4, 64, 16
    g = torch.Generator().manual_seed(len(feature))
    q, dout = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, K, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(H, generator=g, dtype=torch.float64) if kw.get("sinks") else None
    pos = mask = None
    if kw.get("packed"):  # documents of 5..20 tokens
        pos = torch.tensor([sum((list(range(int(n))) for n in torch.randint(5, 21, (S,), generator=g)), [])[:S]
                            for _ in range(B)])
    if kw.get("padded"):  # left padding of 1..15 tokens
        mask = torch.ones(B, S, dtype=torch.long)
        for b in range(B):
            mask[b, :int(torch.randint(1, 16, (1,), generator=g))] = 0
    feats = dict(window=kw.get("window"), softcap=kw.get("softcap"))
    ref = attention(q, k, v, dout, causal=True, sinks=sinks, position_ids=pos, attention_mask=mask, **feats)[:4]
    info = TokenInfo(doc=None if pos is None else documents(pos), valid=None if mask is None else mask.bool())
    for layout, groups in (("zigzag", 1), ("striped", 1), (RUNS, 1), ("zigzag", K)):  # K: one ring per kv head
        got = virtual_ring(q, k, v, dout, P=4, layout=layout, info=info, sinks=sinks, kernel=kernel,
                           head_groups=groups, **feats)
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            err = (g - r).abs().max().item()
            assert err < 1e-9 * max(1.0, r.abs().max().item()), (kernel, feature, layout, groups, name, err)
