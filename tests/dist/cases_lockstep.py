"""Ranks out of step: asymmetric calls, failures inside the ring, stopped and dead peers, the
straggler report and misuse (``ringseq.lockstep``, ``ringseq.stats``)."""
import os
import re
import signal
import subprocess
import time

import torch
import torch.distributed as dist

import ringseq
from ringseq import lockstep
from ringseq.attention import ring
from ringseq.reference import attention
from ringseq.testing import assert_shards_close, shared_init

from .cases import make_qkv

B, H, K, D = 2, 4, 2, 16


def _inputs(sp, s=16, dtype=torch.float32, seed=0):
    q, k, v, dout = make_qkv(B, H, K, s * sp.size, D, seed)
    local = [ringseq.shard(t.to(dtype), 2, sp=sp).requires_grad_(True) for t in (q, k, v)]
    return local, ringseq.shard(dout.to(dtype), 2, sp=sp)


def _raises(fn, *needles, error=ringseq.RingSeqError) -> str:
    try:
        fn()
    except error as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        assert not missing, (missing, text)
        return text
    raise AssertionError(f"no {error.__name__} (expected one saying {needles})")


def _call(sp, odd: bool, case: str):
    """One ringseq call that differs on the odd rank as ``case`` says."""
    s = 8 if case == "local length" and odd else 16
    dtype = torch.bfloat16 if case == "dtype" and odd else torch.float32
    (q, k, v), _ = _inputs(sp, s=s, dtype=dtype)
    kw = {}
    if odd:
        kw = {"causal": {"causal": False}, "scale": {"scale": 0.3}, "window": {"window": 8},
              "softcap": {"softcap": 30.0}, "kernel": {"kernel": "torch"}}.get(case, {})
        if case == "position_ids":
            kw["position_ids"] = ringseq.shard(torch.arange(16 * sp.size)[None], 1, sp=sp)
        if case == "attention_mask":
            kw["attention_mask"] = torch.ones(B, s, dtype=torch.long)
    return ringseq.ring_attention(q, k, v, sp=sp, **kw)


ASYMMETRIC = {"causal": "causal: rank 0 1, rank {r} 0", "scale": "scale: rank 0 None, rank {r} 0.3",
              "window": "window: rank 0 None, rank {r} 8.0", "softcap": "softcap: rank 0 None, rank {r} 30.0",
              "kernel": "kernel: rank 0 auto, rank {r} torch",
              "position_ids": "position_ids dtype: rank 0 None, rank {r} int64",
              "attention_mask": "attention_mask dtype: rank 0 None",
              "local length": "q.shape[2]: rank 0 16, rank {r} 8",
              "dtype": "q dtype: rank 0 float32, rank {r} bfloat16"}


def asymmetric_calls_are_refused():
    """Every argument that differs on one rank of the group is an error on every rank, naming
    the field and both values; the group is still usable afterwards."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    odd = sp.rank == world - 1
    for case, needle in ASYMMETRIC.items():
        _raises(lambda: _call(sp, odd, case), "out of step", needle.format(r=world - 1))
    (q, k, v), dout = _inputs(sp)
    ringseq.ring_attention(q, k, v, sp=sp).backward(dout)  # all agreed again: the group works


def refusals_in_a_row_quote_where_they_began():
    """Each refusal after the first names where the failures began, from the notes: the rank that
    began them is quoted as having raised, even once its later refusals blame the group's first
    failure, which is its own (a note blaming itself read as a chain without a root); quoted once,
    however many follow."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    odd = sp.rank == world - 1
    _raises(lambda: _call(sp, odd, "causal"), "out of step")
    for case in ("scale", "window", "softcap", "scale", "window"):
        text = _raises(lambda: _call(sp, odd, case), "out of step after a failure that began here: global rank",
                       ASYMMETRIC[case].format(r=world - 1))
        # one root, quoted once: a rank whose own note began it keeps that note (it used to overwrite it
        # with each new error, which quoted the last, so the messages nested and grew with every call)
        assert text.count("after a failure that began here") == 1 and len(text) < 2000, text
    (q, k, v), dout = _inputs(sp)
    ringseq.ring_attention(q, k, v, sp=sp).backward(dout)  # all agreed again: the group works


def _skip_backward(sp, odd: bool, q, k, v, dout):
    """A step in which the ``odd`` rank skips its backward (as if its loss raised and was swallowed)
    and goes on to its next forward, while the others run theirs."""
    out = ringseq.ring_attention(q, k, v, sp=sp)
    if not odd:
        out.backward(dout)
    else:
        ringseq.ring_attention(q, k, v, sp=sp)


