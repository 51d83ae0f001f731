"""Smoke test of bench/bench_shard.py in its quickest mode (2 workers, bench-train MLP, a few steps).

Runs decentpy OSS + ShardedDataParallel and torch DDP (+ fairscale when it imports; its part is
skipped, with the reason, when ``import fairscale`` fails) in one quick run and checks the CSV:
positive step times and memory, optimizer state per rank sharded for decentpy and full for DDP.
"""

from __future__ import annotations

import importlib.util

import pytest

from bench_smoke import run_quick


COLUMNS = {"framework", "setup", "workers", "model", "step_time_s", "step_time_p25_s", "step_time_p75_s",
           "compute_time_s", "timed_steps", "optim_state_bytes_per_rank", "optim_state_bytes_ranks",
           "unsharded_state_bytes", "state_ratio_vs_unsharded", "model_bytes", "peak_rss_mib", "speedup_vs_zero",
           "speedup_vs_fairscale", "speedup_vs_ddp", "cpu", "cores", "torch"}


def _have_fairscale() -> bool:
    try:
        return importlib.util.find_spec("fairscale") is not None
    except (ImportError, ValueError):
        return False


@pytest.fixture(scope="module")
def bench_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """One quick run (one spawn of 2 workers, --no-probe) for every framework the test covers."""
    out = tmp_path_factory.mktemp("bench_shard")
    frameworks = "decentpy,torch-ddp" + (",fairscale" if _have_fairscale() else "")
    stdout, rows = run_quick("bench_shard.py", ["--quick", "--no-probe", "--frameworks", frameworks, "--timeout", "60"],
                             out, "bench_shard.csv", COLUMNS, ("median ms", "machine:", "targets:"), timeout=90)
    for r in rows:
        assert int(r["workers"]) == 2 and r["model"] == "mlp", r
        assert int(r["timed_steps"]) >= 3, r
        for col in ("step_time_s", "step_time_p25_s", "step_time_p75_s", "compute_time_s", "model_bytes",
                    "peak_rss_mib", "unsharded_state_bytes"):
            assert float(r[col]) > 0, (col, r)
        assert float(r["compute_time_s"]) <= float(r["step_time_s"]) * 1.5, r  # fwd+bwd is part of the step
        ranks = [int(b) for b in r["optim_state_bytes_ranks"].split(";")]
        assert len(ranks) == 2 and max(ranks) == int(r["optim_state_bytes_per_rank"]) > 0, r
    return stdout, {r["framework"]: r for r in rows}


def test_bench_shard_quick_decentpy_and_ddp(bench_rows: tuple) -> None:
    _, by = bench_rows
    assert {"decentpy", "torch-ddp"} <= set(by), sorted(by)
    ddp, dp = by["torch-ddp"], by["decentpy"]
    p = int(ddp["model_bytes"])
    # DDP + AdamW: the full state, two fp32 moments per parameter (+ small step counters)
    full = int(ddp["optim_state_bytes_per_rank"])
    assert 2 * p <= full <= 2 * p + 4096, ddp
    assert int(ddp["unsharded_state_bytes"]) == full
    assert [int(b) for b in ddp["optim_state_bytes_ranks"].split(";")] == [full, full]
    # decentpy OSS: each rank holds its shard only; together (about) the full state
    ranks = [int(b) for b in dp["optim_state_bytes_ranks"].split(";")]
    assert max(ranks) < full, dp
    assert 2 * p <= sum(ranks) <= 2 * p + 4096, dp
    assert 0 < float(dp["state_ratio_vs_unsharded"]) < 1
    assert float(dp["speedup_vs_ddp"]) > 0


def test_bench_shard_quick_fairscale(bench_rows: tuple) -> None:
    if not _have_fairscale():
        pytest.skip("fairscale not installed (`import fairscale` fails; `make bench-shard` installs it with "
                    "`pip install --no-deps fairscale==0.4.13`): the fairscale part of the smoke test is skipped")
    out, by = bench_rows
    assert "fairscale" in by, out
    fs, dp = by["fairscale"], by["decentpy"]
    p = int(fs["model_bytes"])
    ranks = [int(b) for b in fs["optim_state_bytes_ranks"].split(";")]
    assert 2 * p <= sum(ranks) <= 2 * p + 4096, fs
    assert float(dp["speedup_vs_fairscale"]) > 0
