""":class:`ElasticGossip`: gossip training that survives a dead peer.

It owns one :class:`~decentpy.DecentralizedDataParallel` per *epoch* (a fixed membership) over
torch's default process group, which it creates for each epoch on a fresh prefix of the rendezvous
store (gloo, the members renumbered ``0..n-1``). When a peer fails, the strategy
(:mod:`.strategy`) finishes the step locally; before the next forward the survivors agree on the new
member list (:mod:`.membership`), the default process group is replaced by one over them, and a new
inner wrapper is built over the same model -- the topology re-made for the new ``n``, each survivor
keeping its own parameters, optimizer and scheduler state (moved across with
``training_state_dict()`` / ``load_training_state_dict()``, no broadcast) -- and training goes on.

With a job secret (:mod:`.auth`) every membership record is signed and every epoch's group runs a
challenge-response before anything else; a joiner whose settings differ from the members' is
refused (it raises :class:`~decentpy.elastic.JoinRefusedError`) and the members go on without it.
What crosses between members (a joiner's state) is plain data (:mod:`decentpy.comm.wire`), never
pickle.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from ..comm import MalformedMessageError, PeerTimeoutError, PeerUnreachableError, SettingsMismatchError
from ..comm.wire import recv_state, send_state
from ..ddp import DecentralizedDataParallel
from ..engine import NODE_MODES
from ..engine.layout import OptimFn, SchedulerFn
from ..topology import Topology, TopologyError, make_topology, node_topology
from .auth import SECRET_ENV, JobKey, handshake, resolve_secret
from .membership import AdmissionError, EvictedError, Formation, JoinRefusedError, Membership, RendezvousError
from ..engine.failure import ElasticPolicy

__all__ = ["ElasticGossip", "MembershipChange"]

logger = logging.getLogger("decentpy.elastic")

_WARNED_NO_SECRET = False
#: joiners refused in one membership change, at most (each refusal is one more attempt at the epoch)
_MAX_REFUSALS = 8


def _warn_no_secret(job: str) -> None:
    """Once per process: an elastic job without a secret admits anyone who reaches its store."""
    global _WARNED_NO_SECRET
    if not _WARNED_NO_SECRET:
        _WARNED_NO_SECRET = True
        logger.warning("decentpy.elastic: job %r runs without a job secret: anyone who can reach the rendezvous store "
                       "can join the job and read the model; pass ElasticGossip(secret=...) or set %s on every "
                       "worker (docs/security.md)", job, SECRET_ENV)


class _Unauthenticated(RuntimeError):
    """Members of a new group that failed its handshake (named in the log; left out)."""

    def __init__(self, ids: Sequence[str]) -> None:
        super().__init__(f"member(s) {list(ids)} failed the group's handshake")
        self.ids = list(ids)


@dataclass(frozen=True)
class MembershipChange:
    """What the callback gets (and :attr:`ElasticGossip.history` keeps) at every membership change."""

    epoch: int
    step: int                 #: the step count training goes on from
    members: Tuple[str, ...]  #: member ids in rank order
    rank: int                 #: this worker's new rank
    world_size: int
    left: Tuple[str, ...] = ()
    joined: Tuple[str, ...] = ()
    reform_s: float = 0.0     #: from the start of this worker's re-formation to the new group in use
    detect_s: Optional[float] = None  #: how long the failed wait lasted before the failure was classified
    cause: str = ""


def _warm_up() -> None:
    """torch's one-time work at a process's first optimizer (its lazy import of ``torch._dynamo``,
    ~1 s here), done before this worker asks to join: the members would otherwise wait for it in
    the new epoch's first collective (measured: it was most of a joiner's ~1.2 s admission pause)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


class _EpochDDP(DecentralizedDataParallel):
    """The inner wrapper of one epoch: gossip (plain, of nodes, compressed or not) whose step degrades
    to local after a peer failure (the elastic failure policy)."""

    _failure_policy = ElasticPolicy.name

    def elastic_policy(self) -> ElasticPolicy:
        """The strategy's failure policy: the iteration's failure, and :meth:`ElasticPolicy.abandon`."""
        policy = self._strategy.policy
        assert isinstance(policy, ElasticPolicy), "internal error: an epoch's strategy runs the elastic policy"
        return policy


