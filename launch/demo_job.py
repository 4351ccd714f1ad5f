"""The demo's training job: a tiny random-init Llama learns to retrieve a fact stored on the
other rank's half of the sequence, and the same model with attention cut at the middle cannot.

Each sample is ``S`` blank tokens with one fact planted in the first half - a value token - and
a question marker at the very end: the model must answer with the value.
Under the zigzag layout over 2 ranks the fact sits in rank 1's tokens and the question at the
end of rank 0's, so no rank can answer from its own tokens, only through the ring.

Two models start from the same weights and see the same batches, both patched, both over the
ring: ``ring`` attends over the whole sequence; ``cut`` treats the two halves as separate
documents (position ids restart at S/2), so no token attends across the middle - what attention
would be if the sequence were split without a ring. At every step rank 0 also evaluates an
unpatched twin of ``ring`` on the same weights: the two losses must agree (exactness). After
training both models answer held-out questions with ``model.generate``: ``ring`` reads the whole
prompt (prefilled through the ring, its cache sharded over the ranks), ``cut`` only the half
after the middle, as its attention did in training. Rank 0 writes a JSON summary: losses, the
twin's losses, retrieval accuracy over training for both models, the answers' accuracy by
generate, peak memory per rank, throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch

VOCAB, BLANK, QUESTION = 64, 0, 1
VALUES = range(50, 64)  # 14 values: chance is 1/14
EVAL_EVERY = 10


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 16,
                         use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def retrieval_batch(step: int, batch: int, S: int) -> dict:
    """The same batch for a given step on every rank: the fact at [S/4, S/2), the question at the end."""
    g = torch.Generator().manual_seed(1_000 + step)
    ids = torch.full((batch, S), BLANK)
    values = torch.randint(VALUES.start, VALUES.stop, (batch,), generator=g)
    where = torch.randint(S // 4, S // 2, (batch,), generator=g)  # zigzag over 2 ranks: rank 1's tokens
    ids[torch.arange(batch), where] = values
    ids[:, -2], ids[:, -1] = QUESTION, values
    labels = torch.full_like(ids, -100)
    labels[:, -1] = values  # only the answer is scored
    return {"input_ids": ids, "labels": labels}


def halves(S: int) -> torch.Tensor:
    """Position ids that restart at S/2: two documents, so attention never crosses the middle."""
    return torch.cat([torch.arange(S // 2), torch.arange(S - S // 2)])[None]


def accuracy(model, sp, batch: dict, position_ids=None) -> float:
    import ringseq

    with torch.no_grad():
        logits = ringseq.gather(model(input_ids=batch["input_ids"], position_ids=position_ids).logits, 1, sp=sp)
    return (logits[:, -2].argmax(-1) == batch["labels"][:, -1]).float().mean().item()


def generated_accuracy(model, batch: dict, cut: bool) -> float:
    """The share of questions ``model.generate`` answers with the planted value (greedy, one new
    token); ``cut``: the prompt starts at the middle, all the cut model's question ever sees."""
    S = batch["input_ids"].size(1)
    prompt = batch["input_ids"][:, S // 2 if cut else 0:-1]
    with torch.no_grad():  # the mask says every token is real (transformers would take BLANK = pad for padding)
        answers = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1,
                                 do_sample=False, pad_token_id=BLANK, eos_token_id=None)[:, -1]
    return (answers == batch["labels"][:, -1]).float().mean().item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="training steps of each model (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--out", default="ringseq-demo", help="folder for ring.json (default: %(default)s)")
    args = parser.parse_args(argv)

    import torch.distributed as dist
    from tqdm import tqdm

    import ringseq

    torch.set_num_threads(1)
    sp = ringseq.init(config=ringseq.config.from_env())
    rank0 = dist.get_rank() == 0
    models = {"ring": ringseq.patch(tiny_llama(), sp=sp), "cut": ringseq.patch(tiny_llama(), sp=sp)}
    positions = {"ring": None, "cut": halves(args.seq_len)}
    twin = tiny_llama() if rank0 else None  # unpatched, same weights as "ring" at every step
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for k, m in models.items()}
    evaluation = retrieval_batch(10_000, 2 * args.batch, args.seq_len)
    log = {"losses": {k: [] for k in models}, "twin_losses": [], "eval_steps": [],
           "accuracy": {k: [] for k in models}}
    twin_seconds, start = 0.0, time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"ring x{sp.size}", disable=not rank0, unit="step")
    for step in bar:
        batch = retrieval_batch(step, args.batch, args.seq_len)
        for name, model in models.items():
            optimizers[name].zero_grad(set_to_none=True)
            loss = model(**batch, position_ids=positions[name]).loss
            loss.backward()
            if name == "ring" and twin is not None:
                tick = time.perf_counter()
                twin.load_state_dict({k: v for k, v in model.state_dict().items()})
                with torch.no_grad():
                    log["twin_losses"].append(twin(**batch).loss.item())
                twin_seconds += time.perf_counter() - tick
            for p in model.parameters():  # the gradient rule: average each gradient over all ranks
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            optimizers[name].step()
            log["losses"][name].append(loss.item())
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == args.steps:
            # who the ring waited for since the last evaluation (rank 0 also runs the unpatched twin):
            # the bar's waited_for
            report = ringseq.stats(sp=sp, reset=True)
            log.setdefault("stats", []).append(report)
            log["eval_steps"].append(step + 1)
            for name, model in models.items():
                log["accuracy"][name].append(accuracy(model, sp, evaluation, positions[name]))
        bar.set_postfix(ring=f"{log['losses']['ring'][-1]:.3f}", cut=f"{log['losses']['cut'][-1]:.3f}",
                        acc=f"{log['accuracy']['ring'][-1]:.0%}" if log["eval_steps"] else "-",
                        waited_for=f"rank{log['stats'][-1]['slowest_rank']}" if log.get("stats") else "-")
    seconds = time.perf_counter() - start - twin_seconds
    log["generate_accuracy"] = {name: generated_accuracy(model.eval(), evaluation, cut=name == "cut")
                                for name, model in models.items()}

    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    everyone = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, peak)
    if rank0:
        os.makedirs(args.out, exist_ok=True)
        log.update(peak_rss_mb=[t.item() for t in everyone], seconds=seconds, ranks=sp.size, seq_len=args.seq_len,
                   tokens_per_s=2 * args.steps * args.batch * args.seq_len / seconds, chance=1 / len(VALUES))
        with open(os.path.join(args.out, "ring.json"), "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
    from ringseq.processes import exit_now

    exit_now(0)  # no interpreter teardown (see ringseq.processes.exit_now)
