"""Exchange plans: how one bucket trades parameters with its group at one step.

This module is the one owner of the rules that depend on the kind of exchange: which buffer is
sent and which receives, the ``(a, b)`` coefficients of the mix ``p <- a p + b recv``, and the
scale the kernel applies when it writes the send buffer. The reducer asks the plan of a step and
never looks at a group's size; the communicators only provide primitives (point-to-point
exchange, all-reduce over a group), so a new kind of exchange (compression, another collective)
is one new :class:`ExchangePlan` subclass.

Built-in plans, with ``w`` the group's self weight and ``s = (1 - w) / (|R| - 1)``:

* :class:`NoExchange` -- a group of one: nothing travels, nothing mixes.
* :class:`PairExchange` -- two ranks: the parameter block itself is sent (no copy), the peer's
  lands in the bucket's receive buffer; ``p <- w p + (1 - w) recv``.
* :class:`GroupAllReduce` -- more ranks: the kernel writes ``s p`` into the receive buffer, which
  is all-reduced in place over the group; ``p <- (w - s) p + recv``.
"""

from __future__ import annotations

import abc
import datetime
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..topology import Group, Topology

if TYPE_CHECKING:
    from .protocol import Communicator, Work

__all__ = ["ExchangePlan", "NoExchange", "PairExchange", "GroupAllReduce", "plan_exchange", "ExchangeSchedule",
           "communication_needs", "BufferMix"]


class ExchangePlan(abc.ABC):
    """The exchange of one rank's bucket with ``group`` at one step."""

    def __init__(self, group: Group, rank: int) -> None:
        self.group = group
        self.rank = rank

    #: whether the received buffer is mixed into the parameters
    mixes: bool = True
    #: whether the communicator needs point-to-point exchanges for this plan
    point_to_point: bool = False
    #: ranks that need a collective (sub-)group for this plan, or None
    collective_ranks: Optional[Tuple[int, ...]] = None

    @abc.abstractmethod
    def coefficients(self) -> Tuple[float, float]:
        """``(a, b)`` of the mix ``p <- a p + b recv``."""

    def mix_coefficients(self, adaptive_factor: float = 1.0) -> Tuple[float, float]:
        """The mix scaled by the adaptive factor ``f``: ``p <- (1 - f) p + f (a p + b recv)``."""
        a, b = self.coefficients()
        f = adaptive_factor
        return (1.0 - f) + f * a, f * b

    def send_scale(self) -> Optional[float]:
        """Scale with which the kernel writes the receive buffer as the buffer to send (``None``:
        the parameter block itself is sent, nothing is written)."""
        return None

    @abc.abstractmethod
    def launch(self, comm: Communicator, bucket: int, param: Tensor, buffer: Tensor) -> Optional[Work]:
        """Start the exchange of ``param`` (and/or the prepared ``buffer``); results land in ``buffer``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ranks={self.group.ranks}, weight={self.group.weight})"


class NoExchange(ExchangePlan):
    """A group of one: the rank keeps its parameters."""

    mixes = False

    def coefficients(self) -> Tuple[float, float]:
        return 1.0, 0.0

    def launch(self, comm: Communicator, bucket: int, param: Tensor, buffer: Tensor) -> Optional[Work]:
        return None


class PairExchange(ExchangePlan):
    """Two ranks swap their parameter blocks (one send, one receive; nothing is copied first)."""

    point_to_point = True

    def __init__(self, group: Group, rank: int) -> None:
        super().__init__(group, rank)
        a, b = group.ranks
        self.peer = b if a == rank else a

    def coefficients(self) -> Tuple[float, float]:
        w = self.group.weight
        return w, 1.0 - w

    def launch(self, comm: Communicator, bucket: int, param: Tensor, buffer: Tensor) -> Optional[Work]:
        return comm.send_recv(bucket, self.peer, param, buffer)


class GroupAllReduce(ExchangePlan):
    """Three or more ranks: an in-place all-reduce of the pre-scaled parameters."""

    def __init__(self, group: Group, rank: int) -> None:
        super().__init__(group, rank)
        self.collective_ranks = group.ranks

    def coefficients(self) -> Tuple[float, float]:
        return self.group.weight - self.group.neighbour_weight(), 1.0

    def send_scale(self) -> Optional[float]:
        return self.group.neighbour_weight()

    def launch(self, comm: Communicator, bucket: int, param: Tensor, buffer: Tensor) -> Optional[Work]:
        return comm.all_reduce(bucket, self.group.ranks, buffer)


def plan_exchange(group: Group, rank: int) -> ExchangePlan:
    """The plan for ``rank`` in ``group`` (the only place that chooses by group size)."""
    if rank not in group.ranks:
        raise ValueError(f"rank {rank} is not in group {group.ranks}")
    if len(group.ranks) == 1:
        return NoExchange(group, rank)
    if len(group.ranks) == 2:
        return PairExchange(group, rank)
    return GroupAllReduce(group, rank)


class ExchangeSchedule:
    """This rank's plan at every step of a topology (one plan object per step of the period)."""

    def __init__(self, topology: Topology, rank: int) -> None:
        self.topology = topology
        self.rank = rank
        self._plans: Dict[int, ExchangePlan] = {}

    def at(self, step: int) -> ExchangePlan:
        index = step % self.topology.period
        plan = self._plans.get(index)
        if plan is None:
            plan = self._plans[index] = plan_exchange(self.topology.group_of(self.rank, index), self.rank)
        return plan


def communication_needs(topology: Topology) -> Tuple[bool, List[Tuple[int, ...]]]:
    """What a communicator must set up for ``topology``, on every rank alike: whether any rank
    exchanges point to point, and the groups that need a collective group, in schedule order
    (group creation is collective: every rank creates every group, in the same order)."""
    p2p = False
    collective: List[Tuple[int, ...]] = []
    for group in topology.unique_groups():
        plan = plan_exchange(group, group.ranks[0])
        p2p = p2p or plan.point_to_point
        if plan.collective_ranks is not None and plan.collective_ranks not in collective:
            collective.append(plan.collective_ranks)
    return p2p, collective


class BufferMix:
    """A whole buffer mixed with the plan's group, outside the kernel pass (the outer steps of local
    steps training: a global copy, a pseudo-gradient): started here, :meth:`wait` leaves
    ``a x + b recv`` in the buffer with the plan's coefficients (the exact mean for a group that
    averages). The buffer must not be written until then."""

    def __init__(self, plan: ExchangePlan, comm: "Communicator", tag: int, buf: Tensor,
                 timeout: datetime.timedelta, adaptive_factor: float = 1.0) -> None:
        """``adaptive_factor``: the mix ``(1 - f) x + f (a x + b recv)`` (the coefficients of a
        compressed gossip mix with ``gamma = f``, for a value that must mix alike)."""
        self.plan, self.buf, self.timeout, self.factor = plan, buf, timeout, adaptive_factor
        self.recv: Optional[Tensor] = None
        self.work: Optional["Work"] = None
        if plan.mixes:
            scale = plan.send_scale()
            # a pair receives into its own buffer; a group all-reduces the pre-scaled copy in place
            self.recv = torch.empty_like(buf) if scale is None else buf * scale
            self.work = plan.launch(comm, tag, buf, self.recv)

    def wait(self) -> Tensor:
        """The mixed buffer (waits for the exchange, bounded by the timeout)."""
        if self.work is not None:
            work, self.work = self.work, None
            work.wait(self.timeout)
            a, b = self.plan.mix_coefficients(self.factor)
            self.buf.mul_(a).add_(self.recv, alpha=b)
            self.recv = None
        return self.buf
