"""The ringseq command, the examples and the launchers themselves, through the real launchers in
subprocesses (tests/launched.py)."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.launched import ONE_THREAD, ROOT, accelerate, ringseq_cmd, torchrun


def test_demo_runs_and_the_curves_agree(tmp_path):
    run = ringseq_cmd("demo", "--steps", "4", "--seq-len", "256", "--batch", "2", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ring loss = unpatched loss on the same weights, every step: yes" in run.stdout
    assert "attention cut at the middle" in run.stdout and "retrieval accuracy after 4 steps" in run.stdout
    assert "answers by model.generate on held-out prompts: ring" in run.stdout
    assert (tmp_path / "demo.png").stat().st_size > 0


# the deepspeed launcher runs the Trainer example in test_trainer.py and a frozen rank below; the
# command ringseq builds for it is checked in tests/unit/test_launch_command.py
@pytest.mark.parametrize("launcher,example,done", [("torchrun", "torchrun_loop.py", "step 4"),
                                                   ("accelerate", "accelerate_loop.py", "step 3: loss")])
def test_launch_runs_the_example(launcher, example, done):
    run = ringseq_cmd("launch", "--launcher", launcher, "--sp", "2", "--nproc", "2", f"examples/{example}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert done in run.stdout


def test_init_under_torchrun_imports_no_training_library():
    run = subprocess.run(torchrun(2, "tests/integration/core_only.py"), cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.count("core only") == 2, run.stdout[-2000:] + run.stderr[-3000:]


def test_accelerate_without_multi_gpu_is_explained():
    """On CPU, accelerate launch without --multi_gpu starts one process: the error says so."""
    run = subprocess.run(accelerate(2, "examples/torchrun_loop.py"), cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "RINGSEQ_SP_SIZE": "2"})
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


def test_a_dead_peer_is_reported_before_torchruns_sigterm(tmp_path):
    """Under torchrun a worker's death makes the agent SIGTERM the others within its monitor
    interval (0.1 s), while the survivors whose transfers with it closed are still reading the
    notes (for up to 0.3 s): each of them writes its RingSeqError, naming the dead rank, before it
    ends (before, none of the 3 survivors said anything; torchrun's summary names the dead rank)."""
    run = subprocess.run(torchrun(4, "tests/integration/frozen_rank.py", str(tmp_path), "2", "exit"), cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, **ONE_THREAD})
    text = run.stdout + run.stderr
    reports = re.findall(r"ringseq: RingSeqError on global rank (\d) \(torchrun stopped this process.*", text)
    # ranks 1 and 3 send to and receive from rank 2: their transfers say at once that it is gone
    assert {"1", "3"} <= set(reports), text[-4000:]
    for line in re.findall(r"ringseq: RingSeqError on global rank \d .*", text):
        assert "the notes point at global rank 2" in line or "global rank 2" in line.split("closed")[0], line
