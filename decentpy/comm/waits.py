"""Bounded waits: every wait on another rank ends, and a timeout names what was awaited."""

from __future__ import annotations

import datetime
import logging
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .failures import DEFAULT_LIVENESS_TIMEOUT, PeerTimeoutError, PeerWatch, running_monitor

__all__ = ["PeerTimeoutError", "wait_bounded", "default_timeout"]

logger = logging.getLogger(__name__)


def wait_bounded(work: dist.Work, timeout: datetime.timedelta, what: str,
                 peers: Optional[Sequence[int]] = None) -> None:
    """Wait for ``work`` at most ``timeout``; a :class:`PeerTimeoutError` that starts with ``what``
    otherwise (gloo raises on a timeout or a closed connection, other backends return False).

    The failure is classified like every other (decentpy.comm.failures): with the heartbeats
    running, the error names the rank(s) that died (``peers``, global ranks, default: every other
    rank of the world) instead of the one connection that failed. The wait itself stays a plain
    blocking wait: no thread hand-off on the hot paths that use it (pipelines, sharding)."""
    start = time.monotonic()
    try:
        ok = work.wait(timeout)
    except (RuntimeError, dist.DistError) as exc:
        raise _classify(exc, what, timeout, peers, start) from exc
    if ok is False:
        raise _classify(None, what, timeout, peers, start)


def _classify(exc: Optional[BaseException], what: str, timeout: datetime.timedelta,
              peers: Optional[Sequence[int]], start: float) -> PeerTimeoutError:
    world = list(range(dist.get_world_size())) if dist.is_initialized() else []
    me = dist.get_rank() if dist.is_initialized() else 0
    awaited = list(peers) if peers is not None else [r for r in world if r != me]
    liveness = DEFAULT_LIVENESS_TIMEOUT if running_monitor() is not None else None
    return PeerWatch(world, timeout, liveness).classify(exc, what, awaited, None, None, start)


def default_timeout() -> datetime.timedelta:
    """The default process group's timeout (torch's default when it cannot be read)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend() == dist.Backend.NCCL else "cpu")
        t = pg._get_backend(device).options._timeout
        if isinstance(t, datetime.timedelta):
            return t
    except Exception:  # pragma: no cover - depends on torch internals
        logger.debug("could not read the process group timeout; using torch's default")
    return dist.default_pg_timeout
