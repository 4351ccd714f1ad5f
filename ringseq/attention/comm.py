"""Point-to-point ring transfers in global ranks (torch.distributed; gloo or NCCL): one flat buffer a hop.

Each hop moves one flat buffer: a K/V block is ``[K | V | status]`` in K's dtype, a dK/dV
accumulator ``[dK | dV | status]`` in fp32 (fp64 for fp64 inputs) (``Block``). The status is
one element, 0 while the ranks the buffer passed through were fine and nonzero once one of them
failed during this call, so a rank whose block kernel raised still completes the ring's
transfers and its peers learn of the failure instead of computing on with a stale block
(``ringseq.attention.ring``). A received buffer is sent on as it is at the next hop: no copy,
and no device operation for the status unless this rank failed (it then marks the buffer it
sends). Only the first hop of a call sends the tensors the ring was given (K, V and a constant
status: three sends into the receiver's one buffer), so K and V are never packed by a copy.

Receive buffers are preallocated per kind of transfer, two sets used in turn (the block received
at step t is computed on, and sent on, at step t+1 while step t+1's block arrives in the other
set; dK/dV likewise). A transfer is posted before the block it overlaps is computed and waited
on after; there is no barrier and no device synchronisation inside the ring loop. Waits are
bounded by ``sp.timeout`` (``ringseq.lockstep.wait``); a transfer that cannot even be posted (a
peer's process is gone) is a ``RingSeqError`` naming that peer. Each transfer is tagged with its
call's lockstep number, kind and ring step, so a message left over from a failed call never pairs
with a later call's.

The ring takes its transport as an argument (``RingOptions.transport``): this class by default,
another with the same interface where a caller runs the ring some other way (the GPU check's
virtual ring of threads, ``ringseq.attention.virtual``).
"""
from __future__ import annotations

import functools
import math
import time

import torch
import torch.distributed as dist

from ringseq import lockstep


class Block:
    """Tensors that travel as one flat buffer: views of it in the ring's layout, and its status.

    ``shapes``: the [B, heads, n, D] shape of each tensor; each lies in the buffer as its
    ``[B, n, heads, D]`` memory (transformers' layout, which the kernels take and return: K and V
    from a model cross the wire without a copy) and is viewed back with ``transpose(1, 2)``."""

    def __init__(self, flat: torch.Tensor, shapes):
        self.flat, self.shapes = flat, shapes
        views, at = [], 0
        for B, h, n, D in shapes:
            size = B * h * n * D
            views.append(flat[at:at + size].view(B, n, h, D).transpose(1, 2))
            at += size
        self.views = views
        self.status = flat[at:at + 1]

    @staticmethod
    def numel(shapes) -> int:
        return sum(math.prod(s) for s in shapes) + 1

    @classmethod
    def zeros(cls, shapes, dtype, device) -> "Block":
        return cls(torch.zeros(cls.numel(shapes), dtype=dtype, device=device), shapes)


