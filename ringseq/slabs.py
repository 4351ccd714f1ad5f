"""How many tokens one slab of the chunked loss holds (``ringseq.loss``; the planner reads it too,
so this file imports nothing)."""

SLAB_BYTES = 64 * 2**20
"""fp32 logits per slab of the chunked loss (its gradient is formed over the logits in place: one slab's worth at once)."""


MIN_TOKENS = 512
"""Below this many tokens a slab saves no memory and costs time: what remains is the LM head's
weight gradient, accumulated slab by slab (benchmarks/loss_slabs.py at a 128k vocabulary and 2048
tokens: 130-token slabs 2.6x the full-logits time, 512-token slabs 1.85x, the same peak)."""


def slab_tokens(vocab: int) -> int:
    """Tokens per slab of the chunked loss for a vocabulary: 524 at 32k, 512 at 128k (64 MiB of
    fp32 logits, but at least ``MIN_TOKENS``)."""
    return max(MIN_TOKENS, SLAB_BYTES // (4 * vocab))
