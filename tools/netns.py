"""Entering a network namespace from a worker process (the throttled-link benchmarks' simulated
nodes, made by ``bench.common.netlink``): here, below both the spawner and the benchmarks, so that
``bench`` depends on ``tools`` and never the other way."""

from __future__ import annotations

import ctypes
import os

__all__ = ["NETNS_DIR", "enter_netns"]

#: where ``ip netns add`` leaves a namespace's handle
NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Move the calling thread (call it first thing in a process, before any other thread or socket
    exists) into the named network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)
