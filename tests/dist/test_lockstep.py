"""Ranks in lockstep: asymmetric calls, failures inside the ring, stopped and dead peers,
the straggler report and misuse, each an error on every rank that names the fix."""
import re

import pytest

from ringseq.testing import DistPool

from . import cases_lockstep as cases


def test_asymmetric_calls_are_an_error_on_every_rank(pool2, pool4):
    pool2.run(cases.asymmetric_calls_are_refused)
    pool4.run(cases.asymmetric_calls_are_refused)


def test_refusals_in_a_row_quote_where_they_began(pool2, pool4):
    pool2.run(cases.refusals_in_a_row_quote_where_they_began)
    pool4.run(cases.refusals_in_a_row_quote_where_they_began)


def test_skipped_layers_backwards_and_labels_are_caught(pool2, pool4):
    pool2.run(cases.skipped_layer_and_backward_are_refused)
    pool4.run(cases.skipped_layer_and_backward_are_refused)


@pytest.mark.parametrize("where", ["forward first step", "forward first ring's last step", "forward last step",
                                   "backward first step", "backward first ring's last step"])
def test_a_failure_inside_the_ring_fails_the_group(pool2, pool4, where):
    pool2.run(cases.failure_fails_the_group, where)
    pool4.run(cases.failure_fails_the_group, where)


@pytest.mark.parametrize("where", ["forward first step", "forward last step", "backward first step"])
def test_a_failure_read_after_the_call_fails_the_group(pool2, pool4, where):
    """As on a GPU, where the ring leaves its failure flags to be read after the call (no host
    synchronisation in it): the peers raise at their next agreement or at the end of the backward."""
    pool2.run(cases.failure_fails_the_group, where, deferred=True)
    pool4.run(cases.failure_fails_the_group, where, deferred=True)


TIMEOUT = 1.5


GRACE = 0.5  # ringseq.peers reads the other ranks' notes this long at a timeout of 1.5 s


def _check_stopped(results, victim, sp_size, phase, first):
    for rank, seconds, message, forward_done in results:
        if rank == victim:
            continue
        assert message, f"group rank {rank} did not raise while rank {victim} was stopped"
        assert TIMEOUT * 0.95 <= seconds <= TIMEOUT * 1.1 + GRACE + 0.3, (rank, seconds, message)
        assert "ring step" in message and "ring_attention #" in message, message
        assert forward_done == (phase == "backward"), (rank, phase, message)
        # every survivor names the stopped rank, not the healthy predecessor it was itself waiting for (a
        # rank stopped in the other ring of the world may be named beside it, when it has stopped by then)
        named = re.search(r"global ranks? ([\d, ]+) never reached a ringseq wait", message)
        silent = {int(x) for x in re.findall(r"\d+", named.group(1))} if named else set()
        healthy = {first + r for r in range(sp_size) if r != victim}
        assert first + victim in silent and not silent & healthy, message
        assert "timeout" in message, message


def _stopped_run(sp_size, phases, victim=1, wake=False):
    """A world of 4 in rings of ``sp_size``; group rank ``victim`` of each ring stops in its phase.
    A stopped peer breaks its group's connections: every run gets a pool of its own. ``wake``:
    wait for the stopped ranks too (woken after the timeout and 3 s)."""
    pool = DistPool(4)
    try:  # wait for every rank but the stopped ones
        return pool.run_expecting([r for r in range(4) if wake or r % sp_size != victim], cases.stopped_peer,
                                  sp_size, phases, TIMEOUT, victim)
    finally:
        pool.close(force=True)


def test_a_stopped_peer_ends_every_wait_within_the_timeout():
    results = _stopped_run(2, ["forward", "backward"])  # two rings of 2: one stops in forward, one in backward
    _check_stopped([r for r in results[:2] if r], 1, 2, "forward", 0)
    _check_stopped([r for r in results[2:] if r], 1, 2, "backward", 2)
    # one ring of 4, stopped in backward (after a whole forward: every wait kind of the call so far);
    # the forward stop is covered by the rings of 2 above
    results = _stopped_run(4, ["backward"], wake=True)
    _check_stopped(results, 1, 4, "backward", 0)
    # the stopped rank, woken, finds its peers gone: it says they gave up on it, naming no healthy rank
    woken = results[1][2]
    assert "the other ranks gave up on this rank (global rank 1)" in woken, woken
    assert not re.search(r"global ranks? [\d, ]+ (failed|raised|never)", woken.split(" (while waiting")[0]), woken


def test_a_healthy_rank_that_entered_the_wait_late_is_not_named():
    pool = DistPool(4)
    try:
        pool.run_expecting([0, 1, 2], cases.late_healthy_rank_is_waiting)
    finally:
        pool.close(force=True)


def test_a_stopped_rank_0_serving_the_store_is_named_within_the_timeout():
    """Global rank 0 serves the process group's store here (plain processes with MASTER_ADDR/PORT,
    as under the deepspeed launcher): stopped, it cannot answer the survivors' reads of the notes,
    which are bounded and name it; no survivor waits for the store's own 30-minute timeout."""
    _check_stopped([r for r in _stopped_run(4, ["forward"], victim=0) if r], 0, 4, "forward", 0)


