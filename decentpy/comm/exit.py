"""Daemon threads that talk to the c10d store, stopped before the interpreter finalizes.

A daemon thread still inside a store call (``TCPStore.add``, GIL released) when Python finalizes
cannot take the GIL back: CPython ends it with ``pthread_exit``, whose forced unwind through the
binding's C++ frames calls ``std::terminate`` -- the process dies with SIGABRT ("terminate called
without an active exception") after the script has finished, and torchrun reports the run as
failed. Seen in the heartbeat thread when rank 0, the store's host, exits first. So every such
thread registers here, and one ``atexit`` hook (run after the non-daemon threads are joined,
before finalization) asks them to stop and waits briefly for each.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import List, Sequence, Tuple

__all__ = ["stop_at_exit", "EXIT_JOIN_S"]

#: how long the exit hook waits for each registered thread (a store call to a host that is gone
#: fails fast; a live store answers in microseconds)
EXIT_JOIN_S = 2.0

_registered: List[Tuple["weakref.ref[threading.Event]", List["weakref.ref[threading.Thread]"]]] = []
_lock = threading.Lock()


def stop_at_exit(stop: threading.Event, threads: Sequence[threading.Thread]) -> None:
    """At interpreter exit: ``stop.set()``, then join each of ``threads`` (at most
    :data:`EXIT_JOIN_S` each). Held weakly: an object stopped and dropped earlier costs nothing."""
    with _lock:  # entries whose owner is gone are dropped here (elastic re-formations register anew)
        _registered[:] = [e for e in _registered if e[0]() is not None]
        _registered.append((weakref.ref(stop), [weakref.ref(t) for t in threads]))


def _stop_all() -> None:
    with _lock:
        entries, _registered[:] = list(_registered), []
    live = []
    for stop_ref, thread_refs in entries:
        stop = stop_ref()
        if stop is not None:
            stop.set()
        live += [t for t in (r() for r in thread_refs) if t is not None and t.is_alive()]
    for t in live:
        if t is not threading.current_thread():
            t.join(EXIT_JOIN_S)


atexit.register(_stop_all)
