"""ringseq.GRPOTrainer through the real launchers against trl.GRPOTrainer on the same prompts
(grpo_step.py: completions token for token, per-token log-probs, logged metrics, reward calls and
parameter updates, every rank asserting): one sequence group against one TRL process, and two
replicas of two ranks (under DeepSpeed ZeRO-2 and 3) against TRL's two data-parallel processes."""
import subprocess
import sys

import pytest

from ringseq.processes import free_port

from .test_clients import DEEPSPEED, ENV, HERE, ROOT
from .test_clients import run as run_launched

SCENARIOS = ["grpo", "bnpo_ref", "dr_grpo", "dapo_iterations", "peft", "bf16"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]


def run(cmd, scenarios, nproc, env=ENV):
    text = run_launched(cmd, scenarios, nproc, env)
    assert text.count("group refusals ok") == nproc, text[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo") / "reference.pt"
    out = subprocess.run([sys.executable, str(HERE / "grpo_step.py"), "reference", "--refusals", "--out", str(path),
                          *SCENARIOS], cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0 and "refusals ok" in out.stdout, (out.stdout + out.stderr)[-5000:]
    return str(path)


# a group of 4 is behind -m slow (the default suite's budget): the default run has 4 processes in the replica test
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_grpo_one_group_equals_one_trl_process(reference, nproc):
    scenarios = SCENARIOS if nproc == 2 else ["dapo_iterations"]
    run([*ACCELERATE, "--num_processes", str(nproc), "--main_process_port", str(free_port()),
         str(HERE / "grpo_step.py"), "ringseq", "--reference", reference, *scenarios], scenarios, nproc)


@pytest.mark.parametrize("scenarios", [["bnpo_ref@3"], pytest.param(["grpo@2", "dapo_iterations@3"],
                                                                      marks=pytest.mark.slow)])
def test_grpo_replicas_under_deepspeed_zero_equal_trl_data_parallel(tmp_path, scenarios):
    path = str(tmp_path / "replicas.pt")
    out = subprocess.run([*ACCELERATE, "--num_processes", "2", "--main_process_port", str(free_port()),
                          str(HERE / "grpo_step.py"), "reference", "--out", path,
                          *(s.partition("@")[0] for s in scenarios)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    run([DEEPSPEED, "--num_gpus", "4", "--master_port", str(free_port()), str(HERE / "grpo_step.py"), "ringseq",
         "--sp-size", "2", "--reference", path + ".replica{replica}", *scenarios], scenarios, 4,
        env={**ENV, "OMP_NUM_THREADS": "1"})
