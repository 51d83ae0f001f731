"""Buckets: which parameters travel and step together, and their flat storage.

A :class:`BucketPlan` assigns parameters (in gradient-ready order) to buckets with the
extension's greedy packer; :class:`Bucket` owns one bucket's flat blocks (parameters, gradients,
the exchange buffer), its optimizer and scheduler, and the per-iteration bookkeeping that the
reducer needs. Parameters and their gradients become views into the flat blocks, so one kernel
pass covers the whole bucket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from . import _C
from .optim import MAX_GROUPS_PER_BUCKET, FusedOptimizer

logger = logging.getLogger(__name__)

ALIGN_BYTES = 128  # every tensor starts on a 128-byte boundary inside its bucket


@dataclass
class BucketPlan:
    """Bucket assignment: ``buckets[i]`` lists parameter indices in gradient-ready order."""

    buckets: List[List[int]]

    @classmethod
    def build(cls, params: Sequence[Tensor], order: Sequence[int], cap_bytes: int) -> "BucketPlan":
        keys: Dict[Tuple[torch.dtype, torch.device], int] = {}
        key_ids = [keys.setdefault((params[i].dtype, params[i].device), len(keys)) for i in order]
        sizes = [params[i].numel() * params[i].element_size() for i in order]
        assignment = _C.assign_buckets(sizes, key_ids, int(cap_bytes))
        return cls([[order[j] for j in bucket] for bucket in assignment])


@dataclass
class Bucket:
    """One bucket: flat storage, optimizer, and the state of its exchange."""

    index: int
    params: List[Tensor]
    names: List[str]
    offsets: List[int]
    param_block: Tensor
    grad_block: Tensor
    comm: Tensor                      # receive buffer (pairs) / in-place reduce buffer (groups)
    param_views: List[Tensor]         # views of param_block, one per parameter
    grad_views: List[Tensor]
    optimizer: Optimizer
    scheduler: Optional[LRScheduler]
    segments: Tensor                  # [nseg, 3] (begin, end, group) on the bucket's device
    fused: bool
    params_are_views: bool
    # exchange state
    work: Optional[object] = None     # in-flight exchange (decentpy.comm.Exchange)
    comm_valid: bool = False          # comm holds a completed exchange for the next mix
    skip_mix: bool = True             # workers are known equal: the next mix is the identity
    # per-iteration bookkeeping
    pending: int = 0
    processed: bool = False
    seen: List[bool] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.param_block.numel()

    def reset_iteration(self) -> None:
        self.pending = len(self.params)
        self.processed = False
        self.seen = [False] * len(self.params)

    @torch.no_grad()
    def gather_params(self) -> None:
        """Copy separate parameters into the flat block (``param_as_bucket_view=False``)."""
        if not self.params_are_views:
            torch._foreach_copy_(self.param_views, [p.detach() for p in self.params])

    @torch.no_grad()
    def scatter_params(self) -> None:
        if not self.params_are_views:
            torch._foreach_copy_([p.detach() for p in self.params], self.param_views)

    @torch.no_grad()
    def adopt_grads(self) -> None:
        """Make every ``.grad`` a view of the flat gradient block again.

        Users may set gradients to ``None`` (``zero_grad()``) or replace them; the new values are
        copied in so that nothing is lost.
        """
        for i, (p, view) in enumerate(zip(self.params, self.grad_views)):
            g = p.grad
            if g is None:
                view.zero_()
                p.grad = view
            elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
                if g.is_sparse:
                    raise RuntimeError(f"parameter '{self.names[i]}' got a sparse gradient; decentpy needs dense ones")
                view.copy_(g)
                p.grad = view


def _segments_for(optimizer: Optimizer, params: Sequence[Tensor], offsets: Sequence[int], total: int,
                  device: torch.device) -> Tensor:
    """Runs of consecutive parameters sharing an optimizer param group, covering [0, total)."""
    group_of = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi
    rows: List[List[int]] = []
    for i, p in enumerate(params):
        begin = offsets[i]
        end = offsets[i + 1] if i + 1 < len(params) else total
        gi = group_of[id(p)]
        if rows and rows[-1][2] == gi:
            rows[-1][1] = end
        else:
            rows.append([begin, end, gi])
    return torch.tensor(rows, dtype=torch.int64, device=device)


def check_optimizer(opt: object, params: Sequence[Tensor], names: Sequence[str], where: str) -> None:
    """``optim_fn`` must return an optimizer over exactly the parameters it was given."""
    if not isinstance(opt, Optimizer):
        raise TypeError(f"optim_fn must return a torch.optim.Optimizer, got {type(opt).__name__} {where}")
    given = {id(p): n for p, n in zip(params, names)}
    seen: Dict[int, int] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) not in given:
                raise ValueError(f"optim_fn returned an optimizer over a parameter it was not given {where} "
                                 f"(shape {tuple(p.shape)}); it must optimise exactly the parameters passed to it")
            seen[id(p)] = seen.get(id(p), 0) + 1
    missing = [n for p, n in zip(params, names) if id(p) not in seen]
    if missing:
        raise ValueError(f"optim_fn returned an optimizer that leaves out parameter '{missing[0]}' {where}; "
                         "it must optimise every parameter passed to it")
    twice = [given[k] for k, c in seen.items() if c > 1]
    if twice:
        raise ValueError(f"optim_fn returned an optimizer with parameter '{twice[0]}' in several groups {where}")


@torch.no_grad()
def make_bucket(index: int, params: List[Tensor], names: List[str], optimizer: Optimizer,
                scheduler: Optional[LRScheduler], param_as_bucket_view: bool) -> Bucket:
    """Flatten ``params`` into a bucket (parameters and gradients become views when asked)."""
    elem = params[0].element_size()
    offsets, total = _C.aligned_offsets([p.numel() for p in params], elem, ALIGN_BYTES)
    param_block, param_views = _C.make_flat_block([p.detach() for p in params], offsets, total, True)
    grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in params]
    for g, n in zip(grads, names):
        if g.is_sparse:
            raise RuntimeError(f"parameter '{n}' got a sparse gradient; decentpy needs dense gradients")
    grad_block, grad_views = _C.make_flat_block(grads, offsets, total, True)
    # Views must have the parameter's own layout (channels_last kept).
    grad_views = [gv if gv.stride() == p.stride() else grad_block.as_strided(p.size(), p.stride(), o)
                  for gv, p, o in zip(grad_views, params, offsets)]
    if param_as_bucket_view:
        for p, v in zip(params, param_views):
            p.data = v
    for p, gv in zip(params, grad_views):
        p.grad = gv
    fused = isinstance(optimizer, FusedOptimizer) and len(optimizer.param_groups) <= MAX_GROUPS_PER_BUCKET
    segments = _segments_for(optimizer, params, offsets, total, param_block.device)
    comm = torch.zeros_like(param_block)
    bucket = Bucket(index=index, params=params, names=names, offsets=list(offsets), param_block=param_block,
                    grad_block=grad_block, comm=comm, param_views=param_views, grad_views=grad_views,
                    optimizer=optimizer, scheduler=scheduler, segments=segments, fused=fused,
                    params_are_views=param_as_bucket_view)
    bucket.reset_iteration()
    logger.debug("bucket %d: %d params, %d elements, %s, %s, fused=%s", index, len(params), total,
                 param_block.dtype, param_block.device, fused)
    return bucket
