"""bench/bench_lm.py: its quick run (torch DDP and decentpy's alternating-exp-ring on loopback, two
evaluations of a tiny budget) writes the rows and the summary; the summary's target loss, times
and ratios against a re-computation from the rows by hand."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from bench_smoke import run_quick

COLUMNS = {"framework", "mode", "topology", "compression", "intra_node", "link_mbit", "workers", "preset", "seed",
           "tokens", "wall_s", "bytes_sent_per_worker", "val_bits_per_byte", "val_bits_per_byte_workers_mean",
           "consensus_distance", "machine"}


def test_quick_run_writes_rows_for_every_arm_and_evaluation(tmp_path) -> None:
    stdout, rows = run_quick("bench_lm.py", ["--quick", "--no-plot"], tmp_path, "bench_lm.csv", COLUMNS,
                             ("machine:", "corpus python-stdlib", "targets:"), timeout=300)
    by_mode = {}
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
    assert set(by_mode) == {"ddp", "decentpy"}, by_mode.keys()
    for mode, rs in by_mode.items():
        assert [int(r["tokens"]) for r in rs] == sorted(int(r["tokens"]) for r in rs)
        assert len(rs) == 3, rs  # evaluations at step 0 and 2 more
        assert float(rs[-1]["val_bits_per_byte"]) < float(rs[0]["val_bits_per_byte"]), rs
        assert int(rs[-1]["workers"]) == 4
    assert (tmp_path / "bench_lm_summary.csv").is_file()


def _rows(mode: str, seed: int, vals: List[float], walls: List[float], **kw: Any) -> List[Dict[str, Any]]:
    return [dict(mode=mode, topology=kw.get("topology", "allreduce"), compression=kw.get("compression", "none"),
                 intra_node="gossip", link_mbit=100.0, seed=seed, tokens=100 * (i + 1), wall_s=w,
                 val_bits_per_byte=v, val_bits_per_byte_workers_mean=v + 0.01, bytes_sent_per_worker=10.0 * i)
            for i, (v, w) in enumerate(zip(vals, walls))]


def test_summary_against_a_hand_computation() -> None:
    """Target: DDP's loss at its first evaluation at or after 75% of the budget (tokens 300 of 400
    -> 3.0 for seed 0, 3.2 for seed 1, mean 3.1); time to it: interpolated between the evaluations
    around it."""
    from bench.bench_lm import summarize

    rows = (_rows("ddp", 0, [5.0, 4.0, 3.0, 2.9], [1, 2, 3, 4]) + _rows("ddp", 1, [5.0, 4.0, 3.2, 3.0], [1, 2, 3, 4])
            + _rows("decentpy", 0, [5.0, 3.05, 2.0, 1.9], [0.5, 1.0, 1.5, 2.0], topology="alternating-exp-ring")
            + _rows("decentpy", 1, [5.0, 3.5, 3.09, 1.9], [0.5, 1.0, 1.5, 2.0], topology="alternating-exp-ring"))
    got = {s["arm"]: s for s in summarize(rows)}
    ddp, aer = got["ddp"], got["aer"]
    assert ddp["target_val_bits_per_byte"] == pytest.approx(3.1)
    # DDP: seed 0 between (2, 4.0) and (3, 3.0): 2.9; seed 1 between (3, 3.2) and (4, 3.0): 3.5; mean 3.2
    assert ddp["time_to_target_s"] == pytest.approx(3.2)
    # aer: seed 0 between (0.5, 5.0) and (1.0, 3.05): 0.5 + 1.9 / 1.95 * 0.5; seed 1 between (1.0, 3.5)
    # and (1.5, 3.09): 1.0 + 0.4 / 0.41 * 0.5
    want = (0.5 + 1.9 / 1.95 * 0.5 + 1.0 + 0.4 / 0.41 * 0.5) / 2
    assert aer["time_to_target_s"] == pytest.approx(want)
    assert aer["speedup_vs_ddp_to_target"] == pytest.approx(3.2 / want)
    assert aer["final_val_bits_per_byte"] == pytest.approx(1.9)
    assert aer["vs_ddp_final"] == pytest.approx(1.9 / 2.95 - 1)


def test_from_csv_merges_runs_and_keeps_each_rows_machine(tmp_path) -> None:
    """The full table is run in parts (a seed, a link at a time): ``--from-csv a,b`` summarises their
    rows together -- two seeds give one summary row per arm with ``seeds`` 2 and the mean of their
    final losses -- and each row keeps the machine it was measured on."""
    import csv

    from bench.bench_lm import main
    from bench.common.tables import write_csv
    from examples.lm.loop import COLUMNS

    fields = list(COLUMNS) + ["machine"]
    for seed, machine, ddp, aer in ((0, "machine A", [5.0, 4.0, 3.0, 2.9], [5.0, 3.05, 2.0, 1.9]),
                                    (1, "machine B", [5.0, 4.0, 3.2, 3.0], [5.0, 3.5, 3.09, 2.1])):
        rows = _rows("ddp", seed, ddp, [1, 2, 3, 4]) + _rows("decentpy", seed, aer, [1, 2, 3, 4],
                                                               topology="alternating-exp-ring")
        write_csv(tmp_path / f"s{seed}.csv", fields, [dict({c: r.get(c) for c in COLUMNS}, machine=machine)
                                                       for r in rows])
    out = tmp_path / "out"
    assert main(["--from-csv", f"{tmp_path / 's0.csv'},{tmp_path / 's1.csv'}", "--no-plot", "--out", str(out)]) == 0
    with open(out / "bench_lm_summary.csv", newline="") as fh:
        summary = {r["arm"]: r for r in csv.DictReader(fh)}
    assert int(summary["ddp"]["seeds"]) == 2 and int(summary["aer"]["seeds"]) == 2
    assert float(summary["ddp"]["final_val_bits_per_byte"]) == pytest.approx(2.95)
    assert float(summary["aer"]["final_val_bits_per_byte"]) == pytest.approx(2.0)
    assert summary["aer"]["machine"] == "machine A; machine B"


def test_link_probe_derives_ddp_time_from_the_probe_and_the_loopback_curve() -> None:
    """bench/lm_link_probe.py: DDP's step to an arm's final loss, linear between evaluations, times
    the probe's seconds per step, against the same arithmetic written out."""
    from bench.lm_link_probe import link_table, step_reaching

    curve = [(0, 8.0), (10, 4.0), (20, 3.0), (30, 2.5)]
    assert step_reaching(curve, 3.5) == 15.0
    assert step_reaching(curve, 8.5) == 0
    assert step_reaching(curve, 2.0) is None
    runs = [dict(mode="ddp", link_mbit=None, local_steps=1, step=s, val_bits_per_byte=v, wall_s=0.1 * s)
            for s, v in curve]
    runs += [dict(mode="decentpy", topology="complete", compression="none", intra_node="gossip", link_mbit=100.0,
                  local_steps=32, fragments=1, step=s, val_bits_per_byte=v, wall_s=w)
             for s, v, w in [(0, 8.0, 0.0), (30, 3.5, 6.0)]]
    probe = [dict(mode="ddp", step=s, wall_s=0.5 * s) for s in (0, 4, 8)]
    (row,) = link_table(runs, probe, 100.0)
    assert row["arm"] == "diloco-32" and row["ddp_step_to_that_loss"] == 15.0
    assert row["ddp_wall_s_to_that_loss"] == 7.5 and row["speedup_vs_ddp"] == round(7.5 / 6.0, 2)
    assert row["ddp_full_budget_s"] == 15.0
