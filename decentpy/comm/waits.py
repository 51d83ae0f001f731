"""Bounded waits: every wait on another rank ends, and a timeout names what was awaited."""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from .failures import PeerTimeoutError

__all__ = ["PeerTimeoutError", "wait_bounded", "default_timeout"]

logger = logging.getLogger(__name__)


def wait_bounded(work: dist.Work, timeout: datetime.timedelta, what: str) -> None:
    """Wait for ``work`` at most ``timeout``; a :class:`PeerTimeoutError` that starts with ``what``
    otherwise (gloo raises on a timeout or a closed connection, other backends return False)."""
    try:
        ok = work.wait(timeout)
    except RuntimeError as exc:
        raise PeerTimeoutError(f"{what} failed or did not complete within {timeout.total_seconds():g} s ({exc}); "
                               "a peer may have died") from exc
    if ok is False:
        raise PeerTimeoutError(f"{what} did not complete within {timeout.total_seconds():g} s; a peer may have died")


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
