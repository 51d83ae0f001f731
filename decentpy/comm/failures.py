"""What went wrong with a peer, classified once: the exception hierarchy, the liveness monitor, and
the one place that turns a raw backend error (gloo, NCCL) into one of decentpy's errors.

Three classes of peer failure, all :class:`PeerTimeoutError` (so ``except PeerTimeoutError`` still
catches every one of them):

* :class:`PeerUnreachableError` -- a peer is gone: killed, stopped (SIGSTOP, a hung host) or its
  connection closed. Named from the heartbeats (below), not from the socket that happened to fail.
* :class:`PeerReportedError` -- a peer raised (a non-finite gradient with ``nonfinite='raise'``, a
  faulty peer with ``peer_check='raise'``, or its own peer failure) and posted its message before
  leaving.
* :class:`PeerTimeoutError` itself -- the peer is alive and silent past the wait's timeout.

Liveness: every process that built a wrapper beats a counter in the job's c10d store once per
:data:`HEARTBEAT_INTERVAL_S` from a daemon thread (the store every process already talks to, like
torchft's heartbeats to its lighthouse, so no extra connection or port). A peer whose counter stops
for :data:`DEFAULT_LIVENESS_TIMEOUT` is reported unreachable even though its socket stays open
(SIGSTOP), while a peer that is merely slow (evaluation on rank 0 only, a long data load) keeps
beating and is waited for up to the wait's own timeout, the process group's. That split is why the
liveness default can be short: torch's DDP watchdog has only the collective timeout (10 min for
NCCL, 30 min for gloo) because it cannot tell slow from dead; torchft tells them apart with
heartbeats and reacts within seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import re
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .exit import stop_at_exit

__all__ = ["PeerTimeoutError", "PeerUnreachableError", "PeerReportedError", "NonFiniteGradientError",
           "PeerNonFiniteError", "FaultyPeerError", "PeerFaultyError", "PeerMonitor", "PeerWatch", "running_monitor",
           "report_to_peers", "start_heartbeat", "NOTICE_INTERVAL_S", "DEFAULT_LIVENESS_TIMEOUT", "HEARTBEAT_INTERVAL_S",
           "peer_monitor"]

logger = logging.getLogger(__name__)

#: how often each process beats its counter in the store
HEARTBEAT_INTERVAL_S = 1.0
#: a peer whose heartbeat stops this long is unreachable (ten missed beats: robust to GC pauses
#: and a loaded host, well under a minute; overridable per wrapper)
DEFAULT_LIVENESS_TIMEOUT = datetime.timedelta(seconds=10)
_PREFIX = "decentpy/peers/"


class PeerTimeoutError(RuntimeError):
    """A peer did not complete an exchange within the timeout (it may have died).

    ``ranks``: the (global) ranks the waiting rank could not get an answer from; ``bucket`` and
    ``step`` what was awaited (None when not a bucket exchange); ``waited_s`` the time actually
    waited."""

    def __init__(self, message: str, ranks: Sequence[int] = (), bucket: Optional[int] = None,
                 step: Optional[int] = None, waited_s: Optional[float] = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks)
        self.bucket = bucket
        self.step = step
        self.waited_s = waited_s


class PeerUnreachableError(PeerTimeoutError):
    """A peer is gone: its process died or stopped (no heartbeat), or its connection closed."""


class PeerReportedError(PeerTimeoutError):
    """A peer raised an error and reported it to every rank before leaving."""


class NonFiniteGradientError(FloatingPointError):
    """A rank's gradient was not finite (``nonfinite='raise'``); raised on every rank, naming it."""

    def __init__(self, message: str, rank: int, step: int, buckets: Sequence[int]) -> None:
        super().__init__(message)
        self.rank, self.step, self.buckets = rank, step, list(buckets)


class PeerNonFiniteError(PeerReportedError, NonFiniteGradientError):
    """On the other ranks: a peer's gradient was not finite and it raised (``nonfinite='raise'``)."""

    def __init__(self, message: str, ranks: Sequence[int] = (), bucket: Optional[int] = None,
                 step: Optional[int] = None, waited_s: Optional[float] = None) -> None:
        PeerTimeoutError.__init__(self, message, ranks, bucket, step, waited_s)
        self.rank, self.buckets = (ranks[0] if ranks else -1), []


