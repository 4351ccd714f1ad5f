"""Every rank of the job, as one scope for a failed step's news, where an engine spans several sequence groups.

Under an engine over data-parallel replicas (DDP, FSDP2 or HSDP over the world with ``sp_size`` < world, DeepSpeed
with dp > 1) a step that fails in one sequence group must fail in every group: the other replicas would otherwise go
on to the engine's collectives that the failed group never makes (FSDP's next all-gather, DDP's bucket all-reduces)
and wait there with no bound. So, besides its own group's agreements, every rank meets every other rank of the job
at the step's gates (before an FSDP unit's collectives, ``ringseq.engines``) and at the end of the backward, on a
gloo group of its own over the world (never the world group the engine uses). A rank that leaves the step with an
exception tells its own group first and then the job (``ringseq.recovery``): each of the job's agreements follows one
of its group's, so a peer of the same group always meets the news in its group, and every other rank at the job's
next gate or the backward's end. Then every rank of the job compares the engines' collective counts and puts its
engine back (``ringseq.engines.recover``).

``Replicas`` carries what ``ringseq.lockstep`` reads of a ``SequenceParallel`` (ranks, rank, size, the control group,
the layout and Ulysses size its records carry, the timeout), so its records, waits and errors are lockstep's own.
"""
from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Replicas:
    ranks: tuple[int, ...]
    """Every global rank of the job, in order."""
    rank: int
    size: int
    check_group: dist.ProcessGroup
    """A gloo group over every rank, made for this alone."""
    layout: str
    ulysses_size: int
    timeout: float
    stats: bool = False
    replicas: bool = True
    """Marks the scope for lockstep's messages (a peer's failure is in another sequence group)."""

    @property
    def group(self):
        return self.check_group

    @property
    def nccl(self) -> bool:  # its waits are gloo's, bounded by the timeout
        return False


def of(sp) -> Replicas | None:
    """The job's scope over ``sp``'s replicas (None where one sequence group is the whole job, or holds one rank).
    Made at the first call, which every rank of the job makes at the same point (its first training forward under
    an engine): ``dist.new_group`` is collective over the world."""
    if sp.dp_size == 1 or sp.size == 1 or getattr(sp, "timeout", None) is None:
        return None
    made = sp._replicas
    if not made:
        world = dist.get_world_size()
        group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=sp.timeout))
        made.append(Replicas(ranks=tuple(range(world)), rank=dist.get_rank(), size=world, check_group=group,
                             layout=sp.layout, ulysses_size=sp.ulysses_size, timeout=sp.timeout))
    return made[0]
