"""Smoke test of bench/bench_train.py in its quickest mode (2 workers, MLP, a few steps).

Checks that the benchmark runs end to end and writes a CSV that the runtime model's calibration
(tools/runtime_model/fit.py) can read (the calibration columns, positive times). decent-dp is optional:
its part is skipped, with the reason, when ``import decent_dp`` fails.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from bench_smoke import run_quick

CALIBRATION_COLUMNS = {"framework", "topology", "workers", "model", "step_time_s", "bytes_per_step",
                       "compute_time_s", "model_bytes", "local_world_size"}
EXTRA_COLUMNS = {"peak_rss_mib", "extra_rss_mib", "step_time_p25_s", "step_time_p75_s", "timed_steps",
                 "speedup_vs_decent_dp", "speedup_vs_ddp", "ratio_vs_floor"}


def _have_decent_dp() -> bool:
    try:
        return importlib.util.find_spec("decent_dp") is not None and importlib.util.find_spec("loguru") is not None
    except (ImportError, ValueError):
        return False


@pytest.fixture(scope="module")
def bench_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """One quick run (one worker spawn) for every framework the smoke test covers."""
    out = tmp_path_factory.mktemp("bench_train")
    frameworks = "decentpy,decentpy-int8,local" + (",decent-dp" if _have_decent_dp() else "")
    return out, _run(out, frameworks)


def _run(tmp_path: Path, frameworks: str) -> list:
    _, rows = run_quick("bench_train.py", ["--quick", "--workers", "2", "--models", "mlp", "--frameworks", frameworks,
                                           "--topologies", "ring", "--no-plot", "--timeout", "60"],
                        tmp_path, "bench_train.csv", CALIBRATION_COLUMNS | EXTRA_COLUMNS, ("median ms", "machine:"),
                        timeout=90)
    for r in rows:
        assert float(r["step_time_s"]) > 0, r
        assert float(r["compute_time_s"]) > 0, r
        assert float(r["model_bytes"]) > 0, r
        assert float(r["bytes_per_step"]) >= 0, r
        assert float(r["peak_rss_mib"]) > 0, r
        assert int(r["workers"]) == 2 and r["model"] == "mlp", r
    return rows


def test_bench_train_quick_decentpy_and_floor(bench_rows: tuple) -> None:
    out, all_rows = bench_rows
    rows = [r for r in all_rows if r["framework"] not in ("decent-dp", "decentpy-int8")]
    got = {(r["framework"], r["topology"]) for r in rows}
    assert got == {("decentpy", "ring"), ("local", "none")}, got
    by = {r["framework"]: r for r in rows}
    p = float(by["decentpy"]["model_bytes"])
    assert float(by["decentpy"]["bytes_per_step"]) == pytest.approx(p, rel=1e-6)  # pair exchange: P
    assert float(by["local"]["bytes_per_step"]) == 0.0
    assert float(by["decentpy"]["ratio_vs_floor"]) > 0

    # the CSV is what the runtime model calibrates from (tools/runtime_model/fit.py; SciPy)
    from tools.runtime_model import fit as runtime_fit

    ms = runtime_fit.load_measurements(out / "bench_train.csv")
    assert ("decentpy", "ring", 2) in [(m.framework, m.topology, m.workers) for m in ms]
    assert "decentpy-int8" not in [m.framework for m in ms]  # compressed bytes: not fitted


def test_bench_train_quick_compressed(bench_rows: tuple) -> None:
    """decentpy-int8 on a ring of 2: one pair exchange per step of P/4 codes + one fp32 scale per 256."""
    _, rows = bench_rows
    by = {r["framework"]: r for r in rows}
    p = int(by["decentpy"]["model_bytes"])
    assert float(by["decentpy-int8"]["bytes_per_step"]) == 4 * (-(-(p // 4) // 256)) + p // 4


def test_bench_train_quick_decent_dp(bench_rows: tuple) -> None:
    if not _have_decent_dp():
        pytest.skip("decent-dp not installed (`import decent_dp` fails; `make bench-train` installs it "
                    "with loguru): the decent-dp part of the smoke test is skipped")
    _, rows = bench_rows
    ref = [r for r in rows if r["framework"] == "decent-dp"]
    assert {(r["framework"], r["topology"]) for r in ref} == {("decent-dp", "ring")}
    assert float(ref[0]["step_time_s"]) > 0
    dp = [r for r in rows if r["framework"] == "decentpy"][0]
    assert float(dp["speedup_vs_decent_dp"]) > 0
