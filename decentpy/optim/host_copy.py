"""A device value the host reads later, without waiting for the stream that computes it.

What a GPU decides in a step (a bucket's skip flag, a peer check's verdict) is needed on the host for
bookkeeping -- counters, logs, histories -- but not before the next kernels are queued: reading it at
once would stall the host until the GPU catches up. :class:`HostCopy` starts an asynchronous copy to
pinned host memory and records an event; :meth:`HostCopy.ready` says whether reading would wait,
:meth:`HostCopy.values` reads (waiting for that copy only). A CPU tensor is its own copy.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor

__all__ = ["HostCopy"]


class HostCopy:
    """``source``'s values on the host, copied asynchronously (see the module)."""

    def __init__(self, source: Tensor) -> None:
        self._event: Optional[Any] = None
        if source.is_cuda:
            self.host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            self.host.copy_(source, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self.host = source

    def ready(self) -> bool:
        """Whether :meth:`values` would return without waiting for the device."""
        return self._event is None or self._event.query()

    def values(self) -> List[Any]:
        """The values as a (nested) list; waits for the copy (an event, not the stream) if needed."""
        if self._event is not None:
            self._event.synchronize()
        return self.host.tolist()
