"""``flex``: FlexAttention (``torch.nn.attention.flex_attention``) with a block mask and a score mod.

It takes every call: the visibility of a masked call (causal, window, same document, valid key;
``ringseq.attention.masks``) is a ``mask_mod`` over small device tables of the call's global
positions, document ids and validity, turned into a ``BlockMask`` once per batch and call
(cached on the ``TokenInfo``, shared by every layer) before the ring loop; softcap is the
``score_mod``; GQA is native; the log-sum-exp comes from ``return_aux=AuxRequest(lse=True)``.
On CUDA it runs compiled (fused Triton kernels); elsewhere eagerly, which torch supports for the
forward only.

Backward with the merged log-sum-exp L: FlexAttention's own backward uses the block's own
(o_b, l_b), so the block is recomputed under autograd and given the gradients the merge
out = sum_b exp(l_b - L) o_b passes to it: dout_b = w dout and dl_b = w <dout, o_b - out> with
w = exp(l_b - L). Its softmax gradient then is exp(s - l_b) w = exp(s - L) and its row term
<dout_b, o_b> - dl_b = w <dout, out>, exactly the merged backward (one more block forward).
"""
from __future__ import annotations

import functools

import torch

from ringseq.errors import RingSeqError

from .common import BlockSpec

BLOCK = 128  # FlexAttention's block size (rows and columns of one mask block)


@functools.cache
def _flex():
    """(flex_attention as the device wants it, create_block_mask, AuxRequest)."""
    from torch.nn.attention import flex_attention as fa

    return fa.flex_attention, torch.compile(fa.flex_attention), fa.create_block_mask, fa.AuxRequest


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _tables(mask, B: int, device):
    """Device tables of a masked call: positions [n], [m]; doc [B', n], [B', m]; valid [B', m]."""
    q, k, info = mask.q, mask.k, mask.info
    tables = {"qpos": q.positions(), "kpos": k.positions()}
    if info.doc is not None:
        tables["qdoc"], tables["kdoc"] = info.doc[:, q.slice()], info.doc[:, k.slice()]
    if info.valid is not None:
        tables["kvalid"] = info.valid[:, k.slice()]
    if info.block is not None and mask.causal:
        tables["qblock"], tables["kblock"] = info.block[:, q.slice()], info.block[:, k.slice()]
    return {name: _to_device(t.contiguous(), device) for name, t in tables.items()}


def mask_mod(spec: BlockSpec, tables: dict | None, window: int | None):
    """The visibility of a call as FlexAttention's mask_mod(b, h, q_idx, kv_idx)."""
    if tables is None:  # unmasked: top-left causal or everything
        if spec.causal:
            return lambda b, h, qi, ki: ki <= qi
        return None
    t = tables
    causal = spec.mask.causal
    nd = t["qdoc"].size(0) if "qdoc" in t else 1
    nv = t["kvalid"].size(0) if "kvalid" in t else 1
    nb = t["qblock"].size(0) if "qblock" in t else 1

    def visible(b, h, qi, ki):
        i, j = t["qpos"][qi], t["kpos"][ki]
        ok = j <= i if causal else j >= 0
        if "qblock" in t:  # bidirectional blocks widen the causal term
            qb = t["qblock"][b if nb > 1 else 0, qi]
            ok = ok | ((qb == t["kblock"][b if nb > 1 else 0, ki]) & (qb >= 0))
        if window is not None:
            ok = ok & (i - j < window)
        if "qdoc" in t:
            bd = b if nd > 1 else 0
            ok = ok & (t["qdoc"][bd, qi] == t["kdoc"][bd, ki])
        if "kvalid" in t:
            ok = ok & t["kvalid"][b if nv > 1 else 0, ki]
        return ok

    return visible


@functools.lru_cache(maxsize=16)
def score_mod(softcap: float | None):
    """The softcap as FlexAttention's score_mod: one function per value, so the compiled kernel
    made for it serves every layer, ring step and batch (a new closure could cost a recompile)."""
    if softcap is None:
        return None
    return lambda score, b, h, qi, ki: softcap * torch.tanh(score / softcap)


def prepared(spec: BlockSpec, B: int, n: int, m: int, device):
    """The call's BlockMask (None: nothing to mask), cached per batch and call."""
    mask = spec.mask
    if mask is None:
        key, cache = ("flex dense", B, n, m, spec.causal, str(device)), _DENSE
    else:
        key, cache = ("flex", mask.q, mask.k, mask.window, mask.causal, B, str(device)), mask.info._cache
    if key not in cache:
        tables = None if mask is None else _tables(mask, B, device)
        mod = mask_mod(spec, tables, None if mask is None else mask.window)
        per_sample = mask is not None and not mask.info.trivial
        cache[key] = None if mod is None else _flex()[2](mod, B if per_sample else None, None, n, m,
                                                         device=device, BLOCK_SIZE=BLOCK)
    return cache[key]


_DENSE: dict = {}  # block masks of unmasked calls depend on shapes only


def backward_runs_on(device: torch.device) -> bool:
    """Whether torch has FlexAttention's backward for this device (CUDA only, in torch 2.13)."""
    return device.type == "cuda"


class Flex:
    name, takes_mask, takes_softcap = "flex", True, True
    exact_lse = True  # takes the merged log-sum-exp at its own precision (else in the accumulation dtype)
    prepared = staticmethod(prepared)

    @staticmethod
    def prepare(spec: BlockSpec, q, n: int, m: int) -> None:
        """Build the call's block mask once per batch (every layer and the backward reuse it)."""
        prepared(spec, q.size(0), n, m, q.device)

    @staticmethod
    def applies(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in (torch.float16, torch.bfloat16, torch.float32)

    @staticmethod
    def _run(q, k, v, spec: BlockSpec):
        eager, compiled, _, aux = _flex()
        fn = compiled if q.is_cuda else eager
        block_mask = prepared(spec, q.size(0), q.size(2), k.size(2), q.device)
        out, extra = fn(q, k, v, score_mod=score_mod(spec.softcap), block_mask=block_mask, scale=spec.scale,
                        enable_gqa=q.size(1) != k.size(1), return_aux=aux(lse=True))
        return out, extra.lse

    @staticmethod
    def forward(q, k, v, spec: BlockSpec):
        out, lse = Flex._run(q.detach(), k.detach(), v.detach(), spec)  # no autograd graph: the ring's backward
        # rows that see nothing: output 0 and lse -inf, whatever sign the kernel reports
        return out, _minus_inf(lse), None

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, spec: BlockSpec):
        if not backward_runs_on(q.device):
            raise RingSeqError("kernel 'flex' has no backward on the CPU (FlexAttention's backward needs CUDA); "
                               "train on the CPU with kernel='cpu_flash' or 'torch', or leave kernel unset")
        with torch.enable_grad():
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            o_b, l_b = Flex._run(qg, kg, vg, spec)
        # [B,H,n]; 0 where the block's row sees nothing (l_b -inf; the merged lse is real, or -1e30 for a
        # row that sees no key at all)
        w = torch.exp(_minus_inf(l_b.detach()).double() - lse.double())
        d_o = (dout.double() * w.unsqueeze(-1)).to(o_b.dtype)
        d_l = (w * (dout.double() * (o_b.detach().double() - out.double())).sum(-1)).to(l_b.dtype)
        return (*torch.autograd.grad((o_b, l_b), (qg, kg, vg), (d_o, d_l)), 0)


def _minus_inf(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp with -inf for rows that see nothing, whatever sign of infinity the kernel reports."""
    return lse.nan_to_num(posinf=float("-inf"), neginf=float("-inf"))
