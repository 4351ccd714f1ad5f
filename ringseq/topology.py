"""Process groups for sequence parallelism, carved once from a named DeepSpeed topology.

The world is a grid ``data x ring x ulysses`` (DeepSpeed ``ProcessTopology``; the last axis
varies fastest), so the ranks of one sequence group are adjacent and a ring stays inside a
node whenever the sequence group fits in one. Every rank builds every group in the same order,
as torch.distributed requires.
"""
from __future__ import annotations

import dataclasses
import os
import socket

import torch
import torch.distributed as dist

from .errors import RingSeqError
from .layouts import check_layout

AXES = ("data", "ring", "ulysses")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class SequenceParallel:
    """This rank's place in the sequence-parallel topology. Built by ``ringseq.init``.

    Everything that communicates takes this object; nothing in ringseq looks it up globally.
    """

    group: dist.ProcessGroup
    """The sequence group: the ranks that together hold one sequence (size ``size``)."""
    rank: int
    """This rank's index inside ``group``."""
    size: int
    """Ranks per sequence (``sp_size``)."""
    ranks: tuple[int, ...]
    """Global ranks of ``group`` in group order (point-to-point sends address these)."""
    dp_group: dist.ProcessGroup
    """Ranks that hold the same sequence position of different samples."""
    dp_rank: int
    """This rank's index inside ``dp_group``."""
    dp_size: int
    """Number of data-parallel replicas (world / sp_size)."""
    layout: str
    """How tokens are spread over the sequence group (see ``ringseq.layouts``)."""
    ring_group: dist.ProcessGroup
    """Ranks that exchange K/V blocks around the ring (size sp_size / ulysses_size)."""
    ring_rank: int
    ring_size: int
    ring_ranks: tuple[int, ...]
    """Global ranks of ``ring_group`` in ring order."""
    ulysses_group: dist.ProcessGroup | None
    """Adjacent ranks that trade heads for sequence by all-to-all (None when ulysses_size is 1)."""
    ulysses_rank: int
    ulysses_size: int
    grad_group: dist.ProcessGroup
    """All ranks that hold a replica of the weights (sequence x data): gradients are summed
    over it and divided by ``dp_size``."""
    mpu: object
    """DeepSpeed model-parallel-unit view of this topology (``ringseq.launch`` uses it)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_process_group(backend: str | None) -> None:
    """Join the launcher's process group, or make a one-process world when there is none."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "WORLD_SIZE" in os.environ:  # set by torchrun, deepspeed and accelerate launchers
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)


def join_deepspeed_comm() -> None:
    """Let DeepSpeed's comm layer wrap the process group now. ZeRO-3's ``zero.Init`` (which
    transformers' ``from_pretrained`` enters under a ZeRO-3 config) reads the data-parallel size
    through it and, when it is not initialised, silently assumes one process."""
    import deepspeed.comm as ds_comm

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend())
    _release_shm_name()


def _release_shm_name() -> None:
    """Remove the name of this rank's DeepSpeed shared-memory buffer; the buffer stays mapped.

    On CPU, DeepSpeed's comm layer (0.19.8) maps one ~69 MB buffer per rank under /dev/shm,
    named by user, MASTER_ADDR, MASTER_PORT and rank, and never unlinks it: every run left its
    buffers behind in RAM (hundreds after a day of tests). Peers open a rank's buffer by name
    only while the comm layer initialises; past this barrier every rank has, so the names can
    go and the memory is freed when the last process exits.
    """
    dist.barrier()
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def _size_equation(world: int, sp_size: int, ulysses_size: int) -> str:
    ring = f"{sp_size // ulysses_size}" if sp_size % ulysses_size == 0 else f"{sp_size}/{ulysses_size}"
    data = f"{world // sp_size}" if world % sp_size == 0 else "N"
    tail = "" if data != "N" else " for any whole N"
    return f"world {world} is not data {data} x ring {ring} x ulysses {ulysses_size}{tail}"


