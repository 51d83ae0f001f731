"""Node modes: what the ranks of a node do together (one part of the gossip strategy, chosen by
``intra_node`` from :data:`~decentpy.engine.NODE_MODES`, beside the exchange and the failure policy).

- :class:`NodeMode` (``intra_node='gossip'``): no node; every rank is its own gossip worker.
- :class:`NodeReduction`: the world (or the wrapper's process group) is ``G`` nodes of ``L`` ranks
  (node ``g`` = group ranks ``g*L .. g*L + L - 1``). Links inside a node are fast, so the node
  averages its gradients exactly and acts as one gossip worker; the topology runs over the ``G``
  nodes (:func:`decentpy.topology.node_topology`). A bucket's reduction runs while autograd computes
  the next bucket's gradients. Its subclasses say which reduction
  (:mod:`~decentpy.engine.node_allreduce`, :mod:`~decentpy.engine.node_shard`).
- :class:`IntraNode` is the node: its group, the count of its ranks that still have data (``Join``:
  the node's mean is over those, and a node steps while any of its ranks does) and the mean.

Adding a node mode: subclass :class:`NodeMode` (or :class:`NodeReduction`), override what differs,
register it in :data:`decentpy.engine.NODE_MODES` under its ``intra_node`` name. A node mode is
handed the strategy it serves; this module imports :class:`~decentpy.engine.gossip.GossipStrategy`
for type checking only.
"""

from __future__ import annotations

import abc
import datetime
import logging
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ..comm import CommGroup, PeerWatch, SubGroup
from ..optim.grad_scaling import GradArgs
from ..topology import Topology, make_topology, node_topology, shard_topology
from .bucket import Bucket
from .driver import BoundedWait

if TYPE_CHECKING:
    from .gossip import GossipStrategy

logger = logging.getLogger(__name__)

__all__ = ["GossipSetup", "NodeMode", "NodeReduction", "IntraNode"]


class GossipSetup(NamedTuple):
    """What a gossip strategy works over: the topology the user sees, the schedule of exchanges
    over every rank of the group, and the node (None: every rank is a gossip worker)."""

    topology: Topology
    exchange_topology: Topology
    node: Optional[Any] = None


class NodeMode:
    """``intra_node='gossip'``: no node, every rank is a gossip worker and steps its own gradient.
    The base of every node mode: the strategy calls these at the points of its iteration."""

    #: the ``intra_node`` name
    name = "gossip"
    #: each exchange carries this rank's whole model (decent-dp's ``pre_average_hook`` can see it)
    exchanges_whole_model = True
    #: the step's gradient is this rank's own, in the bucket's block: its norm can be taken while the
    #: gradients are copied in, and a parameter without one is not updated (node reductions step
    #: the node's reduced gradient, and take its norm after the reduction)
    local_gradients = True

    @classmethod
    def configure(cls, topology: Union[str, Topology], rank: int, size: int, local_world_size: int,
                  timeout: datetime.timedelta) -> GossipSetup:
        """The topologies (and node) for ``size`` ranks of ``local_world_size`` per node; pure
        functions of the sizes, so they raise identically on every rank."""
        t = make_topology(topology, size, local_world_size)
        return GossipSetup(t, t)

    def __init__(self, strategy: "GossipStrategy") -> None:
        self.strategy = strategy

    @property
    def pad_multiple(self) -> int:
        """A bucket's element count is padded to a multiple of this."""
        return 1

    def shard_of(self, numel: int) -> Optional[Tuple[int, int]]:
        """The part of a bucket of ``numel`` elements this rank steps: None, all of it."""
        return None

    def node_reduction(self) -> Optional[IntraNode]:
        """The node's own collectives; None: no node."""
        return None

    def check_resume(self, state: Dict[str, Any], local_world_size: int) -> None:
        """Refuse a checkpoint whose per-rank state this mode cannot take (each rank's optimizer
        state is its own part)."""
        saved = (state.get("intra_node", "gossip"), state.get("local_world_size"))
        if saved[0] != self.name:
            raise ValueError(f"checkpoint was saved with intra_node={saved[0]!r}, local_world_size={saved[1]}; this "
                             f"run has intra_node={self.name!r}, local_world_size={local_world_size} (each rank's "
                             "optimizer state is its own part)")

    def connect(self, device: torch.device) -> None:
        """Collective set-up of the mode's own groups, if any (every rank, at construction)."""

    def close(self) -> None:
        """Release what :meth:`connect` created."""

    def module_hooks(self, model: nn.Module) -> List[Any]:
        """Hooks the mode needs on the wrapped model (handles, removed by the wrapper's close)."""
        return []

    def begin_iteration(self, in_join: bool, active: bool) -> None:
        """A training forward (``active``) or a joined rank's iteration starts."""

    def bucket_ready(self, b: Bucket, joined: bool) -> None:
        """The bucket has its gradients: its sequence, now (through the failure policy)."""
        if not joined:
            b.adopt_grads()  # every gradient in grad_block before its norm is taken
        self.strategy.policy.bucket(b, not joined)

    def end_backward(self, joined: bool) -> None:
        """Every bucket was handed out: finish what is still pending (before the strategy's end)."""

    def end_iteration(self) -> None:
        """After the iteration's end, also a failed one."""

    def grad_args(self, b: Bucket, reduction: Optional[Any]) -> GradArgs:
        """How the kernel scales the bucket's gradient (its norm taken on the device, if needed)."""
        s = self.strategy
        return s.grad_scaling.bucket_args(b.index, b.grad, norm=b.copied_grad_norm())

    def stepped(self, b: Bucket) -> None:
        """After the bucket's step and the launch of its exchange."""

    def wait_params(self) -> None:
        """Wait for whatever still writes the parameters after a step (before they are used again)."""

    def part_changed(self, b: Bucket) -> None:
        """The part of ``b`` this rank steps changed outside the kernel pass (the outer step of local
        steps, before the next forward): the bucket's parameters must reflect it when this returns."""
        b.scatter_params()  # param_as_bucket_view=False: the parameters follow the block

    def drop_work(self) -> None:
        """Forget the node's own collectives in flight without waiting (after one of them failed: the
        rest will never complete). No node, none."""


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


