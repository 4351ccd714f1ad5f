"""Ranks in lockstep: every ringseq collective is agreed, and every wait is bounded.

Each ringseq collective of a sequence group (a batch handed to ``shard_batch`` or a patched
forward, a ``ring_attention`` call, its backward, a ``gather``) starts with one all-gather of a
fixed-size integer record (``RECORD`` int64): which collective, its sequence number on this
rank, and every argument that must agree (shapes, dtype, layout, causal, scale, window,
softcap, kernel, which tensors are present). Records have one size whatever they hold, so ranks
that are out of step still meet in an all-gather of equal size, see each other's records and
raise ``RingSeqError`` on every rank, naming both sides, before any tensor of mismatched size
crosses the wire. The record travels over a CPU (gloo) group, so on GPU it costs no device
synchronisation. Its last slots carry this rank's timing ledger (``ringseq.ledger``), so every
rank always knows its peers' timings without a collective of its own (``ringseq.stats``).

After a failure no result is produced until the ranks are provably back in step. A rank whose
call raised keeps the fingerprint of that first failed call (number, kind, layer) in every
record until it is in step again: ranks that all failed in the same call are in step (they go
on from the same point) and their next agreement clears it; ranks that failed in different
calls refuse every call until a resync point: the next batch (``shard_batch``, a patched
forward: the records then compare the batch itself, not the call numbers, and carry a digest of
each rank's last few batches, so a rank whose batch a peer has had already is behind: it raises
and its loop skips that batch, while the rank ahead waits for it), or ``ringseq.resync(sp,
step)`` in a loop of raw ``ring_attention`` calls (the step numbers order the ranks).

Every wait is bounded by ``sp.timeout``. A wait that times out or whose peer's transport fails
names what it waited for and, from notes in the store (``ringseq.peers``), the rank that
stalled or raised; the groups' transfers are then out of step for good (a stray message can
pair with a later one), so every later call on them raises at once.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import struct
import time

import torch
import torch.distributed as dist

from . import peers
from .errors import RingSeqError
from .layouts import LAYOUTS
from .ledger import Clock, ledger
from .topology import check_sp

RECORD = 64
"""int64 slots of every agreement record (fixed: mismatched ranks still exchange equal sizes)."""
HISTORY = 4
"""Digests of this rank's last batches that every batch record carries (how far a rank can fall behind and catch up)."""
LEDGER = 4
PAYLOAD = HISTORY + LEDGER
"""The record's last slots, never compared: the history, then this rank's ledger (calls, compute and wait
seconds) and the time it entered the agreement (so every rank knows what the agreement itself made each wait)."""
RING_CALLS = ("ring_attention forward", "ring_attention backward")

KINDS = ("batch", "ring_attention forward", "ring_attention backward", "gather", "resync", "exchange",
         "exchange backward", "decode", "rewards", "loss", "backward end", "outcome", "layer", "layer backward",
         "recover", "layer backward start")
"""The collectives agreed: ``exchange`` is a recurrent layer's all-gather of state summaries or
convolution halos (``ringseq.recurrent``); ``decode`` a generation step's all-gather of partial
attention outputs, or of the prompt's last hidden state (``ringseq.attention.decode``); ``rewards``
``ringseq.GRPOTrainer``'s broadcast of group rank 0's rewards; ``loss`` the all-reduce of a loss's
sums or its label count (``ringseq.loss``, the router loss): after the last layer, so a rank whose
last ring call failed after its last transfer meets its peers in an agreement, not in a collective
of another shape; ``backward end`` the end of every backward pass through a ring call
(``check_at_end_of_backward``); ``outcome`` a call's shared outcome (``share_outcome``: not an
agreement, but a record of the same size, so it meets a rank at an agreement in step-sized shape); ``layer`` and
``layer backward start`` and ``layer backward`` a decoder layer's gates under an engine with collectives inside the
model (``ringseq.engines``:
FSDP units, whose all-gathers and reduce-scatters a rank that failed in the layer before would never make);
``recover`` the engines' collective counts the ranks compare as they leave a failed step (``exchange_counts``)."""
RESYNC_KINDS = ("batch", "resync")
HEADER = ("kind", "number", "layer", "failed in call", "failed kind", "failed layer", "layout", "ulysses_size",
          "position", "refused")
_KIND, _NUMBER, _LAYER, _FAILED, _LAYOUT, _ULYSSES, _POSITION, _REFUSED = 0, 1, 2, 3, 6, 7, 8, 9

_layer = contextvars.ContextVar("ringseq_layer", default=-1)
_batched = contextvars.ContextVar("ringseq_batched", default=False)


