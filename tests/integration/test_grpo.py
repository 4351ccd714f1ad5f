"""ringseq.GRPOTrainer through the real launchers against one-process trl.GRPOTrainer on the same
prompts (grpo_step.py: completions token for token, per-token log-probs, logged metrics and
parameter updates, every rank asserting)."""
import subprocess
import sys

import pytest

from ringseq.processes import free_port

from .test_clients import DEEPSPEED, ENV, HERE, ROOT

SCENARIOS = ["grpo", "bnpo_ref", "dr_grpo", "dapo_iterations", "peft", "bf16"]


def run(cmd, scenarios, nproc, env=ENV):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    for name in scenarios:
        assert text.count(f": {name} ok:") == nproc, f"{name}:\n" + text[-5000:]
    return text


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo") / "reference.pt"
    text = run([sys.executable, str(HERE / "grpo_step.py"), "reference", "--out", str(path), *SCENARIOS], [], 0)
    assert "refusals ok" in text, text[-3000:]
    return str(path)


@pytest.mark.parametrize("nproc", [2, 4])
def test_grpo_under_accelerate(reference, nproc):
    scenarios = SCENARIOS if nproc == 2 else ["grpo", "dapo_iterations", "peft"]
    text = run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
                "--main_process_port", str(free_port()), str(HERE / "grpo_step.py"), "ringseq", "--reference",
                reference, *scenarios], scenarios, nproc)
    assert text.count("group refusals ok") == nproc, text[-3000:]


def test_grpo_under_deepspeed_zero_2_and_3(reference):
    scenarios = ["grpo@2", "bnpo_ref@3"]
    run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), str(HERE / "grpo_step.py"), "ringseq",
         "--reference", reference, *scenarios], scenarios, 2, env={**ENV, "OMP_NUM_THREADS": "1"})
