"""Multi-node launches on torchrun's own rendezvous (docs/howto/multinode.md): two simulated hosts
(network namespaces joined by a bridge, bench/common/netlink.py), one ``torchrun --nnodes=2
--rdzv-backend=c10d`` per host, examples/multinode.py on 2 + 2 processes. The nodes come from
torchrun's environment: the run equals the same job on one host with ``local_world_size=2`` given
explicitly, rank for rank. Nodes of different sizes (2 + 1 processes) fail on every rank with a
message naming both sizes.

Skipped (with the reason) where namespaces cannot be created: not root, no iproute2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from bench.common import netlink

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "multinode.py")


def _env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME=netlink.IFNAME)
    env.pop("LOCAL_WORLD_SIZE", None)
    return env


def _hosts(net: "netlink.ThrottledNetwork", procs: Tuple[int, int], job: str, port: int,
           timeout: float = 240.0, etcd_v3: str = "") -> List[subprocess.CompletedProcess]:
    """One torchrun per simulated host, both started at once; their results. ``etcd_v3``: the
    rendezvous on that etcd (decentpy's torchrun backend over etcd's v3 API, an elastic 1:2 nodes)
    instead of c10d's on node 0."""
    runs = []
    for node, n in enumerate(procs):
        rdzv = (["--nnodes=1:2", "--rdzv-backend=decentpy-etcd-v3", f"--rdzv-endpoint={etcd_v3}",
                 "--rdzv-conf=last_call_timeout=15"] if etcd_v3 else
                ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={net.node_address(0)}:{port}",
                 f"--rdzv-conf=is_host={int(node == 0)}"])
        cmd = ["ip", "netns", "exec", net.node_ns[node], sys.executable, "-m", "torch.distributed.run",
               *rdzv, f"--nproc_per_node={n}", f"--rdzv-id={job}", f"--local-addr={net.node_address(node)}",
               "--max-restarts=0", SCRIPT, "--steps", "12"]
        runs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                     cwd=str(ROOT)))
    out = []
    for p in runs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in runs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def _lines(text: str) -> List[Dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def net():
    why = netlink.unavailable_reason()
    if why is not None:
        pytest.skip(why)
    with netlink.ThrottledNetwork(world=4, mbit=1000.0, layout="two-nodes") as n:
        yield n


@pytest.fixture(scope="module")
def etcd_on_node0(net, tmp_path_factory):
    """An etcd server (v3 API only, as etcd 3.6) inside node 0's namespace, on its address."""
    import shutil
    import time

    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (Debian package etcd-server)")
    addr, data = net.node_address(0), tmp_path_factory.mktemp("etcd")
    client, peer = 23790 + os.getpid() % 100, 24790 + os.getpid() % 100
    proc = subprocess.Popen(["ip", "netns", "exec", net.node_ns[0], "etcd", "--data-dir", str(data / "d"),
                             "--enable-v2=false", "--listen-client-urls", f"http://{addr}:{client}",
                             "--advertise-client-urls", f"http://{addr}:{client}",
                             "--listen-peer-urls", f"http://{addr}:{peer}",
                             "--initial-advertise-peer-urls", f"http://{addr}:{peer}",
                             "--initial-cluster", f"default=http://{addr}:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:  # (reachable from node 1, as the torchruns will reach it)
            probe = subprocess.run(["ip", "netns", "exec", net.node_ns[1], sys.executable, "-c",
                                    "import datetime, sys; from decentpy.elastic.etcd_v3 import connect_etcd_v3; "
                                    f"connect_etcd_v3('{addr}:{client}', timeout=datetime.timedelta(seconds=2))"],
                                   capture_output=True, text=True, env=_env(), cwd=str(ROOT))
            if probe.returncode == 0:
                break
            assert proc.poll() is None and time.monotonic() < deadline, probe.stderr[-2000:]
            time.sleep(0.3)
        yield f"{addr}:{client}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _one_host_run() -> Dict[int, Dict[str, object]]:
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", SCRIPT,
                          "--steps", "12", "--local-world-size", "2"], capture_output=True, text=True, env=_env(),
                         cwd=str(ROOT), timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    return {int(r["rank"]): r for r in _lines(one.stdout)}


@pytest.mark.timeout(400)
def test_two_torchruns_on_an_etcd_v3_rendezvous_equal_the_one_host_run(net, etcd_on_node0) -> None:
    """torchrun --rdzv-backend=decentpy-etcd-v3 (elastic: --nnodes=1:2) on a server without the v2
    API: both hosts join one rendezvous, the nodes come from torchrun's environment, and the run
    equals the one-host run rank for rank."""
    hosts = _hosts(net, (2, 2), f"decentpy-etcd-{os.getpid()}", 0, etcd_v3=etcd_on_node0)
    for h in hosts:
        assert h.returncode == 0, h.stderr[-3000:]
    got = {int(r["rank"]): r for h in hosts for r in _lines(h.stdout)}
    assert sorted(got) == [0, 1, 2, 3] and {r["node"] for r in got.values()} == {0, 1}
    want = _one_host_run()
    for rank in range(4):
        assert got[rank]["checksum"] == want[rank]["checksum"], (rank, got[rank], want[rank])


@pytest.mark.timeout(400)
def test_two_torchruns_find_their_nodes_and_equal_the_one_host_run(net) -> None:
    port = 29400 + os.getpid() % 500
    hosts = _hosts(net, (2, 2), f"decentpy-test-{os.getpid()}", port)
    for h in hosts:
        assert h.returncode == 0, h.stderr[-3000:]
    got = {int(r["rank"]): r for h in hosts for r in _lines(h.stdout)}
    assert sorted(got) == [0, 1, 2, 3]
    assert {r["node"] for r in got.values()} == {0, 1}
    assert all(r["replicas"] == 2 and r["topology"] == "alternating-exp-ring" for r in got.values())
    want = _one_host_run()
    for rank in range(4):
        assert got[rank]["checksum"] == want[rank]["checksum"], (rank, got[rank], want[rank])
    assert got[0]["checksum"] != got[2]["checksum"]  # (two replicas: the nodes' models differ)


@pytest.mark.timeout(400)
def test_nodes_of_different_sizes_fail_on_every_rank_naming_both(net) -> None:
    port = 29900 + os.getpid() % 90
    hosts = _hosts(net, (2, 1), f"decentpy-uneven-{os.getpid()}", port)
    for h in hosts:
        assert h.returncode != 0
        text = h.stderr + h.stdout
        assert "processes on this rank's node (torchrun's LOCAL_WORLD_SIZE)" in text, text[-3000:]
    # every rank says it (the agreement raises everywhere), with both sizes
    said = {line.split("]")[0] for h in hosts for line in (h.stderr + h.stdout).splitlines()
            if "processes on this rank's node" in line
            and {int(v) for v in re.findall(r"(\d+) on rank \d+", line)} == {1, 2}}
    assert said == {"[rank0", "[rank1", "[rank2"}, said
