"""Fault soak: random ring cases, one injected fault each, every rank's outcome checked.

    python tests/fault_soak.py                        # 300 cases or 30 minutes, whichever comes first
    python tests/fault_soak.py --cases 12 --seed 1    # a handful (tests/integration/test_fault_soak.py)
    python tests/fault_soak.py --faults exit,kill --worlds 4   # only some faults and worlds

Cases run in trees of fresh processes (world 2 or 4, a third of them with Ulysses 2 around the
ring, gloo, a 2 s timeout): a tree runs a few recoverable cases and may end with one that breaks the
group, and its processes end as ringseq's test jobs do (``exit_now``), as a user's script does (the
interpreter's exit handlers), or hard (``os._exit``: no handler, as a killed process). The cases of
a tree are the steps of a loop that catches an error and skips the step, as
users write it: no ``ringseq.resync`` anywhere, and after a recoverable fault the loop's next step
(new data) must be exact on every rank. Each case draws a layout, a mask
(none, packed documents, left padding, a window), a dtype (fp32, bf16), what runs (raw
``ring_attention`` forward + backward, or a patched tiny Llama's training step) and one fault on
one rank (rank 0, which serves the rendezvous store, included):

``none``             every rank's result is exact (the 2x rule against float64).
``sleep under``      the rank sleeps a quarter of the timeout before the call: exact.
``raise forward``    the rank's block kernel raises in the forward (``raise backward``: backward; ``raise
                     late``: in a forward call's last ring step, after its last transfer);
``other inputs``     the rank's call differs (its window, or its batch);
``refuse``           the rank's own call is wrong (raw: k on another device; the model: output_attentions),
                     which it refuses in the call's agreement;
                     every other rank raises ``RingSeqError`` naming it (in that call or at the next
                     collective), within the timeout plus the grace; the next call is exact again.
``sleep past``       the rank sleeps past the timeout before the call;
``exit``, ``kill``, ``stop``  the rank exits, is SIGKILLed or SIGSTOPped inside the ring:
                     every other rank raises ``RingSeqError`` naming it within the timeout plus the
                     grace; the tree ends there.
``host exits``       (world 4) the rank (not rank 0) raises as in ``raise late``, and rank 0, which serves
                     the store, exits hard on its own error at once (``os._exit``, no lingering), as a
                     job that ends on an error may: every other rank names the victim, in that call
                     and in its next (which finds rank 0 gone), and blames no other rank.

Half the trees wrap the model in an engine, DDP or FSDP2 (per layer and root), with compiled layers in a
third of those: every case of such a tree is a training step of one patched model wrapped once for the tree (the
loop goes on with the same engine after a fault), at world 4 over one sequence group or, in trees without a breaking
fault, two (the engine over replicas: both groups must raise). Trees with compiled layers draw recoverable faults
only and run with a 30 s timeout (the first steps compile, a few seconds apart on four ranks sharing two cores).
Engine trees draw no ``sleep past`` (the engine's own collective before the patched forward, DDP's buffer broadcast
or FSDP2's root all-gather, waits for the sleeper unbounded by ringseq: torch's timeout), and after ``host exits``
the next step may meet the dead host first in that same collective: torch's transport error is accepted there.

In a tree whose processes end hard, rank 0 may end (taking the store) before a survivor far from a
breaking fault's victim has read a note: that survivor must then say that no note could be read,
and blame no rank. Nothing may be silently wrong, hang, or raise anything but ``RingSeqError`` on a healthy rank.
Prints a progress bar, then one JSON line: cases by fault and outcome, the slowest time to an
error against its bound, and every failure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TIMEOUT = 2.0
GRACE = 0.5  # ringseq.peers' grace at this timeout: min(5, max(0.5, 0.2 * TIMEOUT))
SLEEP_PAST = TIMEOUT + 1.0  # a "sleep past" victim's sleep before its call
SLACK = 1.5  # process start-up of a woken rank and scheduling on a loaded 2-core machine
RECOVERABLE = ("none", "sleep under", "raise forward", "raise backward", "raise late", "other inputs", "refuse")
BREAKING = ("sleep past", "exit", "kill", "stop", "host exits")


ENGINES = ("ddp", "fsdp2")
COMPILED_TIMEOUT = 30.0


def draw_tree(rng: random.Random, index: int, faults=RECOVERABLE + BREAKING, worlds=(2, 4),
              engines=("none", "none") + ENGINES) -> dict:
    """One tree: its world, engine and cases (the same on every rank: drawn in the parent), its faults
    drawn from ``faults`` (a tree of breaking faults only still runs exact cases before its last)."""
    from ringseq import LAYOUTS

    world = rng.choice(list(worlds))
    engine = rng.choice(list(engines))
    compiled = engine != "none" and rng.random() < 1 / 3
    recoverable = [f for f in RECOVERABLE if f in faults] or ["none"]
    breaking = [f for f in BREAKING if f in faults and (world > 2 or f != "host exits")  # it needs a bystander
                and not compiled and (engine == "none" or f != "sleep past")]
    cases = []
    for i in range(rng.randint(2, 4)):
        cases.append(_case(rng, world, rng.choice(recoverable), i, engine))
    if breaking and (rng.random() < 0.6 or len(recoverable) < 2):
        cases.append(_case(rng, world, rng.choice(breaking), len(cases), engine))
    # an engine over two sequence groups (replicas) where no case breaks the job
    sp = 2 if engine != "none" and world == 4 and cases[-1]["fault"] in RECOVERABLE and rng.random() < 0.5 else world
    return dict(index=index, world=world, sp=sp, ulysses=rng.choice([1, 1, 2]) if sp == world else 1, cases=cases,
                layouts=LAYOUTS, ending=rng.choice(["ringseq", "user", "hard"]), engine=engine, compiled=compiled,
                timeout=COMPILED_TIMEOUT if compiled else TIMEOUT)


def _case(rng, world: int, fault: str, step: int, engine: str = "none") -> dict:
    from ringseq import LAYOUTS

    victim = rng.randrange(1, world) if fault == "host exits" else rng.randrange(world)
    return dict(step=step, fault=fault, victim=victim, kind=rng.choice(["raw", "raw", "model"]) if engine == "none"
                else "model", layout=rng.choice(LAYOUTS), mask=rng.choice(["none", "documents", "padding", "window"]),
                dtype=rng.choice(["fp32", "bf16"]), seed=rng.randrange(10**6), s=2 * rng.randint(4, 12))


# ---------------------------------------------------------------------------------- on every rank

def _me() -> int:
    """This rank's global rank (a case's victim is one; a tree over replicas has two sequence groups)."""
    import torch.distributed as dist

    return dist.get_rank()


def _inject(case: dict, sp):
    """Arm the case's fault on its victim; returns a function that disarms it."""
    from ringseq.attention import ring

    fault = case["fault"]
    if _me() != case["victim"] or fault in ("none", "other inputs", "refuse"):
        return lambda: None
    if fault.startswith("sleep"):
        time.sleep(TIMEOUT / 4 if fault == "sleep under" else SLEEP_PAST)
        return lambda: None
    original, seen = ring._Schedule.compute, []

    def compute(self, t, work):
        backward = self.opts.label.startswith("the backward")
        # "raise late": the call's last ring step that computes anything (a masked one may be hidden)
        last = max((i for i, w in enumerate(self.work) if w), default=-1)
        late = fault in ("raise late", "host exits")
        if (fault == "raise backward") != backward or (late and t != last):
            return original(self, t, work)
        seen.append(t)
        if len(seen) == 1:
            if fault.startswith("raise") or fault == "host exits":
                def failing(w):
                    raise RuntimeError("injected: the block kernel ran out of memory")
                return original(self, t, failing)
            if fault == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        return original(self, t, work)

    ring._Schedule.compute = compute
    return lambda: setattr(ring._Schedule, "compute", original)


