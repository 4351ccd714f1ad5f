"""Full batch -> this rank's shard, for the manual path (``shard_batch``) and the patched model.

Labels are shifted on the full sequence *before* sharding, so a rank's last token predicts
the next rank's first token; position ids are global (built as 0..S-1 when absent), so rotary
embeddings see true positions; documents and padding are read from the full batch, so no
communication is needed to know them. A length the layout cannot split is padded at the end
(``pad_to_layout``): under causal attention no real token ever sees a token after it, so the
real tokens' results are exactly the unpadded ones.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from . import lockstep
from .attention.masks import TokenInfo, documents
from .attention.work import per_rank
from .balance import balanced
from .errors import RingSeqError
from .layouts import multiple, sp_positions
from .lockstep import checksum, dtype_code
from .loss import IGNORE
from .opaque import REQUIRED, Opaque
from .sharding import gather, shard_tensor
from .topology import check_sp

SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels")


class ShardedBatch(Opaque):
    """Every fact of one sharded batch, made once per forward (``shard_batch``): what the
    attention layers, the loss, the fused LM head and the metrics read, so that none of them
    works it out again. A patched model hands it to every layer as the ``ringseq`` keyword
    argument (transformers passes model keyword arguments down to attention, also on a
    checkpointed layer's recompute); every engine that walks a forward's inputs hands it on as
    itself (``ringseq.opaque``). Shapes: ``ringseq.shapes``. Its fields:

    - ``sp``; ``length``: S, tokens per row as the batch came; ``pad``: tokens appended to every row
      so that the layout can split it (``pad_to_layout``);
    - ``info``: what attention keeps apart over the whole (padded) batch (a ``TokenInfo``: packed
      documents, where the model keeps them apart, and padding);
    - ``documents``: [B, S + pad] int32 document ids by transformers' rule (None: one document per
      row), whether or not attention keeps them apart;
    - ``count``: targets (shifted labels other than -100) in the whole batch: what the loss divides by;
    - ``labels``: this rank's shifted labels [B, s] (entry i is the target of token i);
      ``raw_labels``: this rank's labels as given [B, s] (None when only shift_labels came), what a
      metrics function reads next to the logits of the same tokens;
    - ``attention_mask``: this rank's shard of the 2-D padding mask [B, s] (what recurrent layers zero
      padding with);
    - ``head_groups``: how the attention layers run their ring calls on this batch (the patched
      model's ``patch(head_groups=)``; None: one ring for all heads);
    - ``checkpointed``: this batch as the layers of a compiled checkpointed region see it
      (``in_checkpoint``);
    - ``key`` (made with it): a 0-d int64 tensor naming this batch to the compiled ring ops
      (``ringseq.attention.compiled``)."""

    FIELDS = {"sp": REQUIRED, "length": REQUIRED, "pad": REQUIRED, "info": REQUIRED, "documents": None, "count": None,
              "labels": None, "raw_labels": None, "attention_mask": None, "head_groups": None,
              "checkpointed": False}

    def _made(self):
        # ``in_checkpoint``: this batch for the layers of a compiled checkpointed region
        # (``ringseq.attention.keep.compiled_checkpoint``), the same facts under a key of its own, made
        # with the batch (never while dynamo traces), so that the recurrent layers' op knows to recompute
        # its kernel in the backward rather than keep its graph
        twin = self if self.checkpointed else self.replace(checkpointed=True)
        object.__setattr__(self, "in_checkpoint", twin)

    @property
    def padded_length(self) -> int:
        return self.length + self.pad

    @property
    def order(self):
        """The layout this batch was sharded by: the batch's own ``ringseq.layouts.Runs`` (packed
        documents balanced by work, ``ringseq.balance``; ``info`` carries it to the attention
        layers), else the group's layout name."""
        return self.sp.layout if self.info.layout is None else self.info.layout

    def positions(self) -> torch.Tensor:
        """Global indices (int64 [s]) of this rank's tokens, in local order."""
        sp = self.sp
        return sp_positions(self.order, self.padded_length, sp.ring_size, sp.ulysses_size, sp.rank)

    def shard(self, full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """A tensor of the whole (padded) batch -> this rank's tokens along ``dim``, in this batch's
        order (what ``ringseq.shard`` is for the group's layout)."""
        sp = self.sp
        return shard_tensor(full, dim, self.order, sp.ring_size, sp.rank, sp.ulysses_size)

    def gather(self, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Token-wise results of this rank (``local``, tokens along ``dim``) -> those of the whole
        batch in global order, the layout's padding cut (differentiable: ``ringseq.gather`` in
        this batch's order)."""
        full = gather(local, dim, sp=self.sp, layout=self.order)
        return full.narrow(dim, 0, self.length)

    def with_head_groups(self, head_groups) -> "ShardedBatch":
        """This batch with the attention layers' ring head groups set (``patch(head_groups=)``)."""
        return self if head_groups == self.head_groups else self.replace(head_groups=head_groups)

    def apart(self, documents_apart: bool) -> "ShardedBatch":
        """This batch for a model that keeps packed documents apart or not (the one place where
        that decides what attention sees; the tokens stay where they are)."""
        doc = self.documents if documents_apart else None
        if doc is self.info.doc:
            return self
        info = TokenInfo(doc=doc, valid=self.info.valid, block=self.info.block, layout=self.info.layout)
        return self.replace(info=info)


def shift(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] labels -> [B, S] targets: token i predicts label i+1; the last predicts nothing."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.size(0), 1), IGNORE)], dim=1)


def pad_to_layout(batch: dict, sp) -> tuple[dict, int]:
    """Append tokens to every row of a full batch until ``sp.layout`` can split its length:
    token id 0 / zero embeddings, attention_mask 0, labels -100, position ids continuing the
    row's last one. Returns (batch, tokens added). Exact for the real tokens: attention is
    causal, so none of them sees a later (appended) token, and no label reads one."""
    tokens = batch.get("input_ids", batch.get("inputs_embeds"))
    S = tokens.size(1)
    pad = -S % multiple(sp.layout, sp.ring_size, sp.ulysses_size)
    if pad == 0:
        return batch, 0
    fill = {"input_ids": 0, "inputs_embeds": 0.0, "attention_mask": 0, "labels": IGNORE, "shift_labels": IGNORE}
    out = dict(batch)
    for key, value in fill.items():
        t = batch.get(key)
        if torch.is_tensor(t):
            out[key] = torch.cat([t, t.new_full((t.size(0), pad, *t.shape[2:]), value)], dim=1)
    if torch.is_tensor(batch.get("position_ids")):
        given = batch["position_ids"]
        pos = given.reshape(-1, S)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
        out["position_ids"] = pos.reshape(*given.shape[:-1], S + pad)
    return out, pad


def text_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The [B, S] positions transformers reads packed documents from. Multimodal rotary
    positions (Qwen VL's mRoPE: [3, B, S] rows of temporal, height and width positions) mark
    no documents, unless a fourth, leading row of text positions comes with them ([4, B, S]),
    which Qwen's VL text models read packing from; None: no documents."""
    if position_ids.dim() < 3:
        return position_ids
    return position_ids[0] if position_ids.size(0) == 4 else None


def full_token_info(position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    blocks: torch.Tensor | None = None) -> TokenInfo:
    """Documents, padding and bidirectional blocks of a full batch, by transformers' rules:
    packed documents are read from position_ids only when there is no attention_mask (as
    transformers does)."""
    doc = valid = None
    text = text_positions(position_ids)
    if attention_mask is None:
        doc = None if text is None else documents(text.long())
        doc = doc if doc is not None and bool(doc.any()) else None
    elif not bool(attention_mask.bool().all()):
        valid = attention_mask.bool()
    if blocks is not None and not bool((blocks >= 0).any()):
        blocks = None
    return TokenInfo(doc=doc, valid=valid, block=None if blocks is None else blocks.int())


def batch_record(batch: dict, contents: bool = True, keys=SEQUENCE_KEYS) -> dict[str, int]:
    """What every rank of a sequence group must share about a full batch (a lockstep record):
    dtype, first two sizes and (``contents``) a checksum of each of ``keys``."""
    fields = {}
    for key in keys:
        t = batch.get(key)
        shape = list(t.shape) if torch.is_tensor(t) else []
        fields[f"{key} dtype"] = dtype_code(t)
        fields.update({f"{key}.shape[{i}]": n for i, n in enumerate((shape + [-1, -1])[:2])})
        fields[f"{key} content"] = checksum(t) if torch.is_tensor(t) and contents else 0
    return fields


SAME_BATCH_HINT = ("every rank of a group must get the same full batch. A stock transformers.Trainer, trl.SFTTrainer "
                   "or Accelerate dataloader shards the data over all processes: use ringseq.Trainer, "
                   "ringseq.SFTTrainer or ringseq.prepare_accelerator, or shard it yourself over data-parallel "
                   "replicas (sp.dp_rank of sp.dp_size)")


def check_same_batch(batch: dict, sp, contents: bool = True, keys=SEQUENCE_KEYS) -> None:
    """Refuse when the ranks of a sequence group were handed different full batches (the usual
    mistake: a dataloader sharded over all ranks instead of over data-parallel replicas), or a
    tensor (labels, a mask) on some ranks only: one all-gather of a fixed-size record."""
    if sp.size == 1:
        return
    lockstep.agree(sp, "batch", batch_record(batch, contents, keys), hint=SAME_BATCH_HINT)


def check_batch(batch: dict) -> None:
    """Shapes and values of a full batch that ringseq reads one way only."""
    tokens = batch.get("input_ids", batch.get("inputs_embeds"))
    if tokens.dim() < 2:
        raise RingSeqError(f"input_ids/inputs_embeds must be [batch, sequence, ...]; got shape {tuple(tokens.shape)} "
                           f"(add a batch dimension: x[None])")
    B, S = tokens.shape[:2]
    if B == 0 or S == 0:
        raise RingSeqError(f"the batch is empty: input_ids/inputs_embeds have shape {tuple(tokens.shape)} (a batch "
                           f"needs at least one sample of at least one token)")
    if "input_ids" in batch and (batch["input_ids"].is_floating_point() or batch["input_ids"].dtype == torch.bool):
        raise RingSeqError(f"input_ids must hold integer token ids, got {batch['input_ids'].dtype}")
    for key in ("labels", "shift_labels"):
        t = batch.get(key)
        if torch.is_tensor(t) and (tuple(t.shape) != (B, S) or t.is_floating_point()):
            raise RingSeqError(f"{key} must be integer token ids of shape [batch, sequence] = [{B}, {S}]; got "
                               f"{t.dtype} {tuple(t.shape)}")
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask):
        if mask.dim() != 2:
            raise RingSeqError(f"attention_mask must be the 2-D [batch, sequence] padding mask (1 = real token); got "
                               f"a {mask.dim()}-D mask of shape {tuple(mask.shape)}. A custom 4-D mask cannot be split "
                               f"over the ring: express packed documents with position_ids restarting at 0")
        if tuple(mask.shape) != (B, S):
            raise RingSeqError(f"attention_mask has shape {tuple(mask.shape)} but the tokens are [{B}, {S}]")
        if bool(((mask != 0) & (mask != 1)).any()):
            raise RingSeqError("attention_mask must hold only 0 (padding) and 1 (real token); got other values (an "
                               "additive mask of 0/-inf, or document ids?): pass (mask == 0).long() for an additive "
                               "mask, and packed documents as position_ids")
    pos = batch.get("position_ids")
    rows = torch.is_tensor(pos) and pos.dim() == 3 and pos.size(1) in (1, B) and pos.size(2) == S
    if torch.is_tensor(pos) and ((pos.numel() not in (S, B * S) and not rows) or pos.is_floating_point()):
        raise RingSeqError(f"position_ids must be integers of shape [{B}, {S}] or [{S}] (or multimodal rotary rows "
                           f"[R, {B}, {S}]); got {pos.dtype} {tuple(pos.shape)}")


def _check_form(batch) -> None:
    """What makes a batch unreadable: not a dict, tensors under keys ringseq does not shard, no tokens."""
    if not isinstance(batch, Mapping):
        raise RingSeqError(f"a batch is a dict of tensors (input_ids, labels, ...), got {type(batch).__name__}: "
                           f"collate the samples first (e.g. with a DataCollator)")
    unknown = [k for k, v in batch.items() if k not in SEQUENCE_KEYS and torch.is_tensor(v)]
    if unknown:
        raise RingSeqError(f"shard_batch does not know how to shard {unknown}; it handles {list(SEQUENCE_KEYS)}")
    if not torch.is_tensor(batch.get("input_ids", batch.get("inputs_embeds"))):
        raise RingSeqError("the batch needs input_ids or inputs_embeds (a tensor)")


def check_vocabulary(batch: dict, vocab: int) -> None:
    """Token ids in [0, vocab) and labels there or -100, else a ``RingSeqError`` naming the first bad
    value and its place (the unpatched model raises torch's IndexError or a cross-entropy error from
    deep inside; here every rank holds the same agreed batch, so every rank raises this alike)."""
    for key, ignore in (("input_ids", None), ("labels", IGNORE), ("shift_labels", IGNORE)):
        t = batch.get(key)
        if not torch.is_tensor(t) or t.numel() == 0:
            continue
        bad = (t < 0) | (t >= vocab)
        if ignore is not None:
            bad &= t != ignore
        if bool(bad.any()):
            place = [int(i) for i in bad.reshape(t.shape).nonzero()[0]]
            allowed = f"[0, {vocab})" + (f" or {ignore} (ignored)" if ignore is not None else "")
            raise RingSeqError(f"{key} holds {int(t[tuple(place)])} at {place} (row, position), outside the model's "
                               f"vocabulary: {key} must be in {allowed}. Check the tokenizer against the model's "
                               f"vocab_size (resize_token_embeddings after adding tokens)")


def shard_batch(batch: dict, *, sp, documents_apart: bool = True, balance: bool = True) -> dict:
    """Full batch (every rank of the sequence group holds the same one) -> this rank's shard.

    Takes ``input_ids`` or ``inputs_embeds`` and optionally ``attention_mask``,
    ``position_ids`` and ``labels`` (or already shifted ``shift_labels``), all [B, S, ...].
    Returns this rank's [B, s, ...] slices of ``input_ids``/``inputs_embeds``,
    ``attention_mask``, ``position_ids`` (global values, 0..S-1 when absent) and ``labels`` —
    **already shifted** on the full sequence (entry i is the target of token i, -100 at the
    very end) — plus ``ringseq``: the documents and padding of the whole batch for the
    attention layers. ``model(**local)`` on a patched model returns this rank's logits (and,
    with the labels, the global loss); ``ringseq.loss.cross_entropy(logits, local["labels"],
    sp=sp)`` computes the same loss by hand. ``documents_apart=False`` lets packed documents
    see each other (a patched model whose unpatched version does that overrides it anyway).
    A length the layout cannot split is padded first (``pad_to_layout``; ``local["ringseq"].pad``
    says by how much): the real tokens' results are exact, and gathered per-token outputs have
    the padded length (the first S are the real tokens). Raises ``RingSeqError`` when the ranks
    of the group were given different batches (checked by one all-gather of a fixed-size record, ``ringseq.lockstep``).

    Under the zigzag layout a batch of packed documents (kept apart) is laid out by work
    (``balance``, default; ``ringseq.balance``): every rank gets about the same attention work,
    as a few contiguous runs of tokens. Its tokens are then not where ``ringseq.shard`` puts
    them: put per-token results in order with ``local["ringseq"].gather(x, dim)``, shard more
    tensors of the batch with ``local["ringseq"].shard(full, dim)``, and give ``ring_attention``
    ``token_info=local["ringseq"].info``, which carries the layout. ``balance=False`` keeps plain
    zigzag.
    """
    local, _ = sharded(batch, sp=sp, documents_apart=documents_apart, balance=balance)
    return local


def sharded(batch, *, sp, documents_apart: bool = True, blocks=None, agreed: bool = False,
            balance: bool = True, vocab: int | None = None) -> tuple[dict, ShardedBatch]:
    """``shard_batch``'s dict and its ``ShardedBatch`` (also ``dict["ringseq"]``). ``blocks``: [B, S]
    bidirectional block ids of the full batch (-1: none; ``ringseq.attention.masks``). ``agreed``:
    the caller has checked that the ranks hold the same inputs this batch was made from (a VLM's
    merged embeddings), so their contents are not compared again, only their shapes. ``balance``:
    lay packed documents out by work (zigzag layout only; ``shard_batch``). ``vocab``: the model's
    vocabulary size; token ids and labels outside it are refused (``check_vocabulary``)."""
    check_sp(sp)
    try:  # this rank's batch has no form to compare: refused in the batch's agreement, every rank raising in step
        _check_form(batch)
    except RingSeqError as err:
        lockstep.refuse(sp, "batch", err)
    tokens = batch.get("input_ids", batch.get("inputs_embeds"))
    check_same_batch(batch, sp, contents=not agreed)  # first: every rank then raises the same errors below, or none
    check_batch(batch)
    if vocab is not None:
        check_vocabulary(batch, vocab)
    B, S = tokens.shape[:2]
    batch = {k: v for k, v in batch.items() if v is not None}
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(S, device=tokens.device)
    pos = batch["position_ids"]
    batch["position_ids"] = pos.expand(-1, B, S) if pos.dim() == 3 else pos.reshape(-1, S).expand(B, S)
    raw = batch.get("labels")
    if "shift_labels" not in batch and raw is not None:  # shift on the full, unpadded sequence
        batch["shift_labels"] = shift(batch.pop("labels"))
    batch.pop("labels", None)
    targets = batch.get("shift_labels")
    batch, pad = pad_to_layout(batch, sp)
    if blocks is not None:
        blocks = torch.nn.functional.pad(blocks.reshape(-1, S).expand(B, S), (0, pad), value=-1)
    info = full_token_info(batch["position_ids"], batch.get("attention_mask"), blocks)
    if balance and sp.layout == "zigzag" and documents_apart:
        layout = balanced(info, S + pad, sp.ring_size)
        if layout != "zigzag":
            info = TokenInfo(doc=info.doc, valid=info.valid, block=info.block, layout=layout)
    where = ShardedBatch(sp=sp, length=S, pad=pad, info=info)
    local = {"position_ids": where.shard(batch["position_ids"], -1)}
    for key in ("input_ids", "inputs_embeds", "attention_mask"):
        if key in batch:
            local[key] = where.shard(batch[key], 1)
    if targets is not None:
        local["labels"] = where.shard(batch["shift_labels"], 1)
    facts = where.replace(
        documents=info.doc,
        count=None if targets is None else (targets != IGNORE).sum(),  # the whole batch is here: no communication
        labels=local.get("labels"), attention_mask=local.get("attention_mask"),
        raw_labels=None if raw is None else where.shard(torch.nn.functional.pad(raw, (0, pad), value=IGNORE), 1))
    facts = facts.apart(documents_apart)
    _count_work(facts)
    local["ringseq"] = facts
    return local, facts


def _count_work(facts: ShardedBatch) -> None:
    """Add the batch's visible pairs per ring rank to the group's tally (``ringseq.stats``; a few
    passes over the batch's S integers per sample: about 25 ms at a million tokens, none with
    ``RINGSEQ_STATS=0``)."""
    sp = facts.sp
    if not getattr(sp, "stats", True):
        return
    pairs = per_rank(facts.info, facts.order, facts.padded_length, sp.ring_size)
    st = lockstep.state(sp)
    st.work = pairs if st.work is None else [a + b for a, b in zip(st.work, pairs)]