class NodeReduction(NodeMode):
    """The node is one gossip worker: per bucket, reduce the gradients over the node, then mix and
    step on the node's mean (each bucket finishes when the next one is ready, or at the end)."""

    exchanges_whole_model = False  # shards or node means
    local_gradients = False        # the step's gradient is the node's reduction

    @classmethod
    def configure(cls, topology: Union[str, Topology], rank: int, size: int, local_world_size: int,
                  timeout: datetime.timedelta) -> GossipSetup:
        node = IntraNode(cls.name, rank, size, local_world_size, timeout)
        t = node_topology(topology, node.nodes)  # over the nodes
        return GossipSetup(t, shard_topology(t, local_world_size), node)

    def __init__(self, strategy: "GossipStrategy") -> None:
        super().__init__(strategy)
        self._deferred: Optional[Tuple[Bucket, bool, Optional[Any]]] = None  # a bucket whose reduction is in flight

    @property
    def node(self) -> IntraNode:
        node = self.strategy.setup.node
        assert isinstance(node, IntraNode), "internal error: a node mode needs its node"
        return node

    def node_reduction(self) -> IntraNode:
        return self.node

    def check_resume(self, state: Dict[str, Any], local_world_size: int) -> None:
        saved = (state.get("intra_node", "gossip"), state.get("local_world_size"))
        if saved != (self.name, local_world_size):
            raise ValueError(f"checkpoint was saved with intra_node={saved[0]!r}, local_world_size={saved[1]}; this "
                             f"run has intra_node={self.name!r}, local_world_size={local_world_size} (each rank's "
                             "optimizer state is its shard)")

    def connect(self, device: torch.device) -> None:
        self.node.connect(self.strategy.group, device)

    def close(self) -> None:
        self.node.close()

    @abc.abstractmethod
    def start_reduction(self, b: Bucket) -> Optional[Any]:
        """Start summing the node's gradients of ``b`` into ``b.grad`` (None: nothing in flight)."""

    def begin_iteration(self, in_join: bool, active: bool) -> None:
        self._deferred = None  # (a failed iteration may have left one)
        self.node.end_iteration()
        if in_join:
            self.node.begin_count(active, self.strategy.layout.params[0].device)

    def bucket_ready(self, b: Bucket, joined: bool) -> None:
        local_step = not joined
        if local_step:
            b.adopt_grads()
        else:  # a joined rank: its node steps while any of its ranks has data
            count = self.node.count()
            local_step = count is not None and float(count) > 0  # host read: joined ranks only
        reduction = self.start_reduction(b) if local_step else None
        previous, self._deferred = self._deferred, (b, local_step, reduction)
        if previous is not None:
            self.strategy.policy.bucket(*previous)

    def end_backward(self, joined: bool) -> None:
        if self._deferred is not None:  # the last bucket's reduction
            previous, self._deferred = self._deferred, None
            self.strategy.policy.bucket(*previous)

    def end_iteration(self) -> None:
        self.node.end_iteration()

    def grad_args(self, b: Bucket, reduction: Optional[Any]) -> GradArgs:
        self.node.mean(reduction, b.grad)
        s = self.strategy
        return s.grad_scaling.bucket_args(b.index, b.grad)

    def drop_work(self) -> None:
        self._deferred = None
        self.node.end_iteration()
