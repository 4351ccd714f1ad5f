"""generate on a patched model against the unpatched model's generate on the whole prompt."""
import copy
import math

import pytest
import torch
import torch.distributed as dist

import ringseq
from ringseq.testing import assert_close, shared_init

from .hf_models import EAGER, VOCAB, check_against, loss_and_grads, make_batch, references, tiny_model

SETTINGS = dict(pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, output_scores=True)


def prompt(B, S, left_pad=True, seed=1):
    """[B, S] random token ids; with ``left_pad`` row 1 starts with S // 5 pads (mask 0)."""
    ids = torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, S, dtype=torch.long)
    if left_pad and B > 1:
        mask[1, : S // 5] = 0
        ids[1, : S // 5] = 0
    return ids, mask


def _generating(model):
    model.config.use_cache = model.generation_config.use_cache = True  # tiny_model is configured for training
    return model.eval()


def _held(cache):
    """Keys this rank holds in each attention layer without a window (tokens, and bytes)."""
    from ringseq.patches.cache import KVShard

    full = [layer for layer in cache.layers if isinstance(layer, KVShard) and layer.window is None]
    return [layer.keys.size(-2) for layer in full], sum(
        (layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in full)


def greedy(family, layout, S, new=8, ulysses=1):
    """Greedy decoding: the patched float64 model returns the unpatched one's tokens, token for
    token, on every rank; the fp32 scores of every step are within the 2x rule of the unpatched
    fp32 model's against float64; each rank holds its share of the cache."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, layout=layout, ulysses_size=ulysses)
    # transformers' eager path turns a left pad's query (it sees no key) into nan in float64, and the nan then
    # reaches the real tokens: eager families get prompts without padding
    ids, mask = prompt(2, S, left_pad=family not in EAGER)
    where = f"{family} {layout} S={S} rank {sp.rank}/{world}"
    runs = {}
    for dtype in (torch.float64, torch.float32):
        model = _generating(tiny_model(family, dtype))
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **SETTINGS)
        ringseq.patch(model, sp=sp)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **SETTINGS)
        runs[dtype] = plain, got
        ringseq.unpatch(model)
    plain64, got64 = runs[torch.float64]
    assert torch.equal(got64.sequences, plain64.sequences), f"{where}: {got64.sequences[:, S:]} != " \
                                                            f"{plain64.sequences[:, S:]}"
    plain32, got32 = runs[torch.float32]
    assert torch.equal(plain32.sequences, plain64.sequences), f"{where}: the fp32 model decodes other tokens"
    for step, (g, p, r) in enumerate(zip(got32.scores, plain32.scores, plain64.scores)):
        assert_close(g, p, r, f"{where} scores of step {step}")
    # the cache: each rank its share, all of it once over the group
    held, kv_bytes = _held(got64.past_key_values)
    if not held:  # every attention layer has a window: each keeps at most the window's keys
        assert all(layer.keys.size(-2) <= layer.window for layer in got64.past_key_values.layers), where
        return
    pad = -S % ringseq.layouts.multiple(layout, world // ulysses, ulysses)
    total = torch.tensor(held[0])
    dist.all_reduce(total, group=sp.group)
    assert int(total) == S + pad + new - 1, where  # the last token never goes through the model
    assert max(held) <= (S + pad) // world + math.ceil((new - 1) / world), where
    assert len(set(held)) == 1, where
    unpatched_tokens = S + new - 1
    unpatched_bytes = _held_plain(plain64.past_key_values)
    assert kv_bytes * unpatched_tokens == unpatched_bytes * held[0], where
    cache = got32.past_key_values
    if all(getattr(layer, "window", None) is None for layer in cache.layers):  # the planner's cache, measured
        from ringseq.planner import model_spec
        from ringseq.planner.memory import kv_cache

        assert _all_bytes(cache) == kv_cache(model_spec(tiny_model(family).config), 4, held[0], B=2), where


def _all_bytes(cache):
    """Every tensor a cache holds: keys and values, recurrent and convolution states."""
    total = 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None),
                   *getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]
        total += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
    return total


def _held_plain(cache) -> int:
    """Bytes of the unpatched cache's attention layers without a window."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    full = [layer for layer in cache.layers
            if isinstance(layer, DynamicLayer) and not isinstance(layer, DynamicSlidingWindowLayer)]
    return sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in full)


def sampling(family, S, new=10):
    """Sampling (two samples per prompt): every rank returns the same tokens although each seeded
    its own generator differently: those the unpatched model draws with group rank 0's seed;
    afterwards group rank 0's random state is where the unpatched model leaves it (a next draw
    matches), every other rank's is its own again."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    ids, mask = prompt(2, S)
    model = _generating(tiny_model(family, torch.float64))
    # two samples per prompt: generate expands the rows before the prefill
    kw = dict(max_new_tokens=new, do_sample=True, top_k=20, temperature=0.9, num_return_sequences=2, **SETTINGS)
    torch.manual_seed(100)
    plain = model.generate(input_ids=ids, attention_mask=mask, **kw).sequences
    plain_after = torch.rand(3)
    ringseq.patch(model, sp=sp)
    torch.manual_seed(100 + sp.rank)
    got = model.generate(input_ids=ids, attention_mask=mask, **kw).sequences
    after = torch.rand(3)
    if sp.rank == 0:
        assert torch.equal(after, plain_after), "rank 0: generate left another random state than the unpatched model"
    else:
        torch.manual_seed(100 + sp.rank)
        assert torch.equal(after, torch.rand(3)), f"rank {sp.rank}: generate left this rank's random state changed"
    every = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(every, got, group=sp.group)
    assert all(torch.equal(e, got) for e in every), f"rank {sp.rank}: the ranks sampled different tokens"
    assert torch.equal(got, plain), f"rank {sp.rank}: {got[:, S:]} != {plain[:, S:]}"
    ringseq.unpatch(model)


def train_after_generate(family, S_per_rank=16):
    """generate inside training leaves the patched model as it was: the next step's loss and
    gradients are the unpatched model's (2x rule)."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, S_per_rank * world, "padded", left_pad=family not in EAGER)
    base, refs = references(family, batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    ids, mask = prompt(2, 3 * S_per_rank * world // 2)
    model.eval()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **SETTINGS)
    model.train()
    loss, grads = loss_and_grads(model, batch)
    check_against(refs, loss, grads, sp, f"{family} after generate rank {sp.rank}/{world}")
    ringseq.unpatch(model)


REFUSED = {  # generate keyword -> what the refusal names
    "num_beams": dict(num_beams=2),
    "cache_implementation": dict(cache_implementation="static"),
    "output_hidden_states": dict(output_hidden_states=True),
    "output_attentions": dict(output_attentions=True),
    "prompt_lookup_num_tokens": dict(prompt_lookup_num_tokens=3),
    "past_key_values": "cache",
}


def refusals():
    """What ringseq cannot generate exactly is refused on every rank, with the fix; ranks given
    different prompts are refused too; after each refusal the model still generates."""
    from transformers import DynamicCache

    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    model = _generating(tiny_model("llama", torch.float64))
    ids, mask = prompt(1, 40, left_pad=False)
    ringseq.patch(model, sp=sp)
    for name, kw in REFUSED.items():
        if kw == "cache":
            kw = dict(past_key_values=DynamicCache())
        with pytest.raises(ringseq.RingSeqError, match=name):
            model.generate(input_ids=ids, max_new_tokens=2, **SETTINGS, **kw)
    with pytest.raises(ringseq.RingSeqError, match="same full batch"):
        model.generate(input_ids=ids + (sp.rank == 1), max_new_tokens=2, **SETTINGS)
    with pytest.raises(ringseq.RingSeqError, match="past_key_values"):
        model(input_ids=ids, past_key_values=DynamicCache())
    out = model.generate(input_ids=ids, max_new_tokens=2, **SETTINGS).sequences
    ringseq.unpatch(model)
    assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=2, **SETTINGS).sequences)
    assert "generate" not in vars(model), "unpatch left the instance's generate behind"


def peft_generate(order):
    """LoRA adapters: generate on a PEFT model patched (its inner model borrows the patched forward
    for the call) or on a PEFT wrapper of a patched model returns the unpatched PEFT model's tokens."""
    from .cases_parity import _with_lora

    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    ids, mask = prompt(2, 97)
    plain = _with_lora(_generating(tiny_model("llama", torch.float64)))
    want = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **SETTINGS).sequences
    if order == "patch_then_peft":
        model = _with_lora(ringseq.patch(_generating(tiny_model("llama", torch.float64)), sp=sp))
    else:
        model = ringseq.patch(_with_lora(_generating(tiny_model("llama", torch.float64))), sp=sp)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **SETTINGS).sequences
    assert torch.equal(got, want), f"PEFT {order} rank {sp.rank}/{world}: {got[:, 97:]} != {want[:, 97:]}"
    inner = model.get_base_model()
    if order == "peft_then_patch":
        assert "forward" not in vars(inner) and "_ringseq_patch" not in vars(inner), "the borrowed forward stayed"