def _raw(case: dict, sp, faulty: bool, clock: list):
    """A raw ring_attention forward + backward; checked against float64 when ``faulty`` is False.
    ``clock[0]``: set to the time of the first ringseq call (what a fault's time to an error counts from)."""
    import torch

    import ringseq
    from ringseq.reference import attention as reference
    from ringseq.testing import assert_shards_close
    from tests.dist.cases import make_qkv
    from tests.dist.cases_features import packed_positions, padding_mask

    dtype = torch.float32 if case["dtype"] == "fp32" else torch.bfloat16
    S, seed = case["s"] * sp.size, case["seed"]
    q, k, v, dout = make_qkv(2, 4, 2, S, 16, seed)
    pos = packed_positions(2, S, seed) if case["mask"] == "documents" else None
    pad = padding_mask(2, S, seed) if case["mask"] == "padding" else None
    window = max(2, S // 3) if case["mask"] == "window" else None
    local = [ringseq.shard(t.to(dtype), 2, sp=sp).requires_grad_(True) for t in (q, k, v)]
    mine = window + 1 if window is not None and faulty and case["fault"] == "other inputs" else window
    if faulty and case["fault"] == "other inputs" and window is None:
        mine = S  # a window that sees everything: the same result, another call
    if faulty and case["fault"] == "refuse" and _me() == case["victim"]:
        local[1] = local[1].detach().to("meta")  # refused by its own check, in the call's agreement
    clock[0] = time.perf_counter()
    out = ringseq.ring_attention(*local, sp=sp, window=mine if _me() == case["victim"] else window,
                                 position_ids=None if pos is None else ringseq.shard(pos, 1, sp=sp),
                                 attention_mask=None if pad is None else ringseq.shard(pad, 1, sp=sp))
    out.backward(ringseq.shard(dout.to(dtype), 2, sp=sp))
    if faulty:
        return
    kw = dict(causal=True, window=window, position_ids=pos, attention_mask=pad)
    ref = reference(q, k, v, dout, **kw)[:4]
    plain = reference(*(t.to(dtype) for t in (q, k, v, dout)), sdpa=True, **kw)[:4]
    for name, got, p, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), plain, ref):
        assert_shards_close(got, p, r, f"{name} of case {case}", sp=sp)


