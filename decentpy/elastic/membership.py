"""Who is in the job, per epoch, agreed through a ``torch.distributed`` Store.

Every key lives under ``decentpy/elastic/<job>/`` in the rendezvous store (a TCPStore hosted by
``python -m decentpy.rendezvous``, or any c10d Store); with a job secret, under the job's
secret-derived namespace ``decentpy/elastic/<job>/k-<N>/`` instead, every value signed
(:mod:`.auth`: the record format, the instance nonce, what an outsider can and cannot do). A worker
is named by a stable *member id* (a string of the user's: host:slot, a pod name, "3"); its rank is
its position in the member list of the current epoch, which changes when the membership does.

* ``node/<id>``: the member's failure domain (its node with ``intra_node="allreduce"`` or ``"shard"``, else its
  own id); memberships hold whole nodes (:meth:`Membership.whole_nodes`), ranked node by node.
* ``beat/<id>``: a counter each member adds 1 to every :data:`HEARTBEAT_INTERVAL_S` (a daemon
  thread); a member whose counter stops for the liveness timeout is dead to the others.
* ``changes``: a counter bumped by whoever starts a membership change (a survivor that saw a peer
  fail); a poller thread per member reads it ten times a second and raises :attr:`Membership.changed`,
  so the per-step cost is one attribute read.
* ``instance`` (with a secret): the job instance's nonce, drawn by the first epoch's decider; the
  context of every record that must be fresh (requests to join, decisions, announcements).
* ``join/<slot>`` (``joins`` counts them): a worker asking to be admitted.
* ``epoch<e>/here/<id>``: member ``id`` takes part in forming epoch ``e`` (value: its step count,
  the members it knows to be dead, the members it leaves out).
* ``epoch<e>/members``: the decision, ``"<step>|<id>,<id>,..."`` (members in rank order, the step
  the epoch starts at), written once with ``compare_set`` (the first proposal wins, every member
  reads the same one).
* ``refused/<id>``: a joiner the members refused (its settings differ), with the reason.

Forming epoch ``e+1`` after a failure: each survivor announces itself and waits (bounded) until every
member of epoch ``e`` it does not know to be dead has announced itself or stopped beating; then it
proposes the announced members, in their old order, starting at the largest step any of them
reached. Epoch 1 is formed by the first ``initial_workers`` members to arrive, in the natural order of
their ids.

Every value read here is parsed as untrusted text: a record that does not parse, or (with a secret)
is not signed with the job's key for its key and instance, counts as absent and is named once in
the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from ..comm.exit import stop_at_exit
from .auth import SECRET_ENV, JobKey, describe_untrusted, new_instance_nonce

__all__ = ["Formation", "Membership", "RendezvousError", "EvictedError", "AdmissionError", "JoinRefusedError",
           "HEARTBEAT_INTERVAL_S", "POLL_INTERVAL_S"]

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
POLL_INTERVAL_S = 0.1  # how soon a member sees a change: the admission of a joiner waits for the last to see it
_SLEEP_S = 0.05
#: a non-blocking read: ``compare_set(key, _ABSENT, _ABSENT)`` returns the value, or _ABSENT when
#: the key is missing (``get`` would wait for it, up to the store's timeout)
_ABSENT = "\x00decentpy: absent\x00"
_PUBLIC_POLL_TICKS = 5       # the poller looks at the public requests every 5th tick (0.5 s)
_PUBLIC_BATCH = 64           # at most this many public requests are read per look (older ones are skipped)
_PUBLIC_RETRIES = 20         # a counted public slot with no record yet is looked at this many times
_NAMED_MAX = 1000            # outsiders named in the log, at most (then one summary line)
_MAX_ID = 128


class RendezvousError(RuntimeError):
    """The rendezvous store cannot be reached, or the membership could not be formed in time."""


class EvictedError(RuntimeError):
    """This worker was left out of the new membership (the others found it dead or too late)."""


class AdmissionError(RendezvousError):
    """This worker was not admitted to the job: it has no job secret or not the job's (the members
    refused it and named it in their logs), or the members refused its settings
    (:class:`JoinRefusedError`)."""


class JoinRefusedError(AdmissionError):
    """The members refused this joiner: one of its settings (``setting``) differs from theirs; the
    message names it and both values. The members go on without it."""

    def __init__(self, message: str, setting: str = "") -> None:
        super().__init__(message)
        self.setting = setting


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


def valid_id(value: str) -> bool:
    """A member id or node name: non-empty, short, without ``, | /`` or white space."""
    return (0 < len(value) <= _MAX_ID and value.isprintable()
            and not any(c in value for c in ",|/") and not any(c.isspace() for c in value))


def _encode(step: int, members: Sequence[str]) -> str:
    return f"{step}|{','.join(members)}"


def _decode(epoch: int, payload: str) -> Optional[Formation]:
    """A decision's payload, or None if it does not parse (a step, then valid distinct ids)."""
    step, sep, members = payload.partition("|")
    ids = [m for m in members.split(",") if m]
    if not sep or not step.isdigit() or not ids or len(set(ids)) != len(ids) or not all(map(valid_id, ids)):
        return None
    return Formation(epoch, ids, int(step))


