"""The exchange of compressed gossip within a group of more than two ranks (see
:mod:`decentpy.optim.compression` for the algorithm): a reduce-scatter and an all-gather of compressed
chunks, with the owner's re-quantisation between them.

Round 1: every member sends each other member ``c`` the bytes of chunk ``c`` of its ``q`` (the
wire regions of the chunk's elements: block scales and codes, see
:func:`decentpy.optim.kernels.wire_regions`) and receives the other members' bytes of its own chunk, at
the same offsets, into one receive slot per member. The owner's step
(:func:`decentpy.optim.kernels.group_reduce`) then averages its chunk over the members, writes the
re-quantised mean ``r`` into the result bytes and keeps the rounding in its own public copy. Round 2
sends that chunk of ``r`` to every other member and receives theirs: the result bytes then hold the
whole ``r``, which the next fused pass adds to the group's public mean.

Round 2's sends can only start once round 1 has arrived (its receives are posted at the
launch), and the bucket's exchange is waited for only at its next mix, an iteration later. So the
middle step runs on a helper thread (one per strategy: the rounds of all buckets run in launch
order) that waits for round 1, reduces and launches round 2, while the training thread goes on;
the training thread waits for round 2 at the next mix. gloo's point-to-point work cannot be
polled (it completes only inside ``wait``), hence a thread rather than polling. Every pair of
members exchanges over the communicator's ``send_recv`` (the bucket's tag): round 1 is posted
before round 2 on both ends of every pair, so the messages match in order.
"""

from __future__ import annotations

import concurrent.futures
import datetime
from typing import Any, List, Optional, Sequence, Tuple

from torch import Tensor

from ..optim import kernels
from ..optim.compression import Compression, chunk_bounds
from ..topology import Topology
from .plans import ExchangePlan, NoExchange
from .waits import PeerTimeoutError

__all__ = ["GroupExchange", "GroupExchanger", "compressed_needs", "other_members", "start_compressed_mean"]


def compressed_needs(topology: Topology) -> Tuple[bool, List[Tuple[int, ...]]]:
    """What a communicator must set up for compressed exchanges over ``topology`` (the form of
    :func:`decentpy.comm.plans.communication_needs`): point to point only -- pairs and both rounds of
    the group exchange -- for any group of more than one rank; no collective group."""
    return any(len(g.ranks) > 1 for g in topology.unique_groups()), []


def other_members(plan: ExchangePlan, rank: int) -> List[int]:
    """The other members of the plan's group, in rank order (the order of the receive slots)."""
    return [] if isinstance(plan, NoExchange) else [r for r in plan.group.ranks if r != rank]


def start_compressed_mean(comm: Any, exchanger: "GroupExchanger", tag: int, plan: ExchangePlan, rank: int,
                          compression: Compression, numel: int, wires: Sequence[Tensor], excess: Tensor,
                          timeout: datetime.timedelta, step: Optional[int]) -> Tuple[Optional["GroupExchange"], Tensor]:
    """Start the compressed mean of this rank's wire ``wires[0]`` (``numel`` elements, error-fed into
    ``excess``) over the plan's group, on an exact-average group (the outer exchange of local steps):
    ``wires`` = [q, result, one receive slot per other member...]. Returns the exchange in flight
    (None: alone) and the wire that holds the mean once it completes (``result``, or ``q`` alone)."""
    others = other_members(plan, rank)
    if not others:
        return None, wires[0]
    work = GroupExchange(comm, exchanger, tag, plan.group.ranks, rank, compression, numel, wires[0],
                         list(wires[2:2 + len(others)]), wires[1], excess, timeout, step)
    return work, wires[1]