def _check_sizes(world: int, sp_size: int, ulysses_size: int) -> None:
    if not isinstance(sp_size, int) or sp_size < 1:
        raise RingSeqError(f"sp_size must be a positive integer, got {sp_size!r}")
    if not isinstance(ulysses_size, int) or ulysses_size < 1:
        raise RingSeqError(f"ulysses_size must be a positive integer, got {ulysses_size!r}")
    if sp_size % ulysses_size:
        raise RingSeqError(f"{_size_equation(world, sp_size, ulysses_size)}: ulysses_size "
                           f"{ulysses_size} must divide sp_size {sp_size}")
    if world % sp_size:
        raise RingSeqError(f"{_size_equation(world, sp_size, ulysses_size)}: sp_size {sp_size} must "
                           f"divide the world size; launch a multiple of {sp_size} processes")


def _group(ranks, made: dict):
    """The group of these ranks: the world group for all of them, else one made once per
    ``init`` (every gloo group keeps its own connections and threads, so none is made twice)."""
    ranks = tuple(ranks)
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    if ranks not in made:
        if len(ranks) == 1:  # a group of one: only its member needs to take part
            me = dist.get_rank()
            made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True) if ranks == (me,) else None
        else:
            made[ranks] = dist.new_group(list(ranks))
    return made[ranks]


def _build_groups(lists: list[list[int]], me: int, made: dict):
    """Create one group per rank list (every rank calls for every list); return mine."""
    mine = None
    for ranks in lists:
        group = _group(ranks, made)
        if me in ranks:
            mine = (group, tuple(ranks))
    return mine


def _axis_lists(topo, axis: str, me: int) -> list[list[int]]:
    """Rank lists along ``axis``; an axis of size 1 gives each rank a group of its own."""
    lists = topo.get_axis_comm_lists(axis)
    return lists if lists else [[r] for r in range(dist.get_world_size())]


def init(sp_size: int, ulysses_size: int = 1, layout: str = "zigzag", *,
         backend: str | None = None) -> SequenceParallel:
    """Carve the world into sequence groups and return this rank's ``SequenceParallel``.

    ``sp_size`` ranks hold one sequence: ``sp_size / ulysses_size`` of them form a ring, and
    inside each ring position ``ulysses_size`` adjacent ranks split heads by all-to-all.
    The remaining factor, ``world / sp_size``, is data parallelism. Joins the launcher's
    process group (torchrun, deepspeed, accelerate), or starts a one-process world.
    """
    from deepspeed.runtime.pipe.topology import ProcessTopology

    from .mpu import SequenceParallelMPU

    check_layout(layout)
    _ensure_process_group(backend)
    join_deepspeed_comm()
    world, me = dist.get_world_size(), dist.get_rank()
    _check_sizes(world, sp_size, ulysses_size)
    dims = [world // sp_size, sp_size // ulysses_size, ulysses_size]
    topo = ProcessTopology(axes=list(AXES), dims=dims)

    made: dict = {}
    seq_lists = [topo.filter_match(data=d) for d in range(dims[0])]
    group, ranks = _build_groups(seq_lists, me, made)
    dp_group, dp_ranks = _build_groups(_axis_lists(topo, "data", me), me, made)
    ring_group, ring_ranks = _build_groups(_axis_lists(topo, "ring", me), me, made)
    if ulysses_size > 1:
        ulysses_group, uly_ranks = _build_groups(_axis_lists(topo, "ulysses", me), me, made)
    else:
        ulysses_group, uly_ranks = None, (me,)
    grad_group = dist.group.WORLD
    coord = topo.get_coord(me)
    fields = dict(
        group=group, rank=ranks.index(me), size=sp_size, ranks=ranks,
        dp_group=dp_group, dp_rank=dp_ranks.index(me), dp_size=dims[0], layout=layout,
        ring_group=ring_group, ring_rank=coord.ring, ring_size=dims[1], ring_ranks=ring_ranks,
        ulysses_group=ulysses_group, ulysses_rank=uly_ranks.index(me), ulysses_size=ulysses_size,
        grad_group=grad_group)
    mpu = SequenceParallelMPU(**{k: fields[k] for k in (
        "group", "rank", "size", "dp_group", "dp_rank", "dp_size", "grad_group")})
    return SequenceParallel(**fields, mpu=mpu)
