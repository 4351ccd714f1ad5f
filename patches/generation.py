"""``generate`` on a patched model: the prompt prefilled through the ring, the KV cache kept
sharded, every new token's attention merged over the group (shapes: ``ringseq.shapes``).

What is patched, and why: ``patch`` sets the instance's ``generate`` to ``generate`` below (an
instance attribute, removed by ``unpatch``). It refuses what it cannot do exactly, hands
transformers' own ``generate`` a ``ShardedCache`` (``patches.cache``), and makes sampling draw
the same tokens on every rank (rank 0's random state, shared for the call and left advanced as
the unpatched model leaves it; a rank that came with another state gets its own back).
transformers then calls the patched forward with that cache, which lands in ``cached_forward``:

- the prefill (the cache is empty): every rank has the whole prompt. It goes in with the
  layout's padding in front (masked, zero inputs), so the prompt's last token is the sequence's
  last: causal attention never lets a real token see the padding, and a recurrent layer's state
  stays zero through it. The batch is sharded like a training batch, each attention layer keeps
  its shard's keys and values, and only the last token's logits are computed (its hidden state
  comes from the rank that holds it).
- a decode step: the new tokens are the same on every rank (checked, every step); every layer
  runs on every rank, attention over the group's cache shards (``ringseq.attention.decode``), so
  every rank computes the same logits bit for bit and picks the same token. Its decoder runs in
  the patched forward's traced frame, so that it compiles under ``model.compile()`` (the cache's
  keeping and the attention then two ops: ``patches.compiled_decode``); the prefill stays eager.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import types

import torch
import torch.distributed as dist
from transformers.modeling_outputs import CausalLMOutputWithPast

from ringseq import lockstep, versions
from ringseq.batch import check_same_batch, sharded
from ringseq.errors import RingSeqError
from ringseq.layouts import multiple

from . import logits as logit_maps, mixers, vision_generation
from .cache import ShardedCache, cache_name

# generation settings ringseq cannot run exactly over a sharded cache, and what to do instead
REFUSED = {
    "num_beams": (lambda v: v not in (None, 1), "beam search reorders the cache across beams: use num_beams=1 "
                                                "(greedy or sampling)"),
    "num_beam_groups": (lambda v: v not in (None, 1), "group beam search is beam search: use num_beams=1"),
    "assistant_model": (lambda v: v is not None, "assisted decoding rolls the cache back: drop assistant_model"),
    "prompt_lookup_num_tokens": (lambda v: v is not None, "prompt-lookup decoding rolls the cache back: drop "
                                                          "prompt_lookup_num_tokens"),
    "assistant_early_exit": (lambda v: v is not None, "self-speculative decoding rolls the cache back"),
    "penalty_alpha": (lambda v: v not in (None, 0), "contrastive search selects cache rows: use greedy or sampling"),
    "cache_implementation": (lambda v: v not in (None, "dynamic"), "ringseq keeps its own sharded dynamic cache: "
                                                                   "leave cache_implementation unset"),
    "output_attentions": (lambda v: bool(v), "ringseq never materialises attention weights"),
    "output_hidden_states": (lambda v: bool(v), "the prompt's hidden states are sharded over the group: leave "
                                                "output_hidden_states unset"),
    "output_logits": (lambda v: bool(v), "only the last token's logits are computed in the prefill: use "
                                         "output_scores"),
}


def _settings(model, kwargs: dict):
    """The generation config this call runs with (the model's or the given one, kwargs applied)."""
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    for key, value in kwargs.items():
        if hasattr(config, key):
            setattr(config, key, value)
    return config


def check(model, kwargs: dict) -> None:
    """Refuse a generate call ringseq cannot run exactly over a sharded cache."""
    config = _settings(model, kwargs)
    for key, (bad, fix) in REFUSED.items():
        value = kwargs[key] if key in kwargs else getattr(config, key, None)
        if bad(value):
            raise RingSeqError(f"generate with {key}={value!r} under ringseq: {fix} (or ringseq.unpatch(model) to "
                               f"generate on one rank)")
    for key in ("past_key_values", "cache"):  # transformers >= 5.24 names it ``cache``
        if kwargs.get(key) is not None:
            raise RingSeqError(f"generate with {key} under ringseq: the sharded cache is filled by the prompt; "
                               f"pass the whole sequence as the prompt")
    if kwargs.get("input_features") is not None:
        raise RingSeqError("generate with input_features under ringseq: audio inputs are not sharded; "
                           "ringseq.unpatch(model) to generate on one rank")


def _rng_states(device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_rng_states(states, device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def _share_rng(sp, device) -> bool:
    """Every rank of the group takes group rank 0's random state (so samples agree). Returns
    whether this rank's own state was that one already."""
    states = _rng_states(device)
    if sp.size == 1:
        return True
    shared = []
    for state in states:
        lockstep.agree(sp, "decode", {"random state bytes": state.numel()})
        t = state.clone()
        work = dist.broadcast(t, src=sp.ranks[0], group=sp.check_group or sp.group, async_op=True)
        lockstep.wait(work, sp, "group rank 0's random state", peer=sp.ranks[0], gloo=True)
        shared.append(t)
    _set_rng_states(shared, device)
    return all(torch.equal(a, b) for a, b in zip(states, shared))


def generate(self, *args, **kwargs):
    """``model.generate`` across the sequence group: call it on every rank with the same
    prompt; every rank returns the same tokens. Greedy decoding and sampling (every rank draws
    with group rank 0's random state and leaves it where the unpatched model would; a rank whose
    own state differed gets it back, untouched, afterwards), left-padded batches, stopping
    criteria, ``return_dict_in_generate`` and ``output_scores``. Beam search, assisted decoding,
    other caches and continuing from a given cache are refused. A PEFT model (LoRA and other
    adapters inside the layers) generates through its inner model, which borrows the patched
    forward for the call."""
    handle = self._ringseq_patch
    versions.require_feature("generation", "generate on a patched model")
    check(self, kwargs)
    target = self
    if hasattr(self, "get_base_model"):
        if getattr(getattr(self, "active_peft_config", None), "is_prompt_learning", False):
            raise RingSeqError("generate on a PEFT prompt-learning model (prefix / prompt tuning) under ringseq: its "
                               "virtual tokens are not sharded; ringseq.unpatch(model) to generate on one rank")
        target = self.get_base_model()
    device = next(self.parameters()).device
    own = _rng_states(device)
    with _borrowed(self, target, handle), _signed(target, handle.vision is not None):
        agreed = _share_rng(handle.sp, device)
        cache = ShardedCache(target.config, handle.sp)
        try:
            # always with the cache (a model configured with use_cache=False for training still generates the same
            # tokens; without a cache every step would prefill the whole sequence again)
            if kwargs.get("generation_config") is not None:  # set there: transformers warns about both at once
                kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
                kwargs["generation_config"].use_cache = True
            else:
                kwargs["use_cache"] = True
            kwargs[cache_name(type(target).generate)] = cache
            return type(target).generate(target, *args, **kwargs)
        finally:
            if not agreed:  # this rank drew with rank 0's state: its own comes back, untouched
                _set_rng_states(own, device)


@contextlib.contextmanager
def _borrowed(patched, target, handle):
    """``target`` (a PEFT model's inner transformers model) runs ``patched``'s forward for the call."""
    if target is patched or vars(target).get("_ringseq_patch") is not None:
        yield
        return
    before = vars(target).get("forward")
    target._ringseq_patch = handle
    target.forward = types.MethodType(vars(patched)["forward"].__func__, target)
    try:
        yield
    finally:
        del target._ringseq_patch
        if before is None:
            del target.forward
        else:
            target.forward = before


@contextlib.contextmanager
def _signed(target, vlm: bool):
    """For the call, a VLM's patched forward declares the unpatched forward's parameters too
    (``pixel_values``, ``image_grid_thw``, ...): transformers checks ``generate``'s inputs by the
    forward's signature. All but ``mm_encoder_outputs``: declared, it has ``generate`` encode every
    image on every rank before the prefill, where the ranks' pixels are checked alike and
    ``split_vision`` shares them out."""
    if not vlm:
        yield
        return
    patched = vars(target)["forward"]  # bound, or the caller's torch.compile of it (which wraps it)

    @versions.bindable
    @functools.partial(torch.compiler.disable, recursive=False)  # as the patched forward: its decoder compiles
    def forward(self, *args, **kwargs):
        return patched(*args, **kwargs)

    own = inspect.signature(patched)  # without ``self``
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    extra = [p.replace(kind=p.KEYWORD_ONLY) for name, p in inspect.signature(type(target).forward).parameters.items()
             if name not in own.parameters and name not in ("self", "mm_encoder_outputs")
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    rest = [p for p in own.parameters.values() if p.kind is p.VAR_KEYWORD]
    forward.__signature__ = own.replace(parameters=params + extra + rest)
    target.forward = types.MethodType(forward, target)
    try:
        yield
    finally:
        target.forward = patched


def _full_prompt(input_ids, inputs_embeds, attention_mask, position_ids, pad: int) -> dict:
    """The prompt with ``pad`` masked tokens in front (the layout's padding)."""
    tokens = input_ids if input_ids is not None else inputs_embeds
    B, S = tokens.shape[:2]
    mask = attention_mask if attention_mask is not None else torch.ones(B, S, dtype=torch.long, device=tokens.device)
    if position_ids is None:
        position_ids = torch.arange(S, device=tokens.device)
    if position_ids.dim() > 2 or position_ids.numel() not in (S, B * S):
        raise RingSeqError(f"position_ids of shape {tuple(position_ids.shape)}: ringseq generates with [batch, "
                           f"sequence] position ids only")
    position_ids = position_ids.reshape(-1, S).expand(B, S)

    def front(t, value=0):
        return torch.cat([t.new_full((B, pad, *t.shape[2:]), value), t], 1)

    full = {"attention_mask": front(mask), "position_ids": front(position_ids)}
    if input_ids is not None:
        full["input_ids"] = front(input_ids)
    else:
        full["inputs_embeds"] = front(inputs_embeds)
    return full


def _last_hidden(hidden: torch.Tensor, batch) -> torch.Tensor:
    """The hidden state of the sequence's last token [B, 1, d], from the rank that holds it."""
    sp = batch.sp
    here = (batch.positions() == batch.padded_length - 1).nonzero().flatten().tolist()
    mine = hidden[:, here[0]:here[0] + 1] if here else hidden.new_zeros(hidden.size(0), 1, hidden.size(-1))
    if sp.size == 1:
        return mine
    mine = mine.contiguous()
    lockstep.agree(sp, "decode", {"last hidden": mine.numel(), "dtype": lockstep.dtype_code(mine)})
    work = dist.all_reduce(mine, group=sp.group, async_op=True)  # one rank's state plus zeros: exact
    lockstep.wait(work, sp, f"the prompt's last hidden state ({tuple(mine.shape)})", peer=None)
    return mine


@dataclasses.dataclass
class DecoderCall:
    """A decode step, its bookkeeping done: what runs its decoder (the language model of a VLM,
    through the VLM's inner model: ``vision_generation.decoded``)."""

    kwargs: dict
    vision: bool = False

    @property
    def cache(self) -> ShardedCache:
        return self.kwargs["cache"] if self.vision else self.kwargs["ringseq"].cache

    def run(self, model) -> torch.Tensor:
        """The decoder's last hidden states of the new tokens (traced under ``torch.compile``)."""
        if self.vision:
            return vision_generation.decoded(model, **self.kwargs)
        return model.get_decoder()(**self.kwargs).last_hidden_state


def cached_forward(model, handle, cache, input_ids, inputs_embeds, attention_mask, position_ids, logits_to_keep,
                   kwargs: dict):
    """A patched forward with a KV cache (``generate``'s calls): the prefill when the cache is
    empty (returns the logits generation reads and the cache), a decode step otherwise: its
    checks and bookkeeping here, then a ``DecoderCall``, which the patched forward runs (compiled
    under ``torch.compile``: ``patches.compiled_decode``) and hands to ``decoded``."""
    versions.require_feature("generation", "a patched model with a KV cache (use_cache / past_key_values)")
    if cache is None:
        cache = ShardedCache(model.config, handle.sp)
    if not isinstance(cache, ShardedCache):
        raise RingSeqError(f"a patched model caches keys and values sharded over the group; got past_key_values of "
                           f"type {type(cache).__name__}: call model.generate (it brings ringseq's cache), or pass "
                           f"past_key_values=ringseq.patches.cache.ShardedCache(model.config, sp)")
    if cache.sp is not handle.sp:
        raise RingSeqError("this cache was made for another sequence group than the model's")
    for key in ("labels", "shift_labels", "ringseq"):
        if kwargs.get(key) is not None:
            raise RingSeqError(f"{key} with a KV cache: a patched model computes losses without a cache; drop "
                               f"use_cache / past_key_values")
        kwargs.pop(key, None)
    if cache.seen == 0:
        prefill = vision_generation.prefill if handle.vision is not None else _prefill
        out, batch = _failing(handle.sp, "the prefill", prefill, model, handle, cache, input_ids, inputs_embeds,
                              attention_mask, position_ids, kwargs, sharded=True)
        return _finished(model, handle, cache, _last_hidden(out.last_hidden_state, batch))
    decode = vision_generation.decode if handle.vision is not None else _decode
    return DecoderCall(_failing(handle.sp, "a decode step", decode, model, handle, cache, input_ids, inputs_embeds,
                                attention_mask, position_ids, kwargs), vision=handle.vision is not None)


@torch.compiler.disable
def decoded(model, handle, cache, hidden, logits_to_keep):
    """A decode step's output from the decoder's last hidden states of the new tokens."""
    keep = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else hidden.size(1)
    return _finished(model, handle, cache, hidden[:, -keep:])


def _finished(model, handle, cache, hidden):
    lockstep.finish_step(handle.sp)  # a GPU's deferred failures: raised before generate sees a token
    return CausalLMOutputWithPast(logits=logit_maps.head_logits(model, hidden), past_key_values=cache)


def _failing(sp, what: str, fn, *args, sharded: bool = False):
    """``fn(*args)``; a failure of this rank's own (not ringseq's) is marked for the peers waiting
    in a later layer's ring or all-gather, which learn who failed. ``sharded``: the tokens are
    sharded (the prefill), so a recurrent kernel called without ringseq's batch is refused
    (``mixers.patched_forward``); a decode step runs every token on every rank."""
    try:
        with mixers.patched_forward() if sharded else contextlib.nullcontext():
            return fn(*args)
    except RingSeqError:
        raise
    except BaseException as exc:
        lockstep.mark_failed(sp, f"{what}: {type(exc).__name__}: {exc}")
        raise


def _prefill(model, handle, cache, input_ids, inputs_embeds, attention_mask, position_ids, kwargs):
    """The text prompt through the ring into ``cache``: (the decoder's output on this rank's
    tokens, the prompt's ``ShardedBatch``)."""
    sp = handle.sp
    tokens = input_ids if input_ids is not None else inputs_embeds
    S = tokens.size(1)
    pad = -S % multiple(sp.layout, sp.ring_size, sp.ulysses_size)
    full = _full_prompt(input_ids, inputs_embeds, attention_mask, position_ids, pad)
    local, batch = sharded(full, sp=sp, documents_apart=handle.documents_apart, balance=False)  # the cache's order
    cache.begin_prefill(batch, full["attention_mask"], offset=pad)
    if handle.recurrent:
        kwargs["attention_mask"] = local["attention_mask"]
    decoder = model.get_decoder()
    kwargs[cache_name(type(decoder).forward)] = cache
    out = decoder(input_ids=local.get("input_ids"), inputs_embeds=local.get("inputs_embeds"),
                  position_ids=local["position_ids"], use_cache=True, ringseq=batch, **kwargs)
    cache.end_prefill(length=S)
    return out, batch


def _decode(model, handle, cache, input_ids, inputs_embeds, attention_mask, position_ids, kwargs) -> dict:
    """A decode step of a text model, up to its decoder: the decoder's keyword arguments."""
    sp = handle.sp
    tokens = input_ids if input_ids is not None else inputs_embeds
    B, n = tokens.shape[:2]
    step = {"input_ids": input_ids} if input_ids is not None else {"inputs_embeds": inputs_embeds}
    if attention_mask is not None:
        step["attention_mask"] = attention_mask
    check_same_batch(step, sp)  # every step: the ranks never go on with different tokens
    if attention_mask is not None and attention_mask.size(1) != cache.seen + n:
        raise RingSeqError(f"attention_mask covers {attention_mask.size(1)} tokens, but the cache holds "
                           f"{cache.seen} and {n} come now")
    valid = attention_mask[:, -n:] if attention_mask is not None else torch.ones(B, n, dtype=torch.long,
                                                                                  device=tokens.device)
    decode = cache.begin_step(n, valid)
    kwargs[cache_name(type(model.get_decoder()).forward)] = cache
    return dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                position_ids=position_ids, use_cache=True, ringseq=decode, **kwargs)
