"""DDP behind a throttled link on a preset too slow to train there in full: its wall time derived
from a short probe run at that link and its loss curve on loopback.

Training is deterministic per seed and the link changes only when things happen, not what is
computed (bench-lm's DDP rows at loopback and 100 Mbit/s agree at every evaluation on the small
preset), so DDP's loss at step ``s`` behind the link is its loopback loss at ``s``, and its wall
time is ``s`` times the probe's seconds per step (a run of the first steps of a shorter budget at
that link: the learning-rate schedule differs, the time per step does not). For every local-steps
arm measured at the link the table gives its final loss, its wall time, the step at which DDP
reaches that loss (linear between evaluations) and DDP's derived wall time there: how much sooner
the arm got to its own final loss. A derived figure, labelled so in the CSV (``ddp_wall_source``).

    python -m bench.lm_link_probe --runs docs/data/bench_lm_wide.csv --probe PROBE.csv --link 100 \\
        --out docs/data/bench_lm_wide_link.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from bench.bench_lm import arm_name, read_rows

__all__ = ["step_reaching", "seconds_per_step", "link_table", "main"]


def step_reaching(curve: Sequence[Tuple[float, float]], loss: float) -> Optional[float]:
    """The first step at which the (step, loss) curve reaches ``loss``, linear between points;
    None if it never does."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if l1 <= loss:
            if l0 <= loss:
                return s0
            return s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)
    return None


def seconds_per_step(rows: Sequence[Dict[str, str]]) -> float:
    """The probe's training seconds per step (its last evaluation's wall time over its step)."""
    last = max(rows, key=lambda r: int(r["step"]))
    if int(last["step"]) < 1:
        raise ValueError("the probe run has no step after the first evaluation")
    return float(last["wall_s"]) / int(last["step"])


def link_table(runs: Sequence[Dict[str, str]], probe: Sequence[Dict[str, str]], link: float) -> List[Dict[str, object]]:
    """One row per local-steps arm measured at ``link`` (see the module)."""
    ddp = sorted(((int(r["step"]), float(r["val_bits_per_byte"])) for r in runs
                  if r["mode"] == "ddp" and not r.get("link_mbit")), key=lambda p: p[0])
    if not ddp:
        raise ValueError("the runs have no loopback DDP curve")
    per_step = seconds_per_step([r for r in probe if r["mode"] == "ddp"])
    arms: Dict[str, List[Dict[str, str]]] = {}
    for r in runs:
        if r.get("link_mbit") and float(r["link_mbit"]) == link and int(r.get("local_steps") or 1) > 1:
            arms.setdefault(arm_name(r), []).append(r)
    out: List[Dict[str, object]] = []
    for arm, rows in arms.items():
        last = max(rows, key=lambda r: int(r["step"]))
        loss, wall = float(last["val_bits_per_byte"]), float(last["wall_s"])
        step = step_reaching(ddp, loss)
        ddp_wall = None if step is None else step * per_step
        out.append({"arm": arm, "link_mbit": link, "final_val_bits_per_byte": round(loss, 4),
                    "wall_s": round(wall, 1), "ddp_step_to_that_loss": None if step is None else round(step, 1),
                    "ddp_wall_s_to_that_loss": None if ddp_wall is None else round(ddp_wall, 1),
                    "speedup_vs_ddp": None if ddp_wall is None else round(ddp_wall / wall, 2),
                    "ddp_s_per_step": round(per_step, 3), "ddp_full_budget_s": round(ddp[-1][0] * per_step, 1),
                    "ddp_wall_source": "derived: loopback loss curve x the link probe's s/step"})
    return sorted(out, key=lambda r: str(r["arm"]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="bench_lm.csv files (comma-separated) with DDP on loopback and "
                   "local-steps arms at the link")
    p.add_argument("--probe", required=True, help="bench_lm.csv of DDP's short run at the link")
    p.add_argument("--link", type=float, default=100.0, help="Mbit/s")
    p.add_argument("--out", default=None, help="write the table as CSV here")
    args = p.parse_args(argv)
    runs = [r for path in args.runs.split(",") if path for r in read_rows(Path(path))]
    table = link_table(runs, read_rows(Path(args.probe)), args.link)
    if not table:
        print(f"no local-steps arm at {args.link:g} Mbit/s in {args.runs}")
        return 1
    print(f"DDP behind {args.link:g} Mbit/s: {table[0]['ddp_s_per_step']} s/step (probe), the full budget "
          f"{table[0]['ddp_full_budget_s']} s (derived)")
    for r in table:
        print(f"{r['arm']:24} {r['final_val_bits_per_byte']:.4f} bits/byte in {r['wall_s']:7.1f} s; DDP reaches it at "
              f"step {r['ddp_step_to_that_loss']} = {r['ddp_wall_s_to_that_loss']} s: {r['speedup_vs_ddp']}x")
    if args.out:
        with open(args.out, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
