"""Tiny random-init models of every tested family, their batches, and the comparison with the
unpatched model that every HF case makes (loss and SP-averaged gradients by the 2x rule)."""
import torch
import torch.distributed as dist

from ringseq.testing import assert_model_close

from .hybrid_configs import HYBRIDS, MOE_FAMILIES, hybrid_config, slow_memory


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
    return hybrid_config(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt_oss")
EAGER = ("gemma2", "gpt_oss")
"""transformers' sdpa path drops softcap and sinks, so these families' reference is eager."""


def tiny_model(family: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(family)
    config._attn_implementation = "eager" if family in EAGER else "sdpa"
    # training configuration: with a cache, transformers ignores packed position ids entirely
    config.use_cache = False
    if family == "gpt_oss" or family in MOE_FAMILIES:
        config._experts_implementation = "eager"  # the grouped-mm experts kernel has no float64
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    if family in HYBRIDS:
        slow_memory(model)
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
        dtype = next(model.parameters()).dtype
        if logits.dtype != dtype:  # nemotron_h returns float32 logits of any model: take the head's own
            logits = model.get_output_embeddings()(model.get_decoder()(**inputs).last_hidden_state)
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
    """The patched model's loss and gradients (averaged here over the sequence group: ringseq's
    gradient rule) against the unpatched fp32 and float64 runs, by the 2x rule
    (``ringseq.testing.assert_model_close``). Families whose modules compute in fp32 internally
    (Gemma norms, eager softmax) thereby get the tolerance their own arithmetic allows."""
    for g in grads.values():
        dist.all_reduce(g, group=sp.group)
        g /= sp.size
    assert_model_close(loss, grads, *refs, where)
