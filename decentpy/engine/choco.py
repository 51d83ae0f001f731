"""Compressed gossip (``DecentralizedDataParallel(compression=...)``): CHOCO-style exchanges of
compressed differences against tracked public copies -- one pair of copies per edge for the pairs
of the topology, one copy and the group's public mean per group of more than two ranks.

Pairs. Rank ``i`` keeps, for every bucket and every distinct pair partner ``j`` of the topology's
period, two fp32 copies: ``xhat_{i|j}`` (its own public copy as ``j`` knows it) and ``xhat_{j|i}``
(``j``'s as ``i`` knows it), both starting from the broadcast initial parameters. Per bucket and
step: the received ``q_j`` into ``xhat_{j|i}``; the mix ``x_i += gamma w (xhat_{j|i} - xhat_{i|j})``;
the optimizer update; ``q = Q(x_i - xhat_{i|j'})`` for the next step's partner ``j'`` into the send
bytes, ``xhat_{i|j'} += D(q)``; then ``q`` goes to ``j'`` and ``j'``'s lands in the receive bytes.
One fused kernel pass (:func:`decentpy.optim.kernels.compressed_step`).

Groups of ``m > 2`` ranks (:mod:`decentpy.comm.group_exchange`). Rank ``i`` keeps, per bucket and
distinct group ``G``, ``xhat_i^G`` and the group's public mean ``M^G``; the fused pass adds the
received reduced ``r`` to ``M^G`` and mixes ``x_i += gamma s m (M^G - xhat_i^G)`` (``s`` the weight
of each other member), and sends ``q = Q(x_i - xhat_i^G')`` to the next group as chunks; the owner
of each chunk reduces it between the exchange's two rounds. Bytes sent per step: ``2 (m - 1) / m``
wire sizes, against ``2 (m - 1) / m`` fp32 bucket sizes for the uncompressed group all-reduce.

With ``intra_node='shard'`` / ``'allreduce'`` the node reduces the gradients as without compression
and the compressed exchange runs between the ranks holding the same shard (or local rank) on the
peer nodes: the inter-node traffic is what gets compressed, while the node collectives stay exact.
:class:`CompressedExchange` is one part of the strategy (:mod:`decentpy.engine.exchanges`): the
node mode and the failure policy are the strategy's others, whatever the exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..optim.compression import Compression
from ..comm.group_exchange import GroupExchange, GroupExchanger, compressed_needs, other_members
from ..comm.plans import ExchangePlan
from ..optim.fused import CompressedPass
from .bucket import Bucket
from .exchanges import Exchange

if TYPE_CHECKING:
    from .gossip import GossipStrategy

__all__ = ["CompressedExchange", "EdgeCopies", "wire_buffer_bytes"]


def slot_stride(wire: int) -> int:
    """Bytes from one slot of ``wire`` bytes to the next: ``ceil(wire / 4) * 4``, so that every
    slot's fp32 block scales are 4-byte aligned even when the wire size is not a multiple of 4
    (int4 of an odd count or of a shard of ``4 * odd`` elements)."""
    return -(-wire // 4) * 4


def wire_buffer_bytes(slots: int, wire: int) -> int:
    """Bytes of a send / receive buffer of ``slots`` slots of ``wire`` bytes (slot t starts at
    ``t * slot_stride(wire)``)."""
    return (slots - 1) * slot_stride(wire) + wire if slots > 0 else 0


@dataclass
class EdgeCopies:
    """A bucket's compressed-gossip state: per pair partner ``(self_copy, peer_copy)``, per group
    ``(own copy, the group's public mean)``, the send bytes (one wire), the result bytes of the group
    exchanges (the reduced ``r``; empty without groups) and the wire size; the receive bytes are
    ``bucket.comm`` (one slot per other member of the largest group)."""

    self_copy: Dict[int, Tensor]   # xhat_{i|j}
    peer_copy: Dict[int, Tensor]   # xhat_{j|i}
    send: Tensor                   # the compressed bytes of the last q sent (one wire)
    wire: int                      # bytes of one slot
    group_self: Dict[Tuple[int, ...], Tensor] = field(default_factory=dict)  # xhat_i^G
    group_mean: Dict[Tuple[int, ...], Tensor] = field(default_factory=dict)  # M^G
    result: Optional[Tensor] = None  # r of the last group exchange

    def slot(self, buf: Tensor, t: int) -> Tensor:
        """Slot t: ``wire`` bytes at a 4-byte aligned offset (see :func:`slot_stride`)."""
        start = t * slot_stride(self.wire)
        return buf[start:start + self.wire]


class CompressedExchange(Exchange):
    """The compressed exchange (``compression=``): point to point for a pair, a reduce-scatter and an
    all-gather of compressed chunks for a larger group; see the module."""

    name = "compressed"
    defers_verdicts = False  # the compressed kernels read the host's step count

    def __init__(self, strategy: "GossipStrategy", compression: Compression) -> None:
        super().__init__(strategy)
        self.compression = compression
        peers: List[int] = []
        groups: List[Tuple[int, ...]] = []
        slots = 0
        for step in range(strategy.topology.period):
            plan = strategy.plans.at(step)
            members = self.peers_at(plan)
            slots = max(slots, len(members))
            if len(members) == 1 and members[0] not in peers:
                peers.append(members[0])
            elif len(members) > 1 and tuple(plan.group.ranks) not in groups:
                groups.append(tuple(plan.group.ranks))
        #: the distinct pair partners of this rank over the topology's period (one pair of copies each)
        self.peers: List[int] = sorted(peers)
        #: the distinct groups of more than two ranks this rank is in (two copies each)
        self.groups: List[Tuple[int, ...]] = sorted(groups)
        #: receive slots per bucket: the most other members of any step
        self.slots = max(slots, 1)
        self._exchanger = GroupExchanger()

    def peers_at(self, plan: ExchangePlan) -> List[int]:
        """The other members of the plan's group, in rank order (the order of the receive slots)."""
        return other_members(plan, self.strategy.rank)

    def communication_needs(self) -> Optional[Tuple[bool, List[Tuple[int, ...]]]]:
        """Point to point only: pairs and the chunks of the group exchanges (no all-reduce)."""
        return compressed_needs(self.strategy.topology)

    def close(self) -> None:
        self._exchanger.close()

    # -- per-bucket state ----------------------------------------------------------------------
    def state_of(self, b: Bucket, create: bool = True) -> Optional[EdgeCopies]:
        st: Optional[EdgeCopies] = b.exchange_state  # (a rebuilt layout's buckets start without)
        if st is None and create:
            if b.param.dtype != torch.float32:
                raise ValueError(f"compression: bucket {b.index} holds {b.param.dtype} parameters; compressed gossip "
                                 "steps float32 parameters only (use autocast for mixed precision, not bf16/fp16 "
                                 "parameters)")
            b.gather_params()  # param_as_bucket_view=False: the block follows the (broadcast) parameters
            p = b.param.detach()
            wire = self.compression.wire_bytes(p.numel())
            equal = self.strategy.replicas_equal

            def wire_buffer(slots: int) -> Tensor:
                return torch.zeros(wire_buffer_bytes(slots, wire), dtype=torch.uint8, device=p.device)

            # Every rank's copy of a public value must agree with its owner's: from the parameters only
            # where every rank holds the same ones (broadcast at construction), else from zero (each
            # rank's own parameters differ: an elastic epoch after a failure, broadcast_parameters=False)
            def copy() -> Tensor:
                return p.clone() if equal else torch.zeros_like(p)

            st = EdgeCopies({j: copy() for j in self.peers}, {j: copy() for j in self.peers}, wire_buffer(1),
                            wire, {g: copy() for g in self.groups}, {g: copy() for g in self.groups},
                            wire_buffer(1) if self.groups else None)
            b.comm = wire_buffer(self.slots)  # the receive bytes, slot t from the t-th other member
            b.exchange_state = st
        return st

    def memory_bytes(self) -> int:
        """Bytes of the tracked copies and the compressed buffers of every bucket (what compression adds)."""
        total = 0
        for b in self.strategy.buckets:
            n, wire = b.param.numel(), self.compression.wire_bytes(b.param.numel())
            total += (2 * (len(self.peers) + len(self.groups)) * n * 4 + wire_buffer_bytes(self.slots, wire) +
                      wire * (2 if self.groups else 1))
        return total

    # -- the bucket's pass and launch ----------------------------------------------------------
    def mixing(self, b: Bucket, received: ExchangePlan, nxt: ExchangePlan) -> Dict[str, Any]:
        s = self.strategy
        st = self.state_of(b)
        assert st is not None
        q_recv = peer_copy = self_mix = None
        gw = 0.0
        if b.comm_valid:
            members = self.peers_at(received)
            if not members:
                raise RuntimeError(f"internal error: bucket {b.index} received an exchange at step {s.step} "
                                   f"whose plan is {received!r}")
            if not b.skip_mix:  # the received q (or r) are applied either way: the copies must stay in step
                gamma = float(self.compression.gamma)  # type: ignore[arg-type]
                gw = s.adaptive_factor * gamma * received.group.neighbour_weight()
            if len(members) == 1:
                q_recv, peer_copy, self_mix = st.slot(b.comm, 0), st.peer_copy[members[0]], st.self_copy[members[0]]
            else:  # x_i += gamma s (sum_j xhat_j - m xhat_i) = gamma s m (M - xhat_i)
                g = tuple(received.group.ranks)
                q_recv, peer_copy, self_mix = st.result, st.group_mean[g], st.group_self[g]
                gw *= len(g)
            # the peer check: a non-finite compressed difference is neither mixed nor added to the copy
            if not s.peer_check.admit_wire(b, q_recv, self.compression.compressor, b.param.numel(), members):
                q_recv = peer_copy = self_mix = None
                gw = 0.0
        elif received.mixes and not b.skip_mix:
            raise RuntimeError(f"internal error: bucket {b.index} has no exchange to mix at step {s.step}")
        targets = self.peers_at(nxt)
        q_send = st.send if targets else None
        self_next = (None if not targets else st.self_copy[targets[0]] if len(targets) == 1 else
                     st.group_self[tuple(nxt.group.ranks)])
        return {"recv": None, "mix_a": 1.0, "mix_b": 0.0, "send_scale": None,
                "compressed": CompressedPass(self.compression.compressor, q_recv, peer_copy, self_mix, gw, q_send,
                                             self_next)}

    def launch(self, b: Bucket, nxt: ExchangePlan) -> Optional[Any]:
        s = self.strategy
        assert s.comm is not None, "internal error: the strategy has no communicator (attach() first)"
        st = self.state_of(b, create=False)
        assert st is not None
        targets = self.peers_at(nxt)
        if len(targets) == 1:
            return s.comm.send_recv(b.index, targets[0], st.send, st.slot(b.comm, 0))
        if targets:
            assert st.result is not None
            return GroupExchange(s.comm, self._exchanger, b.index, nxt.group.ranks, s.rank, self.compression,
                                 b.param.numel(), st.send, [st.slot(b.comm, t) for t in range(len(targets))],
                                 st.result, st.group_self[tuple(nxt.group.ranks)], s.timeout, s.step)
        return None

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The tracked copies of every bucket (clones), by pair partner and by group; a bucket not
        stepped yet has none."""
        copies: List[Optional[Dict[int, Tuple[Tensor, Tensor]]]] = []
        group_copies: List[Optional[Dict[Tuple[int, ...], Tuple[Tensor, Tensor]]]] = []
        for b in self.strategy.buckets:
            st = self.state_of(b, create=False)
            copies.append(None if st is None else
                          {j: (st.self_copy[j].clone(), st.peer_copy[j].clone()) for j in self.peers})
            group_copies.append(None if st is None else
                                {g: (st.group_self[g].clone(), st.group_mean[g].clone()) for g in self.groups})
        return {"kind": self.compression.kind, "gamma": self.compression.gamma, "peers": list(self.peers),
                "groups": [list(g) for g in self.groups], "copies": copies, "group_copies": group_copies}

    @torch.no_grad()
    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        if state is None:
            raise ValueError(f"the checkpoint was saved without compression; this run uses compression="
                             f"{self.compression.kind!r} (the tracked public copies are part of the state)")
        groups = [tuple(g) for g in state.get("groups", [])]
        if state["kind"] != self.compression.kind or list(state["peers"]) != self.peers or groups != self.groups:
            raise ValueError(f"the checkpoint was saved with compression {state['kind']!r}, pair partners "
                             f"{state['peers']} and groups {groups}; this run has {self.compression.kind!r}, "
                             f"{self.peers} and {self.groups}")
        if not state["copies"]:  # saved before the first iteration: nothing tracked yet
            return
        buckets = self.strategy.buckets
        if len(state["copies"]) != len(buckets):
            raise ValueError(f"the checkpoint has compressed-gossip copies for {len(state['copies'])} buckets, this "
                             f"run has {len(buckets)}")
        group_copies = state.get("group_copies") or [{} for _ in buckets]
        for b, copies, gcopies in zip(buckets, state["copies"], group_copies):
            if copies is None:
                b.exchange_state = None
                continue
            st = self.state_of(b)
            assert st is not None
            for j in self.peers:
                s, p = copies[j]
                st.self_copy[j].copy_(s)
                st.peer_copy[j].copy_(p)
            for g in self.groups:
                s, m = gcopies[g]
                st.group_self[g].copy_(s)
                st.group_mean[g].copy_(m)
