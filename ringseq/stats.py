"""Straggler report: how long each rank of a sequence group computed and waited in ringseq.

Every ring call adds its block-compute time and its wait time (ring transfers, lockstep
agreements) to this rank's ledger; ``stats`` all-gathers the ledgers of a group. In a ring,
every rank waits for the slowest one (a block arrives only after its sender finished its own
step, and the next call's agreement waits for the last rank to arrive), so the rank that
waited least is the one the others waited for. Timings are host clocks: exact on CPU; on CUDA,
where kernels and NCCL run asynchronously, they show where the host waited, not the device.
Set ``RINGSEQ_STATS=0`` to switch the ledger off (the report then counts calls only).
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

from . import lockstep


@dataclasses.dataclass
class Ledger:
    calls: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0


_ledgers: dict = {}


def enabled() -> bool:
    return os.environ.get("RINGSEQ_STATS", "1") != "0"


def ledger(sp) -> Ledger:
    """This rank's ledger for the sequence group of ``sp``."""
    return _ledgers.setdefault(sp.ranks, Ledger())


class Clock:
    """Adds the time between ``start`` and ``stop`` to a ledger field (nothing when disabled)."""

    def __init__(self, book: Ledger):
        self.book, self.on = book, enabled()

    def time(self, field: str, start: float) -> None:
        if self.on:
            setattr(self.book, field, getattr(self.book, field) + time.perf_counter() - start)


def stats(*, sp, reset: bool = False) -> dict:
    """Per-rank ring timings of the sequence group since the last reset (a collective: every
    rank of the group must call it).

    Returns ``{"ranks": [{"calls", "compute_s", "wait_s"} per group rank], "slowest_rank":
    the group rank the others waited for, "wait_for_slowest_s": how long the other ranks
    waited on average beyond the slowest rank's own waits}``. ``reset=True`` starts a new
    period after reading.
    """
    book = ledger(sp)
    mine = torch.tensor([book.calls, book.compute_s, book.wait_s], dtype=torch.float64)
    rows = [mine]
    if sp.size > 1:
        rows = [torch.empty_like(mine) for _ in range(sp.size)]
        work = dist.all_gather(rows, mine, group=sp.check_group, async_op=True)
        lockstep.wait(work, sp, "the all-gather of ringseq.stats", peer=None, gloo=True)
    ranks = [{"calls": int(r[0]), "compute_s": float(r[1]), "wait_s": float(r[2])} for r in rows]
    # the rank that waited least is the one the others waited for; ties go to the one that computed most
    slowest = min(range(len(ranks)), key=lambda i: (ranks[i]["wait_s"], -ranks[i]["compute_s"]))
    others = [r["wait_s"] for i, r in enumerate(ranks) if i != slowest]
    waited = max(0.0, sum(others) / len(others) - ranks[slowest]["wait_s"]) if others else 0.0
    if reset:
        _ledgers[sp.ranks] = Ledger()
    return {"ranks": ranks, "slowest_rank": slowest, "wait_for_slowest_s": waited}
