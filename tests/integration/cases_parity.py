"""Patched models against the unpatched model: every family, autocast, PEFT, unpatch, refusals."""
import copy

import torch
import torch.distributed as dist

import ringseq
from ringseq import tolerance
from ringseq.testing import assert_close, assert_named_close, shared_init

from .hf_models import EAGER, check_against, loss_and_grads, make_batch, references, tiny_config, tiny_model


def parity(family, layout, kind="plain", S_per_rank=16, short=0, ulysses=1, sp=None):
    """Patched fp32 loss and SP-averaged gradients against the unpatched model (float64 loss from
    its logits, so the reference is not capped at fp32 by transformers' upcast). ``short``
    tokens fewer than the layout can split: the patched model pads the batch itself. ``ulysses``:
    a Ulysses x ring group; ``sp``: a topology of the caller's instead."""
    world = dist.get_world_size()
    sp = sp or shared_init(sp_size=world, layout=layout, ulysses_size=ulysses)
    # A pad query with no visible key (left padding, or a window over pads only) becomes nan in
    # transformers' eager path in float64 (its fp32 softmax of finfo(float64).min), so eager
    # families' float64 reference is taken on short right pads, where every query sees a key.
    batch = make_batch(2, S_per_rank * world - short, kind, left_pad=family not in EAGER)
    base, refs = references(family, batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    loss, grads = loss_and_grads(model, batch)
    check_against(refs, loss, grads, sp, f"{family} {layout} {kind} short {short} rank {sp.rank}/{world}")
    ringseq.unpatch(model)


def autocast_parity(family, dtype_name, kind="plain", S_per_rank=16):
    """fp32 weights under torch.autocast: the patched model computes what the unpatched model
    computes under the same autocast, against the float64 model without autocast. Logits and
    gradients by the 2x rule. The loss is one number whose half-precision error is a sum of
    many roundings of either sign, so the plain run's realised error is a poor yardstick for it
    (a ratio of two such errors exceeds 2 about a third of the time): it is held to twice the
    plain run's mean absolute per-token loss error, which bounds the plain mean's error."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    batch = make_batch(2, S_per_rank * world, kind, left_pad=family not in EAGER)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    exact = tiny_model(family, torch.float64)
    ref_loss, ref_grads = loss_and_grads(exact, batch, manual_loss=True)
    with torch.no_grad():
        ref_logits = exact(**inputs).logits
    base = tiny_model(family, torch.float32)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    with torch.autocast("cpu", dtype=dtype):
        plain_loss, plain_grads = loss_and_grads(base, batch)
        loss, grads = loss_and_grads(model, batch)
        with torch.no_grad():
            plain_logits = base(**inputs).logits
            logits = ringseq.gather(model(**inputs).logits, 1, sp=sp)
    where = f"{family} autocast {dtype_name} {kind} rank {sp.rank}/{world}"
    assert_close(logits, plain_logits, ref_logits, f"{where}: logits")
    for g in grads.values():
        dist.all_reduce(g, group=sp.group)
        g /= sp.size
    assert_named_close(grads, plain_grads, ref_grads, f"{where}: gradients")
    tokens = [tolerance.token_losses(x, batch["labels"]) for x in (plain_logits, ref_logits)]
    verdict = tolerance.mean_within(loss, *tokens, ref_loss, f"{where}: loss")
    assert verdict.ok, str(verdict)


def _with_lora(model):
    """A LoRA adapter on q/v whose B matrices are non-zero too (PEFT starts them at zero, which
    would leave A without gradient), the same on every copy."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0, init_lora_weights="gaussian"))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)
    return model


def peft_in_either_order(order):
    """PEFT adapters on a patched model and a patch on a PEFT model: the adapters' gradients
    against the unpatched PEFT model (fp32 and float64)."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, 16 * world, "packed")
    ref_loss, ref_grads = loss_and_grads(_with_lora(tiny_model("llama", torch.float64)), batch, manual_loss=True)
    plain_loss, plain_grads = loss_and_grads(_with_lora(tiny_model("llama")), batch)
    if order == "patch_then_peft":
        model = _with_lora(ringseq.patch(tiny_model("llama"), sp=sp))
    else:
        model = ringseq.patch(_with_lora(tiny_model("llama")), sp=sp)
    loss, grads = loss_and_grads(model, batch)
    assert grads.keys() == plain_grads.keys() and all("lora_" in n for n in grads), sorted(grads)
    check_against((plain_loss, plain_grads, ref_loss, ref_grads), loss, grads, sp,
                  f"PEFT {order} rank {sp.rank}/{world}")


def unpatch_restores():
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._attn_implementation
    batch = make_batch(2, 8 * world, "plain")
    ref = model(**batch).loss.item()
    ringseq.patch(model, sp=sp)
    assert ringseq.patch(model, sp=sp) is model  # patching twice is harmless
    assert model.config._attn_implementation == "ringseq" and "forward" in vars(model)
    patched = model(**batch).loss.item()
    assert abs(patched - ref) <= 1e-5 * abs(ref)  # the same loss (parity checks it by the 2x rule)
    ringseq.unpatch(model)
    assert "forward" not in vars(model) and not hasattr(model, "_ringseq_patch")
    assert model.config._attn_implementation == impl
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model(**batch).loss.item() == ref
    ringseq.unpatch(model)  # a model that is not patched: no-op
    # memory features: tiled MLPs, checkpointing enabled after patching (its functions wrapped), offload
    model.train()
    ringseq.patch(model, sp=sp, tiled_mlp=2)
    model.gradient_checkpointing_enable()
    funcs = {name: vars(m)["_gradient_checkpointing_func"] for name, m in model.named_modules()
             if "_gradient_checkpointing_func" in vars(m)}
    model(**batch).loss.backward()
    assert all(getattr(vars(m).get("_gradient_checkpointing_func"), "keeps_ring", False)
               for name, m in model.named_modules() if name in funcs)
    ringseq.unpatch(model)
    assert not any("forward" in vars(m) or "_ringseq_tiles" in vars(m) for m in model.modules())
    assert "activation_checkpointing_enable" not in vars(model)
    assert all(vars(m)["_gradient_checkpointing_func"] is funcs[name] for name, m in model.named_modules()
               if name in funcs)


def refuses_unsupported_models():
    import pytest
    import transformers as tf

    sp = shared_init(sp_size=dist.get_world_size())
    dyn = tiny_config("llama")
    dyn.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    cases = [
        (tf.LlamaForCausalLM(dyn), r"rope scaling \['dynamic'\]"),
        (tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                                   d_kv=8)), "encoder-decoder"),
        (tf.MambaForCausalLM(tf.MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1)),
         r"sequence-mixing layers ringseq cannot shard \(.*MambaMixer"),
        (tf.LlamaModel(tiny_config("llama")), "no language-model head"),
    ]
    for model, match in cases:
        with pytest.raises(ringseq.RingSeqError, match=match):
            ringseq.patch(model, sp=sp)
        assert not hasattr(model, "_ringseq_patch")
    model = ringseq.patch(tiny_model("llama"), sp=sp)
    model.train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ringseq.RingSeqError, match="attention dropout"):
        model(**make_batch(1, 8 * sp.size, "plain"))
