"""A VLM answers questions about the pictures in a long multimodal prompt by ``generate`` across
the ranks, every answer checked against the unpatched model.

    ringseq launch --sp 2 --nproc 2 examples/vlm_generate.py
    torchrun --nproc_per_node 2 examples/vlm_generate.py --seq-len 4096 --images 64 --split-vision

The tiny Qwen2.5-VL of ``vlm_finetune.py`` learns to name each picture's kind in the token after
its end token, on rows of ``--train-len`` tokens. Then held-out rows of ``--seq-len`` tokens and
``--images`` pictures are cut right after the end token of the picture at each ``--depths``
fraction of the row: the question is that picture's kind, with every earlier picture in the
prompt. ``model.generate`` (greedy) answers on
every rank, the prompt split over the ranks (the vision tower on the whole prompt, or a share of
the pictures with ``--split-vision``; the language model on the ring; the cache sharded). Every
rank gets the same answers (compared), rank 0 checks them against the unpatched model's
``generate`` on the same weights and prints how many it named right at each depth.
"""
import argparse
import copy

import torch
import torch.distributed as dist

import ringseq
from vlm_finetune import END, KINDS, rows, trained


def questions(seq_len: int, images: int, depth: float, n: int, seed: int) -> tuple[dict, torch.Tensor]:
    """n prompts cut after the end token of the picture at ``depth`` of the row, and their answers."""
    full = rows(n, seq_len, images, seed)
    k = min(int(depth * images), images - 1)
    cut = int((full["input_ids"][0] == END).nonzero()[k]) + 1  # the rows place their pictures alike
    answers = full["labels"][:, cut]
    pictures = n * images
    per = full["pixel_values"].size(0) // pictures
    keep = torch.tensor([i % images <= k for i in range(pictures)])  # the pictures inside the prompt
    prompt = {"input_ids": full["input_ids"][:, :cut], "mm_token_type_ids": full["mm_token_type_ids"][:, :cut],
              "pixel_values": full["pixel_values"].reshape(pictures, per, -1)[keep].flatten(0, 1),
              "image_grid_thw": full["image_grid_thw"][keep]}
    return prompt, answers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="training steps first (default: %(default)s)")
    parser.add_argument("--train-len", type=int, default=1024, help="tokens per training row (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per held-out row (default: %(default)s)")
    parser.add_argument("--images", type=int, default=32, help="pictures per row (default: %(default)s)")
    parser.add_argument("--depths", type=float, nargs="*", default=[0.1, 0.5, 0.9])
    parser.add_argument("--batch", type=int, default=4, help="prompts per depth (default: %(default)s)")
    parser.add_argument("--split-vision", action="store_true", help="each rank encodes a share of the pictures")
    args = parser.parse_args()
    sp = ringseq.init(config=ringseq.config.from_env())
    # trained on shorter rows with the pictures as dense: the questions then come in longer prompts
    model = trained(sp, args.steps, args.train_len, max(1, args.images * args.train_len // args.seq_len),
                    args.split_vision)
    model.eval()
    model.generation_config.use_cache = True
    settings = dict(max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None)
    rank0 = dist.get_rank() == 0
    plain = ringseq.unpatch(copy.deepcopy(model)) if rank0 else None
    same, lines = True, []
    for i, depth in enumerate(args.depths):
        prompt, answers = questions(args.seq_len, args.images, depth, args.batch, seed=10**6 + i)
        with torch.no_grad():
            got = model.generate(**prompt, **settings)[:, -1]
        every = [torch.empty_like(got) for _ in range(sp.size)]
        dist.all_gather(every, got, group=sp.group)
        assert all(torch.equal(e, got) for e in every), "the ranks answered differently"
        if rank0:
            with torch.no_grad():
                reference = plain.generate(**prompt, **settings)[:, -1]
            same = same and torch.equal(got, reference)
            right = int((got == answers).sum())
            lines.append(f"depth {depth:.1f} (prompt of {prompt['input_ids'].size(1)} tokens, "
                         f"{prompt['image_grid_thw'].size(0) // args.batch} pictures): {right} of {args.batch} named "
                         f"right (chance {args.batch / KINDS:.1f}); answers {got.tolist()}, unpatched "
                         f"{reference.tolist()}")
    if rank0:
        print("\n".join(lines), flush=True)
        print("every answer equals the unpatched model's" if same else "SOME ANSWERS DIFFER from the unpatched model's",
              flush=True)
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
