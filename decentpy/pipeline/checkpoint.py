"""Whether a pipeline stage is running a checkpointed forward, or recomputing one for its backward.

fairscale's ``is_checkpointing()`` / ``is_recomputing()``: a layer that has side effects (counting,
running statistics, logging) can ask which of the two runs of a checkpointed micro-batch it is in,
so that the side effect happens once. Both are False outside a checkpointed micro-batch (and in
eval mode or without autograd, where nothing is checkpointed). Per thread.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["is_checkpointing", "is_recomputing", "checkpointing", "recomputing"]

_state = threading.local()


def is_checkpointing() -> bool:
    """Whether a checkpointed micro-batch's first forward is running (its activations are not kept)."""
    return getattr(_state, "checkpointing", False)


def is_recomputing() -> bool:
    """Whether a checkpointed forward is being recomputed for its backward (in this thread)."""
    return getattr(_state, "recomputing", False)


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    before = getattr(_state, name, False)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, before)


def checkpointing() -> "contextlib.AbstractContextManager[None]":
    """Marks the first forward of a checkpointed micro-batch."""
    return _flag("checkpointing")


def recomputing() -> "contextlib.AbstractContextManager[None]":
    """Marks the recomputation of a checkpointed micro-batch."""
    return _flag("recomputing")
