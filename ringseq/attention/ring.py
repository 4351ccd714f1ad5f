"""The ring: blockwise forward and backward over K/V blocks that travel the ring.

Shapes (``ringseq.shapes``): q [B,H,s,D], k/v [B,K,s,D], out [B,H,s,D], lse [B,H,s].

Forward, at step t = 0..T-1, rank r holds the K/V block of rank j = (r - t) mod P. It posts
the transfer of that block to rank r+1 (one flat buffer: ``ringseq.attention.comm``), runs the
kernel calls the batch's plan lists for the step (``ringseq.attention.plan``: hidden blocks
skipped, masks only where needed, every table made once per batch), and folds each partial
into the fp32 (fp64 for fp64 inputs) output accumulator in place: the first partial of a row is
copied, a later one merged by its log-sum-exp (new lse, its weight w = exp(l - lse), then
out + w (o - out): five operations, no dtype round trip but the kernel output's own). The
log-sum-exp is kept in fp64 for fp32 inputs (the backward's exp(score - lse) is then as accurate
as a plain softmax) and in fp32 for half inputs (what their kernels give and take). A row that
has seen no key holds -1e30 (``plan.FLOOR``), never -inf, so no merge needs nan handling.
T is P for plain causal attention; windows and documents can make it as small as 1.

Backward runs the same ring with the merged ``out``/``lse``. The dK/dV of block j travel with
it as one fp32 buffer: each rank adds its contribution to the accumulator it received and passes
it on; after the last step one transfer sends every accumulator home (for T = P that is the next
rank). Only the K kv heads cross the wire, never copies repeated to H heads. Inside the loop there
is no host synchronisation: a peer's failure travels as a status element of the buffers and is
read after the loop (on a GPU later still, ``lockstep.check_later``). A failure after a rank's last
transfer has nothing left to mark: raw calls and calls under Ulysses then share their outcome
(``RingOptions.shared``: one record all-gathered over gloo at the end of the forward and of the
backward), a patched model's calls leave it to the batch's later agreements.

A call runs one ring for all heads by default. ``RingOptions.head_groups`` = g runs g rings, one
after the other, each over 1/g of the kv heads and their query heads, into one output, log-sum-exp
and gradient each (``forward_by_heads``, ``backward_by_heads``): the blocks, receive buffers,
dK/dV accumulators and kernel gradients of one group exist at a time (a memory switch), for g
times the transfers and kernel launches, each as much smaller. The groups share the batch's plan.

Sinks (one logit per head in every softmax denominator, gpt-oss) need no kernel support: they
are folded into the merged log-sum-exp once, after the ring, and the blockwise backward with
that log-sum-exp is exact; their own gradient is -sum_i p_sink(i) * <dout_i, out_i>.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from ringseq import lockstep
from ringseq.errors import RingSeqError
from ringseq.ledger import Clock, ledger

from .comm import Block, RingComm, first_parts, travels_as_is, wire
from .kernels.common import LSE, acc_dtype
from .masks import TokenInfo
from .plan import FLOOR, plan
from .schedule import rank_schedule


@dataclasses.dataclass
class CallNumbers:
    """The lockstep numbers of one ring call's forward and backward (their transfers' tags);
    the backward's is known only when its agreement has run."""

    forward: int = 0
    backward: int = 0


