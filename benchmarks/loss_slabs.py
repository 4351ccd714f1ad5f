"""What the chunked loss's slab size costs and saves at a large vocabulary.

For each vocabulary and slab size (tokens per slab; ``default`` is ``ringseq.loss.slab_tokens``),
a fresh process computes the loss of one rank's hidden states [1, s, d] through the LM head and
its backward (``ringseq.loss.chunked_cross_entropy`` at sp 1), beside the full-logits loss
(``full``: the head over all s tokens, then cross-entropy, as transformers does). ``path`` is
``fused`` (a plain Linear head: every gradient formed in the loss's forward) or, for the slab
sizes in ``--checkpointed``, ``checkpointed`` (the same head behind a no-op forward hook, as
ZeRO-3's gathering hook or PEFT's wrapper makes it: each slab checkpointed, its logits recomputed
in backward). Reports the peak resident memory above the inputs and the time, each as a ratio
to ``full``. Prints JSON lines, writes ``loss_slabs.jsonl`` and ``loss_slabs.png``. Usage::

    python benchmarks/loss_slabs.py                       # vocab 32000 and 128256, s = 2048, d = 1024
    python benchmarks/loss_slabs.py --vocab 128256 --tokens 1024 --slabs 64 512 default
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


def measure(vocab: int, tokens: int, hidden: int, slab, path: str = "fused") -> dict:
    import ringseq
    from ringseq.loss import chunked_cross_entropy, slab_tokens

    sp = ringseq.init(sp_size=dist.get_world_size())
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    if path == "checkpointed":
        head.register_forward_hook(lambda module, args, out: None)
    h = torch.randn(1, tokens, hidden, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    chunk = None if slab == "full" else slab_tokens(vocab) if slab == "default" else int(slab)

    def loss_of(h, labels):
        if chunk is None:
            return torch.nn.functional.cross_entropy(head(h).flatten(0, 1).float(), labels.flatten())
        return chunked_cross_entropy(h, labels, head, sp=sp, count=torch.tensor(labels.numel()), chunk=chunk)

    loss_of(h[:, :2], labels[:, :2]).backward()  # first use: imports and kernel set-up, not counted
    h.grad = head.weight.grad = None
    base = common.rss_mb()
    start = time.perf_counter()
    loss = loss_of(h, labels)
    loss.backward()
    seconds = time.perf_counter() - start
    return dict(vocab=vocab, tokens=tokens, hidden=hidden, slab=slab if slab in ("full", "default") else int(slab),
                slab_tokens=chunk, path="full" if chunk is None else path,
                peak_mb=round(common.peak_rss_mb() - base, 1), seconds=round(seconds, 3), loss=round(loss.item(), 6))


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for vocab in sorted({r["vocab"] for r in records}):
        full = next(r for r in records if r["vocab"] == vocab and r["slab"] == "full")
        for kind, marker in (("fused", "o"), ("checkpointed", "x")):
            rs = sorted((r for r in records if r["vocab"] == vocab and r.get("path", "fused") == kind
                         and r["slab_tokens"]), key=lambda r: r["slab_tokens"])
            if rs:
                ax.plot([r["slab_tokens"] for r in rs], [r["peak_mb"] for r in rs], marker=marker, ls="none" if
                        kind == "checkpointed" else "-", label=f"vocab {vocab} {kind}")
        ax.axhline(full["peak_mb"], ls="--", lw=0.8, color=ax.lines[-1].get_color())
    ax.set(xscale="log", yscale="log", xlabel="tokens per slab", ylabel="peak MB above the inputs",
           title="chunked loss vs full logits (dashed), forward + backward")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--slabs", nargs="+", default=["full", "64", "512", "default", "2048"])
    parser.add_argument("--checkpointed", nargs="*", default=["default"],
                        help="slab sizes also measured with checkpointed slabs (the path of non-Linear heads)")
    parser.add_argument("--out", default=common.RESULTS)
    args = parser.parse_args(argv)
    path = common.fresh_file(args.out, "loss_slabs.jsonl")
    records = []
    runs = [(slab, "fused") for slab in args.slabs] + [(slab, "checkpointed") for slab in args.checkpointed]
    for vocab in args.vocab:
        full = None
        for slab, kind in runs:
            rec = common.run_tree(measure, 1, 2, vocab, args.tokens, args.hidden, slab, kind)
            full = rec if slab == "full" else full
            if full is not None:
                rec.update(mem_to_full=round(rec["peak_mb"] / full["peak_mb"], 3),
                           time_to_full=round(rec["seconds"] / full["seconds"], 3))
            records.append(rec)
            common.emit(rec, path)
    plot(records, os.path.join(args.out, "loss_slabs.png"))
    print(f"wrote {path} and loss_slabs.png", file=sys.stderr)


if __name__ == "__main__":
    main()
