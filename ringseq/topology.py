"""Process groups for sequence parallelism, carved once from a named grid of the world.

The world is a grid ``data x ring x ulysses`` laid out row-major (the last axis varies
fastest), exactly as DeepSpeed's ``ProcessTopology(axes=["data", "ring", "ulysses"])`` lays it
out (tests/unit compares the two), so the ranks of one sequence group are adjacent and a ring
stays inside a node whenever the sequence group fits in one. The grid is a tensor of ranks, so
the core needs no DeepSpeed import (DeepSpeed's comm layer is joined only where DeepSpeed is
used, in ``ringseq.launch.deepspeed_glue``). Every rank builds every group in the same order,
as torch.distributed requires.
"""
from __future__ import annotations

import dataclasses
import datetime
import inspect
import os

import torch
import torch.distributed as dist

from . import peers
from .config import RingSeqConfig, from_env
from .errors import RingSeqError
from .process_group import ensure_process_group, node_key
from .processes import settle_at_exit

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
    """All ranks that hold a replica of the weights (sequence x data): every gradient is averaged
    over it (``ringseq.gradients``)."""
    timeout: float
    """Seconds any ringseq wait may take before it raises ``RingSeqError``."""
    stats: bool
    """Whether waits and block computes are timed, and each batch's attention work per rank counted,
    for ``ringseq.stats``."""
    mpu: object
    """The model-parallel unit to give DeepSpeed, if any (``ringseq.mpu``): every rank data-parallel,
    as ringseq's gradient rule wants DeepSpeed to average over all of them."""
    check_group: dist.ProcessGroup | None = None
    """A CPU (gloo) group over the ranks of ``group`` for ringseq's control traffic: the lockstep records, shared
    outcomes, a generation step's and GRPO's small broadcasts (``ringseq.lockstep``): ``group`` itself on gloo, a
    gloo group of its own beside NCCL. Never the world group an engine's collectives run on, even when the sequence
    group is the world (``_group``): after a failure no engine collective can pair with one of ringseq's."""
    sequence_groups: tuple[tuple[int, ...], ...] = ()
    """Every sequence group's global ranks (``ringseq.engines`` checks that an engine averages over
    whole groups)."""
    dp_replicate: int = 1
    """How many of the ``dp_size`` replicas are pure replicas (HSDP's outer dimension) in ``mesh``;
    the rest, ``dp_size / dp_replicate``, is its ``dp_shard`` dimension."""
    _meshes: dict = dataclasses.field(default_factory=dict, repr=False)
    """The mesh given to ``init`` or made on first use ("root") and its flattened ones (``meshes``)."""
    _replicas: list = dataclasses.field(default_factory=list, repr=False)
    """The job's scope over the replicas, made on first use (``ringseq.replicas.of``)."""

    @property
    def nccl(self) -> bool:
        """Whether the sequence group's collectives and transfers run on the accelerator's backend (NCCL; else
        gloo, whose waits take a timeout)."""
        return self.check_group is not self.group

    @property
    def mesh(self):
        """The torch ``DeviceMesh`` of this topology (``ringseq.meshes``): the one given to
        ``ringseq.init(mesh=)``, else ``(dp_replicate, dp_shard, cp, ulysses)`` made on first use,
        with torchtitan's flattened dimensions made on it (``mesh["dp_shard_cp"]``; ``meshes`` keeps
        them, as torch >= 2.11 prefers). Every rank must ask for it (the first time makes groups)."""
        return self._made()["root"]

    @property
    def meshes(self) -> dict:
        """The flattened meshes torchtitan uses, by name (``ringseq.meshes``): ``dp_shard_cp``, ``dp``,
        ``dp_cp``, and ``fsdp``, the one to hand ``fully_shard``: ``fully_shard(layer,
        mesh=sp.meshes["fsdp"])``. Every rank must ask for them (the first time makes process groups)."""
        return {name: mesh for name, mesh in self._made().items() if name != "root"}

    def _made(self) -> dict:
        from . import meshes

        if "root" not in self._meshes:
            grid = torch.tensor(self.sequence_groups).reshape(self.dp_size, self.ring_size, self.ulysses_size)
            self._meshes["root"] = meshes.made(grid, self.dp_replicate)
        if "fsdp" not in self._meshes:
            self._meshes.update(meshes.flattened(self._meshes["root"]))
        return self._meshes


def check_sp(sp) -> None:
    if not isinstance(sp, SequenceParallel):
        raise RingSeqError(f"sp must be the SequenceParallel that ringseq.init returned, got {type(sp).__name__}: "
                           f"sp = ringseq.init(sp_size=...) once per process, then pass sp=sp")