@dataclasses.dataclass
class _State:
    """This rank's lockstep state for one sequence group."""

    number: int = 0
    """The sequence number of the next collective."""
    recent: list = dataclasses.field(default_factory=list)
    """Digests of the last ``HISTORY`` batches this rank was handed (agreed or skipped), oldest first."""
    last: tuple = (-1, -1, -1)
    """(number, kind, layer) of the latest agreed collective."""
    failure: tuple | None = None
    """(number, kind, layer) of this rank's first failed call since it was last in step."""
    broken: str | None = None
    """Why the group's transfers can no longer be trusted (a wait timed out or a peer's transport failed)."""
    agreed_at: float = 0.0
    """time.time() the last rank entered the group's last agreement: notes older than it are of another incident."""
    born: float = dataclasses.field(default_factory=time.time)
    """time.time() this rank began to use the group (the bound for notes before any agreement)."""
    peers: list | None = None
    """Every rank's ledger as its last record carried it: [calls, compute_s, wait_s] per group rank."""
    baseline: list | None = None
    """The same at the last ``stats(reset=True)``."""
    block_calls_base: dict = dataclasses.field(default_factory=dict)
    """This rank's block kernel calls by backend at the last ``stats(reset=True)``."""
    work: list | None = None
    """Visible query-key pairs of a full-attention layer per ring rank, summed over the batches sharded
    since the last ``stats(reset=True)`` (``ringseq.attention.work``; known on every rank from the full batch)."""
    pending: list = dataclasses.field(default_factory=list)
    """Failure flags of this rank's ring calls on a GPU not read yet: (call, host copy, CUDA event)
    (``check_later``)."""
    settling: bool = False
    """Whether a check of ``pending`` is queued for the end of the running backward pass."""
    own_error: BaseException | None = None
    """This rank's own failure in a step whose later collectives it still makes, raised at the end
    of the step (a patched decode step on a GPU: ``defer_own``, ``finish_step``)."""
    told: bool = False
    """Whether every rank of the group knows of this rank's latest failure: it was raised in a group collective
    every rank met (an agreement, a shared outcome), so ``tell`` has nothing to add."""
    open: object = None
    """The ``SequenceParallel`` of a patched training step whose backward has not ended yet (``open_step``):
    a failure in that backward is the step's (``ringseq.recovery``)."""


_states: dict = {}
_wider: dict = {}
"""Per sequence group (its ranks): the job's scope over its replicas (``ringseq.replicas``) while an engine spans
them, set at every training forward and kept by the others (``widen``)."""


def state(sp) -> _State:
    return _states.setdefault(sp.ranks, _State())


def forget() -> None:
    """Forget every group's state (a test harness starting its ranks afresh)."""
    _states.clear()
    _wider.clear()


def widen(sp, scope) -> None:
    """A patched forward of ``sp`` begins under an engine over the replicas ``scope`` (None: over its group only):
    the step's gates, the end of its forward or the start and end of its backward are met by every rank of
    ``scope`` too, and a failure of the step told to it (``ringseq.recovery``). The scope's news of an earlier
    step is spent (every rank of it left that step through ``exchange_counts``)."""
    _wider[sp.ranks] = scope
    if scope is not None:
        st = state(scope)
        st.told, st.failure = False, None


def wider(sp):
    """The job's scope over ``sp``'s replicas while an engine spans them, else None."""
    return _wider.get(sp.ranks)


def gate(sp, kind: str) -> None:
    """The group agrees, then (under an engine over replicas) every rank of the job: a step's gate."""
    agree(sp, kind, {})
    scope = _wider.get(sp.ranks)
    if scope is not None:
        agree(scope, kind, {})


@contextlib.contextmanager
def layer(index: int | None):
    """Name the model layer the ringseq calls inside belong to (errors and records say it)."""
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or not -1 <= index < 2**62):
        raise RingSeqError(f"lockstep.layer takes a layer index (an int from 0 below 2**62; -1 or None for none), got "
                           f"{index!r}")
    token = _layer.set(-1 if index is None else int(index))
    try:
        yield
    finally:
        _layer.reset(token)


def current_layer() -> int:
    return _layer.get()


@contextlib.contextmanager
def batched():
    """The ring calls inside belong to one agreed batch (a patched forward): a failure that their
    transfers could not carry to every rank reaches the peers at the batch's later agreements (the
    next layer's call, the loss, the end of the backward, the next batch, which a rank that raised
    waits at), so they need not share their outcome (``share_outcome``)."""
    token = _batched.set(True)
    try:
        yield
    finally:
        _batched.reset(token)


def in_batch() -> bool:
    return _batched.get()


