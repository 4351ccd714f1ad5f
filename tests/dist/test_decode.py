"""Generation's decode attention: partials over each rank's keys merged by log-sum-exp."""
from . import cases_decode as cases


def test_decode_attention_matches_dense(pool):
    pool.run(cases.decode_matches_dense)
