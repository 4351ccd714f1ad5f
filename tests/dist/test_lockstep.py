"""Ranks in lockstep: asymmetric calls, failures inside the ring, stopped and dead peers,
the straggler report and misuse, each an error on every rank that names the fix."""
import pytest

from ringseq.testing import DistPool

from . import cases_lockstep as cases


def test_asymmetric_calls_are_an_error_on_every_rank(pool2, pool4):
    pool2.run(cases.asymmetric_calls_are_refused)
    pool4.run(cases.asymmetric_calls_are_refused)


def test_skipped_layers_backwards_and_labels_are_caught(pool2, pool4):
    pool2.run(cases.skipped_layer_and_backward_are_refused)
    pool4.run(cases.skipped_layer_and_backward_are_refused)


@pytest.mark.parametrize("where", ["forward first step", "forward last step", "backward first step"])
def test_a_failure_inside_the_ring_fails_the_group(pool2, pool4, where):
    pool2.run(cases.failure_fails_the_group, where)
    pool4.run(cases.failure_fails_the_group, where)


TIMEOUT = 1.5


def _check_stopped(results, victim, sp_size, phase):
    for rank, seconds, message, forward_done in results:
        if rank == victim:
            continue
        assert message, f"group rank {rank} did not raise while rank {victim} was stopped"
        assert TIMEOUT * 0.95 <= seconds <= TIMEOUT * 1.1, (rank, seconds, message)
        assert "ring step" in message and "ring_attention #" in message, message
        assert forward_done == (phase == "backward"), (rank, phase, message)
        if rank == (victim + 1) % sp_size:  # the rank that waits on the stopped one directly names it
            assert "no answer from global rank" in message and "timeout" in message, message


def _stopped_run(sp_size, phases):
    """A world of 4 in rings of ``sp_size``; group rank 1 of each ring stops in its phase. A
    stopped peer breaks its group's connections: every run gets a pool of its own."""
    pool = DistPool(4)
    try:  # wait for every rank but the stopped ones
        return pool.run_expecting([r for r in range(4) if r % sp_size != 1], cases.stopped_peer, sp_size, phases,
                                  TIMEOUT)
    finally:
        pool.close(force=True)


def test_a_stopped_peer_ends_every_wait_within_the_timeout():
    results = _stopped_run(2, ["forward", "backward"])  # two rings of 2: one stops in forward, one in backward
    _check_stopped([r for r in results[:2] if r], 1, 2, "forward")
    _check_stopped([r for r in results[2:] if r], 1, 2, "backward")
    # one ring of 4, stopped in backward (after a whole forward: every wait kind of the call so far);
    # the forward stop is covered by the rings of 2 above
    _check_stopped([r for r in _stopped_run(4, ["backward"]) if r], 1, 4, "backward")


def test_a_dead_peer_is_a_ringseq_error_at_once():
    pool = DistPool(2, timeout=60)
    try:
        (seconds, message), _ = pool.run_expecting([0], cases.dead_peer)
    finally:
        pool.close(force=True)
    assert seconds < 5, (seconds, message)


def test_the_straggler_is_named(pool):
    pool.run(cases.straggler_is_named)


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
