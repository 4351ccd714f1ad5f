"""The ringseq command and DeepSpeed glue, through the real launchers in subprocesses."""
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# torchrun and accelerate launch give each rank one thread; deepspeed's launcher leaves torch's
# default (every core), so its ranks would oversubscribe this machine's cores
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def ringseq_cmd(*args, cwd=ROOT, timeout=600):
    return subprocess.run([sys.executable, "-m", "ringseq.launch.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_runs_and_the_curves_agree(tmp_path):
    run = ringseq_cmd("demo", "--steps", "4", "--seq-len", "256", "--batch", "2", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ring loss = unpatched loss on the same weights, every step: yes" in run.stdout
    assert "attention cut at the middle" in run.stdout and "retrieval accuracy after 4 steps" in run.stdout
    assert "answers by model.generate on held-out prompts: ring" in run.stdout
    assert (tmp_path / "demo.png").stat().st_size > 0


def test_needle_example_answers_as_the_unpatched_model():
    run = ringseq_cmd("launch", "--sp", "2", "--nproc", "2", "examples/needle_generate.py", "--steps", "10",
                      "--train-len", "128", "--lengths", "128", "300", "--depths", "0.2", "0.8", "--batch", "4")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "every answer equals the unpatched model's" in run.stdout and "depth 0.8" in run.stdout


# the deepspeed launcher runs its own examples in test_trainer.py and every ds_step launch above;
# the command ringseq builds for it is checked in tests/unit/test_launch_command.py
@pytest.mark.parametrize("launcher,example,done", [("torchrun", "torchrun_loop.py", "step 4"),
                                                   ("accelerate", "accelerate_loop.py", "step 3: loss")])
def test_launch_runs_the_example(launcher, example, done):
    run = ringseq_cmd("launch", "--launcher", launcher, "--sp", "2", "--nproc", "2", f"examples/{example}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert done in run.stdout


def test_init_under_torchrun_imports_no_training_library():
    from ringseq.processes import free_port

    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(free_port()), "tests/integration/core_only.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.count("core only") == 2, run.stdout[-2000:] + run.stderr[-3000:]


def test_accelerate_without_multi_gpu_is_explained():
    """On CPU, accelerate launch without --multi_gpu starts one process: the error says so."""
    from ringseq.processes import free_port

    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
                          "--main_process_port", str(free_port()), "examples/torchrun_loop.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "RINGSEQ_SP_SIZE": "2"})
    assert run.returncode != 0 and "world 1 is not data N x ring 2" in run.stderr, run.stderr[-3000:]
    assert "accelerate launch --multi_gpu --num_processes 2" in run.stderr, run.stderr[-3000:]


def test_launch_refuses_sp_not_dividing_the_processes():
    run = ringseq_cmd("launch", "--sp", "3", "--nproc", "2", "examples/torchrun_loop.py")
    assert run.returncode == 2 and "world 2 is not data N x ring 3 x ulysses 1" in run.stderr, run.stderr


def test_env_reports_kernels():
    run = ringseq_cmd("env")
    assert run.returncode == 0 and "kernel cpu float32: cpu_flash" in run.stdout
    for feature, kernel in [("documents", "cuda_varlen"), ("softcap", "flex"), ("dense", "cuda_flash")]:
        assert f"cuda bf16 {feature}" in run.stdout and kernel in run.stdout.split(f"cuda bf16 {feature}")[1].split("\n")[0]


def deepspeed_cases(nproc, *cases):
    """Run ds_step.py's cases under ``deepspeed --num_gpus nproc``; every rank must report each."""
    exe = Path(sys.executable).with_name("deepspeed")
    from ringseq.processes import free_port

    port = free_port()
    run = subprocess.run([str(exe), "--num_gpus", str(nproc), "--master_port", str(port),
                          "tests/integration/ds_step.py", *cases], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env={**os.environ, **ONE_THREAD, "PYTHONUNBUFFERED": "1"})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    # DeepSpeed's CPU comm layer leaves a ~69 MB /dev/shm buffer per rank; ringseq removes the names
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"), "shared-memory buffers left behind"
    for n, case in enumerate(cases):
        assert out.count(f"case {n} [{case}] ok") == nproc, f"case {case}:\n" + out[-4000:]


def test_deepspeed_steps_equal_single_process_and_misconfigurations_are_refused():
    """ZeRO 0-3 (two of them without clipping), the ds_config section, the shipped configs, checkpointing
    with tiled MLPs under ZeRO-2 and ZeRO-3 (each weight's gradient reduced once, after the last tile), and
    the refusals: ZeRO-3 reduce_scatter, an sp_size that does not divide the world, a misspelt key."""
    deepspeed_cases(2, "stage=0,clip=0", "stage=1", "stage=2", "stage=3,clip=0", "stage=2,section",
                    "stage=2,memory", "stage=3,clip=0,memory",
                    "config=launch/configs/ds_zero1.json", "config=launch/configs/ds_zero2.json",
                    "config=launch/configs/ds_zero3.json", "stage=3,reduce_scatter,refuse=reduce_scatter averages",
                    "stage=2,section,sp=3,refuse=sp_size 3 must divide the world size",
                    "stage=2,section,extra=sp_szie:2,refuse=unknown keys ['sp_szie']")


def test_deepspeed_with_data_parallel_replicas_and_checkpoints():
    deepspeed_cases(4, "stage=3,sp=2,checkpoint,resume_sp=4")


@pytest.mark.slow  # ZeRO-1's checkpoint goes through the same save/resume glue as ZeRO-3's above
def test_deepspeed_zero_1_checkpoint_resumes_at_another_shape():
    deepspeed_cases(4, "stage=1,sp=2,checkpoint,resume_sp=4")


def test_two_nodes_keep_ulysses_on_a_node_and_a_hybrid_step_is_exact():
    """Two torchrun "nodes" on this machine (rendezvous on localhost, 2 processes each): the
    groups init builds, and an exact Ulysses x ring step whose ring crosses the nodes."""
    from ringseq.processes import free_port

    port = str(free_port())
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(n),
                               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port,
                               "tests/integration/two_nodes.py"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **ONE_THREAD})
             for n in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    text = "".join(out for out, _ in outs)
    assert text.count(": exact") == 4 and "rank 3 on node 1: ulysses [2, 3], ring [1, 3]" in text, text


def test_the_hybrid_example_trains_and_matches_unpatched(tmp_path):
    run = ringseq_cmd("launch", "--sp", "2", "--nproc", "2", "examples/hybrid_trainer.py", "--steps", "3", "--out",
                      str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "training losses over 3 steps (sp 2, 1 replica(s))" in run.stdout, run.stdout[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("held-out loss"))
    assert float(line.rsplit("relative difference ", 1)[1].rstrip(")")) <= 1e-5, line


def test_the_vlm_example_trains_and_matches_unpatched():
    run = ringseq_cmd("launch", "--sp", "2", "--nproc", "2", "examples/vlm_finetune.py", "--steps", "2",
                      "--seq-len", "512", "--images", "8", "--split-vision")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("held-out loss"))
    assert float(line.rsplit("relative difference ", 1)[1].rstrip(")")) <= 1e-5, line
    assert "kinds named right: " in run.stdout, run.stdout[-2000:]


@pytest.mark.slow  # its trainer is tested step for step against TRL in test_grpo
def test_the_grpo_example_trains_and_draws_its_rewards(tmp_path):
    out, plot = tmp_path / "rewards.json", tmp_path / "rewards.png"
    run = ringseq_cmd("launch", "--sp", "2", "--nproc", "2", "examples/grpo_retrieval.py", "--steps", "2",
                      "--prompt-len", "96", "--mentions", "2", "--out", str(out), "--plot", str(plot))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rewards = json.loads(out.read_text())
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards) and plot.exists(), run.stdout[-2000:]
    assert "sequences of 98 tokens over 2 ranks" in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "accelerate"])