class FaultyPeerError(RuntimeError):
    """What a peer sent failed the peer check (``peer_check='raise'``): not finite, or farther from this
    replica than the bound. Raised where it was detected, naming the peer; every other rank raises a
    :class:`PeerFaultyError` (a subclass) when it next waits for a peer.

    ``peer``: the faulty peer's global rank (-1: a member of ``group`` that could not be named, its
    data not matching its fingerprint); ``bucket``, ``step``: what was checked; ``distance``,
    ``bound``: the measured distance and the bound it exceeded (None for a non-finite value);
    ``group``: the global ranks of the exchange."""

    def __init__(self, message: str, peer: int = -1, bucket: Optional[int] = None, step: Optional[int] = None,
                 distance: Optional[float] = None, bound: Optional[float] = None,
                 group: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.peer, self.bucket, self.step = peer, bucket, step
        self.distance, self.bound, self.group = distance, bound, list(group)


class PeerFaultyError(PeerReportedError, FaultyPeerError):
    """On the other ranks: a rank found a faulty peer and raised (``peer_check='raise'``); names that
    peer (parsed from the detecting rank's report)."""

    def __init__(self, message: str, ranks: Sequence[int] = (), bucket: Optional[int] = None,
                 step: Optional[int] = None, waited_s: Optional[float] = None, peer: int = -1) -> None:
        PeerTimeoutError.__init__(self, message, ranks, bucket, step, waited_s)  # (FaultyPeerError's too: the MRO)
        self.peer = peer


#: how a FaultyPeerError's message names the faulty peer (the detecting rank writes it; the others read
#: it back from the report)
FAULTY_PEER_TOKEN = "faulty peer rank"
_FAULTY_PEER_RE = re.compile(re.escape(FAULTY_PEER_TOKEN) + r" (-?\d+)")


def faulty_peer_of(text: str) -> int:
    """The faulty peer a FaultyPeerError's message names (-1: none)."""
    m = _FAULTY_PEER_RE.search(text)
    return int(m.group(1)) if m else -1


#: how often (at most) a rank looks for its peers' notices (non-finite skips): one store read
NOTICE_INTERVAL_S = 5.0
#: notices of one rank read per look, at most
_MAX_NOTICES = 64
#: characters of a peer's report or notice kept
_MAX_TEXT = 2000


def _printable(value: bytes) -> str:
    """A peer's text from the store, as untrusted input: decoded leniently, control characters
    (but newlines) replaced, at most :data:`_MAX_TEXT` characters."""
    text = value[:_MAX_TEXT * 4].decode("utf-8", errors="replace")[:_MAX_TEXT]
    return "".join(c if c.isprintable() or c == "\n" else "?" for c in text)


class PeerMonitor:
    """This process's heartbeat and the job's notice board of reported errors, in the c10d store."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store = store
        self.rank = rank
        self.store_lost: Optional[str] = None
        self._seen: Dict[int, Tuple[int, float]] = {}  # rank -> (count, when it last changed)
        self._reported = False
        self._notices_total = 0
        self._notices_seen: Dict[int, int] = {}
        self._notices_checked = time.monotonic()
        self._malformed: set = set()  # ranks whose malformed report was named
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="decentpy-heartbeat", daemon=True)
        self._thread.start()
        stop_at_exit(self._stop, [self._thread])  # never inside a store call when Python finalizes

    def _beat(self) -> None:
        key = f"{_PREFIX}beat/{self.rank}"
        while not self._stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception as exc:  # noqa: BLE001 - the store's host is gone; nothing to beat to
                self.store_lost = str(exc)
                return
            self._stop.wait(HEARTBEAT_INTERVAL_S)

    def stop(self) -> None:
        """Stop beating (the process group this monitor belongs to was replaced)."""
        self._stop.set()

    def _counts(self, ranks: Sequence[int]) -> Dict[int, int]:
        return {r: int(self.store.add(f"{_PREFIX}beat/{r}", 0)) for r in ranks}

    def stalled(self, ranks: Sequence[int], liveness_s: float) -> List[int]:
        """Ranks whose heartbeat has not moved for ``liveness_s`` (measured from this process's
        first look at them)."""
        now = time.monotonic()
        out = []
        with self._lock:
            for r, c in self._counts(ranks).items():
                last = self._seen.get(r)
                if last is None or last[0] != c:
                    self._seen[r] = (c, now)
                elif now - last[1] >= liveness_s:
                    out.append(r)
        return out

    def dead(self, ranks: Sequence[int], window_s: float) -> List[int]:
        """Ranks whose heartbeat does not move over ``window_s`` (a few beats), looked at now: after
        a connection closed, which of the peers is gone."""
        before = self._counts(ranks)
        deadline = time.monotonic() + window_s
        alive: set = set()
        while time.monotonic() < deadline and len(alive) < len(before):
            time.sleep(0.1)
            alive |= {r for r, c in self._counts(ranks).items() if c != before[r]}
        return [r for r in ranks if r not in alive]

    def report(self, message: str, unreachable: Sequence[int] = ()) -> None:
        """Post this rank's error, once, for the ranks still waiting on it (``unreachable``: the
        ranks it found gone, so that the others name the cause, not the messenger)."""
        if self._reported:
            return
        self._reported = True
        try:
            self.store.set(f"{_PREFIX}error/{self.rank}", ",".join(map(str, unreachable)) + "|" + message)
            self.store.add(f"{_PREFIX}errors", 1)
        except Exception:  # noqa: BLE001 - the store is gone: the peers will find this rank unreachable
            logger.debug("could not report the error to the store", exc_info=True)

    def notify(self, text: str) -> None:
        """Post a notice (not an error) for every rank: they log it at their next look."""
        try:
            n = int(self.store.add(f"{_PREFIX}notice/{self.rank}/n", 1))
            self.store.set(f"{_PREFIX}notice/{self.rank}/{n}", text)
            self.store.add(f"{_PREFIX}notices", 1)
        except Exception:  # noqa: BLE001 - best effort: the local warning was logged
            logger.debug("could not post the notice", exc_info=True)

    def notices(self, ranks: Sequence[int], force: bool = False) -> List[Tuple[int, str]]:
        """New notices of ``ranks`` since the last look; looks at most every
        :data:`NOTICE_INTERVAL_S` (one store read) unless ``force``."""
        now = time.monotonic()
        if not force and now - self._notices_checked < NOTICE_INTERVAL_S:
            return []
        self._notices_checked = now
        try:
            total = int(self.store.add(f"{_PREFIX}notices", 0))
            if total == self._notices_total:
                return []
            self._notices_total = total
            out = []
            for r in ranks:
                if r == self.rank:
                    continue
                n = int(self.store.add(f"{_PREFIX}notice/{r}/n", 0))
                first = self._notices_seen.get(r, 0) + 1
                if n - first >= _MAX_NOTICES:  # a flood: the last ones only (each is one store read)
                    logger.warning("rank %d posted %d notices at once; showing the last %d", r, n - first + 1,
                                   _MAX_NOTICES)
                    first = n - _MAX_NOTICES + 1
                seen = first - 1
                for i in range(first, n + 1):
                    key = f"{_PREFIX}notice/{r}/{i}"
                    if not self.store.check([key]):  # counted, not written yet: read at the next look, never waited for
                        break
                    out.append((r, _printable(self.store.get(key))))
                    seen = i
                self._notices_seen[r] = seen
            return out
        except Exception:  # noqa: BLE001 - the store is gone: the next wait reports it
            return []

    def reports(self, ranks: Sequence[int]) -> Dict[int, Tuple[List[int], str]]:
        """The errors reported by ``ranks``: (the ranks each found unreachable, its message); one
        store read when none was."""
        if int(self.store.add(f"{_PREFIX}errors", 0)) == 0:
            return {}
        out = {}
        for r in ranks:
            key = f"{_PREFIX}error/{r}"
            if r != self.rank and self.store.check([key]):
                gone, _, text = _printable(self.store.get(key)).partition("|")
                ranks_gone = [int(x) for x in gone.split(",") if x.isdigit() and len(x) < 10]
                if len(ranks_gone) != len([x for x in gone.split(",") if x]):  # not a list of ranks: the message stands
                    if r not in self._malformed:
                        self._malformed.add(r)
                        logger.warning("rank %d's error report names its unreachable ranks as %r, not a list of "
                                       "ranks: that part is ignored", r, gone[:80])
                    ranks_gone = []
                out[r] = (ranks_gone, text)
        return out


_MONITOR: Optional[PeerMonitor] = None
_MONITOR_LOCK = threading.Lock()


def peer_monitor() -> Optional[PeerMonitor]:
    """The monitor of this process's current default process group (started on first use, and
    replaced when the process group was destroyed and initialised again: a monitor beating into
    the old group's store would see every peer as gone), or None without a default store."""
    global _MONITOR
    with _MONITOR_LOCK:
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store (e.g. a custom backend): waits stay plain
            return None
        if _MONITOR is not None and (_MONITOR.store is not store or _MONITOR.rank != dist.get_rank()):
            _MONITOR.stop()
            _MONITOR = None
        if _MONITOR is None:
            _MONITOR = PeerMonitor(store, dist.get_rank())
        return _MONITOR


