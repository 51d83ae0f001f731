"""Compressed gossip (``DecentralizedDataParallel(compression=...)``): CHOCO-style exchanges of
compressed differences against tracked public copies, one pair of copies per edge.

Rank ``i`` keeps, for every bucket and every distinct peer ``j`` of the topology's period, two fp32
copies: ``xhat_{i|j}`` (its own public copy as ``j`` knows it) and ``xhat_{j|i}`` (``j``'s as ``i``
knows it), both starting from the broadcast initial parameters. Per bucket and step, with ``G`` the
rank's group and ``s = (1 - w) / (|G| - 1)`` the weight of each other member (any self weight
``w``: the mixing matrix stays symmetric and doubly stochastic): every received ``q_j`` (``j`` in ``G``) into
``xhat_{j|i}``; the mix ``x_i += gamma s sum_j (xhat_{j|i} - xhat_{i|j})``; the optimizer update;
for every member ``j'`` of the next step's group ``q = Q(x_i - xhat_{i|j'})`` into its send bytes,
``xhat_{i|j'} += D(q)``. Then each ``q`` goes to its ``j'`` (point to point) and the members' ``q``
land in the bucket's receive bytes, one slot per member.

A pair is one fused kernel pass (:func:`decentpy.kernels.compressed_step`). A group of ``m > 2``
ranks adds ``m - 2`` mix-only passes before it and ``m - 2`` compress-only passes after it (the
same kernel with no optimizer update): each peer's ``q`` differs, because each edge has its own
copies (time-varying groups never share one public copy). Bytes sent per step: ``(m - 1)`` wire
sizes, against ``2 (m - 1) / m`` fp32 bucket sizes for the uncompressed group all-reduce.

With ``intra_node='shard'`` / ``'allreduce'`` (:class:`CompressedNodeShard`,
:class:`CompressedNodeAllReduce`) the node reduces the gradients as without compression and the
compressed exchange runs between the ranks holding the same shard (or local rank) on the peer
nodes: the inter-node traffic is what gets compressed, in pairs wherever the node topology pairs
nodes, while the node collectives stay exact. The composition is the class's base order: this
module's ``mix_and_step`` calls the node strategy's ``grad_args`` (the node's mean gradient) and
``stepped`` (the all-gather of the updated shards).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Type

import torch
from torch import Tensor

from .. import kernels
from ..compression import Compression
from ..exchange import ExchangePlan, NoExchange
from ..grad_scaling import UNSCALED
from ..optim import CompressedPass
from .bucket import Bucket
from .gossip import GossipStrategy
from .node_allreduce import NodeAllReduce
from .node_shard import NodeShard

__all__ = ["CompressedGossip", "CompressedNodeShard", "CompressedNodeAllReduce", "COMPRESSED_STRATEGIES",
           "EdgeCopies", "PeerExchanges", "wire_buffer_bytes"]


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
    """A bucket's compressed-gossip state: per peer ``(self_copy, peer_copy)``, the send bytes (one
    slot of the wire size per member of the largest group; the receive bytes are ``bucket.comm``,
    laid out alike) and the segment table of the extra passes."""

    self_copy: Dict[int, Tensor]   # xhat_{i|j}
    peer_copy: Dict[int, Tensor]   # xhat_{j|i}
    send: Tensor                   # the compressed bytes of the last q sent, slot t for the t-th peer
    wire: int                      # bytes of one slot
    segments: Tensor               # [0, numel) in one group (the mix-only / compress-only passes)

    def slot(self, buf: Tensor, t: int) -> Tensor:
        """Slot t: ``wire`` bytes at a 4-byte aligned offset (see :func:`slot_stride`)."""
        start = t * slot_stride(self.wire)
        return buf[start:start + self.wire]


class PeerExchanges:
    """The point-to-point exchanges of one bucket with every member of its group (one wait)."""

    def __init__(self, works: List[Any]) -> None:
        self.works = works

    @property
    def step(self) -> Optional[int]:
        return getattr(self.works[0], "step", None) if self.works else None

    @step.setter
    def step(self, value: Optional[int]) -> None:
        for w in self.works:
            if hasattr(w, "step"):
                w.step = value

    def wait(self, timeout: datetime.timedelta) -> None:
        for w in self.works:
            w.wait(timeout)
        self.works = []


class CompressedGossip(GossipStrategy):
    """Gossip whose exchanges carry compressed differences, point to point within every group."""

    name = "gossip"

    def __init__(self, *args: Any, compression: Compression, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compression = compression
        peers: List[int] = []
        slots = 0
        for step in range(self.topology.period):
            members = self.peers_at(self.plans.at(step))
            slots = max(slots, len(members))
            peers += [j for j in members if j not in peers]
        #: the distinct peers of this rank over the topology's period (one pair of copies each)
        self.peers: List[int] = sorted(peers)
        #: receive / send slots per bucket: the most peers of any step
        self.slots = max(slots, 1)

    def peers_at(self, plan: ExchangePlan) -> List[int]:
        """The other members of the plan's group, in rank order (the order of the wire slots)."""
        return [] if isinstance(plan, NoExchange) else [r for r in plan.group.ranks if r != self.rank]

    def communication_needs(self) -> Optional[Tuple[bool, List[Tuple[int, ...]]]]:
        """Point to point only: every edge carries its own compressed difference (no all-reduce)."""
        return (any(len(g.ranks) > 1 for g in self.topology.unique_groups()), [])

    # -- per-bucket state ----------------------------------------------------------------------
    def state_of(self, b: Bucket, create: bool = True) -> Optional[EdgeCopies]:
        st: Optional[EdgeCopies] = getattr(b, "choco", None)
        if st is None and create:
            if b.param.dtype != torch.float32:
                raise ValueError(f"compression: bucket {b.index} holds {b.param.dtype} parameters; compressed gossip "
                                 "steps float32 parameters only (use autocast for mixed precision, not bf16/fp16 "
                                 "parameters)")
            b.gather_params()  # param_as_bucket_view=False: the block follows the (broadcast) parameters
            p = b.param.detach()
            wire = self.compression.wire_bytes(p.numel())
            st = EdgeCopies({j: p.clone() for j in self.peers}, {j: p.clone() for j in self.peers},
                            torch.zeros(wire_buffer_bytes(self.slots, wire), dtype=torch.uint8, device=p.device), wire,
                            kernels.segments_for_numel(p.numel(), p.device))
            b.comm = torch.zeros_like(st.send)  # the receive bytes, slot t from the t-th peer
            b.choco = st  # type: ignore[attr-defined]
        return st

    def memory_bytes(self) -> int:
        """Bytes of the tracked copies and the compressed buffers of every bucket (what compression adds)."""
        total = 0
        for b in self.buckets:
            total += (2 * len(self.peers) * b.param.numel() * 4 +
                      2 * wire_buffer_bytes(self.slots, self.compression.wire_bytes(b.param.numel())))
        return total

    # -- the per-bucket work -------------------------------------------------------------------
    def _pass(self, b: Bucket, st: EdgeCopies, **buffers: Any) -> None:
        """A mix-only or compress-only pass of the kernel over the bucket (no optimizer update)."""
        kernels.compressed_step(kernels.OptKind.NONE, self.compression.compressor, b.param, None, [], st.segments, [],
                                **buffers)

    def mix_and_step(self, b: Bucket, local_step: bool, reduction: Optional[Any] = None) -> None:
        self.wait_exchange(b)
        st = self.state_of(b)
        assert st is not None
        received, nxt = self.plans.at(self.step), self.plans.at(self.step + 1)
        mixes: List[Tuple[Tensor, Tensor, Tensor, float]] = []  # (q_recv, peer copy, self copy, gamma * w)
        if b.comm_valid:
            members = self.peers_at(received)
            if not members:
                raise RuntimeError(f"internal error: bucket {b.index} received an exchange at step {self.step} "
                                   f"whose plan is {received!r}")
            gw = 0.0
            if not b.skip_mix:  # the received q are applied either way: the copies must stay in step
                gamma = float(self.compression.gamma)  # type: ignore[arg-type]
                gw = self.adaptive_factor * gamma * received.group.neighbour_weight()
            mixes = [(st.slot(b.comm, t), st.peer_copy[j], st.self_copy[j], gw) for t, j in enumerate(members)]
        elif received.mixes and not b.skip_mix:
            raise RuntimeError(f"internal error: bucket {b.index} has no exchange to mix at step {self.step}")
        targets = self.peers_at(nxt)
        sends = [(st.slot(st.send, t), st.self_copy[j]) for t, j in enumerate(targets)]
        if len(mixes) > 1:  # the other members' terms first (they do not depend on the parameters)
            if not b.params_are_views:
                b.gather_params()
            for q, pc, sc, gw in mixes[:-1]:
                self._pass(b, st, q_recv=q, peer_copy=pc, self_copy_mix=sc, choco_mix=gw)
            if not b.params_are_views:
                b.scatter_params()  # the fused pass gathers the parameters again
        q_recv, peer_copy, self_mix, gw = mixes[-1] if mixes else (None, None, None, 0.0)
        q_send, self_next = sends[0] if sends else (None, None)
        grads = self.grad_args(b, reduction) if local_step else UNSCALED
        b.step(None, 1.0, 0.0, None, grads, local_step,
               compressed=CompressedPass(self.compression.compressor, q_recv, peer_copy, self_mix, gw, q_send,
                                         self_next))
        for q, sc in sends[1:]:
            self._pass(b, st, q_send=q, self_copy_next=sc)
        b.comm_valid = False
        b.skip_mix = False
        assert self.comm is not None, "internal error: the strategy has no communicator (attach() first)"
        if targets:
            work = PeerExchanges([self.comm.send_recv(b.index, j, st.slot(st.send, t), st.slot(b.comm, t))
                                  for t, j in enumerate(targets)])
            work.step = self.step
            b.work = work
        else:
            b.work = None
        self.stepped(b)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The tracked copies of every bucket (clones), by peer; a bucket not stepped yet has none."""
        copies: List[Optional[Dict[int, Tuple[Tensor, Tensor]]]] = []
        for b in self.buckets:
            st = self.state_of(b, create=False)
            copies.append(None if st is None else
                          {j: (st.self_copy[j].clone(), st.peer_copy[j].clone()) for j in self.peers})
        return {"kind": self.compression.kind, "gamma": self.compression.gamma, "peers": list(self.peers),
                "copies": copies}

    @torch.no_grad()
    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state_dict` (after the bucket layout was restored)."""
        if state is None:
            raise ValueError(f"the checkpoint was saved without compression; this run uses compression="
                             f"{self.compression.kind!r} (the tracked public copies are part of the state)")
        if state["kind"] != self.compression.kind or list(state["peers"]) != self.peers:
            raise ValueError(f"the checkpoint was saved with compression {state['kind']!r} and peers {state['peers']}; "
                             f"this run has {self.compression.kind!r} and peers {self.peers}")
        if not state["copies"]:  # saved before the first iteration: nothing tracked yet
            return
        if len(state["copies"]) != len(self.buckets):
            raise ValueError(f"the checkpoint has compressed-gossip copies for {len(state['copies'])} buckets, this "
                             f"run has {len(self.buckets)}")
        for b, copies in zip(self.buckets, state["copies"]):
            if copies is None:
                if hasattr(b, "choco"):
                    del b.choco  # type: ignore[attr-defined]
                continue
            st = self.state_of(b)
            assert st is not None
            for j in self.peers:
                s, p = copies[j]
                st.self_copy[j].copy_(s)
                st.peer_copy[j].copy_(p)


class CompressedNodeShard(CompressedGossip, NodeShard):
    """``intra_node='shard'`` with compressed exchanges of the shards between the nodes."""

    name = "shard"


class CompressedNodeAllReduce(CompressedGossip, NodeAllReduce):
    """``intra_node='allreduce'`` with compressed exchanges of the node means between the nodes."""

    name = "allreduce"


#: ``intra_node`` name -> the compressed-gossip strategy (``DecentralizedDataParallel(compression=...)``)
COMPRESSED_STRATEGIES: Dict[str, Type[CompressedGossip]] = {
    cls.name: cls for cls in (CompressedGossip, CompressedNodeShard, CompressedNodeAllReduce)}
