"""The gossip reducer: owns the buckets, the autograd hooks and the in-flight exchanges.

Like c10d's ``Reducer`` for DDP, one object sees every gradient become ready. When all gradients
of a bucket are in (and every earlier bucket is done, so that all ranks launch their collectives
in the same order), the bucket is processed: wait for the exchange launched last iteration, mix,
step and launch the next exchange -- while autograd keeps computing the earlier layers.
Buckets are built at construction, in reverse registration order (as DDP does), so parameters
live in the flat blocks from the start, and each gradient of the first backward is copied into
its gradient block as it arrives (and freed): no iteration holds a second copy of the model. The
first backward also records the gradient-ready order; at its end the layout is rebuilt only if
that order packs the parameters into different buckets (or a parameter was given new storage,
dtype or device since construction), and then every bucket is stepped, so the first iteration
gets its update too.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from .bucket import Bucket, BucketPlan, carry_over_state, check_optimizer, flatten_params, make_bucket
from .comm import CommGroup, first_difference_across_ranks
from .grad_scaling import BucketGradScaling
from .host_memory import release_free_host_memory
from .intra_node import IntraNode
from .exchange import Communicator, ExchangeSchedule
from .grad_scaling import UNSCALED
from .optim import fuse_torch_optimizer
from .topo import Edge
from .topology import Group, Topology

logger = logging.getLogger(__name__)

OptimFn = Callable[[List[Tuple[str, Tensor]]], Optimizer]
SchedulerFn = Callable[[Optimizer], LRScheduler]

@contextlib.contextmanager
def accumulating(reducer: Any) -> Iterator[None]:
    """``no_sync()`` of a wrapper: backward passes inside only accumulate gradients (the reducer's
    ``accumulate`` flag is set, and restored after, also when nested)."""
    before = reducer.accumulate
    reducer.accumulate = True
    try:
        yield
    finally:
        reducer.accumulate = before


class GossipReducer:
    """Bucket-by-bucket mix-and-step inside backward, with exchanges overlapping compute."""

    def __init__(self, params: List[Tensor], names: List[str], optim_fn: OptimFn,
                 scheduler_fn: Optional[SchedulerFn], topology: Topology, grad_scaling: BucketGradScaling,
                 bucket_cap_bytes: int, param_as_bucket_view: bool, timeout: datetime.timedelta,
                 group: Optional[CommGroup] = None, intra: Optional[IntraNode] = None) -> None:
        """Local only (no collective): builds the buckets and their optimizers; :meth:`attach` then
        gives the reducer its communicator. ``group``: the ranks the topology numbers (the world by
        default). ``intra``: the node's gradient reduction and sharding (``intra_node='shard' |
        'allreduce'``; ``topology`` is then the exchange schedule over all ranks, e.g. the shards')."""
        self.params = params
        self.names = names
        self.optim_fn = optim_fn
        self.scheduler_fn = scheduler_fn
        self.topology = topology
        self.comm: Optional[Communicator] = None
        self.grad_scaling = grad_scaling
        self.bucket_cap_bytes = bucket_cap_bytes
        self.param_as_bucket_view = param_as_bucket_view
        self.timeout = timeout
        self.hook_edges: Optional[Dict[Tuple[Tuple[int, ...], float], Edge]] = None  # for pre_average_hook
        self.group = group if group is not None else CommGroup()
        self.rank = self.group.rank
        self.intra = intra
        self.plans = ExchangeSchedule(topology, self.rank)

        self.step = 0                       # iterations completed (schedule index of the next mix)
        self.buckets: List[Bucket] = []
        self.accumulate = False             # gradient accumulation (no_sync)
        self.adaptive_factor = 1.0          # p <- (1-f) p + f mix(p)
        self._bucket_of: List[int] = [-1] * len(params)
        self._slot_of: List[int] = [-1] * len(params)
        self._layout_final = False          # the layout has been checked against the traced order
        self._trace: List[int] = []
        self._traced_seen: List[bool] = [False] * len(params)
        self._pending: List[int] = []
        self._callback_queued = False
        self._prepared = False
        self._outside_iteration = False    # the last forward was not a training one (eval mode)
        self._next_bucket = 0
        self._deferred: Optional[Tuple[Bucket, bool, Optional[Any]]] = None  # intra_node: reduction in flight
        self._gathers: Dict[int, Any] = {}  # intra_node='shard': the node's all-gathers in flight, by bucket
        self.build_from_plan(BucketPlan.build(params, list(reversed(range(len(params)))), bucket_cap_bytes))
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    def attach(self, comm: Communicator,
               hook_edges: Optional[Dict[Tuple[Tuple[int, ...], float], Edge]] = None) -> None:
        """The communicator (and, for optimizers with ``pre_average_hook``, the edges) to exchange with."""
        self.comm = comm
        self.hook_edges = hook_edges

    def has_pre_average_hook(self) -> bool:
        """Whether the buckets' optimizers define decent-dp's ``pre_average_hook`` (all or none)."""
        found = {hasattr(b.optimizer, "pre_average_hook") for b in self.buckets}
        if len(found) > 1:
            raise ValueError("optim_fn returned optimizers with pre_average_hook for some buckets and without for "
                             "others; it must return the same kind of optimizer every time")
        return found == {True}

    # -- hooks -------------------------------------------------------------------------------
    def _make_hook(self, index: int) -> Callable[[Tensor], None]:
        def hook(_: Tensor) -> None:
            self._on_grad_ready(index)
        return hook

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def prepare(self, count_node: bool = False) -> None:
        """Called by a training-mode forward: the next backward is one iteration. ``count_node``
        (inside ``Join``, with intra_node): count the node's ranks that have data this iteration."""
        if self._callback_queued:
            return  # a forward inside backward (e.g. checkpoint recomputation) changes nothing
        self.wait_gathers()
        if self.intra is not None and count_node:
            self.intra.begin_count(True, self.params[0].device)
        if self._layout_final:
            for b in self.buckets:
                moved = b.moved_param()
                if moved is not None:
                    raise RuntimeError(
                        f"parameter '{moved}' no longer lives in decentpy's bucket {b.index}: its storage, dtype or "
                        f"device changed after the first training iteration (model.to(), .double(), .half(), or a "
                        f"new .data); move or cast the model before wrapping it, or before its first training "
                        f"iteration")
        self._prepared = True
        self._deferred = None  # (a failed iteration may have left one)
        self._outside_iteration = False
        self._next_bucket = 0
        self._trace = []
        self._traced_seen = [False] * len(self.params)
        self._pending = [len(b.params) for b in self.buckets]
        for b in self.buckets:
            b.reset_iteration()

    def leave_iteration(self) -> None:
        """Called by a forward with gradients in eval mode: its backward (if any) is not an iteration."""
        if not self._callback_queued:
            self._prepared = False
            self._outside_iteration = True

    @torch.no_grad()
    def _on_grad_ready(self, index: int) -> None:
        if self.accumulate:
            return
        if not self._prepared:
            if self._outside_iteration:
                return  # backward of an eval-mode forward: gradients accumulate locally, as with torch DDP
            raise RuntimeError(self._twice_message(index))
        if not self._callback_queued:
            self._callback_queued = True
            self.grad_scaling.begin_iteration()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        b = self.buckets[self._bucket_of[index]]
        slot = self._slot_of[index]
        # A separately allocated gradient is copied in and freed at once.
        b.adopt_grad(slot, strict=self._layout_final)
        if not self._layout_final:
            if self._traced_seen[index]:
                raise RuntimeError(self._twice_message(index))
            self._traced_seen[index] = True
            self._trace.append(index)
            return
        if self._traced_seen[index]:
            raise RuntimeError(self._twice_message(index))
        self._traced_seen[index] = True
        self._pending[b.index] -= 1
        if self._pending[b.index] == 0:
            self._process_ready_in_order()

    def _twice_message(self, index: int) -> str:
        return (f"parameter '{self.names[index]}' received a gradient twice in one training iteration (two "
                "backward passes over one forward, reentrant checkpointing, or a backward without a "
                "training-mode forward of the wrapper); decentpy steps each parameter once per iteration. "
                "Run forward and backward once per iteration, use non-reentrant checkpointing, or wrap "
                "extra backward passes in ddp.no_sync()")

    def _process_ready_in_order(self) -> None:
        while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] == 0:
            self._process(self.buckets[self._next_bucket])
            self._next_bucket += 1

    def _end_of_backward(self) -> None:
        with torch.no_grad():
            try:
                if not self._layout_final:
                    self._finalise_layout(self._trace)
                while self._next_bucket < len(self.buckets):  # buckets with unused parameters
                    self._process(self.buckets[self._next_bucket])
                    self._next_bucket += 1
                self._flush()
                skipped = self.grad_scaling.end_iteration()  # the iteration's one read-back, if any
                for b in self.buckets:
                    b.finish_iteration(skipped.get(b.index))
                self.step += 1
            finally:
                self._callback_queued = False
                self._prepared = False
                if self.intra is not None:
                    self.intra.end_iteration()

    # -- buckets -----------------------------------------------------------------------------
    def _finalise_layout(self, traced: Sequence[int]) -> None:
        """After the first backward: keep the construction layout unless the traced order differs."""
        seen = set(traced)
        unused = [i for i in reversed(range(len(self.params))) if i not in seen]
        order = list(traced) + unused
        self._check_same_order(order)
        plan = BucketPlan.build(self.params, order, self.bucket_cap_bytes)
        if not self._layout_holds(plan):
            # Costs one extra copy of the parameters and gradients, once; only for models whose
            # gradients arrive in an order other than reverse registration (or that were given new
            # storage after wrapping).
            self.build_from_plan(plan)
            logger.info("rank %d: buckets rebuilt in gradient-ready order", self.rank)
        self._layout_final = True
        logger.info("rank %d: %d buckets (%s), %d parameters without gradient in the first iteration",
                    self.rank, len(self.buckets), ", ".join(str(b.numel) for b in self.buckets), len(unused))

    def _layout_holds(self, plan: BucketPlan) -> bool:
        """Same bucket membership (the order inside a bucket does not matter) and intact views."""
        current = self.plan
        if current is None or len(current.buckets) != len(plan.buckets):
            return False
        if any(set(a) != set(b) for a, b in zip(current.buckets, plan.buckets)):
            return False
        return all(b.layout_intact() for b in self.buckets)

    def _check_same_order(self, order: List[int]) -> None:
        diff = first_difference_across_ranks([(i, tuple(self.params[i].shape)) for i in order],
                                             group=self.group.process_group)
        if diff is not None:
            r, pos = diff[0], diff[1]
            i = order[pos] if pos < len(order) else order[-1]
            raise RuntimeError(
                f"gradient-ready order differs between rank 0 and rank {r} at position {pos} (this rank: "
                f"'{self.names[i]}'); every rank must run the same model and backward, since buckets are "
                "exchanged in that order")

    @property
    def layout_final(self) -> bool:
        return self._layout_final

    def adopt_plan(self, plan: BucketPlan) -> None:
        """Use a saved layout (a checkpoint's); only before the first iteration fixed one."""
        if self._layout_final:
            if self.plan is None or self.plan.buckets != plan.buckets:
                raise ValueError("checkpoint bucket layout differs from this run's; use the same model and "
                                 "bucket_size_in_mb")
            return
        if self.plan is None or self.plan.buckets != plan.buckets or not all(b.layout_intact() for b in self.buckets):
            self.build_from_plan(plan)
        self._layout_final = True

    def build_from_plan(self, plan: BucketPlan) -> None:
        # Optimizer/scheduler state that the user loaded or edited before the layout was final
        # (through ddp._optims / _lr_schedulers) moves to the new buckets; otherwise the old blocks go
        # as each parameter moves to its new one.
        carry = [b for b in self.buckets if b.modified_by_user()]
        old = self.buckets if carry else []
        self.buckets = []
        had_grads = any(p.grad is not None for p in self.params)  # a rebuild, not construction
        sharded = self.intra is not None and self.intra.shards
        pad = self.intra.pad_multiple if self.intra is not None else 1
        # Stage 1, every bucket: parameters into their blocks, then the old storage goes back to
        # the OS before the other blocks are placed (peak: one extra copy of the parameters).
        flats = [flatten_params([self.params[i] for i in indices], self.param_as_bucket_view, pad)
                 for indices in plan.buckets]
        on_cpu = any(f.block.device.type == "cpu" for f in flats)
        if on_cpu:
            release_free_host_memory()
        for bi, (indices, flat) in enumerate(zip(plan.buckets, flats)):
            names = [self.names[i] for i in indices]
            opt = self.optim_fn(list(zip(names, flat.params)))
            check_optimizer(opt, flat.params, names, f"for bucket {bi}")
            if self.comm is not None and hasattr(opt, "pre_average_hook") != (self.hook_edges is not None):
                raise ValueError(
                    f"optim_fn returned an optimizer {'with' if self.hook_edges is None else 'without'} "
                    f"pre_average_hook for bucket {bi} after the first iteration regrouped the buckets, unlike at "
                    "construction; it must return the same kind of optimizer every time")
            opt = fuse_torch_optimizer(opt)
            sched = self.scheduler_fn(opt) if self.scheduler_fn is not None else None
            if old:
                carry_over_state(old, opt, sched)
            shard = self.intra.shard_range(flat.block.numel()) if sharded and self.intra is not None else None
            bucket = make_bucket(bi, flat, names, opt, sched, shard=shard)
            for slot, i in enumerate(indices):
                self._bucket_of[i] = bi
                self._slot_of[i] = slot
            self.buckets.append(bucket)
        del old, carry
        if on_cpu and had_grads:
            release_free_host_memory()  # the gradients' former storage

    @property
    def plan(self) -> Optional[BucketPlan]:
        if not self.buckets:
            return None
        index = {id(p): i for i, p in enumerate(self.params)}
        return BucketPlan([[index[id(p)] for p in b.params] for b in self.buckets])

    # -- the per-bucket work -----------------------------------------------------------------
    def wait_exchange(self, b: Bucket) -> None:
        if b.work is not None:
            work, b.work = b.work, None
            work.wait(self.timeout)  # type: ignore[attr-defined]
            b.comm_valid = True

    def wait_all(self) -> None:
        for b in self.buckets:
            self.wait_exchange(b)
        self.wait_gathers()

    def wait_gathers(self) -> None:
        """The node's all-gathers of the updated shards (intra_node='shard'): before the parameters
        are used again."""
        for b in self.buckets:
            work = self._gathers.pop(b.index, None)
            if work is not None and self.intra is not None:
                self.intra.wait(work, f"the node's all-gather of bucket {b.index}'s updated shards")
                b.scatter_params()  # param_as_bucket_view=False: the parameters follow the block

    def _process(self, b: Bucket, local_step: bool = True) -> None:
        """Wait, plan, step (unless ``local_step`` is False: a joined worker), launch the next exchange.

        With intra_node the bucket's gradient reduction over the node starts here, and the bucket
        finishes (wait, mix, step, exchange) when the next bucket is processed or the iteration ends:
        the reduction runs while autograd computes the next bucket's gradients."""
        if self.intra is None:
            if local_step:
                b.adopt_grads()  # every gradient in grad_block before its norm is taken
            self._finish(b, local_step)
            return
        if local_step:
            b.adopt_grads()
        else:  # a joined rank: its node steps while any of its ranks has data
            count = self.intra.count()
            local_step = count is not None and float(count) > 0  # host read: joined ranks only
        reduction = self.intra.start_reduction(b.grad_block, b.grad) if local_step else None
        previous, self._deferred = self._deferred, (b, local_step, reduction)
        if previous is not None:
            self._finish(*previous)

    def _flush(self) -> None:
        """Finish the bucket whose gradient reduction is still in flight (intra_node)."""
        if self._deferred is not None:
            previous, self._deferred = self._deferred, None
            self._finish(*previous)

    def _finish(self, b: Bucket, local_step: bool, reduction: Optional[Any] = None) -> None:
        self.wait_exchange(b)
        received, nxt = self.plans.at(self.step), self.plans.at(self.step + 1)
        recv: Optional[Tensor] = None
        a, c = 1.0, 0.0
        if received.mixes and not b.skip_mix:
            if not b.comm_valid:
                raise RuntimeError(f"internal error: bucket {b.index} has no exchange to mix at step {self.step}")
            self._pre_average_hook(b, received.group)
            recv = b.comm
            a, c = received.mix_coefficients(self.adaptive_factor)
        reduce_sq = None
        if self.intra is not None and local_step:
            self.intra.finish_reduction(reduction, b.grad_block, b.grad)
            reduce_sq = self.intra.squared_norm if self.intra.shards else None
        grads = self.grad_scaling.bucket_args(b.index, b.grad, reduce_sq) if local_step else UNSCALED
        b.step(recv, a, c, nxt.send_scale(), grads, local_step)
        b.comm_valid = False
        b.skip_mix = False
        assert self.comm is not None, "internal error: the reducer has no communicator (attach() first)"
        b.work = nxt.launch(self.comm, b.index, b.param, b.comm)
        if self.intra is not None and self.intra.shards:
            self._gathers[b.index] = self.intra.gather_params(b.param_block, b.param)

    def _pre_average_hook(self, b: Bucket, group: Group) -> None:
        """decent-dp's extension point: ``optimizer.pre_average_hook(edge, weight)`` right before the
        bucket mixes with ``group`` (after its exchange completed, before the optimizer step)."""
        hook = getattr(b.optimizer, "pre_average_hook", None)
        if hook is None:
            return
        assert self.hook_edges is not None  # build_from_plan refuses such optimizers otherwise
        edge = self.hook_edges[(group.ranks, group.weight)]
        hook(edge, edge.weight)

    @torch.no_grad()
    def shadow_iteration(self) -> None:
        """One iteration of a joined rank: every bucket waits, mixes and re-sends, in order."""
        if not self._layout_final:
            raise RuntimeError(
                f"rank {self.rank} joined before its first training iteration; every rank needs at least one "
                "iteration (which fixes the bucket layout) before it runs out of data")
        self.prepare()
        if self.intra is not None:
            self.intra.begin_count(False, self.params[0].device)
        self.grad_scaling.begin_iteration()
        for b in self.buckets:
            self._process(b, local_step=False)
        self._flush()
        # with intra_node a joined rank may step its shard for its node (zero for everyone else)
        skipped = self.grad_scaling.end_iteration()
        for b in self.buckets:
            b.finish_iteration(skipped.get(b.index))
        if self.intra is not None:
            self.intra.end_iteration()
        self.step += 1
        self._prepared = False

    # -- whole-model operations --------------------------------------------------------------
    def mark_equal(self) -> None:
        """All workers hold the same parameters: the next mix is the identity."""
        for b in self.buckets:
            b.skip_mix = True
