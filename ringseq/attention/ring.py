"""The ring: blockwise forward and backward over K/V blocks that travel the ring.

Shapes (``ringseq.shapes``): q [B,H,s,D], k/v [B,K,s,D], out [B,H,s,D], lse fp32 [B,H,s].

Forward, at step t = 0..T-1, rank r holds the K/V block of rank j = (r - t) mod P. It posts
the transfer of that block to rank r+1, computes the calls the schedule lists for (r, j)
(``ringseq.attention.schedule.rank_schedule``: hidden blocks skipped, masks only where
needed), merges the partial outputs into an fp32 (fp64 for fp64 inputs) accumulator by
log-sum-exp, then waits. The log-sum-exp itself is kept in fp64 ([B,H,s]: free), so that the
backward's exp(score - lse) is as accurate as a plain softmax.
T is P for plain causal attention; windows and documents can make it as small as 1.

Backward runs the same ring with the merged ``out``/``lse``. The dK/dV of block j travel with
it: each rank adds its contribution to the accumulator it received and passes it on; after
the last step one transfer sends every accumulator home (for T = P that is the next rank).
Only the K kv heads cross the wire, never copies repeated to H heads.

A call runs one such ring per head group (``RingOptions.head_groups``; ``ring_attention``'s
default: one per kv head, with its query heads), one after the other, into one output, log-sum-exp
and gradient each (``forward_by_heads``, ``backward_by_heads``): the blocks, receive buffers, dK/dV
accumulators and kernel gradients of one group exist at a time, a group's share of the memory
the backward's peak held for all heads at once; the transfers are as many times more, each as
much smaller. The groups share the call's schedule.

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

from .comm import RingComm, travels_as_is
from .kernels import BlockSpec, for_call
from .kernels.common import LSE, acc_dtype
from .masks import RowMask, TokenInfo
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
    its constructor and ``post``/``fail``/``failed`` (the GPU check passes a virtual ring of threads)."""
    head_groups: int = 1
    """Rings per call, each over an equal share of the kv heads (and their query heads), one after
    the other (``RingAttention``); must divide the kv heads the ring holds."""

    @property
    def P(self) -> int:
        return len(self.ranks)


class _Schedule:
    """This rank's view of the ring schedule: per step, (call, kernel, spec) triples."""

    def __init__(self, q, opts: RingOptions, number: int, like: tuple | None = None,
                 failed: BaseException | None = None):
        """``like``: (steps, plan, work) of another head group of the same call (``prepared``),
        whose plan and prepared calls (they depend on the tokens, not the heads) this one reuses
        with a transport of its own.
        ``failed``: an earlier group's failure (this rank's or a peer's): this ring makes its
        transfers, flagged failed so every peer learns of it, and computes nothing."""
        B, _, s, _ = q.shape
        self.opts, self.B, self.S, self.device = opts, B, s * opts.P, q.device
        if like is None:
            plan = rank_schedule(opts.layout, self.S, opts.P, opts.r, opts.causal, opts.info, opts.window)
            self.steps, self.plan = plan.steps, plan.calls
        else:
            self.steps, self.plan = like[:2]
        self.comm = None
        self.clock = Clock(opts.sp)
        if self.steps > 1:
            self.comm = opts.transport(opts.group, opts.ranks, opts.r, opts.sp, opts.label, self.clock, q.device,
                                       tag=number)
        self.error: BaseException | None = failed
        """The exception this rank's block compute raised; the ring's transfers go on without compute."""
        self.inherited = failed is not None
        """Whether ``error`` is an earlier group's (already reported)."""
        self.work: list[list] = [[] for _ in self.plan]
        """(call, kernel, spec) per step: a backend per call and its device metadata, all before the loop."""
        try:
            if failed is None:
                self.work = like[2] if like is not None else [[self._prepare(q, pc) for pc in step]
                                                              for step in self.plan]
        except RingSeqError as exc:  # a forced kernel that cannot take a call: fail like a block compute
            self.error = exc
        if self.error is not None and self.comm is not None:
            self.comm.fail()

    def prepared(self) -> tuple:
        """(steps, plan, work): what the next head group reuses (not the transport or its buffers)."""
        return self.steps, self.plan, self.work

    def _prepare(self, q, pc):
        o = self.opts
        mask = RowMask(pc.q, pc.k, o.info, o.window, o.causal, self.B, self.device) if pc.masked else None
        spec = BlockSpec(causal=pc.call.causal, scale=o.scale, softcap=o.softcap, mask=mask, rows=o.slab_rows)
        n, m = (r.stop - r.start for r in (pc.call.q_rows, pc.call.k_rows))
        return pc.call, for_call(q, o.kernel, spec, n, m), spec

    def compute(self, t: int, work) -> None:
        """Run ``work(call, kernel, spec)`` for every call of step t, unless this rank failed
        already; a failure is kept (and flagged to the peers) until the ring has finished."""
        if self.error is not None:
            return
        start = time.perf_counter()
        try:
            for call, kernel, spec in self.work[t]:
                work(call, kernel, spec)
        except Exception as exc:  # noqa: BLE001 - re-raised by finish(), after the peers were told
            self.error = exc
            if self.comm is not None:
                self.comm.fail()
        self.clock.time("compute_s", start)

    def finish(self, errors: list | None = None) -> None:
        """Raise this rank's own failure, or a peer's, now that every transfer is done; with
        ``errors`` (a call of several head groups) append it there instead, so the next groups'
        rings still make their transfers and carry the news (``backward_by_heads``)."""
        error = None
        if self.error is not None:
            if not self.inherited:
                lockstep.mark_failed(self.opts.sp, f"{self.opts.label}: {type(self.error).__name__}: {self.error}")
            error = self.error
        elif self.comm is not None and self.comm.failed():
            lockstep.mark_failed(self.opts.sp)
            error = RingSeqError(f"{self.opts.label} failed on another rank of the ring (its block compute raised; "
                                 f"see that rank's error): this rank stops too instead of using its blocks")
        if error is None:
            return
        if errors is None:
            raise error
        errors.append(error)


