"""The supported releases are stated once (``ringseq.versions``): setup.cfg says the same, and
a release outside a range is refused with the fix."""
import configparser
import re
from pathlib import Path

import pytest

from ringseq import RingSeqError, versions

ROOT = Path(__file__).resolve().parents[2]


def _ranges(lines: str) -> dict:
    found = {}
    for line in lines.strip().splitlines():
        m = re.fullmatch(r"\s*([A-Za-z_.-]+)>=([\d.]+),<([\d.]+)\s*", line)
        if m:
            found[m.group(1)] = (m.group(2), m.group(3))
    return found


def test_setup_cfg_states_the_ranges_of_ringseq_versions():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    stated = _ranges(cfg["options"]["install_requires"])
    for extra, members in versions.EXTRAS.items():
        stated.update({k: v for k, v in _ranges(cfg["options.extras_require"][extra]).items() if k in members})
    assert stated == versions.RANGES


@pytest.mark.parametrize("package,version,ok", [("transformers", "5.0.0", True), ("transformers", "6.0.0", False),
                                                ("transformers", "4.57.0", False), ("deepspeed", "0.19.8", True),
                                                ("deepspeed", "0.19.7", False), ("trl", "1.15.0", False)])
def test_a_release_outside_the_range_is_named_with_the_fix(package, version, ok):
    found = versions.problem(package, version)
    assert (found is None) == ok, found
    if not ok:
        low, high = versions.RANGES[package]
        assert f"pip install '{package}>={low},<{high}'" in found


def test_require_refuses_with_the_feature_named(monkeypatch):
    monkeypatch.setitem(versions.RANGES, "accelerate", ("0.1", "0.2"))
    with pytest.raises(RingSeqError, match=r"ringseq.prepare_accelerator needs a supported accelerate: accelerate "):
        versions.require("accelerate", "ringseq.prepare_accelerator")


def test_a_feature_newer_than_the_range_start_is_refused_on_older_releases(monkeypatch):
    """generate on a patched model needs transformers >= 5.23 (layered caches); 5.0-5.22 are in the range but
    refused at the call, naming the release that works."""
    monkeypatch.setattr(versions.importlib.metadata, "version", lambda package: "5.0.0")
    with pytest.raises(RingSeqError, match=r"generate needs transformers >= 5.23 \(found 5.0.0\)"):
        versions.require_feature("generation", "generate")
    monkeypatch.setattr(versions.importlib.metadata, "version", lambda package: "5.23.0")
    versions.require_feature("generation", "generate")
