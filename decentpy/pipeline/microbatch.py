"""Mini-batches as micro-batches: what crosses a stage boundary, how a batch is cut and joined.

A stage's input and output is a tensor or a tuple of tensors (any dtype and shape; every tensor
batched along dim 0). A batch of ``n`` rows in ``chunks`` micro-batches is cut with
``torch.tensor_split``: ``min(chunks, n)`` micro-batches whose sizes differ by at most one (a
batch smaller than ``chunks`` gives fewer micro-batches, never an empty one).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch
from torch import Tensor

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]

__all__ = ["TensorOrTensors", "as_tuple", "check", "scatter", "gather", "batch_size"]


def check(value: object, what: str = "the pipe's input") -> None:
    """TypeError unless ``value`` is a tensor or a non-empty tuple of tensors."""
    if isinstance(value, Tensor):
        return
    if isinstance(value, tuple) and value and all(isinstance(v, Tensor) for v in value):
        return
    kinds = (type(value).__name__ if not isinstance(value, (tuple, list))
             else f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})")
    raise TypeError(f"{what} must be a tensor or a tuple of tensors, got {kinds}")


def as_tuple(value: TensorOrTensors) -> Tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def batch_size(value: TensorOrTensors, what: str = "the pipe's input") -> int:
    """The common size of dim 0 (ValueError when the tensors disagree or one is a scalar)."""
    sizes = []
    for i, t in enumerate(as_tuple(value)):
        if t.dim() == 0:
            raise ValueError(f"{what}: tensor {i} is a scalar; every tensor needs a batch dimension (dim 0)")
        sizes.append(t.shape[0])
    if len(set(sizes)) != 1:
        raise ValueError(f"{what}: the tensors have different batch sizes {sizes} (dim 0)")
    return sizes[0]


def scatter(value: TensorOrTensors, chunks: int) -> List[TensorOrTensors]:
    """``value`` cut into ``min(chunks, batch)`` micro-batches along dim 0 (tuples element-wise)."""
    n = batch_size(value)
    m = max(1, min(chunks, n))
    if isinstance(value, Tensor):
        return list(torch.tensor_split(value, m))
    parts = [torch.tensor_split(t, m) for t in value]
    return [tuple(p[j] for p in parts) for j in range(m)]


def gather(parts: Sequence[TensorOrTensors]) -> TensorOrTensors:
    """The micro-batches joined back along dim 0."""
    if isinstance(parts[0], Tensor):
        return parts[0] if len(parts) == 1 else torch.cat(list(parts))  # type: ignore[arg-type]
    width = len(parts[0])
    return tuple(parts[0][i] if len(parts) == 1 else torch.cat([p[i] for p in parts])  # type: ignore[index]
                 for i in range(width))
