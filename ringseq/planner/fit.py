"""Fit: the memory switches that fit a training step in a budget at the least predicted time.

``ringseq.patch(model, sp=sp, fit=True)`` asks ``choose`` before each new length (and batch
shape): every set of switches (``candidates``) is costed by the planner (``predict.estimate``),
and the fastest whose predicted *step memory* fits the budget less ``HEADROOM`` (the planner's
measured error) wins, a tie going to the one that needs less. Step memory is what a forward + backward adds to what a rank holds between steps
(the gradients, activations and workspace at the step's peak; not the weights or optimizer
state): what ``benchmarks/longest.py`` measures and bounds. Lengths are planned by bucket
(``bucket``: a geometric grid, ``STEPS`` per doubling), at the bucket's top, so a run of mixed
lengths re-plans only when a length leaves the buckets it has seen; the planner's memory grows
with the length, so the top's choice fits every length below it. Pure Python, like the planner.
"""
from __future__ import annotations

import dataclasses
import math

from ringseq.errors import RingSeqError
from ringseq.lengths import multiple

from .features import Features
from .hardware import Hardware
from .model_spec import ModelSpec
from .predict import estimate, ulysses_sizes

GB = 2**30
MB = 2**20
STEPS = 8
"""Buckets per doubling of the length: a bucket's top is at most 2**(1/8) = 9% above its lengths."""
HEADROOM = 0.04
"""Of the budget, kept free beside the predicted step: the planner's largest under-prediction of a step's memory
measured on the benchmark model (3.9%, docs/planner.md), where every step fit then accepted measured within the
budget (docs/memory.md, "Fit within its budget")."""


def plannable(budget: float) -> float:
    """The bytes a predicted step may take of ``budget``: the budget less ``HEADROOM``."""
    return budget * (1 - HEADROOM)


def budget_for(need: float) -> int:
    """The smallest budget whose plannable part holds a predicted step of ``need`` bytes."""
    return int(math.ceil(need / (1 - HEADROOM)))