def _merge(out_acc, lse_acc, rows: slice, o, l):
    """Fold a partial (o, l) for query ``rows`` into the running (out_acc, lse_acc), in place."""
    old = lse_acc[..., rows]
    new = torch.logaddexp(old, l)
    w_old = torch.exp(old - new).nan_to_num_(0.0).unsqueeze(-1)  # nan only where both are -inf
    w_new = torch.exp(l - new).nan_to_num_(0.0).unsqueeze(-1)
    acc = out_acc[..., rows, :]
    acc.mul_(w_old.to(acc.dtype)).addcmul_(o.to(acc.dtype), w_new.to(acc.dtype))
    lse_acc[..., rows] = new


def _empty_if_none(out_acc, lse_acc, shape, dtype, device):
    """The accumulators of rows that have seen no key yet: output 0, log-sum-exp -inf."""
    if out_acc is not None:
        return out_acc, lse_acc
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.full(shape[:-1], float("-inf"), dtype=LSE, device=device))


def _fold_sinks(out, lse, sinks):
    """Add exp(sink[h]) to every softmax denominator of head h, in place."""
    sink = sinks.to(lse.dtype)[None, :, None]
    new = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - new).unsqueeze(-1).to(out.dtype))
    lse.copy_(new)


@dataclasses.dataclass
class _Groups:
    """What the head groups of one call share: the first group's prepared schedule
    (``_Schedule.prepared``) and the failures so far (after one, the later groups' rings only make
    their transfers)."""

    schedule: tuple | None = None
    errors: list = dataclasses.field(default_factory=list)

    def start(self, q, opts: RingOptions, number: int) -> _Schedule:
        sched = _Schedule(q, opts, number, like=self.schedule, failed=self.errors[0] if self.errors else None)
        if self.schedule is None:
            self.schedule = sched.prepared()
        return sched


def _start(q, opts: RingOptions, number: int, groups: _Groups | None) -> _Schedule:
    return _Schedule(q, opts, number) if groups is None else groups.start(q, opts, number)


def ring_forward(q, k, v, sinks, opts: RingOptions, groups: _Groups | None = None):
    """Return (out in q dtype, lse [B,H,s] in fp64, aux for the backward kernel). ``groups``: what
    the head groups of the call share (``forward_by_heads``); a failure is then recorded there,
    not raised."""
    sched = _start(q, opts, opts.numbers.forward, groups)
    B, H, s, D = q.shape
    acc = acc_dtype(q)
    out_acc = lse_acc = aux = None
    kv = (_uncopied(k), _uncopied(v))

    def work(call, kernel, spec):
        nonlocal out_acc, lse_acc, aux
        o, l, a = kernel.forward(q[:, :, call.q_rows], kv[0][:, :, call.k_rows], kv[1][:, :, call.k_rows], spec)
        aux = aux if aux is not None else a
        if out_acc is None and call.q_rows == slice(0, s):  # first call covers every row
            out_acc, lse_acc = o.to(acc), l.to(LSE)
            return
        out_acc, lse_acc = _empty_if_none(out_acc, lse_acc, (B, H, s, D), acc, q.device)
        _merge(out_acc, lse_acc, call.q_rows, o, l)

    for t in range(sched.steps):
        pending = sched.comm.post(list(kv), t) if t < sched.steps - 1 else None
        sched.compute(t, work)
        if pending is not None:
            kv = tuple(pending.wait())
    sched.finish(None if groups is None else groups.errors)
    out_acc, lse_acc = _empty_if_none(out_acc, lse_acc, (B, H, s, D), acc, q.device)
    if sinks is not None:
        _fold_sinks(out_acc, lse_acc, sinks)
    return _seq_major(out_acc, q.dtype), lse_acc, aux


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