def test_a_frozen_rank_0_is_named_under_every_launcher(tmp_path, launcher):
    """Global rank 0 SIGSTOPs itself inside a ring forward. Under deepspeed its process serves the
    rendezvous store; under torchrun and accelerate the agent does. Either way rank 1 raises
    ``RingSeqError`` naming global rank 0 within the timeout plus the notes' grace, and never waits
    for the store's own (30-minute) timeout (tests/integration/frozen_rank.py)."""
    import signal
    import time

    log = open(tmp_path / "launcher.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "ringseq.launch.cli", "launch", "--launcher", launcher, "--sp", "2",
                             "--nproc", "2", "tests/integration/frozen_rank.py", str(tmp_path), "0"], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **ONE_THREAD})
    report, deadline = tmp_path / "rank1.json", time.time() + 300
    try:
        while not report.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(0.2)  # the report's write
    finally:  # end the stopped rank, then the launcher (a SIGKILL ends a stopped process too)
        for pid in tmp_path.glob("pid*"):
            try:
                os.kill(int(pid.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
        log.close()
    assert report.exists(), (tmp_path / "launcher.log").read_text()[-4000:]
    got = json.loads(report.read_text())
    assert got["outcome"] == "RingSeqError", got
    assert (got["agent_store"] or "").lower() == ("" if launcher == "deepspeed" else "true"), got
    assert "global rank 0 never reached a ringseq wait" in got["message"], got
    assert re.findall(r"global ranks? ([\d, ]+) (?:never reached|failed|raised)", got["message"]) == ["0"], got
    assert 2.0 <= got["seconds"] <= 2.0 + 0.5 + 1.5, got  # the timeout, the notes' grace, a loaded machine
