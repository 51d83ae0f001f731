"""Every rank agrees or fails clearly (issue 22): settings that differ between ranks, non-finite
gradients, dead and silent peers. Each probe asserts the error type and that the message names the
bad value or rank, on every rank, within a bound of seconds (not the process group's timeout)."""

from __future__ import annotations

import time
from typing import Any, Dict

import pytest
import torch

from dist_harness import run_workers
from reference import make_mlp

pytestmark = pytest.mark.timeout(120)


def _expect(fn: Any) -> Dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        return {"type": type(exc).__name__, "text": str(exc), "s": time.monotonic() - start}
    return {"type": None, "text": "", "s": time.monotonic() - start}


def settings_worker(rank: int, world: int) -> Dict[str, Any]:
    """Constructor settings that differ on the last rank: one spawn, several probes (the group stays
    usable after each, since every rank raised before any other collective)."""
    from decentpy import DecentralizedDataParallel

    last = rank == world - 1

    def sgd(lr: float) -> Any:
        return lambda named: torch.optim.SGD([p for _, p in named], lr=lr)

    out = {
        "bucket_size_in_mb": _expect(lambda: DecentralizedDataParallel(
            make_mlp(0), sgd(0.1), topology="ring", bucket_size_in_mb=0.0002 if last else 0.0004)),
        "topology": _expect(lambda: DecentralizedDataParallel(
            make_mlp(0), sgd(0.1), topology="complete" if last else "ring")),
        "lr": _expect(lambda: DecentralizedDataParallel(make_mlp(0), sgd(0.5 if last else 0.1), topology="ring")),
    }
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # nobody is stuck in a half-started collective
    out["allreduce"] = t.item()
    return out


def test_settings_that_differ_raise_on_every_rank_at_construction() -> None:
    world = 3
    res = run_workers(settings_worker, world, timeout=90)
    names = {"bucket_size_in_mb": ("0.0004", "0.0002"), "topology": ("ring", "complete"), "lr": ("0.1", "0.5")}
    for rank, out in enumerate(res):
        assert out["allreduce"] == world
        for key, values in names.items():
            got = out[key]
            assert got["type"] == "ValueError", (rank, key, got)
            assert key in got["text"] and f"rank {world - 1}" in got["text"], (rank, key, got)
            assert all(v in got["text"] for v in values), (rank, key, got)
            assert got["s"] < 20, (rank, key, got)