def share_outcome(sp, label: str, failed: bool, origin: bool = True) -> str | None:
    """Whether the call ``label`` failed on any rank, known on every rank before the call returns:
    one all-gather of a record (the agreements' size, over the group's CPU (gloo) group, bounded by
    the timeout; no device synchronisation), so a rank that is at an agreement instead meets it in
    a collective of the same shape and both raise out of step. For the calls whose failure the
    ring's transfers cannot always carry (a kernel that fails after its rank's last transfer) and
    whose peers would meet no later agreement of the same step: raw ``ring_attention`` calls (a
    loop of them may be forward-only, or make several calls a step) and calls under Ulysses (an
    all-to-all follows the ring). So every rank raises in that call, and a loop that skips the step
    goes on exact. ``origin``: this rank's failure is its own (not a peer's, reached as a flag);
    the origins are named even when no note can be read. Returns the error of a rank whose own
    call succeeded while a peer's failed (the rank is marked failed: its peers are, in this same call)."""
    if sp.size == 1 or getattr(sp, "timeout", None) is None:  # one rank, or the virtual ring's stand-ins
        return None
    st = state(sp)
    values = [KINDS.index("outcome"), st.number, current_layer(), *(st.failure or (-1, -1, -1)),
              LAYOUTS.index(sp.layout), sp.ulysses_size, -1, 0, int(failed), int(failed and origin)]
    # built on the host and made a tensor once, as an agreement's record is (no tensor op per slot)
    mine = torch.tensor(values + [0] * (RECORD - PAYLOAD - len(values) + HISTORY) + _snapshot(sp), dtype=torch.int64)
    rows = _exchange(sp, mine, f"the outcome of {label} on every rank").tolist()
    if any(row[_KIND] != KINDS.index("outcome") for row in rows):  # a rank is elsewhere: out of step
        message = _mismatch(torch.tensor([row[:len(HEADER)] for row in rows]), list(HEADER), "", behind=False)
        mark_failed(sp, "" if failed else message)  # a rank sharing its failure keeps its own note
        st.told = True  # the rank elsewhere met this record: it raises where it is
        raise RingSeqError(message)
    if not any(row[len(HEADER)] for row in rows):
        return None
    st.pending = [p for p in st.pending if p[0] != label]  # its deferred flags tell of this same failure
    if failed:
        st.told = True
        return None
    mark_failed(sp)
    st.told = True
    origins = [sp.ranks[r] for r, row in enumerate(rows) if row[len(HEADER) + 1]]
    return peer_failed(sp, label, culprit=origins[0] if origins else None)


def tell(sp, label: str, error: BaseException) -> None:
    """This rank leaves a patched step with ``error``: make sure every rank of the group learns it in this
    step, before any rank goes on to collectives of its engine's (DDP's buffer broadcast, FSDP's all-gathers)
    that this rank would then pair with the wrong ones. Unless every rank knows already (``error`` was raised in
    a group collective they all met) or the group's transfers are broken, this rank shares its outcome (one
    record): the peers meet it at the agreement they wait in and raise there, naming it. Never raises: the
    caller raises ``error``."""
    st = state(sp)
    if sp.size == 1 or getattr(sp, "timeout", None) is None or st.broken or st.told:
        return
    own = not isinstance(error, RingSeqError) and not getattr(error, "relayed", False)
    try:
        share_outcome(sp, label, failed=True, origin=own)
    except RingSeqError:  # peers elsewhere (told there), or gone (the wait's own error): this rank raises its own
        pass
    st.told = True


def float_bits(x: float | None) -> int:
    """A float as the int64 with its bits (None -> 0), so records compare floats exactly."""
    return 0 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def from_bits(bits: int) -> float:
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


def mark_failed(sp, reason: str = "", cause: int | None = None) -> None:
    """This rank's ringseq call failed after its agreement: remember the call (the first one
    since the rank was last in step) and leave a note for peers that may be waiting (``cause``:
    as ``peers.post_failure``'s)."""
    st = state(sp)
    if st.failure is None:
        st.failure = st.last
    st.told = False  # a failure of this rank's: its peers know only once it is shared (``tell``) or agreed
    st.settling = False  # a backward pass that failed drops its end-of-backward callback with it
    if reason:
        peers.post_failure(sp, reason, cause)


def peer_failed(sp, label: str, culprit: int | None = None) -> str:
    """The error of a ring call a peer's failure reached as a flag, naming that peer and quoting
    its error from its note where it left one (``peers.who_raised``); ``culprit``: the global rank
    the flag itself named (``share_outcome``, decode attention), named even when no note can be
    read (the store's host exited at once)."""
    who = peers.who_raised(sp, state(sp).agreed_at or state(sp).born) if peers.shared(sp) else None
    if who is None and culprit is not None:
        who = f"global rank {culprit} raised; its note could not be read from the store"
        peers.remember(sp, [culprit], who)
    return (f"{label} failed on another rank of the ring ({who or 'its block compute raised; see that rank'}): "
            f"this rank stops too instead of using its blocks")


DEFERRED = {"cuda"}
"""Device types whose ring calls leave their failure flags to ``check_later`` (a test adds "cpu")."""


def defers(device) -> bool:
    return device.type in DEFERRED


def check_later(sp, label: str, flags: list) -> None:
    """Read the failure flags of a finished ring call on a GPU later, without a host
    synchronisation now: they are copied to pinned host memory behind the call's work and read at
    this group's next agreement once the device has finished that work (every ringseq collective
    starts with one), and at the end of the backward pass at the latest (``settle``)."""
    flat = torch.cat([f.reshape(1).float() for f in flags]) if len(flags) > 1 else flags[0].reshape(1).float()
    event = None
    if flat.is_cuda:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host = flat.clone()
    state(sp).pending.append((label, host, event))


