"""Buckets: which parameters travel and step together, and their flat storage.

A :class:`BucketPlan` assigns parameters (in gradient-ready order) to buckets with the
extension's greedy packer; :class:`Bucket` owns one bucket's flat blocks (parameters, gradients),
its optimizer and scheduler, the part of it this rank steps and exchanges (elements ``[lo, hi)``:
the whole bucket, or a shard of it) with that part's exchange buffer, and one step path over that
part. Parameters and their gradients become views into the flat blocks, so one kernel pass covers
the part.
"""

from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..optim import kernels
from . import ownership
from ..optim.grad_scaling import UNSCALED, BucketGradScaling, GradArgs
from ..optim.fused import MAX_GROUPS_PER_BUCKET, FusedOptimizer, mark_stepped

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
        assignment = kernels.assign_buckets(sizes, key_ids, int(cap_bytes))
        return cls([[order[j] for j in bucket] for bucket in assignment])


@dataclass
class Bucket:
    """One bucket: flat storage, optimizer, and the state of its exchange.

    What this rank steps and exchanges is elements ``[lo, hi)`` of the flat blocks: the whole
    bucket ``[0, numel)``, stepped by the bucket's optimizer over the parameters themselves, or a
    shard of it (``intra_node='shard'``: :func:`make_bucket` with ``shard=``), stepped by an
    optimizer of the bucket optimizer's class over the parameters' 1-D pieces in that range, whose
    hyper-parameters follow the bucket's optimizer (the one the user and the scheduler see)."""

    index: int
    params: List[Tensor]
    names: List[str]
    offsets: List[int]
    param_block: Tensor
    grad_block: Tensor
    param_views: List[Tensor]         # views of param_block, one per parameter
    grad_views: List[Tensor]
    optimizer: Optimizer
    scheduler: Optional[LRScheduler]
    params_are_views: bool
    # the part this rank steps and exchanges: elements [lo, hi) of the blocks
    lo: int
    hi: int
    whole: bool                       # [0, numel), stepped over the parameters themselves (not pieces)
    param: Tensor                     # param_block[lo:hi]
    grad: Tensor                      # its gradient: grad_block[lo:hi], or the node's mean in a buffer of its own
    comm: Tensor                      # receive buffer (pairs) / in-place reduce buffer (groups) of [lo, hi)
    pieces: List[Tensor]              # what state_optimizer steps (empty: the shard holds alignment padding only)
    piece_offsets: List[int]          # of the pieces inside [lo, hi)
    state_optimizer: Optimizer        # holds this rank's state (the bucket's optimizer unless sharded)
    segments: Optional[Tensor]        # [nseg, 3] (begin, end, group) of [lo, hi) on the bucket's device
    fused: bool
    # exchange state
    work: Optional[object] = None     # in-flight exchange (decentpy.comm.Exchange)
    comm_valid: bool = False          # comm holds a completed exchange for the next mix
    skip_mix: bool = True             # workers are known equal: the next mix is the identity
    stepped: Optional[bool] = None    # a local step ran: None (no), or whether it was skipped (host view)
    exchange_state: Optional[Any] = None  # what the strategy's exchange keeps for this bucket (compressed: copies)
    # gradients: consumed by the last step (the next backward must not accumulate into them), and
    # the squared norms of the gradients copied in this iteration (see adopt_grad)
    consumed: bool = False
    norm_partials: Optional[Tensor] = None  # [len(params), kernels.NORM_SLOTS] float32, or None
    partial_rows: List[Tensor] = field(default_factory=list)  # its rows, one per parameter
    no_grad_slots: int = 0            # parameters that got no gradient this iteration (bit mask)
    _no_update_segments: Dict[int, Tensor] = field(default_factory=dict)  # segment tables by that mask
    #: release consumed gradients before the next backward (see reset_iteration), and take the norm
    #: while copying them in (see track_grad_norms); off only to measure what each saves
    #: (bench/bench_overhead_cuda.py --ablations)
    release_consumed_grads: ClassVar[bool] = True
    #: off by default: on an H200 the default 'skip' path with the norm taken while copying measured
    #: 4.39, 4.15 and 3.85 ms per iteration in three runs, against 2.66 and 3.16 ms with the norm by a
    #: second pass (tools/gpu_notes.md, runs 3 and 4); why the combination costs is not known yet
    norm_while_copying: ClassVar[bool] = False
    partials_filled: int = 0          # slots whose row holds this iteration's gradient (bit mask)
    # what the optimizer and scheduler looked like when created (see modified_by_user)
    fresh_groups: List[Dict[str, Any]] = field(default_factory=list)
    fresh_scheduler: Optional[Dict[str, Any]] = None
    optimizer_loaded: bool = False

    def modified_by_user(self) -> bool:
        """The optimizer or scheduler was loaded or edited since the bucket was built (through
        ``ddp._optims`` / ``_lr_schedulers``): a layout rebuild must carry their state over."""
        if self.optimizer_loaded:
            return True
        if not _same(self.fresh_groups, _hyperparameters(self.optimizer)):
            return True
        return self.scheduler is not None and not _same(self.fresh_scheduler, self.scheduler.state_dict())

    @property
    def numel(self) -> int:
        return self.param_block.numel()

    def reset_iteration(self) -> None:
        """Before an iteration's forward. Gradients the last step consumed are released (``.grad``
        None, as torch's ``zero_grad()``): autograd then hands over each new gradient instead of
        adding it to zeros in place (a read of the zeros saved), and :meth:`adopt_grad` copies it in,
        taking its norm in the same pass when asked to."""
        self.stepped = None
        self.partials_filled = 0
        self.no_grad_slots = 0
        if self.consumed and self.release_consumed_grads:
            for p in self.params:
                p.grad = None
            self.consumed = False

    def track_grad_norms(self) -> None:
        """Take each gradient's squared norm while copying it into the block (see
        :meth:`copied_grad_norm`)."""
        if self.norm_partials is None:
            self.norm_partials = torch.zeros(len(self.params), kernels.NORM_SLOTS, dtype=torch.float32,
                                             device=self.grad_block.device)
            self.partial_rows = list(self.norm_partials.unbind(0))

    def copied_grad_norm(self) -> Optional[Tensor]:
        """The whole block's gradient norm (a one-element float32 tensor on its device) when every
        gradient was copied in this iteration with its norm taken (:meth:`track_grad_norms`): no
        second pass over the gradients. None otherwise (e.g. one accumulated in place, no_sync)."""
        if self.norm_partials is None or self.partials_filled != (1 << len(self.params)) - 1:
            return None
        return self.norm_partials.sum().sqrt_().reshape(1)

    @torch.no_grad()
    def step(self, recv: Optional[Tensor], mix_a: float, mix_b: float, send_scale: Optional[float],
             grads: GradArgs, local_step: bool, compressed: Optional[Any] = None,
             prev_skip: Optional[Tensor] = None, no_update: int = 0, mix_factor: Optional[Tensor] = None,
             mix_guard: float = 0.0, mix_guarded: Optional[Tensor] = None) -> None:
        """Mix ``recv`` into ``[lo, hi)`` (``p <- mix_a p + mix_b recv``; none when ``recv`` is None),
        take the local optimizer step on ``grad`` (unless ``local_step`` is False: a joined worker,
        or a shard of padding only), zero the gradient, and, with ``send_scale``, write
        ``send_scale * p`` into ``comm`` as the next buffer to send. The step counter and scheduler
        move in :meth:`finish_iteration`. The caller has made every gradient a view of
        ``grad_block`` first (:meth:`adopt_grads`). ``compressed``: a
        :class:`~decentpy.optim.CompressedPass` (compressed gossip; ``recv`` is then None and
        ``send_scale`` None: the pass's own buffers carry the exchange). ``prev_skip``: the last
        update's outcome is only on the device (see ``FusedOptimizer.bucket_step``). ``no_update``:
        a bit mask of parameters (of a whole bucket) that got no gradient: mixed and sent, but not
        updated, as torch's optimizers skip a parameter whose ``.grad`` is None. ``mix_factor``: the
        peer check's verdict on ``recv`` as a one-element float32 tensor on the bucket's device
        (csrc/kernels/mix_and_step.h: 1 mixes as given, 0 leaves ``recv`` unread, between scales the
        peer's difference); ``mix_guard``: the check's element guard (an element whose change is not within
        it keeps its value), counted into ``mix_guarded``."""
        send = self.comm if send_scale is not None else None
        scale = 1.0 if send_scale is None else send_scale
        if not self.params_are_views:
            self.gather_params()
        if self.state_optimizer is not self.optimizer:
            _follow(self.state_optimizer, self.optimizer)
        if not self.pieces:  # alignment padding only: nothing to update
            local_step, grads = False, UNSCALED
        no_update = no_update if self.whole and local_step else 0
        if self.fused:
            # zero_grad: the kernel zeroes the gradient in the same pass (also when the update is skipped,
            # so the next iteration never sees skipped, non-finite gradients): no separate zero_() pass.
            self.state_optimizer.bucket_step(self.pieces, self.piece_offsets,  # type: ignore[attr-defined]
                                             self.param, self.grad, self.segments_without(no_update), recv, send,
                                             mix_a, mix_b, scale, grads if local_step else UNSCALED, not local_step,
                                             zero_grad=True, prev_skip=prev_skip, no_update_group=bool(no_update),
                                             **({"compressed": compressed} if compressed is not None else {}),
                                             **({"mix_factor": mix_factor} if mix_factor is not None else {}),
                                             **({"mix_guard": mix_guard, "mix_guarded": mix_guarded}
                                                if mix_guard > 0 else {}))
            if self.whole and not self.params_are_views:
                self.scatter_params()
            self.stepped = False if local_step else None
            self.consumed = True
            return
        if compressed is not None or prev_skip is not None:
            raise RuntimeError(f"internal error: bucket {self.index} is not fused but compressed gossip or a "
                               "deferred verdict needs the fused kernel")
        self._generic_step(recv, mix_a, mix_b, send, scale, grads, local_step, no_update, mix_factor, mix_guard,
                           mix_guarded)
        self.consumed = True

    def segments_without(self, no_update: int) -> Optional[Tensor]:
        """The kernel's segment table with the parameters of the ``no_update`` mask in the extra
        group that is not updated (cached per mask: the same parameters usually go without a
        gradient every iteration, and a new table is a copy to the device)."""
        if not no_update:
            return self.segments
        table = self._no_update_segments.get(no_update)
        if table is None:
            table = _segments_for(self.state_optimizer, self.pieces, self.piece_offsets, self.hi - self.lo,
                                  self.param.device, no_update)
            self._no_update_segments[no_update] = table
        return table

    def _generic_step(self, recv: Optional[Tensor], mix_a: float, mix_b: float, send: Optional[Tensor],
                      send_scale: float, grads: GradArgs, local_step: bool, no_update: int = 0,
                      mix_factor: Optional[Tensor] = None, mix_guard: float = 0.0,
                      mix_guarded: Optional[Tensor] = None) -> None:
        """Optimizers the kernel does not implement: a separate mix, then their own ``step()``."""
        param, grad = self.param, self.grad
        follow = self.whole and not self.params_are_views  # the optimizer steps the separate parameters
        kernel = param.dtype in kernels.KERNEL_DTYPES  # float64 mixes with torch ops
        if recv is not None:
            if kernel:
                kernels.mix(param, recv, mix_a, mix_b, mix_factor=mix_factor, mix_guard=mix_guard,
                            mix_guarded=mix_guarded)
            elif mix_factor is None and mix_guard <= 0:
                param.mul_(mix_a).add_(recv, alpha=mix_b)
            else:  # the peer check's factor and guard (kernels/update.h peer_mix), with torch ops
                f = mix_factor.to(param.dtype) if mix_factor is not None else torch.ones(1, dtype=param.dtype,
                                                                                      device=param.device)
                keep = ~(f > 0)
                a = torch.where(keep, torch.ones_like(f), torch.where(f >= 1, torch.full_like(f, mix_a),
                                                                        mix_a + mix_b * (1 - f)))
                b = torch.where(keep | (f >= 1), torch.full_like(f, mix_b), mix_b * f)
                mixed = torch.where(keep, param, param * a + recv * b)
                if mix_guard > 0:
                    bad = ~((mixed - param).abs() <= mix_guard)
                    if mix_guarded is not None:
                        mix_guarded.add_(bad.sum())
                    mixed = torch.where(bad, param, mixed)
                param.copy_(mixed)
        if follow:
            self.scatter_params()
        skip = True
        if local_step:
            # Whether to call step() at all must be known here: with a scaler or clipping this reads
            # the gradient norm back (a sync on a GPU; fused optimizers avoid it).
            factor, skip = BucketGradScaling.host_factor(grads)
            if not skip:
                if factor != 1.0:
                    grad.mul_(factor)
                without = [p for i, p in enumerate(self.params) if no_update >> i & 1]
                for p in without:  # torch's optimizers skip a parameter whose .grad is None
                    p.grad = None
                try:
                    self.state_optimizer.step()
                finally:
                    for p in without:
                        p.grad = self.grad_views[self.params.index(p)]
                if follow:
                    self.gather_params()
            self.stepped = skip
        if send is not None:
            if kernel:
                kernels.scale_copy(send, param, send_scale)
            else:
                torch.mul(param, send_scale, out=send)
        grad.zero_()

    def take_stepped(self) -> Optional[bool]:
        """At the end of the iteration: what :meth:`step` left for :meth:`finish_iteration` (None: no
        update was attempted; else whether the host already knows it was skipped), cleared."""
        stepped, self.stepped = self.stepped, None
        return stepped

    def finish_iteration(self, stepped: Optional[bool], skipped: Optional[bool]) -> None:
        """Count the step and advance the scheduler if the update happened. ``stepped``: from
        :meth:`take_stepped`; ``skipped``: the device's verdict (gradient norm not finite), when
        the kernel decided."""
        if stepped is None:
            return
        updated = not (stepped if skipped is None else skipped)
        if self.fused:
            self.state_optimizer.finish_bucket_step(updated)  # type: ignore[attr-defined]
        if self.state_optimizer is not self.optimizer:
            mark_stepped(self.optimizer)  # the optimizer its scheduler drives stepped through the shard's
        if updated and self.scheduler is not None:
            self.scheduler.step()

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
    def adopt_grad(self, slot: int, strict: bool = True) -> None:
        """Make ``params[slot].grad`` a view of the flat gradient block again.

        Autograd accumulates in place into a gradient that is already a view; a gradient that is
        not (``None`` after ``zero_grad()``, or replaced by the user) is copied in, so nothing is
        lost and the separate tensor is freed right away.
        """
        p, view = self.params[slot], self.grad_views[slot]
        g = p.grad
        if g is view:
            return
        if p.dtype != view.dtype or p.device != view.device:
            # Moved or cast after wrapping: before the layout is final the reducer rebuilds the
            # buckets from the parameters as they are now; afterwards this cannot be repaired.
            if strict:
                raise RuntimeError(
                    f"parameter '{self.names[slot]}' is now {p.dtype} on {p.device}, but its bucket holds "
                    f"{view.dtype} on {view.device}: move or cast the model before wrapping it, or before "
                    "its first training iteration")
            return
        partials = self.norm_partials
        if g is None:
            self.no_grad_slots |= 1 << slot
            view.zero_()
            if partials is not None:
                partials[slot].zero_()
                self.partials_filled |= 1 << slot
        elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
            if g.is_sparse:
                raise RuntimeError(f"parameter '{self.names[slot]}' got a sparse gradient; decentpy needs dense ones")
            if partials is not None and g.dtype == view.dtype and g.is_contiguous() and view.is_contiguous():
                # one pass: the copy and the gradient's squared norm (the bucket's norm needs no second read);
                # cheap on the host too (this runs for every parameter inside the backward)
                kernels.scale_copy(view.view(-1), g.view(-1), 1.0, sumsq=self.partial_rows[slot])
                self.partials_filled |= 1 << slot
            else:
                view.copy_(g)
        p.grad = view

    def adopt_grads(self) -> None:
        """Every gradient a view of ``grad_block`` (those whose hook did not fire this iteration:
        unused parameters; the others are views already)."""
        for slot, (p, view) in enumerate(zip(self.params, self.grad_views)):
            if p.grad is not view:
                self.adopt_grad(slot)

    def _param_left(self, slot: int) -> bool:
        """The parameter no longer has its view's dtype/device or (views on) its storage."""
        p, pv = self.params[slot], self.param_views[slot]
        if p.dtype != pv.dtype or p.device != pv.device:
            return True
        return self.params_are_views and p.data_ptr() != pv.data_ptr()

    def moved_param(self) -> Optional[str]:
        """Name of the first parameter if it left this bucket (``model.to()``/``.double()`` swap the
        storage of every parameter, so one check per bucket catches them), else None."""
        gv = self.grad_views[0]
        if self._param_left(0) or gv.dtype != self.grad_block.dtype or gv.device != self.grad_block.device:
            return self.names[0]  # (the gradient view itself has its data swapped by a cast)
        return None

    def layout_intact(self) -> bool:
        """Every parameter (when views are on) and gradient still lives in this bucket's blocks."""
        for slot, (p, pv, gv) in enumerate(zip(self.params, self.param_views, self.grad_views)):
            if self._param_left(slot) or (self.params_are_views and p.stride() != pv.stride()):
                return False
            g = p.grad
            if g is not None and (g.data_ptr() != gv.data_ptr() or g.stride() != gv.stride()):
                return False
        return True


