"""A throttled network for the benchmarks: Linux network namespaces joined by veth pairs and a
bridge, each link limited with ``tc ... tbf`` (root only; ``netem`` is not needed).

Layouts (``LAYOUTS``):

* ``per-worker`` -- one namespace per worker, each joined to the switch by its own veth pair whose
  two ends are both limited to B Mbit/s: every worker has its own full-duplex NIC of B Mbit/s
  (egress shaped in the worker's namespace, ingress on the switch's end).
* ``two-nodes`` -- two simulated nodes of ``n / 2`` workers: the workers of a node share one
  namespace (they reach each other over its loopback, unthrottled, like the fast links inside a
  node) and the node's one veth pair to the switch is limited to B Mbit/s each way.

The switch is a bridge in a namespace of its own, so nothing is added to the machine's own network
namespace: the addresses (``SUBNET``) exist only inside namespaces this module creates. Namespace
names are ``dpbench-<pid>-...``; :class:`ThrottledNetwork` removes its own at exit (``with`` block,
``close``, ``atexit``, also after a failure or a SIGTERM), and :func:`cleanup_leftovers` removes those of
processes that are gone (a run killed with SIGKILL) before a new network is built.

Workers enter their namespace with ``setns(2)`` (:func:`tools.netns.enter_netns`) as the first thing they do (see
``tools.spawn.run_workers(netns=...)``): the parent and the workers still talk over pipes, and
every socket a worker opens afterwards (the rendezvous store, gloo's connections) lives in the
namespace. ``MASTER_ADDR`` is rank 0's address there and ``GLOO_SOCKET_IFNAME`` the veth end
``eth0`` (:meth:`ThrottledNetwork.worker_env`).

    with ThrottledNetwork(world=4, mbit=400, layout="two-nodes") as net:
        run_workers(fn, 4, netns=net.namespaces, worker_env=net.worker_env)
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional

__all__ = ["LAYOUTS", "IFNAME", "SUBNET", "NetlinkUnavailable", "ThrottledNetwork", "cleanup_leftovers",
           "unavailable_reason"]

LAYOUTS = ("per-worker", "two-nodes")
IFNAME = "eth0"             # the veth end inside a worker's (node's) namespace
SUBNET = "10.213.0"         # /24, only inside the namespaces created here
PREFIX = "dpbench-"


class NetlinkUnavailable(RuntimeError):
    """Network namespaces or tc cannot be used here (not root, no ``ip``/``tc``, no kernel support)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise NetlinkUnavailable(f"`{' '.join(cmd)}` failed (exit {res.returncode}): {res.stderr.strip()}")
    return res


def unavailable_reason() -> Optional[str]:
    """Why a throttled network cannot be built here, or None (cheap: no namespace is created)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "throttled links need root (network namespaces and tc); run as root or drop --link-mbit"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"throttled links need `{tool}` (iproute2), which is not on PATH"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list_netns() -> List[str]:
    res = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def cleanup_leftovers() -> List[str]:
    """Delete ``dpbench-<pid>-*`` namespaces whose process is gone; the names deleted."""
    gone = []
    for name in _list_netns():
        m = re.match(rf"{re.escape(PREFIX)}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _run("ip", "netns", "delete", name, check=False)
            gone.append(name)
    return gone


def _exit_on_sigterm() -> None:
    """A SIGTERM (``kill``, a CI timeout) exits through ``SystemExit``, so that ``finally`` blocks and
    ``atexit`` remove the namespaces; only where SIGTERM still has its default action."""
    import signal
    import sys
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _tbf(ns: str, dev: str, mbit: float) -> None:
    """Limit ``dev``'s egress in ``ns`` to ``mbit`` Mbit/s: a token bucket of ~2 ms of traffic (at
    least 64 KiB, so that one GSO super-packet fits) and a queue of 20 ms."""
    burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.002))
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
         "burst", str(burst), "latency", "20ms")


class ThrottledNetwork:
    """The namespaces, veth pairs, bridge and tbf limits of one benchmark run (see the module doc).

    ``namespaces[r]`` is rank r's namespace, ``address(r)`` its IPv4 address there. Built on
    construction; removed by :meth:`close` (idempotent; also registered with ``atexit``)."""

    def __init__(self, world: int, mbit: float, layout: str = "per-worker") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown link layout {layout!r}; choose from {', '.join(LAYOUTS)}")
        if mbit <= 0:
            raise ValueError(f"--link-mbit must be positive, got {mbit}")
        if layout == "two-nodes" and (world < 2 or world % 2):
            raise ValueError(f"the two-nodes layout needs an even number of workers >= 2, got {world}")
        why = unavailable_reason()
        if why is not None:
            raise NetlinkUnavailable(why)
        self.world, self.mbit, self.layout = world, float(mbit), layout
        self.node_size = world // 2 if layout == "two-nodes" else 1
        self.nodes = world // self.node_size
        self._tag = f"{PREFIX}{os.getpid()}-{id(self) % 100000}"
        self.switch = f"{self._tag}-sw"
        self.node_ns = [f"{self._tag}-n{i}" for i in range(self.nodes)]
        self.namespaces = [self.node_ns[r // self.node_size] for r in range(world)]
        self._created: List[str] = []
        atexit.register(self.close)
        _exit_on_sigterm()
        cleanup_leftovers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        res = _run("ip", "netns", "add", name, check=False)
        if res.returncode != 0:
            raise NetlinkUnavailable(f"cannot create network namespace {name!r} ({res.stderr.strip()}); "
                                     "throttled links need root and network-namespace support")
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.node_ns):
            self._add_ns(ns)
            port = f"v{i}"
            _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.node_address(i)}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            _tbf(ns, IFNAME, self.mbit)            # the node's egress
            _tbf(self.switch, port, self.mbit)     # its ingress (the switch's egress towards it)

    def node_address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def address(self, rank: int) -> str:
        """Rank ``rank``'s IPv4 address (its namespace's)."""
        return self.node_address(rank // self.node_size)

    def worker_env(self, rank: int) -> Dict[str, str]:
        """The rendezvous environment of rank ``rank`` inside its namespace."""
        return {"MASTER_ADDR": self.address(0), "GLOO_SOCKET_IFNAME": IFNAME,
                "LOCAL_RANK": str(rank % self.node_size), "LOCAL_WORLD_SIZE": str(self.node_size)}

    def describe(self) -> str:
        if self.layout == "per-worker":
            return (f"{self.world} namespaces, one per worker, each with its own {self.mbit:g} Mbit/s full-duplex "
                    "link (tbf on both veth ends) to a bridge")
        return (f"2 nodes of {self.node_size} workers (one namespace each; unthrottled loopback inside a node) "
                f"joined by a {self.mbit:g} Mbit/s full-duplex link (tbf on both veth ends)")

    def close(self) -> None:
        """Delete every namespace created (their veth pairs and the bridge go with them)."""
        while self._created:
            _run("ip", "netns", "delete", self._created.pop(), check=False)

    def __enter__(self) -> "ThrottledNetwork":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
