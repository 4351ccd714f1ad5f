"""``generate`` on a patched vision-language model: the model's own multimodal code on the whole
prompt, its language model prefilled through the ring into the sharded cache, decode steps over
the group's cache shards (shapes: ``ringseq.shapes``; the text path: ``patches.generation``).

The prefill runs the VLM's inner model on the full prompt on every rank (the vision tower on all
images, or on this rank's share with ``split_vision``; the merge of the image features; the
positions, Qwen's 3-D mRoPE rows as ``generate`` or the model computes them, its rope deltas kept
by the model for the new tokens as it keeps them unpatched). Its one call of the language model
is intercepted: the merged embeddings, the positions, the padding mask, Gemma 3's bidirectional
image blocks and Qwen3-VL's DeepStack token places go in with the layout's padding in front
(masked, zero inputs, as for text: the prompt's last token is the sequence's last), are sharded
by the layout, and the language model runs on this rank's shard with the ring, filling the cache.

A decode step runs the inner model too, on the new text tokens alone (no image comes after the
prompt): it gives them the embeddings and positions the unpatched model gives them, and its
language model call runs every layer on every rank, attention over the group's cache shards.
"""
from __future__ import annotations

import torch

from ringseq.batch import check_same_batch, sharded
from ringseq.errors import RingSeqError
from ringseq.layouts import multiple

from . import vision, vision_split
from .cache import cache_name


def _front(t: torch.Tensor, pad: int, dim: int, value=0) -> torch.Tensor:
    """``t`` with ``pad`` entries of ``value`` in front along ``dim``."""
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t.new_full(shape, value), t], dim)


def prefill(model, handle, cache, input_ids, inputs_embeds, attention_mask, position_ids, kwargs) -> tuple:
    """The prompt through the VLM, its language model on the ring into ``cache``. Returns (the
    language model's output on this rank's tokens, the prompt's ``ShardedBatch``)."""
    sp = handle.sp
    vision.check_inputs(handle, kwargs, input_ids=input_ids, inputs_embeds=inputs_embeds,
                        attention_mask=attention_mask, position_ids=position_ids)
    base, _ = vision.multimodal_model(model)
    tokens = input_ids if input_ids is not None else inputs_embeds
    B, S = tokens.shape[:2]
    pad = -S % multiple(sp.layout, sp.ring_size, sp.ulysses_size)
    padding = attention_mask if attention_mask is not None else torch.ones(B, S, dtype=torch.long,
                                                                            device=tokens.device)
    blocks = vision._blocks(base, kwargs)
    seen = {}

    def prefilled(inner, inputs_embeds, position_ids=None, attention_mask=None, use_cache=None, **lm_kwargs):
        lm_kwargs.pop("past_key_values", None)
        lm_kwargs.pop("cache", None)
        if position_ids is None:  # the language model would count them from 0: the same, given here
            position_ids = torch.arange(S, device=inputs_embeds.device)[None].expand(B, S)
        full = {"inputs_embeds": _front(inputs_embeds, pad, 1), "position_ids": _front(position_ids, pad, -1),
                "attention_mask": _front(padding, pad, 1)}
        local, batch = sharded(full, sp=sp, documents_apart=handle.documents_apart,
                               blocks=None if blocks is None else _front(blocks, pad, 1, -1), agreed=True,
                               balance=False)  # the cache's order
        if lm_kwargs.get("visual_pos_masks") is not None:
            lm_kwargs["visual_pos_masks"], lm_kwargs["deepstack_visual_embeds"] = vision._deepstack(
                _front(lm_kwargs["visual_pos_masks"], pad, 1, False), lm_kwargs.get("deepstack_visual_embeds"), batch)
        if handle.recurrent:
            lm_kwargs["attention_mask"] = local["attention_mask"]
        cache.begin_prefill(batch, full["attention_mask"], offset=pad)
        seen["batch"] = batch
        out = inner(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"], use_cache=True,
                    ringseq=batch, **{cache_name(inner): cache}, **lm_kwargs)
        cache.end_prefill(length=S)
        return out

    if handle.vision.split:
        vision_split.encoder_outputs(base, kwargs, sp)
    out = vision.through_base(model, prefilled, input_ids=input_ids, inputs_embeds=inputs_embeds,
                              attention_mask=attention_mask, position_ids=position_ids, kwargs=kwargs, cache=cache)
    return out, seen["batch"]


def decode(model, handle, cache, input_ids, inputs_embeds, attention_mask, position_ids, kwargs) -> dict:
    """A decode step through the VLM, up to its inner model: the checks and the cache's
    bookkeeping (eagerly), and ``decoded``'s arguments."""
    for key in ("pixel_values", "pixel_values_videos"):
        if kwargs.get(key) is not None:
            raise RingSeqError(f"{key} in a decode step: a patched VLM takes its images with the prompt (the "
                               f"sharded cache is filled once); pass them in the first call")
    tokens = input_ids if input_ids is not None else inputs_embeds
    B, n = tokens.shape[:2]
    step = {"input_ids": input_ids} if input_ids is not None else {"inputs_embeds": inputs_embeds}
    if attention_mask is not None:
        step["attention_mask"] = attention_mask
    check_same_batch(step, handle.sp)  # every step: the ranks never go on with different tokens
    if attention_mask is not None and attention_mask.size(1) != cache.seen + n:
        raise RingSeqError(f"attention_mask covers {attention_mask.size(1)} tokens, but the cache holds "
                           f"{cache.seen} and {n} come now")
    valid = attention_mask[:, -n:] if attention_mask is not None else torch.ones(B, n, dtype=torch.long,
                                                                                  device=tokens.device)
    return dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                position_ids=position_ids, kwargs=kwargs, cache=cache, step=cache.begin_step(n, valid))


def decoded(model, *, input_ids, inputs_embeds, attention_mask, position_ids, kwargs, cache, step):
    """A decode step's inner model (compiled under ``torch.compile``): the new text tokens'
    embeddings and positions as the unpatched model makes them, its language model over the
    group's cache (the step reaches its attention layers as the model's keyword arguments do).
    Returns the language model's last hidden states of the new tokens (the same on every rank)."""
    base, _ = vision.multimodal_model(model)
    return base(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                position_ids=position_ids, use_cache=True, ringseq=step, **{cache_name(type(base).forward): cache},
                **kwargs).last_hidden_state
