"""generate on a patched vision-language model against the unpatched model's generate on the whole
multimodal prompt (images on different ranks and across the layout's chunk edges)."""
import math

import pytest
import torch
import torch.distributed as dist

import ringseq
from ringseq.layouts import multiple
from ringseq.testing import assert_close, shared_init

from .cases_generation import SETTINGS, _held
from .cases_vlm import TOWERS, crosses_a_chunk_edge, in_dtype
from .vlm_models import make_batch, tiny_model


def vlm_prompt(family, S, video=False, left_pad=True):
    """A multimodal prompt of two rows of S tokens (two images each; ``video``: row 0 holds a
    video too); with ``left_pad`` row 1 starts with two pads (its images come later)."""
    batch = make_batch(family, 2, S, video=video)
    batch.pop("labels")
    if left_pad:
        mask = torch.ones(2, S, dtype=torch.long)
        mask[1, :2] = 0
        batch["input_ids"][1, :2] = 0
        batch["attention_mask"] = mask
    return batch


def _generating(model):
    model.config.use_cache = model.generation_config.use_cache = True  # tiny_model is configured for training
    # the router loss is for training; unpatched Qwen3-VL-MoE computes it in every step of a padded prompt's
    # generation and fails on the mask (transformers 5.23)
    model.config.get_text_config().output_router_logits = False
    return model.eval()


def _tower(model):
    inner = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    return next(getattr(inner, n) for n in TOWERS if hasattr(inner, n))


def greedy(family, S_per_rank=32, new=6, split=False, video=False, ulysses=1, layout="zigzag"):
    """Greedy decoding: the patched float64 model returns the unpatched one's tokens on every
    rank; the fp32 scores of every step are within the 2x rule of the unpatched fp32 model's
    against float64; each rank holds its share of the cache; ``split``: each rank encodes a share
    of the images (counted by a hook on the vision tower)."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, ulysses_size=ulysses, layout=layout)
    S = S_per_rank * world - (1 if world > 1 else 0)  # a length the layout pads
    batch = vlm_prompt(family, S, video=video)
    where = f"{family} S={S} rank {sp.rank}/{world}" + (" split" if split else "")
    if world > 1 and layout == "zigzag":
        assert crosses_a_chunk_edge(torch.nn.functional.pad(batch["input_ids"], (1, 0)), sp), where
    runs, encoded = {}, []
    for dtype in (torch.float64, torch.float32):
        model = _generating(tiny_model(family, dtype))
        inputs = in_dtype(batch, dtype)
        plain = model.generate(**inputs, max_new_tokens=new, **SETTINGS)
        ringseq.patch(model, sp=sp, split_vision=split)
        hook = _tower(model).register_forward_pre_hook(lambda m, args, kwargs: encoded.append(
            (args[0] if args else next(iter(kwargs.values()))).size(0)), with_kwargs=True)
        got = model.generate(**inputs, max_new_tokens=new, **SETTINGS)
        hook.remove()
        runs[dtype] = plain, got
        ringseq.unpatch(model)
    plain64, got64 = runs[torch.float64]
    assert torch.equal(got64.sequences, plain64.sequences), \
        f"{where}: {got64.sequences[:, S:].tolist()} != {plain64.sequences[:, S:].tolist()}"
    plain32, got32 = runs[torch.float32]
    assert torch.equal(plain32.sequences, plain64.sequences), f"{where}: the fp32 model decodes other tokens"
    for step, (g, p, r) in enumerate(zip(got32.scores, plain32.scores, plain64.scores)):
        assert_close(g, p, r, f"{where} scores of step {step}")
    whole = batch["pixel_values"].size(0) if batch["pixel_values"].dim() == 2 else None
    if split and world > 1 and whole is not None:  # Qwen's patches: this rank encoded a share of them
        assert max(encoded) < whole, (where, encoded, whole)
    held, _ = _held(got64.past_key_values)
    if held:  # the cache: each rank its share, all of it once over the group
        pad = -S % multiple(sp.layout, world // ulysses, ulysses)
        total = torch.tensor(held[0])
        dist.all_reduce(total, group=sp.group)
        assert int(total) == S + pad + new - 1, where
        assert max(held) <= (S + pad) // world + math.ceil((new - 1) / world), where


def sampling(family, S_per_rank=32, new=8):
    """Sampling from a multimodal prompt: every rank draws the same tokens, those the unpatched
    model draws with group rank 0's seed."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = vlm_prompt(family, S_per_rank * world)
    model = _generating(tiny_model(family, torch.float64))
    batch = in_dtype(batch, torch.float64)
    kw = dict(max_new_tokens=new, do_sample=True, top_k=20, temperature=0.9, **SETTINGS)
    torch.manual_seed(100)
    plain = model.generate(**batch, **kw).sequences
    ringseq.patch(model, sp=sp)
    torch.manual_seed(100 + sp.rank)
    got = model.generate(**batch, **kw).sequences
    every = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(every, got, group=sp.group)
    assert all(torch.equal(e, got) for e in every), f"rank {sp.rank}: the ranks sampled different tokens"
    assert torch.equal(got, plain), f"rank {sp.rank}: {got[:, -new:].tolist()} != {plain[:, -new:].tolist()}"
    ringseq.unpatch(model)


def refusals():
    """What a patched VLM's generation refuses, every rank the same way: different images on
    different ranks before any rank encodes them, images in a decode step, labels with a cache;
    the group stays in step after each."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    model = ringseq.patch(_generating(tiny_model("qwen2_5_vl")), sp=sp)
    batch = vlm_prompt("qwen2_5_vl", 32 * world, left_pad=False)
    if world > 1:
        other = dict(batch, pixel_values=batch["pixel_values"] + sp.rank)
        with pytest.raises(ringseq.RingSeqError, match="same full batch"):
            model.generate(**other, max_new_tokens=2, **SETTINGS)
    with pytest.raises(ringseq.RingSeqError, match="labels with a KV cache"):
        model(**batch, labels=batch["input_ids"], use_cache=True)
    cache = model(**batch, use_cache=True).past_key_values  # a prefill by hand, then a step that brings images
    with pytest.raises(ringseq.RingSeqError, match="takes its images with the prompt"):
        model(input_ids=batch["input_ids"][:, -1:], pixel_values=batch["pixel_values"],
              image_grid_thw=batch["image_grid_thw"], past_key_values=cache)
    out = model.generate(**batch, max_new_tokens=2, **SETTINGS)  # still in step after every refusal
    assert out.sequences.shape == (2, 32 * world + 2)
