"""The patched model's forward: the full batch in (on every rank of the sequence group), the
global loss and this rank's logits out (shapes: ``ringseq.shapes``).

It shards the batch once (``ringseq.batch.sharded``: the ``ShardedBatch`` every layer, the
loss, the fused head and the metrics read), runs the model's own decoder on this rank's shard
with the ``ShardedBatch`` as the ``ringseq`` keyword argument (transformers hands it to every
attention function, also on a checkpointed layer's recompute), and computes the loss as local
sum / global count.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from ringseq import engines, lockstep, recovery, versions
from ringseq.batch import ShardedBatch, sharded
from ringseq.errors import RingSeqError
from ringseq.loss import chunked_cross_entropy, count_targets, cross_entropy, slab_tokens

from . import checkpointing, fit as fitting, generation, logits as logit_maps, mixers, router_loss, vision

# What a padding-free collator (TRL's) adds for flash-attention's varlen kernels: a second
# description of the packed documents, which ringseq reads from position_ids instead.
PACKING_METADATA = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _drop_packing_metadata(kwargs: dict, position_ids, recurrent: bool) -> None:
    given = [k for k in PACKING_METADATA if kwargs.get(k) is not None]
    if given and position_ids is None:
        raise RingSeqError(f"{', '.join(given)} describe packed documents, which ringseq reads from position_ids "
                           f"(a document starts where they do not count up): pass position_ids")
    if given and recurrent:
        raise RingSeqError(f"{', '.join(given)} make the recurrent layers of a hybrid model restart their states at "
                           f"every packed document (with the FLA / mamba-ssm kernels; transformers' PyTorch path "
                           f"refuses or ignores them), which ringseq does not reproduce: pass packed documents as "
                           f"position_ids alone (attention keeps them apart, the recurrent layers run across them, "
                           f"as the PyTorch path does), or train without packing")
    for k in PACKING_METADATA:
        kwargs.pop(k, None)


def _batch(handle, input_ids, inputs_embeds, attention_mask, position_ids, labels, shift_labels,
           ringseq, counted: bool, balance: bool, vocab: int | None = None) -> tuple[dict, ShardedBatch]:
    """This rank's inputs and the batch's facts: sharded here from the full batch (its token ids
    and labels checked against ``vocab``), or as ``ringseq.shard_batch`` made them (its ``labels``
    are then already shifted)."""
    if ringseq is None:
        full = {"input_ids": input_ids, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                "position_ids": position_ids, "labels": labels, "shift_labels": shift_labels}
        return sharded({k: v for k, v in full.items() if v is not None}, sp=handle.sp,
                       documents_apart=handle.documents_apart, balance=balance, vocab=vocab)
    if not isinstance(ringseq, ShardedBatch):
        raise RingSeqError(f"ringseq= must be what ringseq.shard_batch put in the batch, got {type(ringseq).__name__}")
    if labels is not None and shift_labels is not None:
        raise RingSeqError("a batch from ringseq.shard_batch carries shifted labels; pass labels or shift_labels, "
                           "not both")
    targets = shift_labels if shift_labels is not None else labels
    facts = ringseq.apart(handle.documents_apart)
    local = {"input_ids": input_ids, "inputs_embeds": inputs_embeds, "position_ids": position_ids,
             "attention_mask": attention_mask, "labels": targets}
    if targets is None:  # the caller took the labels out: logits only
        facts = facts.replace(labels=None, count=None)
    elif targets is not facts.labels:  # labels of the caller's own: count them over the group (unless given)
        facts = facts.replace(labels=targets, count=None if counted else count_targets(targets, handle.sp))
    return local, facts


@dataclasses.dataclass
class _Step:
    """One training or scoring forward between its bookkeeping and its decoder run."""

    handle: object
    batch: ShardedBatch | None = None
    kwargs: dict | None = None
    local: dict | None = None
    padding: object = None
    out: object = None
    vision: dict | None = None
    """A vision-language model's inputs for ``vision.run`` (its multimodal part on the full batch)."""
    router: object = None
    unshifted: bool = False


