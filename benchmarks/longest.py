"""The longest sequence one full training step fits in a per-rank memory budget, side by side.

Systems (one fresh process tree each, gloo, one SGD step = forward + backward + optimizer, fp32):

- ``unpatched``  the transformers model in one process, as a user would train it without sequence
  parallelism (full logits, transformers' loss, no checkpointing).
- ``alst``  DeepSpeed ALST at sp P, with the settings its docs recommend: Ulysses attention through
  ``UlyssesSPAttentionHF.register_with_transformers`` (core sdpa), its data loader adapter
  (``UlyssesSPDataLoaderAdapter``: shards and shifts the labels), ``TiledMLP`` on every MLP, the
  loss through ``TiledFusedLogitsLoss``, activation checkpointing, through ``deepspeed.initialize``
  with its mpu (ZeRO-1).
- ``ringseq``  ``ringseq.patch`` at sp P through ``ringseq.initialize`` (the same ZeRO-1 config), with
  memory features named in the config: ``loss`` (the chunked loss; without it full logits),
  ``ckpt`` (checkpointing that keeps ring outputs), ``replay`` (checkpointing whose recompute
  replays the ring: ``keep_ring_outputs=False``), ``tiled`` (tiled MLP), ``offload`` (checkpointed
  activations in host memory: on CPU a copy that saves nothing), ``groups`` (one ring per kv head:
  ``patch(head_groups="kv")``; without it one ring for all heads, the default), and the engine:
  ZeRO-1 by default, ``zero3`` (DeepSpeed ZeRO-3) or ``fsdp2`` (FSDP2 ``fully_shard`` per decoder
  layer and root over every rank, torch's SGD; no DeepSpeed); or ``fit``
  (``patch(fit=True, memory_budget=`` the budget ``)``: the planner picks the switches for each N;
  a probe it refuses, before the step, counts as not fitting, and a probe records what it chose
  and its predicted step memory at N beside the measured one; its search is ``fit_search``, since
  its step memory falls where it turns a switch on).

The model is a Llama of 4 layers, d=512, MLP 2048, 8 q / 4 kv heads, vocab 32000 (47M parameters:
MLP, logits and attention all matter); ``--model tiny`` is a toy size for the test suite;
``--model hybrid`` the same sizes as a Qwen3.5-style hybrid (three gated DeltaNet layers of 4 key /
8 value heads of 64, one attention layer), for ``unpatched`` and ``ringseq`` systems.

Memory: the budget bounds each rank's *step memory*, the peak resident set of a forward + backward
above the resident set just before it (activations, gradients, communication and kernel buffers;
the model, optimizer and DeepSpeed state held between steps are not counted, and ``peak_mb``
reports the whole process's peak beside it), the largest over ranks. It is read from ``VmHWM``,
reset before each probe through ``/proc/self/clear_refs``, with ``MALLOC_MMAP_THRESHOLD_`` fixed so
freed tensors leave the resident set. A warm-up step at the smallest N comes first (DeepSpeed
allocates buffers on its first step). A watchdog ends a probe whose step passes twice the budget
(it counts as not fitting). The search doubles N from ``--start`` until a probe does not fit, then
bisects on a ``--grain`` grid (each guess where the line through the last two probes meets the
budget, kept strictly inside the bracket), so the reported N fits and N + grain does not; at most
``--max-n`` is probed (a step there takes minutes on this machine), and a system that fits it is
reported as capped. ``--common N`` times training steps at N for each P=2 system: ``--rounds``
fresh process trees per system, interleaved across the systems, ``--steps`` steps each after a
warm-up; tokens/s from the median step. Prints JSON lines, writes ``longest.jsonl`` and
``longest.png`` (when there are searches) to ``--out``.
Usage::

    python benchmarks/longest.py                       # the whole comparison (about 75 min here)
    python benchmarks/longest.py --systems ringseq:2:loss,ckpt,tiled alst:2 --budget-mb 448
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from contenders import KINDS, MODELS  # noqa: E402

from ringseq import processes  # noqa: E402

SYSTEMS = ["unpatched:1", "alst:2", "alst:4", "ringseq:2:", "ringseq:2:loss", "ringseq:2:loss,ckpt",
           "ringseq:2:loss,ckpt,tiled", "ringseq:4:", "ringseq:4:loss,ckpt,tiled", "ringseq:2:loss,replay,tiled"]
OVERSHOOT = 2.0  # the watchdog ends a probe whose step passes this many budgets (protects the machine)


# ---- memory -------------------------------------------------------------------------------------

class Watchdog(threading.Thread):
    """Ends the process tree when this rank's resident set passes ``limit_mb``, telling the driver
    at which N (``ringseq.processes.end_tree_early``)."""

    def __init__(self, budget_mb: float):
        super().__init__(daemon=True)
        self.budget_mb, self.limit_mb, self.N = budget_mb, None, None

    def watch(self, N: int | None, before_mb: float = 0.0) -> None:
        """Watch a step at N that starts at ``before_mb`` resident (None: stop watching)."""
        self.limit_mb, self.N = before_mb + OVERSHOOT * self.budget_mb, N

    def run(self):
        while True:
            N, limit = self.N, self.limit_mb
            if N is not None and common.rss_mb() > limit:
                processes.end_tree_early(N)
            time.sleep(0.01)


# ---- one process tree: the search, or a timing ---------------------------------------------------

def probe(system, N: int, dog: Watchdog) -> dict:
    """One training step at N, the largest value over ranks of: ``step_mb``, the peak resident set of
    its forward + backward above the resident set before it (what the budget bounds: activations,
    gradients, communication and kernel buffers); ``peak_mb``, the peak resident set of the whole
    step (forward, backward and optimizer; model, optimizer and DeepSpeed state included); and the
    step's seconds."""
    from ringseq import RingSeqError

    common.reset_peak()
    before = common.rss_mb()
    dist.barrier()
    dog.watch(N, before)
    start = time.perf_counter()
    try:
        loss = system.forward_backward(N)
    except RingSeqError as err:  # fit: no set of switches fits N (every rank refuses, before the step)
        dog.watch(None)
        return dict(step_mb=None, refused=str(err).split(". To train")[0])
    step_mb = common.hwm_mb() - before
    system.optimizer_step()
    seconds = time.perf_counter() - start
    dog.watch(None)
    got = dict(step_mb=round(common.slowest(step_mb), 1), peak_mb=round(common.slowest(common.hwm_mb()), 1),
               seconds=round(common.slowest(seconds), 2), loss=round(loss, 4))
    fitted = getattr(system, "fit_report", lambda: None)()
    if fitted is not None:  # what fit chose, and predicted at N and at the bucket's top it planned for
        from ringseq.planner import fit as planner_fit

        setting = system.engine.module._ringseq_patch.fit.setting
        sw = planner_fit.Switches(**fitted["switches"])
        at_n = planner_fit.cost(setting, sw, N, 1).predicted_peak_bytes
        got.update(fit=fitted["described"], switches=fitted["switches"], planned_at=fitted["bucket"],
                   predicted_mb=round(at_n / 2**20, 1), predicted_top_mb=round(fitted["predicted_peak_bytes"] / 2**20, 1),
                   replans=fitted["replans"])
    return got


