"""Smoke test of bench/bench_faults.py's torch DDP baseline: torchrun restarts from checkpoints under SIGKILLs.

2 DDP workers, 150 steps, one kill within the first 2 s of training (the run takes longer), a
checkpoint every 20 steps. Checks the two CSV rows: the no-fault row (1.0, nothing redone), and
that the faulty run was restarted (one kill, a stall, at most one checkpoint interval redone) and
ends with exactly the no-fault run's model: the checkpoint holds all the state and the batches are
a function of the step. decentpy's elastic path has its own tests (test_elastic.py).
"""

from __future__ import annotations

import pytest

from bench_smoke import run_quick

COLUMNS = {"framework", "topology", "workers", "kills", "goodput_vs_no_faults", "max_stall_steps", "rejoin_s",
           "final_loss", "final_accuracy", "lost_steps"}
EVERY = 20


@pytest.mark.timeout(300)
def test_bench_faults_ddp_restarts(tmp_path_factory: pytest.TempPathFactory) -> None:
    args = ["--frameworks", "torch-ddp-restarts", "--workers", "2", "--steps", "150", "--kill-every", "2",
            "--max-kills", "1", "--checkpoint-every", str(EVERY), "--run-timeout", "120"]
    _, rows = run_quick("bench_faults.py", args, tmp_path_factory.mktemp("bench_faults"), "bench_faults.csv", COLUMNS,
                        ("checkpoint every 20 steps", "group restarts"), timeout=290)
    assert len(rows) == 2 and all(r["framework"] == "torch-ddp-restarts" for r in rows), rows
    base, hit = rows
    assert int(base["kills"]) == 0 and float(base["goodput_vs_no_faults"]) == 1.0, base
    assert int(base["lost_steps"]) == 0 and base["rejoin_s"] == "", base
    assert int(hit["kills"]) == 1, hit
    assert 0 < float(hit["goodput_vs_no_faults"]) < 1.0 and float(hit["max_stall_steps"]) > 10, hit
    assert 0 <= int(hit["lost_steps"]) <= EVERY and float(hit["rejoin_s"]) > 0, hit
    assert (hit["final_loss"], hit["final_accuracy"]) == (base["final_loss"], base["final_accuracy"]), rows
