"""One outer exchange of a flat buffer, for both faces of local steps: pack, send, receive, step.

A face (the engine's exchange part: one bucket; :class:`decentpy.DiLoCo`: one dtype group of a
fragment) holds one :class:`OuterBuffer` per flat buffer and a :class:`OuterLink` to its group.
At the end of a window :meth:`OuterBuffer.launch` packs the pseudo-gradient ``delta = theta - x``
(float32, :func:`decentpy.optim.outer.pseudo_gradient`) and starts its exchange over the plan of
that outer step; :meth:`OuterBuffer.apply` (later: the next forward, or ``fragment_sync_delay``
inner steps on) receives it and runs the outer step (:func:`decentpy.optim.outer.outer_step`).
The exchange is chosen by three facts:

- the group averages exactly (``complete``) and the global copies agree: only ``delta`` travels
  (DiLoCo); with ``compression`` as the error-fed compressed mean of compressed gossip's group
  exchange (what the wire drops is sent at the next outer step);
- otherwise the buffer ``[theta; delta]`` is mixed (a gossip outer step, or once after an elastic
  re-formation on ``complete``: the members' global copies agree again); with ``compression`` on a
  gossip topology by compressed gossip against public copies (CHOCO, the replicas' mean unchanged);
- ``sparse`` (SparseLoCo) on an exact-average group: the error-fed chunk-wise top-k of ``delta`` in
  2 bits travels, gathered from every member and averaged on arrival; on a gossip topology the same
  messages are the compressor of the CHOCO mix of ``[theta; delta]`` (:mod:`.sparse`);
- a time budget weights the pseudo-gradients by the inner steps behind them: the weight travels as
  one more element of the buffer (:func:`~decentpy.comm.plans.weigh`), or with compression in its
  own uncompressed mix, shared by the outer step's buffers (:meth:`OuterLink.weight_mix`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..comm.compressed_mix import CompressedMix, GossipCopies
from ..comm.group_exchange import (GroupExchange, GroupExchanger, compressed_needs, other_members,
                                   start_compressed_mean)
from ..comm.plans import BufferMix, ExchangePlan, communication_needs
from ..optim import kernels
from ..optim.compression import Compression
from ..optim.outer import fusable_here, outer_step, pseudo_gradient
from ..topology import Topology
from .sparse import SparseCopies, SparseGather, SparseMix, SparseOuter

__all__ = ["OuterLink", "OuterBuffer", "outer_needs", "split", "weigh", "unweigh", "WEIGHT_TAG"]

_TINY = torch.finfo(torch.float32).tiny

# A weighted mean ``sum_j w_j d_j / sum_j w_j`` over a group (a time budget: the pseudo-gradients
# weighted by the inner steps behind them) travels in one buffer: the body ``w d``, then ``w`` as its
# last element; any plan's mix then leaves ``sum W_j w_j d_j`` and ``sum W_j w_j``, whose ratio is the
# weighted mean under the mixing weights ``W``. With compression the weights mix apart, one
# uncompressed element under its own tag, with the compressed exchange's coefficients.

#: the communicator tag of a time budget's weight exchange (apart from the buffers' tags)
WEIGHT_TAG = 1 << 20


def weigh(body: Tensor, slot: Tensor, weight: float) -> None:
    """Write this rank's share of a weighted mean: ``body *= weight`` and ``slot`` (the buffer's last
    element, after the body) ``= weight``."""
    body.mul_(weight)
    slot.fill_(weight)


def unweigh(mixed: Tensor, n: int) -> Tensor:
    """The mixed buffer without its weight element, its last ``n`` elements (the weighted body)
    divided by the mixed weight. No host sync: a zero total weight means every body was zero."""
    total, out = mixed[-1], mixed[:-1]
    out[-n:].div_(total.clamp(min=torch.finfo(out.dtype).tiny))
    return out


def outer_needs(topology: Topology, compression: Optional[Compression],
                sparse: Optional[SparseOuter] = None) -> Optional[Tuple[bool, List[Tuple[int, ...]]]]:
    """What a communicator must set up for the outer exchanges over ``topology`` (None: what the
    plans need, the default): a compressed or sparse exchange runs point to point (pairs, the two
    rounds of the group exchange, the sparse messages' all-gather), beside the plans' all-reduces (a
    time budget's weights, the full-precision exchange that re-synchronises the global copies after an
    elastic re-formation)."""
    if compression is None and sparse is None:
        return None
    return compressed_needs(topology)[0], communication_needs(topology)[1]


class OuterLink:
    """How a face's outer exchanges reach their group: the plan of each outer step (``plans.at(k)``),
    the communicator and the group exchanges' thread, the topology and this rank in it. The engine's
    reads them from its strategy at each use (an elastic re-formation replaces them)."""

    def __init__(self, plans: Any, comm: Any, exchanger: GroupExchanger, topology: Topology, rank: int,
                 timeout: datetime.timedelta, compression: Optional[Compression], replicas_equal: bool = True,
                 sparse: Optional[SparseOuter] = None) -> None:
        self.plans, self.comm, self.exchanger, self.topology, self.rank = plans, comm, exchanger, topology, rank
        self.timeout, self.compression, self.sparse = timeout, compression, sparse
        #: every replica started from the same parameters (compressed gossip's public copies start from them)
        self.replicas_equal = replicas_equal

    @property
    def exact(self) -> bool:
        """The topology averages exactly: the global copies stay home."""
        return self.topology.is_exact_average()

    @property
    def tracked(self) -> bool:
        """A compressed or sparse gossip outer step: the buffers mix against public copies."""
        return (self.compression is not None or self.sparse is not None) and not self.exact

    def plan(self, outer_step: int) -> ExchangePlan:
        return self.plans.at(outer_step)

    def weight_mix(self, outer_step: int, weight: float, device: torch.device) -> BufferMix:
        """A time budget with compression: this rank's inner-step weight mixed apart (one element,
        uncompressed) with the coefficients of the compressed exchange beside it."""
        assert self.compression is not None
        w = torch.full((1,), float(weight), dtype=torch.float32, device=device)
        # the exact mean on an exact-average topology, else compressed gossip's gamma
        return BufferMix(self.plan(outer_step), self.comm, WEIGHT_TAG, w, self.timeout,
                         adaptive_factor=1.0 if self.exact else float(self.compression.gamma))  # type: ignore[arg-type]


@dataclass
class InFlight:
    """An outer exchange in flight: started after the inner step of one iteration, applied at the
    start of iteration ``due`` (the engine's count; DiLoCo applies when its clock says)."""

    due: int
    #: the exchange (None once received); ``result``: where its result lands -- the mixed buffer
    #: ``[theta;] delta [; weight]``, or with a compressed mean its wire bytes
    work: Union[None, BufferMix, CompressedMix, SparseMix, GroupExchange, SparseGather]
    result: Tensor
    compressed: bool
    #: a time budget with compression: the inner-step weights' own mix (shared by the outer step's
    #: buffers); ``total`` its result once received
    weight: Optional[BufferMix] = None
    total: Optional[Tensor] = None
    #: the weight travels as the buffer's last element
    weight_inside: bool = False
    #: DiLoCo's checkpoints: the outer step's inputs ``[theta_mix;] delta`` already decoded and weighed
    settled: bool = False

    def receive(self, timeout: datetime.timedelta) -> Tensor:
        """The exchange's result (waits for it, bounded by ``timeout``)."""
        work, self.work = self.work, None
        if isinstance(work, (BufferMix, CompressedMix, SparseMix)):
            self.result = work.wait()
        elif work is not None:  # (a group exchange or SparseGather: completes into ``result``)
            work.wait(timeout)
        if self.weight is not None:
            self.total, self.weight = self.weight.wait(), None
        return self.result


def split(flat: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
    """``flat`` as views shaped like ``like``, in order."""
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view_as(t))
        at += t.numel()
    return out


class OuterBuffer:
    """One flat buffer's outer exchange (see the module): its error feedback or public copies, and
    the exchange in flight."""

    def __init__(self, link: OuterLink, numel: int, device: torch.device, weighted: bool = False) -> None:
        self.link = link
        self.numel = numel
        self.device = device
        #: a time budget: the pseudo-gradients are weighted by the inner steps behind them
        self.weighted = weighted
        self.pending: Optional[InFlight] = None
        self.excess: Optional[Tensor] = None
        self.wires: List[Tensor] = []  # q, result, then one receive slot per other member
        self.copies: Union[None, GossipCopies, SparseCopies] = None
        self._buf: Optional[Tensor] = None
        self._scratch: Optional[Tensor] = None  # a time budget with a compressed mean: w delta, then zeros
        #: SparseLoCo: the error-feedback buffer, this rank's message and one slot per other member, the mean
        self.error: Optional[Tensor] = None
        self._sparse_wires: List[Tensor] = []
        self._sparse_mean: Optional[Tensor] = None
        sp = link.sparse
        if sp is not None and link.exact:
            self.error = torch.zeros(numel, dtype=torch.float32, device=device)
            size = sp.wire_bytes(numel)
            self._sparse_wires = [torch.empty(size, dtype=torch.uint8, device=device)
                                  for _ in range(max(1, link.topology.world_size))]
            self._sparse_mean = torch.empty(numel, dtype=torch.float32, device=device)
        comp = link.compression
        if comp is not None and link.exact:
            self.excess = torch.zeros(numel, dtype=torch.float32, device=device)
            size = kernels.compressed_bytes(comp.compressor, numel)
            self.wires = [torch.empty(size, dtype=torch.uint8, device=device)
                          for _ in range(1 + max(1, link.topology.world_size))]

    def new_copies(self, theta: Optional[Tensor]) -> None:
        """A compressed or sparse gossip outer step's public copies of ``[theta; delta]``: from
        ``[theta; 0]``, which every replica holds alike while they are equal (the broadcast start), else
        from zero."""
        link = self.link
        if not link.tracked:
            return
        start = None
        if self.link.replicas_equal and theta is not None:
            start = torch.cat([theta.reshape(-1).float(), torch.zeros(self.numel, dtype=torch.float32,
                                                                      device=theta.device)])
        if link.sparse is not None:
            self.copies = SparseCopies(link.topology, link.rank, 2 * self.numel, link.sparse, self.device, start)
        else:
            assert link.compression is not None
            self.copies = GossipCopies(link.topology, link.rank, 2 * self.numel, link.compression, self.device,
                                       start)

    @torch.no_grad()
    def launch(self, x: Tensor, theta: Tensor, outer_step: int, tag: int, *, send_globals: bool,
               weight: Optional[float] = None, weight_mix: Optional[BufferMix] = None, due: int = 0,
               step: Optional[int] = None) -> None:
        """Pack the pseudo-gradient ``theta - x`` (flat; ``theta`` float32, or float64 for float64
        parameters, uncompressed) and start its exchange
        at ``outer_step`` under ``tag``. ``send_globals``: mix ``[theta; delta]`` (a gossip outer
        step, or a re-synchronisation on an exact topology); ``weight``: this rank's inner steps (a
        time budget), with ``weight_mix`` its own mix when compressed; ``step``: for messages."""
        link, comp, n = self.link, self.link.compression, self.numel
        plan = link.plan(outer_step)
        if link.sparse is not None and not send_globals:  # SparseLoCo: the error-fed sparse messages' mean
            self._launch_sparse(x, theta, plan, tag, due, step)
            return
        if comp is not None and not send_globals:  # the error-fed compressed mean
            assert self.excess is not None
            if weight is None:
                pseudo_gradient(x, theta, self.wires[0], comp.compressor, self.excess)
            else:  # Q(w d - e): the weighted pseudo-gradient against zero
                if self._scratch is None:
                    self._scratch = torch.zeros(2 * n, dtype=torch.float32, device=theta.device)
                wd, zero = self._scratch[:n], self._scratch[n:]
                pseudo_gradient(x, theta, wd)
                wd.mul_(float(weight))
                pseudo_gradient(zero, wd, self.wires[0], comp.compressor, self.excess)
            work, mean = start_compressed_mean(link.comm, link.exchanger, tag, plan, link.rank, comp, n, self.wires,
                                               self.excess, link.timeout, step)
            self.pending = InFlight(due, work, mean, compressed=True, weight=weight_mix)
            return
        inside = weight is not None and weight_mix is None  # the weight as the buffer's last element
        size = (2 * n if send_globals else n) + (1 if inside else 0)
        if self._buf is None or self._buf.numel() != size:
            self._buf = torch.empty(size, dtype=theta.dtype, device=theta.device)  # (float64 parameters: float64)
        buf = self._buf
        at = n if send_globals else 0
        if send_globals:
            buf[:n].copy_(theta)
        pseudo_gradient(x, theta, buf[at:at + n])
        if inside:  # sum w_j delta_j / sum w_j over the group
            weigh(buf[at:at + n], buf[-1:], float(weight))  # type: ignore[arg-type]
        elif weight is not None:
            buf[at:at + n].mul_(float(weight))
        mix: Union[BufferMix, CompressedMix, SparseMix]
        if link.tracked:  # a compressed or sparse gossip outer step: [theta; delta], CHOCO
            if self.copies is None:
                self.new_copies(theta)
            if isinstance(self.copies, SparseCopies):
                mix = SparseMix(plan, link.comm, tag, buf, self.copies, link.timeout, step)
            else:
                assert self.copies is not None
                mix = CompressedMix(plan, link.comm, link.exchanger, tag, buf, self.copies, link.timeout, step)
        else:
            mix = BufferMix(plan, link.comm, tag, buf, link.timeout)
        self.pending = InFlight(due, mix, buf, compressed=False, weight=weight_mix, weight_inside=inside)

    def _launch_sparse(self, x: Tensor, theta: Tensor, plan: ExchangePlan, tag: int, due: int,
                       step: Optional[int]) -> None:
        sp, link = self.link.sparse, self.link
        assert sp is not None and self.error is not None and self._sparse_mean is not None
        x32 = x.reshape(-1) if x.dtype == torch.float32 else x.reshape(-1).float()
        t32 = theta.reshape(-1) if theta.dtype == torch.float32 else theta.reshape(-1).float()
        others = other_members(plan, link.rank)
        while len(self._sparse_wires) < 1 + len(others):  # (an elastic re-formation into a larger group)
            self._sparse_wires.append(torch.empty_like(self._sparse_wires[0]))
        mine = self._sparse_wires[0]
        kernels.sparse_pack(x32, t32, self.error, mine, sp.chunk, sp.k, sp.decay)
        work = None
        if others:
            work = SparseGather(link.comm, tag, plan.group.ranks, link.rank, sp, mine,
                                self._sparse_wires[1:1 + len(others)], self._sparse_mean, step)
        else:  # alone: the mean of one message
            kernels.sparse_mean([mine], self._sparse_mean, sp.chunk, sp.k)
        self.pending = InFlight(due, work, self._sparse_mean, compressed=False)

    def receive(self) -> Tensor:
        """The raw result of the exchange in flight (waits for it): what a peer check inspects."""
        assert self.pending is not None, "internal error: no outer exchange in flight"
        return self.pending.receive(self.link.timeout)

    def drop(self) -> None:
        """Forget the exchange in flight (an elastic re-formation, or refused by the peer check)."""
        self.pending = None

    def inputs(self) -> Tuple[Tensor, Optional[Tensor], Optional[Compression]]:
        """The outer step's inputs from the received exchange: ``(delta, theta_mix, compression)`` --
        ``delta`` float32 (or, with ``compression``, the compressed mean's wire bytes), ``theta_mix``
        the mixed global copy of a gossip outer step (None: this rank's own). Idempotent: the
        exchange in flight is settled into these inputs (weighed, decoded where needed)."""
        p = self.pending
        assert p is not None, "internal error: no outer exchange in flight"
        got = p.receive(self.link.timeout)
        n = self.numel
        if not p.settled:
            if p.compressed and p.total is None:  # the mean's wire bytes (decoded by the outer step)
                return got, None, self.link.compression
            if p.compressed:  # the weighted mean's wire: decoded, divided by the mean weight
                assert self.link.compression is not None
                got = self._decode(got, self.link.compression).div_(p.total.clamp(min=_TINY))  # type: ignore[union-attr]
            elif p.total is not None:
                got[-n:].div_(p.total.clamp(min=_TINY))
            elif p.weight_inside:
                got = unweigh(got, n)
            p.result, p.settled, p.total = got, True, None
        return (got, None, None) if got.numel() == n else (got[n:], got[:n], None)

    def _decode(self, wire: Tensor, comp: Compression) -> Tensor:
        out = torch.empty(self.numel, dtype=torch.float32, device=wire.device)
        kernels.outer_decode(comp.compressor, wire, out)
        return out

    def decoded(self) -> Tuple[Tensor, Optional[Tensor]]:
        """:meth:`inputs` with a compressed mean's wire decoded: ``(delta, theta_mix)``, float32."""
        delta, mix, comp = self.inputs()
        return (delta if comp is None else self._decode(delta, comp)), mix

    @torch.no_grad()
    def apply(self, optimizer: Optimizer, params: Sequence[Tensor], thetas: Sequence[Tensor], *,
              stepped: Optional[Sequence[Tensor]] = None, alpha: float = 0.0, pull: Optional[float] = None) -> None:
        """The outer step with the received exchange (:func:`~decentpy.optim.outer.outer_step`):
        ``params`` the tensors this buffer packed, in order, ``thetas`` their global copies,
        ``stepped`` what the outer optimizer holds (default ``params``). One tensor whose outer step
        runs fused takes a compressed mean's wire into the kernel pass; otherwise it is decoded first.
        ``pull`` (NoLoCo, a gossip outer step): the step starts from this rank's own global copy with
        ``delta + pull (theta - theta_mix)`` instead of from ``theta_mix`` with ``delta``."""
        stepped = list(params) if stepped is None else list(stepped)
        delta, mix, comp = self.inputs()
        if pull is not None and mix is not None:
            own = torch.cat([t.detach().reshape(-1).to(delta.dtype) for t in thetas]).sub_(mix)
            delta, mix = own.mul_(float(pull)).add_(delta), None
        if len(params) == 1 and (comp is None or fusable_here(optimizer, stepped, params, thetas, [delta]) is None):
            deltas, mixes = [delta], None if mix is None else [mix]
        else:
            if comp is not None:
                delta, comp = self._decode(delta, comp), None
            deltas, mixes = split(delta, params), None if mix is None else split(mix, params)
        self.pending = None
        outer_step(optimizer, params, thetas, deltas, stepped=stepped, theta_mix=mixes,
                   compressor=comp.compressor if comp is not None else None, alpha=alpha)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, settled: bool = False) -> Dict[str, Any]:
        """The error feedback, the public copies and the exchange in flight: received now, so that
        a resume applies the same outer step at the same iteration -- raw (the engine's layout:
        ``{"due", "compressed", "result", "total"}``) or ``settled`` (DiLoCo's: the outer step's
        decoded inputs ``[theta_mix;] delta``)."""
        flight: Any = None
        if self.pending is not None:
            if settled or self.pending.settled:
                delta, mix = self.decoded()
                flight = (delta if mix is None else torch.cat([mix, delta])).clone()
            else:
                result = self.receive().clone()
                total = self.pending.total
                flight = {"due": self.pending.due, "compressed": self.pending.compressed, "result": result,
                          "total": None if total is None else total.clone()}
        return {"excess": None if self.excess is None else self.excess.clone(), "in_flight": flight,
                "copies": None if self.copies is None else self.copies.state_dict(),
                **({} if self.error is None else {"error": self.error.clone()})}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any], copies: bool = True, what: str = "") -> None:
        """What :meth:`state_dict` saved (either layout); ``copies=False`` (an elastic re-formation:
        new partners) starts the public copies afresh instead."""
        comp = self.link.compression
        if self.error is not None:
            if state.get("error") is None:
                raise ValueError(f"{what}the checkpoint was saved without SparseLoCo's error-feedback buffer; this run "
                                 f"sends the outer exchange sparse ({self.link.sparse!r})")
            self.error.copy_(state["error"])
        if self.excess is not None:
            if state.get("excess") is None:
                raise ValueError(f"{what}the checkpoint was saved without compression's error feedback; this run "
                                 f"compresses the outer exchange ({comp!r})")
            self.excess.copy_(state["excess"])
        if self.link.tracked:
            saved = state.get("copies")
            if not copies:
                self.copies = None  # (made afresh at the next exchange, from the global copy)
            elif saved is None:
                raise ValueError(f"{what}the checkpoint was saved without the compressed gossip outer step's public "
                                 f"copies; this run compresses it ({comp or self.link.sparse!r})")
            else:
                if self.copies is None:
                    self.new_copies(None)
                assert self.copies is not None
                self.copies.load_state_dict(saved)
        flight = state.get("in_flight")
        if flight is None:
            self.pending = None
        elif isinstance(flight, Tensor):  # settled: [theta_mix;] delta
            keep = torch.float64 if flight.dtype == torch.float64 else torch.float32
            self.pending = InFlight(0, None, flight.to(keep, copy=True), compressed=False, settled=True)
        else:
            total = flight.get("total")
            result = flight["result"].clone()
            compressed = bool(flight["compressed"])
            inside = self.weighted and total is None and not compressed
            self.pending = InFlight(int(flight["due"]), None, result, compressed,
                                    total=None if total is None else total.clone(), weight_inside=inside)
