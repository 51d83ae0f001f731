"""The exchange primitives over ``torch.distributed`` (the :class:`decentpy.exchange.Communicator`
interface): a point-to-point exchange on one shared process group, and an in-place all-reduce on a
sub-group created once, collectively, at construction. Which exchange a step uses is decided by
:mod:`decentpy.exchange`. Every wait is bounded, and a timeout names the bucket and the peers.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from .exchange import communication_needs
from .topology import Topology

logger = logging.getLogger(__name__)


class PeerTimeoutError(RuntimeError):
    """A peer did not complete an exchange within the timeout (it may have died)."""


class Exchange:
    """An in-flight exchange of one bucket: wait on it before reading or writing its buffers."""

    def __init__(self, works: List[dist.Work], bucket: int, ranks: Tuple[int, ...], rank: int) -> None:
        self._works = works
        self.bucket = bucket
        self.ranks = ranks
        self.rank = rank

    def wait(self, timeout: datetime.timedelta) -> None:
        peers = [r for r in self.ranks if r != self.rank]
        for work in self._works:
            wait_bounded(work, timeout, f"rank {self.rank}: exchange of bucket {self.bucket} with peer(s) {peers}")
        self._works = []


def wait_bounded(work: dist.Work, timeout: datetime.timedelta, what: str) -> None:
    """Wait for ``work`` at most ``timeout``; a :class:`PeerTimeoutError` that starts with ``what``
    otherwise (gloo raises on a timeout or a closed connection, other backends return False)."""
    try:
        ok = work.wait(timeout)
    except RuntimeError as exc:
        raise PeerTimeoutError(f"{what} failed or did not complete within {timeout.total_seconds():g} s ({exc}); "
                               "a peer may have died") from exc
    if ok is False:
        raise PeerTimeoutError(f"{what} did not complete within {timeout.total_seconds():g} s; a peer may have died")


class SubGroup:
    """A process group over some ranks of a :class:`CommGroup`, used for decentpy's own traffic.

    Ranks are global ranks. Two kinds: a group registered with torch (``dist.new_group``, on the
    world, so users and tools see it as usual) and a private one (built on a store prefix of its own,
    for wrappers on a process group other than the world: see :class:`CommGroup`)."""

    def __init__(self, global_ranks: Sequence[int], pg: Any, registered: bool) -> None:
        self.global_ranks = tuple(global_ranks)
        self.pg = pg
        self.registered = registered

    def send_recv(self, send: Tensor, recv: Tensor, peer: int, tag: int) -> List[Any]:
        """``send`` to global rank ``peer`` and ``recv`` from it (both in flight)."""
        if self.registered:
            ops = [dist.P2POp(dist.isend, send, peer, group=self.pg, tag=tag),
                   dist.P2POp(dist.irecv, recv, peer, group=self.pg, tag=tag)]
            return list(dist.batch_isend_irecv(ops))
        to = self.global_ranks.index(peer)
        return [self.pg.send([send], to, tag), self.pg.recv([recv], to, tag)]

    def all_reduce(self, buffer: Tensor) -> Any:
        """Sum ``buffer`` in place over the group (in flight)."""
        if self.registered:
            return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.pg, async_op=True)
        return self.pg.allreduce([buffer])

    def reduce_scatter(self, out: Tensor, inp: Tensor) -> Any:
        """``out`` <- this rank's chunk of the sum of every member's ``inp`` (``inp`` holds
        ``len(global_ranks)`` chunks of ``out``'s size, in group-rank order; in flight)."""
        if self.registered:
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return scatter(out, inp, op=dist.ReduceOp.SUM, group=self.pg, async_op=True)
        return self.pg._reduce_scatter_base(out, inp)

    def all_gather(self, out: Tensor, inp: Tensor) -> Any:
        """``out`` <- every member's ``inp``, in group-rank order (``inp`` may be this rank's chunk of
        ``out`` itself; in flight)."""
        if self.registered:
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return gather(out, inp, group=self.pg, async_op=True)
        return self.pg._allgather_base(out, inp)

    def destroy(self) -> None:
        if self.registered:
            dist.destroy_process_group(self.pg)
        self.pg = None


# Sub-groups built so far per process group (global ranks): the members of a group build the same
# ones in the same order, so they agree on store prefixes without talking.
_private_sequence: Dict[Tuple[int, ...], "itertools.count[int]"] = {}


class CommGroup:
    """The ranks one wrapper works over: a process group (the world by default), numbered by group rank.

    Topologies and exchange plans speak group ranks ``0 .. size-1``; this object translates them to
    global ranks and creates the wrapper's private sub-groups. On the world these are ordinary
    ``dist.new_group`` groups (every rank creates every group, in the same order). Several wrappers
    on disjoint process groups must run side by side and be built independently, which
    ``dist.new_group`` cannot do safely: only the members of a group call it with
    ``use_local_synchronization=True``, and torch then names the group after the process's count of
    groups, which differs between ranks that belong to different wrappers (and repeats after a group
    is destroyed, reusing stale rendezvous keys: a hang). So on another process group the sub-groups
    are gloo groups on a store prefix of their own, named by the process group's ranks, a sequence
    number and the sub-group's ranks; only their members build them.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        if process_group is dist.group.WORLD:
            process_group = None
        if process_group is not None:
            if process_group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(process_group) < 0:
                raise ValueError(
                    f"rank {dist.get_rank()} is not a member of the process_group it was given; build the wrapper "
                    "only on the ranks of its group (torch.distributed.new_group returns a non-member marker, not "
                    "a group, to the other ranks)")
        self.process_group = process_group
        self.global_ranks: Tuple[int, ...] = tuple(group_ranks(process_group))
        self.rank = self.global_ranks.index(dist.get_rank())
        self.size = len(self.global_ranks)
        self._prefix = ""
        self._created = 0
        if process_group is not None:
            seq = next(_private_sequence.setdefault(self.global_ranks, itertools.count()))
            self._prefix = f"decentpy/group{'-'.join(map(str, self.global_ranks))}/{seq}"

    @property
    def is_world(self) -> bool:
        return self.process_group is None

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.process_group))

    def to_global(self, rank: int) -> int:
        """The global rank of group rank ``rank``."""
        return self.global_ranks[rank]

    def describe(self, ranks: Sequence[int]) -> List[int]:
        """Global ranks of group ranks ``ranks`` (for messages)."""
        return [self.global_ranks[r] for r in ranks]

    def new_subgroup(self, ranks: Sequence[int], timeout: datetime.timedelta) -> Optional[SubGroup]:
        """A group over group ranks ``ranks``; ``None`` on a rank not in it. Every rank of this group
        calls it for the same sub-groups in the same order."""
        members = self.describe(sorted(ranks))
        self._created += 1  # part of the store prefix: sub-groups with the same members (pairs, all-reduce) differ
        if self.is_world:
            pg = dist.new_group(members, timeout=timeout)  # collective over the world
            return SubGroup(members, pg, registered=True) if self.rank in ranks else None
        if self.rank not in ranks:
            return None
        if self.backend != dist.Backend.GLOO:
            raise ValueError(
                f"process groups other than the world need decentpy's own sub-groups, built on gloo here; the group's "
                f"backend is {self.backend!r}: with NCCL use comm='auto' or 'nccl' (decentpy's NCCL communicator)")
        store = dist.PrefixStore(f"{self._prefix}/{self._created}/{'-'.join(map(str, members))}/",
                                 dist.distributed_c10d._get_default_store())
        pg = dist.ProcessGroupGloo(store, members.index(dist.get_rank()), len(members), timeout)
        return SubGroup(members, pg, registered=False)

    def local_world_size(self, env_local_world_size: int) -> int:
        """Ranks per node *of this group*, with nodes of ``env_local_world_size`` consecutive global
        ranks: the count of members on each node, if every node with members has the same count and
        group ranks fill the nodes in order; else 1 (no node structure the topology could use)."""
        env = max(1, int(env_local_world_size))
        if self.is_world:
            return env
        nodes = [g // env for g in self.global_ranks]
        per = {n: nodes.count(n) for n in nodes}
        counts = set(per.values())
        if len(counts) == 1:
            c = counts.pop()
            if all(nodes[r] == nodes[(r // c) * c] for r in range(self.size)):
                return c
        logger.info("process group %s does not fill nodes of %d ranks evenly; its local world size is 1",
                    list(self.global_ranks), env)
        return 1


class TorchCommunicator:
    """Exchange primitives over ``torch.distributed`` (gloo on CPU, NCCL, MPI).

    Ranks given to :meth:`send_recv` and :meth:`all_reduce` are ranks of ``group`` (the world by
    default), as the topology numbers them.
    """

    def __init__(self, topology: Topology, timeout: datetime.timedelta, group: Optional[CommGroup] = None) -> None:
        self.group = group if group is not None else CommGroup()
        self.rank = self.group.rank
        self.world_size = self.group.size
        self.timeout = timeout
        self._subgroups: Dict[Tuple[int, ...], Optional[SubGroup]] = {}
        # Sub-group creation is collective over the group: every rank creates every group, in the
        # same (schedule) order. decentpy's traffic never uses the group itself, so it cannot
        # interleave with the user's collectives (torch DDP beside it, Join's all-reduces).
        p2p, collective = communication_needs(topology)
        pg_timeout = max(timeout, datetime.timedelta(seconds=1))
        self._p2p_group: Optional[SubGroup] = None
        if p2p:
            self._p2p_group = self.group.new_subgroup(list(range(self.world_size)), pg_timeout)
        for ranks in collective:
            self._subgroups[ranks] = self.group.new_subgroup(ranks, pg_timeout)
        logger.debug("rank %d: %d sub-groups", self.rank, len(self._subgroups))

    def close(self) -> None:
        """Destroy the sub-groups this communicator created (the default group stays)."""
        groups = [g for g in self._subgroups.values() if g is not None]
        if self._p2p_group is not None:
            groups.append(self._p2p_group)
        self._subgroups, self._p2p_group = {}, None
        for g in groups:
            g.destroy()

    def send_recv(self, bucket: int, peer: int, send: Tensor, recv: Tensor) -> Exchange:
        """``send`` goes to ``peer``; the peer's counterpart lands in ``recv``."""
        assert self._p2p_group is not None, "internal error: the topology has no pair exchange"
        to = self.group.to_global(peer)
        with _untraced_work(f"decentpy.exchange[bucket {bucket}]"):
            works = self._p2p_group.send_recv(send, recv, to, bucket)
        me = dist.get_rank()
        return Exchange(works, bucket, tuple(sorted((me, to))), me)

    def all_reduce(self, bucket: int, ranks: Tuple[int, ...], buffer: Tensor) -> Exchange:
        """``buffer`` summed in place over ``ranks``."""
        sub = self._subgroups[ranks]
        assert sub is not None, f"internal error: rank {self.rank} is not in group {ranks}"
        with _untraced_work(f"decentpy.exchange[bucket {bucket}]"):
            work = sub.all_reduce(buffer)
        return Exchange([work], bucket, sub.global_ranks, dist.get_rank())


@contextlib.contextmanager
def _untraced_work(label: str) -> Iterator[None]:
    """Launch collectives whose ``Work`` carries no profiler RecordFunction.

    A c10d ``Work`` created while the torch profiler is active starts an asynchronous
    RecordFunction and ends it when the work finishes or is waited on. decentpy waits on an exchange
    one iteration later, possibly after the profiler stopped and freed its event storage; ending
    the RecordFunction then writes into freed memory (a crash at exit: ``free(): invalid next
    size`` or SIGSEGV). So the works are created with RecordFunction disabled on this thread
    (thread-local, restored at once), and the launch itself is recorded synchronously as
    ``label`` so profiles still show it.
    """
    traced = torch.autograd._profiler_enabled()
    with torch.autograd.profiler.record_function(label) if traced else contextlib.nullcontext():
        before = _C.record_function_enabled()
        _C.set_record_function_enabled(False)
        try:
            yield
        finally:
            _C.set_record_function_enabled(before)


def group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """Global ranks of ``group`` (the world when None), in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def first_difference_across_ranks(mine: Sequence[Any],
                                  group: Optional[dist.ProcessGroup] = None) -> Optional[Tuple[int, int, Any, Any]]:
    """Compare every rank's ``mine`` with the first rank's (a collective over ``group``, default:
    the world).

    Returns the first ``(rank in group, position, first rank's item, that rank's item)`` that
    differs (an item is ``None`` past the end of a shorter list), or ``None``; the same answer on
    every rank, so all of them can raise the same error.
    """
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, list(mine), group=group)
    ref = everyone[0]
    for r, other in enumerate(everyone):
        if other == ref:
            continue
        for k in range(max(len(ref), len(other))):
            a = ref[k] if k < len(ref) else None
            b = other[k] if k < len(other) else None
            if a != b:
                return r, k, a, b
    return None


def raise_if_any_rank_failed(failure: Optional[BaseException], what: str,
                             group: Optional[dist.ProcessGroup] = None) -> None:
    """A collective over ``group`` (default: the world): if ``failure`` is set on any rank, raise on
    every rank (the failing rank its own exception, the others a RuntimeError naming that rank (in
    the group) and its message), so that no rank goes on to a collective its peers never join."""
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    everyone: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if failure is not None:
        raise failure
    bad = [(r, m) for r, m in enumerate(everyone) if m is not None]
    if bad:
        r, m = bad[0]
        raise RuntimeError(f"{what} failed on rank {r}: {m}")


def default_timeout() -> datetime.timedelta:
    """The default process group's timeout (torch's default when it cannot be read)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend() == dist.Backend.NCCL else "cpu")
        t = pg._get_backend(device).options._timeout
        if isinstance(t, datetime.timedelta):
            return t
    except Exception:  # pragma: no cover - depends on torch internals
        logger.debug("could not read the process group timeout; using torch's default")
    return dist.default_pg_timeout