def running_monitor() -> Optional[PeerMonitor]:
    """The monitor of the current default process group if one is beating already (never starts
    one: a monitor started only after a failure would find every peer without heartbeats)."""
    with _MONITOR_LOCK:
        if _MONITOR is None:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - the process group is gone
            return None
        return _MONITOR if _MONITOR.store is store else None


def report_to_peers(err: BaseException) -> None:
    """Post ``err`` (this rank is about to raise it outside any wait: a bad hyper-parameter before a
    step) on the job's error board, so that the ranks waiting on this one raise a
    :class:`PeerReportedError` naming it within a heartbeat instead of at their timeout. Nothing
    without a running monitor (one rank, or no heartbeats)."""
    monitor = running_monitor()
    if monitor is not None:
        monitor.report(f"{type(err).__name__}: {err}")


def start_heartbeat() -> None:
    """Beat this process's heartbeat from now on (wrappers call it at construction, so that every
    process of a job beats before any wait could need to tell a dead peer from a slow one)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        peer_monitor()


#: the timeout of the wait that ends a blocked one at exit
_CANCEL_WAIT = datetime.timedelta(milliseconds=1)
_Cancel = Optional[Callable[[], Any]]


class _WakeOnStop(threading.Event):
    """The waiter's stop event: setting it also wakes the thread from its queue."""

    def __init__(self, jobs: "queue.Queue[Any]") -> None:
        super().__init__()
        self._jobs = jobs

    def set(self) -> None:
        super().set()
        self._jobs.put(None)


