"""SparseLoCo's outer exchange (Sarfi et al. 2025, arXiv 2508.15706): the settings, the all-gather
of the members' sparse messages, and the same messages in a gossip outer step.

Each replica adds its pseudo-gradient to an error-feedback buffer decayed by ``decay`` (the buffer
replaces the outer momentum), sends the ``k`` largest entries of every chunk of ``chunk`` elements
in 2 bits, and keeps the rest for later outer steps; the group's mean of the decoded messages is the
outer step's pseudo-gradient (an outer SGD without momentum, lr ``alpha``: SparseLoCo's
``theta <- theta - alpha mean``). The arithmetic lives in csrc/kernels/sparse.h (CPU and CUDA);
what travels is an all-gather of equal-sized messages (no reduction of compressed values: the mean
is exact for what was sent).

On a gossip topology (decentpy's own: SparseLoCo itself averages over all replicas) the replicas'
global copies differ, so the outer step mixes ``z = [theta; delta]`` with the topology's peers as
compressed gossip does (:mod:`decentpy.comm.compressed_mix`, CHOCO), with these messages as its
compressor: a rank sends ``q = S(z - zhat_i)`` (the chunk-wise top-k of the difference to its public
copy, 2 bits each), and the public copies take the place of the error buffer (what was not sent
stays in ``z - zhat_i`` and competes again at the next exchange). Every group, pairs included, is
mixed in one form: each member tracks its own copy ``zhat_i`` and the group's public mean ``M``
(``zhat_i += D(q_i)``, ``M += mean_j D(q_j)``, the all-gather above), then
``z_i += gamma s m (M - zhat_i)`` with ``s`` each other member's weight; for a pair this is
``gamma s (zhat_j - zhat_i)``. The sum of the group's buffers is unchanged, so the replicas' mean
moves as the uncompressed gossip outer step's would.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..arguments import is_int
from ..comm.compressed_mix import gossip_partners, public_copy
from ..comm.group_exchange import other_members
from ..comm.plans import ExchangePlan
from ..optim import kernels
from ..topology import Topology

__all__ = ["SparseOuter", "SparseGather", "SparseCopies", "SparseMix", "DEFAULT_SPARSE_GAMMA"]

#: the consensus step size of a sparse gossip outer step when ``gamma`` is not given
DEFAULT_SPARSE_GAMMA = 0.5

@dataclass(frozen=True)
class SparseOuter:
    """SparseLoCo's outer exchange for ``LocalSteps(sparse=...)`` / ``DiLoCo(sparse=...)``.

    Args:
        k: entries sent per chunk (a multiple of 4); ``k / chunk`` is the density (default 64 / 4096,
            1.56%: inside the paper's 1-3%).
        chunk: elements per chunk of the flat buffer (a power of two up to 4096; the paper's
            64 x 64 blocks hold 4096).
        decay: the error-feedback buffer's decay ``beta`` in ``e <- beta e + delta`` (default 0.95;
            an exact-average group's: a gossip outer step's public copies take its place).
        gamma: a gossip outer step's consensus step size in ``z_i += gamma s m (M - zhat_i)``, in
            ``(0, 1]`` (None: :data:`DEFAULT_SPARSE_GAMMA`); unused on an exact-average group.

    Bytes per message of ``n`` elements: ``8 ceil(n / chunk)`` (two fp32 scales per chunk) + 1.75
    per sent element (a 12-bit offset in its chunk and a 2-bit code): 0.73% of the fp32 bytes at the
    default density.
    """

    k: int = 64
    chunk: int = 4096
    decay: float = 0.95
    gamma: Optional[float] = None

    def check(self) -> None:
        """Raise ``ValueError`` naming the bad value."""
        c, k, d, g = self.chunk, self.k, self.decay, self.gamma
        if not is_int(c) or not 4 <= c <= kernels.SPARSE_MAX_CHUNK or c & (c - 1):
            raise ValueError(f"SparseOuter: chunk must be a power of two in [4, {kernels.SPARSE_MAX_CHUNK}], got {c!r}")
        if not is_int(k) or not 4 <= k <= c or k % 4:
            raise ValueError(f"SparseOuter: k must be a multiple of 4 in [4, chunk={c}] (entries sent per chunk), "
                             f"got {k!r}")
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (math.isfinite(d) and 0.0 <= d <= 1.0):
            raise ValueError(f"SparseOuter: decay must be in [0, 1] (the error buffer's beta), got {d!r}")
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float))
                              or not (math.isfinite(g) and 0.0 < g <= 1.0)):
            raise ValueError(f"SparseOuter: gamma must be in (0, 1] (a gossip outer step's consensus step size) "
                             f"or None, got {g!r}")

    @property
    def consensus(self) -> float:
        """The gossip outer step's consensus step size (``gamma`` or the default)."""
        return DEFAULT_SPARSE_GAMMA if self.gamma is None else float(self.gamma)

    @property
    def density(self) -> float:
        return self.k / self.chunk

    def wire_bytes(self, numel: int) -> int:
        """Bytes of one message of ``numel`` elements."""
        return kernels.sparse_wire_bytes(numel, self.chunk, self.k)


