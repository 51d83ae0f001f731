"""The ranks a wrapper works over: process-group defaults, group ranks and decentpy's private
sub-groups (:class:`CommGroup`)."""

from __future__ import annotations

import datetime
import itertools
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["SubGroup", "CommGroup", "group_ranks", "or_world", "average_"]

logger = logging.getLogger(__name__)


def or_world(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """``group``, or the world when None: the default of every ``group=`` / ``process_group=``
    argument (torch's convention)."""
    return group if group is not None else dist.group.WORLD


def group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """Global ranks of ``group`` (the world when None), in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


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

    def send(self, send: Tensor, peer: int, tag: int) -> Any:
        """``send`` to global rank ``peer`` (in flight). Straight to the process group (also a
        registered one, whose group ranks are its sorted members, as here): ``dist.isend``'s
        argument checks cost ~30 us a call, and these sends are on a pipeline's critical path."""
        return self.pg.send([send], self.global_ranks.index(peer), tag)

    def recv(self, recv: Tensor, peer: int, tag: int) -> Any:
        """``recv`` from global rank ``peer`` (in flight; straight to the process group, as :meth:`send`)."""
        return self.pg.recv([recv], self.global_ranks.index(peer), tag)

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
        logger.debug("process group %s does not fill nodes of %d ranks evenly; its local world size is 1",
                    list(self.global_ranks), env)
        return 1


@torch.no_grad()
def average_(tensors: List[Tensor], world_size: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """In-place exact average over the ``world_size`` ranks of ``group`` (low-precision tensors
    reduced in fp32). A collective: every rank of the group calls it with the same tensors."""
    if world_size == 1:
        return
    for t in tensors:
        buf = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
        dist.all_reduce(buf, group=group)
        buf.div_(world_size)
        if buf is not t:
            t.copy_(buf)