def _model(case: dict, sp, faulty: bool, clock: list):
    """A patched tiny Llama's training step; checked against the unpatched model when ``faulty`` is False. Under an
    engine (``ENGINE``: the tree's) the step runs the tree's one wrapped model, whose gradients the engine averages."""
    import copy

    import ringseq
    from ringseq.testing import assert_model_close
    from tests.integration.hf_models import check_against, make_batch

    kind = {"none": "plain", "documents": "packed", "padding": "padded", "window": "plain"}[case["mask"]]
    other = faulty and case["fault"] == "other inputs" and _me() == case["victim"]
    batch = make_batch(2, case["s"] * sp.size, kind, seed=case["seed"] + (1 if other else 0))
    base, refs = _references(case, sp)
    if ENGINE:  # the tree's model, wrapped once: the loop goes on with the same engine after a fault
        model, wrapper = ENGINE["model"], ENGINE["wrapper"]
        for p in model.parameters():
            p.grad = None
    else:
        model = wrapper = ringseq.patch(copy.deepcopy(base), sp=sp)
    clock[0] = time.perf_counter()
    refused = faulty and case["fault"] == "refuse" and _me() == case["victim"]
    loss = wrapper(**batch, **({"output_attentions": True} if refused else {})).loss
    loss.backward()
    if faulty:
        return
    grads = {n.replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters()}
    if not ENGINE:
        check_against(refs, loss.detach(), grads, sp, f"model case {case}")
        return
    grads = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in grads.items()}
    assert_model_close(loss.detach(), grads, *refs, f"model case {case} under {ENGINE['name']}")


ENGINE: dict = {}
"""This process's tree's engine: its name, the patched model and its wrapper (``wrap``)."""


def wrap(tree: dict, sp) -> None:
    """The tree's engine around one patched tiny Llama (the references' fp32 model: every case's is the same)."""
    import copy

    import ringseq
    from tests.integration.hf_models import tiny_model

    model = ringseq.patch(copy.deepcopy(tiny_model("llama")), sp=sp)
    if tree.get("compiled"):
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
    if tree["engine"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapper = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=sp.meshes["fsdp"])
        wrapper = fully_shard(model, mesh=sp.meshes["fsdp"])
    ENGINE.update(name=tree["engine"] + (" (compiled layers)" if tree.get("compiled") else ""), model=model,
                  wrapper=wrapper)


_MODELS: dict = {}


