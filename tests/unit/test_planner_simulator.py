"""The ring simulator: closed form = step-by-step recurrence, analytic cases, 100k ranks fast."""
import time

import numpy as np
import pytest

from ringseq import RingSeqError
from ringseq.planner.simulate import Costs, _ring, ring_closed_form, simulate, slowdowns


def test_closed_form_equals_the_step_by_step_recurrence_on_random_rings():
    rng = np.random.default_rng(0)
    for _ in range(300):
        P = int(rng.integers(1, 48))
        steps = int(rng.integers(1, P + 1))
        work, link = rng.uniform(0.2, 2, P), rng.uniform(0.05, 3, P)  # both compute- and link-bound
        if rng.random() < 0.3:
            work[:] = work[0]  # ties
        step_by_step = _ring(np.zeros((1, P)), work[None], link[None], steps, 1)[0]
        np.testing.assert_allclose(ring_closed_form(work, link, steps), step_by_step, rtol=1e-12)


def test_homogeneous_ring_takes_ring_steps_times_the_slower_of_compute_and_transfer():
    for compute, inter in ((1.0, 0.5), (1.0, 3.0)):
        r = simulate("ring", 4, 8, Costs(compute=compute, intra=0.1, inter=inter))
        # a link carries one block at a time: the slowest link paces every step but the last
        assert r.makespan == pytest.approx(31 * max(compute, inter) + compute if inter > compute else 32 * compute)


def test_one_slow_rank_holds_up_a_1d_ring_every_step_and_a_2d_ring_fewer():
    rows, cols, delta = 64, 8, 0.5
    costs = Costs(compute=1.0, intra=0.1, inter=0.5, all_to_all=0.2)
    factor, extra = slowdowns(rows, cols, slow_rank=3, slow_extra_s=delta)
    cost = {a: simulate(a, rows, cols, costs, factor=factor, extra=extra).makespan
            - simulate(a, rows, cols, costs).makespan for a in ("ring", "ulysses")}
    assert cost["ring"] == pytest.approx(rows * cols * delta)  # the cascade: every one of P steps waits for it
    assert cost["ulysses"] == pytest.approx(rows * delta)  # only its ring of `rows` steps, then the all-to-all


def test_ring2d_hides_the_inter_node_link_behind_the_inner_ring():
    costs = Costs(compute=1.0, intra=0.1, inter=4.0)  # a block across nodes takes 4 steps of compute
    one_d = simulate("ring", 16, 8, costs).makespan
    two_d = simulate("ring2d", 16, 8, costs).makespan
    assert one_d == pytest.approx(127 * 4.0 + 1.0)
    assert two_d == pytest.approx(16 * 8 * 1.0)  # the outer hop overlaps the 8 inner steps


def test_jitter_spreads_the_finish_times():
    r = simulate("ring", 16, 8, Costs(compute=1.0, intra=0.1, inter=0.2), jitter_sigma=0.1)
    q = r.percentiles()
    assert q["p50"] <= q["p90"] <= q["p99"] <= q["max"] and q["max"] > 128 * 1.0


def test_a_100000_rank_ring_simulates_in_seconds():
    start = time.perf_counter()
    factor, extra = slowdowns(12500, 8, slow_rank=777, slow_factor=1.1, sigma=0.01)
    for arrangement in ("ring", "ulysses", "ring2d"):
        r = simulate(arrangement, 12500, 8, Costs(compute=1e-3, intra=2e-4, inter=8e-4, all_to_all=1e-3),
                     factor=factor, extra=extra)
        assert r.finish.shape == (12500, 8) and np.isfinite(r.makespan)
    assert time.perf_counter() - start < 10


def test_bad_arrangements_are_refused():
    with pytest.raises(RingSeqError, match="unknown arrangement"):
        simulate("torus3d", 2, 2, Costs(compute=1, intra=1, inter=1))
