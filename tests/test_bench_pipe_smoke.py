"""Smoke test of bench/bench_pipe.py in its quickest mode (2 stages, chunks 1 and 2, an 8 x 128 model).

One quick run of decentpy's AsyncPipe, torch.distributed.pipelining and the single-process model;
checks the CSV (columns, positive step times), that decentpy's first-step loss and gradients equal
the single-process model's, and its activation memory under 1F1B. The torch part is a separate test,
skipped with the reason when torch.distributed.pipelining does not import or gave no result.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

from bench_smoke import run_quick

REL_TOL = 1e-4  # float32: the pipelined loss sums the micro-batches' weighted losses in another order

COLUMNS = {"framework", "schedule", "stages", "chunks", "micro_batch", "batch", "status", "reason", "step_time_s",
           "step_time_p25_s", "step_time_p75_s", "timed_steps", "single_step_time_s", "single_m_step_time_s",
           "bubble_measured", "bubble_measured_m", "bubble_theory", "speedup_vs_torch", "loss_first_step", "loss_single", "loss_rel_err", "grad_rel_err",
           "act_peak_bytes_stages", "act_one_mb_bytes_stages", "act_ratio_stages", "act_ratio_max", "cpu", "cores",
           "torch"}

Rows = Dict[Tuple[str, str, int], Dict[str, str]]


@pytest.fixture(scope="module")
def bench_rows(tmp_path_factory: pytest.TempPathFactory) -> Tuple[str, Rows]:
    """One quick run (a probe spawn and a measurement spawn of 2 workers)."""
    stdout, rows = run_quick("bench_pipe.py", ["--quick", "--no-plot", "--timeout", "60"],
                             tmp_path_factory.mktemp("bench_pipe"), "bench_pipe.csv", COLUMNS,
                             ("machine:", "median ms", "targets:"), timeout=120)
    by: Rows = {}
    for r in rows:
        assert int(r["stages"]) == 2, r
        if r["status"] == "ok":
            assert int(r["timed_steps"]) >= 3, r
            for col in ("step_time_s", "step_time_p25_s", "step_time_p75_s"):
                assert float(r[col]) > 0, (col, r)
            assert float(r["step_time_p25_s"]) <= float(r["step_time_s"]) <= float(r["step_time_p75_s"]), r
        else:
            assert r["status"] == "n/a" and r["reason"], r  # never a silent gap
        by[(r["framework"], r["schedule"], int(r["chunks"]))] = r
    return stdout, by


def _close(a: str, b: str) -> bool:
    return abs(float(a) - float(b)) <= REL_TOL * abs(float(b))


def test_bench_pipe_quick_decentpy(bench_rows: Tuple[str, Rows]) -> None:
    _, by = bench_rows
    single = by[("single", "none", 1)]
    assert single["status"] == "ok" and float(single["loss_first_step"]) > 0, single
    assert single["loss_first_step"] == single["loss_single"], single
    # the single process on the same 2 micro-batches in turn: same loss and gradients
    single2 = by[("single", "none", 2)]
    assert single2["status"] == "ok" and _close(single2["loss_first_step"], single["loss_first_step"]), single2
    assert float(single2["grad_rel_err"]) <= REL_TOL, single2
    for sch in ("gpipe", "1f1b"):
        for m in (1, 2):
            r = by[("decentpy", sch, m)]
            assert r["status"] == "ok", r
            assert _close(r["loss_first_step"], single["loss_first_step"]), r
            assert float(r["grad_rel_err"]) <= REL_TOL, r
            assert 0.0 <= float(r["bubble_theory"]) < 1.0 and r["bubble_measured"] and r["bubble_measured_m"], r
            assert float(r["single_step_time_s"]) > 0 and float(r["single_m_step_time_s"]) > 0, r
            ratios = [float(v) for v in r["act_ratio_stages"].split(";")]
            assert len(ratios) == 2 and all(v > 0 for v in ratios), r
            # GPipe keeps all m micro-batches alive on each stage, 1F1B min(S - s, m)
            bounds = [m, m] if sch == "gpipe" else [min(2, m), 1]
            assert all(v <= b + 0.01 for v, b in zip(ratios, bounds)), (ratios, bounds, r)


def test_bench_pipe_quick_torch(bench_rows: Tuple[str, Rows]) -> None:
    out, by = bench_rows
    torch_rows: List[Dict[str, str]] = [r for (fw, _, _), r in by.items() if fw == "torch"]
    assert torch_rows, "the bench wrote no torch rows (neither measured nor n/a)"
    ok = [r for r in torch_rows if r["status"] == "ok"]
    if not ok:
        reasons = sorted({r["reason"] for r in torch_rows})
        pytest.skip(f"torch.distributed.pipelining gave no result on gloo: {'; '.join(reasons)}")
    single = by[("single", "none", 1)]
    for r in ok:
        assert _close(r["loss_first_step"], single["loss_first_step"]), r
        assert float(r["grad_rel_err"]) <= REL_TOL, r
        d = by[("decentpy", r["schedule"], int(r["chunks"]))]
        assert float(d["speedup_vs_torch"]) > 0, d
    # torch's 1F1B refuses fewer micro-batches than stages: reported as n/a with the reason
    m1 = by[("torch", "1f1b", 1)]
    if m1["status"] != "ok":
        assert "n/a" in out and m1["reason"], m1