def settle(sp, wait: bool = True) -> str | None:
    """Read the deferred failure flags of this rank (``check_later``): all of them (``wait``: the
    end of a backward pass), or those whose call the device has finished (an agreement: the host
    keeps running ahead of the device). Returns the error of the first call whose flag is set
    (marking this rank failed), or None."""
    st = state(sp)
    found, left = None, []
    for label, host, event in st.pending:
        if event is not None and not wait and not event.query():
            left.append((label, host, event))
            continue
        if event is not None:
            event.synchronize()
        if found is None and bool(host.any()):
            found = peer_failed(sp, label)
    st.pending = left
    if found is not None:
        mark_failed(sp)
    return found


def defer_own(sp, error: BaseException) -> None:
    """This rank's part of a step failed, but its peers learn of it only at the end of the step (its
    flag is read there): it goes on making the step's collectives and raises then (``finish_step``)."""
    st = state(sp)
    st.own_error = st.own_error or error


def finish_step(sp) -> None:
    """The end of a step whose failures were deferred (a patched decode step on a GPU): raise this
    rank's own failure, or a peer's (its flags read now, waiting for the device), before the step's
    result is used."""
    st = state(sp)
    own, st.own_error = st.own_error, None
    found = settle(sp) if st.pending else None
    if own is not None:
        raise own
    if found is not None:
        raise RingSeqError(found)


def check_at_end_of_backward(sp) -> None:
    """Have the running backward pass end with the group's agreement (once per backward pass, after
    reading a GPU's deferred failure flags). A rank whose kernel failed after its last transfer of a
    ring backward is heard of only by the rank its last accumulators went home to (at P > 2), and a
    rank whose backward raised never reaches this agreement: so every rank raises in this step, and
    none steps its optimizer on a gradient its peers dropped."""
    st = state(sp)
    if st.settling:
        return
    if _wider.get(sp.ranks) is not None:  # under an engine over replicas the job meets first, before the engine's
        gate(sp, "layer backward start")  # first collective of the backward (FSDP2's root prefetches an all-gather)

    def check():
        st.settling = False
        found = settle(sp)
        if sp.size > 1 and getattr(sp, "timeout", None) is not None:  # not the virtual ring's stand-in ranks
            try:
                gate(sp, "backward end")
            except RingSeqError:
                if found is None:
                    raise
        if found is not None:
            raise RingSeqError(found)
        st.open = None  # the step's backward ended on every rank

    st.settling = True
    torch.autograd.Variable._execution_engine.queue_callback(check)


def open_step(sp) -> None:
    """A patched training forward returned: until its backward ends (``check_at_end_of_backward``), a failure
    in a backward pass is this step's (``ringseq.recovery``)."""
    state(sp).open = sp


def open_steps() -> list:
    """The groups whose patched training step's backward has not ended."""
    return [st.open for st in _states.values() if st.open is not None]


def close_step(sp) -> None:
    """The step ended in a failure: a backward pass that raised drops its end-of-backward callback with it."""
    st = state(sp)
    st.open, st.settling = None, False


def mark_broken(sp, reason: str) -> None:
    """The group's transfers can no longer be trusted: every later call raises ``reason`` (the
    note for the peers is ``transport_error``'s, which names the rank it blames)."""
    st = state(sp)
    st.broken = st.broken or reason
    mark_failed(sp)


def _snapshot(sp) -> list[int]:
    book = ledger(sp)
    return [book.calls, float_bits(book.compute_s), float_bits(book.wait_s), float_bits(time.time())]


def _ledgers(table: list, kind: str, in_step: bool) -> list[list[int]]:
    """Every rank's ledger [calls, compute_s bits, wait_s bits] as of the end of this agreement: the
    one its record carried (as of its entry) plus this agreement's own wait, the time from its entry
    to the last rank's (when the all-gather could complete; one job's clocks agree far better than
    that), and the ring call it agrees on. So ``ringseq.stats`` counts the agreement a late rank
    made the others wait in, and the call, without a collective of its own."""
    entered = [from_bits(row[-1]) for row in table]
    last = max(entered)
    call = 1 if in_step and kind in RING_CALLS else 0
    return [[row[-LEDGER] + call, row[-LEDGER + 1], float_bits(from_bits(row[-LEDGER + 2]) + max(0.0, last - t))]
            for row, t in zip(table, entered)]


def refuse(sp, kind: str, error: RingSeqError, position: int | None = None):
    """This rank refuses its own call (its arguments: devices, dtypes, flags, numbers out of range):
    the call's agreement carries the refusal, so every rank of the group raises in this same call
    (this one ``error``, which says what to fix; its peers name it and quote it), before any
    transfer, and the call's number is spent on every rank alike: the group stays in step, and a
    loop that skips the step goes on exact. Never returns."""
    try:
        agree(sp, kind, {}, position=position, refusal=str(error))
    except RingSeqError:
        pass
    raise error


BROKEN = "this sequence group cannot go on: {}. Its transfers are out of step for good; end the job (or build new " \
         "groups: ringseq.init on every rank)"