def _parse_here(payload: str) -> Optional[Tuple[int, List[str], List[str]]]:
    """An announcement ``step|suspected,...|excluded,...`` (the third field may be absent)."""
    parts = payload.split("|")
    if len(parts) not in (2, 3) or not parts[0].isdigit():
        return None
    lists = [[m for m in part.split(",") if m] for part in parts[1:]] + [[]]
    if not all(valid_id(m) for ids in lists for m in ids):
        return None
    return int(parts[0]), lists[0], lists[1]


def _parse_count(value: Optional[bytes]) -> Optional[int]:
    """A counter's value read as text (a public counter is never ``add``-ed to: a value that is not
    a number would make the store drop the connection)."""
    if value is None:
        return 0
    text = value.decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() and len(text) < 19 else None


class Membership:
    """This worker's view of the job's membership (see the module): heartbeat, change poller, and
    the agreement on each epoch's member list. ``key``: the job's key (:mod:`.auth`), None for a
    job without a secret."""

    def __init__(self, store: Any, member_id: str, liveness_s: float, job: str = "default",
                 node: Optional[str] = None, node_size: int = 1, key: Optional[JobKey] = None) -> None:
        for what, value in (("member_id", member_id), ("node", node if node is not None else "x")):
            if not isinstance(value, str) or not valid_id(value):
                raise ValueError(f"{what} must be a non-empty string of at most {_MAX_ID} printable characters "
                                 f"without ',', '|', '/' or spaces, got {value!r}")
        self.store = store
        self.id = member_id
        self.job = job
        #: failure domains of ``node_size`` members (intra_node modes): a node is in a membership whole
        #: or not at all; ``node``: this member's (its member id when each member is its own domain)
        self.node = node if node is not None else member_id
        self.node_size = int(node_size)
        self._nodes: Dict[str, str] = {}  # member id -> node (read from the store once)
        self.liveness_s = float(liveness_s)
        self.key = key
        #: where a worker without the job's secret asks (and is answered): the unauthenticated layout
        self.public = f"decentpy/elastic/{job}/"
        #: where the membership lives: the public area without a secret, the job's namespace with one
        self.prefix = self.public + (f"{key.namespace}/" if key is not None else "")
        self.formation: Optional[Formation] = None
        self.joining = False           # this worker joined a running job (it receives its state from a member)
        self.changed = False           # set by the poller: someone started a membership change
        self.store_lost: Optional[str] = None
        self._changes_seen = 0
        self._seen: Dict[str, tuple] = {}  # id -> (beat count, when it last moved)
        self._instance: Optional[bytes] = None  # the job instance's nonce (with a secret), once read
        self._join_slots: Dict[int, Optional[str]] = {}  # join slot -> the id asking (None: not a valid request)
        self._warned: Set[str] = set()
        self._named: Set[str] = set()  # outsiders named in the log
        self._public_seen = 0
        self._public_pending: Dict[int, int] = {}  # counted public slots without a record yet -> looks
        self._public_request = False   # this worker asked in the public area (no secret, or not the job's)
        self._stop = threading.Event()
        try:
            self._put("node/" + member_id, self.node, fresh=False)
            self._add("beat/" + member_id, 1)
            if key is not None:
                self._public_seen = self._public_count() or 0
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

    def _peek(self, full_key: str) -> Optional[bytes]:
        """The value at ``full_key`` or None, in one store operation that never waits."""
        value = self.store.compare_set(full_key, _ABSENT, _ABSENT)
        value = value.encode() if isinstance(value, str) else bytes(value)
        return None if value == _ABSENT.encode() else value

    @property
    def context(self) -> bytes:
        """The job instance's nonce (the context of fresh records); empty without a secret or
        before the first epoch was decided."""
        if self.key is None:
            return b""
        if self._instance is None:
            payload = self._read("instance", fresh=False)
            if payload is not None:
                self._instance = payload.encode()
        return self._instance or b""

    def _seal(self, key: str, payload: str, fresh: bool = True) -> str:
        """``payload`` as stored at ``key`` (signed with the job's key and, if ``fresh``, the
        instance nonce)."""
        if self.key is None:
            return payload
        return self.key.sign(self.prefix + key, payload, self.context if fresh else b"")

    def _put(self, key: str, payload: str, fresh: bool = True) -> None:
        self.store.set(self.prefix + key, self._seal(key, payload, fresh))

    def _read(self, key: str, fresh: bool = True) -> Optional[str]:
        """The payload of record ``key``, or None if it is absent or (with a secret) not signed with
        the job's key for this key and instance (named once in the log)."""
        raw = self._peek(self.prefix + key)
        if raw is None:
            return None
        if self.key is None:
            return raw.decode("utf-8", errors="replace")
        context = self.context if fresh else b""
        if fresh and not context:
            return None  # the instance is not known yet: nothing fresh can be checked
        payload = self.key.verify(self.prefix + key, raw, context)
        if payload is None:
            self._warn_once(key, "decentpy.elastic: member %s: record %r is not signed with the job secret for this "
                            "key and job instance: ignored", self.id, key)
        return payload

    def _valid(self, key: str) -> bool:
        return self._read(key) is not None

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned and len(self._warned) < _NAMED_MAX:
            self._warned.add(what)
            logger.warning(message, *args)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._add("beat/" + self.id, 1)
            except Exception as exc:  # noqa: BLE001 - the rendezvous host is gone
                self.store_lost = str(exc).splitlines()[0][:200]
                self.changed = True
                return

    def _poll(self) -> None:
        tick = 0
        while not self._stop.wait(POLL_INTERVAL_S):
            tick += 1
            try:
                if self._add("changes", 0) != self._changes_seen:
                    self.changed = True
                elif self.key is not None and tick % _PUBLIC_POLL_TICKS == 0 and self._public_requests() > 0:
                    self.changed = True  # a request without the secret: named and answered at the next confirm()
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

    # -- admission: the public area ------------------------------------------------------------
    def _public_count(self) -> Optional[int]:
        """How many requests the public area counts (None: its counter holds something else)."""
        count = _parse_count(self._peek(self.public + "joins"))
        if count is None:
            self._warn_once("public joins", "decentpy.elastic: member %s: the public join counter (%sjoins) does not "
                            "hold a number: ignored (written by a process without the job secret)", self.id,
                            self.public)
        return count

    def _public_requests(self) -> int:
        """How many requests in the public area this member has not looked at yet (when an outsider
        overwrote the counter with something else: the slots after the last one seen, while there
        are any)."""
        count = self._public_count()
        if count is not None:
            return max(0, count - self._public_seen)
        n = 0
        while n < _PUBLIC_BATCH and self._peek(f"{self.public}join/{self._public_seen + n + 1}") is not None:
            n += 1
        return n

    def _check_admission(self, timeout_s: float) -> None:
        """Before anything else: whether this worker may take part at all. A worker without a
        secret at a job that has one asks in the public area and raises :class:`AdmissionError`
        with the members' answer; a worker with a secret at a job that runs without one raises; a
        worker whose secret does not sign the job's marker asks in the public area too (then
        goes on: a refusal from the members ends its wait, see :meth:`_admission_poll`)."""
        marker = self._peek(self.public + "secured")
        if self.key is None:
            if marker is not None:
                self._refused_without_secret(timeout_s)
            return
        if self._has("current"):  # the job runs under this key: nothing in the public area matters
            return
        if marker is None:
            if self._peek(self.public + "current") is not None:
                raise self._not_admitted(
                    f"member {self.id}: job {self.job!r} at this store runs without a job secret, and this worker has "
                    f"one (secret= or {SECRET_ENV}): give every worker of a job the same secret, or none")
            return
        if self.key.verify(self.public + "secured", marker) is None:
            self._post_public_request()

    def _post_public_request(self) -> None:
        """Ask in the public area, where the members name requests without the job's key."""
        self._public_request = True
        try:
            self.store.delete_key(self.public + "refused/" + self.id)  # an answer to an earlier attempt
            slot = int(self.store.add(self.public + "joins", 1))
            key = f"{self.public}join/{slot}"
            self.store.set(key, self.key.sign(key, self.id) if self.key is not None else self.id)
        except Exception:  # noqa: BLE001 - a public counter an outsider broke: this worker just is not named
            logger.debug("could not post the public request", exc_info=True)

    def _public_answer(self) -> Optional[str]:
        raw = self._peek(self.public + "refused/" + self.id)
        return describe_untrusted(raw, 300) if raw is not None else None

    def _not_admitted(self, message: str) -> AdmissionError:
        self.stop()
        return AdmissionError(message)

    def _refused_without_secret(self, timeout_s: float) -> None:
        self._post_public_request()
        deadline = time.monotonic() + timeout_s
        answer = self._public_answer()
        while answer is None and time.monotonic() < deadline:
            time.sleep(_SLEEP_S)
            answer = self._public_answer()
        said = f"the members answered: {answer}" if answer is not None else f"no member answered within {timeout_s:g} s"
        raise self._not_admitted(
            f"member {self.id} was not admitted: job {self.job!r} admits only workers that hold its job secret, and "
            f"this worker has none ({said}); pass the job's secret as ElasticGossip(secret=...) or in {SECRET_ENV}")

    def _admission_poll(self) -> None:
        """In every wait for a decision: a worker without a secret whose job turns out to have one,
        or a worker the members answered in the public area, stops waiting."""
        if self.key is None:
            if not self._public_request and self._peek(self.public + "secured") is not None:
                self._refused_without_secret(5.0)
            return
        if self._public_request:
            answer = self._public_answer()
            if answer is not None:
                raise self._not_admitted(
                    f"member {self.id} was not admitted: the members of job {self.job!r} refused it ({answer}): its "
                    f"job secret (secret= or {SECRET_ENV}) is not the job's")

    def _answer_public(self) -> None:
        """Name every new request in the public area that is not signed with the job's key, once,
        and answer it with a signed ``refused/<id>``. Bounded: at most :data:`_PUBLIC_BATCH` new
        requests per look (an outsider bumping the counter costs a few reads, never more)."""
        assert self.key is not None
        count = self._public_seen + self._public_requests()
        new = list(range(self._public_seen + 1, count + 1))
        if len(new) > _PUBLIC_BATCH:
            self._warn_once(f"skipped {count}", "decentpy.elastic: member %s: %d requests in the public area at once; "
                            "only the last %d are read", self.id, len(new), _PUBLIC_BATCH)
            new = new[-_PUBLIC_BATCH:]
        self._public_seen = max(self._public_seen, count)
        for slot in sorted(self._public_pending) + new:
            key = f"{self.public}join/{slot}"
            raw = self._peek(key)
            if raw is None:
                looks = self._public_pending.get(slot, 0) + 1
                room = slot in self._public_pending or len(self._public_pending) < _PUBLIC_BATCH
                if looks < _PUBLIC_RETRIES and room:  # (bounded: a counter bumped without records costs no more)
                    self._public_pending[slot] = looks
                else:
                    self._public_pending.pop(slot, None)
                continue
            self._public_pending.pop(slot, None)
            if self.key.verify(key, raw) is None:  # (signed with the job's key: it joins through the namespace)
                self._refuse_outsider(describe_untrusted(raw))

    def _refuse_outsider(self, claimed: str) -> None:
        if claimed in self._named:
            return
        if len(self._named) >= _NAMED_MAX:
            self._warn_once("too many", "decentpy.elastic: member %s: more than %d workers asked to join without the "
                            "job secret; no longer naming them", self.id, _NAMED_MAX)
            return
        self._named.add(claimed)
        logger.warning("decentpy.elastic: member %s: member %r asked to join without the job secret (its request is "
                       "not signed with the job's key): refused", self.id, claimed)
        if valid_id(claimed):
            key = f"{self.public}refused/{claimed}"
            self.store.set(key, self.key.sign(key, "asked to join without the job secret: refused")
                           if self.key is not None else "refused")

    # -- failure domains --------------------------------------------------------------------
    def node_of(self, member_id: str) -> str:
        if member_id not in self._nodes:
            node = self._read(f"node/{member_id}", fresh=False)
            self._nodes[member_id] = node if node is not None and valid_id(node) else member_id
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
        try:
            return self._guarded("forming the first membership",
                                 lambda: self._form_initial(initial_workers, timeout_s))
        except AdmissionError:
            raise
        except RendezvousError as exc:
            if self._public_request:  # the job's marker is not signed with this worker's key
                raise self._not_admitted(
                    f"{exc} -- and job {self.job!r}'s marker in the store is not signed with this worker's secret: is "
                    f"the secret (secret= or {SECRET_ENV}) the job's?") from exc
            raise

    def _form_initial(self, initial_workers: int, timeout_s: float) -> Formation:
        self._check_admission(timeout_s)
        if self._has("current"):  # the job runs already: a replacement or an added worker
            return self._join(timeout_s)
        deadline = time.monotonic() + timeout_s
        arrival = self._add("epoch1/count", 1)
        if arrival > initial_workers:  # too late for the first membership: join at the next change
            self._await_decision(1, deadline, "the first membership")
            return self._join(timeout_s)
        self._put(f"epoch1/arrival/{arrival}", self.id, fresh=False)
        if arrival == 1:  # the first to arrive decides
            ids = self._arrivals(initial_workers, deadline, timeout_s)
            if self._public_request:  # the job's marker is not signed with this key: its members may answer first
                wait_until = min(deadline, time.monotonic() + 10.0)
                while time.monotonic() < wait_until:
                    self._admission_poll()
                    time.sleep(_SLEEP_S)
            if len(set(ids)) != len(ids):
                raise RendezvousError(f"two workers arrived with the same member_id: {sorted(ids)}")
            if len(self.whole_nodes(ids)) != len(ids):
                nodes = sorted({self.node_of(m) for m in ids})
                raise RendezvousError(f"the first {initial_workers} workers do not make whole nodes of {self.node_size}: "
                                      f"nodes {nodes} with members {self.ordered(ids)}")
            if self.key is not None:  # this job instance's nonce, before anything that must be fresh
                self.store.compare_set(self.prefix + "instance", "", self._seal("instance", new_instance_nonce(),
                                                                                fresh=False))
            self.store.compare_set(self.prefix + "epoch1/members", "", self._seal("epoch1/members",
                                                                                  _encode(0, self.ordered(ids))))
        formation = self._await_decision(1, deadline, "the first membership")
        self._adopt(formation)
        return formation

    def _arrivals(self, initial_workers: int, deadline: float, timeout_s: float) -> List[str]:
        """The first ``initial_workers`` arrivals' ids, once all of them wrote theirs (bounded)."""
        ids: Dict[int, str] = {}
        while True:
            self._admission_poll()
            if self._add("epoch1/count", 0) >= initial_workers:
                for i in range(1, initial_workers + 1):
                    if i not in ids:
                        m = self._read(f"epoch1/arrival/{i}", fresh=False)
                        if m is not None and valid_id(m):
                            ids[i] = m
                if len(ids) == initial_workers:
                    return [ids[i] for i in range(1, initial_workers + 1)]
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"member {self.id}: only {min(self._add('epoch1/count', 0), initial_workers)} of {initial_workers} "
                    f"workers arrived at the rendezvous within {timeout_s:g} s")
            time.sleep(_SLEEP_S)

    def _join(self, timeout_s: float) -> Formation:
        """Ask to be admitted, and wait (bounded) for the epoch whose members include this worker."""
        self.joining = True
        deadline = time.monotonic() + timeout_s
        for key in ("admitted/", "leave/", "refused/"):  # a replacement may reuse the id of the worker it replaces
            self.store.delete_key(self.prefix + key + self.id)
        while self.key is not None and not self.context:  # the request is signed over the instance's nonce
            self._admission_poll()
            if time.monotonic() > deadline:
                raise self._not_admitted(f"member {self.id}: job {self.job!r} has no valid instance record: cannot ask "
                                         "to join")
            time.sleep(_SLEEP_S)
        i = self._add("joins", 1)
        self._put(f"join/{i}", self.id)
        self._add("changes", 1)  # the members re-form at their next iteration and admit it
        while True:
            self._admission_poll()
            refused = self._read("refused/" + self.id)
            if refused is not None:
                raise self._refused(refused)
            epoch = self._current_epoch()
            if epoch is not None:
                formation = self._decision(epoch)
                if formation is not None and self.id in formation.members:
                    self._adopt(formation)
                    return formation
            if time.monotonic() > deadline:
                raise self._not_admitted(
                    f"member {self.id} asked to join but was not admitted within {timeout_s:g} s (are the members "
                    "training? they admit new workers at their next iteration)")
            time.sleep(_SLEEP_S)

    def _refused(self, reason: str) -> JoinRefusedError:
        self.stop()
        return JoinRefusedError(f"member {self.id} was refused by the members of job {self.job!r}: {reason}")

    def _current_epoch(self) -> Optional[int]:
        value = self._read("current")
        if value is None or not value.isdigit():
            return None
        return int(value)

    def _decision(self, epoch: int) -> Optional[Formation]:
        """Epoch ``epoch``'s member list, or None if it is not decided (or its record is not valid)."""
        payload = self._read(f"epoch{epoch}/members")
        if payload is None:
            return None
        formation = _decode(epoch, payload)
        if formation is None:
            self._warn_once(f"decision {epoch}", "decentpy.elastic: member %s: the member list of epoch %d does not "
                            "parse (%r): ignored", self.id, epoch, payload[:200])
        return formation

    def _joiners(self, old: Sequence[str], fresh: bool = False, exclude: Sequence[str] = ()) -> List[str]:
        """Workers that asked to join, are beating and are not members yet, in order of asking
        (``fresh``: without looking at their heartbeats), except those in ``exclude``."""
        out: List[str] = []
        for i in range(1, self._add("joins", 0) + 1):
            m = self._join_slot(i)
            if (m is None or m in old or m in out or m in exclude or self._valid("admitted/" + m)
                    or self._valid("leave/" + m) or self._valid("refused/" + m)):
                continue
            self._nodes.pop(m, None)  # a replacement may reuse a former member's id on another node
            out.append(m)
        if fresh:
            return out
        stale = set(self._stale(out)) if out else set()
        return [m for m in out if m not in stale]

    def _join_slot(self, slot: int) -> Optional[str]:
        """The id asking in join slot ``slot`` (read once), or None."""
        if slot in self._join_slots:
            return self._join_slots[slot]
        if self._peek(self.prefix + f"join/{slot}") is None:
            return None  # counted, not written yet: looked at again next time
        m = self._read(f"join/{slot}")
        if m is not None and not valid_id(m):
            self._warn_once(f"join {slot}", "decentpy.elastic: member %s: join request %d names no valid member id "
                            "(%r): ignored", self.id, slot, m[:80])
            m = None
        if m is not None or self.key is None or self.context:
            self._join_slots[slot] = m
        return m

    def members_of(self, epoch: int) -> List[str]:
        """The member list of an earlier ``epoch``."""
        def read() -> List[str]:
            formation = self._decision(epoch)
            if formation is None:
                raise RendezvousError(f"member {self.id}: the member list of epoch {epoch} is missing or not valid")
            return formation.members
        return self._guarded("reading the membership", read)

    def leave(self, timeout_s: float) -> None:
        """Leave the job cleanly: the others re-form without this worker at their next iteration;
        returns once they have decided the membership without it (bounded), so that this process
        may exit without its closing connections looking like a failure to them."""
        def go() -> None:
            assert self.formation is not None
            self._put(f"leave/{self.id}", "1")
            self._add("changes", 1)
            key = f"epoch{self.formation.epoch + 1}/members"
            deadline = time.monotonic() + timeout_s
            while not self._has(key) and time.monotonic() < deadline:
                time.sleep(_SLEEP_S)
        self._guarded("leaving", go)
        self.stop()

    def refuse(self, member_id: str, reason: str) -> None:
        """Record that the members refused joiner ``member_id`` (``reason``: what the joiner reads)."""
        self._guarded("refusing a joiner", lambda: self._put(f"refused/{member_id}", reason[:4000]))

    def pg_prefix(self, epoch: int) -> str:
        """Where epoch ``epoch``'s process group meets in the store (with a secret: a name derived
        from it and the job instance, so that an outsider cannot find it)."""
        base = f"{self.prefix}epoch{epoch}/pg"
        return base if self.key is None else f"{base}-{self.key.group_suffix(epoch, self.context)}"

    def _await_decision(self, epoch: int, deadline: float, what: str) -> Formation:
        while True:
            self._admission_poll()
            formation = self._decision(epoch)
            if formation is not None:
                return formation
            if time.monotonic() > deadline:
                raise RendezvousError(f"member {self.id}: {what} (epoch {epoch}) was not decided in time")
            time.sleep(_SLEEP_S)

    def _adopt(self, formation: Formation) -> None:
        if self.id not in formation.members:
            raise EvictedError(
                f"member {self.id} was left out of epoch {formation.epoch} (members {formation.members}): the others "
                "found it unreachable or it was too late; start it again to join as a new worker")
        self.formation = formation
        self._put("current", str(formation.epoch))
        self._put(f"admitted/{self.id}", str(formation.epoch))
        if self.key is not None:  # tell workers without the secret that this job needs one (and that theirs is not it)
            key = self.public + "secured"
            marker = self._peek(key)
            if marker is None or self.key.verify(key, marker) is None:
                self.store.set(key, self.key.sign(key, "this job admits only workers holding its job secret"))

    def announce_change(self) -> None:
        """Wake the other members' pollers: a membership change has started."""
        self._guarded("announcing a membership change", lambda: self._add("changes", 1))

    def settled(self) -> None:
        """The new epoch is in use. (The poller's baseline stays where it was: any change announced
        meanwhile raises :attr:`changed`, and :meth:`confirm` sorts out the ones already handled.)"""

    def confirm(self) -> bool:
        """After :attr:`changed` rose: whether the membership must change now (a re-formation started
        by a peer, a worker asking to join, a member leaving); clears the flag either way. Requests
        without the job secret are named and answered here, and change nothing."""
        def check() -> bool:
            self._changes_seen = self._add("changes", 0)  # before looking: a later change raises the flag again
            self.changed = False
            if self.key is not None:
                self._answer_public()
            assert self.formation is not None
            members = self.formation.members
            if self._add(f"epoch{self.formation.epoch + 1}/announced", 0) > 0:
                return True
            return (any(self._valid("leave/" + m) for m in members)
                    or bool(self.whole_nodes(self._joiners(members, fresh=True))))
        if self.store_lost is not None:
            raise RendezvousError(f"member {self.id}: the rendezvous store is unreachable ({self.store_lost}); it is "
                                  "the one process that must stay up (python -m decentpy.rendezvous)")
        return bool(self._guarded("reading the membership", check))

    def reform(self, suspected: Sequence[str], step: int, timeout_s: float, exclude: Sequence[str] = ()) -> Formation:
        """Agree on the next epoch with the other survivors (see the module); ``suspected``: members
        this worker knows to be dead, ``step``: its step count, ``exclude``: members and joiners to
        leave out (refused, or failed the group's handshake)."""
        return self._guarded("re-forming the membership",
                             lambda: self._reform(suspected, step, timeout_s, exclude))

    def _reform(self, suspected: Sequence[str], step: int, timeout_s: float, exclude: Sequence[str]) -> Formation:
        assert self.formation is not None
        old = self.formation.members
        epoch = self.formation.epoch + 1
        here_key = f"epoch{epoch}/here/"
        self._put(here_key + self.id, f"{step}|{','.join(suspected)}|{','.join(exclude)}")
        self._add(f"epoch{epoch}/announced", 1)
        self._add("changes", 1)
        deadline = time.monotonic() + timeout_s
        suspects = set(suspected)
        excluded = set(exclude)
        while not self._has(f"epoch{epoch}/members"):
            announced: Dict[str, Tuple[int, List[str], List[str]]] = {}
            for m in old:
                payload = self._read(here_key + m)
                parsed = _parse_here(payload) if payload is not None else None
                if parsed is not None:
                    announced[m] = parsed
            announced[self.id] = (step, list(suspected), list(exclude))  # (its own, as it wrote it)
            here = [m for m in old if m in announced]
            for m in here:  # what the others know to be dead is not waited for either, what they leave out neither
                suspects.update(announced[m][1])
                excluded.update(announced[m][2])
            waiting = [m for m in old if m not in here and m not in suspects and m not in excluded
                       and not self._valid("leave/" + m)]
            if waiting:
                stale = set(self._stale(waiting))
                waiting = [m for m in waiting if m not in stale]
            if not waiting or time.monotonic() > deadline:
                start = max(announced[m][0] for m in here)
                staying = self.whole_nodes([m for m in here if m not in excluded and not self._valid("leave/" + m)])
                members = staying + self.whole_nodes(self.ordered(self._joiners(old, exclude=sorted(excluded))))
                if self.id in members:  # a worker whose node is lost leaves the decision to the others
                    self.store.compare_set(f"{self.prefix}epoch{epoch}/members", "",
                                           self._seal(f"epoch{epoch}/members", _encode(start, members)))
                break
            time.sleep(_SLEEP_S)
        formation = self._await_decision(epoch, deadline + 5.0, "the new membership")
        self._adopt(formation)
        return formation
