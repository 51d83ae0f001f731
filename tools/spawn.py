"""Run a function on N gloo worker processes on 127.0.0.1 (or inside network namespaces), with a hard deadline.

The one spawn harness of the tests (``tests/dist_harness.py`` re-exports it) and the benchmarks
(``bench/common/launch.py`` adapts it): workers are spawned (not forked), each with one torch
thread; the parent collects every rank's return value or traceback and kills all of them when the
deadline passes, so a hang fails fast instead of waiting for a collective's timeout. With ``netns`` each worker first
enters its network namespace (:mod:`tools.netns`; made by ``bench.common.netlink`` for the throttled-link benchmarks) and
``rank_env`` gives it that namespace's rendezvous address and interface.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["DEFAULT_TIMEOUT_S", "WorkerError", "free_port", "run_workers"]

DEFAULT_TIMEOUT_S = 180.0


class WorkerError(AssertionError):
    """A worker raised (or died); carries every failing rank's traceback. An AssertionError, so a
    test that spawns workers fails (not errors) like an assertion in its own process."""

    def __init__(self, failures: Dict[int, str]) -> None:
        self.failures = failures
        super().__init__(f"{len(failures)} worker(s) failed:\n{self.tracebacks()}")

    def tracebacks(self) -> str:
        """Every failing rank's traceback under a ``--- rank r ---`` line, by rank."""
        return "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(self.failures.items()))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any,
            env: Dict[str, str], pg_timeout_s: float, local_ranks: bool, netns: Optional[str] = None,
            rank_env: Optional[Dict[str, str]] = None) -> None:
    if netns is not None:  # first: every socket this process opens from here on is in the namespace
        try:
            from tools.netns import enter_netns

            enter_netns(netns)
        except BaseException:
            queue.put((rank, "error", traceback.format_exc()))
            return
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "GLOO_SOCKET_IFNAME": "lo"})
    if local_ranks:
        os.environ.update({"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    os.environ.update(rank_env or {})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including assertion failures
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                env: Optional[Dict[str, str]] = None, pg_timeout_s: float = 60.0, allow_failures: bool = False,
                stop_on_failure: bool = False, local_ranks: bool = False, netns: Optional[Sequence[str]] = None,
                rank_env: Optional[Sequence[Dict[str, str]]] = None, require_clean_exit: bool = False) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``fn`` must be a module-level function (it is pickled into the spawned processes); ``env`` is
    added to each worker's environment, ``local_ranks`` also sets LOCAL_RANK / LOCAL_WORLD_SIZE as
    torchrun does on one node. Raises :class:`WorkerError` if any rank fails (or, with
    ``allow_failures``, returns the traceback strings as those ranks' results), TimeoutError if the
    workers do not all finish within ``timeout`` seconds. ``stop_on_failure``: stop at the first
    failure (the other ranks would only wait in a collective until ``pg_timeout_s``). ``netns``:
    rank r runs inside network namespace ``netns[r]`` (entered before anything else), ``rank_env[r]``
    is added to its environment last (e.g. MASTER_ADDR and GLOO_SOCKET_IFNAME of that namespace).
    ``require_clean_exit``: a rank that reported its result but then exited with a non-zero code (a
    signal while the interpreter finalized: SIGABRT is ``-6``) fails too, by its exit code.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env or {}, pg_timeout_s,
                                               local_ranks, None if netns is None else netns[r],
                                               None if rank_env is None else rank_env[r]), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    failures: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size and not (failures and stop_on_failure):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers did not finish within {timeout:.0f} s; finished ranks: "
                                   f"{sorted(results)}, failed: {sorted(failures)}")
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in failures]
                for r in dead:
                    failures[r] = f"process exited with code {procs[r].exitcode} without reporting"
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
    finally:
        reported = len(results) + len(failures) == world_size  # else: stopped early or timed out
        for p in procs:
            p.join(timeout=10 if reported else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if require_clean_exit:
        for r, p in enumerate(procs):
            if r in results and p.exitcode != 0:
                del results[r]
                failures[r] = f"process exited with code {p.exitcode} after reporting its result"
    if failures and not allow_failures:
        raise WorkerError(failures)
    merged = dict(results)
    merged.update(failures)
    return [merged[r] for r in range(world_size)]
