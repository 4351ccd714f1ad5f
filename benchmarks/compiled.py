"""Compiled vs eager: a training step of a patched model under torch.compile (inductor, CPU).

For each sequence group size P (default 2 and 4) a small Llama (4 layers, hidden 256, 8 q / 2 kv
heads, fp32) trains on one N-token row (default 4096) split over P ranks, one thread each: eager,
then every decoder layer compiled with ``layer.compile(fullgraph=True)`` (torchtitan's way) and
then the whole model by ``torch.compile(model)``. Beside them, in the same run, the unpatched
model on the whole row in one process, eager and ``torch.compile(model)``: ringseq should keep the
unpatched model's own compiled/eager gain (the ring must not eat it). Reports tokens/s of a step
(forward + backward, median over repetitions, slowest rank), the first compiled step's time
(the compile), graph breaks and graphs made, and each compiled loss against the eager one.

``lengths`` (after them): how often rows of varying length compile, at P=2: one-document rows
whose lengths are drawn (seeded) from ProLong 64K's document-length histogram
(``benchmarks/doc_lengths/``, buckets reaching 256 tokens, capped at N), then rows of N tokens
packed from documents of that mix, through each compiled mode; the graphs dynamo made.

``generate``: decoding after an N-token prompt, eager and under ``model.compile()`` (every decode
step's attention one op, ``patches.compiled_decode``), the unpatched model beside it in the same
run: decode tokens/s (a generate of ``--new`` + 1 tokens minus one of 1 token: the prefill taken
out, median over repetitions, slowest rank), the first compiled generate's time and whether the
compiled tokens are the eager ones.

Prints JSON lines and draws ``benchmarks/results/compiled.png``. Usage::

    python benchmarks/compiled.py                 # N=4096, P = 2 and 4, then the lengths
    python benchmarks/compiled.py lengths --n 2048 --rows 6
    python benchmarks/compiled.py speed --family qwen3_5 --sizes 2   # a hybrid: the recurrent op's share
    python benchmarks/compiled.py generate --sizes 2 --new 32
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MODES = ("eager", "layers", "model")


FAMILIES = ("llama", "qwen3_5")


def _model(family: str = "llama"):
    """The Llama, or a Qwen3.5-style hybrid of the same width and depth (gated DeltaNet layers and
    attention layers in turn; transformers' PyTorch kernels: its chunked delta rule, its convolution)."""
    import transformers as tf

    torch.manual_seed(0)
    common_args = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536, use_cache=False)
    if family == "llama":
        config = tf.LlamaConfig(**common_args)
        config._attn_implementation = "sdpa"
        return tf.LlamaForCausalLM(config)
    config = tf.Qwen3_5TextConfig(**common_args, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                                  linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                                  layer_types=["linear_attention", "full_attention"] * 2)
    config._attn_implementation = "sdpa"
    return tf.Qwen3_5ForCausalLM(config)


def _compiled(model, mode: str):
    if mode == "eager":
        return model
    if mode == "model":
        return torch.compile(model)
    for layer in model.get_decoder().layers:
        layer.compile(fullgraph=True)
    return model


