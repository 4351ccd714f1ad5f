"""Vision-language models: the vision tower on the whole batch, the language model on the ring.

A transformers VLM (``*ForConditionalGeneration``: Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3,
LLaVA, ...) embeds the text, encodes the images, writes their features over the placeholder
tokens, computes the rotary positions of the whole sequence (Qwen's 3-D mRoPE) and then calls
its language model on ``inputs_embeds``. Splitting the tokens before that point breaks the
image merge and the 3-D positions, so ringseq splits after it: the patched forward runs the
model's own multimodal code on the full batch on every rank, and the language model's call is
intercepted (``language_model.forward`` is replaced for the duration of the call) where the
merged embeddings, positions, padding and labels are sharded by the layout and the language
model runs on this rank's shard with the ring. Every rank holds the same merged embeddings, so
each rank's gradient reaches the vision tower and projector only through its own tokens: the
ranks' shares add up to the unpatched model's gradients (``ringseq.gradients``).

The vision tower's attention is never ringseq's: only the text sub-config's implementation is
changed (``set_attn_implementation({text key: "ringseq"})``). ``split_vision`` (``vision_split``)
shares the images among the ranks instead of every rank encoding all of them.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ringseq import versions
from ringseq.batch import check_same_batch, sharded
from ringseq.errors import RingSeqError

from . import vision_split
from .cache import cache_name

def transformers_model(model):
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def text_key(model) -> str | None:
    """The sub-config key of a VLM's language model ("text_config"), or None for a text model."""
    config = model.config
    text = config.get_text_config()
    if text is config or getattr(config, "vision_config", None) is None:
        return None
    for key in getattr(config, "sub_configs", {}):
        if getattr(config, key, None) is text:
            return key
    return None


@dataclasses.dataclass(frozen=True)
class VisionPlan:
    text_key: str
    """The sub-config of the language model ("text_config"): the only one whose attention is ringseq's."""
    split: bool = False
    """Whether each rank encodes a share of the images (``vision_split``) instead of all of them."""


def plan(model, split: bool) -> VisionPlan | None:
    """The plan for a VLM (None for a text model; ``split`` on a text model is an error)."""
    key = text_key(transformers_model(model))
    if key is None:
        if split:
            raise RingSeqError(f"split_vision=True shares a vision tower's images among the ranks, but "
                               f"{type(model).__name__} has no vision tower")
        return None
    versions.require_feature("vision", "patching a vision-language model")
    return VisionPlan(text_key=key, split=bool(split))


def text_config(model):
    return transformers_model(model).config.get_text_config()


def set_attention(model, implementation: str) -> None:
    """Set the language model's attention implementation (a VLM's vision tower keeps its own)."""
    key = text_key(transformers_model(model))
    model.set_attn_implementation(implementation if key is None else {key: implementation})


# What a VLM's inner model calls its language model (Qwen VL, Gemma 3, LLaVA; Idefics3, SmolVLM)
LANGUAGE_MODEL = ("language_model", "text_model")


def _holder(model):
    """(the module that holds the decoder as its language model, that attribute's name) or None."""
    decoder = model.get_decoder()
    for module in model.modules():
        for name in LANGUAGE_MODEL:
            if module is not decoder and getattr(module, name, None) is decoder:
                return module, name
    return None


def multimodal_model(model):
    """(the VLM's inner model: the module that holds the language model and the vision tower,
    its language model)."""
    found = _holder(model)
    if found is None:
        raise RingSeqError(f"{type(model).__name__} has a vision config but no module whose language model is its "
                           f"decoder: ringseq shards VLMs that call their language model on the merged embeddings "
                           f"(Qwen VL, Gemma 3, LLaVA); patch the text model alone instead")
    base, name = found
    return base, getattr(base, name)


def is_sharded_vlm(model) -> bool:
    """Whether ``model`` is a VLM ringseq can shard: its language model is a sub-config's, and an
    inner module holds it as its language model."""
    model = transformers_model(model)
    return text_key(model) is not None and _holder(model) is not None


def check_same_inputs(inputs: dict, sp) -> None:
    """Every rank must hold the same images and metadata before any rank encodes them (one
    all-gather of a fixed-size record per ten tensors)."""
    keys = sorted(k for k, v in inputs.items() if torch.is_tensor(v))
    for first in range(0, len(keys), 10):  # a lockstep record holds 48 fields: 4 per tensor
        check_same_batch(inputs, sp, keys=keys[first:first + 10])


def _deepstack(full_mask, embeds, batch):
    """Qwen3-VL's visual token places and per-layer features for this rank's tokens: the mask is
    sharded like the tokens (``batch``: their ``ShardedBatch``), the features are the rows of the
    image tokens this rank holds, in its local order (the order in which the language model reads them)."""
    mask = torch.nn.functional.pad(full_mask.bool(), (0, batch.pad), value=False)
    local_mask = batch.shard(mask, 1)
    if not embeds:
        return local_mask, embeds
    order = (mask.flatten().cumsum(0) - 1).reshape(mask.shape)  # row of each image token in the features
    rows = batch.shard(order, 1)[local_mask].to(embeds[0].device)
    return local_mask, [e.index_select(0, rows) for e in embeds]


def _blocks(base, kwargs: dict):
    """Gemma 3's bidirectional image blocks ([B, S] ids, -1: text) from ``token_type_ids``, by the
    family's own function; the token types are then kept from the model, whose mask functions for
    them the ring cannot take (it applies the blocks itself). None when the family has none."""
    import sys

    types = kwargs.get("token_type_ids")
    blocks_of = getattr(sys.modules[type(base).__module__], "get_block_sequence_ids_for_mask", None)
    if types is None or blocks_of is None:
        return None
    kwargs.pop("token_type_ids")
    return blocks_of(types)


