"""The typed interface between the backward driver and a bucket strategy.

:class:`~decentpy.engine.driver.BackwardDriver` owns what every data-parallel wrapper needs in
backward (the autograd hooks, readiness, the end of backward, accumulation, Join); a
:class:`BucketStrategy` owns buckets and decides what happens to one when its gradients are ready,
as a comm hook does for c10d's ``Reducer``. A new way of treating a ready bucket (a new exchange, a
new reduction) is a new subclass; the driver does not change.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

__all__ = ["BucketStrategy", "Readiness"]


@dataclass(frozen=True)
class Readiness:
    """Which parameters each bucket waits for. Buckets are handed to the strategy in list order, the
    same on every rank (so all ranks issue their collectives in one order), each once every
    parameter it lists has its gradient (or at the end of backward). A parameter may be in several
    buckets (a bucket may hold part of it), or in none."""

    members: Tuple[Tuple[int, ...], ...]
    buckets_of: Tuple[Tuple[int, ...], ...]  # per parameter: the buckets listing it
    first_of: Tuple[int, ...]                # per parameter: its first bucket (len(members): none)

    @classmethod
    def of(cls, members: Sequence[Sequence[int]], num_params: int) -> "Readiness":
        buckets_of = [[] for _ in range(num_params)]  # type: ignore[var-annotated]
        for b, indices in enumerate(members):
            for i in indices:
                buckets_of[i].append(b)
        return cls(tuple(tuple(m) for m in members), tuple(tuple(b) for b in buckets_of),
                   tuple(b[0] if b else len(members) for b in buckets_of))


class BucketStrategy(abc.ABC):
    """What a wrapper does with its buckets during backward (the driver calls these, nothing else).

    Per iteration: :meth:`begin_iteration`; then, as gradients arrive, :meth:`grad_ready` for each
    (and :meth:`begin_backward` once, after the first one it takes); :meth:`bucket_ready` for every
    bucket, in order; :meth:`end_backward`. A joined rank (``Join``) runs the same sequence without
    gradients, with ``joined=True``. Parameters are numbered as given to
    :meth:`~decentpy.engine.driver.BackwardDriver.attach`.
    """

    @abc.abstractmethod
    def readiness(self) -> Optional[Readiness]:
        """The buckets' members; None while the layout is provisional: the driver then traces the
        first backward's gradient-ready order, hands it to :meth:`settle_layout` at its end, and only
        then hands out the buckets."""

    def settle_layout(self, order: Sequence[int]) -> None:
        """Fix the layout from the first backward's gradient-ready order (parameters in ``order``
        first, in that order; the rest had no gradient)."""
        raise NotImplementedError(f"{type(self).__name__} has no provisional layout")

    def begin_iteration(self, in_join: bool, active: bool) -> None:
        """A training forward (``active``) or a joined rank's iteration starts; ``in_join``: inside a
        ``Join`` context."""

    def stray_grad(self, index: int) -> None:
        """Parameter ``index`` got a gradient outside an iteration (no training forward since the last
        backward, nor an eval-mode forward with gradients): refuse it here, or let it accumulate."""

    @abc.abstractmethod
    def grad_ready(self, index: int, first: bool, sent: bool) -> bool:
        """Parameter ``index`` has its gradient (``first``: its first this iteration; ``sent``: a
        bucket holding it was handed out already). Returns whether it counts (False: it is ignored)."""

    def begin_backward(self) -> None:
        """The first gradient of an iteration's backward was taken."""

    def settle(self) -> None:
        """Apply what the last iteration left pending on the host (its optimizers' step counters,
        LR schedulers, reports), if anything; before the optimizers are read or stepped again."""

    @abc.abstractmethod
    def bucket_ready(self, bucket: int, joined: bool) -> None:
        """Bucket ``bucket`` has its gradients (or backward ended): act on it. ``joined``: a rank out of
        data serving the others' iteration (it has no gradients of its own)."""

    @abc.abstractmethod
    def end_backward(self, joined: bool) -> None:
        """Every bucket was handed out: complete the iteration."""
