"""``ringseq.ring_attention`` and ``ringseq.token_info``: exact softmax attention over a sequence
split across ranks (checks, then the ring, or Ulysses/hybrid around the ring)."""
from __future__ import annotations

import dataclasses
import math

import torch

from ringseq import lockstep
from ringseq.errors import RingSeqError
from ringseq.layouts import check_length
from ringseq.sharding import gather

from . import keep
from .checks import call_record, check_local, check_shapes, check_sp, check_token_info, dtype_code
from .masks import TokenInfo, documents
from .ring import CallNumbers, RingAttention, RingOptions
from .ulysses import HeadsToSeq, SeqToHeads, kv_replicas


def token_info(sp, position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
               blocks: torch.Tensor | None = None) -> TokenInfo:
    """Documents and padding of the whole sequence, from this rank's shards.

    ``position_ids`` [B, s] (or [s]): this rank's shard of the global position ids; a new
    document starts wherever ``position_ids[i] != position_ids[i-1] + 1``. ``attention_mask``
    [B, s]: this rank's shard of the 2-D padding mask (1 = real token). Both are all-gathered
    once (S integers per sample); build this once per forward and pass it to every layer as
    ``ring_attention(..., token_info=...)``. ``blocks`` [B, s]: this rank's shard of bidirectional
    block ids (-1: none; each block one run of tokens, e.g. an image's tokens under Gemma 3): under
    causal attention a token also sees the later tokens of its own block.
    """
    doc = valid = None
    if position_ids is not None:
        pos = gather(position_ids.reshape(-1, position_ids.size(-1)).long(), -1, sp=sp)
        doc = documents(pos)
        if not bool(doc.any()):
            doc = None  # one document per sample: nothing to mask
    if attention_mask is not None:
        if attention_mask.dim() > 2 or bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise RingSeqError(f"attention_mask must be this rank's shard of the 2-D [batch, sequence] padding mask "
                               f"holding 0 (padding) and 1 (real token); got shape {tuple(attention_mask.shape)}"
                               f"{'' if attention_mask.dim() > 2 else ' with other values'}. Express packed "
                               f"documents with position_ids restarting at 0")
        valid = gather(attention_mask.reshape(-1, attention_mask.size(-1)).long(), -1, sp=sp).bool()
        if bool(valid.all()):
            valid = None
    block = None
    if blocks is not None:
        block = gather(blocks.reshape(-1, blocks.size(-1)).long(), -1, sp=sp).int()
        if not bool((block >= 0).any()):
            block = None
    return TokenInfo(doc=doc, valid=valid, block=block)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sp, causal: bool = True,
                   scale: float | None = None, position_ids=None, window=None, softcap=None,
                   sinks=None, attention_mask=None, token_info: TokenInfo | None = None,
                   kernel: str | None = None, slab_rows: int | None = None,
                   head_groups: int | str | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole (global) sequence.

    q [B,H,s,D], k [B,K,s,D], v [B,K,s,Dv] (H % K == 0; K/V cross the wire at K heads; v's head
    dim may differ, as in MLA), each this rank's shard by ``sp.layout`` (or by the batch's own
    layout that ``token_info`` carries: ``shard_batch``'s ``local["ringseq"].info``). Returns [B,H,s,Dv] in
    q's dtype; differentiable in q, k, v and sinks.

    position_ids  this rank's shard of the global position ids: packed documents attend only
                  inside themselves (see ``token_info``).
    window        query i sees key j when 0 <= i - j < window (transformers' sliding_window).
    softcap       scores -> softcap * tanh(scores / softcap) (Gemma 2).
    sinks         [H] logits that join every softmax denominator (gpt-oss).
    attention_mask this rank's shard of the [B, S] padding mask (1 = real token): padding keys
                  never contribute.
    token_info    documents and padding prebuilt by ``ringseq.token_info`` (instead of the two
                  above; saves their all-gather when many layers share them).
    kernel        force a block backend (``cpu_flash``, ``cuda_flash``, ``cuda_varlen``, ``flex``,
                  ``torch``; ``ringseq.attention.kernels.select``); by default the fastest one
                  that applies, chosen per call. A forced kernel is refused only for a call it
                  cannot compute (a mask or softcap it does not take).
    slab_rows     query rows per kernel slab (bounds masks and scores to slab_rows x keys);
                  None: each backend's default.
    head_groups   a memory switch: rings per call, run one after the other, each over an equal
                  share of the kv heads the ring holds (under Ulysses: this rank's after the
                  all-to-all) and their query heads; it must divide those kv heads ("kv": one
                  ring per kv head). Only one group's travelling K/V blocks, dK/dV accumulators
                  and kernel gradients exist at a time, for groups times the transfers and kernel
                  launches, each 1/groups the size: slower, most of all on a GPU with short
                  shards. None or 1 (default): one ring for every head.

    Under ``torch.autocast`` q, k and v are cast to the autocast dtype first, as
    ``scaled_dot_product_attention`` does (a model's rotary embedding typically hands over fp32
    q/k and a bf16 v), and the ring itself runs with autocast off: it merges and accumulates in
    fp32 on purpose.
    """
    device = q.device.type if torch.is_tensor(q) else "cpu"
    if torch.is_tensor(q) and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
        with torch.autocast(device, enabled=False):
            return ring_attention(q, k, v, sp=sp, causal=causal, scale=scale, position_ids=position_ids, window=window,
                                  softcap=softcap, sinks=sinks, attention_mask=attention_mask, token_info=token_info,
                                  kernel=kernel, slab_rows=slab_rows, head_groups=head_groups)
    check_sp(sp)
    try:  # this rank's own misuse: refused in the call's agreement, so every rank raises in this call, in step
        check_local(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks,
                    slab_rows=slab_rows, head_groups=head_groups)
    except RingSeqError as err:
        lockstep.refuse(sp, "ring_attention forward", err)
    fields = call_record(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks,
                         position_ids=position_ids, attention_mask=attention_mask, token_info=token_info,
                         kernel=kernel, slab_rows=slab_rows, head_groups=head_groups)
    # a raw call (or one under Ulysses) ends by sharing its outcome: a failure after the last transfer
    # reaches every rank in this call (a patched forward's later agreements carry it otherwise)
    fields["outcome shared"] = shared = int(not lockstep.in_batch() or sp.ulysses_size > 1)
    number = lockstep.agree(sp, "ring_attention forward", fields)  # before anything can fail on one rank only
    layer = lockstep.current_layer()
    label = f"ring_attention #{number}" + (f" (layer {layer})" if layer >= 0 else "")
    # The ranks agreed on every argument: a check that fails now fails on every rank alike (still in step)
    opts = _options(q, k, v, sp, causal, scale, position_ids, window, softcap, sinks, attention_mask, token_info,
                    kernel, slab_rows, label, number, head_groups, bool(shared))
    try:
        out = _run(q, k, v, sinks, sp, opts)
    except RingSeqError:  # a peer's failure reached this rank (its origin left the note), or one alike on every rank
        lockstep.mark_failed(sp)
        raise
    except BaseException as exc:  # this rank's own: a note for the peers, quoted by their errors
        lockstep.mark_failed(sp, f"{label}: {type(exc).__name__}: {exc}")
        raise
    return AgreeInBackward.apply(out, sp, fields, layer, opts.numbers) if out.requires_grad else out


class AgreeInBackward(torch.autograd.Function):
    """Identity on the output whose backward agrees the call's backward across the group first,
    before any of its all-to-alls or ring transfers (a rank that skipped a backward, or runs a
    different one, makes every rank raise); its lockstep number tags the backward's transfers."""

    @staticmethod
    def forward(ctx, out, sp, fields, layer, numbers):
        ctx.sp, ctx.fields, ctx.layer, ctx.numbers = sp, fields, layer, numbers
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        with lockstep.layer(ctx.layer):
            ctx.numbers.backward = lockstep.agree(ctx.sp, "ring_attention backward",
                                                  {**ctx.fields, "grad dtype": dtype_code(grad)})
        return grad, None, None, None, None


def _options(q, k, v, sp, causal, scale, position_ids, window, softcap, sinks, attention_mask, token_info, kernel,
             slab_rows, label, number, head_groups=None, shared: bool = False) -> RingOptions:
    check_shapes(q, k, v, sp)
    groups = _head_groups(q.size(1), k.size(1), sp.ulysses_size, head_groups)
    if token_info is None:
        token_info = _token_info_or_none(sp, position_ids, attention_mask)
    elif position_ids is not None or attention_mask is not None:
        raise RingSeqError("pass either token_info or position_ids/attention_mask, not both")
    check_token_info(token_info, q.size(0), q.size(2) * sp.size)
    if token_info.layout is not None:
        check_length(token_info.layout, q.size(2) * sp.size, sp.ring_size, sp.ulysses_size)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    layout = sp.layout if token_info.layout is None else token_info.layout  # a batch's own (ringseq.balance)
    return RingOptions(group=sp.ring_group, ranks=sp.ring_ranks, r=sp.ring_rank, layout=layout,
                       causal=bool(causal), scale=scale, kernel=kernel,
                       window=None if window is None else int(window),
                       softcap=None if softcap is None else float(softcap), info=token_info, slab_rows=slab_rows,
                       sp=sp, label=label, kept=keep.current(), numbers=CallNumbers(forward=number),
                       head_groups=groups, shared=shared)


def _head_groups(H: int, K: int, U: int, groups) -> int:
    """The head groups of each ring call: a divisor of the kv heads the ring holds (under Ulysses
    its share of them, after the copies that give every Ulysses rank one); "kv": all of them."""
    ring_kv = max(K, U) // U
    if groups is None:
        return 1
    if groups == "kv":
        return ring_kv
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or ring_kv % groups:
        where = f" (this rank's share under Ulysses {U} of {K})" if U > 1 else ""
        raise RingSeqError(f"head_groups must be a positive integer dividing the {ring_kv} kv heads the ring "
                           f"holds{where}, or \"kv\" (one ring per kv head); got {groups!r}. None or 1 runs one "
                           f"ring for all heads (the default, and the fastest)")
    return groups


def _run(q, k, v, sinks, sp, opts: RingOptions):
    """The ring, or Ulysses around the ring. A value head dim of its own (MLA) is padded with
    zeros to the query's (or the query and key to the value's: zero columns add nothing to a
    score; the scale is already fixed), and the output cut back: exact."""
    D, Dv = q.size(-1), v.size(-1)
    if D != Dv:
        width = max(D, Dv)
        q, k, v = (torch.nn.functional.pad(t, (0, width - t.size(-1))) for t in (q, k, v))
        if opts.kernel is None and q.device.type == "cpu":
            # SDPA on the CPU runs unequal head dims in its math path; aten's CPU flash kernel (equal
            # dims only) is up to 2.4x less accurate in dq at such sizes: the blockwise kernel matches
            opts = dataclasses.replace(opts, kernel="torch")
        return _run(q, k, v, sinks, sp, opts)[..., :Dv]
    U = sp.ulysses_size
    if U == 1:
        return RingAttention.apply(q, k, v, sinks, opts)
    H, K = q.size(1), k.size(1)
    copies = kv_replicas(H, K, U)
    if copies > 1:  # only as many copies as give every Ulysses rank one kv head
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    if sinks is not None:
        h = H // U
        sinks = sinks[sp.ulysses_rank * h:(sp.ulysses_rank + 1) * h]
    q, k, v = (SeqToHeads.apply(t, sp) for t in (q, k, v))
    out = RingAttention.apply(q, k, v, sinks, opts)
    return HeadsToSeq.apply(out, sp)


def _token_info_or_none(sp, position_ids, attention_mask) -> TokenInfo:
    if position_ids is None and attention_mask is None:
        return TokenInfo()
    return token_info(sp, position_ids, attention_mask)
