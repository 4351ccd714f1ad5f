"""The command lines ``ringseq launch`` builds for each launcher (no process is started)."""
import sys
from pathlib import Path

from ringseq.launch.launch_cmd import command


def test_deepspeed_gets_its_own_launcher_with_gpus_port_and_arguments():
    argv = command("deepspeed", 2, "examples/torchrun_loop.py", ["--steps", "4"], port=29555)
    assert Path(argv[0]).name == "deepspeed"
    if Path(sys.executable).with_name("deepspeed").exists():  # the venv's own, even when not on PATH
        assert argv[0] == str(Path(sys.executable).with_name("deepspeed"))
    assert argv[1:] == ["--num_gpus", "2", "--master_port", "29555", "examples/torchrun_loop.py", "--steps", "4"]
    assert command("deepspeed", 4, "pkg.train", [], module=True, port=1)[-2:] == ["--module", "pkg.train"]


def test_torchrun_and_accelerate_run_under_this_interpreter():
    torchrun = command("torchrun", 2, "train.py", ["-x"], port=29556)
    assert torchrun[:3] == [sys.executable, "-m", "torch.distributed.run"] and torchrun[-2:] == ["train.py", "-x"]
    assert "--nproc_per_node" in torchrun and torchrun[torchrun.index("--master_port") + 1] == "29556"
    accelerate = command("accelerate", 2, "train.py", [], port=29557)
    assert accelerate[:3] == [sys.executable, "-m", "accelerate.commands.launch"] and "--multi_gpu" in accelerate
    assert accelerate[accelerate.index("--num_processes") + 1] == "2"