@dataclasses.dataclass(frozen=True)
class RingOptions:
    """Everything non-tensor the ring needs, packed so autograd's backward stays short."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    r: int
    layout: str
    causal: bool
    scale: float
    kernel: str | None = None
    window: int | None = None
    softcap: float | None = None
    info: TokenInfo = dataclasses.field(default_factory=TokenInfo)
    slab_rows: int | None = None
    """Query rows per kernel slab (None: each backend's default)."""
    sp: object = None
    """The ``SequenceParallel`` (timeout, stats ledger)."""
    label: str = "ring_attention"
    """The call in errors: its lockstep number and layer."""
    kept: object = dataclasses.field(default=None, compare=False)
    """The ``keep.Kept`` store of the checkpointed layer this call runs in (None: not checkpointed)."""
    numbers: CallNumbers = dataclasses.field(default_factory=CallNumbers, compare=False)
    """The call's lockstep numbers (tags of its transfers)."""
    transport: object = RingComm
    """What carries the blocks: ``RingComm`` (torch.distributed point-to-point) or any class with
    its constructor and ``post`` (the GPU check passes a virtual ring of threads)."""
    head_groups: int = 1
    """Rings per call, each over an equal share of the kv heads (and their query heads), one after
    the other (``RingAttention``); must divide the kv heads the ring holds. 1: one ring for all."""
    shared: bool = False
    """Whether the call's forward and backward each end by sharing their outcome with every rank
    (``lockstep.share_outcome``): raw calls and calls under Ulysses."""

    @property
    def P(self) -> int:
        return len(self.ranks)


class _Schedule:
    """This rank's view of one ring: the batch's plan (``ringseq.attention.plan``), the transport,
    and this rank's failure (after which the ring's transfers go on, flagged, without compute)."""

    def __init__(self, q, opts: RingOptions, number: int, failed: BaseException | None = None):
        """``failed``: an earlier head group's failure (this rank's or a peer's): this ring makes
        its transfers, flagged failed so every peer learns of it, and computes nothing."""
        self.opts, self.device = opts, q.device
        self.error: BaseException | None = failed
        """The exception this rank's block compute raised; the ring's transfers go on without compute."""
        self.inherited = failed is not None
        """Whether ``error`` is an earlier group's (already reported)."""
        try:
            found = plan(q, opts)
            self.steps, self.work, self.covered = found.steps, found.work, found.covered
            if failed is None:
                ledger(opts.sp).count(found.calls)
        except RingSeqError as exc:  # a forced kernel that cannot take a call: fail like a block compute
            sched = rank_schedule(opts.layout, q.size(2) * opts.P, opts.P, opts.r, opts.causal, opts.info,
                                  opts.window)
            self.steps, self.work, self.covered = sched.steps, [()] * sched.steps, False
            self.error = self.error or exc
        self.clock = Clock(opts.sp)
        self.comm = None
        if self.steps > 1:
            self.comm = opts.transport(opts.group, opts.ranks, opts.r, opts.sp, opts.label, self.clock, q.device,
                                       tag=number)

    def send(self, what, t: int, shift: int = 1, kind: str = "kv"):
        """Post ``what`` (a ``Block``, or a rank's own tensors: K and V, or its first dK and dV) to the
        rank ``shift`` places ahead; a rank that failed marks it so. A ring's first hop of each kind
        sends the pieces of a buffer (each tensor and the status: every rank alike, whatever it
        holds, since a receive takes the sender's pieces), every later hop one buffer as it came."""
        failed = self.error is not None
        if isinstance(what, Block):
            if failed:
                what.status.fill_(1)
            parts = [what.flat] if t else [wire(x) for x in what.views] + [what.status]
        else:
            parts = first_parts(what, what[0].dtype, failed)
        return self.comm.post(parts, t, shift, kind)

    def compute(self, t: int, work) -> None:
        """Run ``work(w)`` for every ``Work`` of step t, unless this rank failed already; a failure
        is kept (and flagged to the peers by the next transfers) until the ring has finished."""
        if self.error is not None:
            return
        start = time.perf_counter()
        try:
            for w in self.work[t]:
                work(w)
        except Exception as exc:  # noqa: BLE001 - re-raised by finish(), after the peers were told
            self.error = exc
        self.clock.time("compute_s", start)

    def finish(self, received, errors: list | None = None) -> None:
        """Raise this rank's own failure, or a peer's (the status of the last ``received`` blocks),
        now that every transfer is done; with ``errors`` (a call of several head groups) append it
        there instead, so the next groups' rings still make their transfers and carry the news
        (``backward_by_heads``). On a GPU a peer's failure is read later, without a host
        synchronisation here (``lockstep.check_later``)."""
        error = None
        if self.error is not None:
            if not self.inherited:
                lockstep.mark_failed(self.opts.sp, f"{self.opts.label}: {type(self.error).__name__}: {self.error}")
            error = self.error
        else:
            flags = [b.status for b in received if b is not None]
            if flags and lockstep.defers(self.device):
                lockstep.check_later(self.opts.sp, self.opts.label, flags)
            elif any(f.tolist()[0] for f in flags):  # CPU tensors: read on the host
                lockstep.mark_failed(self.opts.sp)
                error = RingSeqError(lockstep.peer_failed(self.opts.sp, self.opts.label))
                error.relayed = True  # a peer's failure, passed on (``lockstep.share_outcome`` names origins)
        if error is None:
            return
        if errors is None:
            raise error
        errors.append(error)


def _fresh(out, lse, rows: slice, o, l, empty: bool):
    """The first partial of query ``rows``: copied into the accumulators (a row that sees none of
    the call's keys gets log-sum-exp FLOOR, not -inf: the merges then need no nan handling)."""
    out[:, :, rows].copy_(o)
    dst = lse[:, :, rows]
    if not empty:
        dst.copy_(l)
    elif dst.dtype == l.dtype:
        torch.clamp(l, min=FLOOR, out=dst)
    else:
        dst.copy_(l).clamp_(min=FLOOR)


def _merge(out, lse, rows: slice, o, l):
    """Fold a partial (o, l) of query ``rows`` into the running (out, lse), in place: the new
    log-sum-exp, then out + w (o - out) with w = exp(l - new), the new partial's weight (0 where
    it sees nothing: l = -inf against a finite running value)."""
    acc, run = out[:, :, rows], lse[:, :, rows]
    torch.logaddexp(run, l, out=run)
    w = torch.sub(l, run).exp_()
    acc.lerp_(o if o.dtype == acc.dtype else o.to(acc.dtype),
              (w if w.dtype == acc.dtype else w.to(acc.dtype)).unsqueeze(-1))


def _fold_sinks(out, lse, sinks):
    """Add exp(sink[h]) to every softmax denominator of head h, in place."""
    sink = sinks.to(lse.dtype)[None, :, None]
    new = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - new).unsqueeze(-1).to(out.dtype))
    lse.copy_(new)


