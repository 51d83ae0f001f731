"""Local steps with an outer optimizer (``DecentralizedDataParallel(local_steps=H, outer_optim=...)``):
an exchange part of the gossip strategy (:mod:`decentpy.engine.exchanges`).

For ``H`` iterations each bucket takes the fused in-backward inner step and exchanges nothing (the
kernel pass mixes nothing, nothing is launched). After the inner step of every ``H``-th iteration
the bucket's pseudo-gradient ``delta = theta - x`` (``theta`` its global copy, the parameters at
the start of the window) starts its outer exchange over the topology's plan of that outer step
(:class:`decentpy.comm.plans.BufferMix`): on a topology that averages exactly (``complete``) the
pseudo-gradients are averaged and the global copies, equal on every rank, stay home -- DiLoCo; on
any other the buffer ``[theta; delta]`` is mixed with the group -- a gossip outer step, whose mean
over the replicas is DiLoCo's update with the mean pseudo-gradient. The exchange runs while the rest
of the backward computes; before the parameters are used again (the next forward, a checkpoint,
``global_avg``: :meth:`LocalStepsExchange.wait_params`) the outer step completes: the bucket's
parameters become the mixed global copy, its ``.grad`` the mixed pseudo-gradient, the bucket's
outer optimizer (a torch optimizer over the flat block; DiLoCo's Nesterov SGD by default) steps,
and the result is the new global copy.

The outer step itself is :func:`decentpy.optim.outer.outer_step` (fused for torch's SGD / Adam /
AdamW). With ``compression`` on an exact-average topology the pseudo-gradient travels compressed with
error feedback through compressed gossip's group exchange; on a gossip topology the buffer ``[theta;
delta]`` is mixed by compressed gossip against public copies (:class:`decentpy.comm.compressed_mix.
CompressedMix`: CHOCO, the replicas' mean unchanged by the mix). With ``fragments`` (Streaming DiLoCo)
the buckets take their outer steps in turn, each exchange in flight over ``fragment_sync_delay``
inner steps. With ``sync_every_s`` a window is a time
budget instead of ``H`` iterations, the pseudo-gradients weighted by the inner steps behind them.
Under the elastic failure policy a failed outer exchange is dropped (:meth:`abandon`: the global
copies stay, the window's progress stays in the parameters) and the outer state carries over a
re-formation (:meth:`load_after_reform`).

The same algorithm for scripts with their own torch optimizer: :mod:`decentpy.local_sgd`.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..comm.compressed_mix import CompressedMix, GossipCopies
from ..comm.group_exchange import GroupExchange, GroupExchanger, compressed_needs, start_compressed_mean
from ..comm.plans import BufferMix, ExchangePlan, communication_needs, unweigh, weigh, weight_mix
from ..optim import kernels
from ..optim.compression import Compression
from ..optim.outer import check_fragments, check_outer_options, diloco_outer_optim, fused_outer_reason, outer_step, pseudo_gradient
from .bucket import Bucket
from .exchanges import Exchange

if TYPE_CHECKING:  # a part is handed the strategy it serves (annotations only)
    from .gossip import GossipStrategy

__all__ = ["LocalStepsExchange", "OuterOptimFn", "diloco_outer_optim"]

logger = logging.getLogger(__name__)

#: a bucket's flat float32 global copy -> its outer optimizer
OuterOptimFn = Callable[[List[Tensor]], Optimizer]

#: the time source of ``sync_every_s`` (seconds); tests replace it with a fake clock
CLOCK: Callable[[], float] = time.monotonic




@dataclass
class InFlight:
    """A bucket's outer exchange in flight: started after the inner step of one iteration, applied
    at the start of iteration ``due`` (``fragment_sync_delay`` inner steps later, the next one
    without a delay)."""

    due: int
    #: the exchange (None once received); ``result``: where its result lands -- the mixed buffer
    #: ``[theta;] delta [; weight]``, or with compression the mean's wire bytes
    work: Union[None, BufferMix, CompressedMix, GroupExchange]
    result: Tensor
    compressed: bool
    #: a time budget with compression: the inner-step weights' own (uncompressed) mix, one element,
    #: shared by the buckets of the outer step; ``total`` its result once received
    weight: Optional[BufferMix] = None
    total: Optional[Tensor] = None

    def receive(self, timeout: datetime.timedelta) -> Tensor:
        """The exchange's result (waits for it, bounded by ``timeout``)."""
        work, self.work = self.work, None
        if isinstance(work, (BufferMix, CompressedMix)):
            self.result = work.wait()
        elif work is not None:
            work.wait(timeout)
        if self.weight is not None:
            self.total, self.weight = self.weight.wait(), None
        return self.result


