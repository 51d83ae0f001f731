"""CUDA helpers for the GPU tests and benchmarks: counting a call's host synchronisations (torch's sync
debug mode) and timing a call with CUDA events."""

from __future__ import annotations

import statistics
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


def time_ms(fn: Callable[[], object], runs: int, warmup: int) -> float:
    """Median milliseconds of fn() on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
