"""Needle in a haystack across ranks: a tiny Llama learns to recall a planted value, then answers
with ``model.generate`` on prompts longer than it trained on, the prompt split over the ranks.

    ringseq launch --sp 2 --nproc 2 examples/needle_generate.py
    torchrun --nproc_per_node 2 examples/needle_generate.py --lengths 1024 2048 --depths 0.1 0.5 0.9

Training: rows of blank tokens with one value token at a random depth and a question marker at
the end; the model is scored on the answer only (``ringseq.patch``: every rank trains on its
shard). The check: for every prompt length and needle depth, a batch of haystacks is answered by
``model.generate`` (greedy, one token). Every rank gets the same answers (they are compared),
rank 0 checks them against the unpatched model's ``generate`` on the same weights, and prints a
table of recall: length x depth.
"""
import argparse

import torch
import torch.distributed as dist

import ringseq
from ringseq.launch.demo_job import BLANK, QUESTION, VALUES, tiny_llama


def haystack(batch: int, S: int, depth: float | None, seed: int) -> dict:
    """[batch, S] rows: a value at ``depth`` (a fraction of S; None: anywhere), the question at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((batch, S), BLANK)
    values = torch.randint(VALUES.start, VALUES.stop, (batch,), generator=g)
    where = (torch.randint(0, S - 2, (batch,), generator=g) if depth is None
             else torch.full((batch,), min(int(depth * S), S - 3)))
    ids[torch.arange(batch), where] = values
    ids[:, -2], ids[:, -1] = QUESTION, values
    labels = torch.full_like(ids, -100)
    labels[:, -1] = values
    return {"input_ids": ids, "labels": labels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--train-len", type=int, default=512)
    p.add_argument("--lengths", type=int, nargs="*", default=[512, 1024, 2048])
    p.add_argument("--depths", type=float, nargs="*", default=[0.1, 0.5, 0.9])
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()

    torch.set_num_threads(1)
    sp = ringseq.init(config=ringseq.config.from_env())
    model = ringseq.patch(tiny_llama(), sp=sp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(args.steps):
        loss = model(**haystack(args.batch, args.train_len, None, step)).loss
        optimizer.zero_grad()
        loss.backward()
        for q in model.parameters():  # the gradient rule: average over all ranks, as DDP does
            dist.all_reduce(q.grad)
            q.grad /= dist.get_world_size()
        optimizer.step()
        if dist.get_rank() == 0 and step % 50 == 0:
            print(f"step {step}: answer loss {loss.item():.3f}", flush=True)

    model.eval()
    unpatched = tiny_llama().eval() if dist.get_rank() == 0 else None
    if unpatched is not None:
        unpatched.load_state_dict(model.state_dict())
    table = {}
    for S in args.lengths:
        for depth in args.depths:
            rows = haystack(args.batch, S, depth, seed=10_000 + S)
            prompt = rows["input_ids"][:, :-1]
            # every token is real: without the mask transformers would take the blanks (the pad id) for padding
            settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False,
                            pad_token_id=BLANK, eos_token_id=None)
            with torch.no_grad():
                answers = model.generate(input_ids=prompt, **settings)[:, -1]
            every = [torch.empty_like(answers) for _ in range(sp.size)]
            dist.all_gather(every, answers, group=sp.group)
            assert all(torch.equal(a, answers) for a in every), "the ranks answered differently"
            if unpatched is not None:
                with torch.no_grad():
                    alone = unpatched.generate(input_ids=prompt, **settings)[:, -1]
                assert torch.equal(alone, answers), f"S={S} depth={depth}: the unpatched model answers otherwise"
            table[(S, depth)] = (answers == rows["labels"][:, -1]).float().mean().item()
    if dist.get_rank() == 0:
        print(f"\nrecall by model.generate over {sp.size} ranks (trained on {args.train_len} tokens; chance "
              f"{1 / len(VALUES):.0%}); every answer equals the unpatched model's")
        print("  length " + "".join(f"  depth {d:<5}" for d in args.depths))
        for S in args.lengths:
            print(f"  {S:>6} " + "".join(f"  {table[(S, d)]:>10.0%}" for d in args.depths))


if __name__ == "__main__":
    main()
