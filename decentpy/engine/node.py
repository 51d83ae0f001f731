"""What the node strategies share (``intra_node='shard'`` and ``'allreduce'``).

The world (or the wrapper's process group) is ``G`` nodes of ``L`` ranks (node ``g`` = group ranks
``g*L .. g*L + L - 1``). Links inside a node are fast, so the node averages its gradients exactly
and acts as one gossip worker; the topology runs over the ``G`` nodes
(:func:`decentpy.topology.node_topology`). :class:`IntraNode` is the node: its group, the count of
its ranks that still have data (``Join``: the node's mean is over those, and a node steps while any
of its ranks does) and the mean. :class:`NodeGossip` is gossip mix-and-step on the node's reduced
gradient, with the reduction of a bucket running while autograd computes the next bucket's
gradients; its subclasses say which reduction (:mod:`~decentpy.engine.node_allreduce`,
:mod:`~decentpy.engine.node_shard`).
"""

from __future__ import annotations

import abc
import datetime
import logging
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..comm import CommGroup, PeerWatch, SubGroup
from ..grad_scaling import GradArgs
from ..topology import Topology, node_topology, shard_topology
from .bucket import Bucket
from .driver import BoundedWait
from .gossip import GossipSetup, GossipStrategy

logger = logging.getLogger(__name__)

__all__ = ["IntraNode", "NodeGossip"]


class IntraNode:
    """The node of this rank (``L`` ranks, ``L`` >= 1)."""

    def __init__(self, mode: str, rank: int, size: int, local: int, timeout: datetime.timedelta) -> None:
        """Local only; :meth:`connect` creates the node groups. ``rank``/``size``: in the wrapper's group;
        ``mode``: the ``intra_node`` name (for messages)."""
        if local < 1 or size % local:
            raise ValueError(f"intra_node={mode!r} needs local_world_size to divide the number of ranks; got "
                             f"local_world_size={local} for {size} ranks (divisors: "
                             f"{', '.join(str(d) for d in range(1, size + 1) if size % d == 0)})")
        self.local = int(local)
        self.nodes = size // self.local
        self.node = rank // self.local
        self.local_rank = rank % self.local
        self.group: Optional[SubGroup] = None
        self.wait = BoundedWait(timeout)
        self._all: List[SubGroup] = []
        self._count_work: Optional[Any] = None
        self._count: Optional[Tensor] = None

    def connect(self, group: CommGroup, device: torch.device) -> None:
        """Create the node groups: every rank creates every node's group, in node order (a collective
        over ``group``). ``device``: where the buckets live (on a GPU, waits order the stream)."""
        self.wait = BoundedWait(self.wait.timeout, device)
        if self.local == 1:
            return
        for g in range(self.nodes):
            sub = group.new_subgroup(list(range(g * self.local, (g + 1) * self.local)), self.wait.timeout)
            if sub is not None:
                self._all.append(sub)
            if g == self.node:
                self.group = sub

    def watch_peers(self, watch: PeerWatch, group: CommGroup) -> None:
        """The node's waits go through ``watch`` (a :class:`~decentpy.comm.failures.PeerWatch`; see
        :meth:`BoundedWait.watched`), naming the node's other ranks of ``group``."""
        first = self.node * self.local
        self.wait.watched(watch, [group.to_global(r) for r in range(first, first + self.local)
                                  if r != first + self.local_rank])

    def close(self) -> None:
        for sub in self._all:
            sub.destroy()
        self._all, self.group = [], None

    # -- per iteration ---------------------------------------------------------------------------
    def begin_count(self, active: bool, device: torch.device) -> None:
        """Start counting the node's ranks that have data this iteration (only inside ``Join``: outside
        it every rank has data, and the count would be ``L``)."""
        t = torch.tensor([1.0 if active else 0.0], device=device)
        self._count = t
        self._count_work = self.group.all_reduce(t) if self.group is not None else None

    def count(self) -> Optional[Tensor]:
        """The node's count of active ranks (a one-element tensor; None when not counting)."""
        if self._count_work is not None:
            self.wait(self._count_work, "the node's count of ranks with data")
            self._count_work = None
        return self._count

    def end_iteration(self) -> None:
        self._count, self._count_work = None, None

    def mean(self, work: Optional[Any], grad: Tensor) -> None:
        """Wait for the reduction ``work`` that summed the node's gradients into ``grad``, and divide
        by the node's ranks with data."""
        if work is not None:
            self.wait(work, "the node's gradient reduction")
        count = self.count()
        if count is not None:
            grad.div_(count.clamp(min=1.0))
        elif self.local > 1:
            grad.div_(self.local)


