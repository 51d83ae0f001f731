"""Smoke test of bench/bench_elastic.py in its quickest mode (2 workers, ring, a few steps): both
wrappers train in the same processes, the CSV has its columns and positive step times, and the
paired overhead lies between its own quartiles, the direct cost is made of its parts."""

from __future__ import annotations

from bench_smoke import run_quick

COLUMNS = {"topology", "workers", "plain_ms", "elastic_ms", "elastic_p25_ms", "elastic_p75_ms", "plain_p25_ms",
           "plain_p75_ms", "overhead_pct", "overhead_p25_pct", "overhead_p75_pct", "rounds", "timed_steps", "check_us",
           "store_op_us", "direct_us_per_step", "direct_pct", "cpu", "cores", "torch"}


def test_bench_elastic_quick(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, rows = run_quick("bench_elastic.py", ["--quick", "--no-plot", "--timeout", "120"], tmp_path, "bench_elastic.csv",
                        COLUMNS, ("machine:", "overhead", "targets:"), timeout=180)
    assert [r["topology"] for r in rows] == ["ring"]
    r = rows[0]
    assert int(r["workers"]) == 2 and int(r["timed_steps"]) >= 3
    plain, elastic = float(r["plain_ms"]), float(r["elastic_ms"])
    assert plain > 0 and elastic > 0
    assert int(r["rounds"]) == 1  # --quick: one round of both
    assert float(r["overhead_p25_pct"]) <= float(r["overhead_pct"]) <= float(r["overhead_p75_pct"])
    # the direct cost: two checks and the threads' share, as a fraction of the plain step
    check, store_op, direct = float(r["check_us"]), float(r["store_op_us"]), float(r["direct_us_per_step"])
    assert 0 < check and 0 < store_op and direct >= 2 * check
    assert abs(float(r["direct_pct"]) - direct / (plain * 1e3) * 100) < 1e-6 + 1e-3 * float(r["direct_pct"])
