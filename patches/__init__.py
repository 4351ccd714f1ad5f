"""ringseq.patches: everything that touches third-party model code (transformers)."""
