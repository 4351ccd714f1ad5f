"""Exact sequence parallelism for recurrent layers: state passing (shapes: ``ringseq.shapes``).

A linear-attention or state-space layer maps a state that enters a run of tokens to the state it
leaves with, and that map is affine: ``S_out = T(S_in) + E`` where ``E`` is the state the run
ends with from a zero start and ``T`` is linear (a K x K matrix per head for the delta rule and
KDA, a scalar decay per head for Mamba2). Its outputs are affine in ``S_in`` too:
``out = out_0 + R(S_in)``. So each rank runs the layer's own kernel once per run of tokens it
holds, from a zero start, and gets everything at once by widening the value (one column per
state row, started at the identity): the kernel's output carries ``out_0`` and ``R``, its final
state carries ``E`` and ``T``. One all-gather of the runs' summaries (``E``, ``T``) per layer;
each rank folds the summaries of every run before its own, in global order, into its runs'
entering states (zigzag: its two runs are far apart and fold separately), and corrects its
outputs: ``out = out_0 + R(S_in)``. Backward is autograd through the kernel, the fold and a
gather whose backward sums the summaries' gradients over the group (every later run on every
rank read them), so the ranks' gradient shares add up to the unpatched model's.

The depthwise causal convolution in front of these layers needs the last ``W - 1`` inputs before
each run: one all-gather of every run's tail (``halo``), also with a summing backward.

Every exchange is agreed (``ringseq.lockstep``) and bounded by ``sp.timeout``.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from . import lockstep
from .errors import RingSeqError
from .layouts import Runs, sp_positions


@dataclasses.dataclass(frozen=True)
class Run:
    """A contiguous run of tokens: where it starts in this rank's shard and in the sequence."""

    rank: int
    local: int
    start: int
    length: int


def _runs_of(positions: torch.Tensor, rank: int) -> list[Run]:
    breaks = (torch.diff(positions) != 1).nonzero().flatten().add(1).tolist()
    edges = [0, *breaks, positions.numel()]
    return [Run(rank, a, int(positions[a]), b - a) for a, b in zip(edges, edges[1:])]


def runs(layout, S: int, P: int, U: int) -> tuple[tuple[Run, ...], ...]:
    """Every sequence rank's runs (in its local order), for a padded length S."""
    if isinstance(layout, Runs):  # a batch's own layout keeps them on itself
        return layout._memo(("recurrent runs", U), lambda: _every_run(layout, S, P, U))
    return _static_runs(layout, S, P, U)


@functools.lru_cache(maxsize=64)
def _static_runs(layout: str, S: int, P: int, U: int) -> tuple[tuple[Run, ...], ...]:
    if layout == "striped":
        raise RingSeqError("recurrent layers (linear attention, state-space, short convolutions) run a sequence "
                           "in order: the striped layout gives every rank every P-th token, so no rank holds a run. "
                           "Use layout='zigzag' (default) or 'contiguous'")
    return _every_run(layout, S, P, U)


def _every_run(layout, S: int, P: int, U: int) -> tuple[tuple[Run, ...], ...]:
    return tuple(tuple(_runs_of(sp_positions(layout, S, P, U, r), r)) for r in range(P * U))


def _record(kind: str, t: torch.Tensor) -> dict[str, int]:
    shape = (list(t.shape) + [-1] * 6)[:6]
    return {"exchange": EXCHANGES.index(kind), "dtype": lockstep.dtype_code(t),
            **{f"shape[{i}]": n for i, n in enumerate(shape)}}


EXCHANGES = ("state summaries", "convolution halo")


class _GatherSummed(torch.autograd.Function):
    """Forward: all-gather [R, ...] per rank into [P, R, ...]. Backward: the gradient summed over
    the group (every rank's later runs read these), this rank's part kept."""

    @staticmethod
    def forward(ctx, local, sp, kind):
        ctx.sp, ctx.kind = sp, kind
        parts = [torch.empty_like(local) for _ in range(sp.size)]
        work = dist.all_gather(parts, local.contiguous(), group=sp.group, async_op=True)
        lockstep.wait(work, sp, f"the all-gather of the {kind} ({tuple(local.shape)})", peer=None)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        sp = ctx.sp
        grad = grad.contiguous()
        lockstep.agree(sp, "exchange backward", _record(ctx.kind, grad))
        work = dist.all_reduce(grad, group=sp.group, async_op=True)
        lockstep.wait(work, sp, f"the all-reduce of the {ctx.kind}' gradients", peer=None)
        return grad[sp.rank], None, None


