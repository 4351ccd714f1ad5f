"""A vision-language fine-tuning step over P ranks: every rank encoding every image against
``split_vision`` (each rank a share, features all-gathered), beside the unpatched model in one
process, in one run.

The model is a Qwen2.5-VL of CPU size (vision tower: 4 blocks of hidden 256 on 14 x 14 patches,
window attention and full-attention blocks as the family has them; language model: 2 layers of
hidden 256), trained on one row of N tokens holding ``--images`` pictures of 224 x 224 (256
patches each, 64 placeholder tokens after the 2 x 2 merge) between text tokens. Contenders:

- ``unpatched``  the model in one process.
- ``all``        ``ringseq.patch(model, sp=sp)``: the vision tower on every image on every rank,
                 the language model on the ring.
- ``split``      ``ringseq.patch(model, sp=sp, split_vision=True)``: each rank encodes a share of
                 the images, the features are all-gathered before the merge.

Per configuration: the forward + backward step's median time over ``--reps`` (the slowest rank),
the time in the vision tower alone (forward, the slowest rank), the step memory (peak resident set
above the one before the step) and the loss's difference from the unpatched model's. One thread
per rank; P = 4 runs 4 processes on this machine's 2 cores (time-sliced): compare the contenders
at the same P. Prints JSON lines, writes ``vision.jsonl`` and ``vision.png``. Usage::

    python benchmarks/vision.py                     # 16 images in N = 2048; P = 2, 4
    python benchmarks/vision.py --images 4 --N 512 --sizes 2 --reps 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

IMAGE, START, END = 60, 61, 62
GRID = (1, 16, 16)  # a 224 x 224 picture in 14 x 14 patches
TOKENS = GRID[1] * GRID[2] // 4


def _model():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=65536, use_cache=False,
                rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e4})
    vision = dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=256, window_size=112, fullatt_block_indexes=[3])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=63,
                              vision_start_token_id=START, vision_end_token_id=END)
    config.use_cache = False
    return Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa")


def _batch(N: int, images: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 60, (1, N), generator=g)
    types = torch.zeros(1, N, dtype=torch.int32)
    gap = N // images
    assert gap > TOKENS + 2, f"{images} images of {TOKENS} tokens do not fit in N = {N}"
    for k in range(images):
        at = k * gap + (gap - TOKENS) // 2
        ids[0, at - 1], ids[0, at + TOKENS] = START, END
        ids[0, at:at + TOKENS] = IMAGE
        types[0, at:at + TOKENS] = 1
    patches = images * GRID[0] * GRID[1] * GRID[2]
    return {"input_ids": ids, "labels": ids.masked_fill(types.bool(), -100), "mm_token_type_ids": types,
            "pixel_values": torch.randn(patches, 3 * 2 * 14 * 14, generator=g),
            "image_grid_thw": torch.tensor([GRID] * images)}


def measure(kind: str, N: int, images: int, reps: int) -> dict:
    import ringseq

    P = dist.get_world_size()
    model = _model()
    batch = _batch(N, images)
    if kind != "unpatched":
        ringseq.patch(model, sp=ringseq.init(sp_size=P), split_vision=kind == "split")
    tower = model.model.visual
    spent = []
    tower.register_forward_pre_hook(lambda m, a: spent.append(-time.perf_counter()))
    tower.register_forward_hook(lambda m, a, o: spent.append(spent.pop() + time.perf_counter()))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss

    loss = float(step().detach())
    memory = common.step_peak_mb(step)
    spent.clear()
    ms = common.timed_ms(step, reps)
    vision_ms = common.slowest(sorted(spent)[len(spent) // 2]) * 1e3
    return dict(kind=kind, P=P, N=N, images=images, ms=round(ms, 1), vision_ms=round(vision_ms, 1),
                step_mb=round(common.slowest(memory), 1), loss=loss)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    base = next(r for r in records if r["kind"] == "unpatched")
    for kind, style in (("all", "--s"), ("split", "-o")):
        rows = sorted((r for r in records if r["kind"] == kind), key=lambda r: r["P"])
        axes[0].plot([r["P"] for r in rows], [r["ms"] / base["ms"] for r in rows], style, label=f"{kind}: step")
        axes[0].plot([r["P"] for r in rows], [r["vision_ms"] / base["vision_ms"] for r in rows], style, alpha=0.5,
                     label=f"{kind}: vision tower")
        axes[1].plot([r["P"] for r in rows], [r["step_mb"] / base["step_mb"] for r in rows], style, label=kind)
    axes[0].set(xlabel="ranks P", ylabel="time / one process (slowest rank)",
                title=f"VLM step, {base['images']} images in N={base['N']}")
    axes[1].set(xlabel="ranks P", ylabel="step memory / one process", title="memory per rank")
    common.save_figure(fig, axes, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", type=int, default=2048)
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--sizes", type=int, nargs="*", default=[2, 4])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=common.RESULTS)
    args = p.parse_args(argv)
    jsonl = common.fresh_file(args.out, "vision.jsonl")
    records = []
    with common.freed_memory_returned():
        records.append(common.run_tree(measure, 1, 1, "unpatched", args.N, args.images, args.reps))
        common.emit(records[-1], jsonl)
        for P in args.sizes:
            for kind in ("all", "split"):
                record = common.run_tree(measure, P, 1, kind, args.N, args.images, args.reps)
                record["loss_diff"] = abs(record["loss"] - records[0]["loss"])
                records.append(record)
                common.emit(record, jsonl)
    plot(records, os.path.join(args.out, "vision.png"))


if __name__ == "__main__":
    main()