def the_odd_rank_out_is_named():
    """At world 4 the last rank skips a backward (as if its loss raised and was swallowed) and goes on
    to its next forward, twice: every rank raises both times, and the second error names only the
    rank out of step with the other three as where the failures began (every rank used to name
    every rank, itself included)."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    odd = sp.rank == world - 1
    (q, k, v), dout = _inputs(sp)
    ringseq.resync(sp, 0)
    texts = [_raises(lambda: _skip_backward(sp, odd, q, k, v, dout), "out of step") for _ in range(2)]
    began = texts[1].split("after a failure that began here: ")[1]
    named = set(re.findall(r"global rank (\d+) raised", began.split(": group rank")[0]))
    assert named == {str(sp.ranks[-1])}, texts[1]
    ringseq.resync(sp, 1)
    ringseq.ring_attention(q, k, v, sp=sp).backward(dout)


def skipped_layer_and_backward_are_refused():
    """A rank that skips a layer (its exception was outside ringseq) or a backward is caught at
    its next ringseq call, on every rank; so are labels on one rank only."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    odd = sp.rank == world - 1
    (q, k, v), dout = _inputs(sp)

    def layers():
        for index in (0, 1):
            if odd and index == 0:
                continue  # as if this rank's layer 0 raised and was swallowed
            with lockstep.layer(index):
                ringseq.ring_attention(q, k, v, sp=sp)

    _raises(layers, "out of step", "layer: rank 0 0, rank", "ring_attention forward")
    # the ranks failed at different points (layer 0 and layer 1): every call refuses until a resync point
    _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp), "out of step", "ringseq.resync(sp, step)")
    ringseq.resync(sp, 1)
    ringseq.ring_attention(q, k, v, sp=sp)  # in step again

    _raises(lambda: _skip_backward(sp, odd, q, k, v, dout), "out of step", "ring_attention backward", "ring_attention forward")
    ringseq.resync(sp, 2)
    ids = torch.arange(4 * world)[None]
    batch = {"input_ids": ids, **({"labels": ids} if odd else {})}
    _raises(lambda: ringseq.shard_batch(batch, sp=sp), "labels dtype: rank 0 None, rank", "same full batch")


def _fail_at(invocation: int):
    """Make this rank's block compute raise at its ``invocation``-th ring step (0-based,
    forward steps first, then backward steps), as an out-of-memory error would."""
    original, count = ring._Schedule.compute, [0]

    def failing(*args):
        raise RuntimeError("injected: CPU out of memory in the block kernel")

    def compute(self, t, work):
        count[0] += 1
        return original(self, t, failing if count[0] - 1 == invocation else work)

    ring._Schedule.compute = compute
    return lambda: setattr(ring._Schedule, "compute", original)


def failure_fails_the_group(where: str, deferred: bool = False):
    """An exception inside one rank's ring call makes every rank raise: in that call when a
    later transfer can carry the news (with head groups the next group's ring too: it still makes
    its transfers), else at the next ringseq collective (where the ranks meet out of step). No rank
    gets a result until all are in step again; then it is exact. ``deferred``: the failure flags are
    read as on a GPU, after the call (at the next agreement or the end of the backward pass)."""
    if deferred:
        lockstep.DEFERRED.add("cpu")
        try:
            return failure_fails_the_group(where)
        finally:
            lockstep.DEFERRED.discard("cpu")
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    bad = sp.rank == world - 1
    (q, k, v), dout = _inputs(sp)
    ref = ringseq.ring_attention(q, k, v, sp=sp).detach()
    # one ring for all heads, or one per kv head (head_groups="kv": the first ring's failure is carried
    # by the later rings' transfers); dense causal: P ring steps each way, per ring
    head_groups = "kv" if "ring's" in where else None
    steps = world * (K if head_groups else 1)
    invocation = {"forward first step": 0, "forward first ring's last step": world - 1, "forward last step": steps - 1,
                  "backward first step": steps, "backward first ring's last step": steps + world - 1}[where]
    restore = _fail_at(invocation) if bad else (lambda: None)
    try:
        ringseq.ring_attention(q, k, v, sp=sp, head_groups=head_groups).backward(dout)
    except (RuntimeError, ringseq.RingSeqError) as exc:
        first = exc
    else:
        raise AssertionError("a rank finished the step although one rank's ring call failed")
    finally:
        restore()
    if bad:
        assert "injected" in str(first), first
    else:
        assert isinstance(first, ringseq.RingSeqError), first
        assert "failed on another rank" in str(first) or "had a ringseq call fail" in str(first), first
        if "failed on another rank" in str(first):  # named, its error quoted from its note
            assert f"global rank {sp.ranks[world - 1]} raised" in str(first) and "injected" in str(first), first
    outcomes = []
    for _ in range(3):  # every rank swallows its error and goes on with the loop's next step
        try:
            ringseq.resync(sp, 1)  # a raw loop's resync point: the ranks meet at the same step again
            out = ringseq.ring_attention(q, k, v, sp=sp)
            break
        except ringseq.RingSeqError as exc:
            outcomes.append(str(exc))
    else:
        raise AssertionError(f"the group never got back in step: {outcomes}")
    # no rank got a result while another was out of step: all succeed at the same ringseq collective
    numbers = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(numbers, torch.tensor([lockstep.state(sp).number]))
    assert len({int(n) for n in numbers}) == 1, (numbers, outcomes)
    assert all("out of step" in text for text in outcomes), outcomes
    assert torch.equal(out, ref)


