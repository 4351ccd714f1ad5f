"""Generation's decode step as PyTorch custom ops, for a patched model under ``torch.compile``.

A decode step's attention layer does two things dynamo cannot trace: it keeps the new keys and
values in the rank's cache shard on this rank's turn (``KVShard.keep``: Python bookkeeping of
global indices, padding and windows), and it attends over every rank's shard (one all-gather,
``ringseq.attention.decode``). Under ``torch.compile`` each is one op:

- ``ringseq::decode_keep`` (called by ``KVShard.update``, with the layer's cache index): keeps the
  new keys and values as the eager update does and returns copies of them (an op's outputs may
  not alias its inputs). It marks the layer as the one whose attention comes next.
- ``ringseq::decode_attention`` (called by the patched attention with the copies): attends over
  the keys of the layer the keep op marked, and unmarks it.

The attention op's inputs are the keep op's outputs, and the next layer's keep op depends on
this layer's output, so the two run in this order in any schedule of the graph: what the eager
path relies on (``ShardedCache.last_layer``). An attention op with no keep before it in the step
(a layer that reuses another's keys, or a keep that ran eagerly into another layer) is refused.
Both take the step as a 0-d tensor (``DecodeStep.key``), so the step's facts (the new tokens'
indices, who keeps them) are no constants of the graph: every step of one length runs one graph.
Neither has a gradient: generation runs without one.
"""
from __future__ import annotations

from typing import Optional

import torch

from ringseq import lockstep
from ringseq.attention.compiled import OP_TAGS, batch_of, given
from ringseq.attention.decode import decode_attention
from ringseq.errors import RingSeqError


@torch.library.custom_op("ringseq::decode_keep", mutates_args=(), tags=OP_TAGS)
def _keep(k: torch.Tensor, v: torch.Tensor, step: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    found = batch_of(step)
    found.cache.layers[layer].keep(k, v)
    return k.clone(), v.clone()


@_keep.register_fake
def _(k, v, step, layer):
    return torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("ringseq::decode_attention", mutates_args=(), tags=OP_TAGS)
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor], step: torch.Tensor,
            scale: float, window: int, softcap: float, layer: int) -> torch.Tensor:
    found = batch_of(step)
    cache = found.cache
    held, cache.last_layer = cache.last_layer, None
    if held is None or held.cache is not cache or k.size(-2) != found.q_pos.numel():
        raise RingSeqError("a compiled decode step's attention got keys its layer did not keep through the sharded "
                           "cache (past_key_values.update), which ringseq needs (a layer that reuses another "
                           "layer's keys is not supported): generate without torch.compile")
    with lockstep.layer(None if layer < 0 else layer):
        out = decode_attention(q, held.keys, held.values, sp=found.sp, q_pos=found.q_pos, k_pos=held.positions,
                               k_valid=held.valid, scale=scale, window=given(window, -1),
                               softcap=given(softcap, 0.0), sinks=sinks, agreed=True)
    return out.contiguous()


@_attend.register_fake
def _(q, k, v, sinks, step, scale, window, softcap, layer):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def keep(layer, k: torch.Tensor, v: torch.Tensor):
    """``KVShard.update`` as a compiled graph sees it: the keep op on the layer's cache index."""
    return torch.ops.ringseq.decode_keep(k, v, layer.cache.step.key, layer.index)


def attend(module, q, k, v, step, *, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """The patched attention's decode call as the compiled graph sees it: [B, H, n, Dv]."""
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    return torch.ops.ringseq.decode_attention(q, k, v, sinks, step.key, scale, -1 if window is None else int(window),
                                              0.0 if softcap is None else float(softcap), _index(module))


def _index(module) -> int:
    index = getattr(module, "layer_idx", None)
    return -1 if index is None else int(index)
