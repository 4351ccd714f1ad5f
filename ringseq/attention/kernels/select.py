"""The one place that picks a block backend for a kernel call.

The choice depends on the inputs (device, dtype, head dim) and on what the call needs
(``Need``: a mask, a softcap, and whether the mask is variable-length runs). By default:

=========================  ===============  ==================================================
inputs                     call             backend
=========================  ===============  ==================================================
CUDA fp16/bf16, D <= 256   no mask          ``cuda_flash``
CUDA fp16/bf16, D <= 256   mask = runs      ``cuda_varlen`` (documents, padding, windows)
CUDA fp16/bf16/fp32        anything else    ``flex`` (softcap, masks that are not runs)
CPU                        no softcap       ``cpu_flash``
anything else                               ``torch``
=========================  ===============  ==================================================

so on CUDA no half-precision call falls back to plain fp32 matmuls (fp32 CUDA inputs get
``flex`` too: fused, in their own precision). A forced backend (``kernel=``) is used for every
call it can compute and refused, with the reason, for a call it cannot. ``flex`` off CUDA runs
only when forced, and forward only (its backward raises ``RingSeqError``).
"""
from __future__ import annotations

import dataclasses

import torch

from ringseq.errors import RingSeqError

from .common import BlockSpec
from .cpu_flash import CpuFlash
from .cuda_flash import CudaFlash
from .cuda_varlen import CudaVarlen
from .flex import Flex
from .torch_blocks import TorchBlocks

BACKENDS = {b.name: b for b in (CpuFlash, CudaFlash, CudaVarlen, Flex, TorchBlocks)}
ORDER = (CudaFlash, CudaVarlen, CpuFlash, Flex, TorchBlocks)  # fastest first


@dataclasses.dataclass(frozen=True)
class Need:
    """What one kernel call needs of its backend."""

    masked: bool = False
    """A mask (packed documents, padding, or a window that cuts the call)."""
    softcap: bool = False
    runs: bool = True
    """The mask is variable-length runs (``kernels.runs``); irrelevant without a mask."""


def need(spec: BlockSpec, device_type: str, B: int, n: int, m: int) -> Need:
    """The ``Need`` of a call; whether a mask is runs is worked out only where varlen could run."""
    masked = spec.mask is not None
    runs = not masked or device_type != "cuda" or CudaVarlen.expresses(spec, B, n, m)
    return Need(masked=masked, softcap=spec.softcap is not None, runs=runs)


def _cannot(backend, device_type: str, dtype: torch.dtype, head_dim: int, call: Need) -> str | None:
    """Why ``backend`` cannot run this call, or None."""
    if not backend.applies(device_type, dtype, head_dim):
        return _unfit(backend, device_type, dtype, head_dim)
    if call.masked and not backend.takes_mask:
        return "a mask (packed documents, padding or a window that cuts the block)"
    if call.softcap and not backend.takes_softcap:
        return "a softcap"
    if backend is CudaVarlen and call.masked and not call.runs:
        return "a mask that is not variable-length runs (padding inside a document, or windows that differ between samples)"
    return None


DEVICES, DTYPES = ("cpu", "cuda"), (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _unfit(backend, device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    """Which of device, dtype and head dim keeps ``backend`` from these inputs, in words."""
    def names(dtypes):
        return " or ".join(str(t).removeprefix("torch.") for t in dtypes)

    fits = backend.applies
    wrong = []
    devices = [d for d in DEVICES if any(fits(d, t, h) for t in DTYPES for h in (64, head_dim))]
    if device_type not in devices:
        wrong.append(f"inputs on {device_type} (it runs on {' or '.join(devices)} only)")
    dtypes = [t for t in DTYPES if any(fits(d, t, h) for d in DEVICES for h in (64, head_dim))]
    if dtype not in dtypes:
        wrong.append(f"{names([dtype])} inputs (it takes {names(dtypes)})")
    if not any(fits(d, t, head_dim) for d in DEVICES for t in DTYPES):
        wrong.append(f"head dim {head_dim} (too large for it)")
    return " and ".join(wrong) or f"{device_type} {names([dtype])} inputs of head dim {head_dim}"


def select(device_type: str, dtype: torch.dtype, head_dim: int, name: str | None = None, *, call: Need = Need()):
    """The backend for one call on inputs of this device type, dtype and head dim: ``name`` if
    given (refused only when it cannot apply to this call), else the fastest one that applies."""
    if name is not None:
        if name not in BACKENDS:
            raise RingSeqError(f"unknown kernel {name!r}: choose one of {', '.join(BACKENDS)}")
        why = _cannot(BACKENDS[name], device_type, dtype, head_dim, call)
        if why is not None:
            raise RingSeqError(f"kernel {name!r} cannot apply {why}; use kernel='torch' or leave kernel unset")
        return BACKENDS[name]
    for backend in ORDER:
        if backend is Flex and device_type != "cuda":
            continue  # eager FlexAttention off CUDA is unfused and has no backward: only when forced
        if _cannot(backend, device_type, dtype, head_dim, call) is None:
            return backend
    raise AssertionError("the torch backend applies to everything")


def for_call(q: torch.Tensor, name: str | None, spec: BlockSpec, n: int, m: int):
    """The backend for one ring call on inputs like ``q`` (``n`` query rows, ``m`` keys), with its
    device metadata (varlen runs, block masks, additive masks) built now, once per batch
    (``ringseq.attention.plan``), before any ring loop."""
    B, device = q.size(0), q.device
    backend = select(device.type, q.dtype, q.size(-1), name, call=need(spec, device.type, B, n, m))
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        prepare(spec, q, n, m)
    return backend
