"""torch ``DeviceMesh`` in and out: ``ringseq.init(mesh=...)`` and ``sp.mesh``.

A mesh's dimensions are named as torchtitan and Accelerate name them: the data dimensions
``dp_replicate`` and ``dp_shard``, the sequence (context-parallel) dimension ``cp`` (``sp`` is
taken too), and ``ulysses`` where heads are traded for sequence by all-to-all. Any of them may be
missing (size 1). ringseq's grid is ``data x ring x ulysses`` with the data dimensions flattened
(``dp_replicate`` outermost), ``ring`` the ``cp`` dimension: a sequence group is the ranks of one
``cp x ulysses`` slice.

``sp.mesh`` is the one given to ``init``, or one made on first use with the four dimensions (sizes
of 1 where unused). ``sp.meshes`` holds the flattened dimensions torchtitan uses, each over the
ranks it names: ``dp_shard_cp`` (``dp_shard x cp x ulysses``: what FSDP2 shards over), ``dp``
(``dp_replicate x dp_shard``: the replicas), ``dp_cp`` (every rank), and ``fsdp``: the mesh to hand
``fully_shard`` (``dp_shard_cp``, or HSDP's ``(dp_replicate, dp_shard_cp)`` with pure replicas).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import RingSeqError

DATA_DIMS = ("dp_replicate", "dp_shard")
SEQUENCE_DIMS = ("cp", "sp")
ULYSSES_DIM = "ulysses"
FLATTENED = {"dp_shard_cp": ("dp_shard", "cp", "ulysses"), "dp": DATA_DIMS, "dp_cp": ("dp_replicate", "dp_shard",
                                                                                        "cp", "ulysses")}


def grid_of(mesh, world: int) -> tuple[torch.Tensor, dict[str, int]]:
    """The [data, ring, ulysses] tensor of global ranks that a mesh describes, and its sizes by
    name (``dp_replicate``, ``dp_shard``, ``cp``, ``ulysses``)."""
    names = mesh.mesh_dim_names
    if not names:
        raise RingSeqError("ringseq.init(mesh=) needs a mesh with named dimensions: init_device_mesh(device, shape, "
                           "mesh_dim_names=('dp_shard', 'cp'))")
    known = DATA_DIMS + SEQUENCE_DIMS + (ULYSSES_DIM,)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise RingSeqError(f"the mesh has dimensions {unknown} that ringseq does not run (it splits data and "
                           f"sequence only: {list(known)}); give ringseq.init a mesh of those dimensions")
    sequence = [n for n in names if n in SEQUENCE_DIMS]
    if len(sequence) != 1:
        raise RingSeqError(f"the mesh {tuple(names)} needs exactly one sequence dimension, named 'cp' (or 'sp'): the "
                           f"ranks that hold one sequence between them")
    ranks = mesh.mesh
    if ranks.numel() != world or sorted(ranks.flatten().tolist()) != list(range(world)):
        raise RingSeqError(f"the mesh holds ranks {sorted(ranks.flatten().tolist())}, not the whole world of {world}: "
                           f"give ringseq.init the root mesh (init_device_mesh over every rank)")
    order = [n for n in ("dp_replicate", "dp_shard", sequence[0], ULYSSES_DIM) if n in names]
    ranks = ranks.permute([names.index(n) for n in order])
    sizes = {n: (ranks.size(order.index(n)) if n in order else 1) for n in ("dp_replicate", "dp_shard")}
    sizes["cp"] = ranks.size(order.index(sequence[0]))
    sizes["ulysses"] = ranks.size(order.index(ULYSSES_DIM)) if ULYSSES_DIM in order else 1
    grid = ranks.reshape(sizes["dp_replicate"] * sizes["dp_shard"], sizes["cp"], sizes["ulysses"])
    return grid.contiguous(), sizes


def check_sizes(sizes: dict, sp_size, ulysses_size) -> None:
    """Refuse settings beside a mesh that the mesh contradicts."""
    mesh_sp = sizes["cp"] * sizes["ulysses"]
    if sp_size not in (None, mesh_sp) or ulysses_size not in (1, sizes["ulysses"]):
        raise RingSeqError(f"the mesh says sp_size {mesh_sp} (cp {sizes['cp']} x ulysses {sizes['ulysses']}) but "
                           f"sp_size={sp_size}, ulysses_size={ulysses_size} were given too: give the mesh alone")


def device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def made(grid: torch.Tensor, dp_replicate: int):
    """The mesh of ringseq's grid: (dp_replicate, dp_shard, cp, ulysses), every rank calling."""
    from torch.distributed.device_mesh import DeviceMesh

    data, ring, uly = grid.shape
    ranks = grid.reshape(dp_replicate, data // dp_replicate, ring, uly)
    return DeviceMesh(device_type(), ranks, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "ulysses"))


def flattened(mesh) -> dict:
    """torchtitan's flattened dimensions (``FLATTENED``) of ``mesh``, each over the dimensions of it
    that the mesh has, kept here (torch >= 2.11 asks that flattened meshes be kept by their maker,
    not sliced from the root), and ``fsdp``: the mesh to hand ``fully_shard``, ``dp_shard_cp``, or
    HSDP's 2-D ``(dp_replicate, dp_shard_cp)`` when there are pure replicas. Every rank calling."""
    names = mesh.mesh_dim_names
    sequence = next(n for n in names if n in SEQUENCE_DIMS)
    out = {}
    for flat, parts in FLATTENED.items():
        dims = tuple(d for d in (sequence if p == "cp" else p for p in parts) if d in names)
        if dims:
            out[flat] = mesh[dims]._flatten(flat) if len(dims) > 1 or dims[0] != flat else mesh[flat]
    replicas = mesh.size(names.index("dp_replicate")) if "dp_replicate" in names else 1
    if replicas == 1:
        out["fsdp"] = out["dp_shard_cp"]
    else:
        whole = out["dp_cp"]
        shape, dims = (replicas, whole.size() // replicas), ("dp_replicate", "dp_shard_cp")
        out["fsdp"] = whole._unflatten(0, shape, dims) if hasattr(whole, "_unflatten") else mesh[dims]
    return out
