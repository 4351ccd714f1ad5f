"""``ringseq.patch`` / ``ringseq.unpatch``: one reversible change to a transformers causal LM.

What is patched, and why: the model's attention implementation becomes "ringseq"
(``set_attn_implementation``, through the registry), and the model instance gets its own
``forward`` (an instance attribute; the class is untouched). That forward shards the full
batch (labels shifted first), runs the model's own decoder on the local shard, and computes
the loss as local sum / global count. ``unpatch`` deletes the instance attribute and restores
the previous attention implementation, leaving the model exactly as it was.
"""
from __future__ import annotations

import dataclasses
import types

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ringseq.batch import shard_batch
from ringseq.errors import RingSeqError
from ringseq.loss import IGNORE, chunked_cross_entropy, cross_entropy, slab_tokens
from ringseq.sharding import gather, shard
from ringseq.topology import check_sp
from ringseq.attention.masks import TokenInfo

from . import checkpointing, checks, tiled_mlp as tiling
from .documents import isolates_documents
from .registry import NAME, register


@dataclasses.dataclass(kw_only=True)
class PatchHandle:
    """Attached to a patched model as ``model._ringseq_patch``."""

    sp: object
    previous_attn_implementation: str
    chunked_loss: bool
    documents_apart: bool = True
    """Whether the unpatched model keeps packed documents apart (``patches.documents``)."""
    previous_forward: object = None
    """An instance-level forward that was there before (e.g. TRL's fused LM head), restored by
    ``unpatch``; None when the model used its class's forward."""
    tiled_mlp: object = None
    """None (MLPs untouched), True or a number of tiles per shard (``patches.tiled_mlp``)."""
    offload: bool = False
    """Whether checkpointing offloads to host memory (transformers' option; ``patches.checkpointing``)."""
    keep_ring_outputs: bool = True
    """Whether checkpointed layers keep their ring outputs (False: their recompute replays the ring)."""


def _final_softcap(config):
    return getattr(config, "final_logit_softcapping", None)


def _logits(model, hidden):
    logits = model.get_output_embeddings()(hidden)
    cap = _final_softcap(model.config)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return logits