class NodeGossip(GossipStrategy):
    """The node is one gossip worker: per bucket, reduce the gradients over the node, then mix and
    step on the node's mean (each bucket finishes when the next one is ready, or at the end)."""

    @classmethod
    def configure(cls, topology: Union[str, Topology], rank: int, size: int, local_world_size: int,
                  timeout: datetime.timedelta) -> GossipSetup:
        node = IntraNode(cls.name, rank, size, local_world_size, timeout)
        t = node_topology(topology, node.nodes)  # over the nodes
        return GossipSetup(t, shard_topology(t, local_world_size), node)

    exchanges_whole_model = False  # shards or node means
    local_gradients = False        # the step's gradient is the node's reduction
    _deferred: Optional[Tuple[Bucket, bool, Optional[Any]]] = None  # a bucket whose reduction is in flight

    @property
    def node(self) -> IntraNode:
        node = self.setup.node
        assert isinstance(node, IntraNode), "internal error: a node strategy needs its node"
        return node

    def check_resume(self, state: Dict[str, Any], local_world_size: int) -> None:
        saved = (state.get("intra_node", "gossip"), state.get("local_world_size"))
        if saved != (self.name, local_world_size):
            raise ValueError(f"checkpoint was saved with intra_node={saved[0]!r}, local_world_size={saved[1]}; this "
                             f"run has intra_node={self.name!r}, local_world_size={local_world_size} (each rank's "
                             "optimizer state is its shard)")

    def node_reduction(self) -> IntraNode:
        return self.node

    def connect(self, device: torch.device) -> None:
        self.node.connect(self.group, device)

    def close(self) -> None:
        self.node.close()
        super().close()

    @abc.abstractmethod
    def start_reduction(self, b: Bucket) -> Optional[Any]:
        """Start summing the node's gradients of ``b`` into ``b.grad`` (None: nothing in flight)."""

    def begin_iteration(self, in_join: bool, active: bool) -> None:
        super().begin_iteration(in_join, active)
        self._deferred = None  # (a failed iteration may have left one)
        self.node.end_iteration()
        if in_join:
            self.node.begin_count(active, self.layout.params[0].device)

    def bucket_ready(self, bucket: int, joined: bool) -> None:
        b = self.layout.buckets[bucket]
        local_step = not joined
        if local_step:
            b.adopt_grads()
        else:  # a joined rank: its node steps while any of its ranks has data
            count = self.node.count()
            local_step = count is not None and float(count) > 0  # host read: joined ranks only
        reduction = self.start_reduction(b) if local_step else None
        previous, self._deferred = self._deferred, (b, local_step, reduction)
        if previous is not None:
            self.policy.bucket(*previous)

    def end_backward(self, joined: bool) -> None:
        try:
            if self._deferred is not None:  # the last bucket's reduction
                previous, self._deferred = self._deferred, None
                self.policy.bucket(*previous)
            super().end_backward(joined)
        finally:
            self.node.end_iteration()

    def grad_args(self, b: Bucket, reduction: Optional[Any]) -> GradArgs:
        self.node.mean(reduction, b.grad)
        return super().grad_args(b, reduction)

    def drop_node_work(self) -> None:
        self._deferred = None
        self.node.end_iteration()
