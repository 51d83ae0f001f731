"""Counting host synchronisations of a CUDA call (torch's sync debug mode), for the GPU tests and benchmarks."""

from __future__ import annotations

import warnings
from typing import Callable

import torch


def syncs_in(fn: Callable[[], object]) -> int:
    """How many times ``fn()`` made the host wait for the GPU."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)
