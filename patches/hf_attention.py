"""The functions transformers calls for ``attn_implementation="ringseq"`` (shapes: ``ringseq.shapes``).

``attention_forward`` is called by every attention layer with this rank's q [B,H,s,D] and
k/v [B,K,s,D]; it finds the sequence group and the batch's documents and padding in the
``ringseq`` keyword argument that the patched model passes down (transformers forwards model
keyword arguments to attention functions, also when a checkpointed layer is recomputed).

``mask_function`` is what transformers calls to build masks for this implementation. It
builds nothing: the ring computes visibility from a few integers per token. It only refuses
masks it cannot reproduce.
"""
from __future__ import annotations

import torch

from ringseq.attention import ring_attention
from ringseq.errors import RingSeqError

from .documents import probe_mask_call


def mask_function(*args, use_vmap: bool = False, **kwargs):
    probe_mask_call(kwargs)
    if use_vmap:
        # transformers sets use_vmap exactly when a model adds its own or/and mask functions
        # (bidirectional image tokens, block overlays) on top of the causal mask
        raise RingSeqError("this model adds custom mask functions to the causal mask (e.g. bidirectional "
                           "image-token blocks); ringseq supports causal, sliding-window, packed-document "
                           "and padding masks only")
    return None


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, s_aux=None, ringseq=None, **kwargs):
    if ringseq is None:
        raise RingSeqError("attn_implementation='ringseq' needs the model patched with ringseq.patch(model, sp=sp), "
                           "and a batch from the patched forward or ringseq.shard_batch")
    if torch.is_tensor(attention_mask):
        raise RingSeqError("a custom 4-D attention mask cannot be split over the ring; pass a 2-D padding "
                           "attention_mask and/or packed position_ids instead")
    if dropout and module.training:
        raise RingSeqError(f"attention dropout {dropout} in training is not reproduced by ringseq; set "
                           f"config.attention_dropout = 0.0")
    if not getattr(module, "is_causal", True):
        raise RingSeqError("bidirectional attention is not supported; ringseq patches causal decoders")
    out = ring_attention(query, key, value, sp=ringseq.sp, causal=True, scale=scaling, window=sliding_window,
                         softcap=softcap, sinks=s_aux, token_info=ringseq.info)
    return out.transpose(1, 2).contiguous(), None  # transformers wants [B, s, H, D]
