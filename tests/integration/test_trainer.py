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
# torchrun and accelerate launch give each rank one thread; deepspeed's launcher leaves torch's
# default (every core), so its ranks would oversubscribe this machine's cores
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def launched(cmd, expect, count, env=None, cwd=ROOT, returncode=0):
    run = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, **ONE_THREAD, "PYTHONUNBUFFERED": "1", **(env or {})})
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


# ZeRO-1 goes through the same glue as ZeRO-2 here; tests/integration/ds_step.py steps all four stages.
# The cases of one launch run one after another in one process group (a launch costs more than a case).
# Data-parallel replicas under the Trainer: the DDP case at 4 processes below (DeepSpeed's own
# dp2 reductions: test_launch.py's 4-process ds_step cases and the ZeRO-3 Accelerate step).
def test_trainer_deepspeed_steps_equal_single_process():
    cases = ["stage=2,resume", "stage=3,resume,section,checkpointing", "stage=3,pretrained"]
    launched(deepspeed(2, HERE / "trainer_step.py", *cases), "parameters match", 2 * (len(cases) + 2))


# the hybrid: a Qwen3.5-style model's gated DeltaNet layer state-passed under the Trainer, 2 x 2 replicas
@pytest.mark.parametrize("nproc,cases,extra", [(2, ["resume,checkpointing"], ["--stock-first"]),
                                               (4, ["", "hybrid"], [])])
def test_trainer_ddp_steps_equal_single_process(nproc, cases, extra):
    resumes = sum("resume" in c for c in cases)
    out = launched(torchrun(nproc, HERE / "trainer_step.py", *cases, *extra), "parameters match",
                   nproc * (len(cases) + resumes))
    assert out.count("stock Trainer refused") == (nproc if "--stock-first" in extra else 0), out[-3000:]


def test_trainer_under_accelerate_launch_with_the_shipped_config():
    from ringseq.processes import free_port

    launched([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "launch/configs/accelerate_cpu.yaml"),
              "--main_process_port", str(free_port()), str(HERE / "trainer_step.py")], "eval loss", 2)


# ZeRO-2 through Accelerate takes the same route into ringseq.initialize as ZeRO-3. ZeRO-3 at 2
# processes (one sequence group): DeepSpeed's data-parallel reductions beside sequence groups are
# stepped at 4 processes in test_launch.py's ds_step cases, the Trainer's at 4 under DDP above.
@pytest.mark.parametrize("flags,nproc", [(["--multi_gpu"], 2), (["--use_deepspeed", "--zero_stage", "3"], 2)])
def test_accelerate_step_equals_single_process(flags, nproc):
    launched(accelerate(nproc, HERE / "accelerate_step.py", *flags), "parameters match", nproc,
             env={"RINGSEQ_SP_SIZE": "2"}, cwd=HERE)


def test_accelerate_own_sp_size_is_refused():
    out = launched(accelerate(2, ROOT / "examples/accelerate_loop.py", "--use_deepspeed", "--zero_stage", "2"),
                   "RingSeqError: Accelerate's parallelism_config has sp_size=2", 2, returncode=1,
                   env={"RINGSEQ_SP_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                        "PARALLELISM_CONFIG_SP_SIZE": "2"})
    assert "step 0" not in out


# the example's ZeRO-3 route is the Accelerate step's above; with --multi_gpu it runs in test_launch.py
@pytest.mark.slow
def test_accelerate_example_with_deepspeed():
    launched(accelerate(2, ROOT / "examples/accelerate_loop.py", "--use_deepspeed", "--zero_stage", "3"), "step 3: loss",
             1, env={"RINGSEQ_SP_SIZE": "2"})


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
    out = launched(ringseq_check(HERE / "check_broken.py", "--steps", "1"), "MISMATCH (rule", 1, returncode=1)
    assert "step 0" in out


def test_trainer_refusals():
    launched([sys.executable, str(HERE / "trainer_refusals.py")], "refusals ok", 1, cwd=HERE)