class SparseGather:
    """One outer exchange in flight: this rank's message to every other member of the group and
    theirs into one slot each (the communicator's ``send_recv``, the buffer's tag); :meth:`wait`
    then writes the members' mean (rank order, this rank's own at its place) into ``out``, the
    exchange's result (as a compressed group exchange's :meth:`wait` completes into its result bytes)."""

    def __init__(self, comm: Any, tag: int, ranks: Sequence[int], rank: int, settings: SparseOuter,
                 mine: Tensor, slots: Sequence[Tensor], out: Tensor, step: Optional[int]) -> None:
        self.settings, self.out = settings, out
        others = [r for r in ranks if r != rank]
        self.inputs: List[Tensor] = list(slots[:len(others)])
        self.inputs.insert(list(ranks).index(rank), mine)
        self.works: List[Any] = []
        for peer, slot in zip(others, slots):
            w = comm.send_recv(tag, peer, mine, slot)
            if hasattr(w, "step"):
                w.step = step
            self.works.append(w)

    def wait(self, timeout: datetime.timedelta) -> None:
        works, self.works = self.works, []
        for w in works:
            w.wait(timeout)
        kernels.sparse_mean(self.inputs, self.out, self.settings.chunk, self.settings.k)



class SparseCopies:
    """One buffer's public copies for sparse gossip outer steps over ``topology``, seen from ``rank``
    (see the module): per distinct group it mixes in, pairs included, ``(own copy, the group's public
    mean)``; and the wire buffers of one exchange."""

    def __init__(self, topology: Topology, rank: int, numel: int, settings: SparseOuter, device: torch.device,
                 start: Optional[Tensor] = None) -> None:
        self.settings, self.numel = settings, numel
        pairs, groups, slots = gossip_partners(topology, rank)
        self.groups = sorted(pairs + groups)

        self.own: Dict[Tuple[int, ...], Tensor] = {g: public_copy(start, numel, device) for g in self.groups}
        self.mean: Dict[Tuple[int, ...], Tensor] = {g: public_copy(start, numel, device) for g in self.groups}
        size = settings.wire_bytes(numel)
        self.wires = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(1 + slots)]  # q, slots
        self._residual = torch.empty(numel, dtype=torch.float32, device=device)  # the pack's (not kept)
        self.decoded = torch.empty(numel, dtype=torch.float32, device=device)

    def pack(self, z: Tensor, own: Tensor) -> Tensor:
        """``q = S(z - own)`` into the send wire, and ``own += D(q)`` (the same decode as the peers')."""
        s, q = self.settings, self.wires[0]
        self._residual.zero_()  # (the pack's error buffer, decay 0: the difference alone)
        kernels.sparse_pack(own, z, self._residual, q, s.chunk, s.k, 0.0)
        kernels.sparse_mean([q], self.decoded, s.chunk, s.k)
        own.add_(self.decoded)
        return q

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        s = self.settings
        return {"kind": f"sparse-{s.k}/{s.chunk}", "groups": [list(g) for g in self.groups],
                "group_copies": {g: (self.own[g].clone(), self.mean[g].clone()) for g in self.groups}}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        s = self.settings
        groups = [tuple(g) for g in state["groups"]]
        if state["kind"] != f"sparse-{s.k}/{s.chunk}" or groups != self.groups:
            raise ValueError(f"the checkpoint's sparse gossip outer exchange is {state['kind']!r} over groups "
                             f"{groups}; this run has 'sparse-{s.k}/{s.chunk}' over {self.groups}")
        for g in self.groups:
            a, b = state["group_copies"][g]
            self.own[g].copy_(a)
            self.mean[g].copy_(b)


class SparseMix:
    """``buf`` mixed with the plan's group by a sparse gossip outer step (see the module): started
    here, :meth:`wait` leaves the mixed buffer in ``buf``; ``buf`` and ``copies`` must not be touched
    until then."""

    def __init__(self, plan: ExchangePlan, comm: Any, tag: int, buf: Tensor, copies: SparseCopies,
                 timeout: datetime.timedelta, step: Optional[int]) -> None:
        if buf.dtype != torch.float32 or buf.numel() != copies.numel:
            raise ValueError(f"a sparse mix takes a float32 buffer of {copies.numel} elements (its copies'), got "
                             f"{buf.dtype} of {buf.numel()}")
        self.buf, self.copies, self.timeout = buf, copies, timeout
        self.work: Optional[SparseGather] = None
        members = other_members(plan, plan.rank)
        if members:
            g = tuple(plan.group.ranks)
            self.own, self.mean = copies.own[g], copies.mean[g]
            self.weight = copies.settings.consensus * plan.group.neighbour_weight() * len(g)
            q = copies.pack(buf, self.own)
            self.work = SparseGather(comm, tag, g, plan.rank, copies.settings, q, copies.wires[1:1 + len(members)],
                                     copies.decoded, step)

    def wait(self) -> Tensor:
        """The mixed buffer (waits for the exchange, bounded by the timeout)."""
        if self.work is not None:
            work, self.work = self.work, None
            work.wait(self.timeout)
            self.mean.add_(self.copies.decoded)
            self.buf.add_(self.mean - self.own, alpha=self.weight)
        return self.buf