def wire(t: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor that carries ``t`` [B, heads, n, D]: its [B, n, heads, D] memory."""
    return t.transpose(1, 2)


def travels_as_is(t: torch.Tensor) -> bool:
    """Whether ``t`` [B, heads, n, D] crosses the wire without a copy (``wire``)."""
    return t.transpose(1, 2).is_contiguous()


@functools.lru_cache(maxsize=64)
def _constant_status(value: int, dtype, device: str) -> torch.Tensor:
    """A one-element status to send beside tensors not in a buffer (never written)."""
    return torch.full((1,), value, dtype=dtype, device=device)


def first_parts(tensors, dtype, failed: bool) -> list[torch.Tensor]:
    """The pieces of a block not yet in a buffer (a call's own K and V): each tensor's wire
    memory and a constant status, sent as three pieces into the receiver's one buffer."""
    device = tensors[0].device
    return [wire(t) for t in tensors] + [_constant_status(1 if failed else 0, dtype, str(device))]


class RingComm:
    """Send to the rank ``shift`` places ahead in the ring, receive from the one as far behind.

    ``ranks`` are the global ranks of the ring in ring order; ``me`` is this rank's index;
    ``sp`` gives the timeout; ``label`` names the call in errors; ``clock`` (``ringseq.ledger``)
    gets the time spent waiting; ``tag`` is the call's lockstep number (transfers are tagged
    with it, their kind and their step).
    """

    def __init__(self, group: dist.ProcessGroup, ranks: tuple[int, ...], me: int, sp, label: str, clock, device,
                 tag: int = 0):
        self.group, self.ranks, self.me, self.sp, self.label, self.clock = group, ranks, me, sp, label, clock
        self.tag, self.device = tag, device
        self._buffers: dict[str, list] = {}
        """Two receive buffers per kind of transfer, used in turn."""

    def post(self, parts: list[torch.Tensor], step: int, shift: int = 1, kind: str = "kv") -> "Transfer":
        """Start sending ``parts`` (one flat buffer, or the pieces of one: ``first_parts``) to the
        rank ``shift`` places ahead and receiving the same pieces, from the rank as far behind, into
        the next of this kind's two flat buffers. Returns a handle whose ``wait()`` gives that buffer."""
        P = len(self.ranks)
        to, frm = self.ranks[(self.me + shift) % P], self.ranks[(self.me - shift) % P]
        sizes = [p.numel() for p in parts]
        flat = self.buffer(kind, sum(sizes), parts[0].dtype)
        pieces = list(flat.split(sizes)) if len(parts) > 1 else [flat]
        tag = _tag(self.tag, kind, step, P)
        ops = [dist.P2POp(dist.isend, p, to, self.group, tag) for p in parts]
        ops += [dist.P2POp(dist.irecv, p, frm, self.group, tag) for p in pieces]
        since = time.time()
        # NCCL coalesces the hop into one group call; gloo (CPU tensors) posts each op on its own anyway, so
        # its sends and receives are posted apart: a post that fails names the peer whose connection closed
        # (a dead predecessor fails the receive while the send to a healthy successor posts)
        batches = [ops] if self.device.type != "cpu" else [ops[:len(parts)], ops[len(parts):]]
        works = []
        for batch in batches:
            try:
                works += dist.batch_isend_irecv(batch)
            except RuntimeError as exc:
                peer = frm if batch[0].op is dist.irecv else to
                what = f"posting ring step {step + 1} of {self.label} (to global rank {to}, from global rank {frm})"
                raise lockstep.transport_error(self.sp, what, peer, exc, since) from exc
        return Transfer(self, works, flat, parts, step, [to] * len(parts) + [frm] * len(pieces))

    def buffer(self, kind: str, numel: int, dtype) -> torch.Tensor:
        """The next of this kind's two receive buffers (allocated by the first transfers of a kind;
        a kind whose size or dtype changes gets new ones)."""
        sets = self._buffers.get(kind, [])
        if sets and (sets[0].numel(), sets[0].dtype) != (numel, dtype):
            sets = []
        if len(sets) < 2:
            self._buffers[kind] = sets + [torch.empty(numel, dtype=dtype, device=self.device)]
            return self._buffers[kind][-1]
        self._buffers[kind] = sets[1:] + sets[:1]
        return sets[0]


KIND_CODES = {"kv": 0, "dkv": 1}


def _tag(number: int, kind: str, step: int, P: int) -> int:
    """A transfer's tag: its call's lockstep number, its kind and its step (gloo pairs a receive
    with a send of the same tag only; NCCL ignores tags and orders by stream)."""
    return ((number * len(KIND_CODES) + KIND_CODES.get(kind, 0)) * (P + 1) + step) % (2**31 - 1)


class Transfer:
    def __init__(self, comm: RingComm, works, received: torch.Tensor, sent, step: int, peers: list[int]):
        self._comm, self._works, self._received, self._sent = comm, works, received, sent
        self._step, self._peers = step, peers  # the sent tensors stay alive until the transfer is done
        """The global rank each work sends to or receives from (a failed work names its own peer)."""

    def wait(self) -> torch.Tensor:
        """The received flat buffer, once every send and receive of the hop is done."""
        comm = self._comm
        start = time.perf_counter()
        what = f"ring step {self._step + 1} of {comm.label}: the block from global rank {self._peers[-1]}"
        peers = self._peers if len(self._peers) == len(self._works) else [self._peers[-1]] * len(self._works)
        for work, peer in zip(self._works, peers):
            lockstep.wait(work, comm.sp, what, peer=peer)
        comm.clock.time("wait_s", start)
        self._sent = None
        return self._received