def _accumulate(total, rows: slice, grad, like: torch.Tensor, dtype, travels: bool):
    """``total[:, :, rows] += grad``; the first gradient that covers every row becomes the
    accumulator itself (no zero-filled one beside it: the backward's peak is these buffers),
    in the kernel's layout unless it ``travels`` and the wire would copy it (``comm.wire``);
    a zero-filled one takes the layout of ``like`` (the ring's K/V: the wire's)."""
    if total is None:
        if rows == slice(0, like.shape[2]) and grad.shape == like.shape and (not travels or travels_as_is(grad)):
            return grad.to(dtype)
        total = torch.zeros_like(like, dtype=dtype)
    total[:, :, rows] += grad
    return total


def ring_backward(dout, q, k, v, sinks, out, lse, aux, opts: RingOptions, dq_into=None,
                  groups: _Groups | None = None):
    """Return (dq, dk, dv, dsinks) in the input dtypes; accumulation is fp32 (fp64 for fp64).
    ``dq_into``: a tensor of q's shape in the accumulation dtype that dq is summed into (and
    returned as): a head group's share of the whole dq (``backward_by_heads``); ``groups`` as for
    ``ring_forward``."""
    opts = dataclasses.replace(opts, label=f"the backward of {opts.label}")
    sched = _start(q, opts, opts.numbers.backward, groups)
    acc = acc_dtype(q)
    # The gradient arrives as a [B,H,s,D] view of [B,s,H,D] memory (transformers' layout). The
    # CPU flash kernel works in that layout and copies a contiguous dout back into it, so on CPU
    # it stays as it came (two q-sized copies fewer); other kernels get it contiguous.
    if dout.device.type != "cpu" or dout.stride(-1) != 1:
        dout = dout.contiguous()
    # A row that sees no key at all (lse -inf) has output 0 and passes no gradient; +inf
    # makes every exp(score - lse) of that row exactly 0 instead of nan.
    lse_b = lse.masked_fill(lse == float("-inf"), float("inf"))
    dq = None if dq_into is None else dq_into.zero_()
    dk = dv = None
    kv, travelling = (_uncopied(k), _uncopied(v)), None

    def work(call, kernel, spec):
        nonlocal dq, dk, dv
        qr, kr = call.q_rows, call.k_rows
        gq, gk, gv = kernel.backward(dout[:, :, qr], q[:, :, qr], kv[0][:, :, kr], kv[1][:, :, kr],
                                     out[:, :, qr], lse_b[:, :, qr], aux, spec)
        dq = _accumulate(dq, qr, gq, q, acc, travels=False)
        dk = _accumulate(dk, kr, gk, kv[0], acc, travels=sched.steps > 1)
        dv = _accumulate(dv, kr, gv, kv[1], acc, travels=sched.steps > 1)

    # Block j's dK/dV accumulators arrive from the rank that held it before. On a GPU they arrive
    # while this step computes, into a buffer of their own, and are added after. On the CPU
    # (gloo: a transfer cannot be polled, only waited for) they are waited for first and this
    # step adds into them: neither the accumulators sent at the last step nor a fresh pair for
    # this one is alive during the compute (two accumulator pairs fewer at the backward's peak,
    # for a transfer that is short against a CPU block's compute).
    eager = q.device.type == "cpu"
    sets = 2 if eager else 1  # eager: the pair received last is sent on while the next arrives
    for t in range(sched.steps):
        last = t == sched.steps - 1
        pending_kv = None if last else sched.comm.post(list(kv), t)
        dk = dv = None  # otherwise they start at this rank's own contribution
        if travelling is not None and eager:
            dk, dv = travelling.wait()
            travelling = None
        sched.compute(t, work)
        if dk is None:  # no call of this step (or a failed compute): nothing of this rank's own
            dk = torch.zeros_like(kv[0], dtype=acc)
            dv = torch.zeros_like(kv[1], dtype=acc)
        if travelling is not None:
            dk_in, dv_in = travelling.wait()
            dk += dk_in
            dv += dv_in
        if not last:
            travelling = sched.comm.post([dk, dv], t, kind="dkv", sets=sets)
            kv = tuple(pending_kv.wait())
    if sched.steps > 1:  # send each accumulator home to the rank that owns the block
        dk, dv = sched.comm.post([dk, dv], sched.steps - 1, shift=-(sched.steps - 1), kind="dkv", sets=sets).wait()
    sched.finish(None if groups is None else groups.errors)
    if dq is None:
        dq = torch.zeros_like(q, dtype=acc)
    dsinks = None
    if sinks is not None:
        # a sum over every query of terms that largely cancel: accumulate it in fp64 (cheap, [B,H,s])
        delta = (dout.double() * out.double()).sum(-1)  # [B,H,s]
        p_sink = torch.exp(sinks.double()[None, :, None] - lse.double())
        dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


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
    lse = torch.empty((B, H, s), dtype=LSE, device=q.device)
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
            out, lse, aux = forward_by_heads(q, k, v, sinks, opts)
            if opts.kept is not None:
                opts.kept.put(out, lse, aux)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.opts, ctx.aux = opts, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        return (*backward_by_heads(dout, q, k, v, sinks, out, lse, ctx.aux, ctx.opts), None)
