"""Soak: a few hundred random ring_attention cases against the float64 reference, bounded in time.

Each case draws a layout, a world (2 or 4) and Ulysses size, fp32 or bf16, a local length,
kv heads, and any mix of packed documents, padding, a sliding window, softcap, sinks and kernel
slabs; ringseq's output and gradients must pass the project's 2x rule (``ringseq.testing``)
against the full-sequence float64 reference, as in ``tests/dist``. Prints a progress bar and one
JSON line: cases run, failures, and the worst error seen as a share of its allowed bound.
Usage::

    python tests/soak.py                  # 300 cases or 5 minutes, whichever comes first
    python tests/soak.py --cases 20 --minutes 1 --seed 3
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH = 10  # cases per round trip to the pool


def draw(rng: random.Random, world: int) -> dict:
    """One random case (the same on every rank: drawn in the parent)."""
    from ringseq import LAYOUTS

    case = dict(layout=rng.choice(LAYOUTS), ulysses=rng.choice([1, 2] if world >= 2 else [1]),
                dtype=rng.choice(["fp32", "bf16"]), S_per_rank=2 * rng.randint(3, 20), K=rng.choice([1, 2, 4]),
                seed=rng.randrange(10**6), slab_rows=rng.choice([None, 3, 5]))
    features = {}
    if rng.random() < 0.4:
        features["packed"] = True
    if rng.random() < 0.3:
        features["padded"] = True
    if rng.random() < 0.4:
        features["window"] = rng.randint(1, case["S_per_rank"] * world)
    if rng.random() < 0.25:
        features["softcap"] = rng.choice([1.5, 5.0, 30.0])
    if rng.random() < 0.25:
        features["sinks"] = True
    case["features"] = features
    return case


def run_cases(cases: list[dict]) -> list[dict]:
    """On every rank: each case checked by the 2x rule; the worst error share per case."""
    import torch.distributed as dist

    from ringseq import testing
    from ringseq.testing import shared_init
    from tests.dist import cases_features

    worst = []
    real = testing.assert_close

    def recording(actual, plain, ref64, what, floor=None):
        err, ref_err = testing.error(actual, ref64), testing.error(plain, ref64)
        bound = 2 * ref_err + (2 * testing.rounding(ref64, actual.dtype) if floor is None else floor)
        worst[-1] = max(worst[-1], err / bound if bound else 0.0)
        real(actual, plain, ref64, what, floor)

    cases_features.assert_close = testing.assert_close = recording
    results = []
    try:
        for case in cases:
            worst.append(0.0)
            sp = shared_init(sp_size=dist.get_world_size(), ulysses_size=case["ulysses"], layout=case["layout"])
            try:
                cases_features.check_features(sp, dtype=cases_features.DTYPES[case["dtype"]], K=case["K"],
                                              S_per_rank=case["S_per_rank"], seed=case["seed"],
                                              slab_rows=case["slab_rows"], **case["features"])
                results.append(dict(case, worst_share=worst[-1], failed=None))
            except AssertionError as exc:
                results.append(dict(case, worst_share=worst[-1], failed=str(exc)[:500]))
    finally:
        cases_features.assert_close = testing.assert_close = real
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    from tqdm import tqdm

    from ringseq.testing import DistPool

    rng = random.Random(args.seed)
    deadline = time.monotonic() + 60 * args.minutes
    done, bar = [], tqdm(total=args.cases, unit="case", desc="soak")
    pools = {}
    try:
        while len(done) < args.cases and time.monotonic() < deadline:
            world = rng.choice(args.worlds)
            if world not in pools:
                pools[world] = DistPool(world)
            batch = [draw(rng, world) for _ in range(min(BATCH, args.cases - len(done)))]
            per_rank = pools[world].run(run_cases, batch)
            for n, case in enumerate(per_rank[0]):
                failed = [r[n]["failed"] for r in per_rank if r[n]["failed"]]
                done.append(dict(case, world=world, worst_share=max(r[n]["worst_share"] for r in per_rank),
                                 failed=failed[0] if failed else None))
            bar.update(len(batch))
            bar.set_postfix(worst=f"{max(c['worst_share'] for c in done):.2f}",
                            failed=sum(1 for c in done if c["failed"]))
    finally:
        bar.close()
        for pool in pools.values():
            pool.close()
    worst = max(done, key=lambda c: c["worst_share"]) if done else None
    failures = [c for c in done if c["failed"]]
    print(json.dumps({"cases": len(done), "failures": len(failures),
                      "worst_error_share_of_bound": round(worst["worst_share"], 3) if worst else None,
                      "worst_case": worst, "failures_seen": [dict(c, failed=c["failed"][:600]) for c in failures[:5]]}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