@contextlib.contextmanager
def _intercepted(lm, run):
    """``lm.forward`` replaced by ``run`` for the duration (an instance attribute, put back after)."""
    before = vars(lm).get("forward")
    lm.forward = run
    try:
        yield
    finally:
        if before is None:
            del lm.forward
        else:
            lm.forward = before


def through_base(model, language_model, *, input_ids, inputs_embeds, attention_mask, position_ids, kwargs,
                 cache=None):
    """Run the VLM's inner model on the full inputs with its language model's one call replaced by
    ``language_model(inner, inputs_embeds, **the call's other arguments)`` (``inner``: the language
    model's own forward); ``cache``: a KV cache for the inner model (generation). Returns what
    ``language_model`` returned."""
    base, lm = multimodal_model(model)
    inner = type(lm).forward.__get__(lm)  # the language model's own forward, whatever wraps the instance
    seen = {}

    def intercepted(input_ids=None, inputs_embeds=None, **lm_kwargs):
        if seen:
            raise RingSeqError(f"{type(base).__name__} called its language model twice in one forward; ringseq "
                               f"shards a VLM whose forward calls it once: ringseq.unpatch(model) to run it on one "
                               f"rank, or patch its text model alone")
        seen["out"] = language_model(inner, lm.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds,
                                     **lm_kwargs)
        return seen["out"]

    if cache is not None:
        kwargs = {**kwargs, cache_name(type(base).forward): cache}
    with _intercepted(lm, intercepted):
        base(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
             use_cache=cache is not None, **kwargs)
    if not seen:
        raise RingSeqError(f"{type(base).__name__} never called its language model, so ringseq had nothing to shard: "
                           f"ringseq.unpatch(model) to run it on one rank, or patch its text model alone")
    return seen["out"]


def check_inputs(handle, kwargs: dict, **inputs) -> None:
    """Every rank holds the same inputs (the inputs are agreed on, not the merged embeddings: a
    vision tower need not be bitwise alike on every rank)."""
    check_same_inputs({**inputs, **{k: v for k, v in kwargs.items() if torch.is_tensor(v)}}, handle.sp)


def run(model, handle, *, input_ids, inputs_embeds, attention_mask, position_ids, labels, shift_labels, kwargs,
        balance: bool = False):
    """The VLM's own forward on the full batch, its language model on this rank's shard
    (``balance``: packed documents laid out by work, ``ringseq.balance``). Returns (the language
    model's output on this rank's tokens, the ``ShardedBatch``). Under ``torch.compile(model)`` the
    model's own code (the vision tower, the merge, the language model) is traced; the checks, the
    agreements and the sharding run eagerly (``_checked``, ``_shard``)."""
    base, _ = multimodal_model(model)
    blocks = _checked(handle, base, kwargs, input_ids=input_ids, inputs_embeds=inputs_embeds,
                      attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                      shift_labels=shift_labels)
    full = {"position_ids": None, "labels": labels, "shift_labels": shift_labels,
            "attention_mask": attention_mask}  # the 2-D padding mask (the model may hand its language model its own)
    seen = {}

    def sharded_language_model(inner, inputs_embeds, position_ids=None, attention_mask=None, past_key_values=None,
                               use_cache=None, **lm_kwargs):
        local, batch, lm_kwargs = _shard(handle, {**full, "inputs_embeds": inputs_embeds, "position_ids": position_ids},
                                         blocks, balance, lm_kwargs)
        seen["ringseq"] = batch
        return inner(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"], use_cache=False,
                     ringseq=batch, **lm_kwargs)

    out = through_base(model, sharded_language_model, input_ids=input_ids, inputs_embeds=inputs_embeds,
                       attention_mask=attention_mask, position_ids=position_ids, kwargs=kwargs)
    return out, seen["ringseq"]


@torch.compiler.disable
def _checked(handle, base, kwargs: dict, **inputs):
    """The inputs agreed on every rank, Gemma 3's image blocks, the vision work shared out: the eager
    part before the model's own forward. Returns the blocks."""
    check_inputs(handle, kwargs, **inputs)
    blocks = _blocks(base, kwargs)
    if handle.vision.split:
        vision_split.encoder_outputs(base, kwargs, handle.sp)
    return blocks


@torch.compiler.disable
def _shard(handle, full: dict, blocks, balance: bool, lm_kwargs: dict):
    """The language model's inputs on this rank's shard (agreed): (its tensors, the ``ShardedBatch``,
    its other arguments, Qwen3-VL's visual features and a recurrent model's padding sharded)."""
    local, batch = sharded({k: v for k, v in full.items() if v is not None}, sp=handle.sp,
                           documents_apart=handle.documents_apart, blocks=blocks, agreed=True, balance=balance)
    batch = batch.with_head_groups(handle.head_groups)
    lm_kwargs = dict(lm_kwargs)
    if lm_kwargs.get("visual_pos_masks") is not None:
        lm_kwargs["visual_pos_masks"], lm_kwargs["deepstack_visual_embeds"] = _deepstack(
            lm_kwargs["visual_pos_masks"], lm_kwargs.get("deepstack_visual_embeds"), batch)
    if handle.recurrent and local.get("attention_mask") is not None:
        lm_kwargs["attention_mask"] = local["attention_mask"]  # recurrent layers zero padding with this shard
    return local, batch, lm_kwargs