@versions.bindable
@functools.partial(torch.compiler.disable, recursive=False)
def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
            shift_labels=None, ringseq=None, num_items_in_batch=None, use_cache=None, past_key_values=None,
            fused_lm_head=False, logits_fn=None, logits_to_keep=0, cache=None, **kwargs):
    """Patched forward: the full batch in (on every rank of the sequence group), the global loss
    and this rank's logits out. A batch already sharded by ``ringseq.shard_batch`` (it carries
    ``ringseq``) is taken as it is; its ``labels`` are already shifted. ``fused_lm_head=True``
    (TRL's fused LM head) returns per-token log-probabilities instead (``patches.fused_head``).
    ``logits_fn(logits, labels)`` (a Trainer's ``preprocess_logits_for_metrics``) is applied to
    this rank's logits a slab of tokens at a time and ``logits`` is its result for the whole
    sequence in global order: full-vocabulary logits of the shard are never held. With a KV
    cache (``use_cache=True`` or ``past_key_values``: ``generate``'s calls) it prefills or decodes
    over the group's sharded cache instead (``patches.generation``): logits of the last token only
    in the prefill, of the new tokens (or the last ``logits_to_keep``) in a decode step.

    Under ``torch.compile`` (of the model, ``model.compile()``) this frame and its bookkeeping
    (batch, agreements, loss) run eagerly and the decoder runs compiled, each attention layer's
    ring one op (``ringseq.attention.compiled``)."""
    try:
        step = _prepare(self, input_ids, attention_mask, position_ids, inputs_embeds, labels, shift_labels, ringseq,
                        num_items_in_batch, use_cache, past_key_values, fused_lm_head, logits_fn, logits_to_keep, cache,
                        kwargs)
    except BaseException as exc:  # a refusal before the batch: its group (the job, over replicas) is told and every
        # rank puts its engine back, as the ranks that met the refusal in the batch's agreement do
        if not getattr(exc, "_ringseq_step_failed", False) and not (
                use_cache or past_key_values is not None or cache is not None):  # not a generation call's
            _failed(self, exc, "the patched forward's checks")
        raise
    if isinstance(step, generation.DecoderCall):  # a decode step: the decoder over the group's cache (compiled too)
        try:
            hidden = step.run(self)
        except RingSeqError:
            raise
        except BaseException as exc:
            lockstep.mark_failed(self._ringseq_patch.sp, f"a decode step: {type(exc).__name__}: {exc}")
            raise
        return generation.decoded(self, self._ringseq_patch, step.cache, hidden, logits_to_keep)
    if not isinstance(step, _Step):
        return step  # a generation call's output (the prefill's)
    try:
        with mixers.patched_forward():
            if step.vision is not None:  # the multimodal part on the full batch, the language model sharded
                step.out, step.batch = vision.run(self, step.handle, **step.vision)
            else:
                step.out = self.get_decoder()(input_ids=step.local.get("input_ids"),
                                              inputs_embeds=step.local.get("inputs_embeds"),
                                              position_ids=step.local["position_ids"], use_cache=False,
                                              ringseq=step.batch, **step.kwargs)
        out = _outputs(self, step, num_items_in_batch, fused_lm_head, logits_fn)
        _opened(self, out)
    except BaseException as exc:
        _failed(self, exc)
        raise
    return out


@torch.compiler.disable
def _failed(model, exc: BaseException, what: str = "the patched forward") -> None:
    """This rank leaves a training or scoring forward with ``exc``: its note (unless ringseq raised it, which
    left one), every rank of the group told in this step (the peers raise at the agreement or layer gate they
    wait in, before any engine collective this rank would not make) and the engine around the model back to
    idle with every other rank (``ringseq.recovery``)."""
    recovery.step_failed(model._ringseq_patch.sp, exc, what, model)
    try:
        exc._ringseq_step_failed = True  # once per step, however many frames it leaves
    except AttributeError:  # an exception type without attributes
        pass


@torch.compiler.disable
def _opened(model, out) -> None:
    """A training forward returned tensors with a gradient: until its backward ends, a backward failure is this
    step's (``ringseq.recovery``), and the backward ends with the group's agreement, queued by the first of them
    to get its gradient. Its hooks are registered before any engine's on the same outputs (FSDP2's root registers
    its own when this forward returns), so the agreement runs before the engine's final callbacks: a rank whose
    backward failed after the last ring call (in the embedding's backward) is met there, before the root's
    reduce-scatters it would never make."""
    tensors = [t for t in (out.values() if hasattr(out, "values") else ()) if torch.is_tensor(t) and t.requires_grad]
    sp = model._ringseq_patch.sp
    if not tensors:  # no backward to come: under an engine over replicas the job meets at the forward's end
        engines.forward_end(sp)
        return
    lockstep.open_step(sp)
    engines.opened(sp)

    def queue_the_end(grad):
        lockstep.check_at_end_of_backward(sp)

    for t in tensors:
        t.register_hook(queue_the_end)


