"""Generation's decode attention: partials over each rank's keys merged by log-sum-exp."""
from . import cases_decode as cases


def test_decode_attention_matches_dense(pool):
    pool.run(cases.decode_matches_dense)


def test_a_decode_loop_that_skips_a_failed_step_goes_on_exact(pool2, pool4):
    for agreed, deferred in ((False, False), (True, False), (True, True)):
        pool2.run(cases.decode_loop_skips_a_failed_step, agreed=agreed, deferred=deferred)
        pool4.run(cases.decode_loop_skips_a_failed_step, agreed=agreed, deferred=deferred)
