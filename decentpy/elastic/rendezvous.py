"""The rendezvous: the one process an elastic job needs up, hosting a ``torch.distributed.TCPStore``.

``python -m decentpy.rendezvous --port 29400`` hosts it (like torchft's lighthouse, but a plain c10d
store: no decentpy logic runs in it, so it never needs the training code or a GPU);
:func:`connect` is how a worker reaches it. Any other c10d Store (e.g. torch's ``EtcdStore``, or a
TCPStore hosted by the user's launcher) works the same: :class:`~decentpy.elastic.ElasticGossip`
takes the store object.

It listens on 127.0.0.1 unless told otherwise (``--host``): a store reachable from other hosts
lets anyone who reaches it take part in the membership of a job without a secret, and delay any
job (docs/security.md). c10d's TCPStore listens on every interface whatever host it is given, so
the listening socket is bound here and handed to it.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import signal
import socket
import sys
import threading
from typing import Any, List, Optional

import torch.distributed as dist

from .membership import RendezvousError

__all__ = ["connect", "serve", "host_store", "main", "DEFAULT_HOST"]

#: where the rendezvous listens by default: this host only
DEFAULT_HOST = "127.0.0.1"

logger = logging.getLogger(__name__)


def connect(host: str, port: int, timeout: datetime.timedelta = datetime.timedelta(seconds=30)) -> Any:
    """A client of the rendezvous store at ``host:port``; :class:`RendezvousError` if it cannot be
    reached within ``timeout`` (every later store operation is bounded by it too)."""
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - c10d raises several types for a refused connection
        raise RendezvousError(f"cannot reach the rendezvous store at {host}:{port} within "
                              f"{timeout.total_seconds():g} s ({str(exc).splitlines()[0][:200]}); start it with "
                              f"`python -m decentpy.rendezvous --port {port}` on {host}") from exc


def host_store(host: str = DEFAULT_HOST, port: int = 0) -> Any:
    """A TCPStore server listening on ``host:port`` only (``port`` 0: a free one, ``store.port``).
    The bound socket is kept on the store object (``store.listen_socket``) for its lifetime."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on host {host!r}: {exc}; give an address of this host (127.0.0.1, "
                         "0.0.0.0 for every interface, or one interface's address)") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
        bound = sock.getsockname()[1]
        store = dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, use_libuv=True,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    try:
        store.listen_socket = sock  # (the store's server listens on this descriptor: keep it open)
    except AttributeError:  # pragma: no cover - a store class without a __dict__
        _SOCKETS.append(sock)
    return store


_SOCKETS: List[socket.socket] = []


def serve(port: int, host: str = DEFAULT_HOST, ready: Optional[threading.Event] = None,
          stop: Optional[threading.Event] = None) -> None:
    """Host the store on ``host:port`` until ``stop`` is set (or forever); 127.0.0.1 by default."""
    store = host_store(host, port)
    logger.info("decentpy rendezvous: TCPStore on %s:%d", host, store.port)
    print(f"decentpy rendezvous: listening on {host}:{store.port}", flush=True)
    if host in ("127.0.0.1", "::1", "localhost"):
        print("decentpy rendezvous: only this host can reach it; for workers on other hosts pass --host 0.0.0.0 (or "
              "the address of the interface they reach) and keep the port behind a firewall, and give the job a "
              "secret (docs/security.md)", flush=True)
    if ready is not None:
        ready.set()
    (stop or threading.Event()).wait()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decentpy.rendezvous",
                                     description="Host the rendezvous store of elastic decentpy jobs (a c10d TCPStore).")
    parser.add_argument("--port", type=int, default=29400, help="TCP port (default 29400)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default {DEFAULT_HOST}, this host only; 0.0.0.0: every "
                             "interface, behind a firewall)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve(args.port, args.host, stop=stop)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