@torch.compiler.disable
def _prepare(self, input_ids, attention_mask, position_ids, inputs_embeds, labels, shift_labels, ringseq,
             num_items_in_batch, use_cache, past_key_values, fused_lm_head, logits_fn, logits_to_keep, cache, kwargs):
    """Everything before the decoder: checks, the engine, the batch, the fit switches and
    checkpointing. A generation call's prefill is run whole here, its output returned instead of
    a step; a decode step returns what runs its decoder (``patches.generation.cached_forward``)."""
    handle = self._ringseq_patch
    if past_key_values is None:  # transformers >= 5.24 names it ``cache`` (and validates generate's kwargs by it)
        past_key_values = cache
    cached = past_key_values is not None or bool(use_cache)
    try:  # this rank's own misuse: refused in the batch's agreement, so every rank raises in this step, in step
        if not cached:  # first: a step refused on one rank finds the same engines on every rank (``recover``)
            if torch.is_grad_enabled():  # the engine around the model must average as the gradient rule needs
                handle.sharding = engines.check(self, handle.sp) or handle.sharding
            else:  # the job's news of an earlier step is spent
                lockstep.widen(handle.sp, lockstep.wider(handle.sp))
            _drop_packing_metadata(kwargs, position_ids, handle.recurrent)
        if kwargs.get("output_attentions"):
            raise RingSeqError("output_attentions is not available: ringseq never materialises attention weights")
        if cached and (fused_lm_head or logits_fn is not None):
            raise RingSeqError("fused_lm_head / logits_fn with a KV cache: generation computes plain logits")
    except RingSeqError as err:
        lockstep.refuse(handle.sp, "batch", err)
    if cached:
        kwargs.update(labels=labels, shift_labels=shift_labels, ringseq=ringseq)
        return generation.cached_forward(self, handle, past_key_values, input_ids, inputs_embeds, attention_mask,
                                         position_ids, logits_to_keep, kwargs)
    step = _Step(handle, kwargs=kwargs, unshifted=labels is not None and ringseq is None)  # TRL's fused head: S - 1
    balance = _balance(self, handle, labels is not None or shift_labels is not None, fused_lm_head, logits_fn, kwargs)
    step.router = _router(self, handle, kwargs)
    if handle.fit is not None and self.training and torch.is_grad_enabled():  # the switches for this length
        rows = next(x for x in (input_ids, inputs_embeds) if x is not None)
        length = ringseq.padded_length if ringseq is not None else rows.shape[1]
        fitting.before_step(self, handle, rows.shape[0], length)
    checkpointing.wrap(self, handle.offload, handle.keep_ring_outputs)  # checkpointed layers keep ring outputs
    try:
        if handle.vision is None:
            step.local, batch = _batch(handle, input_ids, inputs_embeds, attention_mask, position_ids, labels,
                                       shift_labels, ringseq, counted=num_items_in_batch is not None,
                                       balance=balance, vocab=_vocabulary(self))
            step.batch = batch.with_head_groups(handle.head_groups)
            step.padding = step.local.get("attention_mask")
            if handle.recurrent and step.padding is not None:
                kwargs["attention_mask"] = step.padding  # recurrent layers zero padding with this rank's shard
            return step
        # the multimodal part on the full batch, the language model sharded (run by the forward: compiled under
        # torch.compile(model), its sharding and agreements eager)
        if ringseq is not None:
            raise RingSeqError("a vision-language model takes the full batch (images and placeholder tokens), not "
                               "one from ringseq.shard_batch: call the patched model on it")
        step.vision = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                           position_ids=position_ids, labels=labels, shift_labels=shift_labels, kwargs=kwargs,
                           balance=balance)
    except BaseException as exc:  # peers waiting in a later layer's ring learn who failed (``ringseq.peers``)
        _failed(self, exc)
        raise
    return step


