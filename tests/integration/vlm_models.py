"""Tiny random-init vision-language models and long multi-image batches built in code (nothing
downloaded): Qwen2.5-VL, Qwen3-VL (dense and MoE with its router loss), Qwen3.5 (hybrid language model), Gemma 3, LLaVA, Idefics3 and
SmolVLM.

A batch is what the family's processor would make: text tokens with each image's placeholder
tokens (one per merged patch), the images' pixels in the family's format and its metadata
(Qwen: patches [N, C*T*P*P] and grid_thw; Gemma 3 / LLaVA: [images, 3, H, W]), labels with
-100 on the placeholders. Images land where ``image_at`` says, so tests put them on different
ranks and across the layout's chunk boundaries.
"""
import math

import torch

VOCAB = 96
IMAGE, VIDEO, START, END = 90, 91, 92, 93
QWEN = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
VLMS = (*QWEN, "gemma3", "llava", "idefics3", "smolvlm")
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0)
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=2,
                   spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64)
# one Qwen image: a 1 x 4 x 4 patch grid -> 4 placeholder tokens after the 2 x 2 merge
QWEN_GRID = (1, 4, 4)


def tiny_config(family: str):
    import transformers as tf

    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen2_5_vl":
        text = dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4})
        vision = dict(QWEN_VISION, window_size=4, fullatt_block_indexes=[1])
        return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen3_vl":
        text = dict(TEXT, head_dim=16, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                        "mrope_interleaved": True, "rope_theta": 1e4})
        vision = dict(QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen3_vl_moe":  # experts with the router loss in the language model
        text = dict(TEXT, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    output_router_logits=True, router_aux_loss_coef=0.1,
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                     "rope_theta": 1e4})
        vision = dict(QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        return tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen3_5":  # gated DeltaNet + full attention (the hybrid-models issue) under a vision tower
        text = dict(TEXT, head_dim=16, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                               "mrope_interleaved": True, "rope_theta": 1e4,
                                                               "partial_rotary_factor": 1.0})
        vision = dict(QWEN_VISION, num_position_embeddings=16)
        return tf.Qwen3_5Config(text_config=text, vision_config=vision, **ids)
    if family == "gemma3":  # 16 x 16 images, 4 x 4 patches, pooled to 4 tokens
        text = dict(TEXT, head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
                    layer_types=["sliding_attention", "full_attention"])
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      image_size=16, patch_size=4, vision_use_head=False)
        return tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
                               boi_token_index=START, eoi_token_index=END)
    if family == "llava":  # CLIP on 8 x 8 images, 2 x 2 patches -> 16 tokens (the class token dropped)
        text = dict(TEXT, model_type="llama")
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, image_size=8, patch_size=2, projection_dim=32)
        return tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE, image_seq_length=16,
                              vision_feature_layer=-1)
    if family in ("idefics3", "smolvlm"):  # 16 x 16 images, 4 x 4 patches, pixel shuffle by 2 -> 4 tokens
        text = dict(TEXT, model_type="llama")
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                      patch_size=4)
        kind = tf.Idefics3Config if family == "idefics3" else tf.SmolVLMConfig
        return kind(text_config=text, vision_config=vision, scale_factor=2, image_token_id=IMAGE)
    raise ValueError(family)


def tokens_per_image(family: str) -> int:
    return {"gemma3": 4, "llava": 16, "idefics3": 4, "smolvlm": 4}.get(family, QWEN_GRID[1] * QWEN_GRID[2] // 4)


def tiny_model(family: str, dtype=torch.float32, attn: str = "sdpa"):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    config = tiny_config(family)
    config.use_cache = False
    config.get_text_config().use_cache = False
    config.get_text_config()._experts_implementation = "eager"  # the grouped-mm experts kernel has no float64
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn).to(dtype)
    if family == "qwen3_5":
        from .hybrid_configs import slow_memory

        slow_memory(model)
    return model


def image_starts(sizes: list[int], S: int, row: int = 0) -> list[int]:
    """Where each placeholder run (of ``sizes`` tokens) begins: run k of n centred on
    (2k + 1) S / 2n (for two runs S/4 and 3S/4, which are chunk edges of the zigzag layout at
    world 2 and 4), row by row one token later."""
    n = len(sizes)
    starts = [max(2, (2 * k + 1) * S // (2 * n) - size // 2 + row) for k, size in enumerate(sizes)]
    assert all(b - a > size + 1 for a, b, size in zip(starts, starts[1:], sizes)) and starts[-1] + sizes[-1] + 1 < S, \
        f"runs of {sizes} tokens do not fit in {S}"
    return starts


VIDEO_GRID = (4, 4, 4)  # four temporal patches of 4 x 4: 16 placeholder tokens


def make_batch(family: str, B: int, S: int, images_per_row: int = 2, seed: int = 0, padded: bool = False,
               video: bool = False, dtype=torch.float32) -> dict:
    """A full batch of B rows of S tokens, each with ``images_per_row`` images; ``video`` (Qwen):
    row 0 holds a video of four temporal patches after its images."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 80, (B, S), generator=g)
    n = tokens_per_image(family)
    types = torch.zeros(B, S, dtype=torch.long)  # 1: image, 2: video (Qwen's mm_token_type_ids)
    video_tokens = VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2] // 4
    for b in range(B):
        sizes = [n] * images_per_row + ([video_tokens] if video and b == 0 else [])
        for k, (at, size) in enumerate(zip(image_starts(sizes, S, b), sizes)):
            kind = 2 if k == images_per_row else 1
            ids[b, at - 1], ids[b, at + size] = START, END
            ids[b, at:at + size] = VIDEO if kind == 2 else IMAGE
            types[b, at:at + size] = kind
    labels = ids.masked_fill(types > 0, -100)
    batch = {"input_ids": ids, "labels": labels}
    count = B * images_per_row
    if family in QWEN:
        t, h, w = QWEN_GRID
        batch["pixel_values"] = torch.randn(count * t * h * w, 3 * 2 * 2 * 2, generator=g).to(dtype)
        batch["image_grid_thw"] = torch.tensor([QWEN_GRID] * count)
        batch["mm_token_type_ids"] = types.int()
        if video:
            batch["pixel_values_videos"] = torch.randn(math.prod(VIDEO_GRID), 3 * 2 * 2 * 2, generator=g).to(dtype)
            batch["video_grid_thw"] = torch.tensor([VIDEO_GRID])
    else:
        assert not video, "videos: Qwen families only"
        side = 8 if family == "llava" else 16
        batch["pixel_values"] = torch.randn(count, 3, side, side, generator=g).to(dtype)
        if family in ("idefics3", "smolvlm"):  # [rows, images per row, 3, H, W]
            batch["pixel_values"] = batch["pixel_values"].reshape(B, images_per_row, 3, side, side)
        if family == "gemma3":
            batch["token_type_ids"] = types
    if padded:  # right padding on row 0
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, S - 3:] = 0
        batch["attention_mask"] = mask
        batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    return batch
