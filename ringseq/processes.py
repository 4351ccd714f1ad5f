"""Small helpers for the processes ringseq starts or runs in: free ports and a clean exit.

Production code (the ``ringseq`` command, launched jobs) and tests both use these; nothing
here depends on a process group.
"""
from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def exit_now(code: int = 0) -> None:
    """End a launched job without interpreter teardown. With torch 2.13 on this CPU machine a
    2-process gloo job that has imported ``torch._dynamo`` (DeepSpeed and transformers do) aborts
    at exit in about 1 run of 3 ("terminate called without an active exception", even after
    destroy_process_group; without the import it does not): our jobs and test scripts flush and
    leave with ``os._exit`` once their work and checks are done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