# What a padding-free collator (TRL's) adds for flash-attention's varlen kernels: a second
# description of the packed documents, which ringseq reads from position_ids instead.
PACKING_METADATA = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _drop_packing_metadata(kwargs: dict, position_ids) -> None:
    given = [k for k in PACKING_METADATA if kwargs.get(k) is not None]
    if given and position_ids is None:
        raise RingSeqError(f"{', '.join(given)} describe packed documents, which ringseq reads from position_ids "
                           f"(a document starts where they do not count up): pass position_ids")
    for k in PACKING_METADATA:
        kwargs.pop(k, None)


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
             shift_labels=None, ringseq=None, num_items_in_batch=None, use_cache=None, past_key_values=None,
             fused_lm_head=False, logits_fn=None, **kwargs):
    """Patched forward: the full batch in (on every rank of the sequence group), the global loss
    and this rank's logits out. A batch already sharded by ``ringseq.shard_batch`` (it carries
    ``ringseq``) is taken as it is; its ``labels`` are already shifted. ``fused_lm_head=True``
    (TRL's fused LM head) returns per-token log-probabilities instead (``patches.fused_head``).
    ``logits_fn(logits, labels)`` (a Trainer's ``preprocess_logits_for_metrics``) is applied to
    this rank's logits a slab of tokens at a time and ``logits`` is its result for the whole
    sequence in global order: full-vocabulary logits of the shard are never held."""
    handle = self._ringseq_patch
    if past_key_values is not None or use_cache:
        raise RingSeqError("a patched model trains on whole sequences: KV caches (use_cache, past_key_values) "
                           "are not supported; ringseq.unpatch(model) before generating")
    if kwargs.get("output_attentions"):
        raise RingSeqError("output_attentions is not available: ringseq never materialises attention weights")
    _drop_packing_metadata(kwargs, position_ids)
    count = num_items_in_batch
    drop_last = labels is not None and ringseq is None  # unshifted labels: S - 1 tokens have a target
    if ringseq is None:  # full batch: shard it here
        full = {"input_ids": input_ids, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                "position_ids": position_ids, "labels": labels, "shift_labels": shift_labels}
        local = shard_batch({k: v for k, v in full.items() if v is not None}, sp=handle.sp,
                            documents_apart=handle.documents_apart)
        if count is None and (labels is not None or shift_labels is not None):
            targets = shift_labels if shift_labels is not None else labels[:, 1:]
            count = (targets != IGNORE).sum()  # the whole batch is here: no communication needed
        input_ids, inputs_embeds = local.get("input_ids"), local.get("inputs_embeds")
        position_ids, shift_labels, ringseq = local["position_ids"], local.get("labels"), local["ringseq"]
    else:  # already sharded by shard_batch: its labels are shifted
        if labels is not None and shift_labels is not None:
            raise RingSeqError("a batch from ringseq.shard_batch carries shifted labels; pass labels or "
                               "shift_labels, not both")
        shift_labels = shift_labels if shift_labels is not None else labels
        if not handle.documents_apart and ringseq.info.doc is not None:
            ringseq = dataclasses.replace(ringseq, info=TokenInfo(valid=ringseq.info.valid))
    checkpointing.wrap(self, handle.offload, handle.keep_ring_outputs)  # checkpointed layers keep ring outputs
    decoder = self.get_decoder()
    out = decoder(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False,
                  ringseq=ringseq, **kwargs)
    hidden = out.last_hidden_state
    if fused_lm_head:
        from .fused_head import fused_outputs

        return fused_outputs(self, handle.sp, hidden, shift_labels, ringseq.pad, drop_last=drop_last,
                             num_items_in_batch=num_items_in_batch)
    loss = logits = None
    if shift_labels is not None and (handle.chunked_loss or logits_fn is not None):
        if count is None:
            count = (shift_labels != IGNORE).sum()
            if handle.sp.size > 1:
                torch.distributed.all_reduce(count, group=handle.sp.group)
        loss = chunked_cross_entropy(hidden, shift_labels, self.get_output_embeddings(), sp=handle.sp, count=count,
                                     final_softcap=_final_softcap(self.config))
    elif logits_fn is None:
        logits = _logits(self, hidden)
        if shift_labels is not None:
            loss = cross_entropy(logits, shift_labels, sp=handle.sp, num_items_in_batch=count)
    if logits_fn is not None:
        local_labels = None
        if labels is not None and drop_last:  # the unshifted labels of this rank's tokens, padded like the batch
            local_labels = shard(torch.nn.functional.pad(labels, (0, ringseq.pad), value=IGNORE), 1, sp=handle.sp)
        logits = _preprocessed(self, hidden, local_labels, logits_fn, handle.sp, ringseq.pad)
    return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states)


