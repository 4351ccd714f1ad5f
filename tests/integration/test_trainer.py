"""ringseq.Trainer, Accelerate, the examples and ``ringseq check``, through the real launchers in
subprocesses (deepspeed --num_gpus, torchrun --nproc_per_node, accelerate launch). The scripts
assert on every rank against single-process references; here each must exit 0 and report."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringseq.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))


def launched(cmd, expect, count, env=None, cwd=ROOT, returncode=0):
    run = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    out = run.stdout + run.stderr
    assert run.returncode == returncode, out[-5000:]
    assert out.count(expect) == count, out[-5000:]
    return out


def deepspeed(nproc, script, *args):
    return [DEEPSPEED, "--num_gpus", str(nproc), "--master_port", str(free_port()), str(script), *args]


def torchrun(nproc, script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), str(script), *args]


def accelerate(nproc, script, *flags):
    return [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", str(nproc),
            "--main_process_port", str(free_port()), str(script)]


# ZeRO-1 goes through the same glue as ZeRO-2 here; tests/integration/ds_step.py steps all four stages
@pytest.mark.parametrize("stage,nproc,extra", [
    (2, 2, ["--resume"]), (3, 2, ["--resume", "--section", "--checkpointing"]), (3, 4, ["--resume", "--pretrained"])])
def test_trainer_deepspeed_steps_equal_single_process(stage, nproc, extra):
    launched(deepspeed(nproc, HERE / "trainer_step.py", "--stage", str(stage), *extra), "parameters match",
             nproc * (2 if "--resume" in extra else 1))


@pytest.mark.parametrize("nproc,extra", [(2, ["--checkpointing", "--stock-first"]), (4, [])])
def test_trainer_ddp_steps_equal_single_process(nproc, extra):
    out = launched(torchrun(nproc, HERE / "trainer_step.py", "--resume", *extra), "parameters match", 2 * nproc)
    assert out.count("stock Trainer refused") == (nproc if "--stock-first" in extra else 0), out[-3000:]


def test_trainer_under_accelerate_launch():
    launched(accelerate(2, HERE / "trainer_step.py", "--multi_gpu"), "eval loss", 2)


@pytest.mark.parametrize("flags,nproc", [(["--multi_gpu"], 2), (["--use_deepspeed", "--zero_stage", "2"], 2),
                                         (["--use_deepspeed", "--zero_stage", "3"], 4)])
def test_accelerate_step_equals_single_process(flags, nproc):
    launched(accelerate(nproc, HERE / "accelerate_step.py", *flags), "parameters match", nproc,
             env={"RINGSEQ_SP_SIZE": "2"}, cwd=HERE)


def test_accelerate_own_sp_size_is_refused():
    out = launched(accelerate(2, ROOT / "examples/accelerate_loop.py", "--use_deepspeed", "--zero_stage", "2"),
                   "RingSeqError: Accelerate's parallelism_config has sp_size=2", 2, returncode=1,
                   env={"RINGSEQ_SP_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                        "PARALLELISM_CONFIG_SP_SIZE": "2"})
    assert "step 0" not in out


@pytest.mark.parametrize("flags", [["--multi_gpu"], ["--use_deepspeed", "--zero_stage", "3"]])
def test_accelerate_example(flags):
    launched(accelerate(2, ROOT / "examples/accelerate_loop.py", *flags), "step 3: loss", 1,
             env={"RINGSEQ_SP_SIZE": "2"})


def test_trainer_deepspeed_example(tmp_path):
    launched(deepspeed(2, ROOT / "examples/trainer_deepspeed.py", "--ds-config", "launch/configs/ds_zero3.json",
                       "--out", str(tmp_path)), "done: 4 steps, sp 2", 1)


def ringseq_check(script, *args):
    return [sys.executable, "-m", "ringseq.launch.cli", "check", "--sp", "2", *args, str(script)]


def test_check_reports_parity(tmp_path):
    out = launched(ringseq_check(ROOT / "examples/check_model.py", "--out", str(tmp_path / "check.json")),
                   "ringseq matches the unpatched model", 1)
    assert "layers.2" in out and "lm_head" in out
    assert '"agree": true' in (tmp_path / "check.json").read_text()


def test_check_catches_a_wrong_loss():
    out = launched(ringseq_check(HERE / "check_broken.py"), "MISMATCH (rule", 1, returncode=1)
    assert "step 0" in out


def test_trainer_refusals():
    launched([sys.executable, str(HERE / "trainer_refusals.py")], "refusals ok", 1, cwd=HERE)
