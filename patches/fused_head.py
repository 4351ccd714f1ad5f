"""TRL's fused LM head under sequence parallelism (shapes: ``ringseq.shapes``).

TRL (>= 1.13) wraps a model's forward so that ``model(..., labels=..., fused_lm_head=True)``
returns per-token log-probabilities (and entropy, top-1 hits) computed in tiles from the final
hidden states, never the [B, S, V] logits; its trainers compute the loss and their logged
metrics from those per-token fields. That wrapper calls the decoder directly, so the ring
never sees its batch. Under ringseq the patched forward answers ``fused_lm_head=True`` itself:
the decoder runs on this rank's shard, TRL's own kernel (``trl.kernels.ChunkedLogProbFunction``)
scores this rank's tokens, and the per-token fields are all-gathered into global token order
(S numbers per sample, differentiably: ``ringseq.gather``'s backward keeps this rank's slice).
Every rank then holds exactly what the unsplit model would have returned, so TRL's loss
(a sum over the fields) is the global loss, its gradient is P times this rank's share (the
gradient rule, through ``ringseq.gather``) and its metrics are the one-process metrics.

TRL's GRPO installs its head with a sampling temperature (the logits are divided by it) and
optionally an fp32 projection (``cast_lm_head_to_fp32``); the trainer that patches the model
states them with ``configure`` (kept on the patch handle), since the patched forward replaces TRL's.
"""
from __future__ import annotations

import contextlib

import torch

from ringseq.errors import RingSeqError
from ringseq.loss import IGNORE

from .logits import SCALINGS

FIELDS = ("log_probs", "entropy", "is_top1")  # what TRL's SFTTrainer asks its fused head for
VOCAB_TILE = 32768  # vocabulary columns per tile of TRL's kernel (TRL's own default)
def _check_head(config) -> None:
    scaled = [name for name in SCALINGS if getattr(config, name, None) not in (None, 1, 1.0)]
    if scaled:
        raise RingSeqError(f"the fused LM head under ringseq does not apply logit scaling ({', '.join(scaled)}); "
                           f"train this model with ringseq.Trainer, whose loss reads the model's own logits")


def configure(model, *, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False):
    """The options of TRL's ``add_fused_lm_head`` for a patched model's fused head: the
    temperature the logits are divided by, and whether the projection runs in fp32 outside
    autocast. Returns the model."""
    handle = getattr(model, "_ringseq_patch", None)
    if handle is None:
        raise RingSeqError("fused_head.configure takes a model ringseq.patch patched")
    if not temperature > 0:
        raise RingSeqError(f"the fused head's temperature must be positive, got {temperature}")
    handle.fused_head = {"temperature": float(temperature), "cast_lm_head_to_fp32": bool(cast_lm_head_to_fp32)}
    return model


def _global(local: torch.Tensor, batch, drop_last: bool) -> torch.Tensor:
    """[B, s] per-token field of this rank -> [B, S] in global order (S - 1 tokens when the
    labels were unshifted, as TRL returns them)."""
    full = batch.gather(local)
    return full[:, : full.size(1) - 1] if drop_last else full


def _head_tensors(head):
    """The head's weight and bias as the kernel reads them. Under FSDP2 a head that is (in) a group of
    its own (Accelerate shards ``lm_head`` apart from the root) stays sharded until its forward runs,
    which the fused head never calls: it is unsharded here, and FSDP2 reduces its gradient and
    reshards it at the end of the backward, as for a group its forward left unsharded."""
    if hasattr(head.weight, "full_tensor") and hasattr(head, "unshard"):
        head.unshard()
    if hasattr(head.weight, "full_tensor"):
        raise RingSeqError("the LM head's weight is still sharded by FSDP2 where TRL's fused head reads it: shard the "
                           "head in a group of its own (fully_shard(lm_head)) or with the root")
    return head.weight, head.bias


def fused_outputs(model, batch, hidden: torch.Tensor, *, drop_last: bool, num_items_in_batch=None, aux_loss=None):
    """TRL's ``FusedCausalLMOutput`` of the whole sequence from this rank's final hidden states
    [B, s, d] and the batch's shifted targets (``ShardedBatch.labels``)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

    targets = batch.labels
    if targets is None:
        raise RingSeqError("fused_lm_head=True needs labels (or shift_labels)")
    config = model.config.get_text_config()
    _check_head(config)
    weight, bias = _head_tensors(model.get_output_embeddings())
    mask = targets != IGNORE
    options = model._ringseq_patch.fused_head
    hidden = hidden.reshape(-1, hidden.size(-1))
    precision = contextlib.nullcontext()
    if options["cast_lm_head_to_fp32"]:  # as TRL's head: fp32 activations, autocast off (weights cast by TRL)
        hidden, precision = hidden.float(), torch.autocast(hidden.device.type, enabled=False)
    with precision, maybe_gather_lm_head_ctx(weight, bias):
        log_probs, entropy, _, _, is_top1 = ChunkedLogProbFunction.apply(
            hidden, weight, bias, targets.clamp(min=0).reshape(-1), options["temperature"], VOCAB_TILE,
            getattr(config, "final_logit_softcapping", None), 1.0, FIELDS)
    log_probs, entropy = (x.view(mask.shape).masked_fill(~mask, 0) for x in (log_probs, entropy))
    is_top1 = is_top1.view(mask.shape) & mask
    log_probs, entropy = (_global(x, batch, drop_last) for x in (log_probs, entropy))
    is_top1, label_mask = (_global(x.to(torch.uint8), batch, drop_last).bool() for x in (is_top1, mask))
    # TRL's own fused head divides by at least one token
    count = batch.count.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    out = FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, is_top1=is_top1,
                              label_mask=label_mask)
    if aux_loss is not None:  # the MoE router loss of the whole batch (``patches.router_loss``), as TRL's head adds it
        out["aux_loss"] = aux_loss.float()
        out["loss"] = out.loss + getattr(config, "router_aux_loss_coef", 0.0) * out.aux_loss
    return out
