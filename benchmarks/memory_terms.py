"""The tensors alive at a training step's peak, by what made them: where the step's memory goes.

For each system of ``benchmarks/longest.py`` (``kind:P[:features]``, its contenders) one process
tree runs a warm-up step, then one forward + backward under a ``TorchDispatchMode`` that records
every tensor storage an operator returns (bytes, shape, the autograd node running, when known)
and drops it when the storage is freed (the last tensor or view on it goes). At the moment the
recorded bytes peak it reports, on rank 0, the live storages grouped by (autograd node, operator,
shape), largest first, in MB. Storages that exist before the step (parameters, optimizer state,
DeepSpeed's flat buffers), and views of them, are not counted; gradients and buffers made during
it are. A view of a larger storage counts the storage once. Live bytes are not the resident set
(``longest.py`` measures that): an allocation whose pages are never touched (DeepSpeed allocates
its reduce bucket, 5e8 elements by default, at full size) counts here whole, so ``--skip-mb``
leaves out storages larger than that from the ranking (they are listed apart).

Evidence for where a configuration's peak is and which terms grow with N (run two N and compare),
not a figure of merit. Usage::

    python benchmarks/memory_terms.py --systems ringseq:2:loss,ckpt,tiled alst:2 --N 20480
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from contenders import KINDS, MODELS  # noqa: E402
from longest import parse_system  # noqa: E402

MB = 2**20


class LiveTensors(TorchDispatchMode):
    """Every storage an operator returns, until its tensor is freed; a copy of the live set at the peak."""

    def __init__(self):
        super().__init__()
        self.before = _storages_alive()
        """Storages alive before the step: an op's view of one (a weight's ``t()``) is not counted."""
        self.live: dict[int, tuple[str, str, tuple, int]] = {}
        self.total = self.peak = 0
        self.at_peak: dict = {}
        self.peak_op = ""

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.total -= entry[3]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n == 0 or key in self.live or key in self.before:
                continue
            self.live[key] = ("forward" if node is None else type(node).__name__, func.__name__, tuple(t.shape), n)
            self.total += n
            weakref.finalize(storage, self._free, key)  # the storage's life, not this tensor's (views, detach)
            if self.total > self.peak:
                self.peak, self.at_peak, self.peak_op = self.total, dict(self.live), func.__name__
        return out


def _storages_alive() -> set[int]:
    """The addresses of every tensor storage Python can reach now; each leaves the set when its
    storage is freed (so a new storage at a reused address is counted)."""
    alive: set[int] = set()
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        try:
            if obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            continue
        key = storage.data_ptr()
        if key and key not in alive:
            alive.add(key)
            weakref.finalize(storage, alive.discard, key)
    return alive


def _terms(kind: str, P: int, features: tuple, N: int, skip_mb: float, top: int) -> dict:
    system = KINDS[kind](P, features)
    system.forward_backward(min(N, 1024))  # warm-up: buffers allocated on the first step
    system.optimizer_step()
    track = LiveTensors()
    with track:
        system.forward_backward(N)
    groups = collections.Counter()
    apart = []
    for node, op, shape, n in track.at_peak.values():
        if n > skip_mb * MB:
            apart.append(dict(node=node, op=op, shape=list(shape), mb=round(n / MB, 1)))
        else:
            groups[(node, op, shape)] += n
    counted = sum(groups.values())
    return dict(kind="terms", system=f"{kind}:{P}:{','.join(features)}", P=P, N=N, peak_op=track.peak_op,
                live_mb=round(counted / MB, 1), apart=apart,
                terms=[dict(node=node, op=op, shape=list(shape), mb=round(n / MB, 1))
                       for (node, op, shape), n in groups.most_common(top)])


def terms(text: str, N: int, skip_mb: float, top: int) -> dict:
    kind, P, features = parse_system(text)
    return common.run_tree(_terms, P, 1, kind, P, features, N, skip_mb, top)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=["ringseq:2:loss,ckpt,tiled", "alst:2"])
    parser.add_argument("--N", type=int, nargs="+", default=[8192])
    parser.add_argument("--skip-mb", type=float, default=1024.0, help="list storages larger than this apart")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--model", choices=sorted(MODELS), default="bench", help="longest.py's models")
    parser.add_argument("--out", default=None, help="a folder: also append the lines to memory_terms.jsonl there")
    args = parser.parse_args(argv)
    os.environ["RINGSEQ_LONGEST_MODEL"] = args.model  # the process trees read it when they import contenders.py
    path = None if args.out is None else os.path.join(args.out, "memory_terms.jsonl")
    for N in args.N:
        for text in args.systems:
            common.emit(terms(text, N, args.skip_mb, args.top), path)


if __name__ == "__main__":
    main()
