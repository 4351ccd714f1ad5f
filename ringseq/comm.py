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
        self.group = group
        P = len(ranks)
        self.next = ranks[(me + 1) % P]
        self.prev = ranks[(me - 1) % P]

    def post(self, tensors: list[torch.Tensor]) -> "Transfer":
        """Start sending ``tensors`` to the next rank and receiving same-shaped ones from the
        previous rank. Returns a handle; its ``wait()`` gives the received tensors."""
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recvs]
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