def _stop_myself_later(wake_after: float):
    """SIGSTOP this process now; a helper sends SIGCONT after ``wake_after`` seconds."""
    subprocess.Popen(["sh", "-c", f"sleep {wake_after}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def late_healthy_rank_is_waiting(stopped: int = 3, late: int = 2, delay: float = 1.0, timeout: float = 2.0):
    """A world of 4: global rank ``stopped`` stops (SIGSTOP) before a call's agreement, and healthy
    rank ``late`` enters it ``delay`` s after the others (busy elsewhere): it times out after their
    grace of reading notes has ended. Every rank that times out names ``stopped`` alone: a long wait
    says so in the store, so the late rank reads as waiting, not as one that never reached a wait."""
    import re

    sp = ringseq.init(sp_size=dist.get_world_size(), timeout=timeout)
    (q, k, v), _ = _inputs(sp)
    ringseq.ring_attention(q, k, v, sp=sp)  # warm
    if sp.rank == stopped:
        _stop_myself_later(timeout + 3)
    if sp.rank == late:
        time.sleep(delay)
    text = _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp), "never reached a ringseq wait")
    named = re.search(r"global ranks? ([\d, ]+) never reached a ringseq wait", text)
    assert named and {int(x) for x in re.findall(r"\d+", named.group(1))} == {stopped}, text
    return text


def stopped_peer(sp_size: int, phases: list, timeout: float, victim: int = 1):
    """Group rank ``victim`` stops (SIGSTOP) at the start of its ring forward or backward
    (``phases[d]`` for the sequence group of data index d); every other rank must raise within
    the timeout, naming the ring step and the peer it waited for. Returns (group rank, seconds
    from the call to the error, message, whether the forward finished) per rank."""
    sp = ringseq.init(sp_size=sp_size, timeout=timeout)
    phase = phases[sp.dp_rank]
    (q, k, v), dout = _inputs(sp)
    ringseq.ring_attention(q, k, v, sp=sp).backward(dout)  # warm: the first backward loads its kernels
    if sp.rank == victim:
        target = "ring_forward" if phase == "forward" else "ring_backward"
        original = getattr(ring, target)

        def stopping(*args, **kwargs):
            setattr(ring, target, original)
            _stop_myself_later(timeout + 3)
            return original(*args, **kwargs)

        setattr(ring, target, stopping)
    out, start = None, time.perf_counter()
    try:
        out = ringseq.ring_attention(q, k, v, sp=sp)
        start = time.perf_counter()
        out.backward(dout)
    except ringseq.RingSeqError as exc:
        return sp.rank, time.perf_counter() - start, str(exc), out is not None
    except RuntimeError as exc:  # the woken victim finds its peers gone: any transport error will do
        assert sp.rank == victim, exc
        return sp.rank, time.perf_counter() - start, str(exc), out is not None
    return sp.rank, time.perf_counter() - start, "", out is not None


def refused_then_gone():
    """A rank refused a batch its peer does not hold and exits; the peer, whose next call finds it
    gone, quotes that refusal (the note the rank left), not just "failed or exited"."""
    sp = ringseq.init(sp_size=dist.get_world_size(), timeout=30)
    ids = torch.arange(8)[None] + (sp.rank == 1)
    _raises(lambda: ringseq.shard_batch({"input_ids": ids}, sp=sp), "same full batch")
    if sp.rank == 1:
        os._exit(0)
    (q, k, v), _ = _inputs(sp)
    return _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp), "global rank 1 raised", "out of step")


