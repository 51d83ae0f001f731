"""Failure policies: what a gossip strategy does when a peer fails (one part of the strategy, chosen by
name from :data:`FAILURE_POLICIES`, as the node mode and the exchange are).

The strategy runs every operation that can meet a failed peer through its policy: a bucket's
sequence (wait for its exchange, step, launch the next), the node's reduction of a bucket's
gradient, what follows a step (a node's all-gather of updated shards), and the wait for the
parameters. A policy wraps those operations, the way compression wraps a communication hook,
instead of subclassing every strategy:

- ``"raise"`` (:class:`FailurePolicy`): the operation's own error propagates (a
  :class:`~decentpy.comm.PeerTimeoutError` naming the peer, on every rank that waits for it).
- ``"elastic"`` (:class:`ElasticPolicy`): the iteration's first failure is kept, not raised; every
  bucket that has not stepped yet takes its local optimizer step without mixing and launches
  nothing, so no survivor mixes a half-received buffer; the elastic wrapper re-forms the group over
  the survivors before the next forward (:mod:`decentpy.elastic`).

Adding a policy: subclass :class:`FailurePolicy`, override the operations it guards, register it
in :data:`FAILURE_POLICIES`. A policy is handed the strategy it serves; this module imports
:class:`~decentpy.engine.gossip.GossipStrategy` for type checking only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Optional, Type

from ..comm import PeerTimeoutError
from ..optim.grad_scaling import UNSCALED, GradArgs
from .bucket import Bucket

if TYPE_CHECKING:
    from .gossip import GossipStrategy

__all__ = ["FailurePolicy", "ElasticPolicy", "FAILURE_POLICIES", "make_failure_policy"]

logger = logging.getLogger(__name__)


class FailurePolicy:
    """The ``"raise"`` policy: every operation runs as it is and its errors propagate. The base of
    every policy: an override guards an operation and calls this one for the work."""

    name = "raise"
    #: whether the strategy may defer the skip verdicts of an iteration to the next backward
    defers_verdicts = True
    #: the iteration's first peer failure kept instead of raised (None: none)
    failure: Optional[PeerTimeoutError] = None
    #: the step at which it happened
    failed_at: Optional[int] = None

    def __init__(self, strategy: "GossipStrategy") -> None:
        self.strategy = strategy

    def bucket(self, b: Bucket, local_step: bool, reduction: Optional[Any] = None) -> None:
        """The bucket's sequence: wait for its exchange, step, launch the next."""
        self.strategy.mix_and_step(b, local_step, reduction)

    def grad_args(self, b: Bucket, reduction: Optional[Any]) -> GradArgs:
        """The bucket's gradient arguments (a node strategy: after the node's reduction)."""
        return self.strategy.grad_args(b, reduction)

    def stepped(self, b: Bucket) -> None:
        """What follows a bucket's step (a node strategy with shards: the all-gather)."""
        self.strategy.stepped(b)

    def wait_params(self) -> None:
        """The wait for whatever still writes the parameters after a step."""
        self.strategy.wait_params()

    def attach(self, comm: Any) -> None:
        """The strategy got its communicator."""

    def abandon(self) -> None:
        """Forget every exchange in flight: the group is being replaced."""
        raise RuntimeError(f"the {self.name!r} failure policy does not abandon a group")


