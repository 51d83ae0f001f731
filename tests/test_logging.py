"""What decentpy logs at INFO on a plain gloo run: once per job, on rank 0 only (the topology and the
buckets); everything else a rank may say (which communicator, bucket rebuilds) is DEBUG."""

from __future__ import annotations

import logging
from typing import List, Tuple

from dist_harness import run_workers
from reference import batch, decentpy_optim_fn, loss_fn, make_mlp


def _train_and_capture(rank: int, world_size: int) -> List[Tuple[int, str, str]]:
    from decentpy import DecentralizedDataParallel

    records: List[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root = logging.getLogger("decentpy")
    root.setLevel(logging.DEBUG)
    root.addHandler(Keep(level=logging.DEBUG))
    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("sgd"), topology="ring")
    for step in range(2):
        x, y = batch(rank, step)
        loss_fn(ddp(x), y).backward()
    ddp.wait()
    ddp.close()
    return [(r.levelno, r.name, r.getMessage()) for r in records]


def test_info_once_per_job_on_rank_zero() -> None:
    got = run_workers(_train_and_capture, 2, timeout=120)
    info = [[m for lvl, _, m in recs if lvl >= logging.INFO] for recs in got]
    debug = [[m for lvl, _, m in recs if lvl == logging.DEBUG] for recs in got]
    # rank 0: the wrapper (topology, world size, bucket cap) and the buckets, nothing else
    assert len(info[0]) == 2, info[0]
    assert info[0][0].startswith("decentpy: ") and "ring" in info[0][0] and "world size 2" in info[0][0]
    assert "buckets" in info[0][1]
    assert info[1] == [], info[1]
    # the communicator choice (gloo: not NCCL) is still there, at DEBUG, on every rank
    for r in (0, 1):
        assert any("exchanges over torch.distributed" in m for m in debug[r]), debug[r]
    assert any("buckets" in m for m in debug[1])
