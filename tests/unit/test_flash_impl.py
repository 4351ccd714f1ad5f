"""Which flash implementation the GPU's flash ops run (``ringseq.attention.kernels.flash_impl``): FA3
only where torch offers it, FA3 is installed and its ops pass the check on the device; torch's own
otherwise, with the reason; ``RINGSEQ_FLASH`` decides. The device parts are stood in for here (the
check itself runs on a GPU: benchmarks/gpu_check.py records the decision)."""
import pytest
import torch

import ringseq
from ringseq.attention.kernels import flash_impl


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(flash_impl, "_state", {})
    calls = []
    monkeypatch.setattr(torch.nn.attention, "activate_flash_attention_impl", lambda impl: calls.append(("on", impl)),
                        raising=False)
    monkeypatch.setattr(torch.nn.attention, "restore_flash_attention_impl", lambda **kw: calls.append(("off",)),
                        raising=False)
    return calls


def test_fa3_when_offered_installed_and_checked(fresh, monkeypatch):
    monkeypatch.setattr(flash_impl, "unavailable", lambda device: None)
    monkeypatch.setattr(flash_impl, "_checked", lambda device: None)
    assert flash_impl.ensure("cuda")["impl"] == "FA3" and fresh == [("on", "FA3")]
    assert flash_impl.describe()["impl"] == "FA3" and flash_impl.ensure("cuda")["impl"] == "FA3"  # decided once
    assert fresh == [("on", "FA3")]


def test_a_failed_check_restores_torchs_kernels(fresh, monkeypatch):
    monkeypatch.setattr(flash_impl, "unavailable", lambda device: None)
    monkeypatch.setattr(flash_impl, "_checked", lambda device: "its dq is off by 0.5")
    got = flash_impl.ensure("cuda")
    assert got["impl"] == "FA2" and "dq is off" in got["why"] and fresh == [("on", "FA3"), ("off",)]


def test_missing_fa3_keeps_torchs_kernels_or_refuses_when_asked(fresh, monkeypatch):
    monkeypatch.setattr(flash_impl, "unavailable", lambda device: "FA3's package is not installed")
    assert flash_impl.ensure("cuda") == {"impl": "FA2", "why": "FA3's package is not installed"} and not fresh
    monkeypatch.setattr(flash_impl, "_state", {})
    monkeypatch.setenv("RINGSEQ_FLASH", "fa3")
    with pytest.raises(ringseq.RingSeqError, match="RINGSEQ_FLASH=fa3 but FA3's package is not installed"):
        flash_impl.ensure("cuda")
    monkeypatch.setenv("RINGSEQ_FLASH", "fa2")
    assert flash_impl.ensure("cuda") == {"impl": "FA2", "why": "RINGSEQ_FLASH=fa2"}
    monkeypatch.setenv("RINGSEQ_FLASH", "fa4")
    with pytest.raises(ringseq.RingSeqError, match="RINGSEQ_FLASH must be one of auto, fa2, fa3"):
        flash_impl.wanted()


def test_what_stops_fa3_here_is_said():
    why = flash_impl.unavailable("cpu")
    assert why and ("Hopper" in why or "torch" in why)
    if not torch.cuda.is_available():
        assert flash_impl.describe()["impl"] == "none"
