"""The ``ringseq`` command in this process: the launchers' command lines ``launch`` builds, the
subcommands' arguments and help, and the refusals made before any process starts."""
import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ringseq.launch.cli import build_parser, main
from ringseq.launch.launch_cmd import command
from ringseq.launch.plan_cmd import tokens

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("launch", "demo", "env", "check", "plan")


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


def subparsers() -> dict:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("text, count", [("1000000", 1_000_000), ("1_000_000", 1_000_000), ("1,000,000", 1_000_000),
                                         ("128K", 131_072), ("128k", 131_072), ("1M", 1_048_576),
                                         ("1.5M", 1_572_864), ("0.5K", 512)])
def test_seq_len_takes_k_and_m_binary(text, count):
    assert tokens(text) == count
    args = build_parser().parse_args(["plan", "--model", "m", "--seq-len", text, "--gpus", "8"])
    assert args.seq_len == count
    assert build_parser().parse_args(["demo", "--seq-len", text]).seq_len == count
    help_text = " ".join(subparsers()["plan"].format_help().split())
    assert "binary" in help_text and "128K = 131072, 1M = 1048576" in help_text


@pytest.mark.parametrize("text", ["1.5", "0", "1G", "ten", "-4", "0.0001K", ""])
def test_seq_len_refuses_what_is_not_a_whole_token_count(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["plan", "--model", "m", "--seq-len", text, "--gpus", "8"])
    assert exit_.value.code == 2 and "not a whole number of tokens" in capsys.readouterr().err


def test_hardware_is_any_case_and_unknown_presets_are_named(capsys):
    for text in ("H100", "h100", "H200", "A100", "Cpu"):
        args = build_parser().parse_args(["plan", "--model", "m", "--seq-len", "1M", "--gpus", "8", "--hardware", text])
        assert args.hardware == text.lower()
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["plan", "--model", "m", "--seq-len", "1M", "--gpus", "8", "--hardware", "TPU"])
    assert exit_.value.code == 2 and "'h100'" in capsys.readouterr().err


@pytest.mark.parametrize("name", COMMANDS)
def test_help_describes_every_command_and_argument_with_its_default(name):
    parser = subparsers()[name]
    assert parser.description and len(parser.description) > 40, name
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name} {action.dest} has no help"
        if action.option_strings:  # an option: its default (or that it is required) is shown
            assert "(default: " in action.help or "(required)" in action.help, f"{name} {action.dest}"
            if "%(default)s" in action.help:
                assert f"(default: {action.default})" in text, f"{name} {action.dest}"


def test_the_demo_writes_to_a_folder_git_ignores():
    args = subparsers()["demo"].parse_args([])
    assert args.out == "ringseq-demo" and "ringseq-demo/" in (ROOT / ".gitignore").read_text().splitlines()


def bad_script(tmp_path):
    script = tmp_path / "no_batches.py"
    script.write_text("def make_model():\n    raise AssertionError('not called by the check of the file')\n")
    return script


def test_check_refuses_a_script_without_make_batches_before_starting_processes(tmp_path, capsys, monkeypatch):
    def no_processes(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "call", no_processes)
    script = bad_script(tmp_path)
    assert main(["check", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"ringseq: error: {script} must define make_batches(): make_model() returns a "
                                "transformers causal LM, make_batches() an iterable of full batches"]
    broken = tmp_path / "broken.py"
    broken.write_text("import os\nimport no_such_module\n")
    assert main(["check", str(broken)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ringseq: error: importing {broken} raised ModuleNotFoundError (line 2): No module named 'no_such_module'"]
    assert main(["check", str(tmp_path / "missing.py")]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_check_refusal_is_one_line_from_the_real_command(tmp_path):
    run = subprocess.run([sys.executable, "-m", "ringseq.launch.cli", "check", str(bad_script(tmp_path))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert len(run.stderr.splitlines()) == 1 and "must define make_batches()" in run.stderr, run.stderr
