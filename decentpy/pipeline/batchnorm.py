"""BatchNorm whose running statistics advance once per mini-batch, not once per micro-batch.

In a pipeline, a mini-batch reaches each BatchNorm as several micro-batches. Each is normalised
with its own statistics (what the layer computes in training), but the running mean and variance
are updated once, after the mini-batch, from the sums over all its micro-batches: the same
running statistics as plain BatchNorm on the whole mini-batch. Recomputation for checkpointing
(:func:`recomputing`) adds nothing to the sums.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .checkpoint import is_recomputing, recomputing

__all__ = ["DeferredBatchNorm", "recomputing", "is_recomputing"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm (any dimensionality) that defers its running-statistics update to
    :meth:`commit`, called by the pipe once per mini-batch."""

    sum: Tensor
    sum_squares: Tensor
    counted: Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, chunks: int = 1) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.chunks = chunks
        # float64 sums (the variance is E[x^2] - E[x]^2); not saved with the model
        self.register_buffer("sum", torch.zeros(num_features, dtype=torch.float64), persistent=False)
        self.register_buffer("sum_squares", torch.zeros(num_features, dtype=torch.float64), persistent=False)
        self.register_buffer("counted", torch.zeros((), dtype=torch.int64), persistent=False)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"DeferredBatchNorm expects a batch with a feature dimension (>= 2-D), got {input.dim()}-D")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        if not is_recomputing():
            with torch.no_grad():
                dims = [0] + list(range(2, input.dim()))
                x = input.detach().to(torch.float64)
                self.sum += x.sum(dims)
                self.sum_squares += (x * x).sum(dims)
                self.counted += input.numel() // input.shape[1]
        # this micro-batch's own statistics; the running ones wait for commit()
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the mini-batch's statistics into the running ones (as one BatchNorm step on it)."""
        n = int(self.counted)
        if n == 0:
            return
        mean = self.sum / n
        var = (self.sum_squares / n - mean * mean).clamp_(min=0.0)
        unbiased = var * (n / (n - 1)) if n > 1 else var
        assert self.num_batches_tracked is not None and self.running_mean is not None and self.running_var is not None
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counted.zero_()

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """``module`` with every BatchNorm that tracks running statistics replaced by a
        DeferredBatchNorm holding the same parameters and buffers (fairscale's name)."""
        if isinstance(module, _BatchNorm) and module.track_running_stats and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, chunks)
            device = module.running_mean.device if module.running_mean is not None else None
            out = out.to(device) if device is not None else out
            with torch.no_grad():
                if module.affine:
                    out.weight = module.weight
                    out.bias = module.bias
                assert module.running_mean is not None and module.running_var is not None
                out.running_mean.copy_(module.running_mean)  # type: ignore[union-attr]
                out.running_var.copy_(module.running_var)  # type: ignore[union-attr]
                out.num_batches_tracked.copy_(module.num_batches_tracked)  # type: ignore[union-attr]
            out.train(module.training)
            return out
        for name, child in module.named_children():
            module.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return module