def dead_peer(victim: int = 1):
    """A peer process that dies inside the ring: the others raise a RingSeqError at once."""
    sp = shared_init(sp_size=dist.get_world_size(), timeout=60)
    (q, k, v), _ = _inputs(sp)
    if sp.rank == victim:
        def dying(self, *args, **kwargs):
            os._exit(3)

        ring.RingComm.post = dying
    start = time.perf_counter()
    text = _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp), "ring step 1 of ring_attention",
                   "failed or exited")
    return time.perf_counter() - start, text


def store_host_exits_after_a_peer_failed(victim: int = 2):
    """Global rank ``victim``'s block kernel raises after its last transfer of a raw call; global
    rank 0, which serves the rendezvous store, exits hard on its own error at once (``os._exit``:
    no lingering), as a user's loop that ends the job may. The survivors name ``victim`` in that
    call (from its note, or from the call's shared outcome if the store is gone already) and again
    in their next call, which finds rank 0 gone: rank 0 is told of, never blamed."""
    import re

    sp = ringseq.init(sp_size=dist.get_world_size(), timeout=10)
    (q, k, v), _ = _inputs(sp)
    restore = _fail_at(sp.ring_size - 1) if sp.rank == victim else (lambda: None)
    try:
        ringseq.ring_attention(q, k, v, sp=sp)
    except (RuntimeError, ringseq.RingSeqError) as exc:
        first = str(exc)
    else:
        raise AssertionError("a rank finished a call that failed on another")
    finally:
        restore()
    if sp.rank == 0:
        os._exit(0)
    if sp.rank == victim:
        return first
    assert f"global rank {victim} raised" in first, first
    start = time.perf_counter()
    second = _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp), f"global rank {victim} raised",
                     "global rank 0) has exited")
    assert not re.search(r"global ranks? 0 (failed|raised|never)", second), second
    return first, second, time.perf_counter() - start


def dead_predecessor_is_named(victim: int = 2, slow: int = 0, delay: float = 2.0):
    """A ring of 4 whose ``victim`` is dead before its successor posts its first hop, while the
    rank that successor sends to (``slow``) is healthy but still busy (no note of its own yet): the
    successor's receive fails to post, and its error names the dead predecessor, not the slow rank."""
    sp = shared_init(sp_size=dist.get_world_size(), timeout=60)
    (q, k, v), _ = _inputs(sp)
    post = ring.RingComm.post

    def late(self, *args, **kwargs):  # inside the call, after its agreement: the victim dies at its first hop
        if sp.rank == victim:
            os._exit(3)
        time.sleep(delay if sp.rank == slow else 0.5)  # the victim is gone before the others post
        return post(self, *args, **kwargs)

    ring.RingComm.post = late
    text = _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp), "ring step 1 of ring_attention",
                   f"global rank {victim} failed or exited")
    assert f"global rank {slow} failed" not in text, text
    return text


