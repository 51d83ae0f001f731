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


def test_quick_race_sizes_each_arm_to_the_budget(tmp_path) -> None:
    """``--race --quick``: a 4-second budget on loopback; each arm probes its throughput, trains the
    tokens that fill the budget (its rows carry budget_s and its own token count), and the race table
    is written."""
    stdout, rows = run_quick("bench_lm.py", ["--quick", "--race", "--no-plot"], tmp_path, "bench_lm.csv", COLUMNS,
                             ("machine:", "race on loopback: T = 4.0 s", "equal wall time (the race)"), timeout=300)
    finals = {}
    for r in rows:
        assert float(r["budget_s"]) == 4.0 and r["data_split"] == "shuffle" and float(r["grad_clip"]) == 1.0
        finals[r["mode"]] = max(int(finals.get(r["mode"], 0)), int(r["tokens"]))
    assert set(finals) == {"ddp", "decentpy"}
    assert all(t > 0 and t % 4096 == 0 for t in finals.values()), finals  # whole steps of the preset's batch
    assert (tmp_path / "bench_lm_race.csv").is_file()


def test_race_summary_against_a_hand_computation() -> None:
    """The race table: per link and arm the mean final loss over seeds at equal wall time, its range,
    and its gap to DDP's and to decent-dp's on the same topology (rows without a budget are not in it)."""
    from bench.bench_lm import race_summary

    def run(mode: str, seed: int, final: float, tokens: int, **kw: Any) -> List[Dict[str, Any]]:
        base = dict(mode=mode, topology=kw.get("topology", "allreduce"), compression=kw.get("compression", "none"),
                    intra_node="gossip", link_mbit=100.0, seed=seed, budget_s=kw.get("budget_s", 60.0),
                    bytes_sent_per_worker=1.0, wall_s=59.0)
        return [dict(base, tokens=0, val_bits_per_byte=8.0), dict(base, tokens=tokens, val_bits_per_byte=final)]

    rows = (run("ddp", 0, 3.6, 100) + run("ddp", 1, 3.4, 100)
            + run("decentpy", 0, 3.2, 300, topology="alternating-exp-ring", compression="int8")
            + run("decentpy", 1, 3.3, 320, topology="alternating-exp-ring", compression="int8")
            + run("decent-dp", 0, 3.45, 150, topology="alternating-exp-ring")
            + run("ddp", 2, 1.0, 999, budget_s=None))  # an equal-token run: not in the race
    got = {r["arm"]: r for r in race_summary(rows)}
    assert set(got) == {"ddp", "aer-int8", "decent-dp-aer"}
    assert got["ddp"]["final_val_bits_per_byte"] == pytest.approx(3.5) and got["ddp"]["seeds"] == 2
    a = got["aer-int8"]
    assert a["final_val_bits_per_byte"] == pytest.approx(3.25) and (a["min"], a["max"]) == (3.2, 3.3)
    assert a["vs_ddp"] == pytest.approx(3.25 / 3.5 - 1) and a["tokens"] == pytest.approx(310)
    assert a["decent_dp_rival"] == "decent-dp-aer" and a["vs_decent_dp"] == pytest.approx(3.25 / 3.45 - 1)
    assert got["decent-dp-aer"]["vs_decent_dp"] is None


def test_best_settings_take_each_arms_lowest_mean_final_loss(tmp_path) -> None:
    """--settings: from a sweep's rows, each arm's (lr, outer lr, outer momentum) with the lowest final
    loss, mean over seeds."""
    from bench.bench_lm import best_settings
    from bench.common.tables import write_csv
    from examples.lm.loop import COLUMNS

    rows = []
    for lr, olr, om, finals in ((1e-3, 0.7, 0.9, (3.6, 3.8)), (2e-3, 0.7, 0.9, (3.5, 3.9)), (2e-3, 1.0, 0.0, (3.4, 3.5))):
        for seed, final in enumerate(finals):
            rows.append(dict(mode="decentpy", topology="complete", compression="none", intra_node="gossip",
                             local_steps=32, fragments=1, seed=seed, tokens=500, val_bits_per_byte=final,
                             peak_lr=lr, outer_lr=olr, outer_momentum=om))
    for lr, final in ((1e-3, 3.3), (4e-3, 3.1)):
        rows.append(dict(mode="ddp", topology="allreduce", compression="none", seed=0, tokens=500,
                         val_bits_per_byte=final, peak_lr=lr))
    write_csv(tmp_path / "sweep.csv", list(COLUMNS), [{c: r.get(c) for c in COLUMNS} for r in rows])
    got = best_settings(tmp_path / "sweep.csv")
    assert got["diloco-32"] == {"lr": 2e-3, "outer_lr": 1.0, "outer_momentum": 0.0}
    assert got["ddp"] == {"lr": 4e-3}


def test_remedy_and_two_replica_arms_are_named_and_take_the_plain_arms_settings() -> None:
    """A row of an Adam-state-averaging arm or of two replicas of two names its own arm (not the plain
    'complete'), and those arms run at the plain arm's swept settings."""
    from bench.bench_lm import ARMS, arm_name, settings_arm

    base = dict(mode="decentpy", topology="complete", compression="none", intra_node="gossip", local_steps=1,
                fragments=1)
    assert arm_name(base) == "complete"
    assert arm_name(dict(base, state_averaging="exp_avg_sq/16")) == "complete-avg-v-16"
    assert arm_name(dict(base, state_averaging="exp_avg,exp_avg_sq/1")) == "complete-avg-mv-1"
    assert arm_name(dict(base, intra_node="allreduce")) == "complete-2x2"
    for arm in ("complete-avg-v-1", "complete-avg-v-16", "complete-avg-mv-1", "complete-avg-mv-16", "complete-2x2"):
        assert arm in ARMS and settings_arm(arm) == "complete"
    assert settings_arm("aer-int8") == "aer-int8"
    # NoLoCo's row is its own arm, not DiLoCo's gossip outer step on the same topology and H
    pairs = dict(base, topology="random-pairs", local_steps=32)
    assert arm_name(pairs) == arm_name(dict(pairs, outer_rule="diloco")) == "diloco-32-random-pairs"
    assert arm_name(dict(pairs, outer_rule="noloco")) == "noloco-32"
    assert arm_name(dict(base, local_steps=32, outer_rule="sparseloco")) == "sparseloco-32"