def _references(case: dict, sp):
    """The unpatched model and its references for a model case (made once, before the case's fault
    and its clock: a slow reference must not stand in for a healthy rank's wait)."""
    from tests.integration.hf_models import make_batch, references

    kind = {"none": "plain", "documents": "packed", "padding": "padded", "window": "plain"}[case["mask"]]
    key = (case["seed"], kind, case["s"] * sp.size)  # a case's next step (seed + 1) may meet a later case's seed
    if key not in _MODELS:
        _MODELS[key] = references("llama", make_batch(2, case["s"] * sp.size, kind, seed=case["seed"]))
    return _MODELS[key]


def run_case(case: dict, sp) -> dict:
    """This rank's outcome of one case: the faulty call, then (for a recoverable fault) the same
    call again without the fault."""
    import ringseq

    fault = case["fault"]
    run = _model if case["kind"] == "model" else _raw
    if case["kind"] == "model":
        _references(case, sp)
    disarm = _inject(case, sp)
    clock, outcome = [time.perf_counter()], {}
    try:
        run(case, sp, fault not in ("none", "sleep under"), clock)
        outcome = dict(outcome="finished")
    except ringseq.RingSeqError as exc:
        outcome = dict(outcome="RingSeqError", message=str(exc)[:1500])
    except AssertionError as exc:
        outcome = dict(outcome="wrong", message=str(exc)[:1500])
    except Exception as exc:  # noqa: BLE001 - recorded: a raw error on a healthy rank is a failure
        outcome = dict(outcome=type(exc).__name__, message=str(exc)[:1500])
    finally:
        disarm()
    outcome["seconds"] = round(time.perf_counter() - clock[0], 3)
    if fault == "host exits":  # rank 0, the store's host, ends the job on its error at once (no lingering)
        if _me() == 0:
            os._exit(1)
        try:  # the survivors' next call finds it gone: the victim, not rank 0, is still where it began
            run(dict(case, seed=case["seed"] + 1), sp, False, [0.0])
            outcome["after"] = "finished"
        except Exception as exc:  # noqa: BLE001 - judged: a RingSeqError naming the victim
            outcome["after"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
    if fault in RECOVERABLE and fault not in ("none", "sleep under"):
        # the loop's next step, with new data and no resync call, as a loop that skips a bad step goes on
        again = dict(case, seed=case["seed"] + 1)
        if case["kind"] == "model":
            _references(again, sp)
        try:
            run(again, sp, False, [0.0])
            outcome["again"] = "exact"
        except ringseq.RingSeqError as exc:
            outcome["again"] = f"RingSeqError: {str(exc)[:300]}"
        except AssertionError as exc:
            outcome["again"] = f"wrong: {str(exc)[:300]}"
    return outcome


def _rank(rank: int, world: int, port: int, tree: dict, results) -> None:
    """One rank of a tree; ``results`` is its end of a pipe (a send is written before it returns,
    so an outcome survives the rank's own death in a later case)."""
    import traceback

    from ringseq.processes import exit_now, join_gloo

    try:
        join_gloo(rank, world, port, threads=1)
        import ringseq

        sp = ringseq.init(sp_size=tree.get("sp", world), ulysses_size=tree.get("ulysses", 1),
                          timeout=tree.get("timeout", TIMEOUT))
        if tree.get("engine", "none") != "none":
            wrap(tree, sp)
        for case in tree["cases"]:
            results.send((rank, case["step"], run_case(case, sp)))
    except BaseException:  # noqa: BLE001 - the harness reports it
        results.send((rank, -1, dict(outcome="harness", message=traceback.format_exc()[-600:])))
    if tree.get("ending") == "hard":  # as a process killed or ended by os._exit: no exit handler at all
        os._exit(0)
    if tree.get("ending") == "user":  # as a user's script ends: the interpreter's exit handlers (ringseq's lingers)
        import atexit

        atexit._run_exitfuncs()
        os._exit(0)
    exit_now(0)  # as our launched test jobs leave: rank 0 stays while the survivors read its store


# ---------------------------------------------------------------------------------- the parent

def run_tree(tree: dict) -> dict:
    """Spawn the tree, collect each rank's outcomes (a dead or stopped rank gives none), end it."""
    from multiprocessing.connection import wait

    from ringseq.processes import free_port
    from ringseq.testing import process_context

    ctx = process_context()
    world, port = tree["world"], free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=_rank, args=(r, world, port, tree, pipes[r][1]), daemon=True) for r in range(world)]
    budget = 60 + sum(tree.get("timeout", TIMEOUT) + 8 for _ in tree["cases"])
    got, deadline = {}, time.time() + budget
    for p in procs:
        p.start()
    for _, writer in pipes:  # the children hold the writing ends: a dead rank's pipe reads as ended
        writer.close()
    expected = {(r, c["step"]) for r in range(world) for c in tree["cases"]}
    last = tree["cases"][-1]
    if last["fault"] in BREAKING:  # the victim of a breaking fault gives no outcome for it
        expected.discard((last["victim"], last["step"]))
    if last["fault"] == "host exits":  # nor the store's host that exits on its error
        expected.discard((0, last["step"]))
    readers = [reader for reader, _ in pipes]
    try:
        while readers and not expected <= set(got) and time.time() < deadline:
            for reader in wait(readers, timeout=1.0):
                try:
                    rank, step, outcome = reader.recv()
                except EOFError:  # the rank is gone
                    readers.remove(reader)
                    continue
                got[(rank, step)] = outcome
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    missing = sorted(expected - set(got))
    return dict(got=got, missing=missing)


