"""Event simulator of ring attention over up to 100,000 ranks: one layer's ring passes, rank by rank.

Each rank r at ring step t starts when it holds the step's K/V block, T[r, t]. It posts the
block's transfer to its successor (a link carries one transfer at a time: the send starts at
max(T[r, t], link free) and occupies the link for latency + bytes / bandwidth), computes for
``compute[r] * jitter`` seconds, and begins step t+1 at
    T[r, t+1] = max(T[r, t] + compute, arrival of the block its predecessor sent at step t).
Without per-step noise the recurrence is solved in closed form (``ring_closed_form``, exact,
checked against the step-by-step recurrence in the tests): a 100,000-rank ring takes about a
second. With per-step noise (``jitter_sigma``) it runs step by step, vectorised over ranks.

Arrangements of P = rows x cols ranks (``cols`` ranks per node, rank r = row * cols + col):
``ring``     one ring through all P ranks in rank order: intra-node links, one inter-node link per node.
``ulysses``  Ulysses over the ``cols`` ranks of a node (an all-to-all that waits for the node's
             slowest rank, before and after), then ``cols`` rings of ``rows`` ranks across nodes.
``ring2d``   a ring of rings (double ring): per outer step the node's ranks run an inner ring of
             ``cols`` steps over intra-node links while each rank forwards the outer block to the
             same rank of the next node; the next outer step waits for both (node-synchronous).
Times in seconds; arrays [rows, cols].
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ringseq.errors import RingSeqError

ARRANGEMENTS = ("ring", "ulysses", "ring2d")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds of one ring step's compute per rank (full-size steps), and of one transfer."""

    compute: float
    """Compute of one ring step on a healthy rank."""
    intra: float
    """Transfer of one block between ranks of a node (latency + bytes / bandwidth)."""
    inter: float
    """Transfer of one block between nodes."""
    all_to_all: float = 0.0
    """One Ulysses all-to-all (``ulysses`` arrangement)."""


@dataclasses.dataclass(frozen=True)
class Result:
    """``finish`` [rows, cols]: when each rank ends the layer; ``makespan``: the slowest."""

    finish: np.ndarray
    seconds: float

    @property
    def makespan(self) -> float:
        return float(self.finish.max())

    def percentiles(self) -> dict[str, float]:
        q = np.percentile(self.finish, [50, 90, 99])
        return dict(p50=float(q[0]), p90=float(q[1]), p99=float(q[2]), max=self.makespan)


