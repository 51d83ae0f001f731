"""Give freed host memory back to the operating system after the buckets take over the model.

Moving a CPU model into flat bucket blocks frees its original storage. glibc keeps such memory
resident when it sits in the middle of the heap, and the freed holes are usually a few bytes too
small for the (aligned) blocks that follow, so a worker would carry a dead copy of the model for
the whole run. ``malloc_trim`` releases those pages; it runs once per layout build, never per step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from typing import Callable, Optional

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Optional[Callable[[int], int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim  # glibc only; musl and others lack it
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_free_host_memory() -> bool:
    """Return free heap pages to the OS (glibc); False where the C library cannot."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    logger.debug("returned free heap pages to the operating system (malloc_trim)")
    return True
