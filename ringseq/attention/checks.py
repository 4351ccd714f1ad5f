"""Argument checks of ``ring_attention``: every problem a ``RingSeqError`` that names the fix."""
from __future__ import annotations

import math

import torch

from ringseq.errors import RingSeqError
from ringseq.layouts import layout_code, multiple

from ringseq.lockstep import KERNELS, checksum, dtype_code, float_bits
from ringseq.topology import check_sp  # noqa: F401 - part of the checks' interface

from .masks import TokenInfo


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RingSeqError(f"q, k, v must be 4-D [B, heads, s, D]; got shapes {tuple(q.shape)}, "
                           f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise RingSeqError(f"k and v must agree on batch, kv heads and local length (v may have a head dim of its "
                           f"own, as in MLA); got {tuple(k.shape)} and {tuple(v.shape)}")
    (B, H, s, D), (Bk, K, sk, Dk) = q.shape, k.shape
    if (B, s, D) != (Bk, sk, Dk):
        raise RingSeqError(f"q [B,H,s,D]={tuple(q.shape)} and k/v [B,K,s,D]={tuple(k.shape)} must agree "
                           f"on batch, local length and head dim")
    if K == 0 or H % K:
        raise RingSeqError(f"query heads H={H} must be a multiple of kv heads K={K} (GQA/MQA)")
    if (s * sp.size) % multiple(sp.layout, sp.ring_size, sp.ulysses_size):
        raise RingSeqError(f"local length {s} cannot come from layout {sp.layout!r} over "
                           f"{sp.size} ranks: shard the sequence with ringseq.shard")


def _number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


LARGEST = 2**62
"""The largest integer argument a record holds (an int64 slot, with room)."""


def check_features(q, causal, scale, window, softcap, sinks) -> None:
    if not isinstance(causal, bool):
        raise RingSeqError(f"causal must be True or False, got {causal!r} (a {type(causal).__name__}): a string or "
                           f"number would be read as a flag by its truth value")
    if scale is not None and not (_number(scale) and 0 < scale < math.inf):
        raise RingSeqError(f"scale must be a positive finite number (the factor on q.k; None: 1/sqrt(head dim)), "
                           f"got {scale!r}")
    if window is not None:
        if not causal:
            raise RingSeqError("window (sliding-window attention) is defined for causal attention "
                               "only (query i sees key j when 0 <= i - j < window); pass causal=True")
        if not _number(window) or int(window) != window or not 1 <= window <= LARGEST:
            raise RingSeqError(f"window must be a positive integer (a number of tokens; None for none), got {window!r}")
    if softcap is not None and not (_number(softcap) and 0 < softcap < math.inf):
        raise RingSeqError(f"softcap must be a positive finite number, got {softcap!r}")
    if sinks is not None and tuple(sinks.shape) != (q.size(1),):
        raise RingSeqError(f"sinks must hold one logit per query head, shape [{q.size(1)}]; "
                           f"got {tuple(sinks.shape)}")


def check_token_info(info: TokenInfo, B: int, S: int) -> None:
    for name in ("doc", "valid", "block"):
        value = getattr(info, name)
        if value is not None and (value.dim() != 2 or value.size(1) != S or value.size(0) not in (1, B)):
            raise RingSeqError(f"token_info.{name} has shape {tuple(value.shape)} but the sequence group holds "
                               f"batch {B} x {S} tokens; build it with ringseq.token_info from this batch's "
                               f"position_ids/attention_mask shards")


def check_tensors(q, k, v, sinks) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        if name == "sinks" and t is None:
            continue
        if not torch.is_tensor(t):
            raise RingSeqError(f"{name} must be a torch.Tensor, got {type(t).__name__} (stack lists with torch.stack)")
        if not t.is_floating_point():
            raise RingSeqError(f"{name} must be a floating-point tensor (attention of integer or bool values is not "
                               f"defined), got {t.dtype}")
    devices = [str(t.device) for t in (q, k, v, sinks) if t is not None]
    if len(set(devices)) > 1:
        raise RingSeqError(f"q, k, v{' and sinks' if sinks is not None else ''} must be on one device; got "
                           f"{', '.join(devices)} (move them with .to(q.device))")
    if not (q.dtype == k.dtype == v.dtype):
        raise RingSeqError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype} (under torch.autocast "
                           f"ring_attention casts them to the autocast dtype itself)")