def slowdowns(rows: int, cols: int, *, slow_rank: int | None = None, slow_factor: float = 1.0,
              slow_extra_s: float = 0.0, sigma: float = 0.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(factor [rows, cols], extra seconds [rows, cols]) per rank: a lognormal(0, sigma) spread
    of persistent speeds, and one throttled rank (compute x slow_factor, + slow_extra_s per step)."""
    factor = np.ones((rows, cols))
    if sigma:
        factor = np.random.default_rng(seed).lognormal(0.0, sigma, (rows, cols))
    extra = np.zeros((rows, cols))
    if slow_rank is not None:
        factor.flat[slow_rank] *= slow_factor
        extra.flat[slow_rank] += slow_extra_s
    return factor, extra


def _ring(T: np.ndarray, work: np.ndarray, link: np.ndarray, steps: int, axis: int, jitter=None) -> np.ndarray:
    """Run ``steps`` ring steps along ``axis`` from start times T; ``work`` [rows, cols] compute
    per step, ``link`` [rows, cols] transfer time of the link leaving each rank."""
    T = T.copy()
    free = np.zeros_like(T)
    done, send = np.empty_like(T), np.empty_like(T)
    for t in range(steps):
        np.add(T, work if jitter is None else work * jitter[t % len(jitter)], out=done)
        if t == steps - 1:
            return done
        np.maximum(T, free, out=send)
        np.add(send, link, out=free)  # the link is busy until the block arrives
        np.maximum(done, np.roll(free, 1, axis=axis), out=T)
    return T


def _previous_greater(x: np.ndarray) -> np.ndarray:
    """For each position, the nearest earlier position holding a strictly greater value (-1: none)."""
    out = np.full(len(x), -1, dtype=np.int64)
    stack: list[int] = []
    values = x.tolist()
    for p, v in enumerate(values):
        while stack and values[stack[-1]] <= v:
            stack.pop()
        if stack:
            out[p] = stack[-1]
        stack.append(p)
    return out


def ring_closed_form(work: np.ndarray, link: np.ndarray, steps: int) -> np.ndarray:
    """Finish times [P] of ``steps`` ring steps, all ranks starting at 0, without per-step noise.

    The recurrence of ``_ring`` is max-plus linear: T[i, t] is the heaviest path into rank i
    that shifts k times (k links i-k..i-1, each at least one step at its transfer time m) and
    spends its other t - k steps computing or waiting on a link it crossed, each at most
    C(i, k) = the largest w or m on the way. Within a range of k where C is constant the path
    gets lighter with k (each shift swaps a step of C for an m <= C), so only the k where C
    grows count: the previous-greater-element chain of the sequence w_i, m_{i-1}, w_{i-1}, ...
    (a few dozen links even for random speeds). Exact, O(P x chain) instead of O(P x steps).
    """
    P = len(work)
    seq = np.empty(2 * P)
    seq[0::2], seq[1::2] = work, link
    seq = np.concatenate([seq, seq])
    pge = _previous_greater(seq)
    mpre = np.concatenate([[0.0], np.cumsum(np.concatenate([link, link]))])
    i = np.arange(P)
    pos0 = 2 * (P + i)
    cur = pos0.copy()
    best = (steps - 1) * seq[pos0]
    active = np.ones(P, dtype=bool)
    while active.any():
        cur = np.where(active, pge[cur], cur)
        k = (P + i) - cur // 2
        active &= (cur >= 0) & (k <= steps - 1)
        if not active.any():
            break
        cand = mpre[P + i] - mpre[P + i - k] + (steps - 1 - k) * seq[cur]
        best = np.where(active, np.maximum(best, cand), best)
    return best + work


def simulate(arrangement: str, rows: int, cols: int, costs: Costs, *, factor=None, extra=None,
             jitter_sigma: float = 0.0, seed: int = 0) -> Result:
    """One layer's ring pass over P = rows x cols ranks (see the module docstring).

    ``factor``/``extra`` [rows, cols] (``slowdowns``) scale and lengthen each rank's step
    compute; ``jitter_sigma`` adds a per-step lognormal noise (a table of 16 draws, cycled)."""
    import time

    if arrangement not in ARRANGEMENTS:
        raise RingSeqError(f"unknown arrangement {arrangement!r}: choose one of {list(ARRANGEMENTS)}")
    if rows < 1 or cols < 1:
        raise RingSeqError(f"rows and cols must be >= 1, got {rows} x {cols}")
    start = time.perf_counter()
    factor = np.ones((rows, cols)) if factor is None else np.asarray(factor, dtype=float)
    extra = np.zeros((rows, cols)) if extra is None else np.asarray(extra, dtype=float)
    work = costs.compute * factor + extra
    jitter = None
    if jitter_sigma:
        jitter = np.random.default_rng(seed + 1).lognormal(0.0, jitter_sigma, (16, rows, cols))
    T = np.zeros((rows, cols))
    if arrangement == "ring":
        flat_link = np.full(rows * cols, costs.intra)
        flat_link[cols - 1::cols] = costs.inter  # the last rank of each node sends to the next node
        if jitter is None:
            finish = ring_closed_form(work.reshape(-1), flat_link, rows * cols).reshape(rows, cols)
        else:
            finish = _ring(T.reshape(1, -1), work.reshape(1, -1), flat_link.reshape(1, -1), rows * cols, 1,
                           jitter.reshape(16, 1, -1)).reshape(rows, cols)
    elif arrangement == "ulysses":
        T = np.broadcast_to(T.max(axis=1, keepdims=True) + costs.all_to_all, T.shape)
        link = np.full((rows, cols), costs.inter if rows > 1 else 0.0)
        if jitter is None:  # every ring starts when the all-to-all ends
            finish = np.stack([ring_closed_form(work[:, u], link[:, u], rows) for u in range(cols)], 1) + T
        else:
            finish = _ring(T, work, link, rows, 0, jitter)
        finish = np.broadcast_to(finish.max(axis=1, keepdims=True) + costs.all_to_all, T.shape).copy()
    else:
        # a node's inner ring (cols steps over intra links) acts as one outer rank of compute W_n;
        # the outer ring of rows nodes forwards blocks over inter links while it runs. A node
        # starts an outer step when all its ranks may (the inner ring couples them anyway).
        inner = _ring(T, work, np.full((rows, cols), costs.intra), cols, 1, None if jitter is None else jitter[:cols])
        W = inner.max(axis=1)
        starts = ring_closed_form(W, np.full(rows, costs.inter), rows) - W
        finish = starts[:, None] + inner
    return Result(finish, time.perf_counter() - start)
