"""``patch(fit=True)`` at world sizes 1, 2 and 4 (``cases_fit``)."""
from . import cases_fit


def test_fit_chooses_per_length_and_stays_exact(pool):
    pool.run(cases_fit.fit_per_length)


def test_fit_refuses_a_length_no_set_fits(pool2, pool4):
    pool2.run(cases_fit.fit_refuses_what_it_cannot_fit)
    pool4.run(cases_fit.fit_refuses_what_it_cannot_fit)


def test_fit_costs_fsdp2_as_zero_3_over_its_shards(pool2, pool4):
    pool2.run(cases_fit.fit_under_fsdp2)
    pool4.run(cases_fit.fit_under_fsdp2)
