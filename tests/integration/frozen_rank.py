"""One rank SIGSTOPs itself inside a ring forward under a real launcher; the others report how
their call ended (tests/integration/test_frozen_under_launchers.py).

    ringseq launch --launcher deepspeed --sp 2 --nproc 2 tests/integration/frozen_rank.py OUT_DIR VICTIM [exit]

Every rank writes its pid to ``OUT_DIR/pid<rank>``; after an exact first call, global rank
``VICTIM`` stops (or with ``exit`` exits) in the block compute of its second call (forward + backward), and
every other rank writes
``OUT_DIR/rank<rank>.json``: the seconds from its call to its error, and the error. The test
ends the stopped rank and the launcher.
"""
import json
import os
import signal
import sys
import time

import torch

import ringseq
from ringseq.attention import ring
from ringseq.processes import exit_now

TIMEOUT = 2.0


def main(out_dir: str, victim: int, how: str = "stop") -> None:
    sp = ringseq.init(timeout=TIMEOUT)
    me = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"pid{me}"), "w") as f:
        f.write(str(os.getpid()))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 16, generator=g) for _ in range(3))
    local = [ringseq.shard(t, 2, sp=sp).requires_grad_(True) for t in (q, k, v)]
    ringseq.ring_attention(*local, sp=sp).sum().backward()  # every connection and the store client made
    if me == victim:
        original = ring._Schedule.compute

        def compute(self, t, work):
            if how == "exit":  # dies: the launcher then stops the others (torchrun: SIGTERM within 0.1 s)
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSTOP)
            return original(self, t, work)

        ring._Schedule.compute = compute
    start = time.perf_counter()
    try:
        ringseq.ring_attention(*local, sp=sp).sum().backward()  # a ring of 2 may finish the forward alone
        outcome = dict(outcome="finished")
    except ringseq.RingSeqError as exc:
        outcome = dict(outcome="RingSeqError", message=str(exc))
    except Exception as exc:  # noqa: BLE001 - reported: anything but a RingSeqError fails the test
        outcome = dict(outcome=type(exc).__name__, message=str(exc))
    outcome.update(rank=me, seconds=round(time.perf_counter() - start, 3),
                   agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
    with open(os.path.join(out_dir, f"rank{me}.json"), "w") as f:
        json.dump(outcome, f)
    exit_now(0)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    main(args[0], int(args[1]), *args[2:3])
