"""Per-bucket gradient unscaling, finiteness check and clipping for the in-backward step.

torch's ``GradScaler.step`` expects a whole optimizer step after backward; decentpy steps each
bucket inside backward. Without a host synchronisation per bucket: each bucket's gradient norm
stays on the device, and the fused kernel reads it together with the scaler's scale to derive the
gradient factor and whether to skip the update (``grad_factor`` in csrc/kernels/update.h, the one
definition of that rule). At the end of the iteration the scaler advances with torch's own update
rule on the device, and the per-bucket skip decisions (:class:`SkipVerdict`) are copied to the
host without waiting; they are read when first needed -- before the next iteration's first bucket
step, or when the optimizers' step counters or the LR schedulers are looked at -- by which time
the copy has normally landed. So the end of the backward does not wait for the GPU: a wait there
would leave the GPU idle while the host launches the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .host_copy import HostCopy

import decentpy._C as _C  # the compiled extension (a module of the package, not its __init__)


@dataclass(frozen=True)
class GradArgs:
    """How the kernel scales one bucket's gradients: by ``factor``, or, with ``norm`` set, by the
    factor and skip it derives from ``norm``, ``scale`` (the GradScaler's, or None) and ``clip``."""

    factor: float = 1.0
    norm: Optional[Tensor] = None
    scale: Optional[Tensor] = None
    clip: float = 0.0


UNSCALED = GradArgs()


class SkipVerdict:
    """Whether each bucket that took a norm skipped its update in one iteration (its norm was not
    finite), read when first needed. On a GPU the flags travel to pinned host memory
    asynchronously; :meth:`result` waits for that copy only (an event, not the stream)."""

    def __init__(self, buckets: List[int], found: Tensor) -> None:
        self.buckets = buckets
        self._found = found  # on the device: what a deferred step reads (see flag())
        self._flags = HostCopy(found)
        self._result: Optional[Dict[int, bool]] = None

    def ready(self) -> bool:
        """Whether :meth:`result` would return without waiting for the device."""
        return self._result is not None or self._flags.ready()

    def flag(self, bucket: int) -> Optional[Tensor]:
        """Bucket ``bucket``'s skip flag where the device computed it (a one-element bool tensor),
        for a kernel that runs before the host has read it; None when it took no norm."""
        if bucket not in self.buckets:
            return None
        j = self.buckets.index(bucket)
        return self._found[j:j + 1]

    def result(self) -> Dict[int, bool]:
        """``{bucket: skipped}``."""
        if self._result is None:
            self._result = dict(zip(self.buckets, self._flags.values()))
        return self._result

#: what a bucket whose gradient is not finite does: skip its update (and tell every rank), raise on
#: every rank, or nothing is checked (the values are stepped and sent as they are)
NONFINITE_CHOICES = ("skip", "raise", "ignore")


class BucketGradScaling:
    """Gradient norms per bucket (on the device) and the end-of-iteration scaler update."""

    def __init__(self, scaler: Optional["torch.amp.GradScaler"], clip_norm: float, nonfinite: str = "ignore") -> None:
        if nonfinite not in NONFINITE_CHOICES:
            raise ValueError(f"nonfinite must be one of {', '.join(map(repr, NONFINITE_CHOICES))}, got {nonfinite!r}")
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.clip_norm = float(clip_norm)
        self.nonfinite = nonfinite
        self.check_finite = nonfinite != "ignore"
        self._norms: Dict[int, Tensor] = {}

    @property
    def active(self) -> bool:
        """Whether buckets take a norm: for the scaler, clipping, or the non-finite check (the same
        norm serves all three; the kernel skips a bucket whose norm is not finite, so its
        non-finite values are never stepped into the parameters, hence never sent)."""
        return self.scaler is not None or self.clip_norm > 0 or self.check_finite

    def begin_iteration(self) -> None:
        self._norms = {}

    def _scale_tensor(self, device: torch.device) -> Optional[Tensor]:
        if self.scaler is None:
            return None
        scale = self.scaler._scale
        if scale is None:
            raise RuntimeError("the GradScaler has no scale yet: call scaler.scale(loss).backward() (decentpy "
                               "unscales each bucket's gradients inside that backward)")
        if scale.device != device:
            raise RuntimeError(f"the GradScaler's scale is on {scale.device} but the gradients are on {device}")
        return scale

    def bucket_args(self, bucket: int, grad_block: Tensor,
                    reduce_sq: Optional[Callable[[Tensor], Tensor]] = None,
                    norm: Optional[Tensor] = None) -> GradArgs:
        """The kernel's gradient arguments for one bucket (no host synchronisation). ``reduce_sq``
        sums a squared norm over the ranks that hold the rest of the bucket (intra_node='shard').
        ``norm``: the block's norm when already known (taken while the gradients were copied in);
        else it is computed here, a pass over the block."""
        if not self.active:
            return UNSCALED
        if norm is None:
            # fp32 accumulation for the half types; float64 blocks (torch's path) keep their precision
            wide = grad_block.dtype == torch.float64
            norm = torch.linalg.vector_norm(grad_block, dtype=None if wide else torch.float32).float().reshape(1)
        if reduce_sq is not None:
            norm = reduce_sq(norm.square()).sqrt()
        self._norms[bucket] = norm
        return GradArgs(norm=norm, scale=self._scale_tensor(grad_block.device), clip=self.clip_norm)

    @staticmethod
    def host_factor(args: GradArgs) -> Tuple[float, bool]:
        """(factor, skip) on the host, for optimizers stepped by torch (the generic path): whether to
        call ``step()`` at all needs the answer now, so this reads the norm (a sync on a GPU)."""
        if args.norm is None:
            return args.factor, False
        scale = float(args.scale) if args.scale is not None else 1.0
        return _C.grad_factor(float(args.norm), scale, args.clip)

    def end_iteration(self) -> Optional[SkipVerdict]:
        """Advance the scaler (back off if any bucket overflowed, grow after enough clean steps) and
        return, for the buckets that computed a norm, whether each skipped its update (None: no
        bucket did); nothing here waits for the device."""
        if not self._norms:
            return None
        buckets: List[int] = sorted(self._norms)
        found = ~torch.isfinite(torch.cat([self._norms[b] for b in buckets]))
        if self.scaler is not None and self.scaler._scale is not None:
            s = self.scaler
            scale = s._scale  # GradScaler keeps these as tensors; update them with torch's own rule
            if not isinstance(getattr(s, "_growth_tracker", None), torch.Tensor):
                s._lazy_init_scale_growth_tracker(scale.device)
            found_inf = found.any().to(torch.float32).reshape(())
            torch._amp_update_scale_(scale, s._growth_tracker, found_inf, s.get_growth_factor(),
                                     s.get_backoff_factor(), s.get_growth_interval())
        self._norms = {}
        return SkipVerdict(buckets, found)
