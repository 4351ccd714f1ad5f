"""ringseq.Trainer and Accelerate against single-process references, in the warm pools as the
launchers start them (deepspeed, torchrun, ``accelerate launch``: their variables and flags,
``ringseq.testing.launcher_env``), and ``ringseq check`` and the refusal of Accelerate's own
sp_size through the real commands. The scripts assert on every rank; here each must report."""
import sys
from pathlib import Path

import pytest

from tests.launched import ROOT, accelerate, deepspeed, launched

HERE = Path(__file__).resolve().parent


def reported(text, expect, count):
    assert text.count(expect) == count, text[-5000:]
    return text


# ZeRO-1 goes through the same glue as ZeRO-2 here; tests/integration/ds_step.py steps all four stages.
# The cases of one launch run one after another in one process group (a launch costs more than a case).
# Data-parallel replicas under the Trainer: the DDP case at 4 processes below (DeepSpeed's own
# dp2 reductions: test_deepspeed.py's 4-process ds_step cases and the ZeRO-3 Accelerate step).
def test_trainer_deepspeed_steps_equal_single_process(pool2):
    cases = ["stage=2,resume", "stage=3,resume,section,checkpointing", "stage=3,pretrained", "stage=2,fit"]
    reported(pool2.run_script(HERE / "trainer_step.py", *cases, launcher="deepspeed"), "parameters match",
             2 * (len(cases) + 2))


# the hybrid: a Qwen3.5-style model's gated DeltaNet layer state-passed under the Trainer, 2 x 2 replicas;
# TrainingArguments(torch_compile=True) on the hybrid: the ring and the gated DeltaNet's kernels ops in the compiled
# decoder (docs/compile.md)
@pytest.mark.parametrize("nproc,cases,extra", [(2, ["resume,checkpointing", "compile,hybrid"], ["--stock-first"]),
                                               (4, ["", "hybrid"], [])])
def test_trainer_ddp_steps_equal_single_process(pools, nproc, cases, extra):
    resumes = sum("resume" in c for c in cases)
    out = reported(pools(nproc).run_script(HERE / "trainer_step.py", *cases, *extra), "parameters match",
                   nproc * (len(cases) + resumes))
    assert out.count("stock Trainer refused") == (nproc if "--stock-first" in extra else 0), out[-3000:]


# FSDP2 through TrainingArguments(fsdp=..., fsdp_config={"version": 2}) and Accelerate's context parallelism
# (parallelism_config cp_size: ringseq's ring over its cp dimension, sp made from it): Accelerate's own FSDP2
# code on gloo (ringseq.launch.accelerate_fsdp; docs/testing.md), with cpu_ram_efficient_loading (from_pretrained),
# sharded state dicts and resuming; FSDP1 (Accelerate needs a GPU for it) and a cp_size that is not ringseq's group
# are refused. FSDP's activation checkpointing ("fsdp,ac"), bf16 and compile: the GPU user's matrix (test_matrix.py)
@pytest.mark.parametrize("nproc,cases", [(2, ["fsdp,resume", "fsdp,ramload,pretrained", "fsdp,sharded,resume",
                                              "refuse=fsdp1", "refuse=cp_mismatch"]),
                                         (4, ["fsdp,cp,resume"])])
def test_trainer_fsdp2_steps_equal_single_process(pools, nproc, cases):
    resumes = sum("resume" in c for c in cases)
    trained = [c for c in cases if "refuse" not in c]
    out = reported(pools(nproc).run_script(HERE / "trainer_step.py", *cases), "parameters match",
                   nproc * (len(trained) + resumes))
    assert out.count("refused as expected") == nproc * (len(cases) - len(trained)), out[-3000:]


def test_trainer_under_accelerate_launch_with_the_shipped_config(pool2):
    config = ("accelerate", "--config_file", str(ROOT / "launch/configs/accelerate_cpu.yaml"))
    reported(pool2.run_script(HERE / "trainer_step.py", launcher=config), "eval loss", 2)


# ZeRO-2 through Accelerate takes the same route into ringseq.initialize as ZeRO-3. ZeRO-3 at 2
# processes (one sequence group): DeepSpeed's data-parallel reductions beside sequence groups are
# stepped at 4 processes in test_deepspeed.py's ds_step cases, the Trainer's at 4 under DDP above.
# FSDP2 (accelerate launch --use_fsdp) at 4 processes, 2 replicas of 2, alone and with Accelerate's own context
# parallelism config (its cp dimension is ringseq's sequence group; torch's context-parallel hooks never attached);
# each then saves and loads its state with Accelerate (save_state / load_state) and steps on
@pytest.mark.parametrize("flags,nproc,env", [
    (["--multi_gpu"], 2, {}), (["--use_deepspeed", "--zero_stage", "3"], 2, {}),
    (["--use_fsdp", "--fsdp_version", "2"], 4, {}),
    (["--use_fsdp", "--fsdp_version", "2"], 4, {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2",
                                                 "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"})])
def test_accelerate_step_equals_single_process(pools, flags, nproc, env):
    out = reported(pools(nproc).run_script(HERE / "accelerate_step.py", launcher=("accelerate", *flags),
                                           env={"RINGSEQ_SP_SIZE": "2", **env}, cwd=HERE), "parameters match", nproc)
    assert out.count(f"cp {2 if env else 1} ") == nproc, out[-3000:]
    assert out.count("save_state / load_state: the next step matches") == nproc, out[-3000:]


def test_accelerate_own_sp_size_is_refused():
    out = launched(accelerate(2, ROOT / "examples/accelerate_loop.py", "--use_deepspeed", "--zero_stage", "2"),
                   "RingSeqError: Accelerate's parallelism_config has sp_size=2", 2, returncode=1,
                   env={"RINGSEQ_SP_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                        "PARALLELISM_CONFIG_SP_SIZE": "2"})
    assert "step 0" not in out


# through the real deepspeed launcher, to the process's clean exit (the Trainer under DeepSpeed's steps are
# checked in the pools above)
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
    """``ringseq check``'s job on a model whose patched loss is 0.1% off: it says MISMATCH and exits 1
    (in a pool of its own: a fresh CLI start costs 10 s more, and the broken loss stays in its processes)."""
    from ringseq.testing import DistPool

    from . import check_broken

    with DistPool(2) as pool:
        (status, out), _ = pool.run(check_broken.checked, "--steps", "1")
    assert status == 1 and "MISMATCH (rule" in out and "step 0" in out, out[-5000:]


def test_trainer_refusals(plain):
    reported(plain.run_script(HERE / "trainer_refusals.py", launcher=None, cwd=HERE), "refusals ok", 1)
