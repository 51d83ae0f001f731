"""The throttled-link harness of the benchmarks (bench/common/netlink.py): two workers in two network
namespaces behind 100 Mbit/s links move data at about that rate, and no namespace is left behind.

Skipped (with the reason) where namespaces cannot be created: not root, no iproute2.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from bench.common import netlink
from tools.spawn import run_workers

MBIT = 100.0
NBYTES = 2_500_000  # 0.2 s at 100 Mbit/s


def _transfer(rank: int, world: int, nbytes: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.ones(nbytes // 4)
    dist.barrier()
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        dist.barrier()  # the receiver's completion bounds the sender's time too
        times.append(time.perf_counter() - t0)
    import os

    return dict(times=times, ifname=os.environ["GLOO_SOCKET_IFNAME"], master=os.environ["MASTER_ADDR"])


def _ours() -> list:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(netlink.PREFIX)]


def test_throttled_link_rate_and_teardown() -> None:
    why = netlink.unavailable_reason()
    if why is not None:
        pytest.skip(why)
    try:
        net = netlink.ThrottledNetwork(2, MBIT, "per-worker")
    except netlink.NetlinkUnavailable as exc:
        pytest.skip(str(exc))
    names = set(net.namespaces) | {net.switch}
    try:
        assert names <= set(_ours())
        assert net.namespaces[0] != net.namespaces[1]
        res = run_workers(_transfer, 2, NBYTES, timeout=60, netns=net.namespaces,
                          rank_env=[net.worker_env(r) for r in range(2)])
    finally:
        net.close()
    assert not names & set(_ours()), "namespaces left behind"
    assert res[0]["ifname"] == netlink.IFNAME and res[0]["master"] == net.address(0)
    best = min(res[0]["times"])
    rate = NBYTES * 8 / best / 1e6
    # tbf lets a burst through first and TCP/gloo add headers: a sane band around the limit
    assert 0.6 * MBIT <= rate <= 1.25 * MBIT, f"measured {rate:.0f} Mbit/s through a {MBIT:g} Mbit/s link"


def test_two_nodes_layout_shares_a_namespace_per_node() -> None:
    why = netlink.unavailable_reason()
    if why is not None:
        pytest.skip(why)
    try:
        net = netlink.ThrottledNetwork(4, MBIT, "two-nodes")
    except netlink.NetlinkUnavailable as exc:
        pytest.skip(str(exc))
    with net:
        assert net.namespaces[0] == net.namespaces[1] != net.namespaces[2] == net.namespaces[3]
        assert net.worker_env(3)["LOCAL_RANK"] == "1" and net.worker_env(3)["LOCAL_WORLD_SIZE"] == "2"
        assert net.address(1) == net.address(0) != net.address(2)
    assert not (set(net.namespaces) | {net.switch}) & set(_ours())


def test_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netlink.os, "geteuid", lambda: 1000)
    with pytest.raises(netlink.NetlinkUnavailable, match="root"):
        netlink.ThrottledNetwork(2, MBIT)