def _follow(optimizer: Optimizer, leader: Optimizer) -> None:
    """``optimizer`` takes ``leader``'s current hyper-parameters (an LR scheduler steps the leader)."""
    for mine, theirs in zip(optimizer.param_groups, leader.param_groups):
        for k, v in theirs.items():
            if k != "params":
                mine[k] = v


def _hyperparameters(optimizer: Optimizer) -> List[Dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _same(a: Any, b: Any) -> bool:
    """Deep equality of state-dict-like values (tensors compared by value)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def carry_over_state(old: Sequence[Bucket], optimizer: Optimizer, scheduler: Optional[LRScheduler]) -> None:
    """Move per-parameter optimizer state, group hyperparameters and scheduler state from the
    buckets of an old layout into a new bucket's fresh ``optimizer`` and ``scheduler``.

    Each new parameter group takes the hyperparameters of the old group of its first parameter;
    the scheduler takes the state of the old scheduler of its first parameter when both drive the
    same number of groups (else it stays fresh).
    """
    group_of: Dict[int, Dict[str, Any]] = {}
    owner: Dict[int, Bucket] = {}
    for b in old:
        for g in b.optimizer.param_groups:
            for p in g["params"]:
                group_of[id(p)] = g
                owner[id(p)] = b
    for g in optimizer.param_groups:
        src = group_of.get(id(g["params"][0]))
        if src is not None:
            g.update({k: v for k, v in src.items() if k != "params"})
        for p in g["params"]:
            b = owner.get(id(p))
            if b is not None and p in b.optimizer.state:
                optimizer.state[p] = dict(b.optimizer.state[p])  # fused: copied into new flat blocks
    first = owner.get(id(optimizer.param_groups[0]["params"][0]))
    if scheduler is not None and first is not None and first.scheduler is not None:
        if len(first.optimizer.param_groups) == len(optimizer.param_groups):
            scheduler.load_state_dict(first.scheduler.state_dict())


def _segments_for(optimizer: Optimizer, params: Sequence[Tensor], offsets: Sequence[int], total: int,
                  device: torch.device, no_update: int = 0) -> Tensor:
    """Runs of consecutive parameters sharing an optimizer param group, covering [0, total); the
    parameters of the ``no_update`` bit mask in one more group after the optimizer's (see
    ``FusedOptimizer.bucket_step``'s ``no_update_group``)."""
    group_of = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi
    rows: List[List[int]] = []
    for i, p in enumerate(params):
        begin = offsets[i]
        end = offsets[i + 1] if i + 1 < len(params) else total
        gi = len(optimizer.param_groups) if no_update >> i & 1 else group_of[id(p)]
        if rows and rows[-1][2] == gi:
            rows[-1][1] = end
        else:
            rows.append([begin, end, gi])
    table = torch.tensor(rows, dtype=torch.int64)
    kernels.check_segments(table, total, len(optimizer.param_groups) + (1 if no_update else 0))  # the GPU kernel trusts it
    return table.to(device)


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
        shown = ", ".join(f"'{n}'" for n in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(f"optim_fn returned an optimizer that leaves out {len(missing)} parameter(s) {where}: "
                         f"{shown}; it must optimise every parameter passed to it")
    twice = [given[k] for k, c in seen.items() if c > 1]
    if twice:
        raise ValueError(f"optim_fn returned an optimizer with parameter '{twice[0]}' in several groups {where}")


@dataclass
class FlatParams:
    """Parameters of one bucket moved (or copied) into a flat block: the first stage of a bucket."""

    params: List[Tensor]
    offsets: List[int]
    block: Tensor
    views: List[Tensor]
    as_views: bool


@torch.no_grad()
def flatten_params(params: List[Tensor], as_views: bool, pad_multiple: int = 1) -> FlatParams:
    """Copy ``params`` into one aligned block; with ``as_views`` they become views of it.

    Done for every bucket before any other block is allocated, so that the parameters' former
    storage can be returned to the OS (see :mod:`decentpy.host_memory`) before the gradient,
    exchange and optimizer blocks are placed.
    """
    elem = params[0].element_size()
    offsets, total = kernels.aligned_offsets([p.numel() for p in params], elem, ALIGN_BYTES)
    total = -(-total // pad_multiple) * pad_multiple  # equal shards (intra_node='shard')
    block, views = kernels.make_flat_block([p.detach() for p in params], offsets, total, True)
    if as_views:
        for p, v in zip(params, views):
            p.data = v
    return FlatParams(params, list(offsets), block, views, as_views)


@dataclass
class _Part:
    """What a bucket steps: see the fields of the same names in :class:`Bucket`."""

    lo: int
    hi: int
    whole: bool
    param: Tensor
    grad: Tensor
    pieces: List[Tensor]
    piece_offsets: List[int]
    state_optimizer: Optimizer
    segments: Optional[Tensor]


def _whole(params: List[Tensor], offsets: List[int], block: Tensor, grad_block: Tensor,
           optimizer: Optimizer) -> _Part:
    """The whole bucket ``[0, numel)``, stepped by its own optimizer over the parameters."""
    total = block.numel()
    return _Part(0, total, True, block, grad_block, params, offsets, optimizer,
                 _segments_for(optimizer, params, offsets, total, block.device))


def _shard(params: List[Tensor], views: List[Tensor], offsets: List[int], block: Tensor, lo: int, hi: int,
           optimizer: Optimizer) -> _Part:
    """Elements ``[lo, hi)``: the pieces of the parameters in that range (1-D views of the block)
    under an optimizer of ``optimizer``'s class and parameter groups, and a gradient buffer of its
    own (the node's mean gradient of the range)."""
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    per_group: List[List[Tensor]] = [[] for _ in optimizer.param_groups]
    pieces: List[Tensor] = []
    piece_offsets: List[int] = []
    for p, view, off in zip(params, views, offsets):
        a, e = max(lo, off), min(hi, off + p.numel())
        if a >= e:
            continue
        piece = kernels.flat_alias(view)[a - off:e - off]
        pieces.append(piece)
        piece_offsets.append(a - lo)
        per_group[group_of[id(p)]].append(piece)
    param = block[lo:hi]
    grad = torch.zeros_like(param)
    if not pieces:  # alignment padding only: nothing steps, the bucket's optimizer stands for the state
        return _Part(lo, hi, False, param, grad, pieces, piece_offsets, optimizer, None)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
              for g, ps in zip(optimizer.param_groups, per_group)]
    try:
        shard_opt = type(optimizer)(groups, **optimizer.defaults)
    except TypeError as exc:
        raise TypeError(f"intra_node: the bucket's optimizer {type(optimizer).__name__} could not be rebuilt over "
                        f"this rank's shard of the parameters as type(opt)(param_groups, **opt.defaults) ({exc}); "
                        "use an optimizer whose constructor takes its defaults as keyword arguments") from None
    # leading alignment padding (the shard starts between two parameters) steps with the first piece
    segments = _segments_for(shard_opt, pieces, [0] + piece_offsets[1:], hi - lo, param.device)
    for piece, o in zip(pieces, piece_offsets):  # the generic path steps the pieces from these gradients
        piece.grad = grad[o:o + piece.numel()]
    return _Part(lo, hi, False, param, grad, pieces, piece_offsets, shard_opt, segments)


@torch.no_grad()
def make_bucket(index: int, flat: FlatParams, names: List[str], optimizer: Optimizer,
                scheduler: Optional[LRScheduler], shard: Optional[Tuple[int, int]] = None) -> Bucket:
    """The rest of a bucket around its flat parameters: gradient block, what this rank steps (the
    whole bucket, or with ``shard=(lo, hi)`` that shard), its exchange buffer and optimizer state."""
    params, offsets = flat.params, flat.offsets
    total = flat.block.numel()
    for p, n in zip(params, names):
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(f"parameter '{n}' got a sparse gradient; decentpy needs dense gradients")
    # A zero block (no per-parameter zero tensors when there are no gradients yet), viewed with the
    # parameters' layout in the block (channels_last kept); existing gradients are copied in.
    grad_block = torch.zeros_like(flat.block)
    grad_views = [grad_block.as_strided(v.size(), v.stride(), o) for v, o in zip(flat.views, offsets)]
    for p, gv in zip(params, grad_views):
        if p.grad is not None:  # ``.grad`` stays None until the first backward, as in torch
            gv.copy_(p.grad)
            p.grad = gv
    if shard is None:
        part = _whole(params, offsets, flat.block, grad_block, optimizer)
    else:
        part = _shard(params, flat.views, offsets, flat.block, shard[0], shard[1], optimizer)
    opt = part.state_optimizer
    fused = bool(part.pieces) and isinstance(opt, FusedOptimizer) and len(opt.param_groups) <= MAX_GROUPS_PER_BUCKET
    if fused:
        # Allocated now, next to the bucket's blocks, rather than in the middle of the first
        # backward: long-lived blocks then sit together and per-step temporaries reuse one
        # region instead of fragmenting the heap.
        opt.prepare_bucket_state(part.pieces, part.piece_offsets, part.hi - part.lo,  # type: ignore[attr-defined]
                                 flat.block.device)
    ownership.own(optimizer)  # its steps are the in-backward steps (see ownership)
    ownership.own(opt)
    bucket = Bucket(index=index, params=params, names=names, offsets=offsets, param_block=flat.block,
                    grad_block=grad_block, param_views=flat.views, grad_views=grad_views, optimizer=optimizer,
                    scheduler=scheduler, params_are_views=flat.as_views, lo=part.lo, hi=part.hi, whole=part.whole,
                    param=part.param, grad=part.grad, comm=torch.zeros_like(part.param), pieces=part.pieces,
                    piece_offsets=part.piece_offsets, state_optimizer=opt, segments=part.segments, fused=fused,
                    fresh_groups=copy.deepcopy(_hyperparameters(optimizer)),
                    fresh_scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None)
    ref = weakref.ref(bucket)  # no cycle: the old blocks must go as soon as a rebuild drops the bucket

    def mark_loaded(_: Optimizer) -> None:
        b = ref()
        if b is not None:
            b.optimizer_loaded = True

    optimizer.register_load_state_dict_post_hook(mark_loaded)
    bucket.reset_iteration()
    logger.debug("bucket %d: %d params, %d elements [%d, %d) stepped here, %s, %s, fused=%s", index, len(params),
                 total, part.lo, part.hi, flat.block.dtype, flat.block.device, fused)
    return bucket
