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


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e-4, 0, -1, True])
def test_timeouts_gloo_cannot_bound_are_refused(timeout):
    with pytest.raises(RingSeqError, match="finite number of seconds, at least 0.001"):
        RingSeqConfig(timeout=timeout)


def test_the_stats_switch_is_read_with_the_other_settings():
    assert from_env({"RINGSEQ_STATS": "0"}).resolved_stats() is False
    assert from_env({"RINGSEQ_STATS": "1"}).resolved_stats() is True
    with pytest.raises(RingSeqError, match="RINGSEQ_STATS='off' must be 0"):
        from_env({"RINGSEQ_STATS": "off"})


def test_the_config_is_a_leaf():
    """ringseq.config imports no other ringseq module but its errors and layout names (init
    consumes a config; the config builds nothing)."""
    import ast

    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[2] / "ringseq" / "config.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
    assert imported <= {"errors", "lengths"}, imported
