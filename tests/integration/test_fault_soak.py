"""The fault soak (``tests/fault_soak.py``) on two hand-made trees: every fault kind's outcome is
checked as the soak checks its random cases (``python tests/fault_soak.py`` runs hundreds)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fault_soak

ROOT = Path(__file__).resolve().parents[2]


def _case(step, fault, victim, kind="raw", mask="documents", dtype="fp32", layout="zigzag"):
    return dict(step=step, fault=fault, victim=victim, kind=kind, layout=layout, mask=mask, dtype=dtype,
                seed=100 + step, s=8)


TREES = [
    # world 2: exact, a kernel that raises in the backward, another window, then rank 1 SIGKILLed in the ring
    dict(index=0, world=2, cases=[_case(0, "none", 0, mask="window"), _case(1, "raise backward", 1, dtype="bf16"),
                                  _case(2, "other inputs", 0, mask="window", layout="contiguous"),
                                  _case(3, "kill", 1, mask="padding")]),
    # world 4: a patched model whose rank 2 raises in the forward, a short sleep, then rank 0 (it serves the
    # rendezvous store) SIGSTOPped inside the ring
    dict(index=1, world=4, cases=[_case(0, "raise forward", 2, kind="model", mask="none"),
                                  _case(1, "sleep under", 3, layout="striped"), _case(2, "stop", 0)]),
    # world 4: rank 2 exits inside the ring; every survivor names it, none a neighbour that gave up after it
    dict(index=2, world=4, cases=[_case(0, "exit", 2, mask="none", dtype="bf16")]),
    # FSDP2 over two sequence groups of 2 (replicas): one wrapped model for the tree; a kernel that raises in rank 1's
    # backward fails both groups' step, the next steps are exact, then rank 3 refuses its own call
    dict(index=3, world=4, sp=2, engine="fsdp2", cases=[_case(0, "raise backward", 1, kind="model", mask="none"),
                                                         _case(1, "none", 0, kind="model", mask="documents"),
                                                         _case(2, "refuse", 3, kind="model", mask="none")]),
    # DDP with its defaults over one group of 2: a kernel that raises in rank 0's forward, then rank 1 SIGKILLed
    dict(index=4, world=2, engine="ddp", cases=[_case(0, "raise forward", 0, kind="model", mask="padding"),
                                                _case(1, "kill", 1, kind="model", mask="none")]),
]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"world{t['world']}-{t.get('engine', 'none')}")
def test_every_fault_ends_as_the_soak_requires(tree):
    verdicts = fault_soak.judge(tree, fault_soak.run_tree(tree))
    assert [v["fault"] for v in verdicts] == [c["fault"] for c in tree["cases"]]
    failed = [(v["fault"], v["problems"]) for v in verdicts if not v["ok"]]
    assert not failed, failed


@pytest.mark.slow  # a dozen random cases through the script itself
def test_the_soak_script_reports_its_counts():
    run = subprocess.run([sys.executable, "tests/fault_soak.py", "--cases", "12", "--seed", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["cases"] >= 12 and report["failures"] == 0 and sum(r["cases"] for r in report["by_fault"].values()) \
        == report["cases"]
