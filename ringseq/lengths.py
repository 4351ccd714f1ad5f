"""The layouts' names and the sequence lengths each can split: the one place for both.

Imports nothing (the planner and the config read it without torch); ``ringseq.layouts`` holds
the index math of each layout.
"""
from __future__ import annotations

from .errors import RingSeqError

LAYOUTS = ("contiguous", "zigzag", "striped")
"""``contiguous``: rank r holds one run; ``zigzag``: chunks r and 2P-1-r of 2P (balanced causal
work, the default); ``striped``: every P-th token."""


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise RingSeqError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    return layout


def multiple(layout: str, P: int, U: int = 1) -> int:
    """The global length S must be a multiple of this number (P ring ranks, U Ulysses ranks)."""
    return (2 * P if check_layout(layout) == "zigzag" else P) * U


def padded_length(layout: str, S: int, P: int, U: int = 1) -> int:
    """The smallest length >= S that the layout can split."""
    m = multiple(layout, P, U)
    return -(-S // m) * m


def check_length(layout: str, S: int, P: int, U: int = 1) -> int:
    """Return the local length S / (P U), or raise if the layout cannot split S."""
    m = multiple(layout, P, U)
    if S % m:
        pad = -S % m
        ranks = f"{P} ranks" if U == 1 else f"{P} ring x {U} Ulysses ranks"
        raise RingSeqError(
            f"sequence length {S} cannot be split by layout {layout!r} over {ranks}: it must be a "
            f"multiple of {m}; pad the sequence by {pad} tokens (to {S + pad}) or change sp_size/layout")
    return S // (P * U)
