"""The one place that picks a block backend for a kernel call."""
from __future__ import annotations

import torch

from ringseq.errors import RingSeqError

from .cpu_flash import CpuFlash
from .cuda_flash import CudaFlash
from .torch_blocks import TorchBlocks

BACKENDS = {b.name: b for b in (CpuFlash, CudaFlash, TorchBlocks)}


def _cannot(backend, q: torch.Tensor, masked: bool, softcap: bool) -> str | None:
    """Why ``backend`` cannot run this call, or None."""
    if not backend.applies(q):
        return f"{q.device.type} {str(q.dtype).removeprefix('torch.')} inputs of head dim {q.size(-1)}"
    if masked and not backend.takes_mask:
        return "a mask (packed documents, padding or a window that cuts the block)"
    if softcap and not backend.takes_softcap:
        return "a softcap"
    return None


def select(q: torch.Tensor, name: str | None = None, *, masked: bool = False, softcap: bool = False):
    """The backend for one call on inputs like ``q``: ``name`` if given (refused only when it
    cannot apply to this call), else the fastest one that applies."""
    if name is not None:
        if name not in BACKENDS:
            raise RingSeqError(f"unknown kernel {name!r}: choose one of {', '.join(BACKENDS)}")
        why = _cannot(BACKENDS[name], q, masked, softcap)
        if why is not None:
            raise RingSeqError(f"kernel {name!r} cannot apply {why}; use kernel='torch' or leave kernel unset")
        return BACKENDS[name]
    for backend in (CudaFlash, CpuFlash, TorchBlocks):
        if _cannot(backend, q, masked, softcap) is None:
            return backend
    raise AssertionError("the torch backend applies to everything")