@torch.compiler.disable
def _outputs(self, step: _Step, num_items_in_batch, fused_lm_head, logits_fn):
    """The loss (the router's included), the logits or TRL's fused head from the decoder's output."""
    out, batch, router, padding = step.out, step.batch, step.router, step.padding
    hidden, targets = out.last_hidden_state, batch.labels
    count = num_items_in_batch if num_items_in_batch is not None else batch.count
    aux = None
    if router is not None:  # the router loss of the whole batch, as the unpatched model computes it
        aux = router_loss.aux_loss(out.router_logits, router, batch,
                                   batch.attention_mask if padding is None else padding)
    if fused_lm_head:
        from .fused_head import fused_outputs

        return fused_outputs(self, batch, hidden, drop_last=step.unshifted, num_items_in_batch=num_items_in_batch,
                             aux_loss=aux)
    handle = step.handle
    loss = logits = None
    if targets is not None and (handle.chunked_loss or logits_fn is not None):
        loss = chunked_cross_entropy(hidden, targets, self.get_output_embeddings(), sp=handle.sp, count=count,
                                     final_softcap=logit_maps.final_softcap(self.config),
                                     finish=logit_maps.finisher(self))
    elif logits_fn is None:
        logits = logit_maps.head_logits(self, hidden)
        if targets is not None:
            loss = cross_entropy(logits, targets, sp=handle.sp, num_items_in_batch=count)
    if logits_fn is not None:
        logits = _preprocessed(self, hidden, batch.raw_labels if step.unshifted else None, logits_fn, batch)
    if router is None:
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states)
    if loss is not None:
        loss = loss + router.coef * aux.to(loss.dtype)
    # this rank's router logits are in the layout's token order and of its tokens only: not returned
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux.float(), logits=logits, hidden_states=out.hidden_states)


def _vocabulary(model) -> int | None:
    """The token ids the model reads: its input embedding's rows (kept under FSDP2 and ZeRO-3 sharding)."""
    embedding = model.get_input_embeddings()
    return getattr(embedding, "num_embeddings", None) or getattr(model.config.get_text_config(), "vocab_size", None)


def _balance(model, handle, labelled: bool, fused_lm_head: bool, logits_fn, kwargs: dict) -> bool:
    """Whether a full batch's packed documents may be laid out by work (``ringseq.balance``): only
    when nothing of this rank's tokens leaves the forward in their local order, so that
    ``ringseq.gather(out.logits, 1, sp=sp)`` stays right. The loss, TRL's fused head and
    ``logits_fn`` put what they return in global order themselves; returned logits (no labels,
    ``chunked_loss=False``) and hidden states keep the group's layout."""
    hidden = kwargs.get("output_hidden_states")
    if hidden is None:
        hidden = getattr(model.config, "output_hidden_states", False)
    if hidden:
        return False
    return fused_lm_head or logits_fn is not None or (labelled and handle.chunked_loss)


def _router(model, handle, kwargs: dict):
    """The router loss to add (``patches.router_loss``), when the router logits are asked for."""
    want = kwargs.get("output_router_logits")
    want = getattr(model.config.get_text_config(), "output_router_logits", False) if want is None else want
    if not want:
        return None
    if handle.router_loss is None:  # the family has a router but adds no loss (kimi_linear, nemotron_h, lfm2_moe)
        kwargs["output_router_logits"] = False
        return None
    kwargs["output_router_logits"] = True
    return handle.router_loss


def _preprocessed(model, hidden, labels, fn, batch: ShardedBatch):
    """fn(logits, labels) slab by slab over this rank's tokens, gathered into global order."""
    B, s = hidden.shape[:2]
    step = max(1, slab_tokens(model.config.get_text_config().vocab_size) // B)
    parts = []
    with torch.no_grad():
        for a in range(0, s, step):
            part = fn(logit_maps.head_logits(model, hidden[:, a:a + step]),
                      None if labels is None else labels[:, a:a + step])
            n = hidden[:, a:a + step].size(1)
            if not torch.is_tensor(part) or part.dim() < 2 or tuple(part.shape[:2]) != (B, n):
                raise RingSeqError("preprocess_logits_for_metrics must work token by token under ringseq (it is "
                                   "applied to slabs of logits [B, n, V] and must return [B, n, ...], e.g. "
                                   f"logits.argmax(-1)); it returned {type(part).__name__} "
                                   f"{tuple(getattr(part, 'shape', ()))}")
            parts.append(part)
    return batch.gather(torch.cat(parts, 1))
