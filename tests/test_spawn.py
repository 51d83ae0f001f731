"""The spawn harness shared by the tests and the benchmarks (tools/spawn.py, bench/common/launch.py):
results by rank, the benchmarks' one-node environment and rank-0 JSON result, and a failing rank
stopping the group at once instead of leaving the others in a collective until the deadline."""

from __future__ import annotations

import os
import time
from typing import Any, Dict

import pytest

from bench.common.launch import spawn_workers
from dist_harness import WorkerError, run_workers


def _env_body(rank: int, world: int, plan: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    return dict(rank=dist.get_rank(), world=world, plan=plan,
                local=[os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE"),
                       os.environ.get("OMP_NUM_THREADS")])


def _fail_on_rank_1(rank: int, world: int, plan: Dict[str, Any]) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 would wait here until the process group's timeout


def test_run_workers_results_by_rank() -> None:
    got = run_workers(_env_body, 2, {"x": (1, 2)})
    assert [g["rank"] for g in got] == [0, 1]
    assert got[1]["plan"] == {"x": (1, 2)}  # pickled: a tuple stays a tuple
    # the tests' workers get no LOCAL_* variables of their own: what the parent has, if anything
    assert got[0]["local"][:2] == [os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")]


def test_bench_spawn_workers_rank0_json_and_local_env() -> None:
    got = spawn_workers(_env_body, 2, {"x": (1, 2)}, timeout_s=120.0)
    assert got == dict(rank=0, world=2, plan={"x": [1, 2]}, local=["0", "2", "1"])  # JSON: the tuple is a list


def test_failing_rank_stops_the_group() -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 fails on purpose") as info:
        spawn_workers(_fail_on_rank_1, 2, {}, timeout_s=120.0, pg_timeout_s=120.0)
    assert time.monotonic() - t0 < 100, "waited for the process group's timeout"
    assert str(info.value).startswith("benchmark worker failed:\n--- rank 1 ---\n")
    assert isinstance(info.value.__cause__, WorkerError)
