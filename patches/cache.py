"""The KV cache of a patched model's ``generate``: every rank keeps the keys and values of its own
tokens only (shapes: ``ringseq.shapes``).

``ShardedCache`` is a transformers ``DynamicCache`` (so ``generate`` and the model's layers use
it as they use their own) whose attention layers are ``KVShard``: the keys and values of this
rank's share of the prompt (the ring prefilled them, in the layout's token order) and of the new
tokens this rank was chosen to keep (every P-th decode step, so the shards stay balanced). Each
layer keeps the global index of every key it holds and whether the key is padding: what decode
attention masks with (``ringseq.attention.decode``); a window layer drops the keys no later
query can see.

Indices are those of the prefilled sequence: the prompt goes in with ``offset`` layout-padding
tokens in front of it (masked out, zero inputs: see ``patches.generation``), so the prompt's
last token is the sequence's last and new token t has index ``offset + S + t``.

Recurrent layers of hybrid models keep transformers' own ``LinearAttentionLayer``: after the
prefill they hold the states of the whole prompt (the same on every rank), and decode steps
update them on every rank alike. ``update_conv_state`` is overridden for the prefill only: the
convolution state is the last inputs of the whole prompt, which one rank holds
(``ringseq.recurrent.sequence_tail``), and the convolution itself runs sharded.
"""
from __future__ import annotations

import inspect

import torch
from transformers import cache_utils
from transformers.cache_utils import CacheLayerMixin, DynamicCache

from ringseq import recurrent
from ringseq.opaque import REQUIRED, Opaque
from ringseq.errors import RingSeqError


CROP_REFUSED = ("a sharded KV cache cannot be cropped (assisted or speculative decoding rolls it back): "
                "ringseq.unpatch(model) to decode that way")


