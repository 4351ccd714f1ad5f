"""``ringseq plan``: predicted memory, step time and the best shape for a model on a cluster."""
from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory, step time and the best ring x Ulysses shape")
    p.add_argument("--model", required=True, help="config.json of the model (or its folder)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--gpus", type=int, required=True, help="devices in all")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--hardware", default="h100", help="preset: h100, h200, a100, cpu")
    p.add_argument("--zero-stage", type=int, default=3)
    p.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all gpus)")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--inference", action="store_true", help="one forward (prefill) instead of a training step")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (ring outputs kept)")
    p.add_argument("--tiled-mlp", type=int, default=None, help="MLP tiles")
    p.add_argument("--offload", action="store_true", help="optimizer state in host memory")
    p.add_argument("--intra-gbps", type=float, default=None, help="override: GB/s per device inside a node")
    p.add_argument("--inter-gbps", type=float, default=None, help="override: GB/s per device across nodes")
    p.add_argument("--tflops", type=float, default=None, help="override: peak TFLOP/s per device")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run)


def make_plan(args):
    import ringseq

    return ringseq.plan(model=args.model, seq_len=args.seq_len, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                        hardware=args.hardware, zero_stage=args.zero_stage, training=not args.inference,
                        layout=args.layout, sp_size=args.sp_size, checkpointing=args.checkpointing,
                        tiled_mlp=args.tiled_mlp, offload=args.offload, intra_gbps=args.intra_gbps,
                        inter_gbps=args.inter_gbps, tflops=args.tflops)


def table(p) -> str:
    rows = [f"{'mode':<14}{'ulysses':>8}{'ring':>6}{'step s':>10}{'eff':>7}{'exposed s':>11}{'GiB/rank':>10}"]
    for e in p.modes:
        rows.append(f"{e.name:<14}{e.ulysses:>8}{e.ring:>6}{e.step_time_s:>10.3g}{e.efficiency:>7.1%}"
                    f"{e.exposed_comm_s:>11.3g}{e.memory_per_rank_gb:>10.1f}")
    rows.append(f"tokens per rank {p.tokens_per_rank:.0f}; a ring step hides its transfer from "
                f"{p.min_tokens_per_rank_for_overlap:.0f} tokens per rank")
    rows.append(f"recommended: {p.recommendation.reason}")
    return "\n".join(rows)


def run(args) -> int:
    p = make_plan(args)
    print(json.dumps(p.to_dict(), indent=2) if args.json else table(p))
    return 0
