"""Decode attention over a key set split across the group against a float64 dense reference."""
import math

import torch
import torch.distributed as dist

from ringseq import lockstep
from ringseq.attention import decode
from ringseq.testing import assert_close, shared_init


def _dense(q, k, v, q_pos, k_pos, valid, scale, window, softcap, sinks):
    """Plain attention over every key (K/V repeated for the query heads), in q's dtype."""
    H, K = q.size(1), k.size(1)
    k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    vis = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        vis = vis & (q_pos[:, None] - k_pos[None, :] < window)
    s = s.masked_fill(~(vis[None] & valid[:, None])[:, None], -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1).to(s.dtype)], -1)
    p = torch.softmax(s, -1)[..., : k.size(2)]
    return p @ v


def decode_matches_dense(seed=0):
    """n new queries over m keys held by the group's ranks in an interleaved order (each rank
    every P-th key, as decode steps hand them out), slabs smaller than a rank's keys (the
    partial's slab loop runs); windows, softcap, sinks, padding, GQA; fp32 and bf16."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    g = torch.Generator().manual_seed(seed)
    B, H, K, n, m, D = 2, 8, 2, 3, 96, 16
    q64, k64, v64 = (torch.randn(B, h, s, D, generator=g, dtype=torch.float64) for h, s in ((H, n), (K, m), (K, m)))
    k_pos = torch.arange(m)
    q_pos = torch.arange(m - n, m)
    valid = torch.ones(B, m, dtype=torch.bool)
    valid[1, :17] = False
    sinks64 = torch.randn(H, generator=g, dtype=torch.float64)
    mine = torch.arange(sp.rank, m, world)
    old, decode.KEY_SLAB = decode.KEY_SLAB, 7
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for window, softcap, sinks in ((None, None, None), (20, None, None), (None, 2.0, None),
                                           (None, None, sinks64), (40, 3.0, sinks64)):
                q, k, v = (t.to(dtype) for t in (q64, k64, v64))
                sk = None if sinks is None else sinks.to(dtype)
                scale = D ** -0.5
                got = decode.decode_attention(q, k[:, :, mine], v[:, :, mine], sp=sp, q_pos=q_pos, k_pos=k_pos[mine],
                                              k_valid=valid[:, mine], scale=scale, window=window, softcap=softcap,
                                              sinks=sk)
                ref = _dense(q64, k64, v64, q_pos, k_pos, valid, scale, window, softcap, sinks)
                plain = _dense(q, k, v, q_pos, k_pos, valid, scale, window, softcap, sk)
                assert_close(got, plain, ref, f"decode {dtype} window={window} softcap={softcap} "
                                              f"sinks={sinks is not None} rank {sp.rank}/{world}")
                every = [torch.empty_like(got) for _ in range(world)]
                dist.all_gather(every, got, group=sp.group)
                assert all(torch.equal(e, got) for e in every), "ranks merged different outputs"
    finally:
        decode.KEY_SLAB = old


def decode_loop_skips_a_failed_step(steps: int = 4, failing: int = 1, agreed: bool = False, deferred: bool = False):
    """A decode loop that catches an error and skips the step, with new queries each step: at step
    ``failing`` the last rank's partial raises (as an out-of-memory would), before its all-gather.
    Every rank raises in that step (the last its own error, the others a ``RingSeqError`` naming it)
    and every other step is exact: no rank's partial of one step merges with another step's.
    ``agreed``: as a patched model's decode step calls it, without an agreement of its own;
    ``deferred``: its flags read as on a GPU, at the end of the step (``lockstep.finish_step``, which
    the patched model's cached forward calls), the failing rank making its all-gather all the same."""
    if deferred:
        lockstep.DEFERRED.add("cpu")
        try:
            return decode_loop_skips_a_failed_step(steps, failing, agreed)
        finally:
            lockstep.DEFERRED.discard("cpu")
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    bad = sp.rank == world - 1
    B, H, K, n, m, D = 2, 4, 2, 1, 40, 16
    g = torch.Generator().manual_seed(5)
    k64, v64 = (torch.randn(B, K, m, D, generator=g, dtype=torch.float64) for _ in range(2))
    k_pos, valid, mine = torch.arange(m), torch.ones(B, m, dtype=torch.bool), torch.arange(sp.rank, m, world)
    original, raised = decode.partial, []
    for step in range(steps):
        q64 = torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(100 + step), dtype=torch.float64)
        q, k, v = (t.float() for t in (q64, k64, v64))
        if bad and step == failing:
            def failing_partial(*args, **kwargs):
                raise RuntimeError("injected: out of memory in the decode partial")
            decode.partial = failing_partial
        try:
            if agreed:  # the patched model's decode step agrees once on its new tokens, then every layer calls
                lockstep.agree(sp, "decode", {"step": step})
            got = decode.decode_attention(q, k[:, :, mine], v[:, :, mine], sp=sp, q_pos=torch.tensor([m - 1]),
                                          k_pos=k_pos[mine], k_valid=valid[:, mine], agreed=agreed)
            if agreed:
                lockstep.finish_step(sp)  # the end of the decode step (patches.generation.cached_forward)
        except Exception as exc:  # noqa: BLE001 - every rank must raise at the failing step, and only there
            raised.append((step, f"{type(exc).__name__}: {exc}"))
            continue
        finally:
            decode.partial = original
        args = (torch.tensor([m - 1]), k_pos, valid, D ** -0.5, None, None, None)
        assert_close(got, _dense(q, k, v, *args), _dense(q64, k64, v64, *args), f"decode step {step} rank {sp.rank}")
    assert [s for s, _ in raised] == [failing], (sp.rank, raised)
    text = raised[0][1]
    if bad:
        assert text.startswith("RuntimeError: injected"), text
    else:
        assert text.startswith("RingSeqError") and f"global rank {sp.ranks[-1]} raised" in text, text