class ElasticPolicy(FailurePolicy):
    """A failed exchange ends the step's communication, not the run; see the module.

    A failure inside the node's own collectives (the reduction of the gradients, the all-gather of
    updated shards) means a worker of this node died or left for the re-formation: this worker's
    remaining buckets do nothing more in the iteration, and a node whose worker died is left out
    whole at the re-formation. With no failure each operation is the strategy's own (one ``is
    None`` test per bucket)."""

    name = "elastic"
    defers_verdicts = False  # a re-formation replaces the strategy: nothing may stay pending across it

    def __init__(self, strategy: "GossipStrategy") -> None:
        super().__init__(strategy)
        self.failure = None
        self.failed_at = None
        #: the failure came from the node's own collectives (their work in flight is dropped at abandon)
        self.node_failed = False

    def bucket(self, b: Bucket, local_step: bool, reduction: Optional[Any] = None) -> None:
        s = self.strategy
        if self.failure is None:
            try:
                s.wait_exchange(b)
            except PeerTimeoutError as exc:
                self._failed(exc)
        if self.failure is None:
            try:
                super().bucket(b, local_step, reduction)
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
        b.step(None, 1.0, 0.0, None, grads, local_step, no_update=s.without_gradient(b, local_step))
        b.comm_valid = False
        b.skip_mix = True
        self.stepped(b)

    def grad_args(self, b: Bucket, reduction: Optional[Any]) -> GradArgs:
        """A failure here is the node's own reduction (a node strategy)."""
        try:
            return super().grad_args(b, reduction)
        except PeerTimeoutError:
            self.node_failed = True
            raise

    def stepped(self, b: Bucket) -> None:
        """A failure here is the node's own collective (the all-gather of updated shards): a worker
        of this node died."""
        try:
            super().stepped(b)
        except PeerTimeoutError as exc:
            self._node_failure(exc)

    def wait_params(self) -> None:
        """A failure in the node's own all-gather of updated shards (``intra_node='shard'``): a worker
        of this node died, the node leaves whole. A failure in the exchange's own wait (local steps:
        the outer exchange) costs that exchange only: it is dropped (the global copies and the
        parameters stay as they are, so the next outer step's pseudo-gradient still carries this
        window's progress) and the group re-forms."""
        s = self.strategy
        try:
            s.wait_node_params()
        except PeerTimeoutError as exc:
            self._node_failure(exc)
        if self.node_failed:
            s.exchange.abandon()
            return
        try:
            s.exchange.wait_params()
        except PeerTimeoutError as exc:
            s.exchange.abandon()
            if self.failure is None:
                self._failed(exc)

    def attach(self, comm: Any) -> None:
        watch = getattr(comm, "watch", None)
        node = self.strategy.node_reduction()
        if node is not None and watch is not None:
            # a node collective whose peer left for a re-formation ends when that peer reports it
            node.watch_peers(watch, self.strategy.group)

    def abandon(self) -> None:
        """Forget every exchange in flight (the group is being replaced: nobody will complete them),
        and, where a node collective failed, the node's own work in flight too."""
        for b in self.strategy.buckets:
            b.work = None
            b.comm_valid = False
            b.skip_mix = True
        self.strategy.exchange.abandon()
        if self.node_failed:
            self.strategy.drop_node_work()

    def _node_failure(self, exc: PeerTimeoutError) -> None:
        """A node collective in flight failed: kept as the iteration's failure (unless an earlier one
        is), and the node's other work in flight dropped (it will never complete)."""
        self.node_failed = True
        if self.failure is None:
            self._failed(exc)
        self.strategy.drop_node_work()

    def _failed(self, exc: PeerTimeoutError) -> None:
        s = self.strategy
        self.failure, self.failed_at = exc, s.step
        logger.warning("decentpy.elastic: rank %d, step %d: %s; finishing this step locally (no mix) and re-forming "
                       "the group over the survivors", s.group.to_global(s.rank), s.step, exc)


#: failure policy name -> class (``GossipStrategy(..., failure=name)``)
FAILURE_POLICIES: Dict[str, Type[FailurePolicy]] = {cls.name: cls for cls in (FailurePolicy, ElasticPolicy)}


def make_failure_policy(name: str, strategy: "GossipStrategy") -> FailurePolicy:
    """The policy registered as ``name``, bound to ``strategy``."""
    if name not in FAILURE_POLICIES:
        raise ValueError(f"failure policy must be one of {', '.join(map(repr, FAILURE_POLICIES))}, got {name!r}")
    return FAILURE_POLICIES[name](strategy)
