"""Ranks in lockstep: every ringseq collective is agreed, and every wait is bounded.

Each ringseq collective of a sequence group (a batch handed to ``shard_batch`` or a patched
forward, a ``ring_attention`` call, its backward) starts with one all-gather of a fixed-size
integer record (``RECORD`` int64): which collective, its sequence number on this rank, and
every argument that must agree (shapes, dtype, layout, causal, scale, window, softcap, kernel,
which tensors are present). Records have one size whatever they hold, so ranks that are out of
step still meet in an all-gather of equal size, see each other's records and raise
``RingSeqError`` on every rank, naming both sides, before any tensor of mismatched size
crosses the wire. The record travels over a CPU (gloo) group, so on GPU it costs no device
synchronisation.

Every wait is bounded by ``sp.timeout``: a peer that does not answer in time (stopped,
deadlocked, swapping), or whose process died, ends the wait with a ``RingSeqError`` saying
which collective, ring step, layer and peer rank it was waiting for.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import struct
import time

import torch
import torch.distributed as dist

from .errors import RingSeqError

RECORD = 64
"""int64 slots of every agreement record (fixed: mismatched ranks still exchange equal sizes)."""

KINDS = ("batch", "ring_attention forward", "ring_attention backward", "gather")

_layer = contextvars.ContextVar("ringseq_layer", default=-1)
_counters: dict = {}
_failed: dict = {}


@contextlib.contextmanager
def layer(index: int | None):
    """Name the model layer the ringseq calls inside belong to (errors and records say it)."""
    token = _layer.set(-1 if index is None else int(index))
    try:
        yield
    finally:
        _layer.reset(token)


def current_layer() -> int:
    return _layer.get()


def float_bits(x: float | None) -> int:
    """A float as the int64 with its bits (None -> 0), so records compare floats exactly."""
    return 0 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


KERNELS = ("cpu_flash", "cuda_flash", "torch", "cuda_varlen", "flex")
"""Block backends by record code (``ringseq.attention.kernels.BACKENDS``; -1: chosen per call)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.int8, torch.uint8, torch.int16)


def dtype_code(t) -> int:
    """A small integer for a tensor's dtype in records (-2: not a tensor, -1: None)."""
    if t is None:
        return -1
    if not torch.is_tensor(t):
        return -2
    return DTYPES.index(t.dtype) if t.dtype in DTYPES else 99


