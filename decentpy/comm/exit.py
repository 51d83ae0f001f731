"""Daemon threads that talk to the c10d store, stopped before the interpreter finalizes.

A daemon thread still inside a store call (``TCPStore.add``, GIL released) when Python finalizes
cannot take the GIL back: CPython ends it with ``pthread_exit``, whose forced unwind through the
binding's C++ frames calls ``std::terminate`` -- the process dies with SIGABRT ("terminate called
without an active exception") after the script has finished, and torchrun reports the run as
failed. Seen in the heartbeat thread when rank 0, the store's host, exits first. So every such
thread registers here, and one ``atexit`` hook (run after the non-daemon threads are joined,
before finalization) asks them to stop and waits briefly for each.

Asking is not enough for a thread blocked in a wait on a peer that is alive but will never answer:
the waiter of :mod:`decentpy.comm.failures` keeps a wait given up on (a peer reported an error)
inside gloo until that peer's connection closes -- and the peer, handling the same failure, often
closes it a few seconds later, while this process finalizes: SIGABRT (found with
``nonfinite='raise'`` on 4 ranks, where the ranks that learn of the error from a report exit up to
~2.5 s after the others). So a thread may also register an ``unblock`` callable, called at exit
before the join: the waiter's ends its wait there and then (a wait with a 1 ms timeout on the same
work: gloo closes that work's connections and wakes the blocked wait with an error), so the thread
returns to Python while the interpreter can still take it back.
"""

from __future__ import annotations

import atexit
import inspect
import threading
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

__all__ = ["stop_at_exit", "EXIT_JOIN_S"]

#: how long the exit hook waits for each registered thread (a store call to a host that is gone
#: fails fast; a live store answers in microseconds)
EXIT_JOIN_S = 2.0

_Unblock = Optional[Callable[[], None]]
_registered: List[Tuple["weakref.ref[threading.Event]", List["weakref.ref[threading.Thread]"],
                        Callable[[], _Unblock]]] = []
_lock = threading.Lock()


def stop_at_exit(stop: threading.Event, threads: Sequence[threading.Thread], unblock: _Unblock = None) -> None:
    """At interpreter exit: ``stop.set()``, ``unblock()`` if one of ``threads`` is still alive (it
    must make a blocking call of the thread return; its errors are ignored), then join each of
    ``threads`` (at most :data:`EXIT_JOIN_S` each). Held weakly: an object stopped and dropped
    earlier costs nothing (a bound method ``unblock`` weakly too)."""
    with _lock:  # entries whose owner is gone are dropped here (elastic re-formations register anew)
        _registered[:] = [e for e in _registered if e[0]() is not None]
        held = weakref.WeakMethod(unblock) if inspect.ismethod(unblock) else (lambda: unblock)
        _registered.append((weakref.ref(stop), [weakref.ref(t) for t in threads], held))


def _stop_all() -> None:
    with _lock:
        entries, _registered[:] = list(_registered), []
    live = []
    for stop_ref, thread_refs, unblock_ref in entries:
        unblock = unblock_ref()
        stop = stop_ref()
        if stop is not None:
            stop.set()
        mine = [t for t in (r() for r in thread_refs) if t is not None and t.is_alive()]
        if mine and unblock is not None:
            try:
                unblock()
            except Exception:  # noqa: BLE001 - at exit; the join below still bounds the wait
                pass
        live += mine
    for t in live:
        if t is not threading.current_thread():
            t.join(EXIT_JOIN_S)


atexit.register(_stop_all)
