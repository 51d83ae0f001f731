"""The sharded-gradient reduce of ``ShardedDataParallel``: gradients to their owning ranks, unit
by unit, inside backward (a strategy of the backward driver, whose buckets are the units below).

Each iteration the gradients go into a flat gradient block laid out as the sharded
optimizer's parameter block (:class:`~decentpy.sharding.oss.FlatLayout`), in which every owner's
elements are one contiguous run, preceded in the gradient block by one *usage flag* per parameter
overlapping the run. Each run (with its flags) is cut into *units* of at most
``reduce_buffer_size`` elements; a unit travels to its owner with one in-place ``dist.reduce``
straight from the block (no packing) -- the cheapest collective that delivers each element to its
one owner (gloo's reduce-scatter costs more than an all-reduce).

When a gradient is ready it is copied into the block, pre-divided by the group size (torch DDP's
mean, computed as DDP does, while copying), and the rank drops its own copy. Units are launched
from the end of the block (gradient-ready order, as autograd usually runs), each as soon as the
driver finds every parameter overlapping it has its gradient and every earlier unit has gone (so
that all ranks issue their collectives in the same order): the last layers' owner receives while the first layers
still compute. A run's flags ride in its lowest unit, launched after the rest of the run, when
this rank's usage of each of its parameters is known (1: it had a gradient here, set on the
device): their sums say whether any rank had a gradient, without a collective of their own. The
owner reads them back to the host only when it did not use one of its parameters itself (the
usual iteration, every parameter used, has no host synchronisation).

At the end of backward the units not launched yet are launched (a parameter without a new
gradient contributes the one it accumulated under ``no_sync``, or zeros), every reduction
completes (bounded waits) and the owner copies its run out of the block (the block then goes): a parameter it
owns whole gets a gradient viewing that copy, a piece of a split parameter likewise, a parameter
no rank used ``None`` (as torch DDP); every other gradient is ``None``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..optim.kernels import flat_alias
from ..engine.driver import BoundedWait
from ..engine.strategy import BucketStrategy, Readiness

if TYPE_CHECKING:
    from .oss import FlatLayout

__all__ = ["ShardedGrads"]


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` (memory order) of a parameter, at ``at`` in the gradient block."""

    start: int
    stop: int
    at: int


@dataclass
class Run:
    """One owner's run of a layout: elements ``[lo, hi)`` of the parameter block, at ``at`` in the
    gradient block, after the usage flags of ``params`` (the parameters overlapping it)."""

    owner: int
    lo: int
    hi: int
    at: int
    params: List[int]

    @property
    def flags_at(self) -> int:
        return self.at - len(self.params)


@dataclass
class Plan:
    """The gradient block of one layout: its runs, each parameter's segments, its size."""

    runs: List[Run]
    segments: List[List[Segment]]
    numel: int


@dataclass
class Unit:
    """What one ``dist.reduce`` sends: elements ``[lo, hi)`` of layout ``layout``'s gradient block,
    all owned by ``owner``; it goes when the parameters ``params`` overlapping it have their
    gradient. ``flags_of``: the run whose usage flags it carries (its lowest unit)."""

    layout: int
    owner: int
    lo: int
    hi: int
    params: List[int]
    flags_of: Optional[int] = None
    work: Optional[Any] = None


@dataclass
class Target:
    """On the owner: the tensor (the parameter, or this rank's piece of it) that gets the averaged
    gradient of elements ``[lo, hi)`` of the parameter block, inside run ``run``, and whose usage
    flag is the ``flag``-th of that run."""

    tensor: Tensor
    lo: int
    hi: int
    whole: bool
    run: int
    flag: int


def plan_layout(layout: "FlatLayout") -> Plan:
    """Where each run, its flags and each parameter's segments go in the gradient block."""
    ends = [off + p.numel() for off, p in zip(layout.offsets, layout.params)]
    runs: List[Run] = []
    shift = 0
    for owner, lo, hi in layout.runs:
        params = [i for i, (off, end) in enumerate(zip(layout.offsets, ends)) if off < hi and end > lo]
        shift += len(params)
        runs.append(Run(owner, lo, hi, lo + shift, params))
    segments: List[List[Segment]] = [[] for _ in layout.params]
    for run in runs:
        for i in run.params:
            off = layout.offsets[i]
            start, stop = max(run.lo, off) - off, min(run.hi, ends[i]) - off
            segments[i].append(Segment(start, stop, run.at + off + start - run.lo))
    return Plan(runs, segments, layout.block.numel() + shift)


