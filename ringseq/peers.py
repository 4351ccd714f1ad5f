"""Who stalled, who failed: notes in the rendezvous store, read when a wait or transfer ends badly.

A rank whose ringseq call fails leaves a note (``post_failure``): its error, and when the error
was a peer's (a transfer whose peer closed, a flagged block) the rank it blames. A rank whose wait
times out leaves a note that it is waiting, then reads the others' notes for a short grace period
(``blame``): the ranks of the group that left neither note are the ones that stopped, froze or
died; a rank that left a failure note raised, and its error is quoted. A rank whose transfer
failed because its peer closed the connection reads that peer's note (``explain``): a peer that
raised because of another rank is followed to that rank, so every survivor names the rank where
the failure began, not a healthy neighbour that gave up after its own error. Waiting ranks are
healthy (in a ring every rank waits for its predecessor). Nothing is written while all is well,
but a note that a collective's wait has lasted long (``post_waiting``).

The notes live in the store every launcher makes for the default process group (torchrun's
agent's, or ``init_process_group``'s, hosted by global rank 0). Every read and write here is
bounded: a client of that store's server of its own, whose calls give up after a short timeout
(``_store``), so a frozen rank 0 that hosts the store delays no survivor beyond the grace; a store
that is not a TCP store is called on a thread given up at the deadline. Without a store (or when
its host is gone or frozen) the caller names what it can.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import queue
import signal
import sys
import threading
import time

import torch.distributed as dist

GRACE = 5.0
"""Longest time ``blame`` reads notes (survivors of one stall time out within moments of each other)."""

_clients: dict = {}


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group or store: nothing to read
        return None


def _store(timeout: float):
    """The process group's store, every call of which returns within ``timeout`` seconds (or
    raises), whatever its host is doing; None without one. A TCP store gets a client of its own
    (so a call left hanging holds no lock of the process group's); its calls, and making it, run on
    a worker thread given up at the deadline: c10d's client bounds neither its handshake nor its
    reconnection against a server that is stopped rather than gone (measured: both hang)."""
    base = _default_store()
    if base is None:
        return None
    inner = base
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        key = (inner.host, inner.port)
        if key not in _clients:
            host, port = key
            _clients[key] = _Bounded(lambda: dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                                           timeout=datetime.timedelta(seconds=60)))
        bounded = _clients[key]
    else:
        bounded = _clients.setdefault(id(base), _Bounded(lambda: base))
    return bounded.within(timeout)


class _Call:
    """One store call waiting its turn on a ``_Bounded``'s worker."""

    def __init__(self, name: str | None, args: tuple):
        self.name, self.args, self.done = name, args, threading.Event()
        self.value = self.error = None
        self.dropped = False


class _Bounded:
    """A store made and called on one daemon thread, one call after another in the order they were
    made; each caller waits for its own call at most its deadline (on a loaded machine a store can
    outlast a short one; a stopped host never answers). A write given up at its deadline keeps its
    place and is made when the store answers, so a rank's notes land in the order it wrote them (a
    'waiting' note, then its clearing, then its failure note: a slow store loses none and leaves no
    stale one); a read given up is dropped. A store that does not answer costs each caller its
    deadline, and no threads pile up."""

    def __init__(self, make):
        self.make, self.store, self.timeout = make, None, 1.0
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.worker, self.pid, self.lock = None, None, threading.Lock()

    def _serve(self) -> None:
        while True:
            call = self.calls.get()
            if call.dropped:
                continue
            try:
                if self.store is None:
                    self.store = self.make()
                if call.name is not None:
                    call.value = getattr(self.store, call.name)(*call.args)
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller's thread
                call.error = exc
            call.done.set()

    def _queue(self, name: str | None, *args) -> _Call:
        call = _Call(name, args)
        with self.lock:
            if self.worker is None or self.pid != os.getpid():  # a forked child has no thread of its parent's
                self.calls, self.pid = queue.SimpleQueue(), os.getpid()
                self.worker = threading.Thread(target=self._serve, daemon=True, name="ringseq-store")
                self.worker.start()
            self.calls.put(call)
        return call

    def prepare(self) -> None:
        """Make the store now (a failure is left for the first call to meet)."""
        self._queue(None)

    def within(self, timeout: float) -> "_Bounded":
        self.timeout = max(0.05, timeout)
        return self

    def _call(self, name: str, *args):
        call = self._queue(name, *args)
        if not call.done.wait(self.timeout):
            call.dropped = name != "set"  # a read is of no use late; a write keeps its place
            raise TimeoutError(f"the store did not answer {name} within {self.timeout:g} s")
        if call.error is not None:
            raise call.error
        return call.value

    def post(self, key: str, value: str, timeout: float) -> bool:
        """Write ``key`` and wait at most ``timeout`` seconds (0: not at all) for the store to take it;
        whether it did. A write not taken in time is still made when the store answers."""
        call = self._queue("set", key, value)
        return call.done.wait(timeout) and call.error is None

    def flush(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the writes queued so far (at exit: a failure's note
        queued while the store was slow)."""
        self._queue(None).done.wait(timeout)

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def check(self, keys):
        return self._call("check", keys)


def connect(sp) -> None:
    """Make this rank's store client now, on its worker (``ringseq.init``): at a failure every
    survivor reads at once, and a client made then may not connect within the grace."""
    if shared(sp):
        bounded = _store(_timeout(sp))
        if bounded is not None:
            bounded.prepare()


_silent_until = 0.0

composing: str | None = None
"""The error this rank is composing after a transport failure while it reads the notes (what it
waited for, and the rank the notes point at so far): said at once if torchrun's agent stops the
process meanwhile (``reporting``)."""


@contextlib.contextmanager
def reporting(text: str):
    """While this rank reads the notes to explain ``text`` (a transfer whose peer's connection
    closed): under torchrun, whose agent stops every worker with SIGTERM within its monitor
    interval (0.1 s) of one worker's death, a SIGTERM first writes the error as far as it is
    known to stderr, then ends the process as it would have. Only here: elsewhere SIGTERM is left
    as it was (a handler would wait for a blocking wait to return before it ran)."""
    global composing
    composing = text
    previous, installed = None, False
    if "TORCHELASTIC_RUN_ID" in os.environ and threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        installed = previous is not None  # None: a handler set outside Python, left alone

        def on_sigterm(signum, frame):
            rank = dist.get_rank() if dist.is_initialized() else "?"
            sys.stderr.write(f"ringseq: RingSeqError on global rank {rank} (torchrun stopped this process while it "
                             f"read the other ranks' notes): {composing}\n")
            sys.stderr.flush()
            if callable(previous):
                previous(signum, frame)
                return
            signal.signal(signal.SIGTERM, previous)
            os.kill(os.getpid(), signal.SIGTERM)

        if installed:
            signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        composing = None
        if installed:
            signal.signal(signal.SIGTERM, previous)


def _found_silent(sp) -> None:
    """The store did not answer: notes are not written for a while (each would wait its grace)."""
    global _silent_until
    _silent_until = time.time() + 2 * _timeout(sp)


_linger_until = 0.0
LINGER_S = 10.0
"""The longest a store's host stays at exit for the survivors of a failure (with a long timeout)."""


def _incident(sp, breaking: bool) -> None:
    """A failure on ``sp``'s group: the store's host keeps serving the notes a while at exit. A
    failure every rank meets in the same call is read within a second (``raised_since``); one that
    breaks the group may reach a rank only at its timeout (then it reads within its grace)."""
    global _linger_until
    stay = min(sp.timeout, LINGER_S) + 2 * _timeout(sp) + 0.5 if breaking else 1.5
    _linger_until = max(_linger_until, time.time() + stay)


def linger() -> None:
    """At exit (``ringseq.processes``' exit handler and ``exit_now``): a process that serves the
    rendezvous store (global rank 0 without torchrun's agent) stays, after a failure it saw,
    until the survivors that learn of it last (by their timeout, at most ``LINGER_S``) have read
    the notes, instead of taking the store with it."""
    if _linger_until:  # a note queued while the store was slow is written before this process goes
        for bounded in list(_clients.values()):
            bounded.flush(1.0)
    serving = dist.is_initialized() and _store_host() == dist.get_rank()
    if serving and time.time() < _linger_until:
        time.sleep(_linger_until - time.time())


def shared(sp) -> bool:
    """Whether ``sp``'s ranks are processes that share a store (not one process, not the virtual
    ring's stand-in ranks, which live in one process and have no timeout of their own)."""
    return sp.size > 1 and getattr(sp, "timeout", None) is not None and _default_store() is not None


def _key(sp, what: str, rank: int) -> str:
    return f"ringseq/{'-'.join(map(str, sp.ranks))}/{what}/{rank}"


def _timeout(sp) -> float:
    return min(GRACE, max(0.5, 0.2 * sp.timeout))


def signal_after(sp) -> float:
    """How long a ringseq wait lasts before it says so in the store (``post_waiting``): half the
    grace its peers read notes for, so a healthy rank still inside a collective that began within
    the grace of a peer's timeout is seen waiting, not named as the one that stopped."""
    return 0.5 * _timeout(sp)


def post_waiting(sp, what: str, waiting: bool = True) -> None:
    """Say in the store that this rank is inside a ringseq wait that has lasted ``signal_after``
    (``waiting``), or that it has left it (the note then reads as older than any incident). Only
    long waits write: nothing is written while all is well."""
    if shared(sp):
        _post(sp, "waiting", f"{time.time() if waiting else 0.0:.3f}|{what}")


def _post(sp, what: str, note: str) -> None:
    """Write this rank's ``what`` note, waiting for the store within the grace; right after the store
    failed to answer, not waiting at all (a wait would cost a grace for nothing). Either way the note
    is queued in order after this rank's earlier ones and made when the store answers (``_Bounded``):
    a note is a courtesy, and a store that does not answer is found by its readers."""
    store = _store(_timeout(sp))
    if store is None:
        return
    silent = time.time() < _silent_until
    if not store.post(_key(sp, what, dist.get_rank()), note, 0.0 if silent else _timeout(sp)) and not silent:
        _found_silent(sp)


NOTE_CHARS = 4000
"""The longest error a note quotes (every ringseq message is shorter: a relayed error quotes its origin whole,
its fix included)."""

AFTERMATH = -1
"""The ``cause`` of a note whose error followed another rank's failure that no note named (a
group found out of step after failures): the note is quoted, its rank is not blamed."""


def post_failure(sp, text: str, cause: int | None = None, breaking: bool = False, stalled: bool = False) -> None:
    """Note that this rank's ringseq call failed (read by peers whose waits then end badly);
    ``cause``: the global rank this rank's error blames (the failure began there), or
    ``AFTERMATH``; ``breaking``: the failure ended the group's transfers (how long the store's
    host stays at exit, ``linger``); ``stalled``: this rank timed out waiting for ``cause`` (a
    verdict, not a provisional blame after a closed connection)."""
    if not shared(sp):
        return
    _incident(sp, breaking)
    if cause == dist.get_rank():  # a failure that began here (the group named this rank): its own, not a link
        cause = None  # a note blaming itself would be a chain with no root: its readers would wait their grace out
    mark = "!" if stalled and cause is not None else ""
    _post(sp, "failed", f"{time.time():.3f}|{mark}{'' if cause is None else cause}|{text[:NOTE_CHARS]}")


class _Notes:
    """The notes of one incident, read within one deadline: a store that stops answering ends
    the reading (what was read so far stands)."""

    def __init__(self, sp, since: float, deadline: float):
        self.sp, self.since, self.deadline = sp, since, deadline  # notes older than the last agreement: another incident
        self.store = _store(max(0.05, deadline - time.time()))
        self.failed: dict[int, tuple[int | None, str]] = {}
        self.waiting: set[int] = set()
        self.stalled: set[int] = set()
        """Ranks whose note blames a rank they timed out waiting for (not a closed connection's guess)."""
        self.lost = self.store is None
        """The store stopped answering (or never did): its host is stopped, stuck or gone."""
        self.gone = False
        """The store's connection failed outright (not a call left unanswered): its host has exited."""

    def _read(self, key: str):
        if self.store is None or time.time() >= self.deadline:
            return None
        try:
            if not self.store.check([key]):
                return None
            stamp, _, rest = self.store.get(key).decode().partition("|")
        except Exception as exc:  # noqa: BLE001 - a store that does not answer: stop reading
            self.store, self.lost, self.gone = None, True, not isinstance(exc, TimeoutError)
            _found_silent(self.sp)
            return None
        return rest if float(stamp) >= self.since else None

    def read(self, rank: int) -> None:
        """Read ``rank``'s notes: a waiting rank is read again (it leaves its failure note after
        its own grace)."""
        if rank in self.failed:
            return
        note = self._read(_key(self.sp, "failed", rank))
        if note is not None:
            cause, _, text = note.partition("|")
            if cause.startswith("!"):
                cause = cause[1:]
                self.stalled.add(rank)
            self.failed[rank] = (int(cause) if cause else None, text)
            self.waiting.discard(rank)
        elif rank not in self.waiting and self._read(_key(self.sp, "waiting", rank)) is not None:
            self.waiting.add(rank)

    def root(self, rank: int) -> int:
        """Follow the ranks that blamed another to where the failure began."""
        seen = set()
        while rank in self.failed and self.failed[rank][0] is not None and rank not in seen:
            seen.add(rank)
            rank = self.failed[rank][0]
        return rank

    def roots(self) -> set[int]:
        """The ranks where the failures noted so far began (an aftermath note names none)."""
        return {self.root(r) for r in self.failed} - {AFTERMATH}

    def timed_out_on(self, me: int) -> bool:
        """Whether a peer's note says it timed out waiting for ``me``."""
        return any(r in self.stalled and self.failed[r][0] == me for r in self.failed)

    def gave_up_on(self, me: int) -> str:
        """Words for a rank whose peers' notes blame it (it was stopped, stuck or far slower, and
        has just come back to find them gone): what they said, not a healthy peer's name."""
        blamers = sorted(r for r in self.failed if r in self.stalled and self.failed[r][0] == me)
        said = self.failed[blamers[0]][1] if blamers else ""
        return (f"the other ranks gave up on this rank (global rank {me}): global rank"
                f"{'s' if len(blamers) > 1 else ''} {', '.join(map(str, blamers))} timed out waiting for it, so this "
                f"process was stopped, stuck in other work or far slower than they are ({said[:300]})")

    def words(self, rank: int) -> str:
        if rank in self.failed and self.failed[rank][0] is None:
            return f"global rank {rank} raised ({self.failed[rank][1]})"
        return None


def blame(sp, what: str, since: float, grace: float | None = None) -> tuple[int | None, str | None]:
    """After a wait timed out: which ranks of the group stalled or failed, from the notes left
    since ``since`` (time.time() of the group's last agreement: a peer may have raised long
    before this rank began to wait): the first of them and all of them in words; (None, None)
    when the store cannot tell."""
    grace = _timeout(sp) if grace is None else grace
    deadline = time.time() + grace
    if _default_store() is None:
        return None, None
    _incident(sp, breaking=True)
    notes = _Notes(sp, since, deadline)
    if notes.store is None:  # no connection to the store within the grace
        return _store_lost(sp, since, grace, gone=False)
    me = dist.get_rank()
    try:
        notes.store.set(_key(sp, "waiting", me), f"{time.time():.3f}|{what}")
    except Exception as exc:  # noqa: BLE001 - the store does not answer: its host is the one stopped or gone
        _found_silent(sp)
        return _store_lost(sp, since, grace, gone=not isinstance(exc, TimeoutError))
    others = [r for r in sp.ranks if r != me]
    while time.time() < deadline and notes.store is not None and len(notes.failed) + len(notes.waiting) < len(others):
        for r in others:
            notes.read(r)
        time.sleep(0.02)
    roots = notes.roots()
    raised = [r for r in sorted(roots) if notes.words(r)]
    _remember(sp, raised, notes)
    if notes.lost and not raised:  # a connection that takes writes but whose reads go unanswered, or one gone
        return _store_lost(sp, since, grace, notes.gone)
    if notes.lost:  # the notes read before the store stopped answering stand: those ranks began it
        return raised[0], "; ".join([notes.words(r) for r in raised] + [_host_after(notes.gone)])
    if me in roots and not raised and notes.timed_out_on(me):  # the others gave up on this rank: it stalled
        return me, notes.gave_up_on(me)
    silent = sorted({r for r in others if r not in notes.failed and r not in notes.waiting} | (roots - set(raised)
                                                                                                - {me}))
    parts = [notes.words(r) for r in raised]
    if silent:
        parts.append(f"global rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} never reached a "
                     f"ringseq wait: stopped, stuck in other work, far slower, or dead")
    if not parts:
        return None, None
    waited = sorted(notes.waiting | (set(notes.failed) - roots))
    if waited:
        parts.append(f"global rank{'s' if len(waited) > 1 else ''} {', '.join(map(str, waited))} "
                     f"waited or failed as this one did")
    return (raised or silent)[0], "; ".join(parts)


def _store_host_silent(sp, grace: float, gone: bool = False) -> str:
    """Words for a store that did not answer: without torchrun's agent, the process group's store
    is served by global rank 0's process, so rank 0 is the one stopped, stuck or dead (``gone``:
    its connection failed outright, so its process has exited)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return (f"the rendezvous store (torchrun's agent) {'is gone' if gone else f'did not answer within {grace:g} s'}"
                f", so no rank's notes could be read: a node or its agent is stopped or gone")
    where = "" if 0 in sp.ranks else " (a rank of another sequence group)"
    if gone:
        return (f"the rendezvous store is gone (its connection closed): its host, global rank 0{where}, has "
                f"exited, so no note could be read to tell where the failure began (global rank 0 or a rank it "
                f"lost first)")
    return (f"global rank 0{where} never reached a ringseq wait: stopped, stuck in other work, far slower, or dead "
            f"(it serves the rendezvous store, which did not answer within {grace:g} s)")


def _host_after(gone: bool) -> str:
    """Words for the store's host that stopped answering after the notes above were read: told, not blamed."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return "then the rendezvous store (torchrun's agent) stopped answering"
    return (f"then the rendezvous store stopped answering: its host (global rank 0) "
            f"{'has exited' if gone else 'is stopped or stuck'} since, after that failure")


_incidents: dict = {}
"""A sequence group's ranks -> (time.time(), roots, words) of the latest failure whose origin this
rank read in the notes: when the store's host exits after it (a user's loop that ends the job on an
error), the notes cannot be read again, and that failure, not the host, is still where it began."""


def remember(sp, raised: list, words: str) -> None:
    """This rank learnt that the failure began at ``raised`` (global ranks), told by ``words``."""
    if raised:
        _incidents[tuple(sp.ranks)] = (time.time(), list(raised), words)


def _remember(sp, raised: list, notes: "_Notes") -> None:
    remember(sp, raised, "; ".join(notes.words(r) for r in raised))


def _store_lost(sp, since: float, grace: float, gone: bool) -> tuple[int, str]:
    """(root, words) when the store cannot be read: the failure this rank read of since the group's
    last agreement (``since``) if any (its origin; the store's host only told of), else the host."""
    known = _incidents.get(tuple(sp.ranks))
    if known is None or known[0] < since:
        return 0, _store_host_silent(sp, grace, gone)
    _, roots, words = known
    return roots[0], f"{words}, in this group's last failure; {_host_after(gone)}"


def explain(sp, peer: int, since: float) -> tuple[int, str | None]:
    """After a transfer with ``peer`` failed (its connection closed): the rank where the failure
    began and, when it left a note of its own error, that error in words. A peer's note that
    blames another rank is followed there; the rank at the end of the chain that left no note
    failed or exited. gloo closes every connection of a process when one of them fails, so two
    healthy survivors can blame each other (each posts a provisional note at once, blaming the
    peer of its failed transfer): then the rank of the group that left no note at all is named."""
    notes = _Notes(sp, since, time.time() + min(0.3, _timeout(sp)))
    me, rank, seen, extended = dist.get_rank(), peer, set(), False
    while notes.store is not None:  # a note may be a moment behind the closed connection
        _point_at(rank)
        notes.read(rank)
        if rank in notes.failed:
            cause, text = notes.failed[rank]
            if cause is None:
                _remember(sp, [rank], notes)
                return rank, notes.words(rank)
            if cause == AFTERMATH:
                return rank, f"global rank {rank} stopped after a failure elsewhere ({text})"
            seen.add(rank)
            if cause == me and rank in notes.stalled:  # the peer timed out waiting for this rank: it stalled
                return me, notes.gave_up_on(me)
            if cause == me or cause in seen:  # survivors that blamed each other
                break
            rank = cause
            continue
        if rank in notes.waiting and not extended:  # alive, timed out: its failure note follows its grace
            notes.deadline, extended = max(notes.deadline, time.time() + _timeout(sp) + 0.3), True
        if time.time() >= notes.deadline:
            return rank, None  # no note: this one failed or exited
        time.sleep(0.02)
    others = [r for r in sp.ranks if r != me]
    while notes.store is not None and time.time() < notes.deadline:
        for r in others:
            notes.read(r)
        time.sleep(0.02)
    raised = [r for r in sorted(notes.roots()) if notes.words(r)]
    _remember(sp, raised, notes)
    if notes.lost and raised:  # the notes read before the store went stand: those ranks began it
        return raised[0], "; ".join([notes.words(r) for r in raised] + [_host_after(notes.gone)])
    if notes.lost and _store_host() == 0:  # connections closed and the store gone: its host died
        known = _incidents.get(tuple(sp.ranks))
        if known is not None and known[0] >= since:  # after a failure this rank read of: that is the origin
            return _store_lost(sp, since, 0.0, gone=True)
        return 0, (f"the connection with global rank {peer} closed and the rendezvous store is gone: its host, "
                   f"global rank 0{'' if 0 in sp.ranks else ' (a rank of another sequence group)'}, has exited, "
                   f"so no note could be read to tell where the failure began (global rank {peer}, global rank 0 "
                   f"or a rank they lost first)")
    silent = [r for r in others if r not in notes.failed and r not in notes.waiting]
    return (silent[0] if len(silent) == 1 else peer), None


def _point_at(rank: int) -> None:
    """``composing`` now points at ``rank`` (the notes followed so far lead there)."""
    global composing
    if composing is not None:
        composing = f"{composing.split(': the notes point at')[0]}: the notes point at global rank {rank}, which " \
                    f"failed or exited (or a rank its note blames)"


def _store_host() -> int | None:
    """The global rank whose process serves the rendezvous store: 0 for a TCP store made by
    ``init_process_group``, None under torchrun's agent (or without a TCP store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    inner = _default_store()
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    return 0 if isinstance(inner, dist.TCPStore) else None


def who_raised(sp, since: float) -> str | None:
    """After a peer's failure reached this rank as a flag (a marked block): the ranks of the group
    whose own error began it, with their errors, from their notes; None when none is found."""
    return raised_since(sp, since)[1]


def raised_since(sp, since: float, mine: bool = False) -> tuple[list[int], str | None]:
    """The global ranks of the group whose own error began the failures noted since ``since``, and
    their errors in words, read for a moment (a note may trail the flag or the record that told
    of it); ``([], None)`` when none is found. ``mine``: this rank's own note counts too (a group
    out of step after failures that began with this rank, or with every rank at once)."""
    notes = _Notes(sp, since, time.time() + min(1.0, _timeout(sp)))
    me = dist.get_rank()
    others = [r for r in sp.ranks if r != me or mine]
    while notes.store is not None and time.time() < notes.deadline:
        for r in others:
            notes.read(r)
        raised = [r for r in sorted(notes.roots()) if notes.words(r)]
        if raised:
            _remember(sp, raised, notes)
            return raised, "; ".join(notes.words(r) for r in raised)
        time.sleep(0.05)
    return [], None