def straggler_is_named(delay: float = 0.25, calls: int = 4):
    """One rank made slow by a sleep before each call is the slowest rank, and the others'
    wait for it is the injected delay within 20%, every call's (the last one's too, with no
    collective after it: each agreement tells every rank what it made each rank wait)."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    (q, k, v), _ = _inputs(sp)
    ringseq.stats(sp=sp, reset=True)
    with torch.no_grad():
        for _ in range(calls):
            if sp.rank == world - 1:
                time.sleep(delay)
            ringseq.ring_attention(q, k, v, sp=sp)
    report = ringseq.stats(sp=sp, reset=True)  # no collective since the last call: its wait is counted too
    assert [r["calls"] for r in report["ranks"]] == [calls] * world, report
    if world > 1:
        assert report["slowest_rank"] == world - 1, report
        assert abs(report["wait_for_slowest_s"] - delay * calls) <= 0.2 * delay * calls, report
    assert ringseq.stats(sp=sp)["ranks"][sp.rank]["calls"] == 0  # reset


def raw_loop_out_of_step(steps: int = 6):
    """A raw loop that swallows errors. At step 1 the last rank raises outside ringseq between its
    forward and backward and goes on to step 2, while the others meet its step-2 forward with
    their step-1 backward: every rank raises, and the ranks are now a step apart. Without a
    resync point every later call raises on every rank (none gives a result); with
    ``ringseq.resync(sp, step)`` at the top of each step the rank behind skips a step and the
    group is exact from the step they meet at."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    odd = sp.rank == world - 1

    def inputs(step):
        (q, k, v), dout = _inputs(sp, seed=step)
        return q, k, v, dout

    def run(step, resync):
        if resync:
            ringseq.resync(sp, step)
        q, k, v, dout = inputs(step)
        out = ringseq.ring_attention(q, k, v, sp=sp)
        if odd and step == 1 and not resync:
            raise ValueError("a user error between the forward and the backward")
        out.backward(dout)
        return out.detach()

    outcome = {}
    for step in range(steps):
        try:
            outcome[step] = run(step, resync=False)
        except (ringseq.RingSeqError, ValueError) as exc:
            outcome[step] = exc
    failed = [s for s, o in outcome.items() if not torch.is_tensor(o)]
    assert failed == list(range(1, steps)), (sp.rank, {s: str(o)[:120] for s, o in outcome.items()})
    # the same loop with a resync point at each step: back in step, then exact
    start, end = steps + (1 if odd else 0), steps + 4  # the last rank is a step ahead, as the failure left it
    results = {}
    for step in range(start, end):
        try:
            results[step] = run(step, resync=True)
        except ringseq.RingSeqError as exc:
            results[step] = str(exc)
    met = [s for s, o in results.items() if torch.is_tensor(o)]
    assert met == list(range(steps + 1, end)), (sp.rank, results)
    for step in met:  # against the full-sequence reference (no collective: the ranks ran different steps)
        q, k, v, _ = make_qkv(B, H, K, 16 * sp.size, D, step)
        ref = ringseq.shard(attention(q, k, v, causal=True), 2, sp=sp)
        assert (results[step].double() - ref).abs().max() < 1e-5, (sp.rank, step)


def stats_on_one_rank():
    """``ringseq.stats`` communicates nothing: a callback that logs on rank 0 alone leaves the
    group in step (its all-gather used to pair with a peer's next agreement)."""
    sp = shared_init(sp_size=dist.get_world_size())
    (q, k, v), dout = _inputs(sp)
    ringseq.ring_attention(q, k, v, sp=sp).backward(dout)
    if sp.rank == 0:
        report = ringseq.stats(sp=sp, reset=True)
        assert len(report["ranks"]) == sp.size and report["ranks"][1]["calls"] >= 1, report
        # this rank's block kernel calls by backend and the GPU's flash implementation (none here)
        assert report["kernels"]["block_calls"].get("cpu_flash", 0) >= 2 and report["kernels"]["flash"]["impl"] == \
            "none", report["kernels"]
    ringseq.ring_attention(q, k, v, sp=sp).backward(dout)  # every rank: still in step
    if sp.rank == 0:  # since the reset: this call's forward and backward rings, one call per step each
        steps = min(sp.size, 2) if sp.size > 1 else 1
        assert sum(ringseq.stats(sp=sp)["kernels"]["block_calls"].values()) >= 2 * steps, ringseq.stats(sp=sp)


class _SlowStore:
    """A store whose first write takes ``delay`` seconds (as a client connecting on a loaded machine)."""

    def __init__(self, store, delay: float):
        self.store, self.delay = store, delay

    def set(self, *args):
        time.sleep(self.delay)
        self.delay = 0.0
        return self.store.set(*args)

    def get(self, *args):
        return self.store.get(*args)

    def check(self, *args):
        return self.store.check(*args)


def raises_before_the_ring(timeout: float, slow_store: bool = False):
    """A rank whose ring call raises after the agreement but before its first transfer: its
    peer, left waiting, names it and quotes its error (from the note it left in the store).
    ``slow_store``: the raising rank first waits long in the call's agreement and its store takes
    longer than the grace to take that 'waiting' note: its clearing and the failure note that
    follow still land, in order, before the peer reads them (a loaded machine once lost the
    failure note behind the waiting one, and the peer blamed no one)."""
    from ringseq import peers

    sp = ringseq.init(sp_size=dist.get_world_size(), timeout=timeout)
    (q, k, v), _ = _inputs(sp)
    ringseq.ring_attention(q, k, v, sp=sp)
    original = ring.plan  # the batch's plan: made (or found) before the ring's first transfer
    if slow_store and sp.rank == 1:
        for bounded in peers._clients.values():
            bounded.flush(5.0)
            bounded.store = _SlowStore(bounded.store, 1.2 * peers._timeout(sp))
    elif slow_store:
        time.sleep(2 * peers.signal_after(sp))  # the peer waits in the agreement long enough to say so
    if sp.rank == 1:
        def failing(*args, **kwargs):
            raise RuntimeError("injected before the ring")

        ring.plan = failing
    try:
        ringseq.ring_attention(q, k, v, sp=sp)
    except (RuntimeError, ringseq.RingSeqError) as exc:
        return str(exc)
    finally:
        ring.plan = original
    return ""


