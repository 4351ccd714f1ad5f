"""Test bodies that run on every rank of a DistPool (they must be importable by the workers)."""
import itertools
import re

import torch
import torch.distributed as dist

import ringseq
from ringseq.reference import attention
from ringseq.testing import assert_shards_close, shared_init

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_qkv(B, H, K, S, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, K, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, K, S, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    return q, k, v, dout


def check_attention(sp, *, B, H, K, S, D, dtype, causal, kernel=None, seed=0, slab_rows=None, head_groups=None):
    """ringseq's out, dq, dk, dv on this rank's shard vs the float64 full-sequence reference."""
    q, k, v, dout = make_qkv(B, H, K, S, D, seed)
    ref = attention(q, k, v, dout, causal=causal, sdpa=True)[:4]
    plain = attention(*(t.to(dtype) for t in (q, k, v, dout)), causal=causal, sdpa=True)[:4]
    local = [ringseq.shard(t.to(dtype), 2, sp=sp).requires_grad_(True) for t in (q, k, v)]
    out = ringseq.ring_attention(*local, sp=sp, causal=causal, kernel=kernel, slab_rows=slab_rows,
                                 head_groups=head_groups)
    out.backward(ringseq.shard(dout.to(dtype), 2, sp=sp))
    case = (f"rank {sp.rank}/{sp.size} {sp.layout} {dtype} causal={causal} B{B} H{H} K{K} S{S} D{D} {kernel} "
            f"slab {slab_rows} head_groups {head_groups}")
    for name, got, p, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), plain, ref):
        assert_shards_close(got, p, r, f"{name} [{case}]", sp=sp)


def attention_matrix(layout, kernel=None):
    """Every dtype x causal x head mode, head dims, batch sizes, slab sizes and head groups cycled,
    on one layout (a slab of 5 rows makes the kernels' slab loops run several times, a partial last
    one; head groups: one per kv head by default, one for all, or two)."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, layout=layout)
    heads = [(8, 8), (8, 2), (8, 1)]
    dims = itertools.cycle([32, 64, 128])
    batches = itertools.cycle([1, 2])
    slab = itertools.cycle([None, 5])
    groups = itertools.cycle([None, 1, 2])
    for dtype, causal, (H, K) in itertools.product(DTYPES.values(), (True, False), heads):
        g = next(groups)
        check_attention(sp, B=next(batches), H=H, K=K, S=16 * world, D=next(dims), dtype=dtype,
                        causal=causal, kernel=kernel, seed=H + K, slab_rows=next(slab),
                        head_groups=g if g is None or K % g == 0 else None)


def head_group_refusals():
    """head_groups that do not divide the ring's kv heads are refused on every rank, before any transfer."""
    import pytest

    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    q, k, v, _ = make_qkv(1, 8, 2, 8 * world, 16)
    local = [ringseq.shard(t.float(), 2, sp=sp) for t in (q, k, v)]
    for bad in (3, 4):  # refused after the agreement (the ring's kv heads), alike on every rank
        with pytest.raises(ringseq.RingSeqError, match="head_groups must be a positive integer dividing the 2 kv"):
            ringseq.ring_attention(*local, sp=sp, head_groups=bad)
    for bad in (0, True, 1.0, "all"):  # refused by this rank's own check, before the agreement
        with pytest.raises(ringseq.RingSeqError, match="head_groups must be a positive integer dividing the kv heads"):
            ringseq.ring_attention(*local, sp=sp, head_groups=bad)
    ringseq.ring_attention(*local, sp=sp, head_groups=2)  # the group goes on


def head_dims(layout):
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, layout=layout)
    for D in (32, 64, 128):
        check_attention(sp, B=2, H=8, K=2, S=24 * world, D=D, dtype=torch.float32, causal=True, seed=D)