def test_a_refusal_a_peer_left_is_quoted():
    pool = DistPool(2, timeout=60)
    try:
        pool.run_expecting([0], cases.refused_then_gone)
    finally:
        pool.close(force=True)


def test_a_dead_peer_is_a_ringseq_error_at_once():
    pool = DistPool(2, timeout=60)
    try:
        (seconds, message), _ = pool.run_expecting([0], cases.dead_peer)
    finally:
        pool.close(force=True)
    assert seconds < 5, (seconds, message)


def test_a_store_host_that_exits_after_a_peers_failure_is_not_blamed():
    pool = DistPool(4, timeout=60)
    try:
        results = pool.run_expecting([1, 3], cases.store_host_exits_after_a_peer_failed)
    finally:
        pool.close(force=True)
    assert all(r[2] < 5 for r in (results[1], results[3])), results


def test_a_dead_predecessor_is_named_not_the_busy_successor():
    """Rank 3 receives from the dead rank 2 and sends to rank 0, which is still busy: the hop's
    receive is the post that fails, so rank 3 names rank 2 (a post of the send and the receive
    together would name the rank it sends to)."""
    pool = DistPool(4, timeout=60)
    try:
        results = pool.run_expecting([1, 3], cases.dead_predecessor_is_named)
    finally:
        pool.close(force=True)
    assert "posting ring step 1" in results[3], results


def test_the_straggler_is_named(pool):
    pool.run(cases.straggler_is_named)


def test_ranks_out_of_step_give_no_result_until_they_resync(pool2, pool4):
    """The probes' raw loop that swallows errors: a rank that raised outside ringseq between its
    forward and backward leaves the ranks a step apart; no later call gives a result on any rank
    until ``ringseq.resync(sp, step)`` brings them to the same step, after which they are exact."""
    pool2.run(cases.raw_loop_out_of_step)
    pool4.run(cases.raw_loop_out_of_step)


def test_stats_report_each_ranks_attention_work(pool, pool4):
    pool.run(cases.attention_work_is_reported)
    pool4.run(cases.attention_work_is_reported, 2)  # Ulysses 2 x ring 2: a ring rank's pairs split in two


def test_stats_on_one_rank_only_leaves_the_group_in_step(pool2):
    pool2.run(cases.stats_on_one_rank)


@pytest.mark.parametrize("slow_store", [False, True])
def test_a_rank_that_raises_before_the_ring_is_named_by_its_peers(slow_store):
    pool = DistPool(2, timeout=60)
    try:
        results = pool.run(cases.raises_before_the_ring, TIMEOUT, slow_store)
    finally:
        pool.close(force=True)
    assert "injected before the ring" in results[1], results
    assert "global rank 1 raised (ring_attention #" in results[0] and "injected before the ring" in results[0], results


def test_own_misuse_leaves_the_group_usable(pool2, pool4):
    pool2.run(cases.own_misuse_leaves_the_group_usable)
    pool4.run(cases.own_misuse_leaves_the_group_usable)


@pytest.mark.parametrize("call", ["ring_attention", "gather", "shard_batch"])
def test_a_loop_that_skips_a_refused_step_goes_on_exact(pool2, pool4, call):
    pool2.run(cases.skip_loop_after_a_refusal, call)
    pool4.run(cases.skip_loop_after_a_refusal, call)


@pytest.mark.parametrize("where,ulysses,forward_only", [
    ("forward last step", 1, False), ("forward last step", 1, True), ("backward last step", 1, False),
    ("forward first step", 2, False), ("backward last step", 2, False)])
def test_a_loop_that_skips_a_failed_step_goes_on_exact(pool2, pool4, where, ulysses, forward_only):
    pool2.run(cases.skip_loop_after_a_failure, where, ulysses, forward_only)
    pool4.run(cases.skip_loop_after_a_failure, where, ulysses, forward_only)


def test_the_rank_out_of_step_with_the_others_is_named(pool4):
    pool4.run(cases.the_odd_rank_out_is_named)


def test_misuse_is_refused_with_the_fix(pool):
    pool.run(cases.misuse_is_refused)


def test_soak_cases_run_and_report_their_worst_error(pool2):
    import random

    from tests import soak

    rng = random.Random(1)
    cases = [soak.draw(rng, 2) for _ in range(6)]
    per_rank = pool2.run(soak.run_cases, cases)
    assert [len(r) for r in per_rank] == [6, 6]
    assert all(c["failed"] is None and 0 < c["worst_share"] <= 1 for r in per_rank for c in r), per_rank


def test_a_batch_beside_a_resync_raises_on_both_and_never_waits(pool2):
    pool2.run(cases.batch_beside_resync)


def test_ranks_that_disagree_on_a_batch_raise_at_once_whatever_their_history(pool4):
    pool4.run(cases.disagreeing_batches_raise_at_once)
