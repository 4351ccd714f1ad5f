"""The warm pools the distributed tests run in (ringseq.testing.DistPool, tests/conftest.py): a case
starts from a clean state whatever the previous one left; a case that fails, dies or hangs is
reported with the failing rank's traceback within its bounds and its pool is rebuilt; a launched
script runs as its launcher would start it (checked against the real launchers)."""
import json
import time
from pathlib import Path

import pytest
import torch

from ringseq.testing import DistPool
from tests.launched import accelerate, deepspeed, launched

from . import cases_harness as cases
from . import harness_script

SCRIPT = Path(__file__).resolve().parent / "harness_script.py"


def test_a_case_starts_clean_whatever_the_last_one_left(pool):
    fresh = pool.run(cases.state)
    pool.run(cases.leave_state)
    after = pool.run(cases.state)
    assert after == fresh, (fresh, after)
    assert {k: fresh[0][k] for k in ("probe", "dtype", "accelerate", "zero3", "threads", "clocks")} == {
        "probe": None, "dtype": torch.float32, "accelerate": False, "zero3": False, "threads": 1,
        "clocks": (0.0, 0.0)}, fresh


@pytest.mark.parametrize("case,args,words", [(cases.fail_on, (1,), "ValueError: injected on rank 1"),
                                             (cases.die_on, (1,), "its process died (exit code 3) in die_on")])
def test_a_failing_or_dying_rank_is_reported_and_its_pool_rebuilt(case, args, words):
    pool = DistPool(2, timeout=60, grace=3)
    try:
        started = time.time()
        with pytest.raises(AssertionError) as failed:
            pool.run(case, *args)
        assert time.time() - started < 3 + 5, "not within the grace"
        assert "--- rank 1 ---" in str(failed.value) and words in str(failed.value), failed.value
        assert not pool.alive, "a pool that failed a case stays in use"
    finally:
        pool.close(force=True)


def test_a_hanging_case_ends_at_the_timeout_and_closes_its_pool():
    pool = DistPool(2, timeout=3, grace=2)
    try:
        started = time.time()
        with pytest.raises(TimeoutError, match=r"within 3s \(a hang\); ranks \[1\] never answered"):
            pool.run(cases.hang_on, 1, 60)
        assert time.time() - started < 3 + 5 and not pool.alive
    finally:
        pool.close(force=True)


def seen(folder, tag):
    """What harness_script.py's ranks saw, rank by rank."""
    return [json.loads(f.read_text()) for f in sorted(folder.glob(f"seen-{tag}-*.json"))]


def test_scripts_see_what_the_launchers_give_them(pool2, plain, tmp_path):
    """The same script under the real deepspeed and ``accelerate launch`` and in the pool as each:
    the same variables, argv and working directory, but for two known differences: the port (the
    pool's group keeps its own) and torch's elastic agent, which hosts the store under torchrun and
    accelerate launch (rank 0 hosts the pool's; the agent's store under failure is tested with the
    real launchers in test_launch.py's frozen-rank cases)."""
    flags = ("--use_deepspeed", "--zero_stage", "3")
    for launcher, real in [("deepspeed", deepspeed(2, SCRIPT, "--tag", "real")),
                           (("accelerate", *flags), accelerate(2, SCRIPT, *flags) + ["--tag", "real"])]:
        launched(real, "wrote what it saw", 2, env={"HARNESS": "x"}, cwd=tmp_path)
        out = pool2.run_script(SCRIPT, "--tag", "pool", launcher=launcher, env={"HARNESS": "x"}, cwd=tmp_path)
        assert out.count("wrote what it saw") == 2, out
        want, got = seen(tmp_path, "real"), seen(tmp_path, "pool")
        assert len(want) == len(got) == 2, (want, got)
        for w, g in zip(want, got):
            assert w["env"].pop("MASTER_PORT") and g["env"].pop("MASTER_PORT") == str(pool2.port)
            agent = w["env"].pop("TORCHELASTIC_USE_AGENT_STORE"), g["env"].pop("TORCHELASTIC_USE_AGENT_STORE")
            assert agent == (None if launcher == "deepspeed" else "True", None), agent
            local = ["--local_rank=" + str(w["group"][0])] * (launcher == "deepspeed")
            assert (w.pop("argv"), g.pop("argv")) == ([*local, "--tag", "real"], [*local, "--tag", "pool"])
            assert w == g, (launcher, w, g)
        for f in tmp_path.glob("seen-*"):
            f.unlink()
    plain.run_script(SCRIPT, "--tag", "plain", launcher=None, cwd=tmp_path)
    assert seen(tmp_path, "plain") == [{"group": None, "argv": ["--tag", "plain"], "local_rank": None,
                                        "cwd": str(tmp_path), "env": dict.fromkeys(harness_script.NAMES)}]
    with pytest.raises(AssertionError, match=r"(?s)SystemExit: 3.*harness_script.py failed; what it printed:\n"
                                             r"script rank None wrote what it saw"):
        plain.run_script(SCRIPT, "--tag", "plain", "--exit", "3", launcher=None, cwd=tmp_path)
    assert not plain.alive