def traffic(layout, dtype_name):
    """Bytes per ring hop: one buffer of K and V at kv-head width forward; K/V and the fp32 dK/dV
    backward; each buffer ends in a one-element status (a peer's failure, ``ringseq.attention.comm``)
    in its dtype. One ring for all heads by default; with head groups each group's ring moves its
    share of the heads. Every hop is one transfer of one buffer, but a ring's first of each kind, which
    sends the rank's own K, V (dK, dV) and status as three pieces into the receiver's one buffer."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, layout=layout)
    dtype = DTYPES[dtype_name]
    B, H, K, S, D = 2, 8, 2, 16 * world, 32
    s = S // world
    q, k, v, dout = make_qkv(B, H, K, S, D)
    local = [ringseq.shard(t.to(dtype), 2, sp=sp).requires_grad_(True) for t in (q, k, v)]
    for head_groups, groups in ((None, 1), (1, 1), (2, 2), ("kv", K)):
        hops, real = [], dist.batch_isend_irecv

        def counting(ops):
            sends = [op.tensor for op in ops if op.op is dist.isend]
            if sends:  # a hop's receives are posted apart on gloo (ringseq.attention.comm)
                hops.append((len(sends), sum(t.numel() * t.element_size() for t in sends)))
            return real(ops)

        dist.batch_isend_irecv = counting
        try:
            out = ringseq.ring_attention(*local, sp=sp, head_groups=head_groups)
            forward = list(hops)
            out.backward(ringseq.shard(dout.to(dtype), 2, sp=sp))
        finally:
            dist.batch_isend_irecv = real
        block = B * (K // groups) * s * D
        size = torch.empty(0, dtype=dtype).element_size()
        kv = 2 * block * size + size
        first, later = [(3, kv)], [(1, kv)] * (world - 2)
        assert forward == (first + later) * groups if world > 1 else forward == [], (head_groups, forward, kv)
        backward = sorted(hops[len(forward):])
        dkv = [(3, 2 * block * 4 + 4)] + [(1, 2 * block * 4 + 4)] * (world - 1)  # the first hop in pieces
        expected = sorted((first + later + dkv) * groups) if world > 1 else []
        assert backward == expected, (head_groups, backward, expected)


def shard_gather_roundtrip(layout):
    """gather(shard(x)) == x; gather's backward gives each rank its slice times the group size (the
    gradient rule), and the slices averaged over the group equal the single-process gradient."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, layout=layout)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8 * world, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8 * world, 5, generator=g, dtype=torch.float64)
    full = ringseq.gather(ringseq.shard(x, 1, sp=sp), 1, sp=sp)
    assert torch.equal(full, x)
    (full * w).sum().backward()
    averaged = x.grad.clone()
    dist.all_reduce(averaged, group=sp.group)
    assert torch.equal(averaged / world, w)
    assert torch.equal(ringseq.shard(x.grad, 1, sp=sp), ringseq.shard(w, 1, sp=sp) * world)


