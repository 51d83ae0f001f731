"""Sharded data-parallel benchmark on CPU: decentpy OSS + ShardedDataParallel vs torch ZeRO vs DDP vs fairscale.

For 2 and 4 gloo worker processes on 127.0.0.1 (one torch thread each) it trains the bench-train
MLP (``bench.common.models.make_model("mlp")``: 3 x Linear(1024, 1024), batch 64 per rank, own synthetic
data per rank, fixed seed) with AdamW (lr 1e-4) in four set-ups, side by side in one run:

* ``decentpy``    ``decentpy.OSS(params, optim=torch.optim.AdamW)`` + ``decentpy.ShardedDataParallel``
                  (ZeRO-2: optimizer state and gradients sharded; decentpy swaps in its fused AdamW);
* ``torch-zero``  ``DistributedDataParallel`` + ``torch.distributed.optim.ZeroRedundancyOptimizer(
                  optimizer_class=torch.optim.AdamW)`` (ZeRO-1: optimizer state sharded);
* ``torch-ddp``   ``DistributedDataParallel`` + plain ``torch.optim.AdamW`` (nothing sharded: the
                  unsharded baseline of the optimizer state);
* ``fairscale``   fairscale 0.4.13 ``fairscale.optim.OSS(optim=torch.optim.AdamW)`` +
                  ``fairscale.nn.data_parallel.ShardedDataParallel`` (skipped, with the reason, when
                  it does not import or fails in a short probe run), with
                  ``zero_grad(set_to_none=False)``: with torch's default (True) fairscale reduces
                  its buckets' stale gradients -- faster, but a wrong step.

Per configuration (measurement machinery shared with bench/bench_train.py: bench/common/measure.py):

* step time: wall time of forward + backward + ``optimizer.step()`` (+ ``zero_grad()``), measured
  on every rank; per step the max over ranks; the median over the timed steps (plus the 25th/75th
  percentiles). All configurations of one worker count live in the same processes and are timed
  in interleaved rounds (a few steps of each in turn, order rotated each round);
* optimizer state per rank: the bytes of the tensors in the rank's optimizer state (the local
  shard's optimizer for the sharded set-ups, torch AdamW's full state for DDP), counted once per
  storage (views of one flat block, or a shared step counter, are not counted twice); the
  maximum over ranks, compared with the unsharded state (torch-ddp's, same run);
* peak memory per worker, as bench_train measures it (see bench_train.MEMORY): baseline RSS +
  the RSS high-water mark reached by the configuration built and warmed up alone, max over ranks.

Writes ``bench/out/bench_shard.csv``.

    python -m bench.bench_shard                 # 2 and 4 workers, all four set-ups
    python -m bench.bench_shard --quick --frameworks decentpy,torch-ddp     # smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench.common.launch import add_link_args, add_run_args, bench_parser, open_network, quick_timing, spawn_workers
from bench.common.machine import report_machine
from bench.common.measure import (Config, Runner, gather_results, measure_and_time, prime, rss_bytes, state_bytes,
                                  timing_row)
from bench.common.models import LR, MODEL_DESC, MODELS, make_model
from bench.common.references import FAIRSCALE_VERSION, fairscale_missing
from bench.common.tables import cell, check_choices, csv_list, fmt, mib, print_targets
from bench.common.tables import print_table as print_table_rows
from bench.common.tables import write_csv as write_rows_csv


FRAMEWORKS = ("decentpy", "torch-zero", "torch-ddp", "fairscale")
SETUP = {"decentpy": "OSS+SDP", "torch-zero": "DDP+ZeRO", "torch-ddp": "DDP+AdamW", "fairscale": "OSS+SDP"}
# run-time probed before the measurement (the torch baselines are not: a failure there is an error)
PROBED = ("decentpy", "fairscale")
STATE_TOLERANCE = 0.05  # target: state per rank <= unsharded / world * (1 + 5%)


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------


class ShardRunner(Runner):
    """The benchmarks' Runner (memory bookkeeping, data, timed step) with the sharded set-ups."""

    def build(self, model: Any) -> None:
        import torch

        fw = self.cfg.framework
        if fw == "decentpy":
            import decentpy

            self.opt = decentpy.OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR)
            self.net = decentpy.ShardedDataParallel(model, self.opt)
        elif fw == "fairscale":
            from fairscale.nn.data_parallel import ShardedDataParallel
            from fairscale.optim import OSS

            self.opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR)
            self.net = ShardedDataParallel(model, self.opt)
            # fairscale trains on stale gradients after zero_grad(set_to_none=True), torch's default
            # (its buckets keep the first step's gradients); set_to_none=False is its correct mode.
            self.zero_grad_kwargs = {"set_to_none": False}
        elif fw == "torch-zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(model)
            self.opt = ZeroRedundancyOptimizer(self.net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        elif fw == "torch-ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(model)
            self.opt = torch.optim.AdamW(self.net.parameters(), lr=LR)
        else:
            raise ValueError(f"unknown framework {fw!r} (choose from {', '.join(FRAMEWORKS)})")

    def finish(self) -> None:
        pass  # every set-up completes its communication inside step()

    def state_bytes(self) -> int:
        return state_bytes(self.opt)


def _import_frameworks(frameworks: Sequence[str]) -> None:
    import decentpy  # noqa: F401  (measure.trim uses it; imported before the baseline is taken)

    if "fairscale" in frameworks:
        import fairscale.nn.data_parallel  # noqa: F401
        import fairscale.optim  # noqa: F401


def _worker_body(rank: int, n: int, plan: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    cfgs = [Config(**c) for c in plan["configs"]]
    _import_frameworks([c.framework for c in cfgs])
    dist.barrier()
    prime(cfgs, rank, plan, ShardRunner)
    base_rss = rss_bytes()
    runners, mems = measure_and_time(cfgs, rank, plan, ShardRunner)
    results = gather_results(runners, mems, base_rss, rank, n)
    mine = [r.state_bytes() for r in runners]
    every: List[Any] = [None] * n
    dist.all_gather_object(every, mine)
    for i, res in enumerate(results):  # rank 0 only
        res["state_per_rank"] = [every[k][i] for k in range(n)]
    for r in runners:
        r.finish()
    del runners
    return dict(results=results)


def _probe_body(rank: int, n: int, plan: Dict[str, Any]) -> Dict[str, Optional[str]]:
    """Build each framework and run two steps; per framework None (works) or the first error."""
    import torch.distributed as dist

    out: Dict[str, Optional[str]] = {}
    for fw in plan["frameworks"]:
        err: Optional[str] = None
        try:
            _import_frameworks([fw])
            dist.barrier()
            r = ShardRunner(Config(fw, SETUP[fw], n, plan["model"]), rank, plan["seed"])
            for _ in range(2):
                r.step()
            r.state_bytes()
            del r
        except Exception as exc:  # noqa: BLE001  (reported, the framework is skipped)
            err = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        errs: List[Any] = [None] * n
        dist.all_gather_object(errs, err)
        out[fw] = next((e for e in errs if e), None)
    return out


def probe(frameworks: Sequence[str], model: str, seed: int, timeout_s: float = 120.0) -> Dict[str, Optional[str]]:
    """Run-time check of ``frameworks`` on 2 workers: {framework: None if it works, else why not}.

    All in one spawn; if that spawn dies or hangs (a failure on one rank only), each framework
    again in its own spawn, so that the culprit is found.
    """
    if not frameworks:
        return {}
    plan = dict(frameworks=list(frameworks), model=model, seed=seed)
    try:
        return spawn_workers(_probe_body, 2, plan, timeout_s, pg_timeout_s=60.0)
    except (RuntimeError, TimeoutError) as exc:
        if len(frameworks) == 1:
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            return {frameworks[0]: (lines[-1] if lines else type(exc).__name__)[:300]}
        out: Dict[str, Optional[str]] = {}
        for fw in frameworks:
            out.update(probe([fw], model, seed, timeout_s))
        return out


# ----------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------


def greedy_partition_share(model: str, world: int) -> float:
    """Largest per-rank share of the parameters (by numel) under the OSS partition rule (numel
    descending, each to the least-loaded rank): the best a parameter-granular sharding can do."""
    sizes = sorted((p.numel() for p in make_model(model, 0).parameters()), reverse=True)
    load = [0] * world
    for s in sizes:
        load[load.index(min(load))] += s
    return max(load) / float(sum(sizes))


def summarize(raw: List[Dict[str, Any]], model: str) -> List[Dict[str, Any]]:
    rows = []
    for res in raw:
        rows.append(dict(timing_row(res), state_ranks=res["state_per_rank"], state=max(res["state_per_rank"])))
    by = {(r["cfg"].workers, r["cfg"].framework): r for r in rows}
    for r in rows:
        n = r["cfg"].workers
        ddp, zero, fs = by.get((n, "torch-ddp")), by.get((n, "torch-zero")), by.get((n, "fairscale"))
        # unsharded AdamW state: DDP's, measured; without a DDP run, 2 fp32 moments per parameter
        # plus one fp32 step per parameter tensor (torch's layout)
        n_tensors = sum(1 for _ in make_model(model, 0).parameters())
        r["unsharded"] = ddp["state"] if ddp else 2 * r["param_bytes"] + 4 * n_tensors
        r["unsharded_measured"] = ddp is not None
        r["state_ratio"] = r["state"] / r["unsharded"]
        r["state_target"] = (1.0 + STATE_TOLERANCE) / n
        r["partition_bound"] = greedy_partition_share(model, n)
        # step-time ratios to the baselines (> 1: this one is faster); none against itself
        r["vs_zero"] = zero["step"] / r["step"] if zero and zero is not r else None
        r["vs_fs"] = fs["step"] / r["step"] if fs and fs is not r else None
        r["vs_ddp"] = ddp["step"] / r["step"] if ddp and ddp is not r else None
        r["rss_vs_ddp"] = r["peak_rss"] - ddp["peak_rss"] if ddp else None
    order = {f: i for i, f in enumerate(FRAMEWORKS)}
    rows.sort(key=lambda r: (r["cfg"].workers, order[r["cfg"].framework]))
    return rows


def print_table(rows: List[Dict[str, Any]]) -> None:
    hdr = ["n", "framework", "set-up", "median ms", "p25-p75 ms", "fwd+bwd ms", "steps", "ZeRO/this",
           "fs/this", "DDP/this", "state/rank MiB", "state per rank MiB", "state/unsharded", "1/n+5%",
           "peak RSS MiB", "vs DDP MiB"]
    table = []
    for r in rows:
        c = r["cfg"]
        dp = c.framework == "decentpy"
        table.append([str(c.workers), c.framework, SETUP[c.framework], f"{r['step'] * 1e3:.2f}",
                      f"{r['p25'] * 1e3:.1f}-{r['p75'] * 1e3:.1f}", f"{r['compute'] * 1e3:.2f}", str(r["steps"]),
                      fmt(r["vs_zero"], ".2f", "x") if dp else "", fmt(r["vs_fs"], ".2f", "x") if dp else "",
                      fmt(r["vs_ddp"], ".2f", "x") if c.framework != "torch-ddp" else "",
                      mib(r["state"]), "/".join(f"{b / 2**20:.1f}" for b in r["state_ranks"]),
                      f"{r['state_ratio']:.3f}", f"{r['state_target']:.3f}", f"{r['peak_rss'] / 2**20:.0f}",
                      fmt(None if r["rss_vs_ddp"] is None else r["rss_vs_ddp"] / 2**20, "+.1f")])
    print_table_rows(hdr, table, group=lambda t: t[0])
    print("median ms = forward+backward+optimizer.step()+zero_grad(), per step the max over ranks, median over the "
          "timed steps; fwd+bwd ms = the forward+backward part alone;\nZeRO/this, fs/this, DDP/this = step time of "
          "torch ZeRO / fairscale / torch DDP divided by this one's (>1: this one is faster);\nstate/rank = "
          "optimizer state bytes on the rank that holds the most (per rank: rank 0/1/...); state/unsharded = that "
          "over torch-ddp's full AdamW state;\n1/n+5% = the target for state/unsharded; vs DDP = peak RSS minus "
          "torch-ddp's (same n)")
    if rows and not rows[0]["unsharded_measured"]:
        print("(no torch-ddp run: the unsharded state is computed as 2 fp32 moments per parameter + a 4-byte step "
              "per tensor)")


def check_targets(rows: List[Dict[str, Any]], workers: Sequence[int], skipped: Dict[str, str],
                  requested: Sequence[str]) -> List[Tuple[str, Optional[bool], str]]:
    """(title, met (None: not measured), detail) for each target."""
    out: List[Tuple[str, Optional[bool], str]] = []
    dp = {r["cfg"].workers: r for r in rows if r["cfg"].framework == "decentpy"}
    why_no_dp = skipped.get("decentpy", "not requested (--frameworks)")
    for n in workers:
        title = f"decentpy optimizer state per rank <= 1/{n} of the unsharded state + 5% (n={n})"
        r = dp.get(n)
        if r is None:
            out.append((title, None, f"not measured: decentpy {why_no_dp}"))
            continue
        ok = r["state_ratio"] <= r["state_target"]
        out.append((title, ok, f"max over ranks {mib(r['state'])} MiB = {r['state_ratio']:.3f} of the unsharded "
                               f"{mib(r['unsharded'])} MiB (target <= {r['state_target']:.3f}; the parameter-"
                               f"granular partition can reach {r['partition_bound']:.3f} on this model)"))
    for key, other, label in (("vs_zero", "torch-zero", "torch's ZeRO (DDP + ZeroRedundancyOptimizer)"),
                              ("vs_fs", "fairscale", f"fairscale {FAIRSCALE_VERSION} OSS + ShardedDataParallel")):
        title = f"decentpy step time faster than {label} at 4 workers"
        r = dp.get(4)
        if 4 not in workers:
            out.append((title, None, "not measured: no 4-worker run (--workers)"))
        elif r is None:
            out.append((title, None, f"not measured: decentpy {why_no_dp}"))
        elif r[key] is None:
            why = skipped.get(other) or ("not requested (--frameworks)" if other not in requested else "no result")
            out.append((title, None, f"not measured: {other} {why}"))
        else:
            out.append((title, r[key] > 1.0, f"{other} / decentpy = {r[key]:.2f}x (decentpy {r['step'] * 1e3:.2f} "
                                             f"ms per step)"))
    return out


CSV_FIELDS = ["framework", "setup", "workers", "model", "step_time_s", "step_time_p25_s", "step_time_p75_s",
              "compute_time_s", "timed_steps", "optim_state_bytes_per_rank", "optim_state_bytes_ranks",
              "unsharded_state_bytes", "state_ratio_vs_unsharded", "state_target_ratio", "partition_bound_ratio",
              "model_bytes", "peak_rss_mib", "peak_rss_vs_ddp_mib", "speedup_vs_zero", "speedup_vs_fairscale",
              "speedup_vs_ddp", "cpu", "cores", "torch"]


def write_csv(path: Path, rows: List[Dict[str, Any]], machine: Dict[str, str]) -> None:
    def row(r: Dict[str, Any]) -> Dict[str, Any]:
        c = r["cfg"]
        return dict(
            framework=c.framework, setup=SETUP[c.framework], workers=c.workers, model=c.model,
            step_time_s=f"{r['step']:.6g}", step_time_p25_s=f"{r['p25']:.6g}", step_time_p75_s=f"{r['p75']:.6g}",
            compute_time_s=f"{r['compute']:.6g}", timed_steps=r["steps"],
            optim_state_bytes_per_rank=r["state"], optim_state_bytes_ranks=";".join(map(str, r["state_ranks"])),
            unsharded_state_bytes=r["unsharded"], state_ratio_vs_unsharded=f"{r['state_ratio']:.6f}",
            state_target_ratio=f"{r['state_target']:.6f}", partition_bound_ratio=f"{r['partition_bound']:.6f}",
            model_bytes=r["param_bytes"], peak_rss_mib=f"{r['peak_rss'] / 2**20:.1f}",
            peak_rss_vs_ddp_mib="" if r["rss_vs_ddp"] is None else f"{r['rss_vs_ddp'] / 2**20:.2f}",
            speedup_vs_zero=cell(r["vs_zero"], ".4f"), speedup_vs_fairscale=cell(r["vs_fs"], ".4f"),
            speedup_vs_ddp=cell(r["vs_ddp"], ".4f"),
            cpu=machine["cpu"], cores=machine["cores"], torch=machine["torch"])

    write_rows_csv(path, CSV_FIELDS, (row(r) for r in rows))


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    p.add_argument("--model", default="mlp", choices=MODELS, help="bench_train model")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"comma-separated, from {','.join(FRAMEWORKS)}")
    # finer interleaving than bench_train's 4 x 8 at the same 32 timed steps: on a small shared
    # machine the load drifts within seconds, and every configuration should see the same drift
    add_run_args(p, rounds=8, chunk=4)
    add_link_args(p)
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: 2 workers, 2 warm-up steps, 1 round of 3 timed steps, no primer configurations")
    p.add_argument("--no-probe", action="store_true",
                   help=f"skip the 2-worker run-time probe of {', '.join(PROBED)} (a failure then aborts the run)")
    args = p.parse_args(argv)
    if args.quick:
        quick_timing(args, warmup=2)
        if args.workers == p.get_default("workers"):
            args.workers = "2"
    return args


def available(frameworks: Sequence[str], args: argparse.Namespace) -> Tuple[List[str], Dict[str, str]]:
    """The frameworks that import and (unless --no-probe) run; why each other one is skipped."""
    skipped: Dict[str, str] = {}
    if "decentpy" in frameworks:
        try:
            import decentpy

            decentpy.OSS, decentpy.ShardedDataParallel  # noqa: B018
        except Exception as exc:  # noqa: BLE001
            skipped["decentpy"] = f"unavailable: {type(exc).__name__}: {exc}"
    if "fairscale" in frameworks:
        why = fairscale_missing("bench-shard")
        if why is not None:
            skipped["fairscale"] = f"unavailable: {why}"
    to_probe = [f for f in frameworks if f in PROBED and f not in skipped]
    if to_probe and not args.no_probe:
        t0 = time.perf_counter()
        for fw, err in probe(to_probe, args.model, args.seed).items():
            if err:
                skipped[fw] = f"failed at run time in a 2-worker probe: {err}"
        print(f"run-time probe of {', '.join(to_probe)} on 2 workers: {time.perf_counter() - t0:.0f} s")
    for fw, why in skipped.items():
        print(f"{fw} skipped: {why}")
    return [f for f in frameworks if f not in skipped], skipped


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workers = [int(w) for w in csv_list(args.workers)]
    requested = csv_list(args.frameworks)
    check_choices(requested, FRAMEWORKS, "framework")
    machine = report_machine("fairscale")
    t_start = time.perf_counter()
    frameworks, skipped = available(requested, args)
    print(f"optimizer: AdamW(lr={LR}) everywhere (torch.optim.AdamW, default CPU implementation, in DDP, ZeRO and "
          "fairscale; decentpy.OSS swaps in decentpy's fused AdamW); gloo on 127.0.0.1, 1 torch thread per worker")
    print("zero_grad: torch's default (set_to_none=True) everywhere but fairscale, which runs set_to_none=False: with "
          "True its ShardedDataParallel trains on stale gradients (its known bug), a faster but wrong step")
    print(f"model {args.model}: {MODEL_DESC[args.model]}")
    print(f"timing: {args.warmup} warm-up steps per configuration, then {args.rounds} interleaved rounds x "
          f"({args.rewarm} untimed + {args.chunk} timed) steps = {args.rounds * args.chunk} timed steps; per step the "
          "max over ranks; median")
    raw: List[Dict[str, Any]] = []
    for n in workers:
        cfgs = [Config(fw, SETUP[fw], n, args.model) for fw in frameworks]
        if not cfgs:
            continue
        t0 = time.perf_counter()
        print(f"[{n} workers] {len(cfgs)} configurations ({', '.join(frameworks)}) ...", flush=True)
        plan = dict(configs=[asdict(c) for c in cfgs], warmup=args.warmup, rounds=args.rounds, chunk=args.chunk,
                    rewarm=args.rewarm, seed=args.seed, primer=not args.quick)
        net = open_network(args, n)  # None: loopback; else the --link-mbit namespaces
        try:
            if net is not None:
                print(f"network: {net.describe()}", flush=True)
            raw += spawn_workers(_worker_body, n, plan, args.timeout, pg_timeout_s=300.0, net=net)["results"]
        finally:
            if net is not None:
                net.close()
        print(f"[{n} workers] done in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = summarize(raw, args.model)
    print()
    print_table(rows)
    print("\nmemory: peak RSS per worker measured as bench/bench_train.py does: worker baseline RSS + (VmHWM after "
          "building the configuration alone and its warm-up steps - RSS before its model was built), max over ranks")
    print_targets(check_targets(rows, workers, skipped, requested))
    csv_path = Path(args.out) / ("bench_shard.csv" if args.link_mbit is None
                                  else f"bench_shard_link{args.link_mbit:g}_{args.link_layout}.csv")
    write_csv(csv_path, rows, machine)
    print(f"\nwrote {csv_path} (total {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
