"""Running a benchmark's worker group, and the command-line options every spawned benchmark shares.

The spawning is :func:`tools.spawn.run_workers`, the harness the tests use too; a benchmark adds
the environment of a one-node torchrun (LOCAL_RANK, one OpenMP thread), takes rank 0's result
(JSON, so that it is plain data) and stops at the first failing rank, since the others would only
wait in a collective until the deadline.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from bench.common.netlink import ThrottledNetwork

from tools.spawn import WorkerError, run_workers

__all__ = ["OUT_DIR", "WorkerBody", "add_link_args", "add_run_args", "bench_parser", "open_network", "quick_timing",
           "spawn_workers"]

# body(rank, world, plan) -> a JSON-serialisable result (rank 0's is returned)
WorkerBody = Callable[[int, int, Dict[str, Any]], Any]

OUT_DIR = Path(__file__).resolve().parents[1] / "out"  # bench/out: every benchmark's CSVs and plots


def _rank0_json(body: WorkerBody, rank: int, world: int, plan: Dict[str, Any]) -> str:
    """``body``, then a barrier (every rank done); rank 0's result as JSON, the others' empty."""
    import torch.distributed as dist

    result = body(rank, world, plan)
    dist.barrier()
    return json.dumps(result) if rank == 0 else ""


def spawn_workers(body: WorkerBody, world: int, plan: Dict[str, Any], timeout_s: float,
                  pg_timeout_s: float = 300.0, net: Optional[ThrottledNetwork] = None) -> Any:
    """Run ``body(rank, world, plan)`` on ``world`` processes; rank 0's result, or raise.

    ``body`` must be a module-level function (it is pickled into spawned processes). Raises
    RuntimeError with the traceback received if a worker fails or dies, TimeoutError past
    ``timeout_s``. ``net``: each worker runs inside its namespace of that throttled network.
    """
    try:
        results = run_workers(functools.partial(_rank0_json, body), world, plan, timeout=timeout_s,
                              env={"OMP_NUM_THREADS": "1"}, pg_timeout_s=pg_timeout_s, stop_on_failure=True,
                              local_ranks=True, netns=None if net is None else net.namespaces,
                              rank_env=None if net is None else [net.worker_env(r) for r in range(world)])
    except WorkerError as exc:
        raise RuntimeError("benchmark worker failed:\n" + exc.tracebacks()) from exc
    return json.loads(results[0])


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line: the first line of its docstring ``doc`` as the description, the
    defaults shown in ``--help``."""
    return argparse.ArgumentParser(description=doc.split("\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


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
    parser.add_argument("--out", default=str(OUT_DIR))
    if plot:
        parser.add_argument("--no-plot", action="store_true")


def quick_timing(args: argparse.Namespace, warmup: int) -> None:
    """``--quick``: ``warmup`` warm-up steps and one round of 3 timed steps, no re-warm."""
    args.warmup, args.rounds, args.chunk, args.rewarm = warmup, 1, 3, 0


def add_link_args(parser: argparse.ArgumentParser) -> None:
    """``--link-mbit B`` and ``--link-layout``: run the workers on a throttled network
    (:mod:`bench.common.netlink`; root only)."""
    from bench.common.netlink import LAYOUTS

    parser.add_argument("--link-mbit", type=float, default=None,
                        help="throttle every link to B Mbit/s per direction (network namespaces + tc tbf; root only); "
                        "default: unthrottled loopback")
    parser.add_argument("--link-layout", default="per-worker", choices=LAYOUTS,
                        help="per-worker: one namespace and one B Mbit/s NIC per worker; two-nodes: two namespaces "
                        "of n/2 workers (fast inside) joined by one B Mbit/s link")


def open_network(args: argparse.Namespace, world: int) -> Optional[ThrottledNetwork]:
    """The throttled network of ``world`` workers that ``args`` ask for (None: plain loopback);
    exits with a clear message where namespaces cannot be created."""
    if getattr(args, "link_mbit", None) is None:
        return None
    from bench.common.netlink import NetlinkUnavailable

    try:
        return ThrottledNetwork(world, args.link_mbit, args.link_layout)
    except NetlinkUnavailable as exc:
        raise SystemExit(f"--link-mbit: {exc}") from exc