def misuse_is_refused():
    """Each misuse a RingSeqError that names the fix."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    x = torch.randn(2, 8 * world, 3)
    for dim in (3, -4, 1.0, None):
        _raises(lambda: ringseq.shard(x, dim, sp=sp), f"dim={dim!r}", "pass an integer")
    _raises(lambda: ringseq.gather(x, 5, sp=sp), "dim=5")
    _raises(lambda: ringseq.shard([1, 2], 0, sp=sp), "torch.Tensor")
    (q, k, v), _ = _inputs(sp)
    for bad_sp in (None, "sp", 2):
        _raises(lambda: ringseq.ring_attention(q, k, v, sp=bad_sp), "SequenceParallel", "ringseq.init")
        _raises(lambda: ringseq.shard(x, 1, sp=bad_sp), "SequenceParallel")
        _raises(lambda: ringseq.gather(x, 1, sp=bad_sp), "SequenceParallel")
        _raises(lambda: ringseq.shard_batch({"input_ids": x.long()}, sp=bad_sp), "SequenceParallel")
    for wrong in (q.long(), q > 0):
        _raises(lambda: ringseq.ring_attention(wrong, k, v, sp=sp), "floating-point")
    _raises(lambda: ringseq.ring_attention(list(q), k, v, sp=sp), "torch.Tensor")
    ids = torch.arange(4 * world)[None]
    for mask, needle in ((torch.ones(1, 1, 4 * world, 4 * world), "2-D"), (torch.full((1, 4 * world), 2), "only 0")):
        _raises(lambda: ringseq.shard_batch({"input_ids": ids, "attention_mask": mask}, sp=sp), needle)
    _raises(lambda: ringseq.shard_batch({"input_ids": ids, "labels": ids[:, 1:]}, sp=sp), "labels must be")
    _raises(lambda: ringseq.shard_batch({"input_ids": ids, "position_ids": ids.float()}, sp=sp), "position_ids")
    local_mask = torch.full((B, 16), 3)
    _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp, attention_mask=local_mask), "0 (padding) and 1")
    for scale in (0.0, -0.1, float("nan"), float("inf")):  # aten's CPU flash kernel gives NaN rows for scale <= 0
        _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp, scale=scale), "scale must be a positive finite")
    _raises(lambda: ringseq.shard_batch([{"input_ids": ids}], sp=sp), "a batch is a dict", "collate")
    _raises(lambda: ringseq.shard_batch({"input_ids": ids[:0]}, sp=sp), "the batch is empty")
    _raises(lambda: ringseq.stats(sp=None), "SequenceParallel")
    _raises(lambda: lockstep.layer("a").__enter__(), "layer index")
    for timeout in (float("inf"), 1e-4, float("nan")):
        _raises(lambda: ringseq.init(sp_size=world, timeout=timeout), "finite number of seconds", "at least 0.001")
    _raises(lambda: ringseq.resync(sp, 1.5), "step number")
    for window in (True, 0, 2.5, 2**70):
        _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp, window=window), "window must be a positive integer")
    for softcap in (True, float("inf"), -1.0):
        _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp, softcap=softcap), "softcap must be a positive")
    _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp, slab_rows=0), "slab_rows must be a positive integer")
    _raises(lambda: lockstep.layer(2**70).__enter__(), "layer index")
    _raises(lambda: ringseq.ring_attention(q, k, v, sp=sp, causal="yes"), "causal must be True or False")
    ringseq.ring_attention(q, k, v, sp=sp)  # every refusal was the whole group's, in the same call: still in step


def own_misuse_leaves_the_group_usable():
    """A rank whose own arguments are wrong (k on another device, k of another dtype, a non-bool flag)
    refuses the call in its agreement: every rank raises in that same call, before any transfer (the
    misusing rank with its fix, its peers naming it and quoting it), and the next call is exact: the
    group never broke and stayed in step."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    (q, k, v), dout = _inputs(sp)
    ref = ringseq.ring_attention(q, k, v, sp=sp).detach()
    me, odd = dist.get_rank(), world - 1
    for wrong, words in ((dict(k=k.to("meta")), "must be on one device"), (dict(k=k.double()), "must share a dtype"),
                         (dict(causal="yes"), "causal must be True or False")):
        args = {"k": k, "causal": True, **(wrong if sp.rank == odd else {})}
        peer = f"global rank {sp.ranks[odd]} refused its call: "
        text = _raises(lambda: ringseq.ring_attention(q, args["k"], v, sp=sp, causal=args["causal"]),
                       *((words,) if sp.rank == odd else ("was refused by another rank", peer + "", words)))
        assert sp.rank == odd or "the group stays in step" in text, text
    out = ringseq.ring_attention(q, k, v, sp=sp)
    assert torch.equal(out, ref) and lockstep.state(sp).broken is None and lockstep.state(sp).failure is None, me


