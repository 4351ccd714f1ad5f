"""Cases for tests/dist/test_harness.py: what a case may leave behind in a warm worker, and cases
that fail, die or hang on one rank."""
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

PROBE = "RINGSEQ_HARNESS_PROBE"


def leave_state() -> None:
    """Change everything ``ringseq.testing._Clean`` puts back, and destroy the default group."""
    from accelerate import PartialState
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    import ringseq
    from ringseq.testing import shared_init

    from ringseq import peers

    os.environ[PROBE] = "left"
    sys.argv.append("--left")
    sys.path.insert(0, "/left")
    os.chdir(tempfile.gettempdir())
    torch.set_num_threads(2)
    peers._silent_until = peers._linger_until = time.time() + 60
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    PartialState(cpu=True)
    leave_state.config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_batch_size": 1})
    sp = shared_init(sp_size=dist.get_world_size())
    q = torch.randn(1, 2, 8, 4, dtype=torch.float32)
    ringseq.ring_attention(q, q, q, sp=sp)  # a collective count the next case must not inherit
    dist.destroy_process_group()  # a script's last line: the pool's group stays


def state() -> dict:
    from accelerate.state import AcceleratorState, PartialState
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from ringseq import peers

    dist.barrier()  # the group still works
    return {"probe": os.environ.get(PROBE), "dtype": torch.get_default_dtype(), "draw": torch.rand(3).tolist(),
            "accelerate": bool(PartialState._shared_state or AcceleratorState._shared_state),
            "zero3": is_deepspeed_zero3_enabled(), "argv": list(sys.argv), "path": list(sys.path), "cwd": os.getcwd(),
            "threads": torch.get_num_threads(), "clocks": (peers._silent_until, peers._linger_until)}


def fail_on(rank: int) -> None:
    if dist.get_rank() == rank:
        raise ValueError(f"injected on rank {rank}")
    dist.barrier()  # the others wait for the one that failed: the pool's grace ends their wait


def die_on(rank: int) -> None:
    if dist.get_rank() == rank:
        os._exit(3)
    dist.barrier()


def hang_on(rank: int, seconds: float) -> None:
    if dist.get_rank() == rank:
        time.sleep(seconds)
