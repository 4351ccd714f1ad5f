"""Fine-tune a tiny Qwen2.5-VL on long rows of many images across the sequence group.

    torchrun --nproc_per_node 2 examples/vlm_finetune.py
    ringseq launch --sp 2 --nproc 2 examples/vlm_finetune.py --split-vision

Each row is long text noise holding ``--images`` pictures; after each picture's end token comes
a token naming its kind (one of four patterns), the only tokens with labels. Naming them needs
the vision tower, whose features reach the language model through the merge that runs on the
full row on every rank; the language model then runs on the ring, each rank on its share of the
row. ``--split-vision`` has each rank encode a share of the pictures instead of all of them.
At the end rank 0 checks the patched model's held-out loss against the unpatched model on the
same weights and reports how many kinds it names right.
"""
import argparse
import copy

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

import ringseq

IMAGE, START, END, KINDS = 60, 61, 62, 4  # kinds are tokens 1..4
GRID = (1, 4, 4)  # a picture of 4 x 4 patches: 4 placeholder tokens after the 2 x 2 merge
TOKENS = GRID[1] * GRID[2] // 4


def model_config() -> Qwen2_5_VLConfig:
    text = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=65536, use_cache=False,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, window_size=4, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=63,
                              vision_start_token_id=START, vision_end_token_id=END)
    config.use_cache = False
    return config


def rows(n: int, seq_len: int, images: int, seed: int) -> dict:
    """n rows of ``seq_len`` tokens, ``images`` pictures each, spread along the row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 60, (n, seq_len), generator=g)
    types = torch.zeros(n, seq_len, dtype=torch.int32)
    labels = torch.full((n, seq_len), -100)
    kinds = torch.randint(0, KINDS, (n * images,), generator=g)
    patches = torch.randn(n * images, GRID[1] * GRID[2], 3 * 2 * 2 * 2, generator=g)
    for i, kind in enumerate(kinds.tolist()):  # a kind is a brighter quarter of the patch features
        patches[i, :, kind * 6:(kind + 1) * 6] += 2.0
    gap = seq_len // images
    for b in range(n):
        for k in range(images):
            at = k * gap + gap // 2
            ids[b, at - 1], ids[b, at:at + TOKENS], ids[b, at + TOKENS] = START, IMAGE, END
            types[b, at:at + TOKENS] = 1
            ids[b, at + TOKENS + 1] = labels[b, at + TOKENS + 1] = 1 + kinds[b * images + k]
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": types, "pixel_values": patches.flatten(0, 1),
            "image_grid_thw": torch.tensor([GRID] * (n * images))}


def kinds_named(model, batch: dict) -> tuple[int, int]:
    """(kinds named right, kinds) by the patched model's logits at each end token."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # this rank's tokens
    sp = model._ringseq_patch.sp
    full = ringseq.gather(logits, 1, sp=sp)[:, :batch["input_ids"].size(1)]
    ends = batch["input_ids"] == END
    wanted = batch["labels"].roll(-1, 1)[ends]
    return int((full[ends].argmax(-1) == wanted).sum()), int(wanted.numel())


def trained(sp, steps: int, seq_len: int, images: int, split_vision: bool = False):
    """A tiny Qwen2.5-VL patched over ``sp``, trained ``steps`` steps on rows of ``images`` pictures."""
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(model_config(), attn_implementation="sdpa")
    ringseq.patch(model, sp=sp, split_vision=split_vision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    bar = tqdm(range(steps), desc=f"VLM ring x{sp.size}", disable=dist.get_rank() != 0, unit="step")
    for step in bar:
        batch = rows(2, seq_len, images, seed=step * 1000 + sp.dp_rank)  # the same on a group's ranks
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # the gradient rule: average over all ranks, as DDP does
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row (default: %(default)s)")
    parser.add_argument("--images", type=int, default=32, help="pictures per row (default: %(default)s)")
    parser.add_argument("--split-vision", action="store_true", help="each rank encodes a share of the pictures")
    args = parser.parse_args()
    sp = ringseq.init(config=ringseq.config.from_env())  # first: the process group (gloo on CPU)

    model = trained(sp, args.steps, args.seq_len, args.images, args.split_vision)
    rank0 = dist.get_rank() == 0
    held_out = rows(2, args.seq_len, args.images, seed=10**6)
    with torch.no_grad():
        ring = model(**held_out).loss.item()
    right, total = kinds_named(model, held_out)
    if rank0:
        plain = ringseq.unpatch(copy.deepcopy(model))
        with torch.no_grad():
            unpatched = plain(**held_out).loss.item()
        print(f"held-out loss: ringseq {ring:.6f}, unpatched on the same weights {unpatched:.6f} "
              f"(relative difference {abs(ring - unpatched) / abs(unpatched):.1e})", flush=True)
        print(f"kinds named right: {right} of {total} (chance: {total // KINDS})", flush=True)


if __name__ == "__main__":
    main()
