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

from ringseq import lockstep
from ringseq.attention import compiled, ring_attention
from ringseq.attention.decode import decode_attention
from ringseq.errors import RingSeqError

from . import compiled_decode
from .cache import DecodeStep
from .documents import probe_mask_call

# Keyword arguments transformers (5.x) hands every attention function that ringseq may ignore:
# the layer's position ids (this rank's shard; the rotary embedding has used them and the
# documents are in ``ringseq``), caching flags (the layer has used its cache before attention is
# called) and output flags that attention does not read.
IGNORED = frozenset({"position_ids", "cache_position", "output_hidden_states", "num_items_in_batch",
                     "output_router_logits", "return_dict"})
# Arguments that are fine only with these values.
ALLOWED_VALUES = {"use_cache": (False, True, None), "output_attentions": (False, None), "is_causal": (True, None)}


def mask_function(*args, use_vmap: bool = False, **kwargs):
    probe_mask_call(kwargs)
    if use_vmap:
        # transformers sets use_vmap exactly when a model adds its own or/and mask functions
        # (bidirectional image tokens, block overlays) on top of the causal mask
        raise RingSeqError("this model adds custom mask functions to the causal mask (e.g. bidirectional "
                           "image-token blocks); ringseq supports causal, sliding-window, packed-document "
                           "and padding masks only")
    return None


def _check_kwargs(kwargs: dict) -> None:
    """Refuse every argument ringseq would otherwise silently not apply."""
    for name, allowed in ALLOWED_VALUES.items():
        if kwargs.get(name) not in allowed:
            raise RingSeqError(f"attention got {name}={kwargs[name]!r}, which ringseq does not reproduce (it computes "
                               f"causal attention without attention weights); leave {name} unset")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in IGNORED and k not in ALLOWED_VALUES)
    if unknown:
        raise RingSeqError(f"attention got arguments ringseq does not read: {', '.join(unknown)} (e.g. flash-attention "
                           f"packing metadata or a position bias); ringseq reads packed documents from position_ids "
                           f"and supports causal, window, softcap and sink attention only")


def _decode_eagerly(module, query, key, value, step: DecodeStep, scaling, sliding_window, softcap, s_aux):
    """A decode step's attention: the new tokens over every rank's cache shard."""
    held = step.cache.last_layer  # the keys this layer's cache just returned: their indices and padding
    if held is None or held.keys is not key:
        raise RingSeqError("a decode step's attention got keys that are not the sharded cache's: this model "
                           "does not read its keys from past_key_values.update, which ringseq needs")
    with lockstep.layer(getattr(module, "layer_idx", None)):
        out = decode_attention(query, key, value, sp=step.sp, q_pos=step.q_pos, k_pos=held.positions,
                               k_valid=held.valid, scale=scaling, window=sliding_window, softcap=softcap,
                               sinks=s_aux, agreed=True)
    return out.transpose(1, 2).contiguous(), None


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, s_aux=None, ringseq=None, **kwargs):
    _check_kwargs(kwargs)
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
    if torch.compiler.is_compiling():  # the ring as one op in the compiled graph (``ringseq.attention.compiled``)
        if isinstance(ringseq, DecodeStep):  # generation's decode step (``patches.compiled_decode``)
            out = compiled_decode.attend(module, query, key, value, ringseq, scale=scaling, window=sliding_window,
                                         softcap=softcap, sinks=s_aux)
            return out.transpose(1, 2).contiguous(), None
        out = compiled.attend(query, key, value, batch=ringseq, scale=scaling, window=sliding_window, softcap=softcap,
                              sinks=s_aux)
        return out.transpose(1, 2).contiguous(), None
    if isinstance(ringseq, DecodeStep):  # generation: the new tokens over every rank's cache shard
        return _decode_eagerly(module, query, key, value, ringseq, scaling, sliding_window, softcap, s_aux)
    with lockstep.layer(getattr(module, "layer_idx", None)):
        out = ring_attention(query, key, value, sp=ringseq.sp, causal=True, scale=scaling, window=sliding_window,
                             softcap=softcap, sinks=s_aux, token_info=ringseq.info, head_groups=ringseq.head_groups)
    return out.transpose(1, 2).contiguous(), None  # transformers wants [B, s, H, D]
