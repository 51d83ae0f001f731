"""Local steps in the engine (``DecentralizedDataParallel(local_steps=...)``): the adapter of
:mod:`decentpy.local_steps` to the gossip strategy, as one of its exchange parts
(:mod:`decentpy.engine.exchanges`).

For ``H`` iterations each bucket takes the fused in-backward inner step and exchanges nothing (the
kernel pass mixes nothing, nothing is launched). The window clock (:class:`~decentpy.local_steps.
WindowClock`, ticked once per iteration) says when a fragment's outer exchange starts: after its
bucket's inner step, the bucket's pseudo-gradient against its float32 global copy ``theta`` (the
parameters at the start of the window) starts the shared outer exchange
(:class:`~decentpy.local_steps.exchange.OuterBuffer`: the exact mean on ``complete`` -- DiLoCo --, a
gossip mix of ``[theta; delta]`` on any other topology, compressed or weighted as set) while the
rest of the backward computes. Before the parameters are used again (the next forward, a
checkpoint, ``global_avg``: :meth:`LocalStepsExchange.wait_params`), or ``fragment_sync_delay``
iterations later, the outer step completes: the bucket's outer optimizer (a torch optimizer over
``theta``; DiLoCo's Nesterov SGD by default) steps, the result is the new global copy and the
parameters restart from it (or merge with it, Streaming DiLoCo's ``alpha``).

What only the engine has: the global copy of a bucket built after the first backward (the layout
is provisional until then), the peer check of what arrived, ``intra_node='shard'``'s shards, and
under the elastic failure policy a failed outer exchange dropped (:meth:`abandon`: the global
copies stay, the window's progress stays in the parameters) and the outer state carried over a
re-formation (:meth:`load_after_reform`, the next exchange on ``complete`` re-synchronising the
global copies once).

The same algorithm for scripts with their own torch optimizer: :mod:`decentpy.local_sgd`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..comm.group_exchange import GroupExchanger
from ..comm.plans import BufferMix, ExchangePlan
from ..local_steps import LocalSteps, SparseOuter, WindowClock
from ..local_steps.exchange import OuterBuffer, OuterLink, outer_needs
from ..optim.compression import Compression
from ..optim.outer import fused_outer_reason
from .bucket import Bucket
from .exchanges import Exchange

if TYPE_CHECKING:  # a part is handed the strategy it serves (annotations only)
    from .gossip import GossipStrategy

__all__ = ["LocalStepsExchange"]

logger = logging.getLogger(__name__)

#: the time source of ``sync_every_s`` (seconds); tests replace it with a fake clock
CLOCK: Callable[[], float] = time.monotonic




@dataclass
class OuterState:
    """A bucket's global copy (float32), its outer optimizer (over ``theta``) and its outer exchange
    (:class:`decentpy.local_steps.OuterBuffer`: error feedback, public copies, the exchange in flight)."""

    theta: Tensor
    optimizer: Optimizer
    outer: OuterBuffer


class _StrategyLink(OuterLink):
    """The strategy's communicator, plans, topology and rank, read at each use (an elastic
    re-formation replaces them)."""

    def __init__(self, strategy: "GossipStrategy", exchanger: GroupExchanger,
                 compression: Optional[Compression], sparse: Optional[SparseOuter] = None) -> None:
        # (no super().__init__: properties below)
        self._s = strategy
        self.exchanger = exchanger
        self.compression = compression
        self.sparse = sparse

    plans = property(lambda self: self._s.plans)
    comm = property(lambda self: self._s.comm)
    topology = property(lambda self: self._s.topology)
    rank = property(lambda self: self._s.rank)
    timeout = property(lambda self: self._s.timeout)
    replicas_equal = property(lambda self: self._s.replicas_equal)


class LocalStepsExchange(Exchange):
    """``H`` inner steps without exchange, then the outer step (see the module)."""

    name = "local-steps"

    def __init__(self, strategy: "GossipStrategy", options: LocalSteps,
                 compression: Optional[Compression] = None) -> None:
        super().__init__(strategy)
        #: the global copies are equal on every rank and only the pseudo-gradients travel
        self.exact = strategy.topology.is_exact_average()
        #: Streaming DiLoCo: bucket ``i`` is in fragment ``i % fragments``; one fragment's outer exchange
        #: starts every ``local_steps / fragments`` iterations, in turn, and is applied
        #: ``fragment_sync_delay`` inner steps later, merged with ``fragment_update_alpha``
        options.check("local_steps")
        self.options = options
        #: the window and fragment clock (ticked once per iteration, at its first bucket's launch)
        self.clock = WindowClock(options, lambda: CLOCK())
        self._decided: Tuple[int, Optional[int]] = (-1, None)  # (iteration, the fragment it launches, or None)
        self._weight_at: Tuple[int, Optional[BufferMix]] = (-1, None)  # (iteration, its weight mix)
        self.compression = compression
        if compression is not None and self.exact:  # (the mean's wire is decoded inside the fused step)
            why = fused_outer_reason(options.outer_optimizer([torch.zeros(1)]))
            if why is not None:
                raise ValueError(f"local_steps with compression={compression.kind!r} runs the fused outer step, and "
                                 f"the outer optimizer is not fusable: {why}; use torch's SGD, Adam or AdamW")
        self._exchanger = GroupExchanger()
        self._link = _StrategyLink(strategy, self._exchanger, compression, options.sparse)
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
        return self.clock.outer_steps

    def communication_needs(self) -> Optional[Tuple[bool, List[Tuple[int, ...]]]]:
        """What the outer exchanges need of the communicator (:func:`~decentpy.local_steps.exchange.outer_needs`)."""
        return outer_needs(self.strategy.topology, self.compression, self.options.sparse)

    def close(self) -> None:
        self._exchanger.close()

    def abandon(self) -> None:
        """Drop the outer exchanges in flight: the global copies and the parameters stay as they are,
        so the next outer step's pseudo-gradient carries this window's inner steps too."""
        for b in self.strategy.buckets:
            st: Optional[OuterState] = b.exchange_state
            if st is not None:
                st.outer.drop()

    def load_after_reform(self, state: Optional[Dict[str, Any]]) -> None:
        """An elastic re-formation keeps each replica's global copy, outer optimizer state and error
        feedback (a joiner receives its neighbour's: the whole training state travels); on an exact
        topology the next outer exchange averages the global copies as well, once."""
        self._load(state, copies=False)
        self._resync = set(range(self.options.fragments)) if self.exact else set()

    def state_of(self, b: Bucket) -> OuterState:
        st: Optional[OuterState] = b.exchange_state
        if st is None:
            layout = self.strategy.layout
            if self._window_start is None and not layout.final and self.clock.outer_steps == 0:
                self._window_start = {id(p): p.detach().clone() for p in layout.params}
            b.gather_params()
            theta = b.param.detach().to(torch.float32, copy=True)  # (this rank's part: a shard with 'shard')
            if self._window_start is not None:
                whole = b.param_block.detach().to(torch.float32, copy=True)
                for p, off in zip(b.params, b.offsets):
                    whole[off:off + p.numel()].copy_(self._window_start[id(p)].reshape(-1))
                theta.copy_(whole[b.lo:b.hi])
            st = OuterState(theta, self.options.outer_optimizer([theta]),
                            OuterBuffer(self._link, theta.numel(), theta.device, weighted=self.weighted))
            b.exchange_state = st
            if layout.final and all(c.exchange_state is not None for c in self.strategy.buckets):
                self._window_start = None
            if layout.final and len(self.strategy.buckets) < self.options.fragments and not self._few_buckets_logged:
                self._few_buckets_logged = True
                logger.warning("local_steps: %d buckets for fragments=%d: fragments %s hold no bucket and their "
                               "outer steps exchange nothing (a smaller bucket_size_in_mb gives more buckets)",
                               len(self.strategy.buckets), self.options.fragments,
                               list(range(len(self.strategy.buckets), self.options.fragments)))
        return st

    def _launching(self) -> Optional[int]:
        """The fragment whose outer exchange this iteration starts, or None (:class:`WindowClock`,
        ticked once per iteration, at its first bucket's launch)."""
        step = self.strategy.step
        if self._decided[0] != step:
            self._decided = (step, self.clock.tick())
        return self._decided[1]

    @property
    def weighted(self) -> bool:
        """The pseudo-gradients are weighted by the inner steps behind them (a time budget)."""
        return self.clock.timed

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
        if fragment is None or b.index % self.options.fragments != fragment:
            return None
        s = self.strategy
        st = self.state_of(b)
        assert s.comm is not None, "internal error: the strategy has no communicator (attach() first)"
        resync = fragment in self._resync
        weight = float(self.clock.inner_steps) if self.weighted else None
        st.outer.launch(b.param, st.theta, self.clock.outer_steps, b.index, send_globals=not self.exact or resync,
                        weight=weight, weight_mix=self._weight_mix() if weight is not None and self.compression
                        is not None else None, due=s.step + 1 + self.options.fragment_sync_delay, step=s.step)
        return None

    def _weight_mix(self) -> BufferMix:
        """This outer step's mix of the inner-step weights (one element, started at its first bucket's
        launch, shared by the buckets of the outer step)."""
        s = self.strategy
        if self._weight_at[0] != s.step:
            self._weight_at = (s.step, self._link.weight_mix(self.clock.outer_steps, float(self.clock.inner_steps),
                                                             s.layout.params[0].device))
        mix = self._weight_at[1]
        assert mix is not None
        return mix

    @torch.no_grad()
    def wait_params(self) -> None:
        """Complete the outer step of every bucket whose exchange is due (before the parameters are
        read again: the next forward, a checkpoint): the one outer step of
        :func:`decentpy.optim.outer.outer_step`. With ``fragment_sync_delay`` an exchange stays in
        flight over that many inner steps, its parameters training on, until the iteration it is due."""
        if self.weighted:
            self.clock.start(once=True)  # the first window starts with the first forward (and after a resume)
        done = False
        step = self.strategy.step
        for b in self.strategy.buckets:
            st: Optional[OuterState] = b.exchange_state
            if st is None or st.outer.pending is None or st.outer.pending.due > step:
                continue
            got = st.outer.receive()
            compressed = st.outer.pending.compressed  # (got: the wire bytes of the mean)
            plan = self.strategy.plans.at(self.clock.outer_steps)
            if not self.strategy.peer_check.admit_outer(b, got, self.compression.compressor if compressed else None,
                                                        st.theta.numel(), plan.group.ranks):
                st.outer.drop()
                done = True  # the peer check dropped this outer step (not finite): theta and the parameters stay
                continue
            st.outer.apply(st.optimizer, [b.param], [st.theta], stepped=[st.theta],
                           alpha=float(self.options.fragment_update_alpha), pull=self.options.outer_pull)
            self.strategy.node_mode.part_changed(b)  # (intra_node='shard': the node all-gathers the shards)
            self._resync.discard(b.index % self.options.fragments)
            done = True
        if done:
            self.clock.applied()
            self._window_start = None  # a bucket built from now on starts from the new global copy

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The global copies and outer optimizers' states, and an exchange still in flight (a
        fragment's, with ``fragment_sync_delay``): its result, received now, so that a resume applies
        the same outer step at the same iteration."""
        out: List[Optional[Dict[str, Any]]] = []
        for b in self.strategy.buckets:
            st: Optional[OuterState] = b.exchange_state
            out.append(None if st is None else {"theta": st.theta.clone(), "optimizer": st.optimizer.state_dict(),
                                                **st.outer.state_dict()})
        return {"kind": self.name, **self.options.checkpoint_fields(), **self.clock.state_dict(),
                "resync": sorted(self._resync), "buckets": out}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        self._load(state, copies=True)

    @torch.no_grad()
    def _load(self, state: Optional[Dict[str, Any]], copies: bool) -> None:
        if state is None or state.get("kind") != self.name:
            raise ValueError(f"the checkpoint was saved {'without' if state is None else 'with another'} exchange "
                             f"({None if state is None else state.get('kind')!r}); this run uses local_steps="
                             f"{self.options.sync_every} (the global copies and outer optimizers are part of the state)")
        self.options.check_checkpoint(state)
        buckets = self.strategy.buckets
        if len(state["buckets"]) != len(buckets):
            raise ValueError(f"the checkpoint has outer state for {len(state['buckets'])} buckets, this run has "
                             f"{len(buckets)}")
        self.clock.load_state_dict(state)  # (a time budget restarts its window with the resumed run)
        self._decided = (-1, None)
        self._resync = set(state.get("resync", ()))
        for b, saved in zip(buckets, state["buckets"]):
            if saved is None:
                b.exchange_state = None
                continue
            st = self.state_of(b)
            st.theta.copy_(saved["theta"])
            st.optimizer.load_state_dict(saved["optimizer"])
            # (an elastic re-formation: new partners, the public copies afresh on both ends alike)
            st.outer.load_state_dict(saved, copies=copies)
