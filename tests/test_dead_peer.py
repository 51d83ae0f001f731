"""A worker dies mid-run: every survivor fails within the timeout, naming bucket and peer."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Dict

import pytest

from dist_harness import run_workers
from reference import batch, decentpy_optim_fn, loss_fn, make_mlp

TIMEOUT_S = 8.0


def dying_worker(rank: int, world: int, topo: str) -> Dict[str, Any]:
    from decentpy import DecentralizedDataParallel

    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam"), topology=topo, local_world_size=2,
                                    bucket_size_in_mb=0.0002, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    start = None
    try:
        for k in range(50):
            if k == 4:
                if rank == 2:
                    os._exit(17)  # dies without any goodbye, mid-run
                start = time.monotonic()
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
        ddp.consensus_distance()
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - (start or time.monotonic())}
    return {"error": None, "elapsed": 0.0}


@pytest.mark.parametrize("topo", ["ring", "complete"])
def test_survivors_fail_within_timeout_naming_bucket_and_peer(topo: str) -> None:
    res = run_workers(dying_worker, 4, topo, timeout=120, allow_failures=True, pg_timeout_s=TIMEOUT_S)
    assert "exited with code 17" in str(res[2])
    for r in (0, 1, 3):
        o = res[r]
        assert isinstance(o, dict), f"rank {r} crashed instead of raising: {o}"
        assert o["error"] is not None, f"rank {r} did not notice the dead peer"
        assert "bucket" in o["error"] and "peer" in o["error"], o["error"]
        assert o["elapsed"] < 3 * TIMEOUT_S, f"rank {r} took {o['elapsed']:.1f} s to fail"