def grid(world: int, sp_size: int, ulysses_size: int, nodes: list | None = None) -> torch.Tensor:
    """[data, ring, ulysses] tensor of global ranks, row-major (the last axis fastest), over the
    ranks in node order (``nodes[r]``: rank r's node; None: one node, the identity order): the
    ranks of a node are adjacent in the grid, so a Ulysses group and a sequence group that fit
    in a node stay in it, and a ring longer than a node crosses nodes in as few hops as it can."""
    order = list(range(world))
    if nodes is not None:
        first = {}
        for r, node in enumerate(nodes):
            first.setdefault(node, r)
        order.sort(key=lambda r: (first[nodes[r]], r))
    ranks = torch.tensor(order).reshape(world // sp_size, sp_size // ulysses_size, ulysses_size)
    if nodes is not None and ulysses_size > 1:
        for group in axis_lists(ranks, "ulysses"):
            if len({nodes[r] for r in group}) > 1:
                per_node = min(sum(1 for n in nodes if n == node) for node in set(nodes))
                raise RingSeqError(f"the Ulysses group of global ranks {group} would span nodes "
                                   f"{sorted({str(nodes[r]) for r in group})}: its all-to-all must stay on a node's "
                                   f"fast links. Choose a ulysses_size that divides the {per_node} ranks per node "
                                   f"(the ring crosses nodes instead)")
    return ranks


def axis_lists(ranks: torch.Tensor, axis: str) -> list[list[int]]:
    """Rank lists along ``axis`` (the other coordinates fixed), in DeepSpeed's order."""
    dim = AXES.index(axis)
    moved = ranks.movedim(dim, -1)
    return moved.reshape(-1, moved.size(-1)).tolist()


def sequence_lists(ranks: torch.Tensor) -> list[list[int]]:
    """One list per data index: the ring x ulysses ranks that hold one sequence."""
    return ranks.reshape(ranks.size(0), -1).tolist()


def _group(ranks, made: dict, **options):
    """The group of these ranks, made once per ``init`` (every gloo group keeps its own connections and
    threads, so none is made twice). Never the world group, even for every rank: that is where engines (DDP,
    FSDP over the world) run their collectives, and ringseq's must not share their order (after a failure an
    engine's collective would pair with one of ringseq's; ``ringseq.engines.recover`` counts the engine's).
    Its group ranks follow the list's order, which node placement (``grid``) may leave unsorted: a rank's place
    in its list is its place in the group's collectives."""
    ranks = tuple(ranks)
    key = (ranks, options.get("backend"))
    if key not in made:
        if len(ranks) == 1:  # a group of one: only its member needs to take part
            me = dist.get_rank()
            made[key] = (dist.new_group(list(ranks), use_local_synchronization=True, **options)
                         if ranks == (me,) else None)
        else:
            order = {}
            if list(ranks) != sorted(ranks):
                if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
                    raise RingSeqError(f"the ranks {list(ranks)} of a group are in node order, not in rank order "
                                       f"(the launcher interleaves the nodes' ranks); torch {torch.__version__} "
                                       f"makes groups in rank order only, which would scramble the ring. Use "
                                       f"torch >= 2.13 (dist.new_group(sort_ranks=False)), or launch with each "
                                       f"node's ranks consecutive (torchrun, deepspeed and accelerate do)")
                order = {"sort_ranks": False}
            made[key] = dist.new_group(list(ranks), **options, **order)
    return made[key]


def _build_groups(lists: list[list[int]], me: int, made: dict, **options):
    """Create one group per rank list (every rank calls for every list); return mine."""
    mine = None
    for ranks in lists:
        group = _group(ranks, made, **options)
        if me in ranks:
            mine = (group, tuple(ranks))
    return mine


def init(sp_size: int | None = None, ulysses_size: int = 1, layout: str = "zigzag", *, timeout: float | None = None,
         backend: str | None = None, config: RingSeqConfig | None = None, mesh=None) -> SequenceParallel:
    """Carve the world into sequence groups and return this rank's ``SequenceParallel``.

    ``sp_size`` ranks hold one sequence (None: the whole world): ``sp_size / ulysses_size`` of
    them form a ring, and inside each ring position ``ulysses_size`` adjacent ranks split heads
    by all-to-all. The remaining factor, ``world / sp_size``, is data parallelism. ``timeout``:
    seconds any ringseq wait may take before it raises ``RingSeqError`` (None:
    ``RINGSEQ_TIMEOUT``, else 600). ``config``: a ``ringseq.config.RingSeqConfig`` instead of
    the other settings (``ringseq.init(config=ringseq.config.from_env())`` reads ``RINGSEQ_*``).
    Joins the launcher's process group (torchrun, deepspeed, accelerate; on CUDA after binding
    ``LOCAL_RANK``'s GPU), or starts a one-process world. ``mesh``: a torch ``DeviceMesh`` over
    the world instead of the sizes, its sequence dimension named ``cp`` (or ``sp``), data
    dimensions ``dp_replicate`` / ``dp_shard`` and ``ulysses`` where used (``ringseq.meshes``);
    ``sp.mesh`` gives it back, with the flattened dimensions ``fully_shard`` takes.
    """
    from .mpu import SequenceParallelMPU

    given = RingSeqConfig(sp_size=sp_size, ulysses_size=ulysses_size, layout=layout, timeout=timeout)
    if config is not None and given != RingSeqConfig():
        raise RingSeqError("ringseq.init takes either config= or the settings (sp_size, ulysses_size, layout, "
                           "timeout), not both")
    config = config or given
    ensure_process_group(backend)
    settle_at_exit()
    world, me = dist.get_world_size(), dist.get_rank()
    dp_replicate = 1
    if mesh is not None:
        from . import meshes

        ranks, sizes = meshes.grid_of(mesh, world)
        meshes.check_sizes(sizes, config.sp_size, config.ulysses_size)
        config = dataclasses.replace(config, sp_size=sizes["cp"] * sizes["ulysses"], ulysses_size=sizes["ulysses"])
        dp_replicate = sizes["dp_replicate"]
    config.check_world(world)
    sp_size, ulysses_size, layout = config.sp_size or world, config.ulysses_size, config.layout
    if mesh is None:
        ranks = grid(world, sp_size, ulysses_size, _nodes(world))
    coord = [int(c) for c in (ranks == me).nonzero()[0]]

    made: dict = {}
    bound = {"timeout": datetime.timedelta(seconds=config.resolved_timeout())}  # NCCL's watchdog honours it
    group, seq_ranks = _build_groups(sequence_lists(ranks), me, made, **bound)
    dp_group, dp_ranks = _build_groups(axis_lists(ranks, "data"), me, made)
    ring_group, ring_ranks = _build_groups(axis_lists(ranks, "ring"), me, made, **bound)
    if ulysses_size > 1:
        ulysses_group, uly_ranks = _build_groups(axis_lists(ranks, "ulysses"), me, made, **bound)
    else:
        ulysses_group, uly_ranks = None, (me,)
    # the control traffic's gloo group (records are CPU integers), apart from every group an engine uses: on gloo
    # the sequence group itself (never the world group, ``_group``), else one of its own
    check_group = group
    if dist.get_backend() != "gloo":
        check_group, _ = _build_groups(sequence_lists(ranks), me, made, backend="gloo", **bound)
    fields = dict(
        group=group, rank=seq_ranks.index(me), size=sp_size, ranks=seq_ranks,
        dp_group=dp_group, dp_rank=dp_ranks.index(me), dp_size=ranks.size(0), layout=layout,
        ring_group=ring_group, ring_rank=coord[1], ring_size=ranks.size(1), ring_ranks=ring_ranks,
        ulysses_group=ulysses_group, ulysses_rank=uly_ranks.index(me), ulysses_size=ulysses_size,
        grad_group=dist.group.WORLD, timeout=config.resolved_timeout(), stats=config.resolved_stats(),
        check_group=check_group, sequence_groups=tuple(map(tuple, sequence_lists(ranks))), dp_replicate=dp_replicate)
    sp = SequenceParallel(**fields, mpu=SequenceParallelMPU())
    if mesh is not None:
        sp._meshes["root"] = mesh
    peers.connect(sp)  # the store client the failure notes need, made before any failure
    return sp


def _nodes(world: int) -> list | None:
    """Every rank's node (one all-gather at init), or None for a world of one node."""
    if world == 1:
        return None
    nodes = [None] * world
    dist.all_gather_object(nodes, node_key(os.environ))
    return nodes if len(set(nodes)) > 1 else None


def resolve(sp, section: RingSeqConfig | None = None) -> SequenceParallel:
    """The ``SequenceParallel`` a client (Trainer, SFTTrainer, ``ringseq.initialize``) runs on:
    ``sp`` as given (checked against a ds_config ``"ringseq"`` section), else one built from the
    section, else from ``RINGSEQ_*`` (default: one sequence over the whole world)."""
    if sp is None:
        return init(config=section or from_env())
    check_sp(sp)
    if section is not None:
        section.check_matches(sp)
    return sp
