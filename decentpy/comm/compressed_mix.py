"""A whole buffer mixed with the plan's group through compressed gossip's exchanges (CHOCO: compressed
differences against tracked public copies), outside the kernel pass: the compressed form of
:class:`decentpy.comm.plans.BufferMix`, for the outer steps of local steps on a gossip topology
(the buffer ``[theta; delta]``: a global copy and a pseudo-gradient).

Why copies: a gossip outer step mixes the global copies themselves, and quantising a model's values
(not a difference) leaves an error of the values' own scale at every exchange. Each rank instead
sends ``q = Q(z - zhat)``, the difference between its buffer and its public copy ``zhat`` (which
every partner tracks identically), and both ends add ``D(q)`` to their copy of ``zhat``; the
differences shrink as the copies track the buffers, and so does the compression error (Koloskova
et al., 2019). The mix then moves ``z`` towards the partners' public copies:

* a pair ``{i, j}``: ``z_i += gamma (1 - w) (zhat_{j|i} - zhat_{i|j})``, with one pair of copies per
  distinct partner of the topology's period (time-varying pairs: a copy follows only the exchanges
  with its partner);
* a group of ``m > 2`` ranks: the group exchange of :mod:`decentpy.comm.group_exchange` (compressed
  chunks, each owner re-quantising the mean of its chunk and keeping the rounding in its own copy),
  whose result ``r`` moves the group's public mean ``M``; ``z_i += gamma s m (M - zhat_i)``, ``s``
  each other member's weight.

Either mix leaves the sum of the buffers over the group unchanged (doubly stochastic, and the
copies agree on both ends), so the replicas' mean follows the uncompressed mean exactly. Copies
start from the buffer every rank holds alike (``start``), or from zero when the replicas differ
(after an elastic re-formation): both ends start from the same value either way.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..optim import kernels
from ..optim.compression import Compression
from ..topology import Topology
from .group_exchange import GroupExchange, GroupExchanger, other_members
from .plans import ExchangePlan, plan_exchange

__all__ = ["GossipCopies", "CompressedMix", "gossip_partners", "public_copy"]


def public_copy(start: Optional[Tensor], numel: int, device: torch.device) -> Tensor:
    """A public copy's first value: the buffer every rank holds alike (``start``), else zero (the
    replicas differ): both ends of an exchange start from the same value either way."""
    if start is not None:
        return start.detach().to(torch.float32, copy=True)
    return torch.zeros(numel, dtype=torch.float32, device=device)


def gossip_partners(topology: Topology, rank: int) -> Tuple[List[Tuple[int, ...]], List[Tuple[int, ...]], int]:
    """``(pairs, groups, slots)`` over the topology's period seen from ``rank``: the distinct pairs
    and the distinct groups of more than two ranks it mixes in (rank tuples in the plans' order), and the
    most other members of one exchange (the receive slots it needs). A public copy follows one of them."""
    pairs: List[Tuple[int, ...]] = []
    groups: List[Tuple[int, ...]] = []
    slots = 1
    for step in range(topology.period):
        plan = plan_exchange(topology.group_of(rank, step), rank)
        members = other_members(plan, rank)
        slots = max(slots, len(members))
        g = tuple(plan.group.ranks)
        if members and g not in pairs and g not in groups:
            (pairs if len(members) == 1 else groups).append(g)
    return sorted(pairs), sorted(groups), slots


class GossipCopies:
    """One buffer's public copies for compressed gossip mixes over ``topology``, seen from ``rank``:
    per distinct pair partner ``(own copy, partner's copy)``, per distinct group of more than two
    ranks ``(own copy, the group's public mean)``; and the wire buffers of one exchange."""

    def __init__(self, topology: Topology, rank: int, numel: int, compression: Compression, device: torch.device,
                 start: Optional[Tensor] = None) -> None:
        self.compression = compression
        self.numel = numel
        peers, self.groups, slots = gossip_partners(topology, rank)
        self.peers = sorted(j for g in peers for j in g if j != rank)

        def copy() -> Tensor:
            return public_copy(start, numel, device)

        self.self_copy: Dict[int, Tensor] = {j: copy() for j in self.peers}
        self.peer_copy: Dict[int, Tensor] = {j: copy() for j in self.peers}
        self.group_self: Dict[Tuple[int, ...], Tensor] = {g: copy() for g in self.groups}
        self.group_mean: Dict[Tuple[int, ...], Tensor] = {g: copy() for g in self.groups}
        wire = kernels.compressed_bytes(compression.compressor, numel)
        self.wires = [torch.empty(wire, dtype=torch.uint8, device=device) for _ in range(2 + slots)]  # q, r, slots
        self._zero = torch.zeros(numel, dtype=torch.float32, device=device)  # the pack's excess (no feedback)
        self._decoded = torch.empty(numel, dtype=torch.float32, device=device)

    def memory_bytes(self) -> int:
        return 4 * self.numel * (2 * (len(self.peers) + len(self.groups)) + 2) + sum(w.numel() for w in self.wires)

    def pack(self, z: Tensor, own: Tensor) -> Tensor:
        """``q = Q(z - own)`` into the send wire, and ``own += D(q)`` (what the partners add too)."""
        self._zero.zero_()
        q = self.wires[0]
        kernels.outer_pack(own, z, q, self.compression.compressor, self._zero)
        self.add_decoded(own, q)
        return q

    def add_decoded(self, copy: Tensor, wire: Tensor) -> None:
        """``copy += D(wire)``: the same arithmetic on both ends of an exchange."""
        kernels.outer_decode(self.compression.compressor, wire, self._decoded)
        copy.add_(self._decoded)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.compression.kind, "peers": list(self.peers), "groups": [list(g) for g in self.groups],
                "pairs": {j: (self.self_copy[j].clone(), self.peer_copy[j].clone()) for j in self.peers},
                "group_copies": {g: (self.group_self[g].clone(), self.group_mean[g].clone()) for g in self.groups}}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        groups = [tuple(g) for g in state["groups"]]
        if state["kind"] != self.compression.kind or list(state["peers"]) != self.peers or groups != self.groups:
            raise ValueError(f"the checkpoint's compressed outer exchange has compression {state['kind']!r}, pair "
                             f"partners {state['peers']} and groups {groups}; this run has "
                             f"{self.compression.kind!r}, {self.peers} and {self.groups}")
        for j in self.peers:
            a, b = state["pairs"][j]
            self.self_copy[j].copy_(a)
            self.peer_copy[j].copy_(b)
        for g in self.groups:
            a, b = state["group_copies"][g]
            self.group_self[g].copy_(a)
            self.group_mean[g].copy_(b)


class CompressedMix:
    """``buf`` mixed with the plan's group by compressed gossip (see the module): started here,
    :meth:`wait` leaves the mixed buffer in ``buf``. ``buf`` and ``copies`` must not be touched until
    then."""

    def __init__(self, plan: ExchangePlan, comm: Any, exchanger: GroupExchanger, tag: int, buf: Tensor,
                 copies: GossipCopies, timeout: datetime.timedelta, step: Optional[int]) -> None:
        if buf.dtype != torch.float32 or buf.numel() != copies.numel:
            raise ValueError(f"a compressed mix takes a float32 buffer of {copies.numel} elements (its copies'), got "
                             f"{buf.dtype} of {buf.numel()}")
        self.plan, self.buf, self.copies, self.timeout = plan, buf, copies, timeout
        self.work: Any = None
        members = other_members(plan, plan.rank)
        self.members = members
        gamma = float(copies.compression.gamma)  # type: ignore[arg-type]
        if len(members) == 1:
            j = members[0]
            self.own, self.public = copies.self_copy[j], copies.peer_copy[j]
            q = copies.pack(buf, self.own)
            self.weight = gamma * plan.group.neighbour_weight()
            self.work = comm.send_recv(tag, j, q, copies.wires[2])
        elif members:
            g = tuple(plan.group.ranks)
            self.own, self.public = copies.group_self[g], copies.group_mean[g]
            q = copies.pack(buf, self.own)  # (before the exchange: the owner's step adjusts ``own`` after round 1)
            self.weight = gamma * plan.group.neighbour_weight() * len(g)
            self.work = GroupExchange(comm, exchanger, tag, g, plan.rank, copies.compression, copies.numel, q,
                                      copies.wires[2:2 + len(members)], copies.wires[1], self.own, timeout, step)

    def wait(self) -> Tensor:
        """The mixed buffer (waits for the exchange, bounded by the timeout)."""
        if self.work is not None:
            work, self.work = self.work, None
            work.wait(self.timeout)
            c = self.copies
            c.add_decoded(self.public, c.wires[2] if len(self.members) == 1 else c.wires[1])
            self.buf.add_(self.public - self.own, alpha=self.weight)
        return self.buf
