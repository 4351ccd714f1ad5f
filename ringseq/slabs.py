"""How many tokens one slab of the chunked loss holds (``ringseq.loss``; the planner reads it too,
so this file imports nothing)."""

SLAB_BYTES = 64 * 2**20
"""fp32 logits per slab of the chunked loss (its backward holds about three slabs' worth at once)."""


def slab_tokens(vocab: int) -> int:
    """Tokens per slab of the chunked loss for a vocabulary: 524 at 32k, 131 at 128k (at least 16,
    so that a slab's matmul stays efficient)."""
    return max(16, SLAB_BYTES // (4 * vocab))