def measure(N: int, reps: int, patched: bool, family: str = "llama") -> list[dict]:
    """Every mode of one configuration, in this process tree (rank 0's records)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import ringseq

    P = dist.get_world_size() if patched else 1
    sp = ringseq.init(sp_size=P) if patched else None
    ids = torch.randint(0, 512, (1, N), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    records, eager_loss = [], None
    for mode in MODES:
        torch._dynamo.reset()
        counters.clear()
        model = _model(family)
        if patched:
            model = ringseq.patch(model, sp=sp)
        run = _compiled(model, mode)
        losses = []

        def train_step():
            loss = run(**batch).loss
            loss.backward()
            losses.append(loss.detach())
            model.zero_grad(set_to_none=True)

        start = time.perf_counter()
        train_step()
        first = common.slowest(time.perf_counter() - start) if patched else time.perf_counter() - start
        ms = common.timed_ms(train_step, reps) if patched else _timed_ms(train_step, reps)
        loss = losses[-1].item()
        eager_loss = loss if mode == "eager" else eager_loss
        records.append(dict(system="ringseq" if patched else "unpatched", family=family, P=P, N=N, mode=mode,
                            tokens_per_s=round(N / ms * 1e3, 1), step_ms=round(ms, 1),
                            first_step_s=round(first, 2), graph_breaks=sum(counters["graph_break"].values()),
                            graphs=counters["stats"]["unique_graphs"], loss=loss,
                            loss_vs_eager=abs(loss - eager_loss)))
        if patched:
            ringseq.unpatch(model)
    return records


def varying(N: int, rows: int, seed: int) -> list[dict]:
    """The graphs each compiled mode makes over rows of drawn lengths, then over packed rows."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import balance
    import fit_mixed
    import ringseq

    sp = ringseq.init(sp_size=dist.get_world_size())
    ns = fit_mixed.lengths("prolong64k", rows, 256, N, seed)
    hist = balance.histogram(os.path.join(balance.DATA, "prolong64k.json"))
    g = torch.Generator().manual_seed(seed)
    packed = [balance.packed_positions(N, hist, g) for _ in range(rows)]
    records = []
    for mode in MODES[1:]:
        torch._dynamo.reset()
        counters.clear()
        model = ringseq.patch(_model(), sp=sp)
        run = _compiled(model, mode)
        made = []
        for part, batches in (("one document", [dict(n=n) for n in ns]),
                              ("packed", [dict(n=N, position_ids=p[None]) for p in packed])):
            for b in batches:
                ids = torch.randint(0, 512, (1, b["n"]), generator=torch.Generator().manual_seed(b["n"]))
                run(input_ids=ids, labels=ids, position_ids=b.get("position_ids")).loss.backward()
                model.zero_grad(set_to_none=True)
                made.append(counters["stats"]["unique_graphs"])
            records.append(dict(system="ringseq", P=sp.size, N=N, mode=mode, rows=part,
                                lengths=[b["n"] for b in batches] if part == "one document" else None,
                                documents=[int((p == 0).sum()) for p in packed] if part == "packed" else None,
                                graphs_after_each_row=made[-len(batches):],
                                graph_breaks=sum(counters["graph_break"].values())))
        ringseq.unpatch(model)
    return records