def _ranks(text: str, pattern: str) -> set[int]:
    """Every rank number in the lists ``pattern``'s group matches ("global ranks 0, 1, 2 ...")."""
    return {int(x) for group in re.findall(pattern, text) for x in re.findall(r"\d+", group)}


def judge(tree: dict, ran: dict) -> list[dict]:
    """Each case of the tree: its verdict (ok or the failure) and its slowest time to an error."""
    verdicts = []
    world = tree["world"]
    for case in tree["cases"]:
        fault, victim, step = case["fault"], case["victim"], case["step"]
        problems, slowest = [], 0.0
        for r in range(world):
            outcome = ran["got"].get((r, step))
            if outcome is None:
                if not (fault in BREAKING and r == victim) and not (fault == "host exits" and r == 0):
                    problems.append(f"rank {r} gave no outcome (a hang or a crash)")
                continue
            if outcome["outcome"] == "harness":
                problems.append(f"rank {r}: {outcome['message']}")
                continue
            if fault in ("none", "sleep under"):
                if outcome["outcome"] != "finished":
                    problems.append(f"rank {r}: {outcome['outcome']}: {outcome.get('message', '')}")
                continue
            if r == victim:
                continue  # the faulty rank: its own error, whatever it is
            if outcome["outcome"] == "wrong":
                problems.append(f"rank {r}: silently wrong: {outcome['message']}")
            elif outcome["outcome"] != "RingSeqError":
                problems.append(f"rank {r}: {outcome['outcome']} instead of a RingSeqError: {outcome.get('message')}")
            else:
                slowest = max(slowest, outcome["seconds"])
                text = outcome["message"].lower()
                sp = tree.get("sp", world)  # a group's ranks are consecutive global ranks: group rank g of rank r's
                named = victim in _ranks(text, r"global ranks? ([\d, ]+)") | {
                    r // sp * sp + g for g in _ranks(text, r"group ranks? ([\d, ]+)")}
                # a tree whose processes end hard: rank 0 may take the store with it before a survivor far
                # from the victim has read a note; it must say so, and blame no one
                unknowable = tree.get("ending") == "hard" and "no note could be read to tell where" in text
                if not named and not unknowable:
                    problems.append(f"rank {r} did not name rank {victim}: {text}")
                blamed = _ranks(text, r"global ranks? ([\d, ]+) (?:failed|raised)")
                if fault in BREAKING and blamed - {victim}:  # a healthy neighbour that gave up after its own error
                    problems.append(f"rank {r} blamed healthy rank(s) {sorted(blamed - {victim})}: {text}")
                timeout = tree.get("timeout", TIMEOUT)
                bound = timeout + GRACE + SLACK if fault in BREAKING else timeout + SLACK
                if fault == "sleep past":  # a rank that began its wait later may pass it, then time out in the next
                    bound += SLEEP_PAST
                if outcome["seconds"] > bound:
                    problems.append(f"rank {r} raised after {outcome['seconds']} s (bound {bound} s)")
            if fault == "host exits":  # its next call: the victim named again, rank 0 only told of
                after = outcome.get("after", "")
                engine_first = tree.get("engine", "none") != "none" and after.startswith("RuntimeError") and \
                    "connection" in after.lower()  # the engine's collective before the patched forward met it first
                if engine_first:
                    pass
                elif not after.startswith("RingSeqError") or victim not in _ranks(after.lower(), r"global ranks? ([\d, ]+) raised"):
                    problems.append(f"rank {r}: the call after rank 0 exited did not name rank {victim}: {after}")
                elif _ranks(after.lower(), r"global ranks? ([\d, ]+) (?:failed|raised|never)") - {victim}:
                    problems.append(f"rank {r} blamed another rank than {victim} after rank 0 exited: {after}")
            if fault in RECOVERABLE and outcome.get("again") != "exact":
                problems.append(f"rank {r}: the call after the fault: {outcome.get('again')}")
        engine = tree.get("engine", "none") + (" compiled" if tree.get("compiled") else "")
        if tree.get("sp", world) < world:
            engine += " over replicas"
        verdicts.append(dict(tree=tree["index"], world=world, engine=engine, **case, ok=not problems,
                             problems=problems, slowest_error_s=slowest))
    return verdicts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write every case's verdict as JSON lines here")
    p.add_argument("--faults", default=",".join(RECOVERABLE + BREAKING),
                   help="the faults to draw from, comma-separated (default: all)")
    p.add_argument("--worlds", default="2,4", help="the world sizes to draw from")
    p.add_argument("--engines", default="none,none," + ",".join(ENGINES),
                   help="the engines to draw a tree's from, comma-separated, repeats weighing (default: half the "
                        "trees under DDP or FSDP2)")
    args = p.parse_args(argv)
    faults = tuple(f.strip() for f in args.faults.split(","))
    unknown = set(faults) - set(RECOVERABLE + BREAKING)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}: choose from {', '.join(RECOVERABLE + BREAKING)}")
    worlds = tuple(int(w) for w in args.worlds.split(","))
    engines = tuple(e.strip() for e in args.engines.split(","))
    if set(engines) - {"none", *ENGINES}:
        p.error(f"unknown engines {sorted(set(engines) - {'none', *ENGINES})}: choose from none, {', '.join(ENGINES)}")
    from tqdm import tqdm

    rng, verdicts, start = random.Random(args.seed), [], time.time()
    bar = tqdm(total=args.cases, desc="fault soak", unit="case")
    index = 0
    while len(verdicts) < args.cases and time.time() - start < 60 * args.minutes:
        tree = draw_tree(rng, index, faults, worlds, engines)
        index += 1
        got = judge(tree, run_tree(tree))
        verdicts += got
        bar.update(len(got))
        bar.set_postfix(failures=sum(not v["ok"] for v in verdicts))
    bar.close()
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(v) + "\n" for v in verdicts)
    by_fault = {}
    for v in verdicts:
        row = by_fault.setdefault(v["fault"], {"cases": 0, "failures": 0, "slowest_error_s": 0.0})
        row["cases"] += 1
        row["failures"] += not v["ok"]
        row["slowest_error_s"] = max(row["slowest_error_s"], v["slowest_error_s"])
    by_engine = {}
    for v in verdicts:
        row = by_engine.setdefault(v["engine"], {"cases": 0, "failures": 0})
        row["cases"] += 1
        row["failures"] += not v["ok"]
    failures = [dict(fault=v["fault"], kind=v["kind"], world=v["world"], engine=v["engine"], victim=v["victim"],
                     problems=v["problems"]) for v in verdicts if not v["ok"]]
    print(json.dumps({"cases": len(verdicts), "trees": index, "failures": len(failures), "seed": args.seed,
                      "timeout_s": TIMEOUT, "bound_s": TIMEOUT + GRACE + SLACK, "by_fault": by_fault,
                      "by_engine": by_engine,
                      "minutes": round((time.time() - start) / 60, 1), "failed": failures[:20]}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
