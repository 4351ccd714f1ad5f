"""``ringseq.plan``: memory, step time and the best ring x Ulysses shape for a cluster."""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import math

from ringseq.errors import RingSeqError
from ringseq.lengths import check_layout, multiple, padded_length

from . import cost, memory
from .features import Features
from .hardware import Hardware, hardware as get_hardware
from .model_spec import ModelSpec, model_spec



class _Fields:
    """Results read as attributes or, for JSON-minded callers, as ``obj["field"]``."""

    def __getitem__(self, key):
        return getattr(self, key)

    def to_dict(self) -> dict:
        """The fields as JSON takes them: an unbounded limit (``inf``) is None."""
        return {k: None if v == math.inf else v for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class ModeEstimate(_Fields):
    """One shape of the sequence group: ``ulysses`` ranks inside, a ring of ``ring`` across."""

    name: str
    ring: int
    ulysses: int
    step_time_s: float
    """Predicted time of one optimizer step (one forward without training)."""
    efficiency: float
    """Ideal time (the same FLOPs perfectly balanced, no transfers) / step_time_s."""
    exposed_comm_s: float
    """Transfer time per step that compute does not hide."""
    memory_per_rank_gb: float
    memory_gb: dict
    """Parts of memory_per_rank_gb: weights, grads, optimizer, activations, transient, kv_cache
    (GiB; kv_cache: a generation's cache after the prompt, with ``training=False``)."""
    ring_crosses_nodes: bool
    attention_s: float
    """Attention's share of step_time_s (all layers, forward and backward)."""
    recurrent_s: float = 0.0
    """A hybrid's recurrent layers' share of step_time_s (state passing: ``ringseq.recurrent``)."""
    recurrent: dict = dataclasses.field(default_factory=dict)
    """A hybrid's recurrent layers costed both ways at this shape's P: ``{"state": {...},
    "heads": {...}}``, each ``time_s`` (all recurrent layers, forward and backward),
    ``sent_gb_per_rank`` and ``possible`` (the head all-to-all needs P to divide the key heads)."""
    host_memory_per_node_gb: float = 0.0
    """Host memory the node's ranks fill (``memory.host_bytes``: offloaded kept tensors, optimizer state
    and weights), GiB."""

    def fits(self, hw: Hardware) -> bool:
        """Within the device's memory per rank and the host's per node."""
        return self.memory_per_rank_gb <= hw.memory_gb and self.host_memory_per_node_gb <= hw.host_memory_gb


@dataclasses.dataclass(frozen=True)
class Fix(_Fields):
    """A change of ``plan``'s inputs after which a shape fits in device memory."""

    changes: dict
    """``plan`` keywords and their new values, e.g. ``{"checkpointing": True}`` or ``{"gpus": 128}``."""
    mode: str
    """The fastest shape that fits with the change."""
    memory_per_rank_gb: float
    step_time_s: float


@dataclasses.dataclass(frozen=True)
class Recommendation(_Fields):
    """The fastest shape that fits; when none fits, the fastest one and what would make one fit."""

    mode: str
    ring: int
    ulysses: int
    reason: str
    """Why this shape, or that none fits and what would, with fixes named as ``plan`` keywords
    (``checkpointing=True``)."""
    cli_reason: str = ""
    """``reason`` with the fixes named as ``ringseq plan`` flags (``--checkpointing``), as that command prints it."""
    fixes: tuple = ()
    """When no shape fits: every memory switch that alone is enough (else the fewest together that
    are), fastest first, and the gpu count that is enough with the switches as asked (``Fix`` each)."""


@dataclasses.dataclass(frozen=True)
class Plan(_Fields):
    """What ``ringseq.plan`` predicts; times in seconds, memory in GiB per rank."""

    memory_per_rank_gb: float
    step_time_s: float
    modes: list
    recommendation: Recommendation
    min_tokens_per_rank_for_overlap: float
    """Ring block (tokens per rank of a pure ring) at which a step's compute hides its transfer;
    the balanced causal layouts need twice the full-block figure, since each step computes half a block."""
    tokens_per_rank: float
    sp_size: int
    hardware: str
    fits: bool
    host_memory_per_node_gb: float = 0.0
    """The recommended shape's host memory per node (offloaded state and activations), GiB."""
    host_limit_gb: float = float("inf")
    """Host memory per node the job may fill (the preset's, or ``host_memory_gb``), GiB."""
    seq_len: int = 0
    """The tokens per sequence planned (``longest``: the length it found)."""


def mode_name(R: int, U: int) -> str:
    return "ring" if U == 1 else "ulysses" if R == 1 else f"hybrid {U}x{R}"


def ulysses_sizes(m: ModelSpec, P: int) -> list[int]:
    """Ulysses sizes U dividing P that split the heads (H % U == 0, and K % U == 0 or U % K == 0)."""
    return [U for U in range(1, P + 1) if P % U == 0 and m.H % U == 0 and (m.K % U == 0 or U % m.K == 0)]


def estimate(m: ModelSpec, hw: Hardware, f: Features, *, S: int, R: int, U: int, G: int, per_node: int,
             layout: str, causal: bool = True) -> ModeEstimate:
    """Time and memory of one shape; S is padded to the multiple the layout needs."""
    S = padded_length(layout, int(math.ceil(S)), R, U)
    P = R * U
    s = S / P
    on_host = min(G, per_node)
    slowdown = 1.0
    if hw.cores and on_host >= hw.cores:  # ranks share the host's cores: time-sliced, and each core slower
        slowdown = on_host / hw.cores * hw.busy_slowdown
    crosses = R > 1 and P > per_node
    ring = cost.ring_layer(m, hw, S, R, U, layout=layout, causal=causal, training=f.training, inter=crosses,
                           slowdown=slowdown, batch=f.micro_batch, groups=f.groups(max(m.K / U, 1)))
    a2a = cost.ulysses_layer(m, hw, s, U, training=f.training, inter=U > per_node, batch=f.micro_batch)
    if f.replays_ring:  # the recompute runs the ring's forward (and its all-to-alls) once more
        again = cost.ring_layer(m, hw, S, R, U, layout=layout, causal=causal, training=False, inter=crosses,
                                slowdown=slowdown, batch=f.micro_batch, groups=f.groups(max(m.K / U, 1)))
        ring = cost.RingTime(ring.time_s + again.time_s, ring.exposed_s + again.exposed_s, ring.ideal_s + again.ideal_s)
        a2a += cost.ulysses_layer(m, hw, s, U, training=False, inter=U > per_node, batch=f.micro_batch)
    dense = cost.dense_layer(m, hw, s, f, slowdown)
    head = cost.head(m, hw, s, f, slowdown)
    collective, optimizer = cost.state_traffic(m, hw, f, G, inter=G > per_node)
    La = m.attention_layers
    ways = {}
    if m.recurrent is not None:
        for way in ("state", "heads"):
            t = cost.recurrent_layer(m, hw, S, P, way, training=f.training, inter=P > per_node, slowdown=slowdown,
                                     batch=f.micro_batch, runs=1 if layout == "contiguous" else 2)
            ways[way] = {"time_s": m.recurrent.layers * t.time_s, "exposed_s": m.recurrent.layers * t.exposed_s,
                         "ideal_s": m.recurrent.layers * t.ideal_s,
                         "sent_gb_per_rank": m.recurrent.layers * t.sent_bytes / 2**30, "possible": t.possible}
    rec = ways.get("state", {"time_s": 0.0, "exposed_s": 0.0, "ideal_s": 0.0})
    compute = La * (ring.time_s + a2a) + rec["time_s"] + m.L * dense + head + optimizer
    if f.training and f.checkpointing and f.offload_activations:  # out to the host and back, not overlapped
        compute += 2 * memory.offloaded_bytes(m, f, hw.bytes, int(s), int(S / R), U, R, host=hw.name == "cpu") / (
            hw.pcie_gbps * 1e9)
    step = max(compute, collective + optimizer)
    ideal = La * ring.ideal_s + rec["ideal_s"] + m.L * dense + head + optimizer
    exposed = La * (ring.exposed_s + a2a) + rec["exposed_s"] + max(0.0, collective + optimizer - compute)
    mem = memory.per_rank(m, f, hw.bytes, G, int(s), int(S / R), U, R, host=hw.name == "cpu")
    node = memory.host_bytes(m, f, hw.bytes, G, int(s), int(S / R), U, R, host=hw.name == "cpu") * min(G, per_node)
    return ModeEstimate(name=mode_name(R, U), ring=R, ulysses=U, step_time_s=step, efficiency=ideal / step,
                        exposed_comm_s=exposed, memory_per_rank_gb=mem["total"],
                        memory_gb={k: v for k, v in mem.items() if k != "total"}, ring_crosses_nodes=crosses,
                        attention_s=La * (ring.time_s + a2a), recurrent_s=rec["time_s"], recurrent=ways,
                        host_memory_per_node_gb=node / memory.GB)


def _check(seq_len, gpus, gpus_per_node, sp_size, layout):
    for name, value in (("seq_len", seq_len), ("gpus", gpus), ("gpus_per_node", gpus_per_node), ("sp_size", sp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RingSeqError(f"{name} must be a positive integer, got {value!r}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise RingSeqError(f"gpus {gpus} is not a whole number of nodes of gpus_per_node {gpus_per_node}: "
                           f"choose gpus = {gpus // gpus_per_node * gpus_per_node} or "
                           f"{(gpus // gpus_per_node + 1) * gpus_per_node}")
    if gpus % sp_size:
        raise RingSeqError(f"sp_size {sp_size} does not divide gpus {gpus}: gpus must be data x sequence "
                           f"(choose sp_size among {[d for d in range(1, gpus + 1) if gpus % d == 0]})")
    check_layout(layout)
    if seq_len < sp_size:
        raise RingSeqError(f"seq_len {seq_len} is shorter than sp_size {sp_size}: use fewer sequence ranks")


SWITCHES = {"checkpointing": True, "tiled_mlp": 4, "offload": True, "zero_stage": 3, "offload_activations": True}
"""The memory switches a fix may turn on, each with the value it proposes."""
MORE_GPUS = 10  # a fix may double the gpus (and the ranks per sequence) up to 2**10 times


def keywords(changes: dict) -> str:
    """A fix as ``plan`` keywords: ``checkpointing=True, tiled_mlp=4``."""
    return ", ".join(f"{k}={v!r}" for k, v in changes.items())


def flags(changes: dict) -> str:
    """A fix as ``ringseq plan`` flags: ``--checkpointing --tiled-mlp 4``."""
    return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in changes.items())


def _fixes(shapes, f: Features, hw: Hardware, *, S: int, G: int, P: int, per_node: int) -> tuple[Fix, ...]:
    """What makes a shape fit the device's memory (and the host's): the memory switches that are off,
    one at a time (else the fewest together), fastest first; then the fewest doublings of the gpus
    (and of the ranks per sequence) with the switches as asked. ``shapes(features, G, P)`` costs the
    shapes. Offloading kept tensors is a switch only under checkpointing (asked, or in the same fix)."""
    def fix(changes: dict, features: Features, gpus: int = G, sp: int = P) -> Fix | None:
        if features.offload_activations and not features.checkpointing:
            return None
        fitting = [e for e in shapes(features, gpus, sp) if e.fits(hw)]
        if not fitting:
            return None
        best = min(fitting, key=lambda e: e.step_time_s)
        return Fix(changes=changes, mode=best.name, memory_per_rank_gb=best.memory_per_rank_gb,
                   step_time_s=best.step_time_s)

    on = {"checkpointing": f.checkpointing, "tiled_mlp": f.tiled_mlp is not None, "offload": f.offload,
          "zero_stage": f.zero_stage == 3, "offload_activations": f.offload_activations}
    off = [k for k in SWITCHES if not on[k]]
    found: list[Fix] = []
    for n in range(1, len(off) + 1):
        tried = ({k: SWITCHES[k] for k in names} for names in itertools.combinations(off, n))
        found = sorted(filter(None, (fix(c, dataclasses.replace(f, **c)) for c in tried)), key=lambda x: x.step_time_s)
        if found:
            break
    for k in range(1, MORE_GPUS + 1):
        gpus, sp = G << k, P << k
        if sp > S:
            break
        if gpus <= per_node or gpus % per_node == 0:
            more = fix({"gpus": gpus, **({"sp_size": sp} if sp != gpus else {})}, f, gpus, sp)
            if more:
                found.append(more)
                break
    return tuple(found)


def _host(e: ModeEstimate, hw: Hardware) -> str:
    """The host memory a shape fills per node, when it fills any."""
    return (f", {e.host_memory_per_node_gb:.0f} GiB of host memory per node of {hw.host_memory_gb:g}"
            if e.host_memory_per_node_gb else "")


def _reason(best: ModeEstimate, others: list[ModeEstimate], asked: bool, hw: Hardware, fixes: tuple[Fix, ...],
            spell) -> str:
    """The recommendation in words, the fixes spelled by ``spell`` (``keywords`` or ``flags``)."""
    limit = hw.memory_gb
    shape = f"{best.name} (ulysses {best.ulysses} x ring {best.ring})"
    speed = (f"{best.step_time_s:.3g} s/step at {best.efficiency:.0%} efficiency, {best.exposed_comm_s:.3g} s of "
             "exposed communication")
    if best.fits(hw):
        why = "the ulysses_size asked for" if asked else "the fastest shape that fits"
        text = f"{shape}: {why}, {speed}, {best.memory_per_rank_gb:.1f} GiB per rank of {limit:g}{_host(best, hw)}"
        return text + (f"; next {others[0].name} at {others[0].step_time_s:.3g} s" if others else "")

    def said(x: Fix, verb: str) -> str:
        return (f"{spell(x.changes)} {verb} ({x.mode}: {x.memory_per_rank_gb:.1f} GiB per rank, "
                f"{x.step_time_s:.3g} s/step)")

    what = "the ulysses_size asked for does not fit" if asked else "no shape fits"
    where = f"{limit:g} GiB per rank" + (f" and {hw.host_memory_gb:g} GiB of host memory per node"
                                          if best.host_memory_per_node_gb > hw.host_memory_gb else "")
    text = (f"{what} in {where}: {'' if asked else 'the fastest, '}{shape}, needs "
            f"{best.memory_per_rank_gb:.1f} GiB{_host(best, hw)} ({speed})")
    switches = [x for x in fixes if "gpus" not in x.changes]
    more = [x for x in fixes if "gpus" in x.changes]
    if switches and len(switches[0].changes) == 1:
        text += "".join(f"; {said(x, 'alone is enough' if i == 0 else 'alone is enough too')}"
                        for i, x in enumerate(switches))
    elif switches:
        text += "; no single switch is enough" + "".join(f"; {said(x, 'together are enough')}" for x in switches[:3])
    if more:
        text += ("; or, with the switches as asked, " if switches else "; ") + said(more[0], "is enough")
    if not fixes:
        text += (f"; no switch, and no gpu count up to {2 ** MORE_GPUS}x this one, makes a shape fit: shorten the "
                 "sequence or use devices with more memory")
    return text


def _recommend(modes: list[ModeEstimate], hw: Hardware, chosen: int | None, fixes) -> tuple:
    """(best shape, Recommendation): the fastest shape that fits (of Ulysses size ``chosen``, when
    given); ``fixes()`` is asked what would make one fit only when none does."""
    fitting = [e for e in modes if e.fits(hw)]
    pool = [e for e in modes if e.ulysses == chosen] if chosen else (fitting or modes)
    best = min(pool, key=lambda e: e.step_time_s)
    others = sorted((e for e in modes if e is not best), key=lambda e: e.step_time_s)
    found = () if best.fits(hw) else fixes()
    asked = chosen is not None
    return best, Recommendation(mode=best.name, ring=best.ring, ulysses=best.ulysses,
                                reason=_reason(best, others, asked, hw, found, keywords),
                                cli_reason=_reason(best, others, asked, hw, found, flags), fixes=found)


def plan(*, model, seq_len: int, gpus: int, gpus_per_node: int = 8, hardware: str | Hardware = "h100",
         zero_stage: int = 3, training: bool = True, layout: str = "zigzag", sp_size: int | None = None,
         ulysses_size: int | None = None, checkpointing: bool = False, keep_ring_outputs: bool = True,
         tiled_mlp: int | None = None,
         chunked_loss: bool = True, offload: bool = False, optimizer: bool = True, micro_batch: int = 1,
         intra_gbps: float | None = None, inter_gbps: float | None = None, tflops: float | None = None,
         head_groups: int | str | None = None, offload_activations: bool = False, fsdp: bool = False,
         host_memory_gb: float | None = None) -> Plan:
    """Predict per-rank memory and step time of fine-tuning ``model`` (a transformers config, a
    dict of its fields or a path to config.json) on sequences of ``seq_len`` tokens over ``gpus``
    devices (``gpus_per_node`` per node), one sequence group of ``sp_size`` ranks (default: all)
    per sequence; every ring x Ulysses shape is costed and the fastest that fits recommended.
    When none fits, ``recommendation`` names the fastest, says that it does not fit and lists in
    ``fixes`` what would (the memory switches alone or together, more gpus).
    ``optimizer=False`` costs forward + backward alone (no Adam state, no gradient reduction).
    ``head_groups`` (``ringseq.patch``'s: None one ring for all heads, "kv" one per kv head, or n)
    costs the rings each attention call runs: less memory per ring, more launches and latencies.
    ``keep_ring_outputs=False`` (with ``checkpointing``, ``ringseq.patch``'s) costs the recompute
    that replays the ring: each layer keeps its input alone, and runs its ring forward once more.
    ``offload_activations=True`` (with ``checkpointing``) costs the kept tensors in host memory:
    off the device, copied out and back over the host link (``pcie_gbps``) each step. ``fsdp=True``
    (with ``zero_stage=3``) costs FSDP2's full sharding instead of DeepSpeed's ZeRO-3: what it
    gathers within the step (the root's parameters and gradients, a layer and the one prefetched).
    A shape fits when its rank's device memory fits the preset's ``memory_gb`` and what the node's
    ranks keep in host memory (``offload``, ``offload_activations``) fits ``host_memory_gb`` (default:
    the preset's, 80% of a node's)."""
    return _Planner(locals()).plan(seq_len)


def longest(*, up_to: int = 2**40, **keywords) -> Plan | None:
    """The plan of the longest sequence that fits: ``plan``'s keywords but ``seq_len``; the length is the
    largest multiple of the layout's grain (every shape's padding multiple), at most ``up_to``, at which a
    shape (of ``ulysses_size``, when given) fits the device's memory and the host's. None when not even one
    grain fits. Memory grows with the length, so a doubling search and bisection find it."""
    if "seq_len" in keywords:
        raise RingSeqError("longest finds seq_len: give plan's other keywords")
    if isinstance(up_to, bool) or not isinstance(up_to, int) or up_to < 1:
        raise RingSeqError(f"up_to must be a positive whole number of tokens, got {up_to!r}")
    planner = _Planner(dict(keywords, seq_len=None))
    g = planner.grain
    cap = up_to // g
    if cap < 1 or not planner.fits(g):
        return None
    lo, hi = 1, 2  # in grains: lo fits, hi is the first doubling that does not (or the cap)
    while hi <= cap and planner.fits(hi * g):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if planner.fits(mid * g) else (lo, mid)
    return planner.plan(lo * g)


class _Planner:
    """``plan``'s keywords checked once; ``plan(S)`` and ``fits(S)`` at any length."""

    def __init__(self, kw: dict):
        params = inspect.signature(plan).parameters
        unknown = set(kw) - set(params)
        missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in kw]
        if unknown or missing:
            raise TypeError(f"plan() got unexpected keywords {sorted(unknown)}" if unknown else
                            f"plan() needs the keywords {missing}")
        kw = {**{k: p.default for k, p in inspect.signature(plan).parameters.items()
                 if p.default is not inspect.Parameter.empty}, **kw}
        self.m = model_spec(kw["model"])
        self.gpus, self.per_node, self.layout = kw["gpus"], kw["gpus_per_node"], kw["layout"]
        self.sp_size = self.gpus if kw["sp_size"] is None else kw["sp_size"]
        _check(self.sp_size if kw["seq_len"] is None else kw["seq_len"], self.gpus, self.per_node, self.sp_size,
               self.layout)
        self.hw = get_hardware(kw["hardware"], intra_gbps=kw["intra_gbps"], inter_gbps=kw["inter_gbps"],
                               tflops=kw["tflops"], host_memory_gb=kw["host_memory_gb"])
        if kw["offload_activations"] and not (kw["checkpointing"] and kw["training"]):
            raise RingSeqError("offload_activations moves a training step's checkpointed tensors to host memory: "
                               + ("add checkpointing=True (--checkpointing)" if kw["training"] else
                                  "a forward alone (training=False, --inference) keeps none: drop it"))
        self.f = Features(training=kw["training"], zero_stage=kw["zero_stage"], optimizer=kw["optimizer"],
                          checkpointing=kw["checkpointing"], keep_ring_outputs=kw["keep_ring_outputs"],
                          tiled_mlp=kw["tiled_mlp"], chunked_loss=kw["chunked_loss"], offload=kw["offload"],
                          micro_batch=kw["micro_batch"], head_groups=kw["head_groups"],
                          offload_activations=kw["offload_activations"], fsdp=kw["fsdp"])
        self.sizes = ulysses_sizes(self.m, self.sp_size)
        self.chosen = kw["ulysses_size"]
        if self.chosen is not None and self.chosen not in self.sizes:
            raise RingSeqError(f"ulysses_size {self.chosen} cannot split this model over sp_size {self.sp_size} "
                               f"({self.m.H} query heads, {self.m.K} kv heads): choose one of {self.sizes}")
        self.grain = math.lcm(*(multiple(self.layout, self.sp_size // U, U) for U in self.sizes))

    def shapes(self, S: int, features: Features, G: int, P: int, sizes=None) -> list[ModeEstimate]:
        """Every shape of P ranks at S tokens (of the Ulysses size asked for, when ``sizes`` is None)."""
        sizes = sizes or ([self.chosen] if self.chosen else ulysses_sizes(self.m, P))
        return [estimate(self.m, self.hw, features, S=S, R=P // U, U=U, G=G, per_node=self.per_node,
                         layout=self.layout) for U in sizes]

    def fits(self, S: int) -> bool:
        return any(e.fits(self.hw) for e in self.shapes(S, self.f, self.gpus, self.sp_size))

    def plan(self, S: int) -> Plan:
        _check(S, self.gpus, self.per_node, self.sp_size, self.layout)
        m, hw, f = self.m, self.hw, self.f
        modes = self.shapes(S, f, self.gpus, self.sp_size, self.sizes)
        best, rec = _recommend(modes, hw, self.chosen,
                               lambda: _fixes(lambda feat, G, P: self.shapes(S, feat, G, P), f, hw, S=S,
                                              G=self.gpus, P=self.sp_size, per_node=self.per_node))
        share = cost.step_shares(2, self.layout, True)[1]
        crosses = self.sp_size > self.per_node
        overlap = cost.overlap_block(hw, m.H, m.K, m.D, share=share, inter=crosses, training=f.training)
        return Plan(memory_per_rank_gb=best.memory_per_rank_gb, step_time_s=best.step_time_s, modes=modes,
                    recommendation=rec, min_tokens_per_rank_for_overlap=overlap, tokens_per_rank=S / self.sp_size,
                    sp_size=self.sp_size, hardware=hw.name, fits=best.fits(hw),
                    host_memory_per_node_gb=best.host_memory_per_node_gb, host_limit_gb=hw.host_memory_gb,
                    seq_len=S)
