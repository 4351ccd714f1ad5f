"""Point-to-point ring transfers in global ranks (torch.distributed; gloo or NCCL).

A transfer is posted before the block it overlaps is computed, and waited on after; there
is no barrier and no device synchronize inside the ring loop. Every transfer also carries a
one-integer status (0: fine, 1: the sender or a rank before it failed during this call), so a
rank whose block kernel raised still completes the ring's transfers and its peers learn of
the failure instead of computing on with a stale block (``ringseq.attention.ring``). Waits are
bounded by ``sp.timeout`` (``ringseq.lockstep.wait``); a transfer that cannot even be posted
(a peer's process is gone) is a ``RingSeqError`` naming that peer. Each transfer is tagged with
its call's lockstep number and ring step, so a message left over from a failed call never pairs
with a later call's.

The ring takes its transport as an argument (``RingOptions.transport``): this class by default,
another with the same interface where a caller runs the ring some other way (the GPU check's
virtual ring of threads).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ringseq import lockstep


class RingComm:
    """Send to the next rank of the ring, receive from the previous one.

    ``ranks`` are the global ranks of the ring in ring order; ``me`` is this rank's index;
    ``sp`` gives the timeout; ``label`` names the call in errors; ``clock`` (``ringseq.ledger``)
    gets the time spent waiting; ``tag`` is the call's lockstep number (transfers are tagged
    with it and their step).
    """

    def __init__(self, group: dist.ProcessGroup, ranks: tuple[int, ...], me: int, sp, label: str, clock, device,
                 tag: int = 0):
        self.group, self.ranks, self.me, self.sp, self.label, self.clock = group, ranks, me, sp, label, clock
        self.tag = tag
        self.status = torch.zeros(1, dtype=torch.int64, device=device)
        """1 once this rank failed or heard of a failure during this call (sent with every transfer)."""
        self._buffers: dict[str, list] = {}
        """Receive buffers per kind of transfer, used in turn: two sets for K/V (the block received
        at step t is computed on, and sent on, at step t+1 while step t+1's block arrives in the
        other set); for gradient accumulators as many as the ring asks (``post(sets=...)``: one
        where a received pair is added into this rank's own before the next post, two where the
        received pair itself is sent on)."""

    def fail(self) -> None:
        self.status.fill_(1)

    def post(self, tensors: list[torch.Tensor], step: int, shift: int = 1, kind: str = "kv",
             sets: int = 2) -> "Transfer":
        """Start sending ``tensors`` (and the status) to the rank ``shift`` places ahead (the
        next one by default) and receiving same-shaped ones from the rank ``shift`` places
        behind, into the next of this ``kind``'s ``sets`` preallocated buffer sets (a kind whose
        shapes change gets new ones; ``sets=1`` when the caller is done with what it received
        before it posts again). Returns a handle; its ``wait()`` gives the received tensors."""
        P = len(self.ranks)
        to, frm = self.ranks[(self.me + shift) % P], self.ranks[(self.me - shift) % P]
        wired = [wire(t) for t in tensors]
        sends = [w for w, _ in wired] + [self.status.clone()]
        recvs = self._next_buffers(kind, sends, sets)
        tag = _tag(self.tag, kind, step, P)
        ops = [dist.P2POp(dist.isend, t, to, self.group, tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, frm, self.group, tag) for t in recvs]
        since = time.time()
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            what = f"posting ring step {step + 1} of {self.label} (to global rank {to}, from global rank {frm})"
            raise lockstep.transport_error(self.sp, what, to, exc, since) from exc
        return Transfer(self, works, recvs, sends, step, frm, [flip for _, flip in wired])

    def _next_buffers(self, kind: str, like: list[torch.Tensor], count: int = 2) -> list[torch.Tensor]:
        sets = self._buffers.get(kind, [])
        if sets and [(b.shape, b.dtype) for b in sets[0]] != [(t.shape, t.dtype) for t in like]:
            sets = []
        if len(sets) < count:  # the first transfers of a kind allocate its sets
            self._buffers[kind] = sets + [[torch.empty_like(t) for t in like]]
            return self._buffers[kind][-1]
        self._buffers[kind] = sets[1:] + sets[:1]
        return sets[0]

    def failed(self) -> bool:
        """Whether this rank or any rank before it failed during this call (one flag read)."""
        return bool(self.status.item())


KIND_CODES = {"kv": 0, "dkv": 1}


def _tag(number: int, kind: str, step: int, P: int) -> int:
    """A transfer's tag: its call's lockstep number, its kind and its step (gloo pairs a receive
    with a send of the same tag only; NCCL ignores tags and orders by stream)."""
    return ((number * len(KIND_CODES) + KIND_CODES.get(kind, 0)) * (P + 1) + step) % (2**31 - 1)


def wire(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The contiguous tensor that carries ``t``, and whether it is ``t.transpose(1, 2)``. Every rank
    must send what its peer receives into, so the layout is fixed, not each tensor's own: a
    [B, K, s, D] block travels as its [B, s, K, D] memory (transformers' layout, which the kernels
    take and return: no copy for a tensor already so); tensors of fewer dims as they are."""
    if t.dim() >= 3:
        return t.transpose(1, 2).contiguous(), True
    return t.contiguous(), False


def travels_as_is(t: torch.Tensor) -> bool:
    """Whether ``t`` crosses the wire without a copy (``wire``)."""
    return t.transpose(1, 2).is_contiguous() if t.dim() >= 3 else t.is_contiguous()


class Transfer:
    def __init__(self, comm: RingComm, works, received, sent, step: int, peer: int, flips: list[bool]):
        self._comm, self._works, self._received, self._sent = comm, works, received, sent
        self._step, self._peer = step, peer  # the send buffers stay alive until the transfer is done
        self._flips = flips
        """Per tensor: sent as its transpose(1, 2), so the received one is viewed back the same way."""

    def wait(self) -> list[torch.Tensor]:
        comm = self._comm
        start = time.perf_counter()
        what = f"ring step {self._step + 1} of {comm.label}: the block from global rank {self._peer}"
        for work in self._works:
            lockstep.wait(work, comm.sp, what, peer=self._peer)
        comm.clock.time("wait_s", start)
        self._sent = None
        *received, status = self._received
        torch.maximum(comm.status, status, out=comm.status)
        return [r.transpose(1, 2) if flip else r for r, flip in zip(received, self._flips, strict=True)]
