"""``ringseq plan``: predicted memory, step time and the best shape for a model on a cluster."""
from __future__ import annotations

import argparse
import json
import re
from fractions import Fraction

from ringseq.layouts import LAYOUTS
from ringseq.planner import presets

SUFFIXES = {"": 1, "k": 1024, "m": 1024**2}
"""Token-count suffixes, binary as context lengths are named: 128K = 131,072, 1M = 1,048,576."""


def tokens(text: str) -> int:
    """A token count: ``1000000``, ``1_000_000``, ``1,000,000``, or with K or M (binary): ``128K``, ``1M``, ``1.5M``."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", text.strip().replace("_", "").replace(",", ""))
    count = Fraction(found.group(1)) * SUFFIXES[found.group(2).lower()] if found else Fraction(0)
    if count < 1 or count.denominator != 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens: give 1000000, or a number "
                                         "with K or M, binary (128K = 131072, 1M = 1048576)")
    return int(count)


def hardware_name(text: str) -> str:
    """A hardware preset in any case: ``H100`` is ``h100``."""
    return text.strip().lower()


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory, step time and the best ring x Ulysses shape",
                       description="Predict per-rank memory, step time, efficiency and exposed communication of every "
                                   "ring x Ulysses shape of one training step, and recommend the fastest that fits "
                                   "in device memory. When none fits it says so, and names the flags below "
                                   "(--checkpointing, --tiled-mlp N, --offload, --zero-stage 3, --gpus N) that would "
                                   "make one fit, saying which one alone is enough. Formulas: docs/planner.md.")
    p.add_argument("--model", required=True, help="config.json of the model, or its folder (required)")
    p.add_argument("--seq-len", type=tokens, default=None,
                   help="tokens per sequence: a whole number, or with K or M, binary as context lengths are named: "
                        "128K = 131072, 1M = 1048576 (give 1000000 for a million) (default: none; required unless --longest)")
    p.add_argument("--longest", action="store_true",
                   help="find the longest sequence that fits the device's memory and the host's with the switches "
                        "given, and plan it (default: plan --seq-len)")
    p.add_argument("--gpus", type=int, required=True, help="devices in all (required)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default: %(default)s)")
    p.add_argument("--hardware", type=hardware_name, choices=sorted(presets()), default="h100",
                   help="device preset, any case (default: %(default)s)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3,
                   help="DeepSpeed ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also weights "
                        "(default: %(default)s)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2's full sharding instead of DeepSpeed's ZeRO-3 (with --zero-stage 3): the root's "
                        "parameters and gradients and a layer gathered within the step (default: off)")
    p.add_argument("--sp-size", type=int, default=None,
                   help="ranks per sequence; the others are data-parallel replicas (default: all gpus)")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag",
                   help="how a sequence is split over the ring (default: %(default)s)")
    p.add_argument("--inference", action="store_true",
                   help="cost one forward (a prefill) instead of a training step (default: a training step)")
    p.add_argument("--checkpointing", action="store_true",
                   help="gradient checkpointing; ringseq keeps the ring outputs (default: off)")
    p.add_argument("--replay-ring", action="store_true",
                   help="with --checkpointing: keep each layer's input alone and replay the ring in the recompute, "
                        "as patch(keep_ring_outputs=False): less memory, one more ring forward per layer (default: off)")
    p.add_argument("--tiled-mlp", type=int, default=None, metavar="N",
                   help="compute each MLP in N sequence tiles, recomputed in backward (default: off)")
    p.add_argument("--offload", action="store_true",
                   help="optimizer state (and under ZeRO-3 the weights) in host memory (default: off)")
    p.add_argument("--offload-activations", action="store_true",
                   help="with --checkpointing: the tensors kept for backward wait in host memory, copied out and "
                        "back each step (default: off)")
    p.add_argument("--host-memory-gb", type=float, default=None,
                   help="host memory per node the job may fill, GiB: bounds --offload and --offload-activations "
                        "(default: the preset's, 80%% of a node's)")
    p.add_argument("--head-groups", default=None, metavar="N|kv",
                   help="rings per attention call, one after the other (a memory switch: less memory, more "
                        "launches and latencies): kv for one per kv head, or a number (default: one ring)")
    p.add_argument("--intra-gbps", type=float, default=None,
                   help="GB/s per device inside a node (default: the preset's)")
    p.add_argument("--inter-gbps", type=float, default=None,
                   help="GB/s per device across nodes (default: the preset's)")
    p.add_argument("--tflops", type=float, default=None, help="peak TFLOP/s per device (default: the preset's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (default: a table)")
    p.set_defaults(run=run)


def make_plan(args):
    """The plan of --seq-len, or with --longest of the longest sequence that fits (None: not even the shortest)."""
    import ringseq
    from ringseq.planner import longest

    if args.replay_ring and not args.checkpointing:
        raise ringseq.RingSeqError("--replay-ring replays the ring in checkpointing's recompute: add --checkpointing")
    if args.offload_activations and not args.checkpointing:
        raise ringseq.RingSeqError("--offload-activations moves checkpointing's kept tensors to host memory: add "
                                   "--checkpointing")
    if (args.seq_len is None) == (not args.longest):
        raise ringseq.RingSeqError("give --seq-len N, or --longest to find the longest that fits (not both)")
    kw = dict(model=args.model, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
              hardware=args.hardware, zero_stage=args.zero_stage, training=not args.inference,
              layout=args.layout, sp_size=args.sp_size, checkpointing=args.checkpointing,
              keep_ring_outputs=not args.replay_ring, tiled_mlp=args.tiled_mlp, offload=args.offload,
              intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps, tflops=args.tflops,
              head_groups=_head_groups(args.head_groups), fsdp=args.fsdp,
              offload_activations=args.offload_activations, host_memory_gb=args.host_memory_gb)
    return longest(**kw) if args.longest else ringseq.plan(seq_len=args.seq_len, **kw)


def _head_groups(text):
    if text is None or text == "kv":
        return text
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"ringseq plan: --head-groups takes kv or a number, got {text!r}") from None


def table(p) -> str:
    """The shapes, one row each (host memory per node where any goes there), and the advice with its fixes
    named as this command's flags."""
    host = any(e.host_memory_per_node_gb for e in p.modes)
    rows = [f"{'mode':<14}{'ulysses':>8}{'ring':>6}{'step s':>10}{'eff':>7}{'exposed s':>11}{'GiB/rank':>10}"
            + (f"{'host GiB/node':>15}" if host else "")]
    for e in p.modes:
        rows.append(f"{e.name:<14}{e.ulysses:>8}{e.ring:>6}{e.step_time_s:>10.3g}{e.efficiency:>7.1%}"
                    f"{e.exposed_comm_s:>11.3g}{e.memory_per_rank_gb:>10.1f}"
                    + (f"{e.host_memory_per_node_gb:>15.0f}" if host else ""))
    rows.append(f"tokens per rank {p.tokens_per_rank:.0f}; a ring step hides its transfer from "
                f"{p.min_tokens_per_rank_for_overlap:.0f} tokens per rank")
    advice = p.recommendation.cli_reason
    rows.append(f"recommended: {advice}" if p.fits else advice)
    return "\n".join(rows)


def run(args) -> int:
    import sys

    p = make_plan(args)
    if p is None:
        print("ringseq plan: not even the shortest sequence the layout splits fits with these switches; "
              "plan a --seq-len to see what would make it fit", file=sys.stderr)
        if args.json:
            print("null")
        return 1
    if args.longest and not args.json:
        print(f"longest sequence that fits: {p.seq_len} tokens")
    print(json.dumps(p.to_dict(), indent=2) if args.json else table(p))
    return 0
