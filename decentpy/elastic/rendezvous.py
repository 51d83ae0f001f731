"""The rendezvous: the one process an elastic job needs up, hosting a ``torch.distributed.TCPStore``.

``python -m decentpy.rendezvous --port 29400`` hosts it (like torchft's lighthouse, but a plain c10d
store: no decentpy logic runs in it, so it never needs the training code or a GPU);
:func:`connect` is how a worker reaches it. Any other c10d Store (e.g. torch's ``EtcdStore``, or a
TCPStore hosted by the user's launcher) works the same: :class:`~decentpy.elastic.ElasticGossip`
takes the store object.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import signal
import sys
import threading
from typing import Any, List, Optional

import torch.distributed as dist

from .membership import RendezvousError

__all__ = ["connect", "serve", "main"]

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


def serve(port: int, host: str = "0.0.0.0", ready: Optional[threading.Event] = None,
          stop: Optional[threading.Event] = None) -> None:
    """Host the store on ``port`` until ``stop`` is set (or forever)."""
    store = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False, use_libuv=True)
    logger.info("decentpy rendezvous: TCPStore on %s:%d", host, store.port)
    print(f"decentpy rendezvous: listening on {host}:{store.port}", flush=True)
    if ready is not None:
        ready.set()
    (stop or threading.Event()).wait()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decentpy.rendezvous",
                                     description="Host the rendezvous store of elastic decentpy jobs (a c10d TCPStore).")
    parser.add_argument("--port", type=int, default=29400, help="TCP port (default 29400)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
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
