"""``ShardedGradScaler``: AMP loss scaling when each rank holds only its shard's gradients.

torch's ``GradScaler`` decides from the gradients it can see whether a step overflowed. With
:class:`~decentpy.sharding.ShardedDataParallel` a rank sees only the gradients it owns, so two
ranks could disagree: one skips its shard's update, the other steps and broadcasts; the model
would silently diverge, or a rank would wait in a broadcast the others skipped. Here the found-inf
flags are summed over the group in ``unscale_``, so every rank skips exactly the same steps (and
the scale moves identically everywhere). fairscale's signature, plus ``device``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm import or_world
from .oss import OSS, comm_device

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose overflow check is agreed over ``process_group``.

    Args (fairscale's, then ``device``): init_scale, growth_factor, backoff_factor,
    growth_interval, enabled, process_group (default: the world), device ("cuda" when available,
    else "cpu").
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, process_group: Optional[Any] = None,
                 device: Optional[str] = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self.process_group = or_world(process_group)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients, then agree on overflow with the whole group (a collective:
        every rank calls it, through ``step`` or directly, for the same optimizers in the same order)."""
        if not self._enabled:
            return
        if isinstance(optimizer, OSS):
            # The gradients to unscale are those of what this rank steps (its whole parameters and its
            # pieces of split ones); torch's GradScaler reads them from ``param_groups``.
            view = _ShardView(optimizer)
            super().unscale_(view)  # type: ignore[arg-type]
            # in place: GradScaler.step holds this optimizer's state dict while it calls unscale_
            self._per_optimizer_states[id(optimizer)].update(self._per_optimizer_states.pop(id(view)))
        else:
            super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        device = comm_device(self.process_group, torch.device(self._device) if self._device == "cpu"
                             else torch.device("cpu"))
        total = torch.zeros((), dtype=torch.float32, device=device)  # the shape of torch's found_inf
        for v in found.values():
            total += v.to(device, torch.float32)
        dist.all_reduce(total, group=self.process_group)
        if not found:  # a rank with no gradient of its own still records the group's verdict
            assert self._scale is not None, "scale() must run before unscale_()"
            found[self._scale.device] = total.to(self._scale.device)
        for k in found:
            found[k].copy_(total.to(found[k].device))


class _ShardView:
    """What torch's ``GradScaler.unscale_`` reads of an optimizer (its ``param_groups``), for the
    tensors an :class:`OSS` steps on this rank."""

    def __init__(self, oss: OSS) -> None:
        oss._piece_grads_from_params()
        self.param_groups = oss.optim.param_groups
