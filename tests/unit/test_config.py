"""Settings from code, the environment and a ds_config section (no process group)."""
import pytest

from ringseq import RingSeqError
from ringseq.config import RingSeqConfig, from_ds_config, from_env


def test_from_env_reads_the_ringseq_variables():
    config = from_env({"RINGSEQ_SP_SIZE": "4", "RINGSEQ_ULYSSES_SIZE": "2", "RINGSEQ_LAYOUT": "striped"})
    assert config == RingSeqConfig(sp_size=4, ulysses_size=2, layout="striped")
    assert from_env({}) == RingSeqConfig()


@pytest.mark.parametrize("env,match", [({"RINGSEQ_SP_SIZE": "two"}, "not an integer"),
                                       ({"RINGSEQ_SP_SIZE": "0"}, "positive integer"),
                                       ({"RINGSEQ_SP_SIZE": "4", "RINGSEQ_ULYSSES_SIZE": "3"}, "must divide"),
                                       ({"RINGSEQ_LAYOUT": "spiral"}, "unknown")])
def test_bad_environment_is_refused(env, match):
    with pytest.raises(RingSeqError, match=match):
        from_env(env)


def test_ds_config_section_is_split_off():
    section, rest = from_ds_config({"train_micro_batch_size_per_gpu": 1, "ringseq": {"sp_size": 2}})
    assert section == RingSeqConfig(sp_size=2) and rest == {"train_micro_batch_size_per_gpu": 1}
    assert from_ds_config({"zero_optimization": {}}) == (None, {"zero_optimization": {}})


def test_unknown_keys_in_the_section_are_refused():
    with pytest.raises(RingSeqError, match=r"unknown keys \['sp'\]"):
        from_ds_config({"ringseq": {"sp": 2}})