def search(kind: str, P: int, features: tuple, budget_mb: float, start: int, grain: int, cap: int, lo: int,
           hi: int | None, path: str | None):
    """Longest N (a multiple of ``grain``, at most ``cap``) whose step fits ``budget_mb``; probes
    printed as they go. ``lo``/``hi``: a bracket known from an earlier tree (fits / does not fit)."""
    dog = Watchdog(budget_mb)
    dog.start()
    system = KINDS[kind](P, features)
    system.forward_backward(grain)  # warm-up: buffers DeepSpeed allocates on its first step stay resident
    system.optimizer_step()
    name = f"{kind}:{P}:{','.join(features)}"
    seen = []  # (N, peak) of every probe, for the line through the last two

    def fits(N):
        got = probe(system, N, dog)
        ok = got["step_mb"] is not None and got["step_mb"] <= budget_mb
        if got["step_mb"] is not None:
            seen.append((N, got["step_mb"]))
        if dist.get_rank() == 0:
            common.emit(dict(kind="probe", system=name, P=P, N=N, **got, fits=ok), path)
        return ok

    def guess(a, b):
        """Where the line through the last two probes meets the budget, on the grid, inside (a, b)."""
        mid = (a + b) // 2 // grain * grain
        if len(seen) >= 2 and seen[-1][0] != seen[-2][0]:
            (n1, p1), (n2, p2) = seen[-2:]
            slope = (p2 - p1) / (n2 - n1)
            if slope > 0:
                mid = int((n1 + (budget_mb - p1) / slope) // grain * grain)
        return min(max(mid, a + grain), b - grain)

    if "fit" in features:
        return fit_search(system, name, P, fits, budget_mb, start, grain, cap)
    N = min(max(lo + grain, start) if lo else start, cap)
    while hi is None:
        if fits(N):
            if N >= cap:
                return dict(kind="longest", system=name, P=P, longest_N=N, first_over=None, budget_mb=budget_mb,
                            capped=True)
            lo, N = N, min(2 * N, cap)
            if len(seen) >= 2:  # never jump past where the line says the budget ends (the machine has limits)
                (n1, p1), (n2, p2) = seen[-2:]
                slope = (p2 - p1) / (n2 - n1) if n2 != n1 else 0
                if slope > 0:
                    N = max(lo + grain, min(N, int((n2 + 1.1 * (budget_mb - p2) / slope) // grain * grain)))
                N = min(N, cap)
        else:
            hi = N
    while hi - lo > grain:
        N = guess(lo, hi)
        if fits(N):
            lo = N
        else:
            hi = N
    return dict(kind="longest", system=name, P=P, longest_N=lo, first_over=hi, budget_mb=budget_mb, capped=False)


def fit_search(system, name: str, P: int, fits, budget_mb: float, start: int, grain: int, cap: int) -> dict:
    """The fit contender's search: fit's step memory is not monotone in N (it turns switches on as N
    grows), so no bisection. Probes at start, 2 start, ... (with ``--fit-step``: start, start + step, ...)
    below the longest N on the grid that fit accepts (its planner's), then at that N and, while a step goes
    over the budget, one grain below; then one grain above (which fit refuses before the step). The longest
    N: the first of the downward probes that fits."""
    from ringseq.planner import fit as planner_fit

    state = system.engine.module._ringseq_patch.fit
    limit = min(cap, planner_fit.longest(state.setting, 1, state.budget, cap + grain) // grain * grain)
    N, step = start, int(os.environ.get("RINGSEQ_LONGEST_FIT_STEP", "0"))
    while N < limit:
        fits(N)
        N = N + step if step else N * 2
    N = limit
    while N > 0 and not fits(N):
        N -= grain
    above = limit + grain
    if above <= cap:
        fits(above)
    return dict(kind="longest", system=name, P=P, longest_N=N, first_over=N + grain, budget_mb=budget_mb,
                capped=limit >= cap and N == limit, fit_limit=limit)


def timing(kind: str, P: int, features: tuple, N: int, steps: int) -> list[float]:
    """The slowest rank's seconds of each of ``steps`` training steps at N, after a warm-up step."""
    system = KINDS[kind](P, features)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        system.forward_backward(N)
        system.optimizer_step()
        times.append(common.slowest(time.perf_counter() - start))
    return times[1:]


def speeds(texts: list[str], N: int, rounds: int, steps: int) -> list[dict]:
    """tokens/s of each system at N: ``rounds`` fresh process trees per system, interleaved across
    the systems (the machine's load drifts), ``steps`` timed steps each; the median step."""
    samples = {text: [] for text in texts}
    for _ in range(rounds):
        for text in texts:
            kind, P, features = parse_system(text)
            samples[text] += tree(timing, P, kind, P, features, N, steps)
    records = []
    for text, seconds in samples.items():
        kind, P, features = parse_system(text)
        median = statistics.median(seconds)
        records.append(dict(kind="tokens_per_s", system=f"{kind}:{P}:{','.join(features)}", P=P, N=N,
                            seconds=round(median, 2), tokens_per_s=round(N / median, 1),
                            samples_s=[round(x, 2) for x in seconds]))
    return records


# ---- the driver ----------------------------------------------------------------------------------

def tree(fn, P: int, *args):
    """Run ``fn(*args)`` on P fresh ranks (``ringseq.processes.run_tree``); rank 0's result, or
    ("killed", N) when the watchdog ended a probe at N (the other ranks are then stopped)."""
    # inherited: freed tensors leave the resident set
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", common.MMAP_THRESHOLD)
    got = processes.run_tree(fn, P, *args, threads=max(1, (os.cpu_count() or 1) // P))
    if isinstance(got, tuple) and got and got[0] == "early":
        return ("killed", got[1])
    return got


def parse_system(text: str) -> tuple[str, int, tuple]:
    kind, P, *rest = text.split(":")
    if kind not in KINDS:
        raise SystemExit(f"unknown system {kind!r} in {text!r}: one of {', '.join(KINDS)}")
    return kind, int(P), tuple(f for f in (rest[0].split(",") if rest else []) if f)


def longest(text: str, budget_mb: float, start: int, grain: int, cap: int, path: str) -> dict:
    """The search for one system, restarted with a narrower bracket whenever the watchdog ends a tree."""
    kind, P, features = parse_system(text)
    lo, hi = 0, None
    while True:
        got = tree(search, P, kind, P, features, budget_mb, start, grain, cap, lo, hi, path)
        if not isinstance(got, tuple):  # ("killed", N) when the watchdog ended the tree
            return got
        hi = got[1]
        name = f"{kind}:{P}:{','.join(features)}"
        with open(path) as f:
            probes = [json.loads(line) for line in f if '"probe"' in line]
        lo = max([r["N"] for r in probes if r["system"] == name and r["fits"]] + [lo])
        common.emit(dict(kind="probe", system=name, P=P, N=hi, step_mb=None, fits=False,
                         note=f"ended by the watchdog past {OVERSHOOT} x the budget"), path)
        if hi - lo <= grain:
            return dict(kind="longest", system=name, P=P, longest_N=lo, first_over=hi, budget_mb=budget_mb,
                        capped=False)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = list({r["system"]: r for r in records if r["kind"] == "longest"}.values())  # a system's latest search
    latest = {r["system"]: r.get("run") for r in records if r["kind"] == "longest"}  # a system's latest search's run
    probes = [r for r in records if r["kind"] == "probe" and r.get("step_mb")
              and r.get("run") == latest.get(r["system"], r.get("run"))]
    sizes = sorted({r["P"] for r in probes})
    fig, axes = plt.subplots(1, 1 + len(sizes), figsize=(5 + 4.5 * len(sizes), 4.5), squeeze=False)
    axes = axes[0]
    ax = axes[0]
    ax.barh([r["system"] for r in best], [r["longest_N"] for r in best], color="tab:blue")
    for i, r in enumerate(best):
        ax.text(r["longest_N"], i, f" {r['longest_N']}" + (" (cap)" if r.get("capped") else ""), va="center",
                fontsize=8)
    ax.set(xlabel="longest N that trains in the budget", title=f"budget {best[0]['budget_mb']:.0f} MB per rank"
           if best else "")
    for ax, P in zip(axes[1:], sizes):
        for name in sorted({r["system"] for r in probes if r["P"] == P}):
            rs = sorted((r for r in probes if r["system"] == name), key=lambda r: r["N"])
            ax.plot([r["N"] for r in rs], [r["step_mb"] for r in rs], marker="o", ms=3, label=name)
        if best:
            ax.axhline(best[0]["budget_mb"], color="k", lw=0.8, ls="--")
        ax.set(xscale="log", xlabel="sequence length N", ylabel="step MB per rank (forward + backward)",
               title=f"P = {P}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, help="kind:P[:features], e.g. ringseq:2:loss,ckpt")
    parser.add_argument("--budget-mb", type=float, default=448.0, help="per-rank step memory (forward + backward)")
    parser.add_argument("--start", type=int, default=512)
    parser.add_argument("--grain", type=int, default=512)
    parser.add_argument("--max-n", type=int, default=24576, help="the longest N probed (a step there takes minutes)")
    parser.add_argument("--common", type=int, default=4096, help="N of the tokens/s comparison (0: none)")
    parser.add_argument("--model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--rounds", type=int, default=3, help="tokens/s: fresh process trees per system, interleaved")
    parser.add_argument("--steps", type=int, default=2, help="tokens/s: timed steps per tree, after a warm-up step")
    parser.add_argument("--only-timing", action="store_true", help="skip the searches: tokens/s at --common only")
    parser.add_argument("--fit-step", type=lambda t: max(0, int(t)), default=0,
                        help="fit systems: probe every this many tokens from --start (default 0: doubling)")
    parser.add_argument("--out", default=common.RESULTS)
    args = parser.parse_args(argv)
    os.environ["RINGSEQ_LONGEST_FIT_STEP"] = str(args.fit_step)  # read by the fit search in the process trees
    if args.model == "hybrid":
        alst = [t for t in args.systems if t.startswith("alst")]
        if alst:
            parser.error(f"ALST shards attention layers only: {alst} cannot run the hybrid model (give --systems)")
    os.environ["RINGSEQ_LONGEST_MODEL"] = args.model  # the process trees read it when they import contenders.py
    os.environ["RINGSEQ_LONGEST_BUDGET_MB"] = str(args.budget_mb)  # the fit contender's memory_budget
    path = common.fresh_file(args.out, "longest.jsonl")
    budget = args.budget_mb
    records = [] if args.only_timing else [longest(text, budget, args.start, args.grain, args.max_n, path)
                                           for text in args.systems]
    for r in records:
        common.emit(r, path)
    if args.common:
        pairs = [text for text in args.systems if parse_system(text)[1] == 2]
        for r in speeds(pairs, args.common, args.rounds, args.steps):
            common.emit(r, path)
    with open(path) as f:
        records = [json.loads(line) for line in f]
    wrote = [path]
    if any(r["kind"] in ("longest", "probe") for r in records):
        plot(records, os.path.join(args.out, "longest.png"))
        wrote.append("longest.png")
    print(f"wrote {' and '.join(wrote)}", file=sys.stderr)


if __name__ == "__main__":
    main()