class KVShard(CacheLayerMixin):
    """One attention layer's keys and values of this rank's tokens [B, K, m, D], each key's
    global index ``positions`` [m] and ``valid`` [B, m] (False: padding). A sliding-window layer
    (``window``) drops the keys no later query can see, as transformers' own window cache does."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: "ShardedCache", index: int, window: int | None = None):
        super().__init__()
        self.cache, self.index, self.window = cache, index, window
        self.positions = torch.zeros(0, dtype=torch.long)
        self.valid = None

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(*key_states.shape[:2], 0, key_states.size(-1))
        self.values = value_states.new_zeros(*value_states.shape[:2], 0, value_states.size(-1))
        self.valid = torch.zeros(key_states.size(0), 0, dtype=torch.bool)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Keep the new keys when this rank keeps this step's tokens; return every key it holds.
        In a compiled decode step the keeping is an op (``patches.compiled_decode``), which
        returns copies of the new keys and values: the decode attention op that follows attends
        to every key the layer holds."""
        if torch.compiler.is_compiling() and self.cache.prefill is None:
            from .compiled_decode import keep

            return keep(self, key_states, value_states)
        return self.keep(key_states, value_states)

    @torch.compiler.disable  # the prefill in compiled layers (``layer.compile()``): kept eagerly, its graph broken here
    def keep(self, key_states, value_states):
        """``update``'s work, eagerly: (every key, every value) this rank holds for the layer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache = self.cache
        if cache.keeping:
            self.keys = torch.cat([self.keys, key_states], -2)
            self.values = torch.cat([self.values, value_states], -2)
            self.positions = torch.cat([self.positions, cache.new_positions])
            self.valid = torch.cat([self.valid, cache.new_valid], 1)
        if self.window is not None and cache.first_query is not None:
            keep = self.positions > cache.first_query - self.window  # what this and every later query can see
            if not bool(keep.all()):
                idx = keep.nonzero().flatten()
                at = idx.to(self.keys.device)
                self.keys, self.values = self.keys[:, :, at], self.values[:, :, at]
                self.positions, self.valid = self.positions[idx], self.valid[:, idx]
        cache.last_layer = self  # what the attention call that follows reads (a family may share one module)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cache.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, max_length: int) -> None:
        raise RingSeqError(CROP_REFUSED)

    def reorder_cache(self, beam_idx) -> None:
        raise RingSeqError("a sharded KV cache cannot be reordered (beam search): use num_beams=1")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise RingSeqError("a sharded KV cache cannot be expanded (beam search, num_return_sequences > 1 after "
                           "the prefill): use num_beams=1")

    def batch_select_indices(self, indices) -> None:
        raise RingSeqError("a sharded KV cache cannot select batch rows (contrastive search): use greedy or sampling")


# transformers' layered caches of recurrent layers (5.23 has them; ``generate`` refuses releases without)
LinearAttentionLayer = getattr(cache_utils, "LinearAttentionLayer", object)
LinearAttentionCacheLayerMixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
DummyLayer = getattr(cache_utils, "DummyLayer", ())


class KVShardAndState(KVShard, LinearAttentionLayer):
    """A layer with attention and a recurrent mixer side by side (Falcon-H1, Zamba2): this rank's
    keys and values, and the recurrent states (the same on every rank)."""

    def __init__(self, cache: "ShardedCache", index: int, number_of_states: int, window: int | None = None):
        KVShard.__init__(self, cache, index, window)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs):
        if args:  # the attention part (update's keys and values)
            KVShard.lazy_initialization(self, *args)
        else:  # the recurrent part (conv_states= / recurrent_states=)
            LinearAttentionLayer.lazy_initialization(self, **kwargs)


class DecodeStep(Opaque):
    """What a decode step's layers read (the ``ringseq`` keyword argument, as ``ShardedBatch``
    is in the prefill; opaque to the engines as it is, ``ringseq.opaque``): the group (``sp``), the
    ``cache`` and the new tokens' global indices (``q_pos``); its ``key`` names the step for the
    compiled decode ops (``ringseq.attention.compiled.register_batch``)."""

    FIELDS = {"sp": REQUIRED, "cache": REQUIRED, "q_pos": REQUIRED}


class ShardedCache(DynamicCache):
    """A ``DynamicCache`` for ``config`` whose attention layers keep this rank's tokens only."""

    def __init__(self, config, sp):
        super().__init__(config=config)
        if not self.layers:
            raise RingSeqError(f"{type(config).__name__} names no layer types ringseq can cache")
        for i, layer in enumerate(self.layers):
            window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
            if isinstance(layer, CacheLayerMixin) and isinstance(layer, LinearAttentionCacheLayerMixin):
                self.layers[i] = KVShardAndState(self, i, layer.number_of_states, window)
            elif isinstance(layer, CacheLayerMixin):
                self.layers[i] = KVShard(self, i, window)
            elif not isinstance(layer, (LinearAttentionCacheLayerMixin, DummyLayer)):
                raise RingSeqError(f"layer {i}'s cache is a {type(layer).__name__}, which ringseq does not shard: "
                                   f"ringseq.unpatch(model) before generating")
        self.sp = sp
        self.seen = 0
        """Tokens of the caller's sequence so far (prompt and new tokens): what transformers sees."""
        self.offset = 0
        """Layout padding in front of the prompt."""
        self.steps = 0
        """Decode steps so far (step t's tokens are kept by sequence rank t % P)."""
        self.keeping = False
        """Whether this rank keeps the tokens going through the model now."""
        self.new_positions = self.new_valid = None
        """Their global indices [n] and padding flags [B, n] (what the layers append)."""
        self.first_query = None
        """The first new token's global index in a decode step (None in the prefill)."""
        self.prefill = None
        """The prefill's ``ShardedBatch`` while the prompt goes through the model."""
        self.last_layer = None
        """The layer whose keys were returned last: the attention call that follows attends to them."""
        self.step = None
        """The decode step going through the model now (``DecodeStep``)."""

    # --- the patched forward's bookkeeping ------------------------------------------------------

    def begin_prefill(self, batch, valid: torch.Tensor, offset: int) -> None:
        """The prompt's ``ShardedBatch`` ([B, offset + S] ``valid``) goes through the model now."""
        if self.seen:
            raise RingSeqError("a sharded KV cache is filled once, by the prompt; continuing a generation from a "
                               "filled cache (past_key_values=) is not supported: pass the whole sequence as the "
                               "prompt")
        self.prefill, self.keeping, self.offset = batch, True, offset
        self.new_positions = batch.positions()
        self.new_valid = valid[:, self.new_positions.to(valid.device)].bool().cpu()

    def end_prefill(self, length: int) -> None:
        self.prefill, self.keeping, self.seen = None, False, length

    def begin_step(self, n: int, valid: torch.Tensor) -> DecodeStep:
        """n new tokens ([B, n] ``valid``): this rank keeps them on its turn."""
        start = self.offset + self.seen
        q_pos = torch.arange(start, start + n)
        self.keeping = self.steps % self.sp.size == self.sp.rank
        self.new_positions, self.new_valid, self.first_query = q_pos, valid.bool().cpu(), start
        self.steps += 1
        self.seen += n
        self.last_layer = None
        self.step = DecodeStep(sp=self.sp, cache=self, q_pos=q_pos)
        return self.step

    def kv_bytes(self) -> int:
        """Bytes of keys and values this rank holds."""
        return sum(t.numel() * t.element_size() for layer in self.layers if isinstance(layer, KVShard)
                   and layer.is_initialized for t in (layer.keys, layer.values))

    # --- transformers' cache interface ------------------------------------------------------------

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        """In the prefill: cache the whole prompt's last inputs, return this rank's (the
        convolution runs sharded); afterwards transformers' own update."""
        batch = self.prefill
        if batch is None:
            return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)
        layer = self.layers[layer_idx]
        width = kwargs.get("conv_kernel_size") or conv_states.size(-1)
        tail = recurrent.sequence_tail(conv_states, width, batch)
        layer.lazy_initialization(conv_states=tail, state_idx=state_idx, conv_kernel_size=width)
        layer.conv_states[state_idx].copy_(tail)
        layer.has_previous_state[state_idx] = True
        return conv_states

    def crop(self, max_length: int) -> None:
        raise RingSeqError(CROP_REFUSED)


def cache_name(fn) -> str:
    """The name ``fn`` takes a cache by: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"
