"""Replicas of different speeds: DiLoCo with a fixed H against a time budget (``sync_every_s``), one
worker slowed 2x.

4 worker processes train the byte-level LM of ``examples/lm`` (the ``small`` preset, the stdlib's
source) with ``DecentralizedDataParallel(topology="complete")``: decentpy's fused AdamW inside the
backward, DiLoCo's outer Nesterov step. Arms:

- ``fixed-h``: ``local_steps=H``, no slow worker: the reference throughput;
- ``fixed-h-straggler``: ``local_steps=H``, rank 3 sleeps after every step as long as the step took
  (2x slower): every outer step waits for it;
- ``budget-straggler``: ``sync_every_s=T`` with ``T = H x`` the median step time of ``fixed-h`` (the
  same window as ``fixed-h`` when nobody is slow), rank 3 slowed 2x: the others take as many inner
  steps as fit, the pseudo-gradients weighted by them.

Each arm runs ``--outer`` outer steps; after each, every rank evaluates its model (the same on every
rank after DiLoCo's outer step) on a fixed held-out slice, the evaluation's time taken out of the
wall clock. Reported: the tokens per second of the three unslowed workers (against ``fixed-h``'s:
target >= 90% for the budget), and the held-out loss at equal wall time (the last evaluation of each
arm at or before the shorter arm's end: the budget should reach a lower loss than the fixed H).
Medians over ``--repeats`` runs of each arm, interleaved; the machine printed; CSV and plot in
``--out`` (default bench/out).

    python -m bench.bench_straggler [--h 8] [--outer 12] [--repeats 2]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from bench.common.launch import OUT_DIR, bench_parser, spawn_workers
from bench.common.machine import report_machine
from bench.common.plots import finish_axes, finish_figure, pyplot
from bench.common.tables import print_targets, write_outputs

WORKERS = 4
SLOW_RANK = 3
ARMS = ("fixed-h", "fixed-h-straggler", "budget-straggler")
FIELDS = ["arm", "repeat", "outer_step", "wall_s", "val_bits_per_byte", "tokens_per_s_others", "tokens_per_s_slow",
          "inner_steps_others", "inner_steps_slow"]


def _worker(rank: int, world: int, plan: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    import decentpy
    from decentpy.optim import optim_fn_adamw
    from examples.lm.corpus import load_corpus, train_batch, val_windows
    from examples.lm.loop import bits_per_byte
    from examples.lm.model import build, preset

    torch.set_num_threads(1)
    cfg = preset("small")
    corpus = load_corpus()
    windows = val_windows(corpus.val, cfg.context, plan["val_windows"])
    model = build("small", seed=0)
    batch = cfg.global_batch // world
    kw = {"sync_every_s": plan["budget_s"]} if plan["arm"].startswith("budget") else {"local_steps": plan["h"]}
    ddp = decentpy.DecentralizedDataParallel(model, lambda named: optim_fn_adamw(named, lr=cfg.lr, weight_decay=0.1),
                                             topology="complete", **kw)
    slow = plan["arm"].endswith("straggler") and rank == SLOW_RANK
    step, evals, step_s = 0, [], []
    t0 = time.monotonic()
    eval_s = 0.0
    done = 0
    while done < plan["outer"]:
        x, y = train_batch(corpus.train, 0, rank, world, step, batch, cfg.context, split="shard")  # (as published)
        ts = time.monotonic()
        logits = ddp(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        ddp.wait()  # completes an outer exchange this iteration started (it would complete at the next forward)
        took = time.monotonic() - ts
        step_s.append(took)
        if slow:
            time.sleep(took)  # twice as slow
        step += 1
        if ddp.outer_steps != done:  # every rank reaches each outer step once: an evaluation there is collective
            done = ddp.outer_steps
            te = time.monotonic()
            wall = te - t0 - eval_s  # training time so far (the evaluations before this one taken out)
            with torch.no_grad():
                mine = windows[rank::world]
                logits = model(mine[:, :-1])
                nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1),
                                                        reduction="sum").double().reshape(1)
                dist.all_reduce(nll)
            counts = torch.tensor([float(step)], dtype=torch.float64)
            every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, counts)
            eval_s += time.monotonic() - te
            evals.append({"outer_step": done, "wall_s": wall,
                          "val_bits_per_byte": bits_per_byte(float(nll) / (windows.shape[0] * cfg.context)),
                          "steps": [int(c) for c in every]})
    ddp.close()
    return {"evals": evals, "median_step_s": statistics.median(step_s[2:] or step_s), "tokens_per_step": batch * cfg.context}


def _rows(arm: str, repeat: int, res: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows = []
    tps = res["tokens_per_step"]
    for e in res["evals"]:
        others = [e["steps"][r] for r in range(WORKERS) if r != SLOW_RANK]
        rows.append(dict(arm=arm, repeat=repeat, outer_step=e["outer_step"], wall_s=round(e["wall_s"], 3),
                         val_bits_per_byte=round(e["val_bits_per_byte"], 4),
                         tokens_per_s_others=round(statistics.mean(others) * tps / e["wall_s"], 1),
                         tokens_per_s_slow=round(e["steps"][SLOW_RANK] * tps / e["wall_s"], 1),
                         inner_steps_others=statistics.mean(others), inner_steps_slow=e["steps"][SLOW_RANK]))
    return rows


def _loss_at(rows: List[Dict[str, Any]], wall: float) -> float:
    """The last evaluation at or before ``wall`` seconds."""
    before = [r for r in rows if r["wall_s"] <= wall + 1e-9]
    return before[-1]["val_bits_per_byte"] if before else float("nan")


def main(argv: Any = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--h", type=int, default=8, help="inner steps per outer step of the fixed-H arms")
    p.add_argument("--outer", type=int, default=12, help="outer steps per run")
    p.add_argument("--repeats", type=int, default=2, help="runs per arm (interleaved)")
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--docs", action="store_true", help="also write docs/data/bench_straggler.csv and the plot")
    args = p.parse_args(argv)
    machine = report_machine()
    plan = dict(h=args.h, outer=args.outer, val_windows=args.val_windows, budget_s=None)
    rows: List[Dict[str, Any]] = []
    budget = None
    for rep in range(args.repeats):
        for arm in ARMS:
            if arm.startswith("budget"):
                assert budget is not None
            res = spawn_workers(_worker, WORKERS, dict(plan, arm=arm, budget_s=budget), timeout_s=900)
            if arm == "fixed-h" and budget is None:
                budget = round(args.h * res["median_step_s"], 3)
                print(f"time budget: H x the median step time of fixed-h = {args.h} x {res['median_step_s']:.3f} s "
                      f"= {budget:.2f} s")
            new = _rows(arm, rep, res)
            rows += new
            last = new[-1]
            print(f"[{rep}] {arm:18s} {last['outer_step']} outer steps in {last['wall_s']:6.1f} s, held-out "
                  f"{last['val_bits_per_byte']:.4f} bits/byte, unslowed workers {last['tokens_per_s_others']:.0f} "
                  f"tokens/s, slow worker {last['tokens_per_s_slow']:.0f} tokens/s "
                  f"({last['inner_steps_others']:.1f} / {last['inner_steps_slow']} inner steps)")
    final = {a: [[r for r in rows if r["arm"] == a and r["repeat"] == k] for k in range(args.repeats)] for a in ARMS}
    tps = {a: statistics.median(run[-1]["tokens_per_s_others"] for run in final[a]) for a in ARMS}
    walls = [min(final["fixed-h-straggler"][k][-1]["wall_s"], final["budget-straggler"][k][-1]["wall_s"])
             for k in range(args.repeats)]
    loss_fixed = statistics.median(_loss_at(final["fixed-h-straggler"][k], walls[k]) for k in range(args.repeats))
    loss_budget = statistics.median(_loss_at(final["budget-straggler"][k], walls[k]) for k in range(args.repeats))
    ratio = tps["budget-straggler"] / tps["fixed-h"]
    print(f"\nunslowed workers' tokens/s (median of {args.repeats}): fixed-h {tps['fixed-h']:.0f}, fixed-h with a "
          f"straggler {tps['fixed-h-straggler']:.0f} ({tps['fixed-h-straggler'] / tps['fixed-h']:.0%}), time budget "
          f"with a straggler {tps['budget-straggler']:.0f} ({ratio:.0%})")
    print(f"held-out bits/byte at equal wall time ({statistics.median(walls):.1f} s): fixed H {loss_fixed:.4f}, "
          f"time budget {loss_budget:.4f}")
    print_targets([
        ("time budget with a straggler keeps the others' tokens/s >= 90% of the no-straggler run", ratio >= 0.9,
         f"{ratio:.0%}"),
        ("time budget reaches a lower loss at equal wall time than fixed H", loss_budget < loss_fixed,
         f"{loss_budget:.4f} vs {loss_fixed:.4f} bits/byte"),
    ])

    def plot(path: Path) -> Any:
        plt = pyplot("pip install matplotlib")
        if plt is None:
            return None
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for a, colour in zip(ARMS, ("tab:grey", "tab:red", "tab:blue")):
            for k, run in enumerate(final[a]):
                ax.plot([r["wall_s"] for r in run], [r["val_bits_per_byte"] for r in run], color=colour,
                        marker="o", ms=3, label=a if k == 0 else None, alpha=0.9 if k == 0 else 0.5)
        ax.set_xlabel("wall time, s (evaluations excluded)")
        finish_axes(ax, "held-out bits/byte", f"DiLoCo, 4 workers, rank {SLOW_RANK} slowed 2x in the straggler arms")
        return finish_figure(fig, f"bench_straggler: {machine['cpu']}, {machine['cores']} cores, torch "
                                  f"{machine['torch']}", path)

    summary = []
    for a in ARMS:
        runs = final[a]
        summary.append({
            "arm": a, "runs": len(runs), "outer steps": runs[0][-1]["outer_step"],
            "wall s": round(statistics.median(run[-1]["wall_s"] for run in runs), 1),
            "inner steps, unslowed / slow worker": f"{statistics.median(run[-1]['inner_steps_others'] for run in runs):.1f}"
                                                    f" / {statistics.median(run[-1]['inner_steps_slow'] for run in runs):.0f}",
            "unslowed workers' tokens/s": round(tps[a]), "vs fixed-h": f"{tps[a] / tps['fixed-h']:.0%}",
            "bits/byte at the end": round(statistics.median(run[-1]["val_bits_per_byte"] for run in runs), 4),
            f"bits/byte at {statistics.median(walls):.1f} s": round(statistics.median(
                _loss_at(run, walls[k]) for k, run in enumerate(runs)), 4)})
    for r in rows:
        r.update(cpu=machine["cpu"], cores=machine["cores"])
    write_outputs(Path(args.out), "bench_straggler", FIELDS + ["cpu", "cores"], rows, plot)
    if args.docs:
        docs = Path(__file__).resolve().parents[1] / "docs"
        write_outputs(docs / "data", "bench_straggler", FIELDS, [{k: r[k] for k in FIELDS} for r in rows])
        write_outputs(docs / "data", "bench_straggler_summary", list(summary[0]), summary)
        plot(docs / "bench_straggler.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
