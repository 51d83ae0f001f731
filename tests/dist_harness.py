"""Run a function on N gloo worker processes on 127.0.0.1, with a hard timeout.

Workers are spawned (not forked), each with one torch thread; the parent collects every rank's
return value or traceback, and kills all of them when the timeout passes, so a hang fails fast.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import subprocess
import sys
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180.0


class WorkerError(AssertionError):
    """A worker raised; carries every failing rank's traceback."""

    def __init__(self, failures: Dict[int, str]) -> None:
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} worker(s) failed:\n{text}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any,
            env: Dict[str, str], pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "GLOO_SOCKET_IFNAME": "lo"})
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
                env: Optional[Dict[str, str]] = None, pg_timeout_s: float = 60.0,
                allow_failures: bool = False) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``fn`` must be a module-level function. Raises :class:`WorkerError` if any rank fails (or,
    with ``allow_failures``, returns the traceback strings as results), and TimeoutError if the
    workers do not all finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env or {}, pg_timeout_s),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    failures: Dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(failures) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(f"workers did not finish within {timeout:.0f} s; finished ranks: "
                                   f"{sorted(results)}, failed: {sorted(failures)}")
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except Exception:
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
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failures and not allow_failures:
        raise WorkerError(failures)
    merged = dict(results)
    merged.update(failures)
    return [merged[r] for r in range(world_size)]


@contextlib.contextmanager
def single_process_group(backend: str) -> Iterator[None]:
    """A world of one process in this process (HashStore: no sockets); destroyed on exit. Skips the
    test when a default group already exists here."""
    import pytest
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def torchrun(script: str, nproc: int, env: Dict[str, str], timeout: float,
             args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` on this interpreter, one torch thread per worker."""
    full = dict(os.environ, OMP_NUM_THREADS="1", **env)
    full.pop("LOCAL_WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
           *args]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)


def run_example_main(filename: str, argv: Sequence[str]) -> Any:
    """Load ``examples/<filename>`` as a module and return ``main(argv)`` (inside a worker: the
    examples keep a process group that is already initialized)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", filename)
    spec = importlib.util.spec_from_file_location(os.path.splitext(filename)[0], path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(argv))
