"""Tiny random-init models of every tested family, and the parity check run on every rank."""
import copy
import inspect

import torch
import torch.distributed as dist

import ringseq
from ringseq.testing import assert_close, assert_model_close, assert_named_close, rounding, shared_init

VOCAB = 96


def tiny_config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  attention_dropout=0.0)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mistral":  # window on every layer, shorter than a shard
        return tf.MistralConfig(**common, sliding_window=6)
    if family == "qwen2":
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                              layer_types=["full_attention", "sliding_attention"])
    if family == "qwen3":  # head_dim independent of hidden_size / heads
        return tf.Qwen3Config(**common, head_dim=24, layer_types=["sliding_attention", "full_attention"],
                              use_sliding_window=True, sliding_window=7)
    if family == "gemma2":  # softcaps, alternating window, query_pre_attn_scalar
        return tf.Gemma2Config(**common, head_dim=16, sliding_window=6, attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0, query_pre_attn_scalar=20)
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
                                   layer_types=["sliding_attention", "full_attention"])
    if family == "phi3":
        return tf.Phi3Config(**common, pad_token_id=0)
    if family == "gpt_oss":  # sinks, alternating window, mixture of experts
        return tf.GptOssConfig(**common, head_dim=16, sliding_window=6, num_local_experts=4,
                               num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt_oss")
# transformers' sdpa path drops softcap and sinks, so these families' reference is eager
EAGER = ("gemma2", "gpt_oss")


def tiny_model(family: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(family)
    config._attn_implementation = "eager" if family in EAGER else "sdpa"
    # training configuration: with a cache, transformers ignores packed position ids entirely
    config.use_cache = False
    if family == "gpt_oss":
        config._experts_implementation = "eager"  # the grouped-mm experts kernel has no float64
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # sinks start at zero in gpt-oss; make them matter
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_()
    return model


def make_batch(B, S, kind, seed=0, left_pad=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, S), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "packed":  # documents of random lengths, position ids restarting at 0
        pos = []
        for _ in range(B):
            row = []
            while len(row) < S:
                row.extend(range(int(torch.randint(3, S // 2, (1,), generator=g))))
            pos.append(row[:S])
        batch["position_ids"] = torch.tensor(pos)
    if kind == "padded":  # sample 0 left-padded, sample 1 right-padded
        mask = torch.ones(B, S, dtype=torch.long)
        if left_pad:
            mask[0, : S // 3] = 0
            mask[1, S - S // 4:] = 0
        else:  # right pads shorter than the tiny configs' windows: every query sees some key
            mask[:, S - 4:] = 0
        batch["attention_mask"] = mask
        # A padding query sees no key; implementations disagree on its output (sdpa: zeros,
        # eager: uniform over masked keys), so no loss may read it: ignore every label that a
        # padding position predicts (the first real token after a left pad) and the pads' own.
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
        batch["labels"] = labels
    return batch


def loss_and_grads(model, batch, manual_loss=False):
    """Loss and gradients; ``manual_loss`` computes the mean token loss from the logits in their
    own dtype (transformers' loss upcasts with .float(), which would cap an fp64 check at fp32)."""
    model.zero_grad(set_to_none=True)
    if manual_loss:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits
        targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], 1)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    else:
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def references(family, batch):
    """(the unpatched fp32 model, its loss and gradients, the float64 model's loss and gradients)."""
    ref_loss, ref_grads = loss_and_grads(tiny_model(family, torch.float64), batch, manual_loss=True)
    base = tiny_model(family, torch.float32)
    plain_loss, plain_grads = loss_and_grads(base, batch)
    return base, (plain_loss, plain_grads, ref_loss, ref_grads)


def check_against(refs, loss, grads, sp, where):
    """The patched model's loss and gradients (summed here over the sequence group: ringseq's
    gradient rule) against the unpatched fp32 and float64 runs, by the 2x rule
    (``ringseq.testing.assert_model_close``). Families whose modules compute in fp32 internally
    (Gemma norms, eager softmax) thereby get the tolerance their own arithmetic allows."""
    for g in grads.values():
        dist.all_reduce(g, group=sp.group)
    assert_model_close(loss, grads, *refs, where)


def parity(family, layout, kind="plain", S_per_rank=16, short=0):
    """Patched fp32 loss and SP-summed gradients against the unpatched model (float64 loss from
    its logits, so the reference is not capped at fp32 by transformers' upcast). ``short``
    tokens fewer than the layout can split: the patched model pads the batch itself."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, layout=layout)
    # A pad query with no visible key (left padding, or a window over pads only) becomes nan in
    # transformers' eager path in float64 (its fp32 softmax of finfo(float64).min), so eager
    # families' float64 reference is taken on short right pads, where every query sees a key.
    batch = make_batch(2, S_per_rank * world - short, kind, left_pad=family not in EAGER)
    base, refs = references(family, batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    loss, grads = loss_and_grads(model, batch)
    check_against(refs, loss, grads, sp, f"{family} {layout} {kind} short {short} rank {sp.rank}/{world}")
    ringseq.unpatch(model)


def token_losses(logits, batch):
    """Per-token losses (in at least fp32) of the tokens with a target, from full logits."""
    targets = batch["labels"][:, 1:]
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float() if logits.dtype != torch.float64
                                               else logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
    return losses[targets.flatten() != -100]


def autocast_parity(family, dtype_name, kind="plain"):
    """fp32 weights under torch.autocast: the patched model computes what the unpatched model
    computes under the same autocast, against the float64 model without autocast. Logits and
    gradients by the 2x rule. The loss is one number whose half-precision error is a sum of
    many roundings of either sign, so the plain run's realised error is a poor yardstick for it
    (a ratio of two such errors exceeds 2 about a third of the time): it is held to twice the
    plain run's mean absolute per-token loss error, which bounds the plain mean's error."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    batch = make_batch(2, 16 * world, kind, left_pad=family not in EAGER)
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
    assert_named_close(grads, plain_grads, ref_grads, f"{where}: gradients")
    per_token = (token_losses(plain_logits, batch).double() - token_losses(ref_logits, batch)).abs().mean().item()
    err = abs(loss.item() - ref_loss.item())
    assert err <= 2 * per_token + 2 * rounding(ref_loss, torch.float32), \
        f"{where}: loss off by {err:.2e} > 2 x the plain run's mean per-token loss error {per_token:.2e}"


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
         r"sequence-mixing layers other than attention \(.*MambaMixer"),
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


class RingCounter:
    """Counts the ring's point-to-point posts and its ring forwards while active."""

    def __init__(self):
        from ringseq.attention import comm, ring

        self.posts = self.forwards = 0
        self._patches = [(comm.RingComm, "post"), (ring, "ring_forward")]

    def __enter__(self):
        from ringseq.attention import comm, ring

        post, forward = comm.RingComm.post, ring.ring_forward

        def counted_post(*a, **k):
            self.posts += 1
            return post(*a, **k)

        def counted_forward(*a, **k):
            self.forwards += 1
            return forward(*a, **k)

        self._saved = (post, forward)
        comm.RingComm.post, ring.ring_forward = counted_post, counted_forward
        return self

    def __exit__(self, *exc):
        from ringseq.attention import comm, ring

        comm.RingComm.post, ring.ring_forward = self._saved


def backward_counts(model, batch):
    """(loss, grads, ring posts made by the backward, ring forwards run by the backward)."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    with RingCounter() as counter:
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter.posts, counter.forwards


def gradient_checkpointing(family, tiled_mlp=None, reentrant=False, offload=False, enable_first=True, keep=True):
    """A checkpointed patched model against the unpatched, non-checkpointed model; its backward
    makes exactly the ring posts of the non-checkpointed patched model's backward (the recompute
    replays no ring) and runs no ring forward. ``enable_first``: checkpointing enabled before
    patching (else after, as the Trainer does). ``keep=False`` (patch's keep_ring_outputs):
    the recompute replays every layer's ring forward instead, and stays exact."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, 16 * world, "plain")
    base, refs = references(family, batch)
    plain = ringseq.patch(copy.deepcopy(base), sp=sp, tiled_mlp=tiled_mlp)
    _, _, plain_posts, plain_forwards = backward_counts(plain, batch)
    model = copy.deepcopy(base)
    model.train()
    enable_fn = getattr(type(model), "activation_checkpointing_enable", None)
    offload = offload and enable_fn is not None and "offload" in inspect.signature(enable_fn).parameters
    extra = {"offload": True} if offload else {}  # older transformers 5.x have no offload option

    def enable():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant}, **extra)

    if enable_first:
        enable()
    ringseq.patch(model, sp=sp, tiled_mlp=tiled_mlp, keep_ring_outputs=keep)
    if not enable_first:
        enable()
    assert model._ringseq_patch.offload == offload
    loss, grads, posts, forwards = backward_counts(model, batch)
    where = f"{family} checkpointed tiled_mlp={tiled_mlp} reentrant={reentrant} rank {sp.rank}/{world}"
    layers = model.config.num_hidden_layers
    replayed = (world - 1) * layers if keep is False else 0  # a causal ring forward posts P-1 times
    assert (posts, forwards, plain_forwards) == (plain_posts + replayed, 0 if keep else layers, 0), \
        (where, posts, plain_posts, forwards)
    assert world == 1 or posts > 0, where
    check_against(refs, loss, grads, sp, where)


def tiled_mlp_refusals():
    """Mixture-of-experts MLPs and bad tile counts are refused before anything changes."""
    import pytest

    sp = shared_init(sp_size=dist.get_world_size())
    moe = tiny_model("gpt_oss")
    with pytest.raises(ringseq.RingSeqError, match="tiled_mlp tiles dense MLPs"):
        ringseq.patch(moe, sp=sp, tiled_mlp=2)
    assert not hasattr(moe, "_ringseq_patch") and "forward" not in vars(moe.model.layers[0].mlp)
    for bad in (0, -1, 2.5, False, "4"):
        with pytest.raises(ringseq.RingSeqError, match="tiled_mlp must be"):
            ringseq.patch(tiny_model("llama"), sp=sp, tiled_mlp=bad)
    model = ringseq.patch(tiny_model("llama"), sp=sp, tiled_mlp=4)
    assert all("forward" in vars(layer.mlp) for layer in model.model.layers)
    ringseq.patch(model, sp=sp, tiled_mlp=None)  # re-patching changes the option
    assert not any("forward" in vars(layer.mlp) for layer in model.model.layers)


def manual_path():
    """shard_batch + patched model on local inputs + loss.cross_entropy == unpatched loss."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, 16 * world, "packed")
    base, refs = references("llama", batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    local = ringseq.shard_batch(batch, sp=sp)
    labels = local.pop("labels")
    model.zero_grad(set_to_none=True)
    logits = model(**local).logits
    assert logits.shape == (2, 16, VOCAB)
    loss = ringseq.loss.cross_entropy(logits, labels, sp=sp)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    check_against(refs, loss.detach(), grads, sp, f"manual path rank {sp.rank}/{world}")
    # the labels came back shifted on the full sequence, then sharded
    shifted = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), -100)], 1)
    assert torch.equal(labels, ringseq.shard(shifted, 1, sp=sp))
    # the whole shard_batch output, labels included, straight into the patched model; 16 * world - 3
    # tokens: shard_batch pads them to a length the layout splits
    for kind in ("packed", "padded"):
        batch = make_batch(2, 16 * world - 3, kind)
        _, refs = references("llama", batch)
        loss, grads = loss_and_grads(model, ringseq.shard_batch(batch, sp=sp))
        check_against(refs, loss, grads, sp, f"shard_batch {kind} rank {sp.rank}/{world}")


def chunked_loss_is_exact():
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(8, 11, bias=False).double()
    hidden = torch.randn(2, 13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 13), generator=g)
    labels[0, :5] = -100
    count = (labels != -100).sum()
    dist.all_reduce(count, group=sp.group)
    whole = ringseq.loss.cross_entropy(head(hidden), labels, sp=sp)
    gh, gw = torch.autograd.grad(whole, (hidden, head.weight))
    for chunk in (1, 5, 26, 100):
        part = ringseq.loss.chunked_cross_entropy(hidden, labels, head, sp=sp, count=count, chunk=chunk)
        ch, cw = torch.autograd.grad(part, (hidden, head.weight))
        # float64 throughout: slab sums reordered, so equal to a few float64 roundings
        assert torch.allclose(part, whole, rtol=1e-14) and torch.allclose(ch, gh) and torch.allclose(cw, gw)


def different_batches_are_refused():
    """A patched model (and shard_batch) handed a different full batch on one rank of the group
    refuses on every rank instead of computing a mix of two batches."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    model = ringseq.patch(tiny_model("llama"), sp=sp)
    batch = make_batch(2, 16 * world, "plain")
    if sp.rank == world - 1:
        batch = {k: v.flip(1) for k, v in batch.items()}  # same tokens, another order
    try:
        model(**batch)
    except ringseq.RingSeqError as err:
        text = str(err)
        assert "out of step" in text and f"group rank {world - 1}" in text and "input_ids content" in text, err
        assert "same full batch" in text and "ringseq.Trainer" in text, err
    else:
        raise AssertionError("a different batch on one rank was not refused")