class GroupExchanger:
    """Runs the middle step of every group exchange of one strategy, in launch order."""

    def __init__(self) -> None:
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def submit(self, fn: Any) -> "concurrent.futures.Future[Any]":
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="decentpy-choco")
        return self._pool.submit(fn)

    def close(self) -> None:
        """Stop the helper thread (after what it runs now: every wait there is bounded)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class GroupExchange:
    """One bucket's compressed exchange with the other members of ``ranks`` (an in-flight work:
    :meth:`wait` before the receive slots, the result bytes or the owner's copy are used again)."""

    def __init__(self, comm: Any, exchanger: GroupExchanger, bucket: int, ranks: Sequence[int], rank: int,
                 compression: Compression, numel: int, q: Tensor, slots: Sequence[Tensor], result: Tensor,
                 self_copy: Tensor, timeout: datetime.timedelta, step: Optional[int]) -> None:
        """``q``: this rank's compressed difference (wire bytes of ``numel`` elements); ``slots``: one
        receive buffer of the same size per other member, in rank order; ``result``: where ``r``
        lands; ``self_copy``: this rank's public copy in the group (its chunk is adjusted)."""
        self.comm = comm
        self.bucket = bucket
        self.ranks = list(ranks)
        self.rank = rank
        self.compressor = compression.compressor
        self.numel = numel
        self.q, self.slots, self.result, self.self_copy = q, list(slots), result, self_copy
        self.timeout = timeout
        self.step = step
        m = len(self.ranks)
        self.position = self.ranks.index(rank)
        self.others = [r for r in self.ranks if r != rank]
        self.chunks = [chunk_bounds(numel, m, p) for p in range(m)]
        #: per position, the wire byte ranges of its chunk (its block scales, then its codes)
        self.regions = [kernels.wire_regions(self.compressor, numel, lo, hi) for lo, hi in self.chunks]
        # Round 1: chunk c of q to its owner, this rank's chunk of every other member's q into its slot.
        # Round 2's receives are posted now too (the other members' chunks of r land in parts of the
        # result bytes that the reduction does not touch): a message that arrives before its receive is
        # posted keeps gloo's receiving thread spinning. Per peer they follow round 1's, as the peer's
        # sends do, so the messages match in order.
        mine = self.regions[self.position]
        works, round2 = [], []
        for t, j in enumerate(self.others):
            theirs = self.regions[self.ranks.index(j)]
            works += self._pair(j, [q[a:b] for a, b in theirs], [self.slots[t][a:b] for a, b in mine])
        for j in self.others:
            theirs = self.regions[self.ranks.index(j)]
            round2 += self._pair(j, [q[:0]] * len(theirs), [self.result[a:b] for a, b in theirs])
        self._round1 = works
        self._round2: List[Any] = round2
        self._future = exchanger.submit(self._reduce_and_send)

    def _pair(self, peer: int, sends: List[Tensor], recvs: List[Tensor]) -> List[Any]:
        works = []
        for s, r in zip(sends, recvs):  # both ends list their regions in the same order
            if s.numel() == 0 and r.numel() == 0:
                continue
            w = self.comm.send_recv(self.bucket, peer, s, r)
            if hasattr(w, "step"):
                w.step = self.step
            works.append(w)
        return works

    def _reduce_and_send(self) -> List[Any]:
        """On the helper thread: wait for round 1, reduce this rank's chunk, launch round 2."""
        for w in self._round1:
            w.wait(self.timeout)
        self._round1 = []
        inputs = list(self.slots[:len(self.others)])
        inputs.insert(self.position, self.q)  # the members' q in rank order, this rank's own included
        lo, hi = self.chunks[self.position]
        kernels.group_reduce(self.compressor, inputs, self.result, self.self_copy, lo, hi)
        mine = self.regions[self.position]
        works = []
        for j in self.others:
            works += self._pair(j, [self.result[a:b] for a, b in mine], [self.result[:0]] * len(mine))
        return works

    def wait(self, timeout: datetime.timedelta) -> None:
        """Both rounds completed (each wait bounded by ``timeout``; the helper's failure re-raised here)."""
        if self._future is not None:
            future, self._future = self._future, None
            try:
                self._round2 += future.result(timeout=2 * timeout.total_seconds() + 5.0)
            except concurrent.futures.TimeoutError:
                raise PeerTimeoutError(
                    f"rank {self.rank}: the compressed group exchange of bucket {self.bucket} (step {self.step}) with "
                    f"{self.others} did not reach its second round within {2 * timeout.total_seconds() + 5:.0f} s",
                    self.others, self.bucket, self.step) from None
        works, self._round2 = self._round2, []
        for w in works:
            w.wait(timeout)