def _preprocessed(model, hidden, labels, fn, sp, pad: int):
    """fn(logits, labels) slab by slab over this rank's tokens, gathered into global order."""
    B, s = hidden.shape[:2]
    step = max(1, slab_tokens(model.config.get_text_config().vocab_size) // B)
    parts = []
    with torch.no_grad():
        for a in range(0, s, step):
            part = fn(_logits(model, hidden[:, a:a + step]), None if labels is None else labels[:, a:a + step])
            if not torch.is_tensor(part) or part.dim() < 2 or tuple(part.shape[:2]) != (B, hidden[:, a:a + step].size(1)):
                raise RingSeqError("preprocess_logits_for_metrics must work token by token under ringseq (it is "
                                   "applied to slabs of logits [B, n, V] and must return [B, n, ...], e.g. "
                                   f"logits.argmax(-1)); it returned {type(part).__name__} "
                                   f"{tuple(getattr(part, 'shape', ()))}")
            parts.append(part)
    local = torch.cat(parts, 1)
    full = gather(local, 1, sp=sp)
    return full[:, : full.size(1) - pad]


def patch(model, *, sp, chunked_loss: bool = True, tiled_mlp=None, keep_ring_outputs: bool = True):
    """Patch ``model`` (a transformers causal LM) for sequence parallelism over ``sp``.

    Afterwards ``model(**full_batch)``, called with the same full batch on every rank of the
    sequence group, shards the batch itself and returns the exact global loss. Logits: with
    labels and ``chunked_loss`` (default) the loss is computed slab by slab from the final
    hidden states and ``logits`` is None (full-vocabulary logits of the whole shard are never
    held); otherwise ``logits`` is this rank's shard [B, s, V], in the layout's token order.
    ``tiled_mlp`` (None: off; True: one tile per hidden_size tokens; an int: tiles per shard)
    runs every decoder MLP in sequence tiles, each recomputed in backward (``patches.tiled_mlp``).
    Checkpointing (``gradient_checkpointing_enable``, before or after patching) never replays the
    ring: checkpointed layers keep each ring call's output and log-sum-exp
    (``patches.checkpointing``); ``keep_ring_outputs=False`` trades that speed for memory (one
    q-sized tensor per layer less; the recompute replays the ring). Patching twice only updates
    ``sp`` and the options (and puts the patched forward back if something replaced it since).
    Raises ``RingSeqError`` listing every feature of the model that ringseq cannot
    reproduce. A forward set on the instance before (TRL's fused LM head) is replaced, since the
    patched forward answers ``fused_lm_head=True`` itself, and comes back with ``unpatch``.
    """
    check_sp(sp)
    tiling.check(tiled_mlp)
    if not isinstance(model, torch.nn.Module):
        raise RingSeqError(f"ringseq.patch takes a transformers model object, got {type(model).__name__}: load it "
                           f"with AutoModelForCausalLM.from_pretrained (or from_config) first")
    handle = getattr(model, "_ringseq_patch", None)
    if handle is not None:
        handle.sp, handle.chunked_loss, handle.keep_ring_outputs = sp, chunked_loss, bool(keep_ring_outputs)
        if tiled_mlp != handle.tiled_mlp:
            tiling.uninstall(model)
            if tiled_mlp is not None:
                tiling.install(model, tiled_mlp)
            handle.tiled_mlp = tiled_mlp
        if getattr(vars(model).get("forward"), "__func__", None) is not _forward:
            model.forward = types.MethodType(_forward, model)
        return model
    checks.check(model)
    if tiled_mlp is not None:
        tiling.mlps(model)  # refuses MLPs it cannot tile before anything changes
    register()
    handle = PatchHandle(sp=sp, previous_attn_implementation=model.config._attn_implementation,
                         chunked_loss=chunked_loss, previous_forward=vars(model).get("forward"),
                         keep_ring_outputs=bool(keep_ring_outputs))
    model.set_attn_implementation(NAME)
    try:
        handle.documents_apart = isolates_documents(model)
    except BaseException:
        model.set_attn_implementation(handle.previous_attn_implementation)
        raise
    model._ringseq_patch = handle
    model.forward = types.MethodType(_forward, model)
    if tiled_mlp is not None:
        tiling.install(model, tiled_mlp)
        handle.tiled_mlp = tiled_mlp
    checkpointing.watch_offload(_transformers_model(model), handle)
    return model


def _transformers_model(model):
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def options(model) -> dict:
    """The ``patch`` options a model was patched with ({} if it is not patched): what ringseq's
    Trainer, SFTTrainer and ``initialize`` pass on when they (re)patch a model the user patched."""
    handle = getattr(model, "_ringseq_patch", None)
    return {} if handle is None else {"chunked_loss": handle.chunked_loss, "tiled_mlp": handle.tiled_mlp,
                                      "keep_ring_outputs": handle.keep_ring_outputs}


def unpatch(model):
    """Restore a patched model exactly (no-op for a model that is not patched)."""
    handle = getattr(model, "_ringseq_patch", None)
    if handle is None:
        return model
    model.set_attn_implementation(handle.previous_attn_implementation)
    tiling.uninstall(model)
    checkpointing.unwrap(_transformers_model(model))
    checkpointing.unwrap(model)
    if handle.previous_forward is None:
        del model.forward
    else:
        model.forward = handle.previous_forward
    del model._ringseq_patch
    return model
