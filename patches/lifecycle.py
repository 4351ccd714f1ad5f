"""``ringseq.patch`` / ``ringseq.unpatch``: one reversible change to a transformers causal LM.

What is patched, and why: the model's attention implementation becomes "ringseq"
(``set_attn_implementation``, through the registry), and the model instance gets its own
``forward`` (an instance attribute; the class is untouched): ``patches.forward``, which shards
the full batch and runs the model's own decoder on this rank's shard, and its own ``generate``
(``patches.generation``: the prompt prefilled through the ring, the KV cache kept sharded).
``unpatch`` deletes the instance attributes and restores the previous attention
implementation, leaving the model exactly as it was. A patched model can be deep-copied (an
EMA or a reference model): the copy is patched over the same sequence group.
"""
from __future__ import annotations

import copy
import dataclasses
import types

import torch

from ringseq import engines, recovery
from ringseq.errors import RingSeqError
from ringseq.topology import check_sp

from . import checkpointing, checks, fit as fitting, mixers, router_loss, tiled_mlp as tiling, vision
from .documents import isolates_documents
from .forward import forward as _forward
from .generation import generate as _generate
from .vision import transformers_model as _transformers_model
from .registry import NAME, register


@dataclasses.dataclass(kw_only=True, eq=False)
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
    head_groups: object = None
    """Ring head groups of every attention call (``ring_attention``'s ``head_groups``; None: one ring)."""
    mixer_modules: list = dataclasses.field(default_factory=list)
    """The modeling modules whose recurrent kernels route through ringseq for this model (``patches.mixers``)."""
    recurrent: bool = False
    """Whether the model has recurrent layers (they read the padding mask from the decoder's inputs)."""
    router_loss: object = None
    """The MoE auxiliary loss the unpatched model adds (``patches.router_loss``), or None."""
    previous_generate: object = None
    """An instance-level generate that was there before, restored by ``unpatch``."""
    fused_head: dict = dataclasses.field(
        default_factory=lambda: {"temperature": 1.0, "cast_lm_head_to_fp32": False})
    """Options of TRL's fused LM head that the patched forward answers (``patches.fused_head.configure``)."""
    fit: object = None
    """``patches.fit.Fit`` when the planner sets the memory switches (``patch(fit=True)``), else None."""
    zero_stage: int = 0
    """DeepSpeed's ZeRO stage the model trains under (set by ``ringseq.initialize``): what fit costs."""
    sharding: object = None
    """The FSDP engine's sharding found at a training forward (``ringseq.engines.Sharding``): what fit costs
    instead (FSDP2 as ZeRO-3 over its shard dimension)."""
    vision: object = None
    """A vision-language model's plan (``patches.vision.VisionPlan``: the text sub-config whose attention is
    ringseq's, whether the images are shared among the ranks); None for a text model."""

    def __deepcopy__(self, memo):
        # the sequence group (process groups) is shared, never copied: a copied model trains on the same ranks
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        twin = PatchHandle(**{k: v if k == "sp" else copy.deepcopy(v, memo) for k, v in fields.items()})
        mixers.adopt(twin)
        return twin


