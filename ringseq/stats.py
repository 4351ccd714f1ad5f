"""Straggler report: how long each rank of a sequence group computed and waited in ringseq.

Every ring call adds its block-compute time and its wait time (ring transfers, lockstep
agreements) to this rank's ledger (``ringseq.ledger``), and every lockstep record carries the
sender's ledger as it stood when the record was made, so each rank knows every peer's ledger up
to (not including) the group's last ringseq collective. ``stats`` reads that: it communicates
nothing, so a rank may call it alone (a callback that logs on the main process only) without
putting the group out of step. In a ring every rank waits for the slowest one (a block arrives
only after its sender finished its own step, and the next call's agreement waits for the last
rank to arrive), so the rank that waited least is the one the others waited for. Timings are host clocks: exact on CPU; on CUDA, where
kernels and NCCL run asynchronously, they show where the host waited, not the device.
``RINGSEQ_STATS=0`` switches the timings off (the report then counts calls only) and the count of
each rank's attention work (``attention_pairs``, counted from every full batch as it is sharded).
"""
from __future__ import annotations

from . import lockstep
from .attention.kernels import flash_impl
from .ledger import ledger
from .planner import fit
from .topology import check_sp


def _rows(sp) -> list[list[float]]:
    """[calls, compute_s, wait_s] per group rank, as the group's last records carried them."""
    if sp.size == 1:
        book = ledger(sp)
        return [[book.calls, book.compute_s, book.wait_s]]
    seen = lockstep.state(sp).peers
    if seen is None:
        return [[0, 0.0, 0.0] for _ in range(sp.size)]
    return [[int(c), lockstep.from_bits(a), lockstep.from_bits(b)] for c, a, b in seen]


def stats(*, sp, reset: bool = False) -> dict:
    """Per-rank ring timings of the sequence group since the last reset, up to the group's last
    ringseq collective (no communication: any rank may call it, alone or with the others; in a
    one-rank group, up to now).

    Returns ``{"ranks": [{"calls", "compute_s", "wait_s", "attention_pairs"} per group rank],
    "slowest_rank": the group rank the others waited for, "wait_for_slowest_s": how long the other
    ranks waited on average beyond the slowest rank's own waits, "work_max_over_mean": the busiest
    rank's attention work over the mean, "kernels": {"block_calls": this rank's block kernel calls by
    backend, "flash": which flash implementation the GPU's flash ops run and why (FA2 or FA3:
    ``ringseq.attention.kernels.flash_impl``)}, "fit": the last choice of ``patch(fit=True)`` (None
    without one: ``switches``, ``described``, ``length``, ``batch``, ``bucket`` (the length planned
    at), ``predicted_peak_bytes`` (step memory), ``budget_bytes``, ``plannable_bytes`` (the budget less fit's
    headroom: what a predicted step may take), ``measured_peak_bytes`` (on CUDA
    the peak allocated since that step's forward began, above what was allocated then; None on
    CPU), ``predicted_step_s``, ``replans``, ``planning_s``)}``. ``attention_pairs`` is the visible query-key pairs of a
    full-attention layer that the rank's queries had in the batches sharded in the period, counted
    from the full batches (``ringseq.attention.work``; under Ulysses a ring rank's pairs split over
    its U ranks): imbalance in one's own data, whatever the clocks say. ``reset=True`` starts a new
    period after reading (on this rank: each rank keeps its own period).
    """
    check_sp(sp)
    st = lockstep.state(sp)
    now = _rows(sp)
    base = st.baseline if st.baseline is not None and len(st.baseline) == len(now) else [[0, 0.0, 0.0]] * len(now)
    pairs = st.work or [0] * sp.ring_size
    U = sp.size // sp.ring_size
    ranks = [{"calls": int(r[0] - b[0]), "compute_s": float(r[1] - b[1]), "wait_s": float(r[2] - b[2]),
              "attention_pairs": pairs[g // U] / U} for g, (r, b) in enumerate(zip(now, base))]
    # the rank that waited least is the one the others waited for; ties go to the one that computed most
    slowest = min(range(len(ranks)), key=lambda i: (ranks[i]["wait_s"], -ranks[i]["compute_s"]))
    others = [r["wait_s"] for i, r in enumerate(ranks) if i != slowest]
    waited = max(0.0, sum(others) / len(others) - ranks[slowest]["wait_s"]) if others else 0.0
    mean = sum(pairs) / len(pairs)
    calls = dict(ledger(sp).block_calls)
    since = {name: n - st.block_calls_base.get(name, 0) for name, n in calls.items()}
    if reset:
        st.baseline, st.work, st.block_calls_base = now, None, calls
    return {"ranks": ranks, "slowest_rank": slowest, "wait_for_slowest_s": waited,
            "work_max_over_mean": max(pairs) / mean if mean else 1.0,
            "kernels": {"block_calls": {k: n for k, n in since.items() if n}, "flash": flash_impl.describe()},
            "fit": _fit(sp)}


def _fit(sp) -> dict | None:
    """The last choice of ``patch(fit=True)`` on this group (None: none yet), with the peak the
    device measured since that step's forward began, where it reports one (CUDA)."""
    report = fit.reports.get(sp.ranks)
    if report is None:
        return None
    report = dict(report)
    if sp.ranks in fit.peaks:
        import torch

        device, start = fit.peaks[sp.ranks]
        report["measured_peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - start)
    return report