@dataclasses.dataclass
class _Groups:
    """The failures so far of the head groups of one call (after one, the later groups' rings only
    make their transfers); the groups share the batch's plan through ``plan``'s cache."""

    errors: list = dataclasses.field(default_factory=list)

    def start(self, q, opts: RingOptions, number: int) -> _Schedule:
        return _Schedule(q, opts, number, failed=self.errors[0] if self.errors else None)


def _start(q, opts: RingOptions, number: int, groups: _Groups | None) -> _Schedule:
    return _Schedule(q, opts, number) if groups is None else groups.start(q, opts, number)


def ring_forward(q, k, v, sinks, opts: RingOptions, groups: _Groups | None = None):
    """Return (out in q's dtype in transformers' [B, s, H, D] memory, lse [B,H,s] in ``lse_dtype``,
    aux for the backward kernel). ``groups``: what the head groups of the call share
    (``forward_by_heads``); a failure is then recorded there, not raised."""
    sched = _start(q, opts, opts.numbers.forward, groups)
    B, H, s, D = q.shape
    acc, whole = acc_dtype(q), slice(0, s)
    kv, block, aux = (_uncopied(k), _uncopied(v)), None, None
    shapes = tuple(tuple(t.shape) for t in kv)
    out = lse = None  # the accumulators: made at the first partial (adopted when it is one already)

    def work(w):
        nonlocal aux, out, lse
        o, l, a = w.kernel.forward(q[:, :, w.q_rows], kv[0][:, :, w.k_rows], kv[1][:, :, w.k_rows], w.spec)
        aux = aux if aux is not None else a
        if out is None and w.fresh and w.q_rows == whole and o.dtype == acc and travels_as_is(o):
            out, lse = o, _as_lse(l, lse_dtype(q), w.empty)  # the first partial covers every row: no copy
            return
        if out is None:
            out, lse = _accumulators(q, sched.covered)
        if w.fresh:
            _fresh(out, lse, w.q_rows, o, l, w.empty)
        else:
            _merge(out, lse, w.q_rows, o, l)

    for t in range(sched.steps):
        pending = sched.send(kv if block is None else block, t) if t < sched.steps - 1 else None
        sched.compute(t, work)
        if pending is not None:
            block = Block(pending.wait(), shapes)
            kv = block.views
    sched.finish([block], None if groups is None else groups.errors)
    if out is None:  # no call at all (every block hidden), or a failed compute (the call raised above)
        out, lse = _accumulators(q, covered=False)
    if sinks is not None:
        _fold_sinks(out, lse, sinks)
    return out if out.dtype == q.dtype else out.to(q.dtype), lse, aux


