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

from ringseq.layouts import global_positions

from . import ring
from .masks import TokenInfo


class Baton:
    """The lock the virtual ranks pass around, and their mailbox."""

    def __init__(self):
        self.cond = threading.Condition()
        self.mail: dict = {}


class VirtualComm:
    """``ringseq.attention.comm.RingComm``'s interface between the threads of one ``Baton``."""

    def __init__(self, baton: Baton, group, ranks, me, sp, label, clock, device, tag: int = 0):
        self.baton, self.ranks, self.me, self.label = baton, ranks, me, label
        self.status = torch.zeros(1, dtype=torch.int64, device=device)

    @classmethod
    def over(cls, baton: Baton):
        """The transport class of one virtual ring (what ``RingOptions.transport`` takes)."""
        return lambda *args, **kwargs: cls(baton, *args, **kwargs)

    def fail(self):
        self.status.fill_(1)

    def failed(self):
        return bool(self.status.item())

    def post(self, tensors, step, shift=1, kind="kv", sets=2):  # sets: RingComm's buffers, none here
        P, box = len(self.ranks), self.baton
        to, frm = (self.me + shift) % P, (self.me - shift) % P
        with box.cond:
            box.mail[(self.label, kind, step, self.me, to)] = [t.clone() for t in tensors] + [self.status.clone()]
            box.cond.notify_all()
        return _Arrival(self, box, (self.label, kind, step, frm, self.me))


class _Arrival:
    def __init__(self, comm, box, key):
        self.comm, self.box, self.key = comm, box, key

    def wait(self):
        with self.box.cond:  # waiting lets go of the lock: another rank computes meanwhile
            if not self.box.cond.wait_for(lambda: self.key in self.box.mail, timeout=600):
                raise TimeoutError(f"virtual ring: no block {self.key} within 600 s")
            *got, status = self.box.mail.pop(self.key)
        torch.maximum(self.comm.status, status, out=self.comm.status)
        return got


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
                                sp=types.SimpleNamespace(ranks=("virtual", P, r), size=P, stats=False), label="virtual",
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
    full = [torch.empty_like(x) for x in (q, q, k, v)][:1 if dout is None else 4]
    for idx, *parts in results:
        for f, p in zip(full, parts):
            f[:, :, idx] = p
    return full
