"""Joining (or making) the process group, with the device bound first on CUDA.

NCCL ties a communicator to the device that is current when its first collective runs; a
process that has not chosen its GPU by then puts every rank's communicator on GPU 0. So on
CUDA the device is bound (``LOCAL_RANK``, as every launcher sets it) and handed to
``init_process_group(device_id=...)`` before any collective. ``group_args`` decides the
arguments from the environment alone, so the choice is testable without a GPU.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .errors import RingSeqError
from .processes import free_port


def group_args(environ, *, backend: str | None, cuda: bool, device_count: int) -> dict:
    """Keyword arguments for ``init_process_group`` in this environment.

    Under a launcher (``WORLD_SIZE`` set: torchrun, deepspeed, accelerate) it joins the
    launcher's rendezvous (``env://``); otherwise it makes a one-process world on a free port.
    With CUDA the backend is NCCL and ``device_id`` is this process's GPU (``LOCAL_RANK``).
    """
    backend = backend or ("nccl" if cuda else "gloo")
    kwargs: dict = {"backend": backend}
    if "WORLD_SIZE" not in environ:
        kwargs.update(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if cuda and backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", local_device(environ, device_count))
    return kwargs


def local_device(environ, device_count: int) -> int:
    """This process's GPU index: ``LOCAL_RANK`` (0 without a launcher)."""
    local = int(environ.get("LOCAL_RANK", 0))
    if not 0 <= local < device_count:
        raise RingSeqError(f"LOCAL_RANK {local} but this machine has {device_count} GPU(s): start at most "
                           f"{device_count} processes per node (e.g. torchrun --nproc_per_node {device_count})")
    return local


def node_key(environ) -> str:
    """Which node this process runs on: the launcher's node rank (torchrun's ``GROUP_RANK``, which
    Accelerate passes on; DeepSpeed's ``NODE_RANK``...), else the host name."""
    for var in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        if environ.get(var, "") != "":
            return f"node {environ[var]}"
    import socket

    return socket.gethostname()


def ensure_process_group(backend: str | None = None) -> None:
    """Join the launcher's process group, or make a one-process world when there is none; on
    CUDA bind this process's GPU first (also when someone else made the group)."""
    cuda = torch.cuda.is_available()
    if dist.is_initialized():
        if cuda and "LOCAL_RANK" in os.environ and dist.get_backend() == "nccl":
            torch.cuda.set_device(local_device(os.environ, torch.cuda.device_count()))
        return
    kwargs = group_args(os.environ, backend=backend, cuda=cuda, device_count=torch.cuda.device_count() if cuda else 0)
    if "device_id" in kwargs:
        torch.cuda.set_device(kwargs["device_id"])
    dist.init_process_group(**kwargs)