def _accumulators(q, covered: bool):
    """The output accumulator (fp32, fp64 for fp64; transformers' [B, s, H, D] memory) and the
    log-sum-exp; zero output and FLOOR where no fresh call will write first (not ``covered``)."""
    B, H, s, D = q.shape
    out = torch.empty((B, s, H, D), dtype=acc_dtype(q), device=q.device).transpose(1, 2)
    lse = torch.empty((B, H, s), dtype=lse_dtype(q), device=q.device)
    if not covered:
        out.zero_()
        lse.fill_(FLOOR)
    return out, lse


def _as_lse(l, dtype, empty: bool):
    """A first partial's log-sum-exp as the running one (FLOOR for rows that see nothing)."""
    if l.dtype == dtype and not empty:
        return l
    got = l.to(dtype)
    return got.clamp_(min=FLOOR) if empty else got


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The merged log-sum-exp's dtype: fp64 for fp32 and fp64 inputs (free at [B, H, s], and the
    backward's exp(score - lse) is then as accurate as a plain softmax); fp32 for half inputs,
    whose kernels take and give fp32 (no conversion per step)."""
    return LSE if q.dtype in (torch.float32, torch.float64) else torch.float32


def _uncopied(t: torch.Tensor) -> torch.Tensor:
    """K or V as the ring holds them: in the wire's layout (``comm.wire``: transformers' [B, s, K, D]
    memory under the [B, K, s, D] view), copied only when they come in another."""
    return t if travels_as_is(t) else _seq_major(t, t.dtype)


def _seq_major(t: torch.Tensor, dtype) -> torch.Tensor:
    """t [B,H,s,D] in ``dtype``, as a view of [B,s,H,D] memory: the layout transformers' attention
    returns, so its ``out.transpose(1, 2).contiguous()`` before the output projection is no copy
    (which would be one more q-sized tensor, saved for that projection's backward beside ours)."""
    if t.dtype == dtype and t.transpose(1, 2).is_contiguous():
        return t
    B, H, s, D = t.shape
    return torch.empty((B, s, H, D), dtype=dtype, device=t.device).transpose(1, 2).copy_(t)


def ring_backward(dout, q, k, v, sinks, out, lse, aux, opts: RingOptions, dq_into=None,
                  groups: _Groups | None = None):
    """Return (dq, dk, dv, dsinks) in the input dtypes; accumulation is fp32 (fp64 for fp64).
    ``dq_into``: a tensor of q's shape in the accumulation dtype that dq is written into (and
    returned as): a head group's share of the whole dq (``backward_by_heads``); ``groups`` as for
    ``ring_forward``."""
    opts = dataclasses.replace(opts, label=f"the backward of {opts.label}")
    sched = _start(q, opts, opts.numbers.backward, groups)
    acc = acc_dtype(q)
    if dout.stride(-1) != 1:  # the gradient usually comes as transformers' layout: taken as it is
        dout = _seq_major(dout, dout.dtype)
    B, H, s, D = q.shape
    whole = slice(0, s)
    dq = dq_into
    if dq is not None and not sched.covered:
        dq.zero_()
    kv, kv_block = (_uncopied(k), _uncopied(v)), None
    shapes = tuple(tuple(t.shape) for t in kv)
    rows_lse: dict = {}  # the merged log-sum-exp of each call's rows as its kernel takes it: once per range

    def lse_of(rows: slice, kernel):
        dtype = lse.dtype if kernel.exact_lse else acc
        key = (rows.start, rows.stop, dtype)
        if key not in rows_lse:
            rows_lse[key] = lse[:, :, rows].to(dtype).contiguous()
        return rows_lse[key]

    own = None
    """The dK/dV of the block this rank holds, as far as this rank and the ranks before it summed
    them: a received ``Block``, or this step's first kernel gradients adopted as [dk, dv] when they
    cover every key (sent as the pieces of one buffer), else a zeroed ``Block``."""

    def add_kv(gk, gv, keys: slice):
        nonlocal own
        if own is None:
            if keys == slice(0, shapes[0][2]) and all(g.dtype == acc and travels_as_is(g) for g in (gk, gv)):
                own = [gk, gv]
                return
            own = Block.zeros(shapes, acc, q.device)
        into = own if isinstance(own, list) else own.views
        into[0][:, :, keys].add_(gk)
        into[1][:, :, keys].add_(gv)

    def work(w):
        nonlocal dq
        qr, kr = w.q_rows, w.k_rows
        gq, gk, gv, lo = w.kernel.backward(dout[:, :, qr], q[:, :, qr], kv[0][:, :, kr], kv[1][:, :, kr],
                                           out[:, :, qr], lse_of(qr, w.kernel), aux, w.spec)
        if dq is None:
            if w.fresh and qr == whole and gq.dtype == acc:
                dq = gq  # the first gradient covers every row: it is the accumulator
            else:
                dq = torch.empty((B, s, H, D), dtype=acc, device=q.device).transpose(1, 2)
                if not sched.covered:
                    dq.zero_()
        if dq is not gq:
            if w.fresh:
                dq[:, :, qr].copy_(gq)
            else:
                dq[:, :, qr].add_(gq)
        add_kv(gk, gv, slice(kr.start + lo, kr.start + lo + gk.size(2)))

    # Block j's dK/dV accumulators arrive from the rank that held it before. On a GPU they arrive
    # while this step computes, and this step's own are added into them after; on the CPU (gloo:
    # a transfer cannot be polled, only waited for) they are waited for first and this step adds
    # into them directly: no second accumulator is alive during the compute. Either way the
    # received buffer goes on to the next rank.
    eager = q.device.type == "cpu"
    travelling = None
    T = sched.steps
    for t in range(T):
        last = t == T - 1
        pending = None if last else sched.send(kv if kv_block is None else kv_block, t)
        own = None
        if eager and travelling is not None:
            own, travelling = Block(travelling.wait(), shapes), None
        sched.compute(t, work)
        if travelling is not None:
            received, travelling = Block(travelling.wait(), shapes), None
            if isinstance(own, Block):
                received.flat.add_(own.flat)  # dK, dV and the status in one pass
            elif own is not None:
                for into, mine in zip(received.views, own):
                    into.add_(mine)
            own = received
        if own is None:  # nothing of this rank's own at this step, nothing received
            own = Block.zeros(shapes, acc, q.device)
        if T > 1:  # on to the next rank; after the last step home to the rank that owns the block
            travelling = sched.send(own, t, shift=-(T - 1) if last else 1, kind="dkv")
        if pending is not None:
            kv_block = Block(pending.wait(), shapes)
            kv = kv_block.views
    home = own if travelling is None else Block(travelling.wait(), shapes)
    sched.finish([kv_block, home if T > 1 else None], None if groups is None else groups.errors)
    grads = home if isinstance(home, list) else home.views
    dk, dv = (g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, (k, v)))
    if dq is None:  # no call at all
        dq = torch.zeros_like(q, dtype=acc)
    dsinks = None
    if sinks is not None:
        # a sum over every query of terms that largely cancel: accumulate it in fp64 (cheap, [B,H,s])
        delta = (dout.double() * out.double()).sum(-1)  # [B,H,s]
        p_sink = torch.exp(sinks.double()[None, :, None] - lse.double())
        dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
    return dq if dq.dtype == q.dtype else dq.to(q.dtype), dk, dv, dsinks


