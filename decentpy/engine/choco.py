"""Compressed gossip (``DecentralizedDataParallel(compression=...)``): CHOCO-style exchanges of
compressed differences against tracked public copies, one pair of copies per edge.

Rank ``i`` keeps, for every bucket and every distinct peer ``j`` of the topology's period, two fp32
copies: ``xhat_{i|j}`` (its own public copy as ``j`` knows it) and ``xhat_{j|i}`` (``j``'s as ``i``
knows it), both starting from the broadcast initial parameters. One fused kernel pass per bucket
(:func:`decentpy.kernels.compressed_step`): the received ``q_j`` into ``xhat_{j|i}``; the mix
``x_i += gamma w_ij (xhat_{j|i} - xhat_{i|j})``; the optimizer update; ``q = Q(x_i - xhat_{i|j'})``
for the next step's peer ``j'`` into the send bytes, ``xhat_{i|j'} += D(q)``. Then ``q`` goes to
``j'`` and ``q_{j'}`` lands in the bucket's receive bytes. Only pairs: a topology whose schedule
has a group of three or more ranks is refused (see :meth:`CompressedGossip.configure`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..compression import Compression
from ..exchange import NoExchange, PairExchange
from ..grad_scaling import UNSCALED
from ..optim import CompressedPass
from ..topology import Topology, make_topology
from .bucket import Bucket
from .gossip import GossipSetup, GossipStrategy

__all__ = ["CompressedGossip", "EdgeCopies"]


@dataclass
class EdgeCopies:
    """A bucket's compressed-gossip state: per peer ``(self_copy, peer_copy)`` and the send bytes."""

    self_copy: Dict[int, Tensor]   # xhat_{i|j}
    peer_copy: Dict[int, Tensor]   # xhat_{j|i}
    send: Tensor                   # the compressed bytes of the last q sent


class CompressedGossip(GossipStrategy):
    """Gossip whose exchanges carry compressed differences (pairs of ranks only)."""

    name = "gossip"

    @classmethod
    def configure(cls, topology: Union[str, Topology], rank: int, size: int, local_world_size: int,
                  timeout: datetime.timedelta) -> GossipSetup:
        t = make_topology(topology, size, local_world_size)
        for step in range(t.period):
            for group in t.groups(step):
                if len(group.ranks) > 2:
                    raise ValueError(
                        f"compression: topology {t.name!r} has a group of {len(group.ranks)} ranks at step {step} "
                        f"({group.ranks}); compressed gossip supports pair exchanges only for now (ring, "
                        "one-peer-exp, complete over 2 ranks, or a custom topology of pairs): an all-gather of every "
                        "member's compressed difference with |G| tracked copies is not implemented")
        return GossipSetup(t, t)

    def __init__(self, *args: Any, compression: Compression, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compression = compression
        peers: List[int] = []
        for step in range(self.topology.period):
            plan = self.plans.at(step)
            if isinstance(plan, PairExchange) and plan.peer not in peers:
                peers.append(plan.peer)
        #: the distinct peers of this rank over the topology's period (one pair of copies each)
        self.peers: List[int] = sorted(peers)

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
            st = EdgeCopies({j: p.clone() for j in self.peers}, {j: p.clone() for j in self.peers},
                            torch.zeros(self.compression.wire_bytes(p.numel()), dtype=torch.uint8, device=p.device))
            b.comm = torch.zeros_like(st.send)  # the receive bytes
            b.choco = st  # type: ignore[attr-defined]
        return st

    def memory_bytes(self) -> int:
        """Bytes of the tracked copies and the compressed buffers of every bucket (what compression adds)."""
        total = 0
        for b in self.buckets:
            total += 2 * len(self.peers) * b.param.numel() * 4 + 2 * self.compression.wire_bytes(b.param.numel())
        return total

    # -- the per-bucket work -------------------------------------------------------------------
    def mix_and_step(self, b: Bucket, local_step: bool, reduction: Optional[Any] = None) -> None:
        self.wait_exchange(b)
        st = self.state_of(b)
        assert st is not None
        received, nxt = self.plans.at(self.step), self.plans.at(self.step + 1)
        q_recv = peer_copy = self_mix = None
        gw = 0.0
        if b.comm_valid:
            if not isinstance(received, PairExchange):
                raise RuntimeError(f"internal error: bucket {b.index} received an exchange at step {self.step} "
                                   f"whose plan is {received!r}")
            j = received.peer
            q_recv, peer_copy, self_mix = b.comm, st.peer_copy[j], st.self_copy[j]
            if not b.skip_mix:  # the received q is applied either way: the copies must stay in step
                gamma = float(self.compression.gamma)  # type: ignore[arg-type]
                gw = self.adaptive_factor * gamma * (1.0 - received.group.weight)
        elif received.mixes and not b.skip_mix:
            raise RuntimeError(f"internal error: bucket {b.index} has no exchange to mix at step {self.step}")
        q_send = self_next = None
        if isinstance(nxt, PairExchange):
            q_send, self_next = st.send, st.self_copy[nxt.peer]
        elif not isinstance(nxt, NoExchange):
            raise RuntimeError(f"internal error: compressed gossip got the plan {nxt!r}")
        grads = self.grad_args(b, reduction) if local_step else UNSCALED
        b.step(None, 1.0, 0.0, None, grads, local_step,
               compressed=CompressedPass(self.compression.compressor, q_recv, peer_copy, self_mix, gw, q_send,
                                         self_next))
        b.comm_valid = False
        b.skip_mix = False
        assert self.comm is not None, "internal error: the strategy has no communicator (attach() first)"
        b.work = self.comm.send_recv(b.index, nxt.peer, st.send, b.comm) if isinstance(nxt, PairExchange) else None
        if b.work is not None and hasattr(b.work, "step"):
            b.work.step = self.step  # type: ignore[attr-defined]
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
