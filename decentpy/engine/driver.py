"""The backward driver: one per data-parallel wrapper, the same for all of them.

Like c10d's ``Reducer``, one object sees every gradient become ready. It owns what every wrapper
needs in backward and nothing else: the autograd hooks on the parameters (registered here only),
which buckets are ready, handing them to the strategy in the same order on every rank (so that
all ranks issue their collectives in one order), the end-of-backward callback, gradient
accumulation (``no_sync``), a joined rank's iterations (``Join``) and bounded waits. What happens
to a ready bucket is the strategy's (:class:`~decentpy.engine.strategy.BucketStrategy`): gossip
mix-and-step, node reduction then gossip, the sharded-gradient reduce.

A strategy whose layout is provisional (the gossip wrappers' buckets before the first backward)
gets the gradient-ready order of the first backward at its end, fixes its layout from it, and
then every bucket is handed out, so the first iteration gets its update too.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook

from ..comm import wait_bounded
from ..comm.failures import PeerWatch
from .strategy import BucketStrategy, Readiness

__all__ = ["BackwardDriver", "BoundedWait", "DriverJoinHook"]


class BoundedWait:
    """Waits for collectives. On the CPU a wait is bounded by ``timeout`` (a
    :class:`~decentpy.comm.PeerTimeoutError` names what was waited for); on a GPU it only orders the
    current stream after the work (the NCCL watchdog bounds it): a bounded wait there would block the
    host at every wait."""

    def __init__(self, timeout: datetime.timedelta, device: Optional[torch.device] = None) -> None:
        self.timeout = timeout
        self.stream_ordered = device is not None and device.type == "cuda"
        self.watch: Optional[PeerWatch] = None
        self.peers: List[int] = []

    def watched(self, watch: PeerWatch, peers: Sequence[int]) -> None:
        """Wait through ``watch`` from now on (``peers``: the global ranks the collectives involve):
        the wait also ends, classified, when any rank of the group reports a failure or a peer stops
        beating -- at the cost of a thread hand-off per wait (elastic training: a peer that leaves
        for a re-formation must not hold the others for the whole timeout)."""
        self.watch, self.peers = watch, list(peers)

    def __call__(self, work: Any, what: str) -> None:
        if self.stream_ordered:
            work.wait()
        elif self.watch is not None:
            self.watch.wait(work, f"rank {dist.get_rank()}: {what}", self.peers)
        else:
            wait_bounded(work, self.timeout, f"rank {dist.get_rank()}: {what}")


class BackwardDriver:
    """Hooks, readiness and the end of backward for one wrapper; :meth:`attach` gives it the
    parameters and the strategy (again after the wrapper rebuilds its buckets)."""

    def __init__(self) -> None:
        self.strategy: Optional[BucketStrategy] = None
        self.accumulate = False           # gradient accumulation (no_sync): backward passes only accumulate
        self._hooks: List[Any] = []
        self._armed = False               # a training forward ran: its backward is one iteration
        self._outside_iteration = False   # the last forward was not a training one (eval mode, with gradients)
        self._callback_queued = False
        self._ready: Optional[Readiness] = None  # None: tracing the layout's gradient-ready order
        self._seen: List[bool] = []
        self._pending: List[int] = []
        self._next = 0                    # the next bucket to hand out
        self._trace: List[int] = []

    def attach(self, params: Sequence[Tensor], strategy: BucketStrategy) -> None:
        """Hook ``params`` (numbered in this order for the strategy) for ``strategy``; the hooks of an
        earlier attach go. ``accumulate`` is kept (a ``no_sync()`` active now stays active)."""
        self.remove_hooks()
        self.strategy = strategy
        self._seen = [False] * len(params)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _make_hook(self, index: int) -> Callable[[Tensor], None]:
        def hook(_: Tensor) -> None:
            self._on_grad(index)
        return hook

    # -- accumulation --------------------------------------------------------------------------
    def set_accumulate(self, enable: bool) -> None:
        """Backward passes only accumulate gradients while set; the first one after steps."""
        self.accumulate = bool(enable)

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """``no_sync()``: backward passes inside only accumulate gradients (the flag is restored
        after, also when nested)."""
        before = self.accumulate
        self.accumulate = True
        try:
            yield
        finally:
            self.accumulate = before

    # -- iterations ----------------------------------------------------------------------------
    def arm(self, in_join: bool = False) -> None:
        """A training-mode forward: the next backward is one iteration (``in_join``: inside ``Join``)."""
        if self._callback_queued:
            return  # a forward inside backward (e.g. checkpoint recomputation) changes nothing
        self._strategy().begin_iteration(in_join, active=True)
        self._start()

    def leave_iteration(self) -> None:
        """A forward with gradients in eval mode: its backward (if any) is not an iteration, and its
        gradients accumulate locally (as with torch DDP)."""
        if not self._callback_queued:
            self._armed = False
            self._outside_iteration = True

    def _strategy(self) -> BucketStrategy:
        assert self.strategy is not None, "internal error: the driver has no strategy (attach() first)"
        return self.strategy

    def _start(self) -> None:
        self._armed = True
        self._outside_iteration = False
        self._next = 0
        self._trace = []
        self._seen = [False] * len(self._seen)
        self._ready = self._strategy().readiness()
        self._pending = [len(m) for m in self._ready.members] if self._ready is not None else []

    @torch.no_grad()
    def run_iteration(self, joined: bool) -> None:
        """One iteration outside backward, every bucket in order: a joined rank's share of the others'
        iteration (``joined``: its ``Join`` hook), or, not joined, the hand-out of the gradients
        accumulated so far (``ShardedDataParallel.reduce``)."""
        s = self._strategy()
        s.begin_iteration(in_join=joined, active=not joined)
        self._start()
        s.begin_backward()
        self._hand_out_rest(joined)
        s.end_backward(joined)
        self._armed = False

    # -- backward ------------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, index: int) -> None:
        if self.accumulate:
            return
        s = self.strategy
        assert s is not None
        if not self._armed:
            if not self._outside_iteration:
                s.stray_grad(index)
            return
        ready = self._ready
        first = not self._seen[index]
        sent = ready is not None and ready.first_of[index] < self._next
        if not s.grad_ready(index, first, sent):
            return
        if not self._callback_queued:
            self._callback_queued = True
            try:
                s.begin_backward()
            except BaseException:  # (a bad hyper-parameter): no iteration runs; the next forward starts afresh
                self._callback_queued = False
                self._armed = False
                raise
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not first:
            return
        self._seen[index] = True
        if ready is None:
            self._trace.append(index)
            return
        pending = self._pending
        for b in ready.buckets_of[index]:
            pending[b] -= 1
        while self._next < len(pending) and pending[self._next] == 0:
            s.bucket_ready(self._next, False)
            self._next += 1

    def _hand_out_rest(self, joined: bool) -> None:
        """Every bucket not handed out yet (those waiting for parameters without a gradient), in order."""
        s = self._strategy()
        if self._ready is None:
            self._ready = s.readiness()
            assert self._ready is not None, "internal error: the strategy's layout is still provisional"
        while self._next < len(self._ready.members):
            s.bucket_ready(self._next, joined)
            self._next += 1

    def _end_of_backward(self) -> None:
        with torch.no_grad():
            try:
                s = self._strategy()
                if self._ready is None:
                    s.settle_layout(self._trace)
                self._hand_out_rest(False)
                s.end_backward(False)
            finally:
                self._callback_queued = False
                self._armed = False


class DriverJoinHook(JoinHook):
    """A joined rank's part in each iteration the others still run: ``before`` (e.g. a buffer
    broadcast the others' forward makes), then the driver's joined iteration; ``after`` once every
    rank has joined."""

    def __init__(self, driver: BackwardDriver, before: Optional[Callable[[], None]] = None,
                 after: Optional[Callable[[], None]] = None) -> None:
        self.driver = driver
        self.before = before
        self.after = after

    def main_hook(self) -> None:
        if self.before is not None:
            self.before()
        self.driver.run_iteration(joined=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        if self.after is not None:
            self.after()