class ShardedGrads(BucketStrategy):
    """Gradient blocks, units and in-order reductions for one
    :class:`~decentpy.sharding.ShardedDataParallel`; the driver's parameters are :attr:`params`
    (every layout's, in order), its buckets the units."""

    def __init__(self, layouts: List["FlatLayout"], group: Any, global_ranks: List[int], cap_elements: int,
                 reduce_fp16: bool, timeout: datetime.timedelta) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = global_ranks
        self.reduce_fp16 = reduce_fp16
        self.layouts = layouts
        self.plans = [plan_layout(layout) for layout in layouts]
        self.wait = BoundedWait(timeout, layouts[0].block.device if layouts else None)
        self._scale = 1.0 / self.world_size
        self.params: List[Tensor] = [p for layout in layouts for p in layout.params]
        self._where: List[Tuple[int, int]] = []  # running index -> (layout, position)
        self._base: List[int] = []               # layout -> running index of its first parameter
        for k, layout in enumerate(layouts):
            self._base.append(len(self._where))
            self._where += [(k, i) for i in range(len(layout.params))]
        n = self._count = len(self.params)
        self.targets: List[List[Target]] = [self._targets(k) for k in range(len(layouts))]
        self.units: List[Unit] = []
        cap = int(cap_elements)
        for k, plan in enumerate(self.plans):
            for j in reversed(range(len(plan.runs))):  # from the end: gradient-ready order
                run = plan.runs[j]
                mine = {i: s for i in run.params for s in plan.segments[i] if run.at <= s.at < run.at + run.hi - run.lo}
                starts = sorted(s.at for s in mine.values())
                top = run.at + run.hi - run.lo
                while top > run.flags_at:
                    # at most ``cap`` elements; cap 0: one parameter (fairscale's "no buckets")
                    bottom = top - cap if cap > 0 else max(a for a in starts if a < top)
                    if bottom <= run.at:
                        bottom = run.flags_at  # the lowest unit carries the flags
                    params = [i for i, sg in mine.items() if sg.at < top and sg.at + sg.stop - sg.start > bottom]
                    self.units.append(Unit(k, run.owner, bottom, top, params,
                                           flags_of=j if bottom == run.flags_at else None))
                    top = bottom
        self._readiness = Readiness.of([[self._base[u.layout] + i for i in u.params] for u in self.units], n)
        self._blocks: List[Optional[Tensor]] = [None] * len(layouts)
        self._used: List[float] = [0.0] * n     # this iteration: had a gradient on this rank
        self._written: List[bool] = [False] * n

    def _targets(self, k: int) -> List[Target]:
        """What this rank steps of layout ``k``: its whole parameters and pieces, with their runs."""
        layout, plan = self.layouts[k], self.plans[k]
        out = []
        for i, owned in enumerate(layout.owned):
            if owned is None:
                continue
            shard, tensor = owned
            lo, hi = layout.offsets[i] + shard.start, layout.offsets[i] + shard.end
            j = next((j for j, r in enumerate(plan.runs) if r.owner == self.rank and r.lo <= lo and hi <= r.hi
                      and i in r.params), None)
            if j is not None:  # (a parameter with no elements is in no run: it keeps no gradient)
                out.append(Target(tensor, lo, hi, shard.whole, j, plan.runs[j].params.index(i)))
        return out

    @property
    def num_collectives(self) -> int:
        """Collectives per iteration: one reduction per unit (none on a group of one)."""
        return len(self.units) if self.world_size > 1 else 0

    # -- iteration ---------------------------------------------------------------------------------
    def _block_dtype(self, layout: FlatLayout) -> torch.dtype:
        return torch.float16 if self.reduce_fp16 else layout.block.dtype

    def readiness(self) -> Readiness:
        return self._readiness

    def begin_iteration(self, in_join: bool, active: bool) -> None:
        """A new reduction: fresh (uninitialised) gradient blocks, every unit waiting."""
        self._used = [0.0] * self._count
        self._written = [False] * self._count
        self._blocks = [torch.empty(plan.numel, dtype=self._block_dtype(layout), device=layout.block.device)
                        for layout, plan in zip(self.layouts, self.plans)]
        for u in self.units:
            u.work = None

    def _put(self, k: int, i: int, g: Optional[Tensor], add: bool = False) -> None:
        """Parameter ``i`` of layout ``k`` into the gradient block: ``g / world`` (added to what is
        there with ``add``), or zeros when ``g`` is None."""
        block = self._blocks[k]
        assert block is not None
        p = self.layouts[k].params[i]
        segments = self.plans[k].segments[i]
        if g is not None and len(segments) == 1 and segments[0].stop - segments[0].start == p.numel():
            # the usual case: the whole parameter in one place, viewed in its own memory layout
            view = block.as_strided(p.shape, p.stride(), block.storage_offset() + segments[0].at)
            if add:
                view.add_(g, alpha=self._scale)
            else:
                torch.mul(g, self._scale, out=view)  # DDP's mean, divided while copying
            return
        flat = None
        if g is not None:  # a parameter split over several runs: its pieces in memory order
            flat = flat_alias(g if g.stride() == p.stride() else torch.empty_like(p).copy_(g))
        for s in segments:
            dst = block.narrow(0, s.at, s.stop - s.start)
            if flat is None:
                dst.zero_()
            elif add:
                dst.add_(flat.narrow(0, s.start, s.stop - s.start), alpha=self._scale)
            else:
                torch.mul(flat.narrow(0, s.start, s.stop - s.start), self._scale, out=dst)

    def grad_ready(self, n: int, first: bool, sent: bool) -> bool:
        p = self.params[n]
        g = p.grad
        if g is None:
            return False
        if g.requires_grad:
            raise RuntimeError("ShardedDataParallel reduces plain gradients; this backward made gradients that require "
                               "grad (create_graph=True): use torch DDP for higher-order gradients")
        k, i = self._where[n]
        if sent:
            raise RuntimeError(f"parameter {i} of shape {tuple(p.shape)} got a second gradient in one backward after "
                               "its gradients were sent (reentrant checkpointing, or a parameter used in two "
                               "backward passes of one iteration?); torch DDP refuses this as well")
        if not first:  # a second gradient before its units went: add it
            self._put(k, i, g, add=True)
        else:
            self._put(k, i, g)
            self._written[n] = True
            self._used[n] = 1.0
        p.grad = None  # this rank's copy goes now; the owner gets the reduced one at the end
        return True

    def bucket_ready(self, bucket: int, joined: bool) -> None:
        """Reduce unit ``bucket`` to its owner; a joined rank contributes zeros."""
        self._launch(self.units[bucket], zeros=joined)

    # -- collectives -------------------------------------------------------------------------------
    def _launch(self, u: Unit, zeros: bool) -> None:
        """Fill what no gradient wrote (the gradient accumulated under ``no_sync``, else zeros) and,
        in a run's lowest unit, this rank's usage flags; then reduce the unit to its owner."""
        layout = self.layouts[u.layout]
        base = self._base[u.layout]
        for i in u.params:
            p = layout.params[i]
            n = base + i
            if self._written[n]:
                continue
            if p.grad is not None and not zeros:
                self._put(u.layout, i, p.grad)
                self._used[n] = 1.0
                p.grad = None
            else:
                self._put(u.layout, i, None)
            self._written[n] = True
        block = self._blocks[u.layout]
        assert block is not None
        if u.flags_of is not None:  # set on the device (no host-to-device copy): usually all ones
            run = self.plans[u.layout].runs[u.flags_of]
            flags = block.narrow(0, run.flags_at, len(run.params))
            if zeros:
                flags.zero_()
            else:
                flags.fill_(1.0)
                for t, i in enumerate(run.params):
                    if not self._used[base + i]:
                        flags[t].fill_(0.0)
        if self.world_size > 1:
            u.work = dist.reduce(block[u.lo:u.hi], dst=self.global_ranks[u.owner], group=self.group, async_op=True)

    def end_backward(self, joined: bool) -> None:
        """Every unit went: complete every reduction, hand the owners their averaged gradients."""
        for u in self.units:
            if u.work is not None:
                work, u.work = u.work, None
                self.wait(work, f"the reduction of elements [{u.lo}, {u.hi}) of gradient block {u.layout} to its "
                                f"owner, group rank {u.owner}")
        for k, layout in enumerate(self.layouts):
            for p in layout.params:  # a rank keeps only what it owns (set just below)
                p.grad = None
            block = self._blocks[k]
            assert block is not None
            self._hand_out(k, block)
        self._blocks = [None] * len(self.layouts)

    def _hand_out(self, k: int, block: Tensor) -> None:
        """The owner's runs, copied out of the block (a view when it owns the whole block, in its
        dtype), as the gradients of what it steps; ``None`` where no rank had a gradient."""
        layout, plan = self.layouts[k], self.plans[k]
        base = self._base[k]
        mine: Dict[int, Tuple[Tensor, List[float]]] = {}
        for j, run in enumerate(plan.runs):
            if run.owner != self.rank:
                continue
            part = block.narrow(0, run.at, run.hi - run.lo)
            if part.dtype != layout.block.dtype:
                part = part.to(layout.block.dtype)
            elif len(plan.runs) > 1:
                part = part.clone()
            used = [self._used[base + i] for i in run.params]
            if not all(used):
                # A parameter this rank did not use: whether another rank did decides on the host
                # whether it keeps a gradient at all (None or not), as torch DDP's unused-parameter
                # handling -- the one read-back, and only then.
                used = block.narrow(0, run.flags_at, len(run.params)).tolist()
            mine[j] = (part, used)
        for t in self.targets[k]:
            part, used = mine[t.run]
            if used[t.flag] == 0:
                t.tensor.grad = None  # no rank had a gradient: as torch DDP, none
                continue
            lo = plan.runs[t.run].lo
            if t.whole:  # the block holds the parameter in its own memory layout
                t.tensor.grad = part.as_strided(t.tensor.shape, t.tensor.stride(), part.storage_offset() + t.lo - lo)
            else:
                t.tensor.grad = part.narrow(0, t.lo - lo, t.hi - t.lo)
