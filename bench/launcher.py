"""Spawn N gloo worker processes on 127.0.0.1 for a benchmark, with a hard deadline.

The benchmarks' twin of ``tests/dist_harness.py``: same environment (one torch thread per worker,
loopback gloo), but it returns rank 0's JSON payload and stops at the first failing rank, since
the others would otherwise wait in a collective until the deadline.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue as queue_mod
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict

# body(rank, world, plan) -> a JSON-serialisable result (rank 0's is returned)
WorkerBody = Callable[[int, int, Dict[str, Any]], Any]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, body: WorkerBody, plan: Dict[str, Any], pg_timeout_s: float,
            q: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = body(rank, world, plan)
        dist.barrier()
        q.put(("ok", rank, json.dumps(result) if rank == 0 else ""))
        dist.destroy_process_group()
    except BaseException:  # report everything, assertion failures included
        q.put(("error", rank, traceback.format_exc()))


def spawn_workers(body: WorkerBody, world: int, plan: Dict[str, Any], timeout_s: float,
                  pg_timeout_s: float = 300.0) -> Any:
    """Run ``body(rank, world, plan)`` on ``world`` processes; rank 0's result, or raise.

    ``body`` must be a module-level function (it is pickled into spawned processes). Raises
    RuntimeError with every traceback received if a worker fails or dies, TimeoutError past
    ``timeout_s``.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, body, plan, pg_timeout_s, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    payload: Any = None
    errors: Dict[int, str] = {}
    done = 0
    try:
        while done < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{world} benchmark workers did not finish within {timeout_s:.0f} s")
            try:
                kind, rank, data = q.get(timeout=min(left, 5.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"benchmark worker(s) {dead} died (exit codes "
                                       f"{[procs[i].exitcode for i in dead]}) without a traceback")
                continue
            done += 1
            if kind == "error":
                errors[rank] = data
                break  # the others would hang in a collective: stop now
            if rank == 0:
                payload = json.loads(data)
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("benchmark worker failed:\n" + "\n".join(
            f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return payload


def add_run_args(parser: argparse.ArgumentParser, *, rounds: int, chunk: int, plot: bool = False) -> None:
    """The arguments every spawned benchmark shares: the interleaved timing (``warmup`` untimed steps
    per configuration, then ``rounds`` rounds of ``rewarm`` untimed + ``chunk`` timed steps each),
    the seed, the worker group's deadline and the output folder (and ``--no-plot`` with ``plot``)."""
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after each configuration is built")
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
    parser.add_argument("--chunk", type=int, default=chunk, help="timed steps per configuration per round")
    parser.add_argument("--rewarm", type=int, default=1, help="untimed steps before each chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="per worker group, seconds")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    if plot:
        parser.add_argument("--no-plot", action="store_true")


def quick_timing(args: argparse.Namespace, warmup: int) -> None:
    """``--quick``: ``warmup`` warm-up steps and one round of 3 timed steps, no re-warm."""
    args.warmup, args.rounds, args.chunk, args.rewarm = warmup, 1, 3, 0
