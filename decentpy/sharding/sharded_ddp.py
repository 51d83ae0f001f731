"""``ShardedDataParallel``: gradients reduced to the rank that owns them (ZeRO stage 2).

fairscale's constructor and methods. The partition comes from the sharded optimizer(s)
(:class:`~decentpy.sharding.OSS`); the reduction is the backward driver's
:class:`~decentpy.sharding.sharded_grads.ShardedGrads` strategy. Fixes over
fairscale 0.4.13: ``zero_grad(set_to_none=True)`` (torch's default) trains on fresh gradients
(fairscale's buckets kept stale ones), ``reduce_fp16`` works with buckets, unused parameters need
no flag and never hang, and bad input raises on every rank before any collective.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..comm import agree_across_ranks, default_timeout, group_ranks, or_world
from ..comm.failures import start_heartbeat
from ..engine.driver import BackwardDriver, DriverJoinHook
from .sharded_grads import ShardedGrads
from .oss import OSS, comm_device

__all__ = ["ShardedDataParallel"]

logger = logging.getLogger(__name__)


class ShardedDataParallel(nn.Module, Joinable):
    """Wrap ``module``; during backward, reduce each gradient to the rank that owns its parameter.

    Args:
        module: the model (every rank builds the same one).
        sharded_optimizer: an :class:`OSS`, or a list of them over disjoint parameters, sharding over
            ``process_group``.
        process_group: the group to reduce over (default: the world).
        broadcast_buffers: broadcast the module's buffers from the group's first rank at each
            training forward (BatchNorm statistics stay equal).
        sync_models_at_startup: broadcast parameters and buffers from the group's first rank now.
        reduce_buffer_size: the most elements one reduction sends (0: one reduction per parameter).
        auto_refresh_trainable: notice ``requires_grad`` changes at the next forward.
        reduce_fp16: reduce fp16 copies of the gradients (half the bytes).
    """

    def __init__(self, module: nn.Module, sharded_optimizer: Union[OSS, List[OSS]], process_group: Any = None,
                 broadcast_buffers: bool = True, sync_models_at_startup: bool = True,
                 reduce_buffer_size: int = 2 ** 23, auto_refresh_trainable: bool = True,
                 reduce_fp16: bool = False) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedDataParallel needs torch.distributed: call init_process_group(...) first")
        self.module = module
        self._optims = list(sharded_optimizer) if isinstance(sharded_optimizer, (list, tuple)) else [sharded_optimizer]
        self._process_group = or_world(process_group)
        self._global_ranks = group_ranks(self._process_group)
        self._enable_broadcast_buffers = bool(broadcast_buffers)
        self._auto_refresh_trainable = bool(auto_refresh_trainable)
        self._reduce_fp16 = bool(reduce_fp16)
        self._cap = int(reduce_buffer_size)
        self._timeout = default_timeout()
        self._driver = BackwardDriver()
        self._grads: Optional[ShardedGrads] = None

        self._agree(broadcast_buffers, sync_models_at_startup)
        if sync_models_at_startup:
            self._broadcast(list(self.module.parameters()) + list(self.module.buffers()))
        self.refresh_trainable()

    # -- construction ------------------------------------------------------------------------------
    def _check_local(self) -> None:
        if self._cap < 0:
            raise ValueError(f"reduce_buffer_size must be >= 0 (0: one reduction per parameter), got {self._cap}")
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(self.module).__name__}")
        for o in self._optims:
            if not isinstance(o, OSS):
                raise TypeError(f"sharded_optimizer must be a decentpy.OSS (or a list of them), got {type(o).__name__}")
            if group_ranks(o.group) != self._global_ranks:
                raise ValueError(f"the OSS shards over ranks {group_ranks(o.group)} but ShardedDataParallel reduces over "
                                 f"ranks {self._global_ranks}; give both the same group")
        types = sorted({p.device.type for p in self.module.parameters()})
        if len(types) > 1:
            raise ValueError(f"ShardedDataParallel's module must be on one device type, found parameters on {types}")
        if not types:
            raise ValueError("the module has no parameters")
        self.device_type = types[0]
        self.is_multi_device_module = len({p.device for p in self.module.parameters()}) > 1
        seen = set()
        for o in self._optims:
            for p in o._params():
                if id(p) in seen:
                    raise ValueError("a parameter appears in more than one sharded optimizer")
                seen.add(id(p))
        module_ids = {id(p) for p in self.module.parameters()}
        if not seen <= module_ids:
            raise ValueError("the sharded optimizer optimizes parameters that are not the module's")
        left_out = [n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in seen]
        if left_out:
            logger.warning("ShardedDataParallel: %d trainable parameters are in no sharded optimizer (first: '%s'); "
                           "their gradients are not reduced", len(left_out), left_out[0])
        self._devices = {id(p): p.device for p in self.module.parameters()}

    def _agree(self, broadcast_buffers: bool, sync_models_at_startup: bool) -> None:
        """The construction's one collective: a local failure, or a setting or module structure that
        differs from group rank 0's, raises on every rank."""
        failure: Optional[BaseException] = None
        try:
            self._check_local()
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
            failure = exc
        module = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.module.named_parameters()] \
            if isinstance(self.module, nn.Module) else []
        settings = {"module": module, "reduce_buffer_size": self._cap, "broadcast_buffers": broadcast_buffers,
                    "sync_models_at_startup": sync_models_at_startup, "reduce_fp16": self._reduce_fp16,
                    "auto_refresh_trainable": self._auto_refresh_trainable}
        start_heartbeat()  # so that a dead peer is named in any later failed wait
        agree_across_ranks(failure, settings, "ShardedDataParallel", group=self._process_group,
                           explain={"module": _module_differs})

    @torch.no_grad()
    def _broadcast(self, tensors: List[Tensor]) -> None:
        if len(self._global_ranks) == 1:
            return
        works = [dist.broadcast(t.data, src=self._global_ranks[0], group=self._process_group, async_op=True)
                 for t in tensors]
        for w in works:
            w.wait()

    # -- trainability ------------------------------------------------------------------------------
    def _owned_params(self) -> List[Tensor]:
        return [p for o in self._optims for p in o._params()]

    def _trainable_mask(self) -> List[bool]:
        return [p.requires_grad for p in self._owned_params()]

    def refresh_trainable(self) -> None:
        """Rebuild the gradient buckets (and the optimizers' broadcast blocks) for the parameters
        that require gradients now."""
        self._driver.remove_hooks()
        for o in self._optims:
            o.refresh_trainable()
        layouts = [layout for o in self._optims for layout in o.flat_layouts()]
        self._grads = ShardedGrads(layouts, self._process_group, self._global_ranks, self._cap, self._reduce_fp16,
                                   self._timeout)
        self._driver.attach(self._grads.params, self._grads)  # (a no_sync() active now stays active)
        self._mask = self._trainable_mask()

    @property
    def reductions_per_backward(self) -> int:
        """How many ``reduce`` collectives one backward issues (none on a group of one): one per
        owner's run of each flat block, more when a run exceeds ``reduce_buffer_size``."""
        assert self._grads is not None
        return self._grads.num_collectives

    # -- forward / backward ------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        training = self.module.training and torch.is_grad_enabled()
        for name, p in self.module.named_parameters():
            d = self._devices.get(id(p))
            if d is not None and p.device != d:
                raise RuntimeError(f"a parameter moved from {d} to {p.device} after ShardedDataParallel was built; "
                                   "move the model before wrapping it")
            if training and p.grad is not None and p.grad.requires_grad:  # refused now, not mid-backward
                raise RuntimeError(f"parameter '{name}' has a .grad that requires grad (a create_graph=True backward, "
                                   "or a gradient set by hand): ShardedDataParallel reduces plain gradients only; "
                                   "zero_grad() first, or use torch DDP for higher-order gradients")
        if self._auto_refresh_trainable and self._trainable_mask() != self._mask:
            logger.debug("ShardedDataParallel: the trainable parameters changed; rebuilding the gradient buckets")
            self.refresh_trainable()
        if self.module.training and torch.is_grad_enabled():
            Join.notify_join_context(self)
            if self._enable_broadcast_buffers and not self._driver.accumulate:
                self.sync_buffers(blocking=True)
            self._driver.arm()
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally; the next backward outside (or :meth:`reduce`) reduces them.
        A forward inside may rebuild the gradient buckets (``requires_grad`` changed); the context
        stays active over the rebuild."""
        with self._driver.accumulating():
            yield

    def reduce(self) -> None:
        """Reduce the gradients accumulated so far now (after backward passes under :meth:`no_sync`).
        A collective: call it on every rank."""
        self._driver.run_iteration(joined=False)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Reset the gradients of the module's parameters (``None`` by default, as torch)."""
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:  # as nn.Module.zero_grad (an owner's gradient is a view of its reduction buffer)
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def sync_buffers(self, blocking: bool = False) -> None:
        """Broadcast the module's buffers from the group's first rank (a collective)."""
        self._broadcast(list(self.module.buffers()))

    def __getattr__(self, name: str) -> Any:
        """Unknown attributes come from the wrapped module (as fairscale's)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    # -- Join ----------------------------------------------------------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """A joined rank matches each iteration's buffer broadcast and gradient reductions with zero
        gradients (torch DDP's semantics: the mean stays over the whole group)."""
        return DriverJoinHook(self._driver, before=self._sync_buffers_if_enabled)

    def _sync_buffers_if_enabled(self) -> None:
        if self._enable_broadcast_buffers:
            self.sync_buffers(blocking=True)

    @property
    def join_device(self) -> torch.device:
        return comm_device(self._process_group, next(self.module.parameters()).device)

    @property
    def join_process_group(self) -> Any:
        return self._process_group


def _module_differs(r: int, a: List[Any], b: List[Any]) -> str:
    k = next(i for i in range(max(len(a), len(b))) if (a[i] if i < len(a) else None) != (b[i] if i < len(b) else None))
    show = lambda v: tuple(v[k]) if k < len(v) else None  # noqa: E731
    return (f"the module differs between group rank 0 and group rank {r}: parameter #{k} is {show(a)} on rank 0 but "
            f"{show(b)} on rank {r} (name, shape, dtype); every rank must build the same model")