class ElasticGossip(nn.Module):
    """Gossip data parallelism over a membership that changes: a worker that dies is dropped, the
    survivors rebuild the topology over themselves and go on (see docs/elastic.md).

    Args:
        model, optim_fn, lr_scheduler_fn, topology: as for :class:`~decentpy.DecentralizedDataParallel`;
            ``topology`` must be a registered name (it is re-made for every membership size).
        store: the rendezvous store (:func:`decentpy.elastic.connect`, or any c10d Store every worker
            reaches). Do not call ``init_process_group`` yourself: the wrapper creates the default
            process group for each membership (gloo, the members numbered ``0..n-1``).
        member_id: this worker's stable name (unique in the job; no ``, | /`` or spaces).
        initial_workers: how many workers form the first membership.
        timeout: bound on every wait (rendezvous, exchanges of a slow but alive peer).
        peer_liveness_timeout: a member whose heartbeat stops this long is dead (an exchange with a
            killed process fails within ~2.5 s anyway, its connection closing).
        reform_timeout: bound on one re-formation, and on the set-up of each membership's process
            group and wrapper (the state transfer to a joiner included); default ``timeout``.
        on_membership_change: ``callback(change: MembershipChange)``, called on every worker after
            each membership change, before the next forward (rebuild a ``DistributedSampler`` there).
        job: a name that separates jobs sharing one rendezvous store.
        secret: the job secret (bytes or str; default: the ``DECENTPY_JOB_SECRET`` environment
            variable), the same on every worker. Only workers holding it are admitted: every
            membership record is signed with a key derived from it (HMAC-SHA256) and every
            membership's process group authenticates its ranks before use; a worker without it
            raises :class:`~decentpy.elastic.AdmissionError` and is named in the members' logs.
            Without a secret the job admits anyone who reaches the store (one warning per
            process). See docs/security.md; e.g. ``secrets.token_hex(32)``.
        node_id: with ``intra_node='allreduce'`` or ``'shard'``, this worker's node (default: the host
            name): the failure domain. A node is in a membership whole or not at all: when one of
            its ``local_world_size`` workers dies, the others of that node are left out too (they
            raise :class:`~decentpy.elastic.EvictedError`), and a replacement node joins once all of
            its workers asked. Not used with ``intra_node='gossip'`` (each worker is its own domain).
        **ddp_kwargs: further arguments of ``DecentralizedDataParallel`` (``bucket_size_in_mb``,
            ``grad_clip_norm``, ``scaler``, ``local_world_size``, ``nonfinite``, ...).
    """

    def __init__(self, model: nn.Module, optim_fn: OptimFn, lr_scheduler_fn: Optional[SchedulerFn] = None,
                 topology: str = "complete", *, store: Any, member_id: str, initial_workers: int,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=60),
                 peer_liveness_timeout: datetime.timedelta = datetime.timedelta(seconds=10),
                 reform_timeout: Optional[datetime.timedelta] = None,
                 on_membership_change: Optional[Callable[[MembershipChange], None]] = None,
                 job: str = "default", node_id: Optional[str] = None, secret: Union[None, bytes, str] = None,
                 **ddp_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(topology, str):
            raise TypeError(f"ElasticGossip needs a topology name (it is re-made for every membership size), got "
                            f"{type(topology).__name__}; use one of decentpy.available_topologies()")
        from ..pipeline import AsyncPipe
        from ..sharding import ShardedDataParallel
        if isinstance(model, (AsyncPipe, ShardedDataParallel, DecentralizedDataParallel)):
            raise TypeError(f"ElasticGossip wraps a plain model; {type(model).__name__} (pipelines, sharded or already "
                            "wrapped models) is not elastic yet")
        if "process_group" in ddp_kwargs:
            raise ValueError("ElasticGossip does not take process_group=: it owns the default process group (one per "
                             "membership epoch, over every member); sub-group gossip is not elastic yet")
        intra_node = ddp_kwargs.get("intra_node", "gossip")
        if intra_node not in NODE_MODES:
            raise ValueError(f"intra_node must be one of {', '.join(map(repr, NODE_MODES))}, got {intra_node!r}")
        if ddp_kwargs.get("comm", "torch") not in ("torch", "auto"):
            raise ValueError(f"ElasticGossip runs on gloo through torch.distributed (comm='torch'); comm="
                             f"{ddp_kwargs['comm']!r} (decentpy's NCCL communicator) is not elastic yet")
        if peer_liveness_timeout is None:
            raise ValueError("ElasticGossip needs heartbeats: peer_liveness_timeout cannot be None")
        if int(initial_workers) < 1:
            raise ValueError(f"initial_workers must be >= 1, got {initial_workers}")
        if dist.is_initialized():
            raise RuntimeError("ElasticGossip creates the default process group itself (one per membership); "
                               "do not call torch.distributed.init_process_group in an elastic worker")
        job_secret = resolve_secret(secret)
        key = JobKey(job_secret, job) if job_secret is not None else None
        if key is None:
            _warn_no_secret(job)
        self._key = key
        self._model = model
        self._optim_fn = optim_fn
        self._lr_scheduler_fn = lr_scheduler_fn
        self._topology_name = topology
        self._store = store
        self._timeout = timeout
        self._liveness = peer_liveness_timeout
        self._reform_timeout = reform_timeout if reform_timeout is not None else timeout
        self._callback = on_membership_change
        self._ddp_kwargs = {k: v for k, v in ddp_kwargs.items() if k != "comm"}
        self._intra_node = intra_node
        # the failure domain: a node of local_world_size workers (intra_node modes), else the worker
        self._node_size = (int(ddp_kwargs.get("local_world_size") or os.environ.get("LOCAL_WORLD_SIZE", "1"))
                           if intra_node != "gossip" else 1)
        if intra_node != "gossip":
            import socket
            node_id = node_id if node_id is not None else socket.gethostname()
            self._ddp_kwargs["local_world_size"] = self._node_size
        else:
            node_id = None
        self._graveyard: List[Any] = []  # old epochs' communicators: never torn down while peers may hold them
        self._closed = False
        self._settled = False  # update() ran since the last forward
        self.history: List[MembershipChange] = []
        if int(initial_workers) % self._node_size:
            raise ValueError(f"initial_workers={initial_workers} is not a whole number of nodes of local_world_size="
                             f"{self._node_size} workers (intra_node={intra_node!r}: the node is the failure domain)")
        # the topology must be defined for the first membership (later sizes fall back to 'ring' where it is not)
        self._check_topology(topology, int(initial_workers))
        _warm_up()
        self._membership = Membership(store, member_id, peer_liveness_timeout.total_seconds(), job, node=node_id,
                                      node_size=self._node_size, key=key)
        t0 = time.monotonic()
        formation = self._membership.form_initial(int(initial_workers), timeout.total_seconds())
        joining = self._membership.joining
        # a joiner's state comes from a member of the running job (see _transfer)
        known = self._membership.members_of(formation.epoch - 1) if joining else []
        formation, self._inner = self._establish(formation, None, known, joining)
        self._membership.settled()
        self._record(formation, (), (member_id,) if joining else tuple(formation.members), time.monotonic() - t0,
                     None, "joined a running job" if joining else "start")

    # -- what the user reads -------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._model

    @property
    def ddp(self) -> DecentralizedDataParallel:
        """The current epoch's inner wrapper (replaced at every membership change)."""
        return self._inner

    @property
    def members(self) -> Tuple[str, ...]:
        """Member ids of the current epoch, in rank order."""
        assert self._membership.formation is not None
        return tuple(self._membership.formation.members)

    @property
    def epoch(self) -> int:
        assert self._membership.formation is not None
        return self._membership.formation.epoch

    @property
    def rank(self) -> int:
        return self._inner.group_rank

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def topology(self) -> Topology:
        """The topology in use (over the current members)."""
        return self._inner.topology

    @property
    def step_count(self) -> int:
        return self._inner.step_count

    # -- training ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # after update() this iteration's membership is settled: a change announced since waits for
        # the next iteration (the caller drew its data for the step and rank update() left)
        settled, self._settled = self._settled, False
        if self._failed() or (not settled and self._membership.changed and self._membership.confirm()):
            self._reform()
        return self._inner(*args, **kwargs)

    def _failed(self) -> bool:
        """Whether the last iteration met a peer failure. Waits for what the node still gathers of
        it first (``intra_node='shard'``: a dead partner shows there, and the forward must not run
        on half-gathered parameters)."""
        policy = self._inner.elastic_policy()
        policy.wait_params()
        return policy.failure is not None

    def update(self) -> Optional[MembershipChange]:
        """Apply a pending membership change now, e.g. at the top of the training loop, so that
        :attr:`step_count`, :attr:`rank` and :attr:`world_size` read afterwards are those the next
        forward runs with: a change announced after this call is applied at the next iteration
        (without update(), the forward applies pending changes itself). Returns the change, or None."""
        self._settled = True
        if self._failed() or (self._membership.changed and self._membership.confirm()):
            self._reform()
            return self.history[-1]
        return None

    def global_avg(self, *args: Any, **kwargs: Any) -> Any:
        self._current()
        return self._inner.global_avg(*args, **kwargs)

    def consensus_distance(self) -> float:
        self._current()
        return self._inner.consensus_distance()

    def training_state_dict(self) -> Dict[str, Any]:
        """This member's training state (the inner wrapper's, see
        :meth:`DecentralizedDataParallel.training_state_dict`), after any pending re-formation."""
        self._current()
        return self._inner.training_state_dict()

    def load_training_state_dict(self, state: Dict[str, Any], strict: bool = True) -> Any:
        """Resume from :meth:`training_state_dict`, e.g. after the whole job was restarted: every
        member loads the state it saved, in a membership of the same size (members are ranked by
        their ids, so the same ids give the same ranks). A collective over the members."""
        self._current()
        saved = state.get("world_size")
        if saved is not None and saved != self.world_size:
            raise ValueError(f"the checkpoint was saved by a membership of {saved} workers; this one has "
                             f"{self.world_size} ({', '.join(self.members)}): resume with as many members as saved, "
                             "then let members join or leave")
        return self._inner.load_training_state_dict(state, strict=strict)

    def get_lr(self) -> float:
        return self._inner.get_lr()

    def _current(self) -> None:
        """Re-form first if a failure or a change is pending (before a collective over the members)."""
        self.update()

    def close(self) -> None:
        """Stop the heartbeat and release the wrapper (the model keeps its parameters)."""
        if self._closed:
            return
        self._closed = True
        self._inner.elastic_policy().abandon()
        self._retire(self._inner)
        self._membership.stop()

    # -- membership changes --------------------------------------------------------------------
    def _init_world(self, formation: Formation) -> None:
        if dist.is_initialized():
            self._graveyard.append(dist.group.WORLD)
            dist.destroy_process_group()
        prefix = dist.PrefixStore(self._membership.pg_prefix(formation.epoch), self._store)
        # Bounded by reform_timeout while the epoch is set up (a member dying then must not hold the
        # others for the whole timeout); the wrapper's timeout once it trains (see _establish).
        dist.init_process_group("gloo", store=prefix, rank=formation.rank_of(self._membership.id),
                                world_size=len(formation.members), timeout=self._reform_timeout)

    def _check_topology(self, name: str, n: int) -> None:
        """Raise TopologyError where ``name`` is not defined for ``n`` members (over their nodes in the
        intra_node modes)."""
        if self._intra_node != "gossip":
            node_topology(name, n // self._node_size)
        else:
            lws = self._ddp_kwargs.get("local_world_size") or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            make_topology(name, n, int(lws))

    def _topology_for(self, n: int) -> str:
        """The topology name for ``n`` members: the user's, or ``ring`` (defined for every ``n``) where
        the user's is not defined (e.g. alternating-exp-ring on a single node); the same choice on
        every member (a function of ``n``)."""
        try:
            self._check_topology(self._topology_name, n)
            return self._topology_name
        except TopologyError as exc:
            logger.warning("decentpy.elastic: %s; using 'ring' while the membership has %d workers",
                           str(exc).splitlines()[0][:200], n)
            return "ring"

    def _build(self, broadcast: bool) -> _EpochDDP:
        inner = _EpochDDP.__new__(_EpochDDP)
        try:
            inner.__init__(self._model, self._optim_fn, self._lr_scheduler_fn,  # type: ignore[misc]
                           topology=self._topology_for(dist.get_world_size()), timeout=self._timeout,
                           peer_liveness_timeout=self._liveness,
                           comm="torch", broadcast_parameters=broadcast, **self._ddp_kwargs)
        except BaseException:
            driver = inner.__dict__.get("_driver")  # a construction that failed half-way leaves no hook behind
            if driver is not None:
                driver.remove_hooks()
            raise
        return inner

    def _retire(self, inner: _EpochDDP) -> None:
        """Unhook an epoch's wrapper from the model; its process groups stay alive (a peer may still
        hold an exchange with them) until the process ends."""
        self._graveyard.append(inner._comm)
        inner._driver.remove_hooks()
        for h in inner._module_hooks:
            h.remove()
        inner._module_hooks = []
        inner._closed = True

    def _reform(self) -> None:
        t0 = time.monotonic()
        old_inner = self._inner
        policy = old_inner.elastic_policy()
        assert self._membership.formation is not None
        old = self._membership.formation
        failure = policy.failure
        suspected: List[str] = []
        if isinstance(failure, PeerUnreachableError):
            ranks = failure.ranks
            suspected = [old.members[r] for r in ranks if 0 <= r < len(old.members)]
        policy.abandon()
        state = old_inner.training_state_dict()
        self._retire(old_inner)
        # the failed iteration's gradients are not carried over (buckets whose node reduction failed
        # did not step, and left theirs): the new epoch starts from the parameters, as a new job would
        for p in self._model.parameters():
            p.grad = None
        cause = (f"{type(failure).__name__} at step {policy.failed_at}" if failure is not None
                 else "a membership change announced by a peer")
        # end the peers' waits on this worker's abandoned exchanges (and on its node collectives) now
        from ..comm import peer_monitor
        monitor = peer_monitor()
        if monitor is not None:
            monitor.report(f"member {self._membership.id} is re-forming the group (membership change)")
        formation = self._membership.reform(suspected, int(state["step"]), self._reform_timeout.total_seconds())
        formation, self._inner = self._establish(formation, state, old.members, False)
        self._membership.settled()
        left = tuple(m for m in old.members if m not in formation.members)
        joined = tuple(m for m in formation.members if m not in old.members)
        self._record(formation, left, joined, time.monotonic() - t0,
                     failure.waited_s if failure is not None else None, cause)

    def _establish(self, formation: Formation, state: Optional[Dict[str, Any]], known: List[str],
                   joiner: bool) -> Tuple[Formation, _EpochDDP]:
        """The epoch's process group and inner wrapper, with this worker's state (``state``: its own,
        None: the first epoch's broadcast, or a joiner's transfer; ``known``: the members that had a
        state before). A member failing meanwhile (the change itself fails): once more, over whoever
        is left (up to 3 attempts). A joiner whose settings differ from the members', or a rank
        that fails the group's handshake, is left out and the epoch formed again without it."""
        last: Optional[BaseException] = None
        failures = refusals = 0
        while True:
            step = int(state["step"]) if state is not None else formation.step
            try:
                self._init_world(formation)
                self._authenticate(formation)
                inner = self._build(broadcast=state is None and not joiner)
                if state is not None:  # (its saved rank stays: with shards, its local rank must not change)
                    # (the exchange's own state, compressed gossip's public copies, is per membership:
                    # the new epoch's starts afresh, from zero, on every member alike)
                    inner.load_training_state_dict(dict(state, step=formation.step, world_size=len(formation.members),
                                                        rebuild_exchange=True))
                if state is not None or joiner:
                    self._transfer(formation, known, inner, joiner)
                    self._sync_node(formation, inner)
                set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
                if set_timeout is not None and self._reform_timeout != self._timeout:
                    set_timeout(self._timeout)
                return formation, inner
            except SettingsMismatchError as exc:
                refused = self._refuse_joiners(formation, known, exc)
                refusals += 1
                if refusals > _MAX_REFUSALS:
                    raise RendezvousError(f"member {self._membership.id}: {refusals} joiners refused in one membership "
                                          f"change; the last: {exc}") from exc
                formation = self._membership.reform([], step, self._reform_timeout.total_seconds(), exclude=refused)
            except _Unauthenticated as exc:
                failures += 1
                if self._membership.id in exc.ids or failures >= 3:
                    raise AdmissionError(f"member {self._membership.id}: {exc}") from exc
                formation = self._membership.reform(exc.ids, step, self._reform_timeout.total_seconds(),
                                                    exclude=exc.ids)
            except MalformedMessageError:
                raise  # a peer sent something that is not a state: named, never retried
            except (PeerTimeoutError, RuntimeError) as exc:
                if isinstance(exc, (EvictedError, RendezvousError)):
                    raise
                last = exc
                failures += 1
                if failures >= 3:
                    raise RendezvousError(f"member {self._membership.id}: the membership could not be formed in 3 "
                                          f"attempts: {last}") from exc
                logger.warning("decentpy.elastic: member %s: forming epoch %d failed (%s); once more without whoever "
                               "stopped beating", self._membership.id, formation.epoch, str(exc).splitlines()[0][:300])
                formation = self._membership.reform([], step, self._reform_timeout.total_seconds())

    def _authenticate(self, formation: Formation) -> None:
        """With a secret: the new group's challenge-response (:func:`.auth.handshake`) before any
        other collective; a rank that answers without the job key is named and left out."""
        if self._key is None:
            return
        me = formation.rank_of(self._membership.id)
        bad = handshake(self._key, formation.epoch, formation.members, me, self._membership.context)
        if bad:
            named = ", ".join(f"rank {r} (member {formation.members[r]!r})" for r in bad)
            logger.warning("decentpy.elastic: member %s: epoch %d: %s answered the group's challenge without the job "
                           "key: left out, the others form the epoch again without it", self._membership.id,
                           formation.epoch, named)
            raise _Unauthenticated([formation.members[r] for r in bad])

    def _refuse_joiners(self, formation: Formation, known: List[str], exc: SettingsMismatchError) -> List[str]:
        """The inner wrapper's agreement found settings that differ (the same error on every rank):
        when only joiners differ from a member that was in the job already, they are refused (a
        signed ``refused/<id>`` record, a WARNING naming the setting and both values) and their ids
        returned; a refused joiner raises :class:`JoinRefusedError`. When members differ among
        themselves (or in the first epoch, where nobody was in the job before), the error stands."""
        differing = [formation.members[r] for r in exc.differing if 0 <= r < len(formation.members)]
        reference = formation.members[exc.reference_rank] if 0 <= exc.reference_rank < len(formation.members) else None
        if not known or reference not in known or not differing or any(m in known for m in differing):
            raise exc
        me = self._membership.id
        if me in differing:
            self._membership.stop()
            if dist.is_initialized():  # this process may build another ElasticGossip
                self._graveyard.append(dist.group.WORLD)
                dist.destroy_process_group()
            raise JoinRefusedError(f"member {me} was refused by the members of the job: its setting {exc.setting!r} "
                                   f"differs from theirs ({exc}); they go on without it", exc.setting) from exc
        for m in differing:
            self._membership.refuse(m, f"its setting {exc.setting!r} differs from the members': {exc}")
        logger.warning("decentpy.elastic: member %s: refused joiner(s) %s: setting %r differs (%s); the members go on "
                       "without it", me, differing, exc.setting, exc)
        return differing

    def _transfer(self, formation: Formation, old_members: List[str], inner: _EpochDDP, joiner: bool) -> None:
        """Joiners receive their whole training state (parameters, buffers, optimizer and scheduler
        state, step) point to point from the member ranked one failure domain before them (the
        previous rank; with nodes, the same local rank of the previous node, a replica); several
        joiners in turn, so a joiner may pass on what it just received.
        ``old_members``: the previous epoch's."""
        me = formation.rank_of(self._membership.id)
        known = set(old_members)
        step = self._node_size
        for j, m in enumerate(formation.members):
            if m in known or j < step:
                continue
            if joiner and m == self._membership.id:
                state = self._receive_state(formation, inner, j - step)
                logger.info("decentpy.elastic: member %s received its state from member %s (rank %d) at step %d",
                            m, formation.members[j - step], j - step, state["step"])
            elif me == j - step:
                send_state(inner.training_state_dict(), dst=j)

    def _sync_node(self, formation: Formation, inner: _EpochDDP) -> None:
        """``intra_node='allreduce'``: the node's workers are replicas, but the iteration that failed
        may have stepped on some of them and not on others (each learns of the failure at its own
        bucket); every worker of a node takes the training state of the node's first worker, point
        to point, so the node starts the epoch as one. Not with ``'shard'``: there each worker's
        optimizer state is its own shard's, and every shard of the failed iteration was gathered
        by the whole node (stepped, mixed or not), so the node holds one model already."""
        size = self._node_size
        if size <= 1 or self._intra_node != "allreduce":
            return
        me = formation.rank_of(self._membership.id)
        first = me - me % size
        if me == first:
            state = inner.training_state_dict()
            for k in range(1, size):
                send_state(state, dst=first + k)
        else:
            self._receive_state(formation, inner, first)

    def _receive_state(self, formation: Formation, inner: _EpochDDP, src: int) -> Dict[str, Any]:
        """The training state sent by rank ``src``, loaded into ``inner`` as this member's (its own
        rank and the membership's size); returned. Plain data loaded with ``weights_only=True``:
        anything else raises :class:`~decentpy.comm.MalformedMessageError` naming the sender, and
        nothing of it runs."""
        received = recv_state(src, what=f"the training state of member {formation.members[src]!r}")
        if not isinstance(received, dict):
            raise MalformedMessageError(f"the training state of member {formation.members[src]!r} from rank {src}: a "
                                        f"{type(received).__name__}, not a dict")
        # the sender's rank stays in the state: with shards it has this member's local rank (checked at load)
        # and the exchange's own state is per rank: this epoch's starts afresh (see _establish)
        state = dict(received, world_size=len(formation.members), rebuild_exchange=True)
        inner.load_training_state_dict(state)
        return state

    def leave(self) -> None:
        """Leave the job cleanly at an iteration boundary: the others re-form without this worker at
        their next iteration (an exchange still in flight with it ends at once, that step is local
        for them). The model keeps its parameters."""
        self._current()
        self._inner.elastic_policy().abandon()
        from ..comm import peer_monitor
        monitor = peer_monitor()
        if monitor is not None:  # the others' waits on this worker end within a heartbeat
            monitor.report(f"member {self._membership.id} left the job (leave())")
        self._membership.leave(self._reform_timeout.total_seconds())
        logger.warning("decentpy.elastic: member %s left the job at step %d", self._membership.id, self.step_count)
        self._retire(self._inner)
        self._closed = True

    def _record(self, formation: Formation, left: Tuple[str, ...], joined: Tuple[str, ...], reform_s: float,
                detect_s: Optional[float], cause: str) -> None:
        change = MembershipChange(formation.epoch, formation.step, tuple(formation.members),
                                  formation.rank_of(self._membership.id), len(formation.members), left, joined,
                                  reform_s, detect_s, cause)
        self.history.append(change)
        if cause == "start":
            logger.info("decentpy.elastic: epoch %d: %d members %s; this is %s, rank %d", formation.epoch,
                        change.world_size, list(change.members), self._membership.id, change.rank)
            return
        logger.warning("decentpy.elastic: epoch %d from step %d: %d members %s (left: %s, joined: %s; cause: %s); "
                       "this is %s, now rank %d; re-formed in %.2f s", formation.epoch, formation.step,
                       change.world_size, list(change.members), list(left) or "none", list(joined) or "none", cause,
                       self._membership.id, change.rank, reform_s)
        if self._callback is not None:
            self._callback(change)