def topology(sp_size):
    world, me = dist.get_world_size(), dist.get_rank()
    sp = shared_init(sp_size=sp_size)
    assert (sp.size, sp.dp_size) == (sp_size, world // sp_size)
    assert sp.ranks == tuple(range(me - me % sp_size, me - me % sp_size + sp_size))  # adjacent
    assert sp.rank == me % sp_size and dist.get_rank(sp.group) == sp.rank
    assert dist.get_process_group_ranks(sp.dp_group) == list(range(me % sp_size, world, sp_size))
    assert sp.dp_rank == me // sp_size
    mpu = sp.mpu  # DeepSpeed's view: every rank data-parallel (the gradient rule wants its average over all)
    assert not hasattr(mpu, "get_sequence_parallel_world_size")
    assert mpu.get_data_parallel_world_size() == world and mpu.get_data_parallel_rank() == me
    assert mpu.get_model_parallel_world_size() == 1
    assert sp.sequence_groups == tuple(tuple(range(g * sp_size, (g + 1) * sp_size)) for g in range(world // sp_size))
    # One all-reduce over the gradient group reaches sequence ranks and data ranks alike.
    t = torch.ones(1)
    dist.all_reduce(t, group=sp.grad_group)
    assert t.item() == world


_MESH_SPS = {}


def mesh_in_and_out():
    """ringseq.init(mesh=): the groups follow the mesh's dimensions (in any order, cp or sp, with
    Ulysses); sp.mesh gives it back and sp.meshes its flattened dimensions; a mesh ringseq cannot
    run, or sizes beside it that it contradicts, are refused. ringseq.init(sp_size=) makes a mesh
    of the four dimensions. World 4."""
    from torch.distributed.device_mesh import init_device_mesh

    me = dist.get_rank()

    def made(shape, names):  # each mesh once per worker: every mesh and flattening makes gloo groups
        if (shape, names) not in _MESH_SPS:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            _MESH_SPS[shape, names] = (mesh, ringseq.init(mesh=mesh))
        return _MESH_SPS[shape, names]

    def ranks(mesh):
        return sorted(mesh.mesh.flatten().tolist())

    mesh, sp = made((2, 2), ("dp_shard", "cp"))
    assert sp.mesh is mesh and (sp.size, sp.dp_size, sp.ulysses_size) == (2, 2, 1)
    assert sp.ranks == (me - me % 2, me - me % 2 + 1) and sp.dp_rank == me // 2
    assert ranks(sp.meshes["dp_shard_cp"]) == [0, 1, 2, 3] and sp.meshes["fsdp"] is sp.meshes["dp_shard_cp"]
    assert ranks(sp.meshes["dp"]) == dist.get_process_group_ranks(sp.dp_group)
    _, sp = made((2, 2), ("cp", "dp_shard"))  # the sequence dimension outermost: groups are the columns
    assert sp.ranks == (me % 2, me % 2 + 2) and dist.get_process_group_ranks(sp.dp_group) == [me - me % 2, me - me % 2 + 1]
    _, sp = made((2, 2), ("sp", "ulysses"))
    assert (sp.size, sp.ring_size, sp.ulysses_size, sp.dp_size) == (4, 2, 2, 1)
    assert dist.get_process_group_ranks(sp.ulysses_group) == [me - me % 2, me - me % 2 + 1]
    x = torch.arange(3 * 16, dtype=torch.float64).reshape(3, 16)  # the groups carry a sequence
    assert torch.equal(ringseq.gather(ringseq.shard(x, 1, sp=sp), 1, sp=sp), x)
    mesh, sp = made((2, 1, 2), ("dp_replicate", "dp_shard", "cp"))  # HSDP's mesh for fully_shard
    fsdp = sp.meshes["fsdp"]
    assert fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and fsdp.mesh.tolist() == [[0, 1], [2, 3]]

    sp = shared_init(sp_size=2)
    assert sp.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "ulysses")
    assert tuple(sp.mesh.mesh.shape) == (1, 2, 2, 1) and ranks(sp.meshes["fsdp"]) == [0, 1, 2, 3]
    assert ranks(sp.meshes["dp_cp"]) == [0, 1, 2, 3] and ranks(sp.meshes["dp"]) == [me % 2, me % 2 + 2]
    import warnings

    with warnings.catch_warnings():  # torch >= 2.11 prefers the kept flattened mesh (sp.meshes) to this slice
        warnings.simplefilter("ignore")
        assert ranks(sp.mesh["dp_shard_cp"]) == [0, 1, 2, 3]

    import pytest

    for shape, names, words in (((2, 2), ("dp_shard", "tp"), "dimensions ['tp'] that ringseq does not run"),
                                ((2, 2), ("dp_replicate", "dp_shard"), "exactly one sequence dimension"),
                                ((2, 2), ("cp", "sp"), "exactly one sequence dimension")):
        with pytest.raises(ringseq.RingSeqError, match=re.escape(words)):
            ringseq.init(mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
    with pytest.raises(ringseq.RingSeqError, match="give the mesh alone"):
        ringseq.init(sp_size=4, mesh=made((2, 2), ("dp_shard", "cp"))[0])
    with pytest.raises(ringseq.RingSeqError, match="named dimensions"):
        ringseq.init(mesh=init_device_mesh("cpu", (4,)))


def refuses(sp_size, ulysses_size, match):
    import pytest

    with pytest.raises(ringseq.RingSeqError, match=match):
        ringseq.init(sp_size=sp_size, ulysses_size=ulysses_size)


def refuses_bad_shapes():
    import pytest

    world = dist.get_world_size()
    sp = shared_init(sp_size=world, layout="zigzag")
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 2, 4, 16)
    bad = {
        "4-D": (torch.randn(8, 4, 16), k, k),
        "multiple of kv heads": (q, torch.randn(1, 3, 4, 16), torch.randn(1, 3, 4, 16)),
        "must agree on batch, kv heads and local length": (q, k, torch.randn(1, 2, 6, 16)),
        "agree": (q, torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)),
        "share a dtype": (q, k.double(), k.double()),
        "cannot come from layout": (q[:, :, :3], k[:, :, :3], k[:, :, :3]),
    }
    for match, (a, b, c) in bad.items():
        with pytest.raises(ringseq.RingSeqError, match=match):
            ringseq.ring_attention(a, b, c, sp=sp)


def interleaved_nodes():
    import os

    from .cases_features import reference

    import inspect

    import pytest

    os.environ["GROUP_RANK"] = str(dist.get_rank() % 2)
    try:
        if "sort_ranks" not in inspect.signature(dist.new_group).parameters:  # torch < 2.13: refused, not scrambled
            with pytest.raises(ringseq.RingSeqError, match="in node order, not in rank order"):
                ringseq.init(sp_size=4, ulysses_size=2)
            return
        sp = ringseq.init(sp_size=4, ulysses_size=2)
    finally:
        del os.environ["GROUP_RANK"]
    assert sp.ranks == (0, 2, 1, 3), sp.ranks
    assert dist.get_group_rank(sp.group, dist.get_rank()) == sp.rank, (sp.ranks, sp.rank)
    assert set(dist.get_process_group_ranks(sp.ulysses_group)) in ({0, 2}, {1, 3})
    q, k, v, dout = make_qkv(2, 4, 2, 64, 16, seed=5)
    ref = reference(q, k, v, dout, causal=True)
    local = [ringseq.shard(t.float(), 2, sp=sp).requires_grad_(True) for t in (q, k, v)]
    out = ringseq.ring_attention(*local, sp=sp)
    out.backward(ringseq.shard(dout.float(), 2, sp=sp))
    plain = reference(*(t.float() for t in (q, k, v, dout)), causal=True, sdpa=True)
    for name, got, p, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), plain, ref):
        assert_shards_close(got, p, r, f"{name} interleaved nodes rank {dist.get_rank()}", sp=sp)
    from tests.integration.cases_parity import parity

    parity("qwen3_5", "zigzag", "plain", 64, sp=sp)


def ops_per_ring_step(case: str, mix: str | None):
    """One ring_attention forward + backward makes at most issue 36's bar of operations per ring step
    outside its attention kernels (``benchmarks/ring_ops.py``: bf16, GQA 8/2, D 64, 512 tokens per
    rank, zigzag, sends and receives counted): 16 dense, 24 packed (it was 40-42 and 69-128)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    import ring_ops

    sp = shared_init(sp_size=dist.get_world_size(), layout="zigzag")
    got = ring_ops.count(sp, case, mix)
    assert got["ops_per_step"] <= ring_ops.BARS[case], got
    return got["ops_per_step"]
