"""Smoke test of bench/bench_elastic.py in its quickest mode (2 workers, ring, a few steps): both
wrappers train in the same processes, the CSV has its columns and positive step times, and the
overhead column is the ratio of the two medians it prints."""

from __future__ import annotations

from bench_smoke import run_quick

COLUMNS = {"topology", "workers", "plain_ms", "elastic_ms", "elastic_p25_ms", "elastic_p75_ms", "plain_p25_ms",
           "plain_p75_ms", "overhead_pct", "timed_steps", "cpu", "cores", "torch"}


def test_bench_elastic_quick(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, rows = run_quick("bench_elastic.py", ["--quick", "--no-plot", "--timeout", "120"], tmp_path, "bench_elastic.csv",
                        COLUMNS, ("machine:", "overhead", "targets:"), timeout=180)
    assert [r["topology"] for r in rows] == ["ring"]
    r = rows[0]
    assert int(r["workers"]) == 2 and int(r["timed_steps"]) >= 3
    plain, elastic = float(r["plain_ms"]), float(r["elastic_ms"])
    assert plain > 0 and elastic > 0
    assert abs(float(r["overhead_pct"]) - (elastic / plain - 1) * 100) < 1e-3 * max(1.0, abs(float(r["overhead_pct"])))
