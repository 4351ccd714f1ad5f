"""Point-to-point ring transfers in global ranks (torch.distributed; gloo or NCCL).

A transfer is posted before the block it overlaps is computed, and waited on after; there
is no barrier and no device synchronize inside the ring loop.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class RingComm:
    """Send to the next rank of the ring, receive from the previous one.

    ``ranks`` are the global ranks of the ring in ring order; ``me`` is this rank's index.
    """

    def __init__(self, group: dist.ProcessGroup, ranks: tuple[int, ...], me: int):
        self.group, self.ranks, self.me = group, ranks, me

    def post(self, tensors: list[torch.Tensor], shift: int = 1) -> "Transfer":
        """Start sending ``tensors`` to the rank ``shift`` places ahead (the next one by
        default) and receiving same-shaped ones from the rank ``shift`` places behind.
        Returns a handle; its ``wait()`` gives the received tensors."""
        P = len(self.ranks)
        to, frm = self.ranks[(self.me + shift) % P], self.ranks[(self.me - shift) % P]
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, frm, self.group) for t in recvs]
        return Transfer(dist.batch_isend_irecv(ops), recvs, sends)


class Transfer:
    def __init__(self, works, received, sent):
        self._works = works
        self._received = received
        self._sent = sent  # keep the send buffers alive until the transfer is done

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._sent = None
        return self._received
