"""Each rank's timing ledger: the time ringseq's waits and block computes took on this rank.

A leaf (no other ringseq module is imported): the lockstep agreements, the ring's transfers
and its block computes record into it, and ``ringseq.stats`` reads it. Whether anything is
recorded is the ``stats`` setting of the ``SequenceParallel`` (``RINGSEQ_STATS=0`` turns it
off, read with the other settings in ``ringseq.config``); the call count is kept either way.
"""
from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class Ledger:
    calls: int = 0
    """Ring calls (forward or backward) this rank finished."""
    compute_s: float = 0.0
    """Seconds in block computes."""
    wait_s: float = 0.0
    """Seconds waiting for peers: ring transfers and lockstep agreements."""
    block_calls: dict = dataclasses.field(default_factory=dict)
    """Block kernel calls this rank's rings made, by backend (``ringseq.attention.kernels``)."""

    def count(self, calls: dict) -> None:
        for name, n in calls.items():
            self.block_calls[name] = self.block_calls.get(name, 0) + n


_ledgers: dict = {}


def ledger(sp) -> Ledger:
    """This rank's ledger for the sequence group of ``sp``."""
    return _ledgers.setdefault(sp.ranks, Ledger())


class Clock:
    """Adds the time since ``start`` to a field of ``sp``'s ledger (nothing when ``sp.stats`` is off)."""

    def __init__(self, sp):
        self.book, self.on = ledger(sp), bool(getattr(sp, "stats", True))

    def time(self, field: str, start: float) -> None:
        if self.on:
            setattr(self.book, field, getattr(self.book, field) + time.perf_counter() - start)
