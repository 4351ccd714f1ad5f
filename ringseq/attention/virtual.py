"""The ring loop on P virtual ranks: threads of one process that pass blocks to each other.

``virtual_ring`` (``VirtualRing``) runs ringseq's own ring forward and backward (``ringseq.attention.ring``) for
P ranks in one process, on any device, with ``VirtualComm`` as the ring's transport
(``RingOptions.transport``): the GPU check uses it to run every block backend through the real
ring on one GPU, and the tests to check the CUDA backends' glue on the CPU. One lock passes
between the ranks (a rank computes only while it holds it and lets go while it waits for a
transfer), so their kernels never run concurrently and a ring of threads cannot deadlock.
"""
from __future__ import annotations

import contextlib
import math
import threading
import types

import torch

from ringseq import lockstep
from ringseq.errors import RingSeqError
from ringseq.layouts import global_positions

from . import ring
from .masks import TokenInfo


class Baton:
    """The lock the virtual ranks pass around, and their mailbox."""

    def __init__(self):
        self.cond = threading.Condition()
        self.mail: dict = {}
        self.rings: dict = {}
        """Rings each rank has started: the n-th ring of every rank is the same ring (head groups and
        calls come in the same order on every rank), which keys its mail."""


class VirtualComm:
    """``ringseq.attention.comm.RingComm``'s interface between the threads of one ``Baton``: a hop
    hands over a copy of the sent buffer (the copy a real transfer makes into its receive buffer)."""

    def __init__(self, baton: Baton, group, ranks, me, sp, label, clock, device, tag: int = 0):
        self.baton, self.ranks, self.me = baton, ranks, me
        with baton.cond:
            self.label = (label, baton.rings.get(me, 0))
            baton.rings[me] = self.label[1] + 1

    @classmethod
    def over(cls, baton: Baton):
        """The transport class of one virtual ring (what ``RingOptions.transport`` takes)."""
        return lambda *args, **kwargs: cls(baton, *args, **kwargs)

    def post(self, parts, step, shift=1, kind="kv"):
        P, box = len(self.ranks), self.baton
        to, frm = (self.me + shift) % P, (self.me - shift) % P
        flat = parts[0].clone() if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
        with box.cond:
            box.mail[(self.label, kind, step, self.me, to)] = flat
            box.cond.notify_all()
        return _Arrival(box, (self.label, kind, step, frm, self.me))


class _Arrival:
    def __init__(self, box, key):
        self.box, self.key = box, key

    def wait(self):
        with self.box.cond:  # waiting lets go of the lock: another rank computes meanwhile
            if not self.box.cond.wait_for(lambda: self.key in self.box.mail, timeout=600):
                raise TimeoutError(f"virtual ring: no block {self.key} within 600 s")
            return self.box.mail.pop(self.key)


def virtual_sp(P: int, r: int, stats: bool = False):
    """What the ring reads of a sequence group, for virtual rank r of P (its lockstep state's and
    ledger's key); ``stats``: the ring times its computes and waits into the ledger."""
    return types.SimpleNamespace(ranks=("virtual", P, r), size=P, stats=stats)


class VirtualRing:
    """ringseq's ring on P virtual ranks over the full q [B,H,S,D], k/v [B,K,S,D] (and ``dout``):
    each rank's shards are made once, in transformers' [B, s, heads, D] memory as a model hands
    them over; ``run`` runs the ring (forward, and backward with ``dout``) and returns each rank's
    results; ``gather`` puts them in global order. ``head_groups``: rings per call (1: one for all
    heads; ``ring.forward_by_heads``)."""

    def __init__(self, q, k, v, dout=None, *, P: int, layout, info: TokenInfo = TokenInfo(), sinks=None,
                 window=None, softcap=None, kernel=None, head_groups: int = 1, stats: bool = False):
        B, H, S, D = q.shape
        self.shape, self.P, self.baton = (q, k, v), P, Baton()
        self.idx = [global_positions(layout, S, P, r).to(q.device) for r in range(P)]
        self.opts = [ring.RingOptions(group=None, ranks=tuple(range(P)), r=r, layout=layout, causal=True,
                                      scale=1.0 / math.sqrt(D), kernel=kernel, window=window, softcap=softcap,
                                      info=info, sp=virtual_sp(P, r, stats), label="virtual",
                                      transport=VirtualComm.over(self.baton), head_groups=head_groups)
                     for r in range(P)]
        self.inputs = [[None if t is None else _seq_major(t[:, :, i]) for t in (q, k, v, dout)] for i in self.idx]
        self.sinks, self.backward = sinks, dout is not None

    def run(self, within=None) -> list:
        """[(out, dq, dk, dv) or (out,)] per rank, each in the rank's local order. ``within(r)``: a
        context manager each rank's thread runs inside (e.g. a dispatch mode: those are per thread)."""
        P = self.P
        results, errors = [None] * P, []

        def rank(r):
            q, k, v, dout = self.inputs[r]
            with self.baton.cond, (within(r) if within else contextlib.nullcontext()):  # a wait lets go of it
                try:
                    out, lse, aux = ring.forward_by_heads(q, k, v, self.sinks, self.opts[r])
                    grads = ()
                    if self.backward:
                        grads = ring.backward_by_heads(dout, q, k, v, self.sinks, out, lse, aux, self.opts[r])[:3]
                    results[r] = (out, *grads)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                    errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(P)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def settle(self) -> None:
        """Read the failure flags a GPU ring left to read later (``lockstep.check_later``)."""
        for opts in self.opts:
            late = lockstep.settle(opts.sp)
            if late is not None:
                raise RingSeqError(late)

    def gather(self, results) -> list:
        """Every rank's results in global order: [out] or [out, dq, dk, dv]."""
        q, k, v = self.shape
        full = [torch.empty_like(x) for x in (q, q, k, v)][:len(results[0])]
        for idx, parts in zip(self.idx, results):
            for f, p in zip(full, parts):
                f[:, :, idx] = p
        return full


def _seq_major(t: torch.Tensor) -> torch.Tensor:
    """t [B, heads, n, D] as a view of [B, n, heads, D] memory (how transformers hands q, k, v over)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def virtual_ring(q, k, v, dout=None, *, P: int, layout, info: TokenInfo = TokenInfo(), sinks=None,
                 window=None, softcap=None, kernel=None, head_groups: int = 1):
    """ringseq's ring on P virtual ranks over the full q [B,H,S,D], k/v [B,K,S,D]: returns
    [out] or, with ``dout``, [out, dq, dk, dv], each in global order."""
    vring = VirtualRing(q, k, v, dout, P=P, layout=layout, info=info, sinks=sinks, window=window, softcap=softcap,
                        kernel=kernel, head_groups=head_groups)
    results = vring.run()
    vring.settle()
    return vring.gather(results)
