"""A byte-level transformer LM on real text, every mode, on loopback and behind throttled links.

Each arm (torch DDP, DDP + PowerSGD, decent-dp 0.2.3, decentpy's topologies, int8, sharded int8)
trains the same model (``examples/lm``: the Python standard library's own source, byte-level, a
fixed held-out split) from the same initial weights with the same AdamW warm-up + cosine schedule,
global batch and token budget, on 4 worker processes (two simulated nodes of 2 on a throttled
link: :mod:`bench.common.netlink`), and is evaluated at least 8 times: held-out bits per byte of
the averaged model (``global_avg()`` first, as a user would evaluate) and the mean of the
workers' own models, against tokens, wall time and bytes sent. The training loop is the
example's own (:func:`examples.lm.loop.run_arm`): one implementation.

Two views of the same race. **Equal tokens** (the default): every arm trains ``--tokens``.
**Equal wall time** (``--race``), the race users run: per link a wall-clock budget ``T``
(``--budget-s``; default DDP's time for ``--tokens`` on that link); every arm first measures its own
throughput on that link (a short probe, :func:`examples.lm.loop.measure_throughput`), then trains
the tokens that fill ``T`` with its learning-rate schedule sized to them, so every arm ends its
schedule at ``T``; the summary compares the final held-out loss at equal wall time. ``--sweep``: a
small sweep per arm on a shorter budget (the inner lr x 0.5, 1, 2; for local steps the outer
lr/momentum among DiLoCo's (0.7, 0.9), plain averaging (1.0, 0) and (0.85, 0.5) between), written
to its own CSV; the other modes then run each arm at its best settings (``--settings``, default the
published sweep ``docs/data/bench_lm_sweep.csv``). Every row names its data split, its settings and
``budget_s`` (empty for equal-token runs).

Outputs (``--out``, default bench/out): ``bench_lm.csv`` (one row per arm, link, seed and
evaluation), ``bench_lm_summary.csv`` (per arm and link: final loss, mean of the seeds, against
torch DDP's; the time to the link's target loss -- DDP's held-out loss at its first evaluation at
or after 75% of the budget -- and its ratio to DDP's), and three plots: loss against tokens,
against wall time (one panel per link) and against bytes sent. ``--docs`` also copies the CSVs
and plots into docs/ (the Benchmarks page is generated from them).

    python -m bench.bench_lm [--arms ddp,aer,...] [--links loopback,100] [--seeds 0] [--tokens N]
        [--preset small|wide] [--race [--budget-s S]] [--sweep] [--data-split shuffle|shard] [--quick] [--docs]

Throttled links need root (network namespaces and tc); without it those links are skipped, said
once. Arms: see ``ARMS``; links: ``loopback`` or a rate in Mbit/s per node.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench.common.launch import OUT_DIR, bench_parser, spawn_workers
from bench.common.machine import report_machine
from bench.common.plots import finish_axes, finish_figure, pyplot
from bench.common.tables import check_choices, print_targets, write_csv

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 4

#: arm name -> the fields of examples.lm.loop.RunSpec it sets
ARMS: Dict[str, Dict[str, Any]] = {
    "ddp": dict(mode="ddp"),
    "ddp-powersgd": dict(mode="ddp-powersgd"),
    "decent-dp-ring": dict(mode="decent-dp", topology="ring"),
    "decent-dp-aer": dict(mode="decent-dp", topology="alternating-exp-ring"),
    "complete": dict(mode="decentpy", topology="complete"),
    "ring": dict(mode="decentpy", topology="ring"),
    "one-peer-exp": dict(mode="decentpy", topology="one-peer-exp"),
    "aer": dict(mode="decentpy", topology="alternating-exp-ring"),
    "aer-int8": dict(mode="decentpy", topology="alternating-exp-ring", compression="int8"),
    "shard-aer-int8": dict(mode="decentpy", topology="alternating-exp-ring", compression="int8", intra_node="shard"),
    # local steps (DiLoCo): H inner steps, then the outer Nesterov step; 'complete' = DiLoCo's exact mean
    "diloco-8": dict(mode="decentpy", topology="complete", local_steps=8),
    "diloco-32": dict(mode="decentpy", topology="complete", local_steps=32),
    "diloco-32-aer": dict(mode="decentpy", topology="alternating-exp-ring", local_steps=32),
    # the outer exchange compressed: int8 pseudo-gradients with error feedback (complete topology)
    "diloco-32-int8": dict(mode="decentpy", topology="complete", local_steps=32, compression="int8"),
    "diloco-128": dict(mode="decentpy", topology="complete", local_steps=128),
    "diloco-128-int8": dict(mode="decentpy", topology="complete", local_steps=128, compression="int8"),
    "diloco-32-random-pairs": dict(mode="decentpy", topology="random-pairs", local_steps=32),
    # NoLoCo (Kolehmainen et al. 2025): one random peer per outer step, heavy-ball momentum 0.5 pulling
    # each replica's own global copy towards its peer's (decentpy.LocalSteps.noloco), at DiLoCo's H
    "noloco-32": dict(mode="decentpy", topology="random-pairs", local_steps=32, outer_rule="noloco"),
    # SparseLoCo (Sarfi et al. 2025): 64 of every 4096 entries of the error-fed pseudo-gradient in 2 bits,
    # averaged exactly (an all-gather), the outer step theta - mean (decentpy.LocalSteps.sparseloco)
    "sparseloco-32": dict(mode="decentpy", topology="complete", local_steps=32, outer_rule="sparseloco"),
    # the same messages in a gossip outer step (decentpy's own: CHOCO on [theta; delta] against public
    # copies, one random peer per outer step as NoLoCo's), consensus step size decentpy's default
    "sparseloco-32-random-pairs": dict(mode="decentpy", topology="random-pairs", local_steps=32,
                                       outer_rule="sparseloco"),
    # compressed gossip outer steps (CHOCO on [theta; delta], int8) and H=128 on the gossip topologies
    "diloco-32-aer-int8": dict(mode="decentpy", topology="alternating-exp-ring", local_steps=32, compression="int8"),
    "diloco-32-random-pairs-int8": dict(mode="decentpy", topology="random-pairs", local_steps=32,
                                        compression="int8"),
    "diloco-128-aer": dict(mode="decentpy", topology="alternating-exp-ring", local_steps=128),
    "diloco-128-aer-int8": dict(mode="decentpy", topology="alternating-exp-ring", local_steps=128,
                                compression="int8"),
    "diloco-128-random-pairs": dict(mode="decentpy", topology="random-pairs", local_steps=128),
    "diloco-128-random-pairs-int8": dict(mode="decentpy", topology="random-pairs", local_steps=128,
                                         compression="int8"),
    # Streaming DiLoCo: 4 fragments, one every 8 steps, each exchange in flight over 2 inner steps
    # and merged with alpha 0.5 (the Streaming DiLoCo paper's tau and alpha range)
    "diloco-32-streaming-4": dict(mode="decentpy", topology="complete", local_steps=32, fragments=4,
                                  fragment_sync_delay=2, fragment_update_alpha=0.5),
    # remedies for the per-worker Adam gap (each worker's AdamW sees a quarter batch): average the
    # second moment, or both moments, over the workers every k steps (decentpy.OptimizerStateAveraging);
    # they take the plain arm's best settings
    **{f"complete-avg-{tag}-{k}": dict(mode="decentpy", topology="complete", state_avg_every=k, state_avg=states)
       for tag, states in (("v", "exp_avg_sq"), ("mv", "exp_avg,exp_avg_sq")) for k in (1, 16)},
    # two replicas of two ranks (gradients all-reduced inside each simulated node, the replicas mixed
    # by the pair): against four plain workers on 'complete' (the plain arm's settings)
    "complete-2x2": dict(mode="decentpy", topology="complete", intra_node="allreduce"),
    # the anchor: torchft 0.2.0's own DiLoCo at the same H (a stand-in Manager, no Lighthouse)
    "torchft-diloco-32": dict(mode="torchft-diloco", local_steps=32),
}
DEFAULT_ARMS = ("ddp", "aer", "aer-int8", "shard-aer-int8", "decent-dp-aer")
#: the race's default arms (``make bench-lm``: the default race fits in 30 minutes on 2 cores)
RACE_ARMS = ("ddp", "aer-int8", "diloco-32-streaming-4", "decent-dp-aer")
#: the sweep's arms: every arm of the published race
SWEEP_ARMS = ("ddp", "complete", "aer", "aer-int8", "decent-dp-aer", "diloco-32", "diloco-32-streaming-4")
#: the sweep: inner lr multipliers of the preset's, and the outer (lr, momentum) of local-steps arms
SWEEP_LR = (0.5, 1.0, 2.0)
SWEEP_OUTER = ((0.7, 0.9), (1.0, 0.0), (0.85, 0.5))
#: the published sweep the other modes take each arm's best settings from (``--settings``)
SETTINGS = ROOT / "docs" / "data" / "bench_lm_sweep.csv"
DEFAULT_LINKS = ("loopback", "100")
#: held-out loss within this fraction of DDP's at equal tokens (compressed every-step gossip)
QUALITY = {"int8": 0.03}


def arm_name(row: Dict[str, Any]) -> str:
    """The ``ARMS`` key of a result row."""
    for name, fields in ARMS.items():
        if (all(str(row.get(k) or ("none" if k == "compression" else "")) == str(v) for k, v in fields.items()
               if k not in ("mode", "fragment_sync_delay", "fragment_update_alpha", "state_avg_every", "state_avg"))
                and fields["mode"] == row["mode"]):
            if int(row.get("fragments") or 1) != int(fields.get("fragments", 1)):
                continue
            if row["mode"] == "decentpy" and row.get("intra_node", "gossip") != fields.get("intra_node", "gossip"):
                continue
            if row["mode"] == "decentpy" and (row.get("compression") or "none") != fields.get("compression", "none"):
                continue
            if int(row.get("local_steps") or 1) != int(fields.get("local_steps", 1)):
                continue
            if (row.get("outer_rule") or "diloco") != fields.get("outer_rule", "diloco"):
                continue
            if (row.get("state_averaging") or "") != (f"{fields['state_avg']}/{fields['state_avg_every']}"
                                                      if fields.get("state_avg_every") else ""):
                continue
            return name
    return f"{row['mode']}-{row.get('topology')}"


def link_label(mbit: Optional[float]) -> str:
    return "loopback" if mbit is None else f"{mbit:g} Mbit/s"


def _worker(rank: int, world: int, plan: Dict[str, Any]) -> Any:
    import torch

    from examples.lm.corpus import load_corpus
    from examples.lm.loop import RunSpec, measure_throughput, run_arm

    torch.set_num_threads(1)
    corpus = load_corpus(plan.get("corpus"))
    if "probes" in plan:  # every arm's throughput on this link, one after the other in one group
        return [measure_throughput(RunSpec(**spec), corpus, torch.device("cpu")) for spec in plan["probes"]]
    return run_arm(RunSpec(**plan["spec"]), corpus, torch.device("cpu"))


def _spawn_on_link(plan: Dict[str, Any], mbit: Optional[float], timeout: float) -> List[Any]:
    """The four workers on one link (loopback, or two simulated nodes behind ``mbit`` per node), each
    running :func:`_worker` with ``plan``; their results."""
    if mbit is None:
        return spawn_workers(_worker, WORKERS, plan, timeout, pg_timeout_s=timeout)
    from bench.common.netlink import ThrottledNetwork
    with ThrottledNetwork(WORKERS, mbit, "two-nodes") as net:
        return spawn_workers(_worker, WORKERS, plan, timeout, pg_timeout_s=timeout, net=net)


def run_one(spec: Dict[str, Any], mbit: Optional[float], corpus: Optional[str], timeout: float) -> List[Dict[str, Any]]:
    """One arm, one seed, on one link: the rows of its evaluations."""
    return _spawn_on_link({"spec": dict(spec, link_mbit=mbit), "corpus": corpus}, mbit, timeout)


def probe_link(specs: Dict[str, Dict[str, Any]], mbit: Optional[float], corpus: Optional[str],
               timeout: float) -> Dict[str, Dict[str, float]]:
    """Every arm's throughput on one link (:func:`examples.lm.loop.measure_throughput`), measured one
    after the other by the same four workers: ``{arm: {"tokens_per_s", "s_per_step", "steps"}}``."""
    got = _spawn_on_link({"probes": [dict(s, link_mbit=mbit) for s in specs.values()], "corpus": corpus}, mbit,
                         timeout)
    return dict(zip(specs, got))


#: a sweep's setting of an arm: (arm, inner peak lr, outer lr, outer momentum)
SweepKey = Tuple[str, float, Optional[float], Optional[float]]


def sweep_finals(rows: Sequence[Dict[str, Any]]) -> Dict[SweepKey, List[float]]:
    """A sweep's final held-out loss per arm and setting, one per seed (each run's last evaluation)."""
    last: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for r in rows:
        key = (arm_name(r), r["seed"], r.get("peak_lr"), r.get("outer_lr"), r.get("outer_momentum"))
        if key not in last or r["tokens"] > last[key]["tokens"]:
            last[key] = r
    finals: Dict[SweepKey, List[float]] = defaultdict(list)
    for (arm, _seed, lr, olr, om), r in last.items():
        finals[(arm, float(lr), _num(olr), _num(om))].append(float(r["val_bits_per_byte"]))
    return finals


def best_of(finals: Dict[SweepKey, List[float]]) -> Dict[str, SweepKey]:
    """Each arm's setting with the lowest final loss, mean over its seeds."""
    best: Dict[str, Tuple[float, SweepKey]] = {}
    for key, vs in finals.items():
        score = statistics.mean(vs)
        if key[0] not in best or score < best[key[0]][0]:
            best[key[0]] = (score, key)
    return {arm: v[1] for arm, v in best.items()}