def patch(model, *, sp, chunked_loss: bool = True, tiled_mlp=None, keep_ring_outputs: bool = True,
          split_vision: bool = False, head_groups=None, fit: bool = False, memory_budget=None):
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
    q-sized tensor per layer less; the recompute replays the ring). ``head_groups`` (a memory
    switch; None: one ring for all heads, the fastest) runs each attention layer's ring once per
    group of kv heads, one group after the other: an int dividing the kv heads the ring holds, or
    "kv" for one ring per kv head; the ring backward then holds one group's buffers at a time, for
    as many times the transfers and kernel launches (``ring_attention``). Hybrid models' recurrent
    layers (gated DeltaNet, KDA, Mamba2, short convolutions) run on this rank's tokens from the
    states their runs enter with (``patches.mixers``), and an MoE model's router loss is that of
    the whole sequence (``patches.router_loss``). Patching twice only updates
    ``sp`` and the options (and puts the patched forward back if something replaced it since).
    Raises ``RingSeqError`` listing every feature of the model that ringseq cannot
    reproduce. A forward set on the instance before (TRL's fused LM head) is replaced, since the
    patched forward answers ``fused_lm_head=True`` itself, and comes back with ``unpatch``.
    A vision-language model (``*ForConditionalGeneration``: Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3,
    LLaVA) runs its vision tower, the merge of image features and its (3-D) positions on the full
    batch and its language model on the ring (``patches.vision``); ``split_vision=True`` has each
    rank encode a share of the images, all-gathered before the merge.
    ``fit=True`` has the planner choose the memory switches (the chunked loss, checkpointing that
    keeps or replays the ring, tiled MLPs, head groups, offload on a GPU) before each training
    step of a new length: the fastest set whose predicted step memory fits ``memory_budget`` bytes
    per rank (None: the device's free memory at the first step less a margin; ``patches.fit``).
    """
    check_sp(sp)
    tiling.check(tiled_mlp)
    _check_head_groups(head_groups)
    if not isinstance(model, torch.nn.Module):
        raise RingSeqError(f"ringseq.patch takes a transformers model object, got {type(model).__name__}: load it "
                           f"with AutoModelForCausalLM.from_pretrained (or from_config) first")
    handle = getattr(model, "_ringseq_patch", None)
    if sp.layout == "striped" and mixers.has_recurrent_layers(model):
        raise RingSeqError("recurrent layers (linear attention, state-space, short convolutions) run a sequence in "
                           "order: the striped layout gives every rank every P-th token, so no rank holds a run of "
                           "them. Use layout='zigzag' (default) or 'contiguous'")
    if fit:
        fitting.check(model, chunked_loss, tiled_mlp, keep_ring_outputs, head_groups, memory_budget, split_vision)
    elif memory_budget is not None:
        raise RingSeqError("memory_budget is the budget fit plans for: pass fit=True with it (or drop it)")
    plan = vision.plan(model, split_vision)
    if handle is not None:
        if handle.fit is not None and not (fit and handle.fit.memory_budget == memory_budget):
            fitting.remove(model, handle)
        handle.sp, handle.chunked_loss, handle.keep_ring_outputs = sp, chunked_loss, bool(keep_ring_outputs)
        handle.head_groups = head_groups
        handle.vision = plan
        if tiled_mlp != handle.tiled_mlp:
            tiling.uninstall(model)
            if tiled_mlp is not None:
                tiling.install(model, tiled_mlp)
            handle.tiled_mlp = tiled_mlp
        if getattr(vars(model).get("forward"), "__func__", None) is not _forward:
            model.forward = types.MethodType(_forward, model)
        if getattr(vars(model).get("generate"), "__func__", None) is not _generate:
            model.generate = types.MethodType(_generate, model)
        if fit and handle.fit is None:
            fitting.install(model, handle, memory_budget)
        return model
    checks.check(model)
    if tiled_mlp is not None:
        tiling.mlps(model)  # refuses MLPs it cannot tile before anything changes
    base = _transformers_model(model)
    router = router_loss.plan(base)  # refuses a router loss it cannot split before anything changes
    register()
    handle = PatchHandle(sp=sp, previous_attn_implementation=vision.text_config(model)._attn_implementation,
                         chunked_loss=chunked_loss, previous_forward=vars(model).get("forward"),
                         previous_generate=vars(model).get("generate"),
                         keep_ring_outputs=bool(keep_ring_outputs), recurrent=mixers.has_recurrent_layers(model),
                         router_loss=router, vision=plan, head_groups=head_groups)
    vision.set_attention(model, NAME)
    try:
        handle.documents_apart = isolates_documents(model)
    except BaseException:
        vision.set_attention(model, handle.previous_attn_implementation)
        raise
    model._ringseq_patch = handle
    model.forward = types.MethodType(_forward, model)
    model.generate = types.MethodType(_generate, model)
    recovery.watch_backward()  # a backward pass that fails in a patched step recovers it on every rank
    mixers.install(model, handle)
    if tiled_mlp is not None:
        tiling.install(model, tiled_mlp)
        handle.tiled_mlp = tiled_mlp
    checkpointing.watch_offload(_transformers_model(model), handle)
    if fit:
        fitting.install(model, handle, memory_budget)
    return model


def _check_head_groups(head_groups) -> None:
    """None, "kv" or a positive int (whether it divides the kv heads the ring holds is checked at the
    first attention call, where the heads and any Ulysses split are known)."""
    if head_groups is None or head_groups == "kv":
        return
    if isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1:
        raise RingSeqError(f"head_groups must be None (one ring for all heads), a positive int dividing the kv heads "
                           f"the ring holds, or \"kv\" (one ring per kv head); got {head_groups!r}")


def options(model) -> dict:
    """The ``patch`` options a model was patched with ({} if it is not patched): what ringseq's
    Trainer, SFTTrainer and ``initialize`` pass on when they (re)patch a model the user patched."""
    handle = getattr(model, "_ringseq_patch", None)
    if handle is None:
        return {}
    if handle.fit is not None:  # fit chooses the switches; the Trainers' re-patching keeps it and its budget
        return {"fit": True, "memory_budget": handle.fit.memory_budget}
    chosen = {"chunked_loss": handle.chunked_loss, "tiled_mlp": handle.tiled_mlp,
              "keep_ring_outputs": handle.keep_ring_outputs, "head_groups": handle.head_groups}
    if handle.vision is not None:  # a VLM keeps its vision split through the Trainers' re-patching
        chosen["split_vision"] = handle.vision.split
    return chosen


def unpatch(model):
    """Restore a patched model exactly (no-op for a model that is not patched)."""
    handle = getattr(model, "_ringseq_patch", None)
    if handle is None:
        return model
    vision.set_attention(model, handle.previous_attn_implementation)
    if handle.fit is not None:
        fitting.remove(model, handle)
    mixers.uninstall(handle)
    tiling.uninstall(model)
    checkpointing.unwrap(_transformers_model(model))
    checkpointing.unwrap(model)
    engines.ungate(model)
    if handle.previous_forward is None:
        del model.forward
    else:
        model.forward = handle.previous_forward
    if handle.previous_generate is None:
        vars(model).pop("generate", None)
    else:
        model.generate = handle.previous_generate
    del model._ringseq_patch
    return model