class _Anchor(torch.autograd.Function):
    """Identity on ``out`` whose backward also reaches ``gathered`` (with zeros): a rank whose own
    runs read nothing of the exchange (the first run of the contiguous layout) still takes part
    in its backward's all-reduce, which every rank of the group makes."""

    @staticmethod
    def forward(ctx, out, gathered):
        ctx.shape, ctx.dtype, ctx.device = gathered.shape, gathered.dtype, gathered.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)


def anchored(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    if gathered.requires_grad and torch.is_grad_enabled():
        return _Anchor.apply(out, gathered)
    return out


def gather_summed(local: torch.Tensor, sp, kind: str) -> torch.Tensor:
    """[R, ...] of every rank of the group, [P, R, ...]: agreed, bounded, summing backward."""
    if sp.size == 1:
        return local[None]
    lockstep.agree(sp, "exchange", _record(kind, local))
    return _GatherSummed.apply(local, sp, kind)


def _my_runs(batch) -> tuple[list[Run], tuple[tuple[Run, ...], ...]]:
    sp = batch.sp
    every = runs(batch.order, batch.padded_length, sp.ring_size, sp.ulysses_size)
    return list(every[sp.rank]), every


# ---- the causal convolution: a halo of W - 1 inputs before each run ---------------------------

class _Halos(list):
    """The halos of this rank's runs, and the exchange they came from (``gathered``)."""

    def __init__(self, halos, gathered):
        super().__init__(halos)
        self.gathered = gathered


def _tails(x: torch.Tensor, width: int, batch):
    """Every rank's runs' last ``width`` inputs [P, R, B, C, width] (x [B, C, s] this rank's
    tokens), and the runs in global order: one agreed all-gather with a summing backward."""
    mine, every = _my_runs(batch)
    R = max(len(r) for r in every)
    B, C, _ = x.shape
    tails = x.new_zeros(R, B, C, width)
    for i, run in enumerate(mine):
        n = min(width, run.length)
        tails[i, :, :, width - n:] = x[:, :, run.local + run.length - n: run.local + run.length]
    every_tail = gather_summed(tails, batch.sp, "convolution halo")
    ordered = sorted((run.start, run.rank, i) for r in every for i, run in enumerate(r))
    return every_tail, every, ordered


def _before(start: int, width: int, every_tail, every, ordered, x) -> torch.Tensor:
    """The ``width`` inputs before global index ``start`` [B, C, width], from the runs' tails
    (zeros before the sequence's first token)."""
    pieces, need = [], width
    k = sum(1 for s, _, _ in ordered if s < start) - 1
    while need > 0 and k >= 0:
        _, rank, i = ordered[k]
        n = min(need, every[rank][i].length)
        pieces.insert(0, every_tail[rank, i, :, :, width - n:])
        need, k = need - n, k - 1
    if need > 0:
        pieces.insert(0, x.new_zeros(*x.shape[:2], need))
    return torch.cat(pieces, -1)


def conv_halo(x: torch.Tensor, width: int, batch) -> list[torch.Tensor]:
    """For x [B, C, s] (this rank's tokens), the ``width`` inputs (a convolution's kernel size
    minus one) before each of this rank's runs, in global order [B, C, width] (zeros before the
    sequence's first token)."""
    every_tail, every, ordered = _tails(x, width, batch)
    mine, _ = _my_runs(batch)
    return _Halos([_before(run.start, width, every_tail, every, ordered, x) for run in mine], every_tail)


def sequence_tail(x: torch.Tensor, width: int, batch) -> torch.Tensor:
    """The whole sequence's last ``width`` inputs [B, C, width] (x [B, C, s] this rank's tokens),
    the same on every rank: what a convolution's cache holds after the prompt."""
    every_tail, every, ordered = _tails(x, width, batch)
    return _before(batch.padded_length, width, every_tail, every, ordered, x)


def causal_conv(kernel, x: torch.Tensor, weight: torch.Tensor, batch, **kwargs) -> torch.Tensor:
    """The model's own depthwise causal convolution ``kernel(x [B, C, s], weight [C, W], ...)`` of
    this rank's tokens, each run preceded by its halo: what the unpatched model computes there."""
    width = weight.size(-1) - 1
    if width == 0:
        return kernel(x, weight, **kwargs)
    mine, _ = _my_runs(batch)
    halos = conv_halo(x, width, batch)
    outs = [kernel(torch.cat([h, x[:, :, run.local:run.local + run.length]], -1), weight, **kwargs)[..., width:]
            for run, h in zip(mine, halos)]
    return anchored(outs[0] if len(outs) == 1 else torch.cat(outs, -1), halos.gathered)


# ---- the recurrence: summaries, fold, correction -----------------------------------------------

class DeltaRule:
    """Gated DeltaNet and KDA: state [B, H, Dk, Dv]; a run maps S to M S + E (M: Dk x Dk per head);
    the output reads the state through the queries: out = out_0 + R S."""

    @staticmethod
    def widen(value: torch.Tensor, Dk: int):
        """value [B, s, H, Dv] -> (value with Dk zero columns, the initial state [0 | I])."""
        B, s, H, Dv = value.shape
        wide = torch.cat([value, value.new_zeros(B, s, H, Dk)], -1)
        init = torch.zeros(B, H, Dk, Dv + Dk, dtype=value.dtype, device=value.device)
        init[..., Dv:] = torch.eye(Dk, dtype=value.dtype, device=value.device)
        return wide, init

    @staticmethod
    def split(out, final, Dv: int):
        """(out_0 [B,s,H,Dv], R [B,s,H,Dk], summary [B,H,Dk,Dv+Dk] = [E | M])."""
        return out[..., :Dv], out[..., Dv:], final

    @staticmethod
    def fold(S, summary, Dv: int):
        E, M = summary[..., :Dv], summary[..., Dv:]
        return E if S is None else M @ S + E

    @staticmethod
    def correct(out0, R, S):
        return out0 if S is None else out0 + torch.einsum("bshk,bhkv->bshv", R, S.to(R.dtype))


class Mamba2:
    """Mamba2: state [B, H, P, N]; a run maps S to a S + E (a: one decay per head); the output
    reads the state through C: y = y_0 + R S^T."""

    @staticmethod
    def widen(x: torch.Tensor, N: int):
        B, s, H, Pd = x.shape
        wide = torch.cat([x, x.new_zeros(B, s, H, N)], -1)
        init = torch.zeros(B, H, Pd + N, N, dtype=torch.float32, device=x.device)
        init[:, :, Pd:] = torch.eye(N, device=x.device)
        return wide, init

    @staticmethod
    def split(out, final, Pd: int):
        """(y_0, R [B,s,H,N], summary [B,H,Pd+1,N]: E and the decay (the widened rows end as a I))."""
        decay = final[:, :, Pd:Pd + 1, :1].expand(-1, -1, 1, final.size(-1))
        return out[..., :Pd], out[..., Pd:], torch.cat([final[:, :, :Pd], decay], 2)

    @staticmethod
    def fold(S, summary, Pd: int):
        E, a = summary[:, :, :Pd], summary[:, :, Pd:Pd + 1, :1]
        return E if S is None else a * S + E

    @staticmethod
    def correct(out0, R, S):
        return out0 if S is None else out0 + torch.einsum("bshn,bhpn->bshp", R, S.to(R.dtype))


def state_passing(kind, run_kernel, inputs: dict, value_name: str, extra: int, batch, whole: bool = False):
    """Run ``run_kernel(**inputs_of_a_run, initial=..., value=widened)`` on each of this rank's
    runs from the widened zero state, exchange the runs' summaries, fold them in global order and
    correct each run's output. ``inputs``: the kernel's per-token tensors [B, s, ...] (sequence on
    dim 1); ``value_name``: the one that carries the state's columns; ``extra``: the state rows
    (Dk, or Mamba2's N). Returns the output [B, s, H, Dv] in the kernel's output dtype; with
    ``whole``, also the state after the whole sequence (every run folded: the same on every rank,
    what a cache holds after the prompt)."""
    mine, every = _my_runs(batch)
    value = inputs[value_name]
    Dv = value.size(-1)
    outs, Rs, summaries = [], [], []
    for run in mine:
        part = {k: v.narrow(1, run.local, run.length) for k, v in inputs.items()}
        part[value_name], init = kind.widen(part[value_name], extra)
        out, final = run_kernel(part, init)
        out0, R, summary = kind.split(out, final, Dv)
        outs.append(out0)
        Rs.append(R)
        summaries.append(summary)
    R_max = max(len(r) for r in every)
    local = torch.stack(summaries + [torch.zeros_like(summaries[0])] * (R_max - len(summaries)))
    gathered = gather_summed(local, batch.sp, "state summaries")  # [P, R, B, H, rows, cols]
    ordered = sorted((run.start, run.rank, i) for r in every for i, run in enumerate(r))
    last = max(run.start for run in mine)
    entering, S = {}, None
    for start, rank, i in ordered:
        entering[(rank, i)] = S
        if start >= last and not whole:
            break  # no run of this rank comes later
        S = kind.fold(S, gathered[rank, i], Dv)
    results = [kind.correct(o, R, entering[(batch.sp.rank, i)]) for i, (o, R) in enumerate(zip(outs, Rs))]
    # contiguous, as the kernel's own output is (callers view it)
    out = anchored(results[0].contiguous() if len(results) == 1 else torch.cat(results, 1), gathered)
    return (out, S) if whole else out
