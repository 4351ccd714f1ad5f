"""The ring loop on P virtual ranks: threads of one process that pass blocks to each other.

``virtual_ring`` runs ringseq's own ring forward and backward (``ringseq.attention.ring``) for
P ranks in one process, on any device, with ``VirtualComm`` as the ring's transport
(``RingOptions.transport``): the GPU check uses it to run every block backend through the real
ring on one GPU, and the tests to check the CUDA backends' glue on the CPU. One lock passes
between the ranks (a rank computes only while it holds it and lets go while it waits for a
transfer), so their kernels never run concurrently and a ring of threads cannot deadlock.
"""
from __future__ import annotations

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


class VirtualComm:
    """``ringseq.attention.comm.RingComm``'s interface between the threads of one ``Baton``: a hop
    hands over a copy of the sent buffer (the copy a real transfer makes into its receive buffer)."""

    def __init__(self, baton: Baton, group, ranks, me, sp, label, clock, device, tag: int = 0):
        self.baton, self.ranks, self.me, self.label = baton, ranks, me, label

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


def virtual_sp(P: int, r: int):
    """What the ring reads of a sequence group, for virtual rank r of P (its lockstep state's key)."""
    return types.SimpleNamespace(ranks=("virtual", P, r), size=P, stats=False)


def virtual_ring(q, k, v, dout=None, *, P: int, layout: str, info: TokenInfo = TokenInfo(), sinks=None,
                 window=None, softcap=None, kernel=None):
    """ringseq's ring on P virtual ranks over the full q [B,H,S,D], k/v [B,K,S,D]: returns
    [out] or, with ``dout``, [out, dq, dk, dv], each in global order."""
    B, H, S, D = q.shape
    results, errors, baton = [None] * P, [], Baton()

    def rank(r):
        idx = global_positions(layout, S, P, r).to(q.device)
        opts = ring.RingOptions(group=None, ranks=tuple(range(P)), r=r, layout=layout, causal=True,
                                scale=1.0 / math.sqrt(D), kernel=kernel, window=window, softcap=softcap, info=info,
                                sp=virtual_sp(P, r), label="virtual",
                                transport=VirtualComm.over(baton))
        qr, kr, vr = (t[:, :, idx].contiguous() for t in (q, k, v))
        with baton.cond:  # held while computing; a transfer's wait lets go of it
            try:
                out, lse, aux = ring.ring_forward(qr, kr, vr, sinks, opts)
                grads = ()
                if dout is not None:
                    grads = ring.ring_backward(dout[:, :, idx].contiguous(), qr, kr, vr, sinks, out, lse, aux,
                                               opts)[:3]
                results[r] = (idx, out, *grads)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for r in range(P):  # failure flags a GPU ring left to read later (``lockstep.check_later``)
        late = lockstep.settle(virtual_sp(P, r))
        if late is not None:
            raise RingSeqError(late)
    full = [torch.empty_like(x) for x in (q, q, k, v)][:1 if dout is None else 4]
    for idx, *parts in results:
        for f, p in zip(full, parts):
            f[:, :, idx] = p
    return full
