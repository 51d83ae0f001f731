"""Whole-model collectives announce themselves before any byte goes on the wire.

A collective of a public call (``global_avg``, ``consensus_distance``, a resume) that one rank calls
alone, or that two ranks call with different arguments, does not fail cleanly in the backend: the
lone rank waits for the process group's timeout, and its tensors may meet the other rank's next
collective on the same connection -- gloo then receives a message of another size and ends the
*other* process with SIGABRT. So each such call first registers its arrival in the job's c10d store
(the store every process already talks to): every rank of the group adds to a counter keyed by the
call's sequence number and its name (arguments that shape the collective included), and waits --
bounded by the wrapper's timeout -- until every rank has arrived. A rank that waits in vain gives the
call up atomically (``compare_set``: the call is either complete for everyone or abandoned for
everyone) and raises :class:`ArrivalError` naming the ranks that did not call it; nothing was sent.
A call number given up on is void: a rank that comes to it later skips it, so its call meets the
lone rank's next one, and the ranks are in step again.

Costs a few store round trips per call (no tensor traffic); for calls that are rare next to the
training iterations (evaluation, checkpoints).
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any, List, Optional, Sequence

import torch.distributed as dist

__all__ = ["ArrivalError", "Arrivals"]

logger = logging.getLogger(__name__)

_PREFIX = "decentpy/arrivals/"
_COMPLETE = "complete"


class ArrivalError(RuntimeError):
    """A whole-group call that not every rank of the group made (in the same order, with the same
    collective-shaping arguments). ``missing``: the group ranks that did not arrive; ``call``: its
    sequence number among this object's calls. Raised before anything was sent."""

    def __init__(self, message: str, what: str, call: int, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.what, self.call, self.missing = what, call, list(missing)


class Arrivals:
    """The arrival check of one wrapper's whole-group calls (see the module).

    Build it on every rank of the group at the same point (after a collective of the wrapper's
    construction): the ranks number their instances alike, so that wrappers built one after another
    on the same ranks never read each other's keys."""

    def __init__(self, global_ranks: Sequence[int], rank: int, timeout: datetime.timedelta,
                 store: Optional[Any] = None) -> None:
        self.global_ranks = list(global_ranks)
        self.rank = rank  # group rank
        self.size = len(self.global_ranks)
        self.timeout = timeout
        self._store = store
        if self._store is None and self.size > 1:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 - a backend without a store: no check (the collective's own errors)
                self._store = None
        self._calls = 0
        self._prefix = ""
        if self._store is not None and self.size > 1:
            group = _PREFIX + "-".join(map(str, self.global_ranks))
            n = int(self._store.add(f"{group}/instances", 1))
            self._prefix = f"{group}/{(n - 1) // self.size}"

    def arrive(self, what: str, timeout: Optional[datetime.timedelta] = None) -> None:
        """Register this rank's call ``what`` and return once every rank of the group made the same
        call; :class:`ArrivalError` otherwise (within ``timeout``, default the wrapper's)."""
        if self._store is None or self.size <= 1:
            return
        store = self._store
        while True:
            self._calls += 1
            call = self._calls
            base = f"{self._prefix}/{call}"
            if not store.check([f"{base}/state"]):
                break
            # given up before this rank came (another rank called alone): void for everyone, skipped
            logger.debug("rank %d: whole-group call #%d was given up on before this rank's %s; skipped",
                         self.rank, call, what)
        key = f"{base}/{what}"
        store.set(f"{base}/by/{self.rank}", what)
        arrived = int(store.add(f"{key}/count", 1))
        waited = (timeout or self.timeout).total_seconds()
        if arrived == self.size:
            state = _decode(store.compare_set(f"{base}/state", "", _COMPLETE))
        else:  # (one outcome per call number: a rank arriving at a call given up on learns it at once)
            state = self._wait(f"{base}/state", waited)
        if state == _COMPLETE:
            return
        missing, others = self._missing(base, what)
        if others:
            seen = "; ".join(f"rank {r} made {w!r}" for r, w in others)
            raise ArrivalError(
                f"{what}: the ranks made different whole-group calls at call #{call} of this wrapper ({seen}); "
                "nothing was sent. Every rank of the group must make the same calls in the same order, with the same "
                "arguments", what, call, missing)
        if state != f"abandoned by {self.rank}":
            raise ArrivalError(
                f"{what}: rank {state.split()[-1]} gave up waiting for this call (whole-group call #{call} of this "
                "wrapper) before this rank made it: the ranks' calls are out of step (a rank called it, or another "
                "whole-group call, alone). Nothing was sent; this call is refused so that the next one is in step "
                "again: call it on every rank of the group together", what, call)
        raise ArrivalError(
            f"{what} is a collective, but rank(s) {missing} of the group did not call it within {waited:g} s "
            f"(whole-group call #{call} of this wrapper). Nothing was sent; call it on every rank of the group, in the "
            "same order and with the same arguments", what, call, missing)

    def _wait(self, state_key: str, timeout_s: float) -> str:
        """The call's outcome once set; after ``timeout_s``, give it up unless it completed meanwhile."""
        store = self._store
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        while True:
            if store.check([state_key]):
                return _decode(store.get(state_key))
            if time.monotonic() >= deadline:
                return _decode(store.compare_set(state_key, "", f"abandoned by {self.rank}"))
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _missing(self, base: str, what: str) -> "tuple[List[int], List[tuple[int, str]]]":
        """The ranks that did not make ``what`` as this call, and what the others made instead (read
        on the failure path only)."""
        store = self._store
        missing, others = [], []
        for r in range(self.size):
            if r == self.rank:
                continue
            k = f"{base}/by/{r}"
            if not store.check([k]):
                missing.append(r)
                continue
            theirs = _decode(store.get(k))
            if theirs != what:
                missing.append(r)
                others.append((r, theirs))
        return missing, others


def _decode(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)
