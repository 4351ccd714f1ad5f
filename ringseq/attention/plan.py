"""The ring's plan for one batch: every ring step's kernel calls, ready to run (``ringseq.shapes``).

Everything a ring call needs that depends on the batch's tokens and the call's options, not on
the tensors - the ring schedule (``schedule.rank_schedule``), each call's mask, its backend and
the backend's device tables (varlen runs, block masks, additive masks) - is made once and kept
on the batch's ``TokenInfo`` (a batch without documents or padding: in a small table by shape),
so every layer, head group and the backward share it and a ring step only runs kernels and
merges. The plan also knows which call first writes each query row: that call's output and
log-sum-exp are copied into the accumulators instead of merged (``Work.fresh``).
"""
from __future__ import annotations

import collections
import dataclasses

from .kernels import BlockSpec, flash_impl, for_call
from .masks import RowMask
from .schedule import rank_schedule

FLOOR = -1e30
"""The merged log-sum-exp of a query row that has seen no key yet: finite, so the merge needs no
nan handling (exp(FLOOR - x) is 0 for any real x), and far below any real score. Kernels report
-inf for such rows; the first copy clamps it to FLOOR."""


@dataclasses.dataclass(frozen=True)
class Work:
    """One kernel call of a ring step."""

    q_rows: slice
    k_rows: slice
    kernel: object
    spec: BlockSpec
    fresh: bool
    """The first call that writes these query rows: copied into the accumulators, not merged."""
    empty: bool
    """Some query rows may see none of the call's keys (their log-sum-exp is -inf)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    steps: int
    """Ring steps every rank of the ring runs."""
    work: tuple
    """This rank's ``Work`` per step."""
    covered: bool
    """Every query row is written first by a fresh call (else the accumulators start at zero)."""
    calls: dict
    """Kernel calls of one ring by backend name (``ringseq.stats``)."""


_SHAPES: collections.OrderedDict = collections.OrderedDict()
"""Plans of batches without documents, padding or blocks: they depend on shapes and options only."""
SHAPE_PLANS = 64


def plan(q, opts) -> Plan:
    """The plan of a ring call on ``q`` (this rank's queries or a head group's) with ``opts``."""
    info = opts.info
    B, _, s, D = q.shape
    key = ("ring plan", opts.layout if isinstance(opts.layout, str) else id(opts.layout), s * opts.P, opts.P,
           opts.r, opts.causal, opts.window, opts.kernel, q.device, q.dtype, D, B, opts.scale, opts.softcap,
           opts.slab_rows)
    cache = info._cache if not info.trivial or info.layout is not None else _SHAPES
    found = cache.get(key)
    if found is None:
        found = cache[key] = _make(q, opts)
        if cache is _SHAPES and len(_SHAPES) > SHAPE_PLANS:
            _SHAPES.popitem(last=False)
    return found


def _make(q, opts) -> Plan:
    B, _, s, _ = q.shape
    if q.device.type == "cuda":
        flash_impl.ensure(q.device)  # FA3 or torch's own flash kernels: decided once per process
    sched = rank_schedule(opts.layout, s * opts.P, opts.P, opts.r, opts.causal, opts.info, opts.window)
    written: list[tuple[int, int]] = []  # query-row intervals written so far, in call order
    covered, steps = True, []
    for calls in sched.calls:
        step = []
        for pc in calls:
            mask = RowMask(pc.q, pc.k, opts.info, opts.window, opts.causal, B, q.device) if pc.masked else None
            spec = BlockSpec(causal=pc.call.causal, scale=opts.scale, softcap=opts.softcap, mask=mask,
                             rows=opts.slab_rows)
            rows, keys = pc.call.q_rows, pc.call.k_rows
            kernel = for_call(q, opts.kernel, spec, rows.stop - rows.start, keys.stop - keys.start)
            span = (rows.start, rows.stop)
            fresh = not any(a < span[1] and span[0] < b for a, b in written)
            if not fresh and not _inside(span, written):
                covered = False  # rows of a merged call not written before: the accumulators start at zero
            written.append(span)
            step.append(Work(rows, keys, kernel, spec, fresh, mask is not None))
        steps.append(tuple(step))
    if not _inside((0, s), written):
        covered = False  # rows no call writes (they see no key): zero output, log-sum-exp FLOOR
    calls = collections.Counter(w.kernel.name for step in steps for w in step)
    return Plan(steps=sched.steps, work=tuple(steps), covered=covered, calls=dict(calls))


def _inside(span: tuple[int, int], written: list[tuple[int, int]]) -> bool:
    """Whether the rows ``span`` all lie in the union of the ``written`` intervals."""
    reach = span[0]
    for a, b in sorted(written):
        if a > reach:
            break
        reach = max(reach, b)
    return reach >= span[1]