def skip_loop_after_a_refusal(call: str, steps: int = 4, refused: int = 1):
    """A loop that catches an error and skips the step, with new data each step, as users write it:
    at step ``refused`` the last rank's call is wrong (``call``: a raw ring_attention with k on another
    device, a gather along a dimension its tensor lacks, a batch that is not a dict). Every rank
    raises at that step, and every other step is exact on every rank: no call of one step ever
    pairs with another step's."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    bad = sp.rank == world - 1
    raised = []
    for step in range(steps):
        wrong = bad and step == refused
        try:
            if call == "ring_attention":
                (q, k, v), _ = _inputs(sp, seed=100 + step)
                out = ringseq.ring_attention(q, k.to("meta") if wrong else k, v, sp=sp)
                qf, kf, vf, dout = make_qkv(B, H, K, 16 * sp.size, D, 100 + step)
                want = ringseq.shard(attention(qf, kf, vf, dout, causal=True, sdpa=True)[0].float(), 2, sp=sp)
                assert (out.detach() - want).abs().max() < 1e-5, (step, (out.detach() - want).abs().max())
            elif call == "gather":
                full = torch.randn(3, 8 * world, generator=torch.Generator().manual_seed(step))
                local = ringseq.shard(full, 1, sp=sp)
                assert torch.equal(ringseq.gather(local, 5 if wrong else 1, sp=sp), full), step
            else:  # shard_batch
                ids = torch.randint(0, 64, (2, 8 * world), generator=torch.Generator().manual_seed(step))
                batch = [ids] if wrong else {"input_ids": ids, "labels": ids}
                local = ringseq.shard_batch(batch, sp=sp)
                assert torch.equal(local["input_ids"], ringseq.shard(ids, 1, sp=sp)), step
        except ringseq.RingSeqError as err:
            raised.append((step, str(err)))
    assert [s for s, _ in raised] == [refused], (dist.get_rank(), raised)
    if not bad:
        assert f"global rank {sp.ranks[-1]} refused its call" in raised[0][1], raised
    return raised


def skip_loop_after_a_failure(where: str, ulysses: int = 1, forward_only: bool = False, steps: int = 4,
                              failing: int = 1):
    """A loop of raw calls that catches an error and skips the step, with new data each step and no
    resync, as users write it: at step ``failing`` the last rank's block kernel raises as an
    out-of-memory would, ``where``: in the forward's first ring step, its last (after the rank's last
    transfer: nothing carries the news but the call's shared outcome), or the backward's last. Every
    rank raises in that step (the last rank its own error, the others a ``RingSeqError`` naming it
    and quoting it), and every other step is exact on every rank: forward and backward, or
    forward-only (``forward_only``: an evaluation loop)."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world, ulysses_size=ulysses)
    bad = sp.rank == world - 1
    T = sp.ring_size  # ring steps of one dense causal call
    invocation = {"forward first step": 0, "forward last step": T - 1, "backward last step": 2 * T - 1}[where]
    raised = []
    for step in range(steps):
        (q, k, v), dout = _inputs(sp, seed=300 + step)
        restore = _fail_at(invocation) if bad and step == failing else (lambda: None)
        try:
            if forward_only:
                with torch.no_grad():
                    out = ringseq.ring_attention(q, k, v, sp=sp)
            else:
                out = ringseq.ring_attention(q, k, v, sp=sp)
                out.backward(dout)
        except (RuntimeError, ringseq.RingSeqError) as exc:
            raised.append((step, f"{type(exc).__name__}: {exc}"))
            continue
        finally:
            restore()
        full = make_qkv(B, H, K, 16 * sp.size, D, 300 + step)
        refs = attention(*full, causal=True)[:4]
        plains = attention(*(t.float() for t in full), causal=True, sdpa=True)[:4]
        got = (out, *(() if forward_only else (t.grad for t in (q, k, v))))
        for name, mine, plain, ref in zip(("out", "dq", "dk", "dv"), got, plains, refs):
            assert_shards_close(mine, plain, ref, f"{name} at step {step} (rank {sp.rank})", sp=sp)
    assert [s for s, _ in raised] == [failing], (dist.get_rank(), raised)
    text = raised[0][1]
    if bad:
        assert "injected" in text and text.startswith("RuntimeError"), text
    else:
        assert text.startswith("RingSeqError") and f"global rank {sp.ranks[-1]} raised" in text, text
        assert "injected" in text, text  # its error quoted from its note
    return raised


