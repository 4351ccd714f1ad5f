"""Who stalled, who failed: notes in the process group's key-value store, read when a wait ends badly.

A rank whose ringseq call fails leaves a note (``post_failure``). A rank whose wait times out
leaves a note that it is waiting, then reads the others' notes for a short grace period
(``blame``): the ranks of the group that left neither note are the ones that stopped, froze or
died; a rank that left a failure note raised, and its error is quoted. Waiting ranks are
healthy (in a ring every rank waits for its predecessor, so naming the predecessor would often
name a rank that was itself waiting). Nothing is written while all is well.

The store is the one every launcher makes for the default process group (torchrun's, or
``init_process_group``'s). Without it (or when its host is gone) ``blame`` returns None and the
caller names what it can.
"""
from __future__ import annotations

import time

import torch.distributed as dist

GRACE = 5.0
"""Longest time ``blame`` reads notes (survivors of one stall time out within moments of each other)."""


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group or store: nothing to read
        return None


def _key(sp, what: str, rank: int) -> str:
    return f"ringseq/{'-'.join(map(str, sp.ranks))}/{what}/{rank}"


def post_failure(sp, text: str) -> None:
    """Note that this rank's ringseq call failed (read by peers whose waits then time out)."""
    store = _store()
    if store is None or sp.size == 1:
        return
    try:
        store.set(_key(sp, "failed", dist.get_rank()), f"{time.time():.3f}|{text[:300]}")
    except Exception:  # noqa: BLE001 - a note is a courtesy; the caller raises its own error anyway
        pass


def _read(store, key: str, since: float):
    try:
        if not store.check([key]):
            return None
        stamp, _, text = store.get(key).decode().partition("|")
    except Exception:  # noqa: BLE001
        return None
    return text if float(stamp) >= since else None


def blame(sp, what: str, since: float, grace: float | None = None) -> str | None:
    """After a wait timed out: which ranks of the group stalled or failed, in words, from the
    notes left since ``since`` (time.time() of the group's last agreement: a peer may have
    raised long before this rank began to wait); None when the store cannot tell."""
    store = _store()
    if store is None:
        return None
    me = dist.get_rank()
    try:
        store.set(_key(sp, "waiting", me), f"{time.time():.3f}|{what}")
    except Exception:  # noqa: BLE001
        return None
    grace = min(GRACE, max(0.5, 0.2 * sp.timeout)) if grace is None else grace
    deadline, failed, waiting = time.time() + grace, {}, set()
    since = since - 1.0  # clocks of one job's processes agree far better than a second
    others = [r for r in sp.ranks if r != me]
    while time.time() < deadline and len(failed) + len(waiting) < len(others):
        for r in others:
            if r in failed or r in waiting:
                continue
            note = _read(store, _key(sp, "failed", r), since)
            if note is not None:
                failed[r] = note
            elif _read(store, _key(sp, "waiting", r), since) is not None:
                waiting.add(r)
        time.sleep(0.05)
    silent = [r for r in others if r not in failed and r not in waiting]
    parts = [f"global rank {r} raised ({note})" for r, note in failed.items()]
    if silent:
        parts.append(f"global rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} never reached a "
                     f"ringseq wait: stopped, stuck in other work, far slower, or dead")
    if not parts:
        return None
    if waiting:
        parts.append(f"global rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, sorted(waiting)))} "
                     f"waited as this one did")
    return "; ".join(parts)
