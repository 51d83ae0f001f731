"""The gossip step of an elastic wrapper: a failed exchange ends the step's communication, not the run.

:class:`ElasticGossipStrategy` is :class:`~decentpy.engine.gossip.GossipStrategy` with one change,
taken only when a peer fails: the first :class:`~decentpy.comm.PeerTimeoutError` of an iteration
(a wait for a bucket's exchange, or the launch of the next one) is kept in :attr:`failure` instead of
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
from ..grad_scaling import UNSCALED

__all__ = ["ElasticGossipStrategy"]

logger = logging.getLogger(__name__)


class ElasticGossipStrategy(GossipStrategy):
    """Gossip mix-and-step that degrades to local steps after a peer failure (see the module)."""

    #: the iteration's first peer failure (None: none); read by the elastic wrapper before the next forward
    failure: Optional[PeerTimeoutError] = None
    #: the step at which it happened
    failed_at: Optional[int] = None

    def mix_and_step(self, b: Bucket, local_step: bool, reduction: Optional[Any] = None) -> None:
        if self.failure is None:
            try:
                self.wait_exchange(b)
            except PeerTimeoutError as exc:
                self._failed(exc)
        if self.failure is None:
            try:
                super().mix_and_step(b, local_step, reduction)  # its wait is done: the mix, step and launch
                return
            except PeerTimeoutError as exc:  # the launch of the next exchange (the bucket has stepped)
                self._failed(exc)
                b.work = None
                return
        # Degraded: the local step alone, nothing received is mixed, nothing is launched.
        b.work = None
        grads = self.grad_args(b, reduction) if local_step else UNSCALED
        b.step(None, 1.0, 0.0, None, grads, local_step)
        b.comm_valid = False
        b.skip_mix = True
        self.stepped(b)

    def _failed(self, exc: PeerTimeoutError) -> None:
        self.failure, self.failed_at = exc, self.step
        logger.warning("decentpy.elastic: rank %d, step %d: %s; finishing this step locally (no mix) and re-forming "
                       "the group over the survivors", self.group.to_global(self.rank), self.step, exc)

    def abandon(self) -> None:
        """Forget every exchange in flight (the group is being replaced: nobody will complete them)."""
        for b in self.buckets:
            b.work = None
            b.comm_valid = False
            b.skip_mix = True
