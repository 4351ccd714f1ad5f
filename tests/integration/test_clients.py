"""TRL's SFTTrainer and transformers' run_clm metrics with ringseq, through the real launchers,
against the same clients without ringseq in one process on the same data (client_step.py:
logged metrics, token counts and parameter updates, every rank asserting)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringseq.processes import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))
SFT = ["packing", "padded", "padding_free", "completion", "assistant", "dft", "peft", "model_id", "bf16",
       "vlm", "vlm_peft", "vlm_bf16"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def run(cmd, scenarios, nproc, env=ENV):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    for name in scenarios:
        assert text.count(f": {name} ok:") == nproc, f"{name}:\n" + text[-5000:]
    return text


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("clients") / "reference.pt"
    run([sys.executable, str(HERE / "client_step.py"), "reference", "--out", str(path), *SFT, "clm", "vlm_trainer"],
        [], 0)
    return str(path)


def test_sft_and_run_clm_metrics_under_accelerate(reference):
    scenarios = [*SFT, "clm", "vlm_trainer"]
    run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--main_process_port", str(free_port()), str(HERE / "client_step.py"), "ringseq", "--reference", reference,
         *scenarios], scenarios, 2)


def test_sft_and_run_clm_metrics_under_deepspeed_zero_2_and_3(reference):
    # NAME@STAGE, one process group
    scenarios = ["packing@2", "peft@2", "padded@3", "completion@3", "clm@3", "vlm@3"]
    run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), str(HERE / "client_step.py"), "ringseq",
         "--reference", reference, *scenarios], scenarios, 2,
        env={**ENV, "OMP_NUM_THREADS": "1"})  # one thread per rank, as torchrun and accelerate launch give
