"""The gossip wrappers' buckets: which parameters share a bucket, their flat storage and optimizers.

Buckets are built at construction, in reverse registration order (as DDP does), so parameters live
in the flat blocks from the start, and each gradient of the first backward is copied into its
gradient block as it arrives (and freed): no iteration holds a second copy of the model. The first
backward also records the gradient-ready order (the driver traces it); at its end the layout is
rebuilt only if that order packs the parameters into different buckets (or a parameter was given
new storage, dtype or device since construction).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..comm import CommGroup, first_difference_across_ranks
from ..host_memory import release_free_host_memory
from ..optim import fuse_torch_optimizer
from . import ownership
from .bucket import Bucket, BucketPlan, carry_over_state, check_optimizer, flatten_params, make_bucket
from .strategy import Readiness

logger = logging.getLogger(__name__)

OptimFn = Callable[[List[Tuple[str, Tensor]]], Optimizer]
SchedulerFn = Callable[[Optimizer], LRScheduler]
#: what a rank steps of a bucket of ``numel`` elements: None (all of it) or a shard ``(lo, hi)``
ShardFn = Callable[[int], Optional[Tuple[int, int]]]


def _build_scheduler(scheduler_fn: Optional[Callable[[Any], Any]], opt: Any, bucket: int) -> Any:
    """``scheduler_fn(opt)``; a TypeError from it (torch's scheduler classes take more than the
    optimizer) says how to give the other arguments."""
    if scheduler_fn is None:
        return None
    try:
        return scheduler_fn(opt)
    except TypeError as exc:
        name = getattr(scheduler_fn, "__name__", type(scheduler_fn).__name__)
        raise TypeError(f"lr_scheduler_fn={name} failed on bucket {bucket}'s optimizer ({exc}): it is called with the "
                        "optimizer alone; give the other arguments with functools.partial, e.g. "
                        "lr_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=100)") from exc


class BucketLayout:
    """The buckets over ``params``, their optimizers and schedulers, and the layout's history."""

    def __init__(self, params: List[Tensor], names: List[str], optim_fn: OptimFn, scheduler_fn: Optional[SchedulerFn],
                 bucket_cap_bytes: int, param_as_bucket_view: bool, group: CommGroup, pad_multiple: int = 1,
                 shard_of: Optional[ShardFn] = None) -> None:
        """Local only (no collective): builds the buckets and their optimizers. ``pad_multiple`` and
        ``shard_of``: the strategy's (each bucket's element count is padded to a multiple of
        ``pad_multiple``; ``shard_of(numel)`` is the part of it this rank steps)."""
        self.params = params
        self.names = names
        # decentpy steps these inside the backward: a torch optimizer's step() on them is refused
        self.claim = ownership.claim(params, names)
        self.optim_fn = optim_fn
        self.scheduler_fn = scheduler_fn
        self.bucket_cap_bytes = bucket_cap_bytes
        self.param_as_bucket_view = param_as_bucket_view
        self.group = group
        self.pad_multiple = pad_multiple
        self.shard_of = shard_of
        #: whether every bucket's optimizer must define pre_average_hook (set once the wrapper decided)
        self.pre_average_hook: Optional[bool] = None
        self.buckets: List[Bucket] = []
        self.bucket_of: List[int] = [-1] * len(params)
        self.slot_of: List[int] = [-1] * len(params)
        self.final = False  # the layout has been checked against the traced order
        self._readiness: Optional[Readiness] = None
        self.build(BucketPlan.build(params, list(reversed(range(len(params)))), bucket_cap_bytes))

    def readiness(self) -> Optional[Readiness]:
        """The buckets' members for the driver; None until the layout is final."""
        return self._readiness if self.final else None

    def has_pre_average_hook(self) -> bool:
        """Whether the buckets' optimizers define decent-dp's ``pre_average_hook`` (all or none)."""
        found = {hasattr(b.optimizer, "pre_average_hook") for b in self.buckets}
        if len(found) > 1:
            raise ValueError("optim_fn returned optimizers with pre_average_hook for some buckets and without for "
                             "others; it must return the same kind of optimizer every time")
        return found == {True}

    def moved_check(self) -> None:
        """Once the layout is final, every parameter must still live in its bucket."""
        if not self.final:
            return
        for b in self.buckets:
            moved = b.moved_param()
            if moved is not None:
                raise RuntimeError(
                    f"parameter '{moved}' no longer lives in decentpy's bucket {b.index}: its storage, dtype or "
                    f"device changed after the first training iteration (model.to(), .double(), .half(), or a "
                    f"new .data); move or cast the model before wrapping it, or before its first training "
                    f"iteration")

    def release(self) -> None:
        """The wrapper is closed: its parameters are no longer stepped inside the backward."""
        ownership.release(self.claim)

    def settle(self, traced: Sequence[int]) -> None:
        """After the first backward: keep the construction layout unless the traced order differs."""
        seen = set(traced)
        unused = [i for i in reversed(range(len(self.params))) if i not in seen]
        order = list(traced) + unused
        self._check_same_order(order)
        plan = BucketPlan.build(self.params, order, self.bucket_cap_bytes)
        if not self._holds(plan):
            # Costs one extra copy of the parameters and gradients, once; only for models whose
            # gradients arrive in an order other than reverse registration (or that were given new
            # storage after wrapping).
            self.build(plan)
            logger.debug("rank %d: buckets rebuilt in gradient-ready order", self.group.rank)
        self.final = True
        # Once per job: rank 0 of the group at INFO, every other rank at DEBUG.
        logger.log(logging.INFO if self.group.rank == 0 else logging.DEBUG,
                   "rank %d: %d buckets (%s), %d parameters without gradient in the first iteration",
                   self.group.rank, len(self.buckets), ", ".join(str(b.numel) for b in self.buckets), len(unused))

    def _holds(self, plan: BucketPlan) -> bool:
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

    def adopt(self, plan: BucketPlan) -> None:
        """Use a saved layout (a checkpoint's); only before the first iteration fixed one."""
        if self.final:
            if self.plan is None or self.plan.buckets != plan.buckets:
                raise ValueError("checkpoint bucket layout differs from this run's; use the same model and "
                                 "bucket_size_in_mb")
            return
        if self.plan is None or self.plan.buckets != plan.buckets or not all(b.layout_intact() for b in self.buckets):
            self.build(plan)
        self.final = True

    def build(self, plan: BucketPlan) -> None:
        # Optimizer/scheduler state that the user loaded or edited before the layout was final
        # (through ddp._optims / _lr_schedulers) moves to the new buckets; otherwise the old blocks go
        # as each parameter moves to its new one.
        carry = [b for b in self.buckets if b.modified_by_user()]
        old = self.buckets if carry else []
        self.buckets = []
        had_grads = any(p.grad is not None for p in self.params)  # a rebuild, not construction
        # Stage 1, every bucket: parameters into their blocks, then the old storage goes back to
        # the OS before the other blocks are placed (peak: one extra copy of the parameters).
        flats = [flatten_params([self.params[i] for i in indices], self.param_as_bucket_view, self.pad_multiple)
                 for indices in plan.buckets]
        on_cpu = any(f.block.device.type == "cpu" for f in flats)
        if on_cpu:
            release_free_host_memory()
        for bi, (indices, flat) in enumerate(zip(plan.buckets, flats)):
            names = [self.names[i] for i in indices]
            opt = self.optim_fn(list(zip(names, flat.params)))
            check_optimizer(opt, flat.params, names, f"for bucket {bi}")
            if self.pre_average_hook is not None and hasattr(opt, "pre_average_hook") != self.pre_average_hook:
                raise ValueError(
                    f"optim_fn returned an optimizer {'without' if self.pre_average_hook else 'with'} "
                    f"pre_average_hook for bucket {bi} after the first iteration regrouped the buckets, unlike at "
                    "construction; it must return the same kind of optimizer every time")
            opt = fuse_torch_optimizer(opt)
            sched = _build_scheduler(self.scheduler_fn, opt, bi)
            if old:
                carry_over_state(old, opt, sched)
            shard = self.shard_of(flat.block.numel()) if self.shard_of is not None else None
            self.buckets.append(make_bucket(bi, flat, names, opt, sched, shard=shard))
            for slot, i in enumerate(indices):
                self.bucket_of[i] = bi
                self.slot_of[i] = slot
        del old, carry
        self._readiness = Readiness.of(plan.buckets, len(self.params))
        if on_cpu and had_grads:
            release_free_host_memory()  # the gradients' former storage

    @property
    def plan(self) -> Optional[BucketPlan]:
        if not self.buckets:
            return None
        index = {id(p): i for i, p in enumerate(self.params)}
        return BucketPlan([[index[id(p)] for p in b.params] for b in self.buckets])