def batch_beside_resync():
    """One rank at a batch agreement, the other at an explicit resync: nothing orders them, so
    both raise (neither waits for the other forever), and a resync on both puts them in step."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    ids = torch.arange(4 * world)[None]
    if sp.rank == 0:
        _raises(lambda: ringseq.resync(sp, 3), "out of step")
    else:
        _raises(lambda: ringseq.shard_batch({"input_ids": ids}, sp=sp), "out of step")
    ringseq.resync(sp, 4)
    ringseq.shard_batch({"input_ids": ids}, sp=sp)


def disagreeing_batches_raise_at_once(timeout: float = 30.0):
    """Two sequence groups, each first handed a batch of its own length; then the two ranks of each group different
    batches, group rank 0's the one it had before (issue 58: that group waited out the whole timeout, each rank
    taking the other for one catching up). Ranks that disagree raise in that call, far within the timeout, and
    the next batch on which they agree goes on."""
    sp = shared_init(sp_size=2, timeout=timeout)
    length = 4 if sp.dp_rank == 0 else 6
    first = {"input_ids": torch.arange(length)[None]}
    ringseq.shard_batch(first, sp=sp)
    other = first if sp.rank == 0 else {"input_ids": torch.arange(length)[None] + 1}
    start = time.monotonic()
    _raises(lambda: ringseq.shard_batch(other, sp=sp), "differ")
    took = time.monotonic() - start
    assert took < 5, f"rank {dist.get_rank()}: raised after {took:.1f} s (timeout {timeout:g} s)"
    ringseq.shard_batch({"input_ids": torch.arange(length)[None] + 2}, sp=sp)


def attention_work_is_reported(ulysses=1):
    """``stats`` reports each rank's visible query-key pairs of the batches sharded in the period,
    counted independently here from the dense reference mask of the same packed, padded batch."""
    from ringseq.layouts import global_positions
    from ringseq.reference import visibility

    world = dist.get_world_size()
    sp = shared_init(sp_size=world, ulysses_size=ulysses)
    S = 24 * world
    pos = torch.tensor([list(range(S // 3)) + list(range(S - S // 3)), list(range(S))])
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, :5] = 0
    ringseq.stats(sp=sp, reset=True)
    packed = {"input_ids": torch.zeros(2, S, dtype=torch.long), "position_ids": pos}
    layouts = [ringseq.shard_batch(packed, sp=sp)["ringseq"].order for _ in range(2)]  # two batches add up
    ringseq.shard_batch({"input_ids": torch.zeros(2, S, dtype=torch.long), "attention_mask": mask}, sp=sp)
    batches = [(visibility(S, causal=True, position_ids=pos).sum(-1).sum(0), layout) for layout in layouts]
    batches.append((visibility(S, causal=True, attention_mask=mask).sum(-1).sum(0), sp.layout))
    U = sp.ulysses_size  # the ranks of a Ulysses group attend all of their ring rank's queries, 1/U of the heads each
    want = [sum(float(keys[global_positions(layout, S, sp.ring_size, g // U)].sum()) for keys, layout in batches) / U
            for g in range(world)]
    report = ringseq.stats(sp=sp, reset=True)
    got = [r["attention_pairs"] for r in report["ranks"]]
    assert got == want, (got, want)
    assert report["work_max_over_mean"] == max(want) / (sum(want) / world)
    assert ringseq.stats(sp=sp)["ranks"][0]["attention_pairs"] == 0  # reset
