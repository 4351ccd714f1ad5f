"""Tiny random-init configs of the hybrid families (recurrent layers beside attention), small
enough for CPU processes and built so that a state lost at a shard edge would show: every
recurrent layer forgets slowly (``slow_memory``)."""
import math

import torch

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              hidden_size=32, max_position_embeddings=4096)
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
           linear_num_value_heads=4)
MAMBA = dict(mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16)
TWO = ["linear_attention", "full_attention"]
MOE = dict(num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5)


def hybrid_config(family: str):
    import transformers as tf

    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(**COMMON, **GDN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, layer_types=TWO)
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**COMMON, **GDN, **MOE, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=16, layer_types=TWO)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**COMMON, **GDN, **MOE, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, decoder_sparse_step=1,
                                  mlp_only_layers=[], moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                  layer_types=TWO)
    if family == "olmo_hybrid":
        return tf.OlmoHybridConfig(**COMMON, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=2,
                                   linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                   layer_types=TWO, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "kimi_linear":  # MLA attention: q/k head dim 16, v head dim 8
        return tf.KimiLinearConfig(**COMMON, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_local_experts=4,
                                   num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                                   layer_types=TWO, mlp_layer_types=["dense", "sparse"], linear_head_dim=8,
                                   linear_num_heads=2, linear_conv_kernel_dim=4)
    if family == "nemotron_h":
        return tf.NemotronHConfig(**COMMON, intermediate_size=64, layers_block_type=["linear_attention", "moe",
                                                                                    "full_attention", "mlp"],
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, ssm_state_size=8,
                                  mamba_num_heads=4, mamba_head_dim=8, n_groups=1, conv_kernel=4, chunk_size=16,
                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  moe_shared_expert_intermediate_size=16)
    if family == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(**COMMON, **MAMBA, intermediate_size=16, shared_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
                                         layer_types=TWO, mamba_expand=2, position_embedding_type="rope",
                                         logits_scaling=2.0)
    if family == "falcon_h1":  # attention and Mamba2 in parallel in every layer; muP multipliers
        return tf.FalconH1Config(**COMMON, **{k: v for k, v in MAMBA.items() if k != "mamba_n_heads"}, mamba_n_heads=4,
                                 intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, mamba_d_ssm=32, mamba_rms_norm=True, embedding_multiplier=1.5,
                                 lm_head_multiplier=0.5, ssm_in_multiplier=0.8, ssm_out_multiplier=1.2,
                                 attention_in_multiplier=0.9, attention_out_multiplier=1.1, key_multiplier=0.7,
                                 ssm_multipliers=[1.0, 0.5, 0.9, 1.1, 0.8], mlp_multipliers=[0.9, 1.1])
    if family == "bamba":
        return tf.BambaConfig(**COMMON, **MAMBA, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, attn_layer_indices=[1], mamba_expand=2)
    if family == "zamba2":  # Mamba2 layers and shared attention blocks
        return tf.Zamba2Config(**COMMON, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                               num_key_value_heads=2, attention_head_dim=16, mamba_d_state=8, mamba_headdim=8,
                               mamba_ngroups=1, n_mamba_heads=8, chunk_size=16, use_mem_rope=True, num_mem_blocks=1,
                               layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])
    if family == "lfm2":
        return tf.Lfm2Config(**COMMON, intermediate_size=64, num_hidden_layers=2, block_auto_adjust_ff_dim=False,
                             num_attention_heads=2, num_key_value_heads=1, conv_L_cache=3, conv_bias=False,
                             layer_types=["conv", "full_attention"])
    if family == "lfm2_moe":
        return tf.Lfm2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, conv_L_cache=3, conv_bias=False,
                                num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                layer_types=["conv", "full_attention"])
    raise ValueError(family)


HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear", "nemotron_h", "granitemoehybrid",
           "falcon_h1", "bamba", "zamba2", "lfm2", "lfm2_moe")
MOE_FAMILIES = ("qwen3_5_moe", "qwen3_next", "kimi_linear", "nemotron_h", "granitemoehybrid", "lfm2_moe")
WITH_ROUTER_LOSS = ("qwen3_5_moe", "qwen3_next", "granitemoehybrid")
CHUNK = {"qwen3_5": 64, "qwen3_5_moe": 64, "qwen3_next": 64, "olmo_hybrid": 64, "kimi_linear": 64}
"""Tokens per chunk of the family's kernel (the delta-rule kernels' fixed 64; Mamba2's config: 16)."""


def slow_memory(model) -> None:
    """Decays near 1 (exp(-0.01 softplus(-3)) per token for the delta rule, Mamba2 and KDA): a
    state carries across hundreds of tokens, so a state lost at a shard edge moves the loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(math.log(0.01))
            elif name.endswith("dt_bias"):
                p.fill_(-3.0)
