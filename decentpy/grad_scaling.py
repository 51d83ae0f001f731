"""Per-bucket gradient unscaling, finiteness check and clipping for the in-backward step.

torch's ``GradScaler.step`` expects a whole optimizer step after backward; decentpy steps each
bucket inside backward, so it unscales in the kernel (``grad_scale``) and advances the scaler with
torch's own update rule once per iteration.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


class BucketGradScaling:
    """Computes each bucket's gradient factor and whether it must skip its update."""

    def __init__(self, scaler: Optional["torch.amp.GradScaler"], clip_norm: float) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.clip_norm = float(clip_norm)
        self._inv_scale: Optional[float] = None
        self._found_inf = False

    @property
    def active(self) -> bool:
        return self.scaler is not None or self.clip_norm > 0

    def begin_iteration(self) -> None:
        self._inv_scale = None
        self._found_inf = False

    def bucket_factor(self, grad_block: Tensor) -> Tuple[float, bool]:
        """(factor to multiply the gradients by, skip the update) for one bucket."""
        if not self.active:
            return 1.0, False
        inv_scale = 1.0
        if self.scaler is not None:
            if self._inv_scale is None:
                self._inv_scale = 1.0 / float(self.scaler.get_scale())
            inv_scale = self._inv_scale
        norm = float(torch.linalg.vector_norm(grad_block, dtype=torch.float32)) * inv_scale
        if not torch.isfinite(torch.tensor(norm)):
            self._found_inf = True
            return 0.0, True
        factor = inv_scale
        if self.clip_norm > 0 and norm > self.clip_norm:
            factor *= self.clip_norm / (norm + 1e-6)
        return factor, False

    def end_iteration(self) -> None:
        """Advance the scaler (back off if any bucket overflowed, grow after enough clean steps)."""
        if self.scaler is None or self._inv_scale is None or self.scaler._scale is None:
            return
        s = self.scaler
        scale = s._scale  # GradScaler keeps these as tensors; update them with torch's own rule
        if not isinstance(getattr(s, "_growth_tracker", None), torch.Tensor):
            s._lazy_init_scale_growth_tracker(scale.device)
        tracker = s._growth_tracker
        found = torch.full((), float(self._found_inf), dtype=torch.float32, device=scale.device)
        torch._amp_update_scale_(scale, tracker, found, s.get_growth_factor(), s.get_backoff_factor(),
                                 s.get_growth_interval())
