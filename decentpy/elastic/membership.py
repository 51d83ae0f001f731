"""Who is in the job, per epoch, agreed through a ``torch.distributed`` Store.

Every key lives under ``decentpy/elastic/<job>/`` in the rendezvous store (a TCPStore hosted by
``python -m decentpy.rendezvous``, or any c10d Store). A worker is named by a stable *member id*
(a string of the user's: host:slot, a pod name, "3"); its rank is its position in the member list
of the current epoch, which changes when the membership does.

* ``node/<id>``: the member's failure domain (its node with ``intra_node="allreduce"`` or ``"shard"``, else its
  own id); memberships hold whole nodes (:meth:`Membership.whole_nodes`), ranked node by node.
* ``beat/<id>``: a counter each member adds 1 to every :data:`HEARTBEAT_INTERVAL_S` (a daemon
  thread); a member whose counter stops for the liveness timeout is dead to the others.
* ``changes``: a counter bumped by whoever starts a membership change (a survivor that saw a peer
  fail); a poller thread per member reads it ten times a second and raises :attr:`Membership.changed`,
  so the per-step cost is one attribute read.
* ``epoch<e>/here/<id>``: member ``id`` takes part in forming epoch ``e`` (value: its step count).
* ``epoch<e>/members``: the decision, ``"<step>|<id>,<id>,..."`` (members in rank order, the step
  the epoch starts at), written once with ``compare_set`` (the first proposal wins, every member
  reads the same one).

Forming epoch ``e+1`` after a failure: each survivor announces itself and waits (bounded) until every
member of epoch ``e`` it does not know to be dead has announced itself or stopped beating; then it
proposes the announced members, in their old order, starting at the largest step any of them
reached. Epoch 1 is formed by the first ``initial_workers`` members to arrive, in the natural order of
their ids.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from ..comm.exit import stop_at_exit

__all__ = ["Formation", "Membership", "RendezvousError", "EvictedError", "HEARTBEAT_INTERVAL_S", "POLL_INTERVAL_S"]

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
POLL_INTERVAL_S = 0.1  # how soon a member sees a change: the admission of a joiner waits for the last to see it
_SLEEP_S = 0.05


class RendezvousError(RuntimeError):
    """The rendezvous store cannot be reached, or the membership could not be formed in time."""


class EvictedError(RuntimeError):
    """This worker was left out of the new membership (the others found it dead or too late)."""


class Formation(NamedTuple):
    """One epoch's membership as agreed: ``members`` in rank order, the step it starts at."""

    epoch: int
    members: List[str]
    step: int

    def rank_of(self, member_id: str) -> int:
        return self.members.index(member_id)


def natural_key(member_id: str) -> Any:
    """Ids that are numbers sort as numbers, before the others (which sort as text)."""
    return (0, int(member_id), "") if member_id.isdigit() else (1, 0, member_id)


def _encode(step: int, members: Sequence[str]) -> str:
    return f"{step}|{','.join(members)}"


def _decode(epoch: int, value: bytes) -> Formation:
    step, _, members = value.decode().partition("|")
    return Formation(epoch, [m for m in members.split(",") if m], int(step))