@dataclass
class OuterState:
    """A bucket's global copy (float32), its outer optimizer (over ``theta``), the outer exchange in
    flight and, with compression, the error feedback and the wire buffers."""

    theta: Tensor
    optimizer: Optimizer
    pending: Optional[InFlight] = None
    buf: Optional[Tensor] = None
    excess: Optional[Tensor] = None
    wires: List[Tensor] = field(default_factory=list)  # q, result, then one receive slot per other member
    #: a compressed gossip outer step's public copies of the buffer ``[theta; delta]``
    copies: Optional[GossipCopies] = None
    #: a time budget with compression on ``complete``: the weighted pseudo-gradient, then zeros
    scratch: Optional[Tensor] = None


class LocalStepsExchange(Exchange):
    """``H`` inner steps without exchange, then the outer step (see the module)."""

    name = "local-steps"

    def __init__(self, strategy: "GossipStrategy", local_steps: int, outer_optim: Optional[OuterOptimFn] = None,
                 compression: Optional[Compression] = None, sync_every_s: Optional[float] = None,
                 fragments: int = 1, fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0) -> None:
        super().__init__(strategy)
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps must be an int >= 1 (inner steps per outer step), got {local_steps!r}")
        #: the global copies are equal on every rank and only the pseudo-gradients travel
        self.exact = strategy.topology.is_exact_average()
        self.local_steps = local_steps
        #: a time budget per window instead of ``local_steps`` (seconds; None: a step count)
        self.sync_every_s = check_outer_options("local_steps", local_steps, local_steps != 1, sync_every_s)
        #: Streaming DiLoCo: bucket ``i`` is in fragment ``i % fragments``; one fragment's outer exchange
        #: starts every ``local_steps / fragments`` iterations, in turn, and is applied
        #: ``fragment_sync_delay`` inner steps later, merged with ``fragment_update_alpha``
        self.period = check_fragments("local_steps", local_steps, fragments, fragment_sync_delay,
                                      fragment_update_alpha, self.sync_every_s is not None)
        self.fragments = fragments
        self.delay = fragment_sync_delay
        self.alpha = float(fragment_update_alpha)
        self._inner_steps = 0                   # inner steps in the current window (this iteration's included)
        self._window_t0: Optional[float] = None  # when the window started (the time budget)
        self._decided: Tuple[int, Optional[int]] = (-1, None)  # (iteration, the fragment it launches, or None)
        self._weight_at: Tuple[int, Optional[BufferMix]] = (-1, None)  # (iteration, its weight mix)
        self.outer_optim: OuterOptimFn = outer_optim if outer_optim is not None else diloco_outer_optim
        self.compression = compression
        if compression is not None and self.exact:  # (the mean's wire is decoded inside the fused step)
            why = fused_outer_reason(self.outer_optim([torch.zeros(1)]))
            if why is not None:
                raise ValueError(f"local_steps with compression={compression.kind!r} runs the fused outer step, and "
                                 f"the outer optimizer is not fusable: {why}; use torch's SGD, Adam or AdamW")
        self._exchanger = GroupExchanger()
        self._outer_steps = 0  # outer steps completed (the index of the topology's schedule for the next one)
        # The parameters at the start of the first window, by parameter, while the bucket layout is
        # provisional: a bucket built later (the layout rebuilt after the first backward) takes its
        # global copy from here, not from parameters that already took inner steps.
        self._window_start: Optional[Dict[int, Tensor]] = None
        #: after an elastic re-formation on an exact-average topology: the fragments whose next outer
        #: exchange also averages the global copies (the members' copies agree again, whatever the
        #: failure left)
        self._resync: Set[int] = set()
        self._few_buckets_logged = False

    @property
    def outer_steps(self) -> Optional[int]:
        """Outer steps completed (the index of the topology's schedule for the next one)."""
        return self._outer_steps

    def communication_needs(self) -> Optional[Tuple[bool, List[Tuple[int, ...]]]]:
        """A compressed outer exchange runs point to point (pairs, the two rounds of the group
        exchange), beside the plans' all-reduces (the full-precision exchange after a re-formation)."""
        if self.compression is None:
            return None
        p2p, _ = compressed_needs(self.strategy.topology)
        _, collective = communication_needs(self.strategy.topology)
        return p2p, collective

    def close(self) -> None:
        self._exchanger.close()

    def abandon(self) -> None:
        """Drop the outer exchanges in flight: the global copies and the parameters stay as they are,
        so the next outer step's pseudo-gradient carries this window's inner steps too."""
        for b in self.strategy.buckets:
            st: Optional[OuterState] = b.exchange_state
            if st is not None:
                st.pending = None

    def load_after_reform(self, state: Optional[Dict[str, Any]]) -> None:
        """An elastic re-formation keeps each replica's global copy, outer optimizer state and error
        feedback (a joiner receives its neighbour's: the whole training state travels); on an exact
        topology the next outer exchange averages the global copies as well, once."""
        self._load(state, copies=False)
        self._resync = set(range(self.fragments)) if self.exact else set()

    def state_of(self, b: Bucket) -> OuterState:
        st: Optional[OuterState] = b.exchange_state
        if st is None:
            layout = self.strategy.layout
            if self._window_start is None and not layout.final and self._outer_steps == 0:
                self._window_start = {id(p): p.detach().clone() for p in layout.params}
            b.gather_params()
            theta = b.param.detach().to(torch.float32, copy=True)  # (this rank's part: a shard with 'shard')
            if self._window_start is not None:
                whole = b.param_block.detach().to(torch.float32, copy=True)
                for p, off in zip(b.params, b.offsets):
                    whole[off:off + p.numel()].copy_(self._window_start[id(p)].reshape(-1))
                theta.copy_(whole[b.lo:b.hi])
            st = OuterState(theta, self.outer_optim([theta]))
            if self.compression is not None and not self.exact:
                self._new_copies(st)
            elif self.compression is not None:
                n = theta.numel()
                st.excess = torch.zeros_like(theta)
                wire = functools.partial(torch.empty, kernels.compressed_bytes(self.compression.compressor, n),
                                         dtype=torch.uint8, device=theta.device)
                st.wires = [wire() for _ in range(1 + max(1, self.strategy.topology.world_size))]
            b.exchange_state = st
            if layout.final and all(c.exchange_state is not None for c in self.strategy.buckets):
                self._window_start = None
            if layout.final and len(self.strategy.buckets) < self.fragments and not self._few_buckets_logged:
                self._few_buckets_logged = True
                logger.warning("local_steps: %d buckets for fragments=%d: fragments %s hold no bucket and their "
                               "outer steps exchange nothing (a smaller bucket_size_in_mb gives more buckets)",
                               len(self.strategy.buckets), self.fragments,
                               list(range(len(self.strategy.buckets), self.fragments)))
        return st

    def _new_copies(self, st: OuterState) -> None:
        """A compressed gossip outer step's public copies of ``[theta; delta]``: from ``[theta; 0]``,
        which every replica holds alike while they are equal (the broadcast start), else from zero."""
        s = self.strategy
        n = st.theta.numel()
        start = torch.cat([st.theta, torch.zeros_like(st.theta)]) if s.replicas_equal else None
        assert self.compression is not None
        st.copies = GossipCopies(s.topology, s.rank, 2 * n, self.compression, st.theta.device, start)

    def _launching(self) -> Optional[int]:
        """The fragment whose outer exchange this iteration starts, or None: with a step count the one
        due every ``local_steps / fragments`` iterations (``fragment_sync_delay`` early), in turn; with
        a time budget the first iteration that ends after it (decided once per iteration, at its
        first bucket's launch, and counted as one inner step of the window)."""
        step = self.strategy.step
        if self._decided[0] != step:
            self._inner_steps += 1
            if self.sync_every_s is None:
                due = (step + 1 + self.delay) % self.period == 0
                # the previous fragment's exchange was applied already (delay < period): this is outer step k
                self._decided = (step, self._outer_steps % self.fragments if due else None)
            else:
                now = CLOCK()
                if self._window_t0 is None:
                    self._window_t0 = now
                self._decided = (step, 0 if now - self._window_t0 >= self.sync_every_s else None)
        return self._decided[1]

    @property
    def weighted(self) -> bool:
        """The pseudo-gradients are weighted by the inner steps behind them (a time budget)."""
        return self.sync_every_s is not None

    def mixing(self, b: Bucket, received: ExchangePlan, nxt: ExchangePlan) -> Dict[str, Any]:
        """Nothing is mixed in the kernel pass (the inner step only); the global copy is taken at the
        bucket's first pass, before any inner step."""
        self.state_of(b)
        return {"recv": None, "mix_a": 1.0, "mix_b": 0.0, "send_scale": None,
                "prev_skip": self.strategy.deferred_skip_flag(b)}

    def launch(self, b: Bucket, nxt: ExchangePlan) -> Optional[Any]:
        """After the window's last inner step: the pseudo-gradient's outer exchange (kept here, not
        in ``b.work``: it completes in :meth:`wait_params`, before the next forward)."""
        fragment = self._launching()
        if fragment is None or b.index % self.fragments != fragment:
            return None
        s = self.strategy
        st = self.state_of(b)
        assert s.comm is not None, "internal error: the strategy has no communicator (attach() first)"
        plan = s.plans.at(self._outer_steps)
        block, n = b.param, st.theta.numel()
        due = s.step + 1 + self.delay
        resync = fragment in self._resync
        exact = self.exact and not resync
        # a time budget with compression: the weighted pseudo-gradient compressed, its weight mixed apart
        weight = self._weight_mix(plan) if self.weighted and self.compression is not None else None
        if self.compression is not None and exact:
            assert st.excess is not None
            if weight is None:
                pseudo_gradient(block, st.theta, st.wires[0], self.compression.compressor, st.excess)
            else:  # Q(w d - e): the weighted pseudo-gradient against zero
                if st.scratch is None:
                    st.scratch = torch.zeros(2 * n, dtype=torch.float32, device=st.theta.device)
                wd, zero = st.scratch[:n], st.scratch[n:]
                pseudo_gradient(block, st.theta, wd)
                wd.mul_(float(self._inner_steps))
                pseudo_gradient(zero, wd, st.wires[0], self.compression.compressor, st.excess)
            work, mean = start_compressed_mean(s.comm, self._exchanger, b.index, plan, s.rank, self.compression, n,
                                               st.wires, st.excess, s.timeout, s.step)
            st.pending = InFlight(due, work, mean, compressed=True, weight=weight)
            return None
        size = (n if exact else 2 * n) + (1 if self.weighted and weight is None else 0)
        if st.buf is None or st.buf.numel() != size:
            st.buf = torch.empty(size, dtype=torch.float32, device=st.theta.device)
        at = 0 if exact else n
        if not exact:
            st.buf[:n].copy_(st.theta)
        pseudo_gradient(block, st.theta, st.buf[at:at + n])
        if weight is not None:
            st.buf[at:at + n].mul_(float(self._inner_steps))
        elif self.weighted:  # sum w_j delta_j / sum w_j over the group: the weights travel as one more element
            weigh(st.buf[at:at + n], st.buf[-1:], float(self._inner_steps))
        if self.compression is not None and not self.exact:  # a compressed gossip outer step: [theta; delta], CHOCO
            assert st.copies is not None
            mix: Union[BufferMix, CompressedMix] = CompressedMix(plan, s.comm, self._exchanger, b.index, st.buf,
                                                                 st.copies, s.timeout, s.step)
        else:
            mix = BufferMix(plan, s.comm, b.index, st.buf, s.timeout)
        st.pending = InFlight(due, mix, st.buf, compressed=False, weight=weight)
        return None

    def _weight_mix(self, plan: ExchangePlan) -> BufferMix:
        """This outer step's mix of the inner-step weights (one element, started at its first bucket's
        launch; uncompressed, with the coefficients of the compressed exchange beside it)."""
        s = self.strategy
        if self._weight_at[0] != s.step:
            assert s.comm is not None and self.compression is not None
            self._weight_at = (s.step, weight_mix(plan, s.comm, self._inner_steps, s.layout.params[0].device,
                                                  s.timeout, self.exact, float(self.compression.gamma)))  # type: ignore[arg-type]
        mix = self._weight_at[1]
        assert mix is not None
        return mix

    @torch.no_grad()
    def wait_params(self) -> None:
        """Complete the outer step of every bucket whose exchange is due (before the parameters are
        read again: the next forward, a checkpoint): the one outer step of
        :func:`decentpy.optim.outer.outer_step`. With ``fragment_sync_delay`` an exchange stays in
        flight over that many inner steps, its parameters training on, until the iteration it is due."""
        done = False
        step = self.strategy.step
        for b in self.strategy.buckets:
            st: Optional[OuterState] = b.exchange_state
            if st is None or st.pending is None or st.pending.due > step:
                continue
            pending, st.pending = st.pending, None
            n = st.theta.numel()
            got = pending.receive(self.strategy.timeout)
            total = pending.total
            plan = self.strategy.plans.at(self._outer_steps)
            if not self.strategy.peer_check.admit_outer(b, got, self.compression.compressor if pending.compressed
                                                        else None, n, plan.group.ranks):
                done = True  # the peer check dropped this outer step (not finite): theta and the parameters stay
                continue
            tiny = torch.finfo(torch.float32).tiny
            if pending.compressed and total is None:  # the mean's wire bytes, decoded inside the fused outer step
                delta, mix, comp = got, None, self.compression
            elif pending.compressed:  # the weighted mean's wire: decoded, divided by the mean weight
                assert self.compression is not None
                delta = torch.empty_like(st.theta)
                kernels.outer_decode(self.compression.compressor, got, delta)
                delta.div_(total.clamp(min=tiny))
                mix, comp = None, None
            else:
                if total is not None:
                    got[-n:].div_(total.clamp(min=tiny))
                elif self.weighted:
                    got = unweigh(got, n)
                delta, mix, comp = (got, None, None) if got.numel() == n else (got[n:], [got[:n]], None)
            outer_step(st.optimizer, [b.param], [st.theta], [delta], stepped=[st.theta], theta_mix=mix,
                       compressor=comp.compressor if comp is not None else None, alpha=self.alpha)
            self.strategy.node_mode.part_changed(b)  # (intra_node='shard': the node all-gathers the shards)
            self._resync.discard(b.index % self.fragments)
            done = True
        if done:
            self._outer_steps += 1
            self._inner_steps = 0
            self._window_t0 = CLOCK() if self.weighted else None
            self._window_start = None  # a bucket built from now on starts from the new global copy

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The global copies and outer optimizers' states, and an exchange still in flight (a
        fragment's, with ``fragment_sync_delay``): its result, received now, so that a resume applies
        the same outer step at the same iteration."""
        out: List[Optional[Dict[str, Any]]] = []
        for b in self.strategy.buckets:
            st: Optional[OuterState] = b.exchange_state
            if st is None:
                out.append(None)
                continue
            flight = None
            if st.pending is not None:
                result = st.pending.receive(self.strategy.timeout).clone()
                total = st.pending.total
                flight = {"due": st.pending.due, "compressed": st.pending.compressed, "result": result,
                          "total": None if total is None else total.clone()}
            out.append({"theta": st.theta.clone(), "optimizer": st.optimizer.state_dict(),
                        "excess": None if st.excess is None else st.excess.clone(), "in_flight": flight,
                        "copies": None if st.copies is None else st.copies.state_dict()})
        return {"kind": self.name, "local_steps": self.local_steps, "sync_every_s": self.sync_every_s,
                "fragments": self.fragments, "fragment_sync_delay": self.delay, "fragment_update_alpha": self.alpha,
                "outer_steps": self._outer_steps, "inner_steps": self._inner_steps,
                "resync": sorted(self._resync), "buckets": out}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        self._load(state, copies=True)

    @torch.no_grad()
    def _load(self, state: Optional[Dict[str, Any]], copies: bool) -> None:
        if state is None or state.get("kind") != self.name:
            raise ValueError(f"the checkpoint was saved {'without' if state is None else 'with another'} exchange "
                             f"({None if state is None else state.get('kind')!r}); this run uses local_steps="
                             f"{self.local_steps} (the global copies and outer optimizers are part of the state)")
        theirs = {k: state.get(k, default) for k, default in
                 (("local_steps", None), ("sync_every_s", None), ("fragments", 1), ("fragment_sync_delay", 0),
                  ("fragment_update_alpha", 0.0))}
        mine = {"local_steps": self.local_steps, "sync_every_s": self.sync_every_s, "fragments": self.fragments,
                "fragment_sync_delay": self.delay, "fragment_update_alpha": self.alpha}
        if theirs != mine:
            raise ValueError("the checkpoint was saved with " + ", ".join(f"{k}={v}" for k, v in theirs.items())
                             + "; this run has " + ", ".join(f"{k}={v}" for k, v in mine.items()))
        buckets = self.strategy.buckets
        if len(state["buckets"]) != len(buckets):
            raise ValueError(f"the checkpoint has outer state for {len(state['buckets'])} buckets, this run has "
                             f"{len(buckets)}")
        self._outer_steps = int(state["outer_steps"])
        self._inner_steps = int(state.get("inner_steps", 0))
        self._decided = (-1, None)
        self._resync = set(state.get("resync", ()))
        self._window_t0 = None  # a time budget restarts with the resumed run
        for b, saved in zip(buckets, state["buckets"]):
            if saved is None:
                b.exchange_state = None
                continue
            st = self.state_of(b)
            st.theta.copy_(saved["theta"])
            st.optimizer.load_state_dict(saved["optimizer"])
            if st.excess is not None:
                if saved.get("excess") is None:
                    raise ValueError("the checkpoint was saved without compression's error feedback; this run "
                                     f"compresses the outer exchange ({self.compression!r})")
                st.excess.copy_(saved["excess"])
            if st.copies is not None:
                if not copies:  # an elastic re-formation: new partners, copies afresh (both ends alike)
                    self._new_copies(st)
                elif saved.get("copies") is None:
                    raise ValueError("the checkpoint was saved without the compressed gossip outer step's public "
                                     f"copies; this run compresses it ({self.compression!r})")
                else:
                    st.copies.load_state_dict(saved["copies"])
            flight = saved.get("in_flight")
            st.pending = None if flight is None else InFlight(
                int(flight["due"]), None, flight["result"].clone(), bool(flight["compressed"]),
                total=None if flight.get("total") is None else flight["total"].clone())