def head_groups(H: int, K: int, groups: int):
    """(query heads, kv heads) slices of each of ``groups`` equal head groups: kv head j serves
    query heads j*H/K .. (j+1)*H/K - 1 (GQA), so a group of kv heads takes its query heads along."""
    per, rep = K // groups, H // K
    return [(slice(g * per * rep, (g + 1) * per * rep), slice(g * per, (g + 1) * per)) for g in range(groups)]


def forward_by_heads(q, k, v, sinks, opts: RingOptions):
    """``ring_forward`` once per head group (``RingOptions.head_groups``), into one output and
    log-sum-exp: only one group's K/V blocks, receive buffers and accumulators exist at a time.
    Returns (out, lse, one aux per group)."""
    ledger(opts.sp).calls += 1
    if opts.head_groups == 1:
        out, lse, aux = ring_forward(q, k, v, sinks, opts)
        return out, lse, [aux]
    B, H, s, D = q.shape
    out = torch.empty((B, s, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)  # transformers' layout
    lse = torch.empty((B, H, s), dtype=lse_dtype(q), device=q.device)
    auxes, groups = [], _Groups()
    for hq, hk in head_groups(H, k.size(1), opts.head_groups):
        o, l, a = ring_forward(q[:, hq], k[:, hk], v[:, hk], None if sinks is None else sinks[hq], opts, groups)
        out[:, hq] = o
        lse[:, hq] = l
        auxes.append(a)
        del o, l
    if groups.errors:
        raise groups.errors[0]
    return out, lse, auxes


def backward_by_heads(dout, q, k, v, sinks, out, lse, auxes, opts: RingOptions):
    """``ring_backward`` once per head group, into whole dq, dk, dv (and dsinks): one group's
    travelling blocks, dK/dV accumulators and kernel gradients exist at a time."""
    ledger(opts.sp).calls += 1
    if opts.head_groups == 1:
        return ring_backward(dout, q, k, v, sinks, out, lse, auxes[0], opts)
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsinks = None if sinks is None else torch.empty_like(sinks)
    direct = q.dtype == acc_dtype(q)  # dq is summed into its share of the whole: no group-sized accumulator
    groups = _Groups()
    for (hq, hk), aux in zip(head_groups(q.size(1), k.size(1), opts.head_groups), auxes, strict=True):
        gq, gk, gv, gs = ring_backward(dout[:, hq], q[:, hq], k[:, hk], v[:, hk], None if sinks is None else sinks[hq],
                                       out[:, hq], lse[:, hq], aux, opts, dq_into=grads[0][:, hq] if direct else None,
                                       groups=groups)
        if not direct:
            grads[0][:, hq] = gq
        grads[1][:, hk] = gk
        grads[2][:, hk] = gv
        if gs is not None:
            dsinks[hq] = gs
        del gq, gk, gv
    if groups.errors:
        raise groups.errors[0]
    return (*grads, dsinks)


class RingAttention(torch.autograd.Function):
    """Forward: up to P-1 point-to-point K/V hops around the ring per head group, overlapped with
    block compute; none when a checkpointed layer is recomputed (``opts.kept`` hands back what its
    first forward computed). Backward: the same K/V hops again, plus the fp32 dK/dV
    accumulators travelling with them and one final hop home."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, opts: RingOptions):
        kept = None if opts.kept is None else opts.kept.take(q)
        if kept is not None:
            out, lse, aux = kept
        else:
            out, lse, aux = _shared(opts, opts.label, forward_by_heads, q, k, v, sinks, opts)
            if opts.kept is not None:
                opts.kept.put(out, lse, aux)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.opts, ctx.aux = opts, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        lockstep.check_at_end_of_backward(ctx.opts.sp)  # the backward ends with the group's agreement
        grads = _shared(ctx.opts, f"the backward of {ctx.opts.label}", backward_by_heads, dout, q, k, v, sinks, out,
                        lse, ctx.aux, ctx.opts)
        return (*grads, None)


def _shared_with_group(exc: BaseException) -> None:
    """Every rank of the group knows of ``exc`` (its outcome was shared): the step's failure path
    (``ringseq.recovery.step_failed``) tells the group no more."""
    try:
        exc.ringseq_shared = True
    except AttributeError:  # an exception type that takes no attributes: the failure path tells the group again
        pass


def _shared(opts: RingOptions, label: str, run, *args):
    """``run(*args)``, then (``opts.shared``) every rank learns whether it failed on any rank
    (``lockstep.share_outcome``): a rank whose own part failed raises its own exception (an
    out-of-memory stays one), the others a ``RingSeqError`` naming it, all in this call."""
    if not opts.shared:
        return run(*args)
    try:
        result = run(*args)
    except Exception as exc:
        own = not getattr(exc, "relayed", False)  # not a peer's failure that reached this rank as a flag
        note = f"{label}: {type(exc).__name__}: {exc}"
        if own and not isinstance(exc, RingSeqError):  # the note first: a peer left waiting names this rank
            lockstep.mark_failed(opts.sp, note)
        if not lockstep.state(opts.sp).broken:  # a transport that failed carries nothing more
            try:
                lockstep.share_outcome(opts.sp, label, failed=True, origin=own)
                _shared_with_group(exc)
            except RingSeqError:  # the peers never came: this rank's own error is still the one to raise,
                if own and not isinstance(exc, RingSeqError):  # and its note the origin's (the wait's replaced it)
                    lockstep.mark_failed(opts.sp, note)
        raise
    error = lockstep.share_outcome(opts.sp, label, failed=False)
    if error is not None:
        exc = RingSeqError(error)
        _shared_with_group(exc)
        raise exc
    return result
