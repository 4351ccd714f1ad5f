"""How ringseq joins or makes the process group, decided without a GPU or a process group.

On CUDA the device must be bound (LOCAL_RANK) and handed to init_process_group as device_id
before any collective; ``ensure_process_group`` is run against recording stand-ins for
torch.cuda and torch.distributed to check the order of those calls.
"""
import pytest
import torch

from ringseq import RingSeqError
from ringseq import process_group as pg


def test_one_process_world_without_a_launcher_on_cpu():
    args = pg.group_args({}, backend=None, cuda=False, device_count=0)
    assert args["backend"] == "gloo" and args["rank"] == 0 and args["world_size"] == 1
    assert args["init_method"].startswith("tcp://127.0.0.1:") and "device_id" not in args


def test_launcher_rendezvous_on_cpu_uses_env():
    args = pg.group_args({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, backend=None, cuda=False,
                         device_count=0)
    assert args == {"backend": "gloo"}


def test_cuda_binds_the_local_rank_device():
    args = pg.group_args({"WORLD_SIZE": "8", "LOCAL_RANK": "3"}, backend=None, cuda=True, device_count=8)
    assert args == {"backend": "nccl", "device_id": torch.device("cuda", 3)}
    alone = pg.group_args({}, backend=None, cuda=True, device_count=1)
    assert alone["device_id"] == torch.device("cuda", 0) and alone["world_size"] == 1
    assert "device_id" not in pg.group_args({"WORLD_SIZE": "2"}, backend="gloo", cuda=True, device_count=2)


def test_local_rank_beyond_the_devices_is_refused():
    with pytest.raises(RingSeqError, match="LOCAL_RANK 9 but this machine has 8 GPU"):
        pg.group_args({"WORLD_SIZE": "16", "LOCAL_RANK": "9"}, backend=None, cuda=True, device_count=8)


def test_device_is_bound_before_the_group_exists(monkeypatch):
    calls = []
    monkeypatch.setattr(pg.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pg.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(pg.torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(pg.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pg.dist, "init_process_group", lambda **kw: calls.append(("init_process_group", kw)))
    monkeypatch.setattr(pg.os, "environ", {"WORLD_SIZE": "4", "LOCAL_RANK": "2"})
    pg.ensure_process_group()
    assert calls == [("set_device", torch.device("cuda", 2)),
                     ("init_process_group", {"backend": "nccl", "device_id": torch.device("cuda", 2)})]


_LATE_THREAD = """
import sys, threading, time
import ringseq
from ringseq.process_group import ensure_process_group
ringseq.init() if sys.argv[1] == "init" else ensure_process_group(None)
threading.Thread(target=lambda: (time.sleep(0.1), print("finished", flush=True)), daemon=True).start()
"""


def test_after_init_the_exit_lets_threads_that_need_the_gil_finish():
    """What a gloo worker freeing its last work does at exit: take the GIL a little after the
    main thread is done. After ``ringseq.init`` the exit waits for it (``settle_at_exit``); a
    bare process group's exit finalizes first and the thread never runs again (the control)."""
    import subprocess
    import sys

    def run(mode):
        done = subprocess.run([sys.executable, "-c", _LATE_THREAD, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        # gloo's own connection log (torch 2.9 prints it to stdout) is not the thread's output
        return "".join(line for line in done.stdout.splitlines(keepends=True) if not line.startswith("[Gloo]"))

    assert run("init") == "finished\n"
    assert run("bare") == ""