def best_settings(path: Path) -> Dict[str, Dict[str, Any]]:
    """Each arm's best settings in a sweep's CSV (the lowest final held-out loss, mean over its seeds):
    ``{arm: {"lr", "outer_lr", "outer_momentum"}}`` (the outer ones for local-steps arms)."""
    if not path.is_file():
        return {}
    out: Dict[str, Dict[str, Any]] = {}
    for arm, (_, lr, olr, om) in best_of(sweep_finals(read_rows(path))).items():
        out[arm] = {"lr": lr} if olr is None else {"lr": lr, "outer_lr": olr, "outer_momentum": om}
    return out


def _num(v: Any) -> Optional[float]:
    return None if v in (None, "", "None") else float(v)


def sweep_variants(arm: str, base_lr: float) -> List[Dict[str, Any]]:
    """The sweep's settings of ``arm``: the inner lr x :data:`SWEEP_LR`, and for local steps x the outer
    settings :data:`SWEEP_OUTER`."""
    outer = SWEEP_OUTER if ARMS[arm].get("local_steps", 1) > 1 or ARMS[arm]["mode"] == "torchft-diloco" else (None,)
    out = []
    for m in SWEEP_LR:
        for o in outer:
            v: Dict[str, Any] = {"lr": base_lr * m}
            if o is not None:
                v.update(outer_lr=o[0], outer_momentum=o[1])
            out.append(v)
    return out