def decoding(N: int, new: int, reps: int, patched: bool, family: str = "llama") -> list[dict]:
    """Decode tokens/s of ``generate`` after an N-token prompt, eager and ``model.compile()``."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import ringseq

    P = dist.get_world_size() if patched else 1
    sp = ringseq.init(sp_size=P) if patched else None
    ids = torch.randint(0, 512, (1, N), generator=torch.Generator().manual_seed(0))
    records, eager_tokens = [], None
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        counters.clear()
        model = _model(family).eval()
        model.config.use_cache = model.generation_config.use_cache = True
        if patched:
            model = ringseq.patch(model, sp=sp)
        if mode == "compiled":
            model.compile()
        out = {}

        def generate(n: int):
            with torch.no_grad():
                out[n] = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, pad_token_id=0)

        start = time.perf_counter()
        generate(new + 1)
        first = time.perf_counter() - start
        timed = common.timed_ms if patched else _timed_ms
        decode_ms = timed(lambda: generate(new + 1), reps) - timed(lambda: generate(1), reps)
        tokens = out[new + 1][0, N:].tolist()
        eager_tokens = tokens if mode == "eager" else eager_tokens
        records.append(dict(system="ringseq" if patched else "unpatched", family=family, P=P, N=N, part="generate",
                            mode=mode, new_tokens=new, decode_tokens_per_s=round(new / decode_ms * 1e3, 1),
                            first_generate_s=round(common.slowest(first) if patched else first, 2),
                            graph_breaks=sum(counters["graph_break"].values()),
                            graphs=counters["stats"]["unique_graphs"], same_tokens_as_eager=tokens == eager_tokens))
        if patched:
            ringseq.unpatch(model)
    return records


def _timed_ms(step, reps: int) -> float:
    import statistics

    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _unpatched(N: int, reps: int, family: str, fn=None, *args) -> list[dict]:
    torch.set_num_threads(1)
    return (fn or measure)(N, *args, reps, False, family)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    groups = sorted({(r["system"], r["P"]) for r in records}, key=lambda g: (g[0] != "unpatched", g[1]))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        gains = []
        for system, P in groups:
            rs = {r["mode"]: r for r in records if (r["system"], r["P"]) == (system, P)}
            gains.append(rs[mode]["tokens_per_s"] / rs["eager"]["tokens_per_s"])
        ax.bar([j + i * width for j in range(len(groups))], gains, width, label=mode)
    ax.set_xticks([j + width for j in range(len(groups))],
                  [f"{s}" + (f" P={P}" if s == "ringseq" else " (1 process)") for s, P in groups])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel="tokens/s / eager",
           title=f"{records[0]['family']}: training step compiled / eager, N={records[0]['N']} (CPU, inductor)")
    common.save_figure(fig, [ax], path)


def plot_generate(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    groups = sorted({(r["system"], r["P"]) for r in records}, key=lambda g: (g[0] != "unpatched", g[1]))
    labels = [f"{s}" + (f" P={P}" if s == "ringseq" else " (1 process)") for s, P in groups]
    for i, mode in enumerate(("eager", "compiled")):
        rates = [next(r["decode_tokens_per_s"] for r in records if (r["system"], r["P"], r["mode"]) == (*g, mode))
                 for g in groups]
        ax.bar([j + i * 0.4 for j in range(len(groups))], rates, 0.4, label=mode)
    ax.set_xticks([j + 0.2 for j in range(len(groups))], labels)
    r = records[0]
    ax.set(ylabel="decode tokens/s", title=f"{r['family']}: decode after {r['N']} tokens (CPU, inductor)")
    common.save_figure(fig, [ax], path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("parts", nargs="*", help="speed, lengths and/or generate (default: speed and lengths)")
    parser.add_argument("--n", type=int, default=4096, help="tokens per row")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="sequence group sizes P")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8, help="rows of each kind in the lengths part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--new", type=int, default=32, help="new tokens per generate in the generate part")
    parser.add_argument("--family", choices=FAMILIES, default="llama",
                        help="the speed part's model: the Llama, or a Qwen3.5-style hybrid (gated DeltaNet)")
    parser.add_argument("--out", default=common.RESULTS)
    args = parser.parse_args(argv)
    parts = args.parts or ["speed", "lengths"]
    if set(parts) - {"speed", "lengths", "generate"}:
        parser.error(f"unknown parts {sorted(set(parts) - {'speed', 'lengths', 'generate'})}: choose speed, "
                     f"lengths and/or generate")
    path = common.fresh_file(args.out, "compiled.jsonl") if {"speed", "lengths"} & set(parts) else None
    if "speed" in parts:
        records = []
        for record in common.run_tree(_unpatched, 1, 1, args.n, args.reps, args.family):
            common.emit(record, path)
            records.append(record)
        for P in args.sizes:
            for record in common.run_tree(measure, P, 1, args.n, args.reps, True, args.family):
                common.emit(record, path)
                records.append(record)
        plot(records, os.path.join(args.out, "compiled.png" if args.family == "llama" else f"compiled_{args.family}.png"))
    if "lengths" in parts:
        for record in common.run_tree(varying, 2, 1, args.n, args.rows, args.seed):
            common.emit(record, path)
    if "generate" in parts:
        path, records = common.fresh_file(args.out, "compiled_generate.jsonl"), []
        runs = [(_unpatched, 1, args.n, args.reps, args.family, decoding, args.new)]
        runs += [(decoding, P, args.n, args.new, args.reps, True, args.family) for P in args.sizes]
        for fn, P, *rest in runs:
            for record in common.run_tree(fn, P, 1, *rest):
                common.emit(record, path)
                records.append(record)
        plot_generate(records, os.path.join(args.out, "compiled_generate.png"))


if __name__ == "__main__":
    main()