class _Waiter:
    """One daemon thread that runs blocking ``work.wait(timeout)`` calls, so the caller can watch
    the peers meanwhile (gloo closes the connection when a wait with a short timeout expires, so a
    wait cannot be sliced, and its works have no future to poll).

    A wait given up on (a peer failed: the caller raised) keeps its thread inside the backend, GIL
    released, until the connection closes; if that happens while Python finalizes, the thread's
    return for the GIL ends in ``std::terminate`` (decentpy/comm/exit.py), so the thread is stopped
    at exit like the heartbeat's: woken if idle, and if blocked its wait is ended (the job's
    ``cancel``: a 1 ms wait on the same work, after which gloo wakes the blocked one with an error)
    and the thread joined, before finalization."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Optional[Tuple[Callable[[], Any], threading.Event, List[Any], _Cancel]]]" = \
            queue.Queue()
        self._stop = _WakeOnStop(self._jobs)
        self._cancel: _Cancel = None  # ends the job running now (see _unblock)
        thread = threading.Thread(target=self._run, name="decentpy-waiter", daemon=True)
        thread.start()
        stop_at_exit(self._stop, [thread], self._unblock)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._stop.is_set():
                return
            fn, done, box, cancel = job
            self._cancel = cancel
            try:
                box.append(("ok", fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append(("error", exc))
            finally:
                self._cancel = None
            done.set()

    def _unblock(self) -> None:
        """At exit (decentpy/comm/exit.py): end the wait this thread is blocked in, if any -- a wait
        given up on, whose peer is alive and would close the connection only later, while the
        interpreter finalizes (SIGABRT)."""
        cancel = self._cancel
        if cancel is not None:
            cancel()

    def submit(self, fn: Callable[[], Any], cancel: _Cancel = None) -> Tuple[threading.Event, List[Any]]:
        """Run ``fn`` on the thread; ``cancel`` makes it return at once (called at exit only)."""
        done, box = threading.Event(), []  # type: ignore[var-annotated]
        self._jobs.put((fn, done, box, cancel))
        return done, box


_WAITER: Optional[_Waiter] = None


def _waiter() -> _Waiter:
    global _WAITER
    with _MONITOR_LOCK:
        if _WAITER is None:
            _WAITER = _Waiter()
        return _WAITER


def _retire_waiter(waiter: _Waiter) -> None:
    """``waiter``'s thread is blocked in a wait given up on (it ends at the backend's timeout): the
    next wait starts a new thread instead of queueing behind it."""
    global _WAITER
    with _MONITOR_LOCK:
        if _WAITER is waiter:
            _WAITER = None


class PeerWatch:
    """How one wrapper's waits watch its peers: the ranks it exchanges with (global), its wait
    timeout and liveness timeout; turns every failure into the one right error, once."""

    def __init__(self, group_ranks: Sequence[int], timeout: datetime.timedelta,
                 liveness: Optional[datetime.timedelta] = DEFAULT_LIVENESS_TIMEOUT) -> None:
        self.group_ranks = list(group_ranks)
        self.timeout = timeout
        self.liveness_s = liveness.total_seconds() if liveness is not None else None
        self.monitor = peer_monitor() if liveness is not None and len(self.group_ranks) > 1 else None
        self.me = dist.get_rank()

    def wait(self, work: Any, what: str, peers: Sequence[int], bucket: Optional[int] = None,
             step: Optional[int] = None) -> None:
        """``work.wait`` bounded by the timeout, a dead or stopped peer detected within the
        liveness timeout, any failure raised as a classified :class:`PeerTimeoutError`."""
        start = time.monotonic()
        timeout_s = self.timeout.total_seconds()
        if self.monitor is None:
            try:
                ok = work.wait(self.timeout)
            except Exception as exc:  # noqa: BLE001 - classified
                raise self.classify(exc, what, peers, bucket, step, start) from exc
            if ok is False:
                raise self.classify(None, what, peers, bucket, step, start)
            return
        waiter = _waiter()
        # cancel: a wait with a 1 ms timeout on the same work ends the blocked one (gloo closes the
        # work's connections and wakes it with an error); used at exit only, see decentpy/comm/exit.py
        done, box = waiter.submit(lambda: work.wait(self.timeout), cancel=lambda: work.wait(_CANCEL_WAIT))
        tick = min(1.0, max(0.05, (self.liveness_s or 1.0) / 4))
        try:
            while not done.wait(tick):
                waited = time.monotonic() - start
                self._check_peers(what, peers, bucket, step, start)
                if waited > timeout_s + 5.0:  # the backend did not honour the timeout
                    raise self._raise_and_report(PeerTimeoutError(
                        f"{what} did not complete within {waited:.1f} s (timeout {timeout_s:g} s); peer(s) "
                        f"{list(peers)} are alive but did not answer", peers, bucket, step, waited))
        except BaseException:
            _retire_waiter(waiter)  # its thread still sits in this wait: later waits (elastic) get a fresh one
            raise
        status, value = box[0]
        if status == "error":
            raise self.classify(value, what, peers, bucket, step, start) from value
        if value is False:
            raise self.classify(None, what, peers, bucket, step, start)

    def _check_peers(self, what: str, peers: Sequence[int], bucket: Optional[int], step: Optional[int],
                     start: float) -> None:
        """While waiting: a reported error anywhere in the group, or an awaited peer without a
        heartbeat for the liveness timeout, ends the wait now."""
        assert self.monitor is not None and self.liveness_s is not None
        try:
            reports = self.monitor.reports(self.group_ranks)
            stalled = self.monitor.stalled(peers, self.liveness_s)
        except Exception as exc:  # noqa: BLE001 - the store's host died
            raise self._store_lost(exc, what, peers, bucket, step, start) from exc
        waited = time.monotonic() - start
        if reports:
            raise self._raise_and_report(self._reported(reports, what, peers, bucket, step, waited))
        if stalled:
            raise self._raise_and_report(PeerUnreachableError(
                f"{what}: rank(s) {stalled} unreachable: no heartbeat for {self.liveness_s:g} s (the process died "
                f"or is stopped); gave up after waiting {waited:.1f} s", stalled, bucket, step, waited))

    def classify(self, exc: Optional[BaseException], what: str, peers: Sequence[int], bucket: Optional[int],
                 step: Optional[int], start: float) -> PeerTimeoutError:
        """The one classification of a failed wait or launch (``exc``: the backend's error, None: the
        backend said the wait timed out), reported to the other ranks."""
        if isinstance(exc, PeerTimeoutError):
            return exc
        detail = f" ({str(exc).splitlines()[0][:200]})" if exc is not None else ""
        timed_out = exc is None or "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        if self.monitor is not None:
            try:
                others = [r for r in self.group_ranks if r != self.me]
                reports = self.monitor.reports(self.group_ranks)
                dead = [r for r in self.monitor.dead(others, 2.5 * HEARTBEAT_INTERVAL_S) if r not in reports]
                reports = {**reports, **self.monitor.reports(self.group_ranks)}  # posted while we looked
                dead = [r for r in dead if r not in reports]
            except Exception as exc2:  # noqa: BLE001 - the store's host died too
                return self._store_lost(exc2, what, peers, bucket, step, start)
            waited = time.monotonic() - start
            if dead:
                return self._raise_and_report(PeerUnreachableError(
                    f"{what}: rank(s) {dead} unreachable (no heartbeat: the process died or is stopped); failed "
                    f"after {waited:.1f} s{detail}", dead, bucket, step, waited))
            if reports:
                return self._raise_and_report(self._reported(reports, what, peers, bucket, step, waited))
        waited = time.monotonic() - start
        if timed_out:
            return self._raise_and_report(PeerTimeoutError(
                f"{what} did not complete within {waited:.1f} s (timeout {self.timeout.total_seconds():g} s); "
                f"peer(s) {list(peers)} may have died{detail}", peers, bucket, step, waited))
        return self._raise_and_report(PeerUnreachableError(
            f"{what}: the connection to peer(s) {list(peers)} failed after {waited:.1f} s{detail}",
            peers, bucket, step, waited))

    def _reported(self, reports: Dict[int, Tuple[List[int], str]], what: str, peers: Sequence[int],
                  bucket: Optional[int], step: Optional[int], waited: float) -> PeerTimeoutError:
        """A peer's report: the ranks it found unreachable are this rank's cause too."""
        first = min(reports)
        gone = sorted({g for unreachable, _ in reports.values() for g in unreachable} - {self.me})
        if gone:
            by = min(r for r, (u, _) in reports.items() if set(u) & set(gone))
            return PeerUnreachableError(
                f"{what}: rank(s) {gone} unreachable, as rank {by} reported (this rank gave up after {waited:.1f} s): "
                f"{reports[by][1]}", gone, bucket, step, waited)
        # a faulty peer found by a rank's peer check: every rank's error names that peer
        faulty = [r for r, (_, text) in sorted(reports.items()) if f"{FaultyPeerError.__name__}:" in text]
        if faulty:
            origin = [r for r in faulty if reports[r][1].startswith(FaultyPeerError.__name__)] or faulty
            text = reports[origin[0]][1]
            return PeerFaultyError(f"{what}: rank {origin[0]} reported an error after {waited:.1f} s: {text}",
                                   sorted(reports), bucket, step, waited, peer=faulty_peer_of(text))
        # the rank where it started (its own error, not a relayed one) is the one to name
        origin = [r for r, (_, text) in sorted(reports.items()) if text.startswith(NonFiniteGradientError.__name__)]
        relayed = [r for r, (_, text) in sorted(reports.items()) if f"{NonFiniteGradientError.__name__}:" in text]
        if origin or relayed:
            first = (origin or relayed)[0]
            return PeerNonFiniteError(f"{what}: rank {first} reported an error after {waited:.1f} s: "
                                      f"{reports[first][1]}", sorted(reports), bucket, step, waited)
        return PeerReportedError(f"{what}: rank {first} reported an error after {waited:.1f} s: {reports[first][1]}",
                                 sorted(reports), bucket, step, waited)

    def _store_lost(self, exc: BaseException, what: str, peers: Sequence[int], bucket: Optional[int],
                    step: Optional[int], start: float) -> PeerUnreachableError:
        waited = time.monotonic() - start
        return PeerUnreachableError(
            f"{what}: the job's store is unreachable after {waited:.1f} s (with env:// it lives in rank 0's process, "
            f"which may have died): {str(exc).splitlines()[0][:200]}", [0], bucket, step, waited)

    def _raise_and_report(self, err: PeerTimeoutError) -> PeerTimeoutError:
        if self.monitor is not None:
            gone = err.ranks if isinstance(err, PeerUnreachableError) else []
            self.monitor.report(f"{type(err).__name__}: {err}", gone)
        return err

    def guard_launch(self, fn: Callable[[], Any], what: str, peers: Sequence[int], bucket: Optional[int] = None,
                     step: Optional[int] = None) -> Any:
        """Start a backend operation; a backend error (a peer already gone) is classified."""
        start = time.monotonic()
        try:
            return fn()
        except (RuntimeError, dist.DistError) as exc:
            raise self.classify(exc, what, peers, bucket, step, start) from exc

    @contextlib.contextmanager
    def guarding(self, what: str) -> Iterator[None]:
        """Around a blocking collective of a public call (over the whole group): a backend error
        leaves as a classified :class:`PeerTimeoutError`, never raw."""
        start = time.monotonic()
        try:
            yield
        except PeerTimeoutError:
            raise
        except (RuntimeError, dist.DistError) as exc:
            peers = [r for r in self.group_ranks if r != self.me]
            raise self.classify(exc, f"rank {self.me}: {what}", peers, None, None, start) from exc