def check_local(q, k, v, *, causal, scale, window, softcap, sinks, slab_rows, head_groups) -> None:
    """What this rank can tell is wrong alone, before the call's agreement: its tensors (types,
    device, dtypes), the flags and numbers (causal, scale, window, softcap, sinks, slab rows) and
    the form of head_groups. ``ring_attention`` then refuses the call in its agreement
    (``lockstep.refuse``): every rank raises in this call, before any transfer, and the group stays
    in step."""
    check_tensors(q, k, v, sinks)
    check_features(q, causal, scale, window, softcap, sinks)
    if slab_rows is not None and (not _number(slab_rows) or int(slab_rows) != slab_rows
                                  or not 1 <= slab_rows <= LARGEST):
        raise RingSeqError(f"slab_rows must be a positive integer (query rows per kernel slab), got {slab_rows!r}")
    if head_groups is not None and head_groups != "kv" and (
            isinstance(head_groups, bool) or not isinstance(head_groups, int) or not 1 <= head_groups <= LARGEST):
        raise RingSeqError(f"head_groups must be a positive integer dividing the kv heads the ring holds, or \"kv\" "
                           f"(one ring per kv head); got {head_groups!r}. None or 1 runs one ring for all heads")


def tensor_fields(name: str, t) -> dict[str, int]:
    """dtype, dimensions and the first four sizes of a tensor (or of nothing) for a record."""
    shape = list(t.shape) if torch.is_tensor(t) else []
    fields = {f"{name} dtype": dtype_code(t), f"{name} dims": len(shape) if torch.is_tensor(t) else -1}
    fields.update({f"{name}.shape[{i}]": n for i, n in enumerate((shape + [-1] * 4)[:4])})
    return fields


def _number_bits(x) -> int:
    try:
        return float_bits(x)
    except (TypeError, ValueError):
        return -3


def call_record(q, k, v, *, causal, scale, window, softcap, sinks, position_ids, attention_mask, token_info,
                kernel, slab_rows, head_groups=None) -> dict[str, int]:
    """Everything about a ``ring_attention`` call that every rank of the group must share."""
    fields = {**tensor_fields("q", q), **tensor_fields("k", k), **tensor_fields("v", v)}
    fields.update({
        "causal": int(bool(causal)), "scale": _number_bits(scale), "window": _number_bits(window),
        "softcap": _number_bits(softcap), "sinks": dtype_code(sinks),
        "kernel": -1 if kernel is None else (KERNELS.index(kernel) if kernel in KERNELS else 99),
        "slab_rows": -1 if slab_rows is None else _number_bits(slab_rows),
        "head_groups": -1 if head_groups is None else -2 if head_groups == "kv" else _number_bits(head_groups),
        **tensor_fields("position_ids", position_ids), **tensor_fields("attention_mask", attention_mask),
        "token_info": -1 if token_info is None else token_checksum(token_info),
    })
    return fields


def token_checksum(info) -> int:
    """Shapes and a position-weighted sum of the documents and padding, and the batch's own
    layout (once per TokenInfo)."""
    if not isinstance(info, TokenInfo):
        return -3
    if "checksum" not in info._cache:
        total = 0
        for t in (info.doc, info.valid, info.block):
            if t is None:
                total = (total * 31 + 7) % 2**61
                continue
            total = (total * 31 + hash(tuple(t.shape)) + checksum(t)) % 2**61
        if info.layout is not None:  # the batch's own layout (ringseq.balance)
            total = (total * 31 + layout_code(info.layout)) % 2**61
        info._cache["checksum"] = total
    return info._cache["checksum"]