def target_loss(ddp_rows: Sequence[Dict[str, Any]]) -> Optional[float]:
    """DDP's held-out loss at its first evaluation at or after 75% of the token budget."""
    if not ddp_rows:
        return None
    budget = max(r["tokens"] for r in ddp_rows)
    late = [r for r in sorted(ddp_rows, key=lambda r: r["tokens"]) if r["tokens"] >= 0.75 * budget]
    return float(late[0]["val_bits_per_byte"]) if late else None


def time_to(rows: Sequence[Dict[str, Any]], loss: float) -> Optional[float]:
    """Wall seconds at which the held-out loss first reaches ``loss``, interpolated linearly between
    the two evaluations around it (None: never reached)."""
    prev = None
    for r in sorted(rows, key=lambda r: r["tokens"]):
        t, v = float(r["wall_s"]), float(r["val_bits_per_byte"])
        if v <= loss:
            if prev is None or prev[1] == v:
                return t
            return prev[0] + (prev[1] - loss) / (prev[1] - v) * (t - prev[0])
        prev = (t, v)
    return None


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (link, arm): final held-out loss (mean over seeds), its gap to DDP's, the time to the
    link's target loss (mean over seeds that reach it) and DDP's time over it."""
    runs: Dict[Tuple[Optional[float], str, int], List[Dict[str, Any]]] = defaultdict(list)
    for r in rows:
        runs[(r["link_mbit"], arm_name(r), r["seed"])].append(r)
    out = []
    for link in dict.fromkeys(k[0] for k in runs):
        ddp_runs = [v for (lk, a, _), v in runs.items() if lk == link and a == "ddp"]
        targets = [t for t in (target_loss(v) for v in ddp_runs) if t is not None]
        target = statistics.mean(targets) if targets else None
        ddp_final = statistics.mean(max(v, key=lambda r: r["tokens"])["val_bits_per_byte"] for v in ddp_runs) \
            if ddp_runs else None
        ddp_time = None
        if target is not None:
            times = [t for t in (time_to(v, target) for v in ddp_runs) if t is not None]
            ddp_time = statistics.mean(times) if times else None
        arms = list(dict.fromkeys(k[1] for k in runs if k[0] == link))
        # the loss every arm of the link reached (the worst final loss, mean over seeds): a wall-time
        # comparison that exists even where an arm never reaches DDP's target (an arm one of whose
        # seeds stops short of it shows none)
        # (over the every-step arms: a local-steps arm far behind would move it to early training; such
        # an arm shows a time only where it reaches that loss)
        every_step = [a for a in arms if ARMS.get(a, {}).get("local_steps", 1) == 1] or arms
        common = max(statistics.mean(float(max(v, key=lambda r: r["tokens"])["val_bits_per_byte"])
                                     for (lk, a, _), v in runs.items() if lk == link and a == arm)
                     for arm in every_step)

        def mean_time(arm: str, loss: float) -> Optional[float]:
            ts = [time_to(v, loss) for (lk, a, _), v in runs.items() if lk == link and a == arm]
            return statistics.mean(ts) if ts and all(t is not None for t in ts) else None  # type: ignore[arg-type]

        ddp_common = mean_time("ddp", common)
        for arm in arms:
            seeds = [v for (lk, a, _), v in runs.items() if lk == link and a == arm]
            finals = [max(v, key=lambda r: r["tokens"]) for v in seeds]
            final = statistics.mean(float(f["val_bits_per_byte"]) for f in finals)
            reach = [time_to(v, target) for v in seeds] if target is not None else []
            reached = [t for t in reach if t is not None]
            t_arm = statistics.mean(reached) if reached and len(reached) == len(seeds) else None
            out.append({
                "link": link_label(link), "arm": arm, "seeds": len(seeds),
                "final_val_bits_per_byte": final,
                "final_val_workers_mean": statistics.mean(float(f["val_bits_per_byte_workers_mean"]) for f in finals),
                "vs_ddp_final": None if ddp_final is None else final / ddp_final - 1.0,
                "wall_s": statistics.mean(float(f["wall_s"]) for f in finals),
                "bytes_sent_per_worker": statistics.mean(float(f["bytes_sent_per_worker"]) for f in finals),
                "target_val_bits_per_byte": target, "time_to_target_s": t_arm,
                "speedup_vs_ddp_to_target": None if (t_arm is None or ddp_time is None) else ddp_time / t_arm,
                "common_val_bits_per_byte": common, "time_to_common_s": mean_time(arm, common),
                "speedup_vs_ddp_to_common": None if (ddp_common is None or mean_time(arm, common) is None) else
                ddp_common / mean_time(arm, common),  # type: ignore[operator]
            })
    return out


def race_summary(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The race (rows with a ``budget_s``): per link and arm, the final held-out loss at equal wall time
    (mean over seeds, with their range), its gap to DDP's on that link and to decent-dp's on the same
    topology, the tokens the arm trained in the budget and the wall time it took."""
    runs: Dict[Tuple[Optional[float], str, int], List[Dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("budget_s") not in (None, "", "None"):
            runs[(r["link_mbit"], arm_name(r), r["seed"])].append(r)
    out: List[Dict[str, Any]] = []
    for link in dict.fromkeys(k[0] for k in runs):
        finals: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
        for (lk, arm, _), v in runs.items():
            if lk == link:
                finals[arm].append(max(v, key=lambda r: r["tokens"]))
        mean = {a: statistics.mean(float(f["val_bits_per_byte"]) for f in fs) for a, fs in finals.items()}
        for arm, fs in finals.items():
            losses = [float(f["val_bits_per_byte"]) for f in fs]
            rival = _decent_dp_rival(arm)
            out.append({
                "link": link_label(link), "arm": arm, "seeds": len(fs),
                "budget_s": statistics.mean(float(f["budget_s"]) for f in fs),
                "tokens": statistics.mean(float(f["tokens"]) for f in fs),
                "wall_s": statistics.mean(float(f["wall_s"]) for f in fs),
                "final_val_bits_per_byte": mean[arm], "min": min(losses), "max": max(losses),
                "vs_ddp": mean[arm] / mean["ddp"] - 1.0 if "ddp" in mean else None,
                "decent_dp_rival": rival if rival in mean else None,
                "vs_decent_dp": mean[arm] / mean[rival] - 1.0 if rival in mean else None,
                "bytes_sent_per_worker": statistics.mean(float(f["bytes_sent_per_worker"]) for f in fs),
            })
    return out


def _decent_dp_rival(arm: str) -> Optional[str]:
    """decent-dp's arm on the topology of decentpy's ``arm`` (None: decent-dp has none, or not decentpy)."""
    fields = ARMS.get(arm, {})
    if fields.get("mode") != "decentpy":
        return None
    return next((a for a, f in ARMS.items() if f["mode"] == "decent-dp" and f["topology"] == fields["topology"]), None)


def race_targets(race: Sequence[Dict[str, Any]], preset: str) -> List[Tuple[str, Optional[bool], str]]:
    """The race's targets (issue 53), each with its measured figure."""
    out: List[Tuple[str, Optional[bool], str]] = []
    slow = [r for r in race if r["link"] == "100 Mbit/s" and r["vs_ddp"] is not None
            and ARMS.get(r["arm"], {}).get("mode") == "decentpy"]
    if not slow:
        return out
    want = 0.10 if preset == "wide" else 0.08
    best = min(slow, key=lambda r: r["vs_ddp"])
    out.append((f"100 Mbit/s, equal wall time ({preset}): the best decentpy arm >= {100 * want:.0f}% below DDP's "
                f"held-out loss", best["vs_ddp"] <= -want, f"{best['arm']} {100 * best['vs_ddp']:+.1f}%"))
    worst = max(slow, key=lambda r: r["vs_ddp"])
    out.append(("100 Mbit/s, equal wall time: every decentpy arm below DDP's", worst["vs_ddp"] < 0,
                f"worst {worst['arm']} {100 * worst['vs_ddp']:+.1f}%"))
    rivals = [r for r in slow if r["vs_decent_dp"] is not None]
    if rivals:
        w = max(rivals, key=lambda r: r["vs_decent_dp"])
        out.append(("100 Mbit/s, equal wall time: every decentpy arm below decent-dp's on its topology",
                    w["vs_decent_dp"] < 0, f"worst {w['arm']} {100 * w['vs_decent_dp']:+.1f}% vs {w['decent_dp_rival']}"))
    return out


def quality_limit(arm: str) -> float:
    """The equal-token target of a decentpy arm, as a fraction of DDP's final loss (issue 53, each arm at
    its best settings): the complete topology (and its Adam remedies) 1%, every-step gossip 2.5%, int8
    3%, Streaming DiLoCo 3%, other local steps (DiLoCo H=32) 5%."""
    fields = ARMS[arm]
    if fields.get("local_steps", 1) > 1:
        return 0.03 if fields.get("fragments", 1) > 1 else 0.05
    if fields.get("compression", "none") != "none":
        return QUALITY.get(fields["compression"], 0.03)
    return 0.01 if fields.get("topology") == "complete" else 0.025


def targets(summary: Sequence[Dict[str, Any]]) -> List[Tuple[str, Optional[bool], str]]:
    """The issue's targets, each with its measured figure (None: not measured in this run)."""
    out: List[Tuple[str, Optional[bool], str]] = []
    loop = [s for s in summary if s["link"] == "loopback" and s["arm"] != "ddp" and s["vs_ddp_final"] is not None]
    for s in loop:
        if ARMS.get(s["arm"], {}).get("mode") != "decentpy":
            continue
        lim = quality_limit(s["arm"])
        out.append((f"{s['arm']}: final held-out loss within {100 * lim:g}% of DDP's (loopback, mean of "
                    f"{s['seeds']} seed(s))", s["vs_ddp_final"] <= lim, f"{100 * s['vs_ddp_final']:+.1f}%"))
    by_arm = {s["arm"]: s for s in loop}
    if "complete-2x2" in by_arm and "complete" in by_arm:
        a, b = by_arm["complete-2x2"], by_arm["complete"]
        out.append(("two replicas of two (complete-2x2) no worse than four plain workers (complete), loopback",
                    a["final_val_bits_per_byte"] <= b["final_val_bits_per_byte"],
                    f"{a['final_val_bits_per_byte']:.4f} vs {b['final_val_bits_per_byte']:.4f}"))
    slow = {s["arm"]: s for s in summary if s["link"] == "100 Mbit/s"}
    for arm, want in (("aer", 2.0), ("shard-aer-int8", 3.0)):
        s = slow.get(arm)
        sp = None if s is None else s["speedup_vs_ddp_to_target"]
        out.append((f"100 Mbit/s: {arm} reaches the target loss >= {want:g}x sooner than DDP",
                    None if s is None else (sp is not None and sp >= want),
                    "not run" if s is None else ("target not reached" if sp is None else f"{sp:.2f}x")))
    for mine, theirs in (("aer", "decent-dp-aer"), ("ring", "decent-dp-ring")):
        a, b = slow.get(mine), slow.get(theirs)
        if a is None or b is None:
            continue
        # DDP's target where either reaches it, else the loss every run of the link reached
        key, what = (("time_to_target_s", "the target") if a["time_to_target_s"] is not None or
                     b["time_to_target_s"] is not None else ("time_to_common_s", "the loss every arm reached"))
        ta, tb = a[key], b[key]
        ok = ta is not None and (tb is None or ta < tb)
        out.append((f"100 Mbit/s: decentpy {mine} reaches {what} sooner than decent-dp's", ok,
                    f"{'-' if ta is None else f'{ta:.1f}'} s vs {'-' if tb is None else f'{tb:.1f}'} s"))
    return out


def plot(rows: Sequence[Dict[str, Any]], path: Path, machine: str) -> Optional[Path]:
    """Held-out loss against tokens (loopback), wall time (one panel per link) and bytes sent."""
    plt = pyplot("pip install matplotlib")
    if plt is None:
        return None
    links = list(dict.fromkeys(r["link_mbit"] for r in rows))
    fig, axes = plt.subplots(1, 2 + len(links), figsize=(5 * (2 + len(links)), 4.2))
    series: Dict[Tuple[Optional[float], str], Dict[int, List[Dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        series[(r["link_mbit"], arm_name(r))][r["seed"]].append(r)

    def curve(seeds: Dict[int, List[Dict[str, Any]]], x: str) -> Tuple[List[float], List[float]]:
        runs = [sorted(v, key=lambda r: r["tokens"]) for v in seeds.values()]
        n = min(len(v) for v in runs)
        xs = [statistics.mean(float(v[i][x]) for v in runs) for i in range(n)]
        ys = [statistics.mean(float(v[i]["val_bits_per_byte"]) for v in runs) for i in range(n)]
        return xs, ys

    base = links[0]
    # one colour per arm in every panel (tab20: more arms than the default cycle), dashed for local steps
    names = list(dict.fromkeys(arm for _, arm in series))
    colour = {a: plt.cm.tab20(i % 20) for i, a in enumerate(names)}
    style = {a: "--" if ARMS.get(a, {}).get("local_steps", 1) > 1 else "-" for a in names}
    for (link, arm), seeds in series.items():
        kw = dict(marker=".", label=arm, color=colour[arm], linestyle=style[arm])
        if link == base:
            axes[0].plot(*curve(seeds, "tokens"), **kw)
            axes[1].plot(*curve(seeds, "bytes_sent_per_worker"), **kw)
        axes[2 + links.index(link)].plot(*curve(seeds, "wall_s"), **kw)
    # the region where the arms differ: from below the best final loss to above the worst (the first
    # evaluation, at ~8 bits/byte, is off the top)
    finals = [float(max(v, key=lambda r: r["tokens"])["val_bits_per_byte"]) for sd in series.values() for v in sd.values()]
    for ax in axes:
        ax.set_ylim(min(finals) - 0.1, max(finals) + 0.8)
    axes[1].set_xscale("log")
    finish_axes(axes[0], "held-out bits per byte", f"against tokens ({link_label(base)})", legend_size=7)
    axes[0].set_xlabel("tokens")
    finish_axes(axes[1], "held-out bits per byte", f"against bytes sent per worker ({link_label(base)})",
                legend_size=7)
    axes[1].set_xlabel("bytes sent per worker")
    for i, link in enumerate(links):
        budgets = sorted({float(r["budget_s"]) for r in rows
                          if r["link_mbit"] == link and r.get("budget_s") not in (None, "", "None")})
        for b in budgets:  # the race's wall-clock budget: every arm's schedule ends there
            axes[2 + i].axvline(b, color="grey", linestyle=":", linewidth=1)
            axes[2 + i].annotate(f"T = {b:.0f} s", (b, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                                 ha="right", va="top", rotation=90)
        finish_axes(axes[2 + i], "held-out bits per byte", f"against wall time, {link_label(link)}", legend_size=7)
        axes[2 + i].set_xlabel("training wall seconds")
    return finish_figure(fig, f"byte-level LM, {WORKERS} workers, {machine}", path)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--arms", default=None, help=f"comma-separated, from {','.join(ARMS)} (default: "
                   f"{','.join(DEFAULT_ARMS)}; --race: {','.join(RACE_ARMS)}; --sweep: {','.join(SWEEP_ARMS)})")
    p.add_argument("--links", default=",".join(DEFAULT_LINKS),
                   help="comma-separated: loopback, or a per-node rate in Mbit/s (two simulated nodes of 2 workers)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--preset", default="small", choices=("small", "wide"))
    p.add_argument("--tokens", type=int, default=None,
                   help="token budget per run (global; default 1M, 500k for --sweep; --race: DDP's budget that sets T)")
    p.add_argument("--evals", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--corpus", default=None, help="a file or directory of text (default: the stdlib's *.py)")
    p.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--docs", action="store_true", help="also copy the CSVs and the plot into docs/")
    p.add_argument("--docs-name", default="bench_lm",
                   help="the published files' name: docs/data/NAME.csv, NAME_summary.csv, docs/NAME.png (another "
                        "preset's table beside the default one)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-csv", default=None, metavar="PATH[,PATH...]",
                   help="train nothing: summarise, plot (and with --docs publish) the rows of earlier runs' "
                        "bench_lm.csv files (comma-separated: e.g. one run per seed or per link, merged)")
    p.add_argument("--race", action="store_true",
                   help="equal wall time: per link a budget T (--budget-s, default DDP's time for --tokens there); "
                        "each arm probes its throughput on the link and trains the tokens that fill T")
    p.add_argument("--budget-s", type=float, default=None,
                   help="--race: the wall-clock budget in seconds on every link (default: DDP's time for --tokens on "
                        "each link, from its probe)")
    p.add_argument("--sweep", action="store_true",
                   help="each arm's sweep (inner lr x 0.5/1/2; local steps x 3 outer settings) on loopback at "
                        "--tokens (default 500k here), written to bench_lm_sweep.csv")
    p.add_argument("--settings", default=str(SETTINGS),
                   help="a sweep's CSV: each arm runs at its best settings there ('none': the preset's)")
    p.add_argument("--data-split", default="shuffle", choices=("shuffle", "shard"),
                   help="the whole training text shuffled over the ranks (as DistributedSampler), or a contiguous "
                        "shard per rank (the heterogeneous stress case)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="every arm clips its gradients to this norm (0: none)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="the learning-rate warm-up in steps (default: 5%% of the run's steps)")
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: ddp and aer on loopback, 2 evaluations of a tiny budget (with --race: a tiny "
                        "budget in seconds)")
    args = p.parse_args(argv)
    if args.arms is None:
        args.arms = ",".join(SWEEP_ARMS if args.sweep else RACE_ARMS if args.race else DEFAULT_ARMS)
    if args.tokens is None:
        args.tokens = 500_000 if args.sweep else 1_000_000
    if args.quick:
        args.arms, args.links, args.tokens, args.evals = "ddp,aer", "loopback", 4096 * 3, 2
        if args.race and args.budget_s is None:
            args.budget_s = 4.0
    if args.race and args.sweep:
        p.error("--race and --sweep are two runs: sweep first (it writes the settings the race takes)")
    return args


def settings_arm(arm: str) -> str:
    """The arm whose swept settings ``arm`` takes when it has none of its own: a remedy arm, or two
    replicas of two ranks, take the plain arm's (the same fields without the state averaging, or
    without ``intra_node='allreduce'``)."""
    fields = {k: v for k, v in ARMS[arm].items() if k not in ("state_avg_every", "state_avg")
              and (k, v) != ("intra_node", "allreduce")}
    return next((a for a, f in ARMS.items() if f == fields), arm)


def _spec(arm: str, args: argparse.Namespace, seed: int, settings: Dict[str, Dict[str, Any]],
          **over: Any) -> Dict[str, Any]:
    """The RunSpec fields of ``arm``: its ARMS entry, the run's options, its best settings (a sweep's),
    then ``over``."""
    spec = dict(ARMS[arm], preset=args.preset, tokens=args.tokens, seed=seed, evals=args.evals,
                data_split=args.data_split, grad_clip=args.grad_clip, warmup_steps=args.warmup_steps)
    if args.lr is not None:
        spec["lr"] = args.lr
    spec.update(settings.get(arm, settings.get(settings_arm(arm), {})))
    spec.update(over)
    return spec


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    check_choices(arms, list(ARMS), "--arms")
    links: List[Optional[float]] = []
    for tok in (t for t in args.links.split(",") if t):
        links.append(None if tok == "loopback" else float(tok))
    if args.sweep:
        links = [None]  # equal tokens: the loss does not depend on the link
    seeds = [int(s) for s in args.seeds.split(",") if s]
    machine = report_machine("decent-dp")
    if any(link is not None for link in links):
        from bench.common.netlink import unavailable_reason
        why = unavailable_reason()
        if why is not None:
            print(f"throttled links skipped: {why}")
            links = [link for link in links if link is None]
    settings: Dict[str, Dict[str, Any]] = {}
    if not args.sweep and not args.from_csv and args.settings != "none":
        settings = best_settings(Path(args.settings))
        print(f"settings: {'each arm at its best in ' + args.settings if settings else 'the preset (no sweep)'}"
              + "".join(f"\n  {a}: " + ", ".join(f"{k} {v:g}" for k, v in settings[a].items()) for a in arms
                        if a in settings))
    rows: List[Dict[str, Any]] = []
    if args.from_csv:
        for path in (p for p in args.from_csv.split(",") if p):
            rows += read_rows(Path(path))
        machines = list(dict.fromkeys(r.get("machine", "") for r in rows))
        machine_line = "; ".join(m for m in machines if m)
    else:
        from examples.lm.corpus import load_corpus
        print(load_corpus(args.corpus).describe())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from examples.lm.loop import COLUMNS, RunSpec, schedule, tokens_for_budget
    stamp = {"machine": machine_line if args.from_csv else
             f"{machine.get('cpu', '')}, {machine.get('cores', '')} cores, torch {machine.get('torch', '')}"}
    csv_name = "bench_lm_sweep.csv" if args.sweep else "bench_lm.csv"

    def stamped(rs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
        # a row read back keeps the machine it was measured on (merged runs may come from several)
        return [dict(r, machine=r.get("machine") or stamp["machine"]) for r in rs]

    # the runs: (link, seed, arm, spec, label) in order; the race first sizes each arm's tokens on each link
    plan: List[Tuple[Optional[float], int, str, Dict[str, Any], str]] = []
    if not args.from_csv:
        for link in links:
            if args.race:
                probe_arms = list(dict.fromkeys(["ddp"] + arms))
                specs = {a: _spec(a, args, seeds[0], settings) for a in probe_arms}
                t0 = time.perf_counter()
                tps = probe_link(specs, link, args.corpus, args.timeout)
                per_step = schedule(RunSpec(**specs["ddp"])).tokens_per_step
                budget = args.budget_s if args.budget_s is not None else args.tokens / tps["ddp"]["tokens_per_s"]
                print(f"race on {link_label(link)}: T = {budget:.1f} s "
                      f"({'--budget-s' if args.budget_s is not None else f'DDP for {args.tokens:,} tokens'}); "
                      f"probes ({time.perf_counter() - t0:.0f} s): " + ", ".join(
                          f"{a} {v['tokens_per_s']:,.0f} tok/s" for a, v in tps.items()), flush=True)
            for seed in seeds:
                for arm in arms:
                    if args.sweep:
                        base = RunSpec(**_spec(arm, args, seed, {})).model_config().lr
                        for v in sweep_variants(arm, base):
                            plan.append((link, seed, arm, _spec(arm, args, seed, {}, **v),
                                         ", ".join(f"{k} {x:g}" for k, x in v.items())))
                    elif args.race:
                        tokens = tokens_for_budget(budget, tps[arm]["tokens_per_s"], per_step)
                        plan.append((link, seed, arm, _spec(arm, args, seed, settings, tokens=tokens, budget_s=budget),
                                     f"{tokens:,} tokens in T"))
                    else:
                        plan.append((link, seed, arm, _spec(arm, args, seed, settings), ""))
    for done, (link, seed, arm, spec, label) in enumerate(plan, 1):
        t0 = time.perf_counter()
        got = run_one(spec, link, args.corpus, args.timeout)
        last = max(got, key=lambda r: r["tokens"])
        print(f"[{done}/{len(plan)}] {arm:16} {link_label(link):11} seed {seed}{' (' + label + ')' if label else ''}: "
              f"held-out {last['val_bits_per_byte']:.4f} bits/byte after {last['tokens']} tokens, train wall "
              f"{last['wall_s']:.1f} s, {last['bytes_sent_per_worker'] / 2**20:.1f} MiB sent per worker "
              f"({time.perf_counter() - t0:.0f} s in all)", flush=True)
        rows += got
        # after every run, so that a run cut short (a restart, a timeout) keeps what it measured
        write_csv(out / csv_name, list(COLUMNS) + ["machine"], stamped(rows))
    if args.sweep:
        return _sweep_report(rows, out, args, stamped)
    equal = [r for r in rows if r.get("budget_s") in (None, "", "None")]
    summary = summarize(equal) if equal else []
    if summary:
        print(f"\nequal tokens:\n{'link':11} {'arm':16} {'final bits/byte':>15} {'vs DDP':>8} {'to target s':>12} "
              f"{'speedup':>8} {'to common s':>12} {'speedup':>8}")
    for s in summary:
        vs = "" if s["vs_ddp_final"] is None else f"{100 * s['vs_ddp_final']:+.1f}%"
        tt = "-" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.1f}"
        sp = "-" if s["speedup_vs_ddp_to_target"] is None else f"{s['speedup_vs_ddp_to_target']:.2f}x"
        tc = "-" if s["time_to_common_s"] is None else f"{s['time_to_common_s']:.1f}"
        sc = "-" if s["speedup_vs_ddp_to_common"] is None else f"{s['speedup_vs_ddp_to_common']:.2f}x"
        print(f"{s['link']:11} {s['arm']:16} {s['final_val_bits_per_byte']:15.4f} {vs:>8} {tt:>12} {sp:>8}"
              f" {tc:>12} {sc:>8}")
    race = race_summary(rows)
    if race:
        print(f"\nequal wall time (the race):\n{'link':11} {'arm':22} {'T s':>6} {'tokens':>9} {'wall s':>7} "
              f"{'final bits/byte':>15} {'range':>15} {'vs DDP':>8} {'vs decent-dp':>13}")
    for r in race:
        vs = "" if r["vs_ddp"] is None else f"{100 * r['vs_ddp']:+.1f}%"
        vd = "" if r["vs_decent_dp"] is None else f"{100 * r['vs_decent_dp']:+.1f}%"
        print(f"{r['link']:11} {r['arm']:22} {r['budget_s']:6.0f} {r['tokens']:9,.0f} {r['wall_s']:7.1f} "
              f"{r['final_val_bits_per_byte']:15.4f} {r['min']:7.4f}-{r['max']:.4f} {vs:>8} {vd:>13}")
    print_targets(targets(summary) + race_targets(race, args.preset))
    if not args.from_csv:
        write_csv(out / "bench_lm.csv", list(COLUMNS) + ["machine"], stamped(rows))
        print(f"wrote {out / 'bench_lm.csv'}")
    fields = list(summary[0]) + ["machine"] if summary else ["machine"]
    write_csv(out / "bench_lm_summary.csv", fields, [dict(s, **stamp) for s in summary])
    print(f"wrote {out / 'bench_lm_summary.csv'}")
    if race:
        write_csv(out / "bench_lm_race.csv", list(race[0]) + ["machine"], [dict(r, **stamp) for r in race])
        print(f"wrote {out / 'bench_lm_race.csv'}")
    png = None if args.no_plot else plot(rows, out / "bench_lm.png", stamp["machine"])
    if png is not None:
        print(f"wrote {png}")
    if args.docs:
        name = args.docs_name
        write_csv(ROOT / "docs" / "data" / f"{name}.csv", list(COLUMNS) + ["machine"], stamped(rows))
        # the summary page of the run: its equal-token table, or the race's when it is only a race
        # (then NAME_summary.csv is the race table; a mixed run writes the race as NAME_race.csv)
        race_name = f"{name}_race.csv" if summary else f"{name}_summary.csv"
        if summary or not race:
            write_csv(ROOT / "docs" / "data" / f"{name}_summary.csv", list(DOCS_COLUMNS), docs_rows(summary))
        if race:
            write_csv(ROOT / "docs" / "data" / race_name, list(RACE_DOCS_COLUMNS), race_docs_rows(race))
        if png is not None:
            shutil.copy(png, ROOT / "docs" / f"{name}.png")
        print(f"wrote docs/data/{name}.csv" + (f", docs/data/{name}_summary.csv" if summary or not race else "")
              + (f", docs/data/{race_name} (the race)" if race else "") + (f", docs/{name}.png" if png else ""))
    return 0


def _sweep_report(rows: List[Dict[str, Any]], out: Path, args: argparse.Namespace, stamped: Any) -> int:
    """Print the sweep per arm and its best settings; with ``--docs`` publish its CSV (the settings
    every other mode takes by default)."""
    from examples.lm.loop import COLUMNS
    finals = sweep_finals(rows)
    chosen = set(best_of(finals).values())
    write_csv(out / "bench_lm_sweep.csv", list(COLUMNS) + ["machine"], stamped(rows))
    print(f"\nsweep ({args.tokens:,} tokens, loopback, seeds {args.seeds}):\n{'arm':22} {'lr':>8} {'outer':>11} "
          f"{'final bits/byte':>15}")
    for key, vs in sorted(finals.items(), key=lambda kv: (kv[0][0], statistics.mean(kv[1]))):
        arm, lr, olr, om = key
        outer = "-" if olr is None else f"{olr:g}/{om:g}"
        print(f"{arm:22} {lr:8.2e} {outer:>11} {statistics.mean(vs):15.4f}{' <- best' if key in chosen else ''}")
    summary = [dict(zip(SWEEP_DOCS_COLUMNS, (
        arm, f"{lr:.2g}", "-" if olr is None else f"{olr:g}", "-" if om is None else f"{om:g}", len(vs),
        f"{statistics.mean(vs):.4f}", "best" if (arm, lr, olr, om) in chosen else "")))
        for (arm, lr, olr, om), vs in sorted(finals.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2:])))]
    write_csv(out / "bench_lm_sweep_summary.csv", list(SWEEP_DOCS_COLUMNS), summary)
    print(f"wrote {out / 'bench_lm_sweep.csv'}, {out / 'bench_lm_sweep_summary.csv'}")
    if args.docs:
        write_csv(SETTINGS, list(COLUMNS) + ["machine"], stamped(rows))
        write_csv(SETTINGS.with_name("bench_lm_sweep_summary.csv"), list(SWEEP_DOCS_COLUMNS), summary)
        print(f"wrote {SETTINGS.relative_to(ROOT)} (every other mode's default settings) and its summary")
    return 0


#: the sweep as the Benchmarks page shows it: one row per arm and setting
SWEEP_DOCS_COLUMNS = ("arm", "inner peak lr", "outer lr", "outer momentum", "seeds", "final held-out bits/byte",
                      "chosen")


#: the race as the Benchmarks page shows it (formatted), from race_summary()'s rows
RACE_DOCS_COLUMNS = ("link", "arm", "seeds", "T s", "tokens in T", "train wall s", "final held-out bits/byte",
                     "range over seeds", "vs DDP", "vs decent-dp (same topology)", "MiB sent per worker")


def race_docs_rows(race: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    def pct(v: Optional[float]) -> str:
        return "-" if v is None else f"{100 * v:+.1f}%"
    return [dict(zip(RACE_DOCS_COLUMNS, (
        r["link"], r["arm"], r["seeds"], f"{r['budget_s']:.0f}", f"{r['tokens']:,.0f}", f"{r['wall_s']:.1f}",
        f"{r['final_val_bits_per_byte']:.4f}", f"{r['min']:.4f}-{r['max']:.4f}", pct(r["vs_ddp"]),
        pct(r["vs_decent_dp"]), f"{r['bytes_sent_per_worker'] / 2**20:.1f}"))) for r in race]


#: the summary as the Benchmarks page shows it (formatted), from summarize()'s rows
DOCS_COLUMNS = ("link", "arm", "seeds", "final held-out bits/byte (averaged model)", "vs DDP",
                "workers' own models", "train wall s", "MiB sent per worker", "target bits/byte",
                "time to target s", "vs DDP to target", "loss every arm reached", "time to it s", "vs DDP to it")


def docs_rows(summary: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    def f(v: Any, spec: str, none: str = "-") -> str:
        return none if v is None else format(v, spec)
    return [dict(zip(DOCS_COLUMNS, (
        s["link"], s["arm"], s["seeds"], f(s["final_val_bits_per_byte"], ".4f"),
        f(None if s["vs_ddp_final"] is None else 100 * s["vs_ddp_final"], "+.1f") + ("%" if s["vs_ddp_final"] is not None else ""),
        f(s["final_val_workers_mean"], ".4f"), f(s["wall_s"], ".1f"), f(s["bytes_sent_per_worker"] / 2**20, ".1f"),
        f(s["target_val_bits_per_byte"], ".4f"), f(s["time_to_target_s"], ".1f", "not reached"),
        f(s["speedup_vs_ddp_to_target"], ".2f") + ("x" if s["speedup_vs_ddp_to_target"] is not None else ""),
        f(s["common_val_bits_per_byte"], ".4f"), f(s["time_to_common_s"], ".1f", "not reached"),
        f(s["speedup_vs_ddp_to_common"], ".2f") + ("x" if s["speedup_vs_ddp_to_common"] is not None else ""))))
        for s in summary]


def read_rows(path: Path) -> List[Dict[str, Any]]:
    """The rows of a bench_lm.csv, numbers as numbers (an empty link is loopback)."""
    import csv

    num = {"tokens": int, "seed": int, "workers": int, "step": int, "wall_s": float, "bytes_sent_per_worker": float,
           "val_bits_per_byte": float, "val_bits_per_byte_workers_mean": float, "peak_lr": float,
           "outer_lr": float, "outer_momentum": float, "budget_s": float}
    out = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            row: Dict[str, Any] = dict(r)
            for k, conv in num.items():
                if row.get(k) not in (None, ""):
                    row[k] = conv(row[k])
            row["link_mbit"] = float(r["link_mbit"]) if r.get("link_mbit") not in (None, "", "None") else None
            out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