def check_broken(sp) -> None:
    """Raise at once when an earlier failure left the group unable to go on (``mark_broken``)."""
    st = state(sp)
    if st.broken:
        raise RingSeqError(BROKEN.format(st.broken))


def exchange_counts(sp, counts: list[int], what: str) -> list[list[int]]:
    """Every rank's ``counts`` (a few integers: its engines' collective counts), [group size][len(counts)], in one
    record of the agreements' size over the control group, bounded by the timeout: every rank leaving a failed
    step makes it at the same point (``ringseq.engines.recover``). Raises ``RingSeqError`` when a rank is elsewhere.
    Over the job's scope (``ringseq.replicas``) the ranks leave in step: their next agreement's number is one."""
    st = state(sp)
    if sp.size == 1:
        return [list(counts)]
    if len(counts) > RECORD - PAYLOAD - len(HEADER):
        raise AssertionError("too many counts for one record")
    values = [KINDS.index("recover"), st.number, -1, -1, -1, -1, LAYOUTS.index(sp.layout), sp.ulysses_size, -1, 0,
              *counts]
    mine = torch.tensor(values + [0] * (RECORD - PAYLOAD - len(values) + HISTORY) + _snapshot(sp), dtype=torch.int64)
    rows = _exchange(sp, mine, what).tolist()
    if any(row[_KIND] != KINDS.index("recover") for row in rows):
        raise RingSeqError(f"{what}: the ranks are out of step: "
                           + ", ".join(f"group rank {r} at {_where(row)}" for r, row in enumerate(rows)))
    if getattr(sp, "replicas", False):  # some met the news at an agreement (numbered), some told it (not)
        st.number, st.failure = max(row[_NUMBER] for row in rows), None
    return [row[len(HEADER):len(HEADER) + len(counts)] for row in rows]


def agree(sp, kind: str, fields: dict[str, int], hint: str = "", position: int | None = None,
          refusal: str | None = None) -> int:
    """All-gather this rank's record of the collective it is about to make; raise
    ``RingSeqError`` on every rank unless the ranks are in step. Returns its sequence number.
    ``kind`` "batch" (and "resync", with ``position`` = the caller's step) is a resync point.
    ``refusal``: this rank refuses the call (``refuse``): every rank raises, quoting it."""
    st = state(sp)
    if st.broken:
        raise RingSeqError(BROKEN.format(st.broken))
    late = settle(sp, wait=False) if st.pending else None  # a peer's failure in an earlier call, read only now
    number = st.number
    st.number += 1
    st.last = (number, KINDS.index(kind), current_layer())
    digest = _digest(fields.values()) if kind == "batch" else 0
    if sp.size == 1:
        st.failure = None
        return number
    failed = st.failure or (-1, -1, -1)
    reason = (refusal or "").encode()
    values = [KINDS.index(kind), number, current_layer(), *failed, LAYOUTS.index(sp.layout), sp.ulysses_size,
              -1 if position is None else int(position), len(reason), *fields.values()]
    if len(values) > RECORD - PAYLOAD:
        raise AssertionError(f"a lockstep record holds at most {RECORD - PAYLOAD} fields")
    names = [*HEADER, *fields]
    n = len(values)
    history = (st.recent + [0] * HISTORY)[:HISTORY] if kind == "batch" else [0] * HISTORY
    deadline = time.monotonic() + sp.timeout  # a rank ahead waits for the others at most this long
    while True:
        mine = torch.tensor(values + [0] * (RECORD - PAYLOAD - n) + history + _snapshot(sp), dtype=torch.int64)
        rows = _exchange(sp, mine, f"the agreement of {kind} #{number}{at_layer()}")
        table = rows.tolist()  # compared on the host: no tensor operation when the ranks are in step
        if any(row[_REFUSED] for row in table):  # a rank refused this call: every rank raises in it, in step
            st.peers = _ledgers(table, kind, False)
            st.told = True  # every rank raises in this call
            if late is not None:
                raise RingSeqError(late)
            st.agreed_at = max(from_bits(row[-1]) for row in table)
            _raise_refusals(sp, table, reason, f"{kind} #{number}{at_layer()}")
        if getattr(sp, "replicas", False):
            _replica_failed(sp, st, table, kind, number)
        compared = rows[:, :n]
        verdict = "in step" if all(row[:n] == table[0][:n] for row in table) else None
        st.peers = _ledgers(table, kind, verdict == "in step")
        if verdict is None and kind in RESYNC_KINDS:
            verdict = _resync(st, rows, n, sp.rank)
        if verdict == "wait" and time.monotonic() < deadline:
            continue  # ahead of a peer: meet it again when it comes to this batch
        if verdict == "wait":
            verdict = None  # the others never caught up within the timeout: raise with the records
        if kind == "batch":
            st.recent = (st.recent + [digest])[-HISTORY:]
        if late is not None:  # every rank has met: this one raises for its earlier call (its record said so)
            st.told = True
            raise RingSeqError(late)
        if verdict == "in step":
            # notes posted after the last rank entered this agreement are of a new incident (a rank that
            # raises at once may post before this rank has even left the all-gather)
            st.failure, st.agreed_at = None, max(from_bits(row[-1]) for row in table)
            return number
        message = _mismatch(compared, names, hint, behind=verdict == "behind")
        odd = _minority(compared)
        # the ranks out of step with a majority of the group began it: the others' notes point at them
        cause = sp.ranks[odd[0]] if odd and sp.rank not in odd else None
        if any(row[_FAILED] >= 0 for row in table):  # out of step after failures: name where they began
            since = st.agreed_at or st.born
            began, words = peers.raised_since(sp, since, mine=True) if peers.shared(sp) else ([], None)
            told = _tellers(sp, table, own=True)  # a rank that told its own failure (``tell``)
            if not began and told:  # its note unread (the store's host gone): its record names it
                began, words = told, "; ".join(f"global rank {r} raised (its note, with its error, could not be "
                                               f"read)" for r in told)
                peers.remember(sp, began, words)
            cause = began[0] if began else peers.AFTERMATH
            message = message.replace(": ", f" after a failure that began here: {words}: ", 1) if words else message
            if dist.get_rank() in began:  # it began with this rank (too): its first note stands as a root (no nesting)
                mark_failed(sp)
                st.told = True
                raise RingSeqError(message)
        mark_failed(sp, message, cause)  # a note: a peer whose next transfer with this rank fails quotes it
        st.told = True  # every rank saw the same records: each raises in this agreement
        raise RingSeqError(message)