@dataclasses.dataclass(frozen=True)
class Switches:
    """One set of ``ringseq.patch``'s memory switches, as fit applies it."""

    chunked_loss: bool = True
    checkpointing: bool = False
    """Gradient checkpointing of every decoder layer."""
    keep_ring_outputs: bool = True
    """Under checkpointing: keep ring outputs (False: the recompute replays the ring)."""
    tiled_mlp: bool = False
    """MLPs in tiles of hidden_size tokens (``patch(tiled_mlp=True)``)."""
    head_groups: str | None = None
    """None: one ring for all heads; "kv": one ring per kv head."""
    offload_activations: bool = False
    """Under checkpointing: the kept tensors in host memory (GPU only)."""

    def describe(self) -> str:
        parts = ["chunked loss" if self.chunked_loss else "full logits"]
        if self.checkpointing:
            parts.append("checkpointing that " + ("keeps ring outputs" if self.keep_ring_outputs else
                                                  "replays the ring"))
            if self.offload_activations:
                parts.append("kept tensors offloaded to the host")
        else:
            parts.append("no checkpointing")
        if self.tiled_mlp:
            parts.append("tiled MLP")
        if self.head_groups:
            parts.append("one ring per kv head")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    """Where the steps run: the model, the device, DeepSpeed's ZeRO stage and the group's shape."""

    spec: ModelSpec
    hw: Hardware
    zero_stage: int = 0
    fsdp: bool = False
    """FSDP2's full sharding (``Features.fsdp``) rather than DeepSpeed's."""
    ring: int = 1
    ulysses: int = 1
    gpus: int = 1
    """Ranks ZeRO shards over (the world)."""
    per_node: int = 1
    layout: str = "zigzag"
    may_tile: bool = True
    """Whether the model's MLPs can be tiled (dense MLPs)."""
    may_offload: bool = False
    """Whether kept tensors can go to host memory (a GPU: on a CPU the host is the device)."""

    @property
    def sp_size(self) -> int:
        return self.ring * self.ulysses

    def features(self, sw: Switches, S: int, B: int) -> Features:
        tiles = max(1, math.ceil(S / self.sp_size / self.spec.d)) if sw.tiled_mlp else 1
        return Features(training=True, zero_stage=self.zero_stage, fsdp=self.fsdp, optimizer=True,
                        checkpointing=sw.checkpointing,
                        keep_ring_outputs=sw.keep_ring_outputs, tiled_mlp=tiles if tiles > 1 else None,
                        chunked_loss=sw.chunked_loss, micro_batch=B, head_groups=sw.head_groups,
                        offload_activations=sw.offload_activations)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A set of switches costed at one length and batch."""

    switches: Switches
    S: int
    B: int
    predicted_peak_bytes: int
    """Predicted step memory: what the step adds to what is held between steps."""
    predicted_step_s: float
    host_fits: bool = True
    """What the node's ranks keep in host memory (offloaded kept tensors) fits the preset's host memory."""


def candidates(setting: Setting) -> list[Switches]:
    """Every set of switches that makes a difference for this model and group."""
    groups = [None]
    if setting.ring > 1 and max(setting.spec.K // setting.ulysses, 1) > 1:
        groups.append("kv")
    found = []
    for loss in (True, False):
        for ckpt, keep in ((False, True), (True, True), (True, False)):
            for tiled in (False, True) if setting.may_tile else (False,):
                for hg in groups:
                    for off in (False, True) if ckpt and setting.may_offload else (False,):
                        found.append(Switches(chunked_loss=loss, checkpointing=ckpt, keep_ring_outputs=keep,
                                              tiled_mlp=tiled, head_groups=hg, offload_activations=off))
    return found


def cost(setting: Setting, sw: Switches, S: int, B: int) -> Choice:
    f = setting.features(sw, S, B)
    e = estimate(setting.spec, setting.hw, f, S=S, R=setting.ring, U=setting.ulysses, G=setting.gpus,
                 per_node=setting.per_node, layout=setting.layout)
    step = sum(e.memory_gb[k] for k in ("grads", "activations", "transient")) * GB
    return Choice(switches=sw, S=S, B=B, predicted_peak_bytes=int(math.ceil(step)), predicted_step_s=e.step_time_s,
                  host_fits=e.host_memory_per_node_gb <= setting.hw.host_memory_gb)


def costed(setting: Setting, S: int, B: int) -> list[Choice]:
    return [cost(setting, sw, S, B) for sw in candidates(setting)]


def choose(setting: Setting, S: int, B: int, budget: float) -> Choice | None:
    """The fastest set whose predicted step fits ``budget`` bytes less the headroom and whose offloaded tensors fit
    the host (ties: the smaller), or None."""
    fitting = [c for c in costed(setting, S, B) if c.predicted_peak_bytes <= plannable(budget) and c.host_fits]
    return min(fitting, key=lambda c: (c.predicted_step_s, c.predicted_peak_bytes)) if fitting else None


def least(setting: Setting, S: int, B: int) -> Choice:
    """The set that needs the least memory of those whose offloaded tensors fit the host (ties: the faster)."""
    return min((c for c in costed(setting, S, B) if c.host_fits),
               key=lambda c: (c.predicted_peak_bytes, c.predicted_step_s))


def bucket(S: int, grain: int = 1) -> int:
    """The top of S's bucket: the smallest point of the grid ceil(2**(k / STEPS)), rounded up to
    ``grain``, that is >= S."""
    def top(k: int) -> int:
        return -(-math.ceil(2 ** (k / STEPS)) // grain) * grain

    k = max(0, math.floor(STEPS * math.log2(max(S, 1))) - 1)
    while top(k) < S:
        k += 1
    return top(k)


def grain(setting: Setting) -> int:
    """The lengths the layout splits: multiples of this."""
    return multiple(setting.layout, setting.ring, setting.ulysses)


def longest(setting: Setting, B: int, budget: float, below: int) -> int:
    """The longest length on the layout's grid, at most ``below``, that some set fits in ``budget`` less the
    headroom (0: none)."""
    g, room = grain(setting), plannable(budget)
    lo, hi = 0, below // g  # in grains: lo fits (or is 0), everything above hi is not asked
    if hi and least(setting, hi * g, B).predicted_peak_bytes <= room:
        return hi * g
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if least(setting, mid * g, B).predicted_peak_bytes <= room:
            lo = mid
        else:
            hi = mid
    return lo * g


def refusal(setting: Setting, S: int, B: int, budget: float) -> str:
    """Why no set fits S tokens x B rows, the longest length that would, and what would fit S."""
    need = least(setting, S, B)
    fits = longest(setting, B, budget, S)
    text = (f"fit: no set of memory switches fits a step of {B} x {S} tokens in the budget of "
            f"{budget / MB:.0f} MiB per rank (sp_size {setting.sp_size}; {HEADROOM:.0%} of it kept free for the "
            f"planner's error): the least any set needs is {need.predicted_peak_bytes / MB:.0f} MiB "
            f"({need.switches.describe()}). The longest length that fits is {fits} tokens"
            + ("" if B == 1 else f" at {B} rows") + ". To train this length: ")
    ways = [f"a memory_budget of at least {budget_for(need.predicted_peak_bytes) / MB:.0f} MiB"]
    more = dataclasses.replace(setting, ring=setting.ring * 2, gpus=setting.gpus * 2)
    for n in range(1, 5):  # the fewest doublings of the sequence group that fit
        wider = least(more, S, B)
        if wider.predicted_peak_bytes <= plannable(budget):
            ways.append(f"sp_size {more.sp_size} ({wider.predicted_peak_bytes / MB:.0f} MiB predicted)")
            break
        more = dataclasses.replace(more, ring=more.ring * 2, gpus=more.gpus * 2)
    if setting.ulysses == 1:
        for U in ulysses_sizes(setting.spec, setting.sp_size)[1:]:
            got = least(dataclasses.replace(setting, ring=setting.sp_size // U, ulysses=U), S, B)
            if got.predicted_peak_bytes <= plannable(budget):
                ways.append(f"ulysses_size {U} ({got.predicted_peak_bytes / MB:.0f} MiB predicted)")
                break
    ways.append("shorter sequences" + ("" if B == 1 else " or fewer rows per batch"))
    return text + "; or ".join(ways)


def report(choice: Choice, budget: float, bucket_top: int, replans: int, planning_s: float) -> dict:
    """What ``ringseq.stats(sp=sp)["fit"]`` shows of the last choice."""
    return {"switches": dataclasses.asdict(choice.switches), "described": choice.switches.describe(),
            "length": choice.S, "batch": choice.B, "bucket": bucket_top,
            "predicted_peak_bytes": choice.predicted_peak_bytes, "budget_bytes": int(budget),
            "plannable_bytes": int(plannable(budget)),
            "measured_peak_bytes": None, "predicted_step_s": choice.predicted_step_s,
            "replans": replans, "planning_s": planning_s}


reports: dict[tuple, dict] = {}
"""The last fit report of each sequence group (by its global ranks), read by ``ringseq.stats``."""

peaks: dict[tuple, tuple] = {}
"""On a GPU, each group's (device, bytes allocated) at its last fitted forward's start: ``ringseq.stats``
measures the step's peak since then."""