def checksum(t: torch.Tensor) -> int:
    """A position-weighted sum of a tensor's bits: equal tensors give equal values on every
    rank; different or reordered values almost surely do not (floats: a strided sample of at
    most ~1M values)."""
    x = t.detach().reshape(-1)
    if x.is_floating_point():
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        x = x[:: x.numel() // 2**20 + 1].view(bits)
    weights = torch.arange(x.numel(), device=x.device) % 65521 + 1
    return int((x.long() * weights).sum())


def _dtype_name(code: int) -> str:
    return {-1: "None", -2: "not a tensor", 99: "another dtype"}.get(code) or str(DTYPES[code]).replace("torch.", "")


def mark_failed(sp, failed: bool) -> None:
    """Remember whether this rank's last ringseq collective raised (the next record says so)."""
    _failed[sp.ranks] = failed


def agree(sp, kind: str, fields: dict[str, int], hint: str = "") -> int:
    """All-gather this rank's record of the collective it is about to make; raise
    ``RingSeqError`` on every rank unless all records are equal. Returns its sequence number."""
    number = _counters.get(sp.ranks, 0)
    _counters[sp.ranks] = number + 1
    if sp.size == 1:
        return number
    from .layouts import LAYOUTS

    names = ["kind", "number", "layer", "previous call raised", "layout", "ulysses_size", *fields]
    values = [KINDS.index(kind), number, current_layer(), int(_failed.get(sp.ranks, False)),
              LAYOUTS.index(sp.layout), sp.ulysses_size, *fields.values()]
    if len(values) > RECORD:
        raise AssertionError(f"a lockstep record holds at most {RECORD} fields")
    mine = torch.tensor(values + [0] * (RECORD - len(values)), dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(sp.size)]
    from .stats import Clock, ledger

    start = time.perf_counter()
    work = dist.all_gather(every, mine, group=sp.check_group, async_op=True)
    wait(work, sp, f"the agreement of {kind} #{number}{_at_layer()}", peer=None, gloo=True)
    Clock(ledger(sp)).time("wait_s", start)
    _failed[sp.ranks] = False
    rows = torch.stack(every)
    if bool((rows == mine).all()):
        return number
    _failed[sp.ranks] = True  # every rank raises here: they all say so next time, and agree again
    raise RingSeqError(_mismatch(rows, names, hint))


def _at_layer() -> str:
    return f" (layer {current_layer()})" if current_layer() >= 0 else ""


FLOAT_FIELDS = {"scale", "softcap", "window", "slab_rows"}


def _mismatch(rows: torch.Tensor, names: list[str], hint: str) -> str:
    first = rows[0].tolist()
    lines = []
    for r in range(1, rows.size(0)):
        other = rows[r].tolist()
        if other == first:
            continue
        if other[0] != first[0] or other[1] != first[1]:
            raised = [f"group rank {i}" for i, row in ((0, first), (r, other)) if row[3]]
            news = f"; the previous ringseq call of {' and '.join(raised)} raised (see its error)" if raised else ""
            what = [f"group rank 0 is at ringseq collective #{first[1]} ({KINDS[first[0]]}"
                    f"{_layer_of(first)}) while group rank {r} is at #{other[1]} ({KINDS[other[0]]}{_layer_of(other)})"
                    + news]
        else:
            diffs = [f"{name}: rank 0 {_show(name, a)}, rank {r} {_show(name, b)}"
                     for name, a, b in zip(names, first, other) if a != b]
            what = [f"group rank 0 and group rank {r} differ in {KINDS[first[0]]} #{first[1]}{_layer_of(first)}: "
                    + "; ".join(diffs)]
        lines += what
    hint = hint or ("every rank of a group must make the same ringseq calls with the same arguments and shapes "
                    "(same batch, same model, no rank skipping a step or a layer after an exception)")
    return "the ranks of a sequence group are out of step: " + " | ".join(lines) + ". " + hint


def _layer_of(row: list[int]) -> str:
    return f", layer {row[2]}" if row[2] >= 0 else ""


def _show(name: str, value: int) -> str:
    if name in FLOAT_FIELDS:
        return "None" if value == 0 else repr(_from_bits(value))
    if name == "previous call raised":
        return "yes" if value else "no"
    if name.endswith("dtype") or name == "sinks":
        return _dtype_name(value)
    if name == "kernel":
        return {-1: "auto", 99: "unknown"}.get(value) or KERNELS[value]
    if name == "layout":
        from .layouts import LAYOUTS

        return LAYOUTS[value]
    return str(value)


def wait(work, sp, what: str, peer: int | None, gloo: bool | None = None) -> None:
    """Wait for ``work`` at most ``sp.timeout`` seconds (gloo), re-raising a timeout or a dead
    peer's transport error as ``RingSeqError`` that says what was awaited. NCCL work is
    stream-ordered (waiting blocks no host); its group timeout bounds it instead. ``gloo``:
    whether the work ran on a gloo group (default: whether ``sp``'s groups are gloo)."""
    if work is None:
        return
    try:
        if not (gloo if gloo is not None else not sp.nccl):
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=sp.timeout))
    except RuntimeError as exc:
        mark_failed(sp, True)
        from_whom = f"global rank {peer}" if peer is not None else "the other ranks of the group"
        text = str(exc)
        if "Timed out" in text or "timeout" in text.lower():
            cause = (f"no answer from {from_whom} within the {sp.timeout:g} s timeout (ringseq.init(timeout=...) "
                     f"or RINGSEQ_TIMEOUT): that rank is stopped, stuck, far slower, or itself waiting for another")
        else:
            cause = f"{from_whom} failed or exited ({text.splitlines()[0][:200]})"
        raise RingSeqError(f"while waiting for {what}: {cause}") from exc
