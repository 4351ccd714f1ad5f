"""The demo's training job: a tiny random-init Llama learns long-range retrieval.

Each sample is ``S`` random filler tokens with one value token planted early in the sequence
and a query marker at the very end; the model must answer with the planted value. With the
zigzag layout over 2 ranks the value sits in rank 1's shard and the question at the end of
rank 0's: no rank can answer from its own tokens, only through the ring.

Run under a launcher (``ringseq demo`` does: torchrun, 2 processes) it trains the patched model
with sequence parallelism, and rank 0 also evaluates an unpatched twin on the same weights at
every step (the exactness check: the two losses must agree). With ``--reference`` it trains the
unpatched model in one process on the same batches: an independent run whose curve follows
until fp32 rounding differences, amplified by training, part them. Rank 0 writes a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch

VOCAB, FILLER, QUERY = 64, 4, 49  # tokens 0..3 filler, 49 asks, 50..63 are the values
VALUES = range(50, 64)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 16,
                         use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def retrieval_batch(step: int, batch: int, S: int) -> dict:
    """The same batch for a given step on every rank and in the reference run."""
    g = torch.Generator().manual_seed(1_000 + step)
    ids = torch.randint(0, FILLER, (batch, S), generator=g)
    values = torch.randint(VALUES.start, VALUES.stop, (batch,), generator=g)
    where = torch.randint(S // 4, S // 2, (batch,), generator=g)  # zigzag chunk 1 of 4: rank 1
    ids[torch.arange(batch), where] = values
    ids[:, -2] = QUERY
    ids[:, -1] = values
    labels = torch.full_like(ids, -100)
    labels[:, -1] = values  # only the answer is scored
    return {"input_ids": ids, "labels": labels}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--out", default="ringseq-demo")
    parser.add_argument("--reference", action="store_true", help="unpatched model, one process")
    args = parser.parse_args(argv)

    import torch.distributed as dist
    from tqdm import tqdm

    import ringseq

    torch.set_num_threads(1 if not args.reference else max(1, torch.get_num_threads()))
    model = tiny_llama()
    sp = None
    if not args.reference:
        sp = ringseq.config.from_env().init()
        ringseq.patch(model, sp=sp)
    rank0 = sp is None or dist.get_rank() == 0
    twin = tiny_llama() if sp is not None and rank0 else None  # unpatched, same weights each step
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, twin_losses, twin_seconds, start = [], [], 0.0, time.perf_counter()
    bar = tqdm(range(args.steps), desc="ring x2" if sp else "reference", disable=not rank0, unit="step")
    for step in bar:
        optimizer.zero_grad(set_to_none=True)
        batch = retrieval_batch(step, args.batch, args.seq_len)
        loss = model(**batch).loss
        loss.backward()
        if twin is not None:
            tick = time.perf_counter()
            twin.load_state_dict(model.state_dict())
            with torch.no_grad():
                twin_losses.append(twin(**batch).loss.item())
            twin_seconds += time.perf_counter() - tick
        if sp is not None and sp.size > 1:  # the gradient rule: sum each gradient over the sequence group
            for p in model.parameters():
                dist.all_reduce(p.grad, group=sp.group)
        optimizer.step()
        losses.append(loss.item())
        tokens = (step + 1) * args.batch * args.seq_len
        bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens / (time.perf_counter() - start - twin_seconds):,.0f}")
    seconds = time.perf_counter() - start - twin_seconds

    model.eval()
    correct = total = 0
    with torch.no_grad():
        for k in range(4):
            batch = retrieval_batch(10_000 + k, args.batch, args.seq_len)
            answer = batch["labels"][:, -1]
            if sp is None:
                logits = model(input_ids=batch["input_ids"]).logits
            else:
                logits = ringseq.gather(model(input_ids=batch["input_ids"]).logits, 1, sp=sp)
            correct += (logits[:, -2].argmax(-1) == answer).sum().item()
            total += len(answer)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    peaks = [peak.item()]
    if sp is not None and dist.get_world_size() > 1:
        everyone = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, peak)
        peaks = [t.item() for t in everyone]
    if rank0:
        os.makedirs(args.out, exist_ok=True)
        name = "reference" if sp is None else "ring"
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump({"losses": losses, "twin_losses": twin_losses, "accuracy": correct / total, "peak_rss_mb": peaks, "seconds": seconds,
                       "tokens_per_s": args.steps * args.batch * args.seq_len / seconds,
                       "seq_len": args.seq_len, "ranks": 1 if sp is None else sp.size}, f)


if __name__ == "__main__":
    main()
    from ringseq.processes import exit_now

    exit_now(0)  # no interpreter teardown (see exit_now)
