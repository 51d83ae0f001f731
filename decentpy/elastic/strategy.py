"""The gossip step of an elastic wrapper: a failed exchange ends the step's communication, not the run.

:class:`ElasticStrategy`, mixed into plain gossip and into the node strategies
(:data:`ELASTIC_STRATEGIES`), is its parent with one change, taken only when a peer fails: the
first :class:`~decentpy.comm.PeerTimeoutError` of an iteration (a wait for a bucket's exchange, or
the launch of the next one) is kept in :attr:`failure` instead of
raised, and from there to the end of the iteration every bucket that has not stepped yet takes its
local optimizer step *without mixing* (its exchange failed or may be half done: nothing received is
used) and launches nothing. Every survivor thus ends the iteration with parameters that are its own
values stepped (a mix that completed before the failure is a doubly stochastic mix of the old
members), so no survivor mixes a partial average and the survivors' mean is never corrupted by a
half-received buffer. The elastic wrapper re-forms the group before the next forward.

With no failure the path is the parent's (one ``is None`` test per bucket).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..comm import PeerTimeoutError
from ..engine.bucket import Bucket
from ..engine.gossip import GossipStrategy
from ..engine.node import NodeGossip
from ..engine.node_allreduce import NodeAllReduce
from ..engine.node_shard import NodeShard
from ..grad_scaling import UNSCALED

__all__ = ["ElasticStrategy", "ElasticGossipStrategy", "ElasticNodeAllReduce", "ElasticNodeShard", "ELASTIC_STRATEGIES"]

logger = logging.getLogger(__name__)


class ElasticStrategy:
    """The elastic behaviour, mixed into a gossip strategy class (plain gossip, or a node strategy:
    ``intra_node='allreduce'`` or ``'shard'``, whose failure domain is the node); see the module.

    A failure inside the node's own collectives (the reduction of the gradients, the all-gather of
    updated shards) means a worker of this node died or left for the re-formation: this worker's
    remaining buckets do nothing more in the iteration, and a node whose worker died is left out
    whole at the re-formation."""

    defers_verdicts = False  # a re-formation replaces the strategy: nothing may stay pending across it

    #: the iteration's first peer failure (None: none); read by the elastic wrapper before the next forward
    failure: Optional[PeerTimeoutError] = None
    #: the step at which it happened
    failed_at: Optional[int] = None
    #: the failure came from the node's own collectives (their work in flight is dropped at abandon)
    node_failed: bool = False

    def mix_and_step(self, b: Bucket, local_step: bool, reduction: Optional[Any] = None) -> None:
        if self.failure is None:
            try:
                self.wait_exchange(b)  # type: ignore[attr-defined]
            except PeerTimeoutError as exc:
                self._failed(exc)
        if self.failure is None:
            try:
                super().mix_and_step(b, local_step, reduction)  # type: ignore[misc]
                return
            except PeerTimeoutError as exc:  # the launch of the next exchange (the bucket has stepped),
                self._failed(exc)            # or the node's reduction (node_failed: it has not)
                b.work = None
                if not self.node_failed:  # stepped: what follows a step still runs (with shards, the
                    self.stepped(b)       # node's all-gather, which every worker of the node joins)
                return
        b.work = None
        if self.node_failed:
            return
        # Degraded: the local step alone, nothing received is mixed, nothing is launched.
        try:
            grads = self.grad_args(b, reduction) if local_step else UNSCALED
        except PeerTimeoutError:
            return  # node_failed: the node's own collective failed
        b.step(None, 1.0, 0.0, None, grads, local_step,
               no_update=self.without_gradient(b, local_step))  # type: ignore[attr-defined]
        b.comm_valid = False
        b.skip_mix = True
        self.stepped(b)

    def stepped(self, b: Bucket) -> None:
        """The parent's (after every step, failed exchange or not); a failure there is the node's
        own collective (the all-gather of updated shards): a worker of this node died."""
        try:
            super().stepped(b)  # type: ignore[misc]
        except PeerTimeoutError as exc:
            self._node_failure(exc)

    def attach(self, comm: Any, hook_edges: Any = None) -> None:
        super().attach(comm, hook_edges)  # type: ignore[misc]
        watch = getattr(comm, "watch", None)
        if isinstance(self, NodeGossip) and watch is not None:
            # a node collective whose peer left for a re-formation ends when that peer reports it
            self.node.watch_peers(watch, self.group)

    def grad_args(self, b: Bucket, reduction: Optional[Any]) -> Any:
        """The parent's; a failure there is the node's own reduction (a node strategy)."""
        try:
            return super().grad_args(b, reduction)  # type: ignore[misc]
        except PeerTimeoutError:
            self.node_failed = True
            raise

    def wait_params(self) -> None:
        """The parent's; a failure there is the node's own all-gather of updated shards
        (``intra_node='shard'``): a worker of this node died, the node leaves whole."""
        try:
            super().wait_params()  # type: ignore[misc]
        except PeerTimeoutError as exc:
            self._node_failure(exc)

    def _node_failure(self, exc: PeerTimeoutError) -> None:
        """A node collective in flight failed: kept as the iteration's failure (unless an earlier one
        is), and the node's other work in flight dropped (it will never complete)."""
        self.node_failed = True
        if self.failure is None:
            self._failed(exc)
        self.drop_node_work()  # type: ignore[attr-defined]

    def _failed(self, exc: PeerTimeoutError) -> None:
        self.failure, self.failed_at = exc, self.step  # type: ignore[attr-defined]
        logger.warning("decentpy.elastic: rank %d, step %d: %s; finishing this step locally (no mix) and re-forming "
                       "the group over the survivors", self.group.to_global(self.rank),  # type: ignore[attr-defined]
                       self.step, exc)  # type: ignore[attr-defined]

    def abandon(self) -> None:
        """Forget every exchange in flight (the group is being replaced: nobody will complete them),
        and, where a node collective failed, the node's own work in flight too."""
        for b in self.buckets:  # type: ignore[attr-defined]
            b.work = None
            b.comm_valid = False
            b.skip_mix = True
        if self.node_failed:
            self.drop_node_work()  # type: ignore[attr-defined]


class ElasticGossipStrategy(ElasticStrategy, GossipStrategy):
    """Plain gossip mix-and-step that degrades to local steps after a peer failure."""


class ElasticNodeAllReduce(ElasticStrategy, NodeAllReduce):
    """``intra_node='allreduce'``, elastic (the failure domain is the node)."""


class ElasticNodeShard(ElasticStrategy, NodeShard):
    """``intra_node='shard'``, elastic (the failure domain is the node). Each shard of each bucket
    is gossiped among the ranks holding that shard on the other nodes, so after a peer failure
    every shard has either completed its mix or stepped locally; the node's all-gather of the
    updated shards runs either way, so a surviving node's workers still hold one model."""


ELASTIC_STRATEGIES = {"gossip": ElasticGossipStrategy, "allreduce": ElasticNodeAllReduce, "shard": ElasticNodeShard}