def _tellers(sp, table: list, own: bool) -> list[int]:
    """The global ranks whose record in ``table`` is a failed shared outcome (``share_outcome``); ``own``: only
    those whose failure was their own (its origin), not a peer's passed on."""
    return [sp.ranks[r] for r, row in enumerate(table) if row[_KIND] == KINDS.index("outcome") and row[len(HEADER)]
            and (row[len(HEADER) + 1] or not own)]


def _replica_failed(sp, st: _State, table: list, kind: str, number: int) -> None:
    """At an agreement of the job's scope (``ringseq.replicas``): raise when a rank of another sequence group told
    the job its step failed (its record is a shared outcome)."""
    origins = _tellers(sp, table, own=True) or _tellers(sp, table, own=False)
    if not origins:
        return
    st.told = True  # every rank of the job raises here or told it
    who = ", ".join(f"global rank {r}" for r in origins)
    raise RingSeqError(f"a step failed on {who} (another rank's error, raised there): every rank of the job raises "
                       f"in this step, at {kind} #{number}{at_layer()}, before the engine's collectives that "
                       f"{'that rank' if len(origins) == 1 else 'those ranks'} will not make; the next step goes on")


def _raise_refusals(sp, table: list, mine: bytes, what: str):
    """Every refusal's words, all-gathered in full (one all-gather of the longest's bytes), then
    the refusing ranks raise their own and the others name them and quote them."""
    lengths = [row[_REFUSED] for row in table]
    width = max(lengths)
    buffer = torch.zeros(width, dtype=torch.uint8)
    if mine:
        buffer[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    every = torch.empty(sp.size * width, dtype=torch.uint8)
    work = _all_gather_single(every, buffer, group=sp.check_group, async_op=True)
    wait(work, sp, f"the refusals of {what}", peer=None, gloo=True)
    texts = {r: bytes(every[r * width:r * width + n].tolist()).decode(errors="replace")
             for r, n in enumerate(lengths) if n}
    if mine:
        raise RingSeqError(mine.decode())
    named = "; ".join(f"global rank {sp.ranks[r]} refused its call: {text}" for r, text in texts.items())
    raise RingSeqError(f"{what} was refused by another rank of the group, so every rank raises in it ({named}). "
                       f"Fix that rank's call; the group stays in step: the next call (or a loop that skips this "
                       f"step) goes on")


def _minority(rows: torch.Tensor) -> list[int]:
    """The group ranks whose record differs from one that more than half the group share (none
    when no record has a majority: two ranks, or a group split evenly, cannot tell who is odd)."""
    records = [tuple(row) for row in rows.tolist()]
    top = max(set(records), key=records.count)
    if 2 * records.count(top) <= len(records):
        return []
    return [r for r, record in enumerate(records) if record != top]


def _digest(values) -> int:
    """A batch record's fields as one int64 (0 is kept for "no batch")."""
    return hash(tuple(int(v) for v in values)) % (2**62) + 1


def _resync(st: _State, rows: torch.Tensor, n: int, me: int) -> str | None:
    """At a resync point, compare what says where the ranks are in the data (the batch itself,
    or the caller's step), not call numbers or failures. Returns "in step" (call numbers are made
    equal), "wait" (this rank is ahead of a peer, which will raise and come again), "behind"
    (this rank must skip), or None (the ranks hold different data: nothing orders them)."""
    data = [_KIND, _LAYOUT, _LAYOUT + 1, _POSITION, *range(len(HEADER), n)]
    sel = rows[:, data]
    if bool((sel == sel[0]).all()):
        st.number = int(rows[:, _NUMBER].max()) + 1
        return "in step"
    kinds = rows[:, _KIND].tolist()
    resyncs = [KINDS.index(k) for k in RESYNC_KINDS]
    if len({k for k in kinds if k in resyncs}) > 1:
        return None  # a batch beside an explicit resync: nothing orders them (both raise; no livelock)
    if kinds[me] == KINDS.index("resync"):  # the caller's step numbers order the ranks
        steps = [int(rows[r, _POSITION]) if k == kinds[me] else None for r, k in enumerate(kinds)]
        top = max(x for x in steps if x is not None)
        if steps[me] < top:
            return "behind"
        return "wait" if any(x is None or x < top for x in steps) else None
    digests = [_digest(rows[r, len(HEADER):n].tolist()) if k == kinds[me] else None for r, k in enumerate(kinds)]
    history = [set(x for x in rows[r, -PAYLOAD:-LEDGER].tolist() if x) for r in range(rows.size(0))]

    def catching_up(r: int) -> bool:  # rank r brings a batch another rank had already, and it had not
        return digests[r] not in history[r] and any(digests[r] in history[o] for o in range(len(digests)) if o != r)

    if catching_up(me):
        return "behind"
    # a peer mid-step, or catching up (at a batch this rank had already, which it had not): it comes again. A peer
    # that brings a batch it had itself before repeats it while this rank does not: they disagree, both raise now
    if any(d is None or (r != me and catching_up(r) and d in history[me]) for r, d in enumerate(digests)):
        return "wait"
    return None


def _exchange(sp, mine: torch.Tensor, what: str) -> torch.Tensor:
    """Every rank's record, [group size, RECORD] (one all-gather into one tensor)."""
    every = torch.empty(sp.size * mine.numel(), dtype=mine.dtype)
    start = time.perf_counter()
    work = _all_gather_single(every, mine, group=sp.check_group, async_op=True)
    wait(work, sp, what, peer=None, gloo=True)
    Clock(sp).time("wait_s", start)
    return every.view(sp.size, -1)


# torch 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there); older ones have only the latter
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resync(sp, step: int) -> None:
    """A resync point for a loop of raw ringseq calls (the patched model and ``shard_batch``
    resync at every batch by themselves): every rank of the group calls it at the start of
    every step with the same ``step`` number. Ranks in step pass it at once; after a failure
    that left ranks at different steps, a rank behind raises (its loop skips that step) and a
    rank ahead waits for it, so the group goes on together from the same step."""
    check_sp(sp)
    if isinstance(step, bool) or not isinstance(step, int):
        raise RingSeqError(f"resync takes the loop's step number (an int, the same on every rank), got {step!r}")
    agree(sp, "resync", {}, position=step,
          hint="call ringseq.resync(sp, step) with the same step number on every rank of the group")


def at_layer() -> str:
    return f" (layer {current_layer()})" if current_layer() >= 0 else ""


FLOAT_FIELDS = {"scale", "softcap", "window", "slab_rows", "head_groups"}


def _mismatch(rows: torch.Tensor, names: list[str], hint: str, behind: bool) -> str:
    first = rows[0].tolist()
    lines = []
    for r in range(1, rows.size(0)):
        other = rows[r].tolist()
        if other == first:
            continue
        if other[_KIND] != first[_KIND] or other[_NUMBER] != first[_NUMBER]:
            what = (f"group rank 0 is at ringseq collective #{first[_NUMBER]} ({_where(first)}) while group rank {r} "
                    f"is at #{other[_NUMBER]} ({_where(other)})")
        else:
            diffs = [f"{name}: rank 0 {_show(name, a)}, rank {r} {_show(name, b)}"
                     for name, a, b in zip(names, first, other) if a != b]
            what = f"group rank 0 and group rank {r} differ in {KINDS[first[_KIND]]} #{first[_NUMBER]}: " + "; ".join(
                diffs)
        lines.append(what)
    failed = [r for r in range(rows.size(0)) if rows[r, _FAILED] >= 0]
    news = ""
    if failed:
        news = (f" Group rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} had a ringseq call fail "
                f"since the group was last in step: no call gives a result until the ranks are back in step (the "
                f"next batch of the patched model or shard_batch, or ringseq.resync(sp, step) in a loop of raw "
                f"ringseq calls).")
    if behind:
        news += (" This rank is behind the others (they had its batch or step already): skip it, as a loop that "
                 "swallows the error does; the ranks ahead wait for it at their batch or step.")
    hint = hint or ("every rank of a group must make the same ringseq calls with the same arguments and shapes "
                    "(same batch, same model, no rank skipping a step or a layer after an exception)")
    return "the ranks of a sequence group are out of step: " + " | ".join(lines) + "." + news + " " + hint


def _where(row: list[int]) -> str:
    text = KINDS[row[_KIND]] + (f", layer {row[_LAYER]}" if row[_LAYER] >= 0 else "")
    if row[_KIND] == KINDS.index("resync"):
        text += f", step {row[_POSITION]}"
    if row[_FAILED] >= 0:
        text += f"; its call #{row[_FAILED]} ({KINDS[row[_FAILED + 1]]}) failed"
    return text


def _show(name: str, value: int) -> str:
    if name in ("head_groups", "slab_rows") and value in (-1, -2):
        return "None" if value == -1 else "'kv'"
    if name in FLOAT_FIELDS:
        return "None" if value == 0 else repr(from_bits(value))
    if name == "failed in call":
        return "none" if value < 0 else f"#{value}"
    if name == "failed kind":
        return "none" if value < 0 else KINDS[value]
    if name.endswith("dtype") or name == "sinks":
        return _dtype_name(value)
    if name == "kernel":
        return {-1: "auto", 99: "unknown"}.get(value) or KERNELS[value]
    if name == "layout":
        return LAYOUTS[value]
    return str(value)


def wait(work, sp, what: str, peer: int | None, gloo: bool | None = None) -> None:
    """Wait for ``work`` at most ``sp.timeout`` seconds (gloo), re-raising a timeout or a dead
    peer's transport error as ``RingSeqError`` that says what was awaited and who stalled or
    failed. A collective's wait (``peer`` None) that lasts ``peers.signal_after`` writes a
    'waiting' note (cleared when it ends), so peers that time out meanwhile see this rank
    waiting. NCCL work is stream-ordered (waiting blocks no host); its group timeout bounds it
    instead. ``gloo``: whether the work ran on a gloo group (default: whether ``sp``'s groups
    are gloo)."""
    if work is None:
        return
    since = time.time()
    try:
        if not (gloo if gloo is not None else not sp.nccl):
            work.wait()
            return
        # a collective's wait (``peer`` None) that times out can be waited on again; a point-to-point
        # one cannot (gloo closes the pair), so only collectives say that they wait long
        signal = peers.signal_after(sp) if peers.shared(sp) and peer is None else sp.timeout
        if signal >= sp.timeout:
            work.wait(timeout=datetime.timedelta(seconds=sp.timeout))
            return
        try:  # the collective goes on meanwhile
            work.wait(timeout=datetime.timedelta(seconds=signal))
            return
        except RuntimeError as exc:
            if not _timed_out(exc):
                raise
        # a long wait says so, so a peer that times out sees this healthy rank waiting, not gone
        peers.post_waiting(sp, what)
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(0.001, sp.timeout - (time.time() - since))))
        finally:  # however the wait ends (a failure's own note, if any, is written after this)
            peers.post_waiting(sp, what, waiting=False)
    except RuntimeError as exc:
        raise transport_error(sp, what, peer, exc, since) from exc


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def transport_error(sp, what: str, peer: int | None, exc: BaseException, since: float) -> RingSeqError:
    """The ``RingSeqError`` for a wait or transfer on ``sp``'s groups that failed with ``exc``;
    the group is marked broken. A timeout names the ranks that stalled (``peers.blame``); a closed
    connection names the rank where the failure began, quoting its error where it left one
    (``peers.explain``), and leaves a note that blames it, for the survivors that follow."""
    text = str(exc)
    timed_out = _timed_out(exc)
    agreed = state(sp).agreed_at or state(sp).born
    from_whom = f"global rank {peer}" if peer is not None else "the other ranks of the group"
    root = None
    if timed_out:
        root, who = peers.blame(sp, what, agreed)
        cause = f"no answer within the {sp.timeout:g} s timeout (ringseq.init(timeout=...) or RINGSEQ_TIMEOUT): "
        cause += who or f"{from_whom} is stopped, stuck, far slower, or itself waiting for another"
    else:
        detail = text.splitlines()[0][:200] if text else type(exc).__name__
        if peer is not None:
            # at once, before reading the others' notes: a survivor whose connection with this rank closed
            # (gloo closes them all) finds that this one is alive and where it looks next
            closed = f"while waiting for {what}: the connection with global rank {peer} closed"
            peers.post_failure(sp, closed, cause=peer, breaking=True)
            with peers.reporting(closed):
                root, words = peers.explain(sp, peer, agreed)
            cause = words or f"global rank {root} failed or exited ({detail})"
        else:  # a collective of the whole group: the notes of every rank
            with peers.reporting(f"while waiting for {what}: a connection of the group closed ({detail})"):
                cause = peers.blame(sp, what, agreed)[1] or f"{from_whom} failed or exited ({detail})"
            root = peers.AFTERMATH
    message = f"while waiting for {what}: {cause}"
    mark_broken(sp, message)
    # survivors whose transfers with this rank fail next (gloo closes a process's connections when
    # one fails or times out) follow this note to the cause
    # "stalled": this rank timed out waiting for a rank that left no note (not one that raised)
    stalled = timed_out and root is not None and root >= 0 and f"global rank {root} raised" not in cause
    peers.post_failure(sp, message, cause=peers.AFTERMATH if root is None else root, breaking=True, stalled=stalled)
    return RingSeqError(message)