class Membership:
    """This worker's view of the job's membership (see the module): heartbeat, change poller, and
    the agreement on each epoch's member list."""

    def __init__(self, store: Any, member_id: str, liveness_s: float, job: str = "default",
                 node: Optional[str] = None, node_size: int = 1) -> None:
        for what, value in (("member_id", member_id), ("node", node if node is not None else "x")):
            if not value or any(c in value for c in ",|/ "):
                raise ValueError(f"{what} must be a non-empty string without ',', '|', '/' or spaces, got {value!r}")
        self.store = store
        self.id = member_id
        #: failure domains of ``node_size`` members (intra_node modes): a node is in a membership whole
        #: or not at all; ``node``: this member's (its member id when each member is its own domain)
        self.node = node if node is not None else member_id
        self.node_size = int(node_size)
        self._nodes: Dict[str, str] = {}  # member id -> node (read from the store once)
        self.liveness_s = float(liveness_s)
        self.prefix = f"decentpy/elastic/{job}/"
        self.formation: Optional[Formation] = None
        self.joining = False           # this worker joined a running job (it receives its state from a member)
        self.changed = False           # set by the poller: someone started a membership change
        self.store_lost: Optional[str] = None
        self._changes_seen = 0
        self._seen: Dict[str, tuple] = {}  # id -> (beat count, when it last moved)
        self._stop = threading.Event()
        try:
            self.store.set(f"{self.prefix}node/{member_id}", self.node)
            self._add("beat/" + member_id, 1)
        except Exception as exc:  # noqa: BLE001 - the store's host is not there
            raise RendezvousError(f"member {member_id}: the rendezvous store is unreachable: "
                                  f"{str(exc).splitlines()[0][:200]}") from exc
        self._threads = [threading.Thread(target=self._beat, name="decentpy-elastic-beat", daemon=True),
                         threading.Thread(target=self._poll, name="decentpy-elastic-poll", daemon=True)]
        for t in self._threads:
            t.start()
        stop_at_exit(self._stop, self._threads)  # never inside a store call when Python finalizes

    # -- store access ------------------------------------------------------------------------
    def _add(self, key: str, n: int) -> int:
        return int(self.store.add(self.prefix + key, n))

    def _has(self, key: str) -> bool:
        return bool(self.store.check([self.prefix + key]))

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._add("beat/" + self.id, 1)
            except Exception as exc:  # noqa: BLE001 - the rendezvous host is gone
                self.store_lost = str(exc).splitlines()[0][:200]
                self.changed = True
                return

    def _poll(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            try:
                if self._add("changes", 0) != self._changes_seen:
                    self.changed = True
            except Exception as exc:  # noqa: BLE001 - the rendezvous host is gone
                self.store_lost = str(exc).splitlines()[0][:200]
                self.changed = True
                return

    def stop(self) -> None:
        self._stop.set()

    def _stale(self, ids: Sequence[str]) -> List[str]:
        """Members whose heartbeat has not moved for the liveness timeout (from this worker's first look)."""
        now = time.monotonic()
        out = []
        for m in ids:
            c = self._add("beat/" + m, 0)
            last = self._seen.get(m)
            if last is None or last[0] != c:
                self._seen[m] = (c, now)
            elif now - last[1] >= self.liveness_s:
                out.append(m)
        return out

    def _guarded(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except (RendezvousError, EvictedError):
            raise
        except Exception as exc:  # noqa: BLE001 - the store's host is gone (or refuses)
            raise RendezvousError(
                f"member {self.id}: {what}: the rendezvous store is unreachable ({str(exc).splitlines()[0][:200]}); "
                "it is the one process that must stay up (python -m decentpy.rendezvous)") from exc

    # -- failure domains --------------------------------------------------------------------
    def node_of(self, member_id: str) -> str:
        if member_id not in self._nodes:
            key = f"{self.prefix}node/{member_id}"
            self._nodes[member_id] = self.store.get(key).decode() if self.store.check([key]) else member_id
        return self._nodes[member_id]

    def ordered(self, ids: Sequence[str]) -> List[str]:
        """``ids`` in rank order for a new membership: by node, then by id (a node's members get
        consecutive ranks), in the natural order of both."""
        return sorted(ids, key=lambda m: (natural_key(self.node_of(m)), natural_key(m)))

    def whole_nodes(self, ids: Sequence[str]) -> List[str]:
        """``ids`` (kept in their order) without the members of nodes that do not have all of their
        ``node_size`` members among them: a node with a dead worker leaves the membership whole, and
        a joining node is admitted once all its workers asked. Every member when nodes are of one."""
        if self.node_size <= 1:
            return list(ids)
        count = Counter(self.node_of(m) for m in ids)
        return [m for m in ids if count[self.node_of(m)] == self.node_size]

    # -- forming epochs ----------------------------------------------------------------------
    def form_initial(self, initial_workers: int, timeout_s: float) -> Formation:
        """Epoch 1: the first ``initial_workers`` members to arrive, in the natural order of their ids."""
        return self._guarded("forming the first membership", lambda: self._form_initial(initial_workers, timeout_s))

    def _form_initial(self, initial_workers: int, timeout_s: float) -> Formation:
        if self._has("current"):  # the job runs already: a replacement or an added worker
            return self._join(timeout_s)
        arrival = self._add("epoch1/count", 1)
        if arrival > initial_workers:  # too late for the first membership: join at the next change
            self._await_decision(1, time.monotonic() + timeout_s, "the first membership")
            return self._join(timeout_s)
        self.store.set(f"{self.prefix}epoch1/arrival/{arrival}", self.id)
        deadline = time.monotonic() + timeout_s
        if arrival == 1:  # the first to arrive decides
            while self._add("epoch1/count", 0) < initial_workers:
                if time.monotonic() > deadline:
                    raise RendezvousError(
                        f"member {self.id}: only {self._add('epoch1/count', 0)} of {initial_workers} workers arrived "
                        f"at the rendezvous within {timeout_s:g} s")
                time.sleep(_SLEEP_S)
            ids = [self.store.get(f"{self.prefix}epoch1/arrival/{i}").decode() for i in range(1, initial_workers + 1)]
            if len(set(ids)) != len(ids):
                raise RendezvousError(f"two workers arrived with the same member_id: {sorted(ids)}")
            if len(self.whole_nodes(ids)) != len(ids):
                nodes = sorted({self.node_of(m) for m in ids})
                raise RendezvousError(f"the first {initial_workers} workers do not make whole nodes of {self.node_size}: "
                                      f"nodes {nodes} with members {self.ordered(ids)}")
            self.store.compare_set(self.prefix + "epoch1/members", "", _encode(0, self.ordered(ids)))
        formation = self._await_decision(1, deadline, "the first membership")
        self._adopt(formation)
        return formation

    def _join(self, timeout_s: float) -> Formation:
        """Ask to be admitted, and wait (bounded) for the epoch whose members include this worker."""
        self.joining = True
        for key in ("admitted/", "leave/"):  # a replacement may reuse the id of the worker it replaces
            self.store.delete_key(self.prefix + key + self.id)
        i = self._add("joins", 1)
        self.store.set(f"{self.prefix}join/{i}", self.id)
        self._add("changes", 1)  # the members re-form at their next iteration and admit it
        deadline = time.monotonic() + timeout_s
        while True:
            if self._has("current"):
                epoch = int(self.store.get(self.prefix + "current"))
                formation = _decode(epoch, self.store.get(f"{self.prefix}epoch{epoch}/members"))
                if self.id in formation.members:
                    self._adopt(formation)
                    return formation
            if time.monotonic() > deadline:
                raise RendezvousError(f"member {self.id} asked to join but was not admitted within {timeout_s:g} s "
                                      "(are the members training? they admit new workers at their next iteration)")
            time.sleep(_SLEEP_S)

    def _joiners(self, old: Sequence[str], fresh: bool = False) -> List[str]:
        """Workers that asked to join, are beating and are not members yet, in order of asking
        (``fresh``: without looking at their heartbeats)."""
        out: List[str] = []
        for i in range(1, self._add("joins", 0) + 1):
            m = self.store.get(f"{self.prefix}join/{i}").decode()
            if m not in old and m not in out and not self._has("leave/" + m) and not self._has("admitted/" + m):
                self._nodes.pop(m, None)  # a replacement may reuse a former member's id on another node
                out.append(m)
        if fresh:
            return out
        stale = set(self._stale(out)) if out else set()
        return [m for m in out if m not in stale]

    def members_of(self, epoch: int) -> List[str]:
        """The member list of an earlier ``epoch``."""
        return self._guarded("reading the membership",
                             lambda: _decode(epoch, self.store.get(f"{self.prefix}epoch{epoch}/members")).members)

    def leave(self, timeout_s: float) -> None:
        """Leave the job cleanly: the others re-form without this worker at their next iteration;
        returns once they have decided the membership without it (bounded), so that this process
        may exit without its closing connections looking like a failure to them."""
        def go() -> None:
            assert self.formation is not None
            self.store.set(f"{self.prefix}leave/{self.id}", "1")
            self._add("changes", 1)
            key = f"epoch{self.formation.epoch + 1}/members"
            deadline = time.monotonic() + timeout_s
            while not self._has(key) and time.monotonic() < deadline:
                time.sleep(_SLEEP_S)
        self._guarded("leaving", go)
        self.stop()

    def _await_decision(self, epoch: int, deadline: float, what: str) -> Formation:
        key = f"epoch{epoch}/members"
        while not self._has(key):
            if time.monotonic() > deadline:
                raise RendezvousError(f"member {self.id}: {what} (epoch {epoch}) was not decided in time")
            time.sleep(_SLEEP_S)
        return _decode(epoch, self.store.get(self.prefix + key))

    def _adopt(self, formation: Formation) -> None:
        if self.id not in formation.members:
            raise EvictedError(
                f"member {self.id} was left out of epoch {formation.epoch} (members {formation.members}): the others "
                "found it unreachable or it was too late; start it again to join as a new worker")
        self.formation = formation
        self.store.set(self.prefix + "current", str(formation.epoch))
        self.store.set(f"{self.prefix}admitted/{self.id}", str(formation.epoch))

    def announce_change(self) -> None:
        """Wake the other members' pollers: a membership change has started."""
        self._guarded("announcing a membership change", lambda: self._add("changes", 1))

    def settled(self) -> None:
        """The new epoch is in use. (The poller's baseline stays where it was: any change announced
        meanwhile raises :attr:`changed`, and :meth:`confirm` sorts out the ones already handled.)"""

    def confirm(self) -> bool:
        """After :attr:`changed` rose: whether the membership must change now (a re-formation started
        by a peer, a worker asking to join, a member leaving); clears the flag either way."""
        def check() -> bool:
            self._changes_seen = self._add("changes", 0)  # before looking: a later change raises the flag again
            self.changed = False
            assert self.formation is not None
            members = self.formation.members
            if self._add(f"epoch{self.formation.epoch + 1}/announced", 0) > 0:
                return True
            return (any(self._has("leave/" + m) for m in members)
                    or bool(self.whole_nodes(self._joiners(members, fresh=True))))
        if self.store_lost is not None:
            raise RendezvousError(f"member {self.id}: the rendezvous store is unreachable ({self.store_lost}); it is "
                                  "the one process that must stay up (python -m decentpy.rendezvous)")
        return bool(self._guarded("reading the membership", check))

    def reform(self, suspected: Sequence[str], step: int, timeout_s: float) -> Formation:
        """Agree on the next epoch with the other survivors (see the module); ``suspected``: members
        this worker knows to be dead, ``step``: its step count."""
        return self._guarded("re-forming the membership", lambda: self._reform(suspected, step, timeout_s))

    def _reform(self, suspected: Sequence[str], step: int, timeout_s: float) -> Formation:
        assert self.formation is not None
        old = self.formation.members
        epoch = self.formation.epoch + 1
        here_key = f"epoch{epoch}/here/"
        self.store.set(self.prefix + here_key + self.id, f"{step}|{','.join(suspected)}")
        self._add(f"epoch{epoch}/announced", 1)
        self._add("changes", 1)
        deadline = time.monotonic() + timeout_s
        suspects = set(suspected)
        while not self._has(f"epoch{epoch}/members"):
            here = [m for m in old if m == self.id or self._has(here_key + m)]
            for m in here:  # what the others know to be dead is not waited for either
                suspects.update(x for x in self.store.get(self.prefix + here_key + m).decode().partition("|")[2]
                                .split(",") if x)
            waiting = [m for m in old if m not in here and m not in suspects and not self._has("leave/" + m)]
            if waiting:
                stale = set(self._stale(waiting))
                waiting = [m for m in waiting if m not in stale]
            if not waiting or time.monotonic() > deadline:
                start = max(int(self.store.get(self.prefix + here_key + m).decode().partition("|")[0]) for m in here)
                staying = self.whole_nodes([m for m in here if not self._has("leave/" + m)])
                members = staying + self.whole_nodes(self.ordered(self._joiners(old)))
                if self.id in members:  # a worker whose node is lost leaves the decision to the others
                    self.store.compare_set(f"{self.prefix}epoch{epoch}/members", "", _encode(start, members))
                break
            time.sleep(_SLEEP_S)
        formation = self._await_decision(epoch, deadline + 5.0, "the new membership")
        self._adopt(formation)
        return formation
