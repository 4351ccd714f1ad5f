"""The ringseq command and DeepSpeed glue, through the real launchers in subprocesses."""
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ringseq_cmd(*args, cwd=ROOT, timeout=600):
    return subprocess.run([sys.executable, "-m", "ringseq.launch.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_runs_and_the_curves_agree(tmp_path):
    run = ringseq_cmd("demo", "--steps", "4", "--seq-len", "256", "--batch", "2", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ring loss = unpatched loss on the same weights, every step: yes" in run.stdout
    assert (tmp_path / "loss_curves.png").stat().st_size > 0


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "accelerate"])
def test_launch_runs_the_example(launcher):
    run = ringseq_cmd("launch", "--launcher", launcher, "--sp", "2", "--nproc", "2", "examples/torchrun_loop.py")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "step 4" in run.stdout


def test_init_under_torchrun_imports_no_training_library():
    from ringseq.processes import free_port

    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(free_port()), "tests/integration/core_only.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.count("core only") == 2, run.stdout[-2000:] + run.stderr[-3000:]


def test_launch_refuses_sp_not_dividing_the_processes():
    run = ringseq_cmd("launch", "--sp", "3", "--nproc", "2", "examples/torchrun_loop.py")
    assert run.returncode == 2 and "world 2 is not data N x ring 3 x ulysses 1" in run.stderr, run.stderr


def test_env_reports_kernels():
    run = ringseq_cmd("env")
    assert run.returncode == 0 and "kernel cpu float32: cpu_flash" in run.stdout


def deepspeed_step(nproc, *args, expect="parameters match", also=None):
    exe = Path(sys.executable).with_name("deepspeed")
    from ringseq.processes import free_port

    port = free_port()
    run = subprocess.run([str(exe), "--num_gpus", str(nproc), "--master_port", str(port),
                          "tests/integration/ds_step.py", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    # DeepSpeed's CPU comm layer leaves a ~69 MB /dev/shm buffer per rank; ringseq.init removes the names
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"), "shared-memory buffers left behind"
    assert out.count(expect) == nproc, out[-4000:]
    assert also is None or out.count(also) == nproc, out[-4000:]


@pytest.mark.parametrize("stage,clip", [(0, "0"), (1, "1.0"), (2, "1.0"), (3, "0")])
def test_deepspeed_step_equals_single_process(stage, clip):
    deepspeed_step(2, "--stage", str(stage), "--clip", clip)


def test_deepspeed_ds_config_section():
    deepspeed_step(2, "--stage", "2", "--section")


@pytest.mark.parametrize("name", ["ds_zero1.json", "ds_zero2.json", "ds_zero3.json"])
def test_shipped_ds_configs(name):
    deepspeed_step(2, "--config", f"launch/configs/{name}")


def test_shipped_accelerate_config():
    from ringseq.processes import free_port

    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          "launch/configs/accelerate_cpu.yaml", "--main_process_port", str(free_port()),
                          "examples/torchrun_loop.py"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RINGSEQ_SP_SIZE": "2"})
    assert run.returncode == 0 and "step 4" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_with_data_parallel_replicas_and_checkpoint(stage):
    deepspeed_step(4, "--stage", str(stage), "--sp", "2", "--checkpoint", also="next step matches")


def test_deepspeed_zero3_reduce_scatter_is_refused():
    deepspeed_step(2, "--stage", "3", "--reduce-scatter", "--expect-refusal", expect="refused as expected")


@pytest.mark.parametrize("args,message", [
    (["--sp", "3"], "sp_size 3 must divide the world size"),
    (["--section-extra", "sp_szie=2"], "unknown keys ['sp_szie']")])
def test_deepspeed_bad_ringseq_section_is_refused(args, message):
    deepspeed_step(2, "--stage", "2", "--section", "--expect-refusal", *args, expect="refused as expected",
                   also=message)
