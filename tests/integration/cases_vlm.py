"""Vision-language models patched against the unpatched model on the whole batch: loss and the
SP-averaged gradients of every parameter (language model, projector, vision tower) by the 2x rule."""
import copy

import torch
import torch.distributed as dist

import ringseq
from ringseq.layouts import multiple
from ringseq.patches.lifecycle import options
from ringseq.testing import shared_init

from .hf_models import check_against, loss_and_grads
from .vlm_models import IMAGE, make_batch, tiny_model


TOWERS = ("visual", "vision_tower", "vision_model")  # Qwen; Gemma 3, LLaVA; Idefics3


def in_dtype(batch: dict, dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def vlm_references(family, batch):
    """(the unpatched fp32 model, its loss and gradients, the float64 model's loss and gradients)."""
    ref_loss, ref_grads = loss_and_grads(tiny_model(family, torch.float64), in_dtype(batch, torch.float64),
                                         manual_loss=True)
    base = tiny_model(family)
    plain_loss, plain_grads = loss_and_grads(base, batch)
    return base, (plain_loss, plain_grads, ref_loss, ref_grads)


def crosses_a_chunk_edge(ids: torch.Tensor, sp) -> bool:
    """Whether some image's placeholder run spans two of the layout's chunks (two ranks, or a
    rank's two zigzag runs)."""
    chunk = ids.size(1) // multiple(sp.layout, sp.ring_size, sp.ulysses_size)
    image = ids == IMAGE
    edges = torch.arange(chunk, ids.size(1), chunk)
    return bool((image[:, edges - 1] & image[:, edges]).any())


def parity(family, S_per_rank=32, padded=False, split=False, short=0, images=2, video=False, ulysses=1):
    """Patched fp32 loss and SP-averaged gradients against the unpatched model (float64 loss from
    its logits). ``split``: each rank encodes a share of the images (counted by a hook on the
    vision tower); ``video`` (Qwen): a video whose temporal patches are shared too; ``ulysses``: a
    Ulysses x ring group."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, ulysses_size=ulysses)
    batch = make_batch(family, 2, S_per_rank * world - short, images_per_row=images, padded=padded, video=video)
    if world > 1 and not short:
        assert crosses_a_chunk_edge(batch["input_ids"], sp), "no image crosses a chunk edge: move the images"
    base, refs = vlm_references(family, batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp, split_vision=split)
    assert options(model)["split_vision"] is split  # what ringseq's Trainers patch the model with again
    encoded = []
    tower = next(getattr(model.model, n) for n in TOWERS if hasattr(model.model, n))
    hook = tower.register_forward_pre_hook(lambda m, args, kwargs: encoded.append(
        (args[0] if args else next(iter(kwargs.values()))).size(0)), with_kwargs=True)
    tokens = []  # every language-model layer runs on this rank's share of the tokens, never on the whole row
    layers = [layer.register_forward_hook(lambda m, args, out: tokens.append((out[0] if isinstance(out, tuple)
                                                                              else out).size(-2)))
              for layer in model.get_decoder().layers]
    loss, grads = loss_and_grads(model, batch)
    for h in (hook, *layers):
        h.remove()
    share = -(-batch["input_ids"].size(1) // multiple(sp.layout, sp.ring_size, sp.ulysses_size)) * \
        multiple(sp.layout, sp.ring_size, sp.ulysses_size) // world
    assert tokens and set(tokens) == {share}, (tokens, share)
    pixels = batch["pixel_values"]
    total = pixels.size(0) * pixels.size(1) if pixels.dim() == 5 else pixels.size(0)  # images (or Qwen's patches)
    total += batch["pixel_values_videos"].size(0) if video else 0
    counts = torch.tensor([sum(encoded)])
    dist.all_reduce(counts, group=sp.group)
    if split and world > 1:  # a share each, all of them once
        assert 0 < sum(encoded) < total and int(counts) == total, (encoded, int(counts), total)
    else:
        assert sum(encoded) == total, (encoded, total)
    assert any(n.startswith(tuple(f"model.{t}" for t in TOWERS)) for n in grads), sorted(grads)[:5]
    check_against(refs, loss, grads, sp, f"{family} padded={padded} split={split} short={short} "
                                         f"ulysses={ulysses} rank {sp.rank}/{world}")
    ringseq.unpatch(model)
    assert model.config.get_text_config()._attn_implementation == base.config.get_text_config()._attn_implementation


def refusals():
    """What a patched VLM refuses in training, every rank the same way (generation's refusals:
    ``cases_vlm_generation``): a batch from ringseq.shard_batch, different images on different ranks, split_vision on pixels it cannot
    share out or on a text model."""
    import pytest

    from .hf_models import tiny_model as text_model

    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    model = ringseq.patch(tiny_model("qwen2_5_vl"), sp=sp)
    batch = make_batch("qwen2_5_vl", 1, 32 * world)
    with pytest.raises(ringseq.RingSeqError, match="takes the full batch"):
        model(**batch, ringseq=ringseq.shard_batch({"input_ids": batch["input_ids"]}, sp=sp)["ringseq"])
    if world > 1:  # one rank's pixels differ: refused before any rank encodes them
        other = dict(batch, pixel_values=batch["pixel_values"] + sp.rank)
        with pytest.raises(ringseq.RingSeqError, match="same full batch"):
            model(**other)
    with pytest.raises(ringseq.RingSeqError, match="no vision tower"):
        ringseq.patch(text_model("llama"), sp=sp, split_vision=True)
    shuffled = ringseq.patch(tiny_model("smolvlm"), sp=sp, split_vision=True)  # pixels [rows, images, 3, H, W]
    with pytest.raises(ringseq.RingSeqError, match="split_vision shares images given as"):
        shuffled(**make_batch("smolvlm", 2, 32 * world))
    assert model(**batch).loss is not None  # still in step after every refusal
