"""A launched script for tests/dist/test_harness.py: writes what its launcher gave it (variables,
argv, working directory) to ``seen-TAG-RANK.json`` in its working directory, prints a line, then
ends as launched scripts end (destroying the group, sys.exit)."""
import argparse
import json
import os
import sys

import torch.distributed as dist

NAMES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE",
         "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_MIXED_PRECISION",
         "ACCELERATE_DYNAMO_BACKEND", "OMP_NUM_THREADS", "TORCHELASTIC_USE_AGENT_STORE", "HARNESS"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="run")
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--exit", type=int, default=0)
    args = parser.parse_args()
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():  # launched: join the launcher's group
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else None
    seen = {"group": [rank, dist.get_world_size()] if dist.is_initialized() else None, "argv": sys.argv[1:],
            "local_rank": args.local_rank, "cwd": os.getcwd(), "env": {n: os.environ.get(n) for n in NAMES}}
    with open(f"seen-{args.tag}-{rank}.json", "w") as f:
        json.dump(seen, f)
    print(f"script rank {rank} wrote what it saw", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(args.exit)


if __name__ == "__main__":
    main()
