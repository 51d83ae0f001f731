"""Fixed-budget convergence: decentralized topologies vs all-reduce DDP on scikit-learn's digits.

4 gloo workers on 127.0.0.1 (one torch thread each). For every optimizer (sgd, adamw, accum-adam)
and every topology (complete, ring, one-peer-exp, alternating-exp-ring with L = 2) a fresh model
(same seed) trains for the same number of epochs on the same disjoint shards with the same
per-worker batch, learning rate and cosine schedule as ``examples/train_digits.py`` (whose data,
model and helpers are imported); then ``global_avg()`` gives every worker the exact average
model, whose test accuracy is reported. The baseline is ``torch.nn.parallel.DistributedDataParallel``
(all-reduce of gradients) with the *same* optimizer object type (the decentpy optimizer helper,
stepped standalone), same schedule, seed, shards and batches.

Compressed gossip (``--compression int8,int4,bf16``): every topology also runs as ``<topology>+<kind>``
with ``DecentralizedDataParallel(compression=...)``
(``--gamma``: the consensus step size, default the kind's default); its row also shows the
difference to the same topology uncompressed at the same number of steps.

Prints a table and writes ``bench/out/bench_convergence.csv``.

    python -m bench.bench_convergence                     # ~1-2 minutes on 2 cores
    python -m bench.bench_convergence --epochs 20 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import examples.train_digits as td  # the example's data, model and helpers
from bench.common.launch import OUT_DIR, bench_parser, spawn_workers
from bench.common.tables import print_table, write_csv

TOPOLOGIES = ("complete", "ring", "one-peer-exp", "alternating-exp-ring")
OPTIMIZERS = ("sgd", "adamw", "accum-adam")
LOCAL_WORLD_SIZE = 2


def _train_one(rank: int, world: int, data: Any, args: Dict[str, Any], optimizer: str, method: str,
               seed: int) -> Dict[str, Any]:
    """One run on this rank; ``method`` is a topology name or 'ddp'. Returns rank-local numbers."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import decentpy.optim as dopt
    from decentpy import DecentralizedDataParallel

    lr = args["lr"] if args["lr"] is not None else td.DEFAULT_LR[optimizer]
    torch.manual_seed(seed)
    model = td.SmallCNN()
    shard = td.shard_indices(len(data.x_train), rank, world, seed)
    bs = args["batch_size"]
    steps_per_epoch = (len(shard) + bs - 1) // bs
    total = steps_per_epoch * args["epochs"]
    optim_fn = td.make_optim_fn(optimizer, lr, args["accum_iter"])
    sched_fn = functools.partial(dopt.lr_scheduler_fn_cosine_with_warmup, t_max=total,
                                 t_warmup=max(1, total // 10))
    dist.barrier()
    t0 = time.perf_counter()
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = optim_fn(list(model.named_parameters()))
        sched = sched_fn(opt)
    else:
        from decentpy import Compression

        topology, _, kind = method.partition("+")
        compression = Compression(kind, gamma=args.get("gamma")) if kind else None
        net = DecentralizedDataParallel(model, optim_fn, lr_scheduler_fn=sched_fn, topology=topology,
                                        local_world_size=LOCAL_WORLD_SIZE, compression=compression)
        opt = sched = None
    shuffle = torch.Generator().manual_seed(seed * 1000 + rank)
    loss_sum = count = 0.0
    for _epoch in range(args["epochs"]):
        net.train()
        order = shard[torch.randperm(len(shard), generator=shuffle)]
        loss_sum = count = 0.0
        for i in range(0, len(order), bs):
            idx = order[i:i + bs]
            x, y = data.x_train[idx], data.y_train[idx]
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
                sched.step()
            loss_sum += float(loss.detach()) * len(y)
            count += len(y)
    consensus = 0.0
    if method != "ddp":
        consensus = net.consensus_distance()
        net.global_avg()
    net.eval()
    with torch.no_grad():
        pred = net(data.x_test).argmax(1)
    acc = float((pred == data.y_test).float().mean())
    dist.barrier()
    wall = time.perf_counter() - t0
    tot = torch.tensor([loss_sum, count], dtype=torch.float64)
    dist.all_reduce(tot)
    return dict(acc=acc, train_loss=float(tot[0] / tot[1]), consensus=consensus, wall_s=wall, lr=lr,
                steps=total)


def _worker_body(rank: int, world: int, plan: Dict[str, Any]) -> List[Dict[str, Any]]:
    import torch.distributed as dist

    rows = []
    for seed in plan["seeds"]:
        data = td.load_data(seed)
        for optimizer in plan["optimizers"]:
            for method in _methods(plan):
                res = _train_one(rank, world, data, plan, optimizer, method, seed)
                accs: List[Any] = [None] * world
                dist.all_gather_object(accs, res["acc"])
                if rank == 0:
                    res.update(seed=seed, optimizer=optimizer, method=method,
                               acc_spread=max(accs) - min(accs))
                    rows.append(res)
                    print(f"  seed {seed} {optimizer:10s} {method:22s} test acc {res['acc']:.4f}  "
                          f"({res['wall_s']:.1f} s)", flush=True)
    return rows


def _methods(plan: Dict[str, Any]) -> List[str]:
    """'ddp', the topologies, then '<topology>+<kind>' for each compressor and topology."""
    out = ["ddp", *plan["topologies"]]
    for kind in plan.get("compression", []):
        out += [f"{t}+{kind}" for t in plan["topologies"]]
    return out


def run(world: int, plan: Dict[str, Any], timeout_s: float) -> List[Dict[str, Any]]:
    """Rank 0's rows from ``world`` spawned workers (raises with every traceback on failure)."""
    return spawn_workers(_worker_body, world, plan, timeout_s)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=None, help="default: train_digits.DEFAULT_LR per optimizer")
    p.add_argument("--accum-iter", type=int, default=4)
    p.add_argument("--seeds", default="0", help="comma-separated; accuracies are averaged over seeds")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--topologies", default=",".join(TOPOLOGIES))
    p.add_argument("--compression", default="", help="comma-separated compressors (int8, int4, bf16) to add for "
                   "every topology, e.g. int8,bf16 (default: none)")
    p.add_argument("--gamma", type=float, default=None, help="consensus step size of compressed gossip "
                   "(default: decentpy.optim.compression.DEFAULT_GAMMA of the kind)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(OUT_DIR))
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    from decentpy import Compression

    for kind in (c for c in args.compression.split(",") if c):
        Compression(kind)  # an unknown kind fails here, naming the valid ones, not in every worker
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    plan = dict(seeds=seeds, optimizers=[o for o in args.optimizers.split(",") if o],
                topologies=[t for t in args.topologies.split(",") if t], epochs=args.epochs,
                batch_size=args.batch_size, lr=args.lr, accum_iter=args.accum_iter,
                compression=[c for c in args.compression.split(",") if c], gamma=args.gamma)
    print(f"digits (sklearn, 1797 8x8 images, 80/20 split), SmallCNN from examples/train_digits.py, "
          f"{args.workers} workers (local world size {LOCAL_WORLD_SIZE}), batch {args.batch_size}/worker, "
          f"{args.epochs} epochs, cosine schedule with 10% warm-up, seeds {seeds}, torch {torch.__version__}",
          flush=True)
    t0 = time.perf_counter()
    rows = run(args.workers, plan, args.timeout)
    wall = time.perf_counter() - t0

    # aggregate over seeds
    agg: Dict[tuple, Dict[str, Any]] = {}
    for r in rows:
        a = agg.setdefault((r["optimizer"], r["method"]), dict(acc=[], loss=[], cons=[], wall=[], spread=[],
                                                                lr=r["lr"], steps=r["steps"]))
        a["acc"].append(r["acc"])
        a["loss"].append(r["train_loss"])
        a["cons"].append(r["consensus"])
        a["wall"].append(r["wall_s"])
        a["spread"].append(r["acc_spread"])
    hdr = ["optimizer", "method", "lr", "steps", "test acc", "DDP acc", "delta vs DDP", "delta vs uncompressed",
           "final train loss", "consensus", "wall s"]
    table, out_rows = [], []
    for optimizer in plan["optimizers"]:
        base = agg.get((optimizer, "ddp"))
        for method in _methods(plan):
            a = agg.get((optimizer, method))
            if a is None:
                continue
            acc = statistics.mean(a["acc"])
            plain = agg.get((optimizer, method.partition("+")[0])) if "+" in method else None
            vs_plain = f"{acc - statistics.mean(plain['acc']):+.4f}" if plain else ""
            bacc = statistics.mean(base["acc"]) if base else float("nan")
            name = "all-reduce DDP" if method == "ddp" else (
                "alternating-exp-ring (L=2)" if method == "alternating-exp-ring" else method)
            table.append([optimizer, name, f"{a['lr']:g}", str(a["steps"]), f"{acc:.4f}", f"{bacc:.4f}",
                          "" if method == "ddp" else f"{acc - bacc:+.4f}", vs_plain,
                          f"{statistics.mean(a['loss']):.4f}",
                          "" if method == "ddp" else f"{statistics.mean(a['cons']):.2e}",
                          f"{statistics.mean(a['wall']):.1f}"])
            out_rows.append(dict(optimizer=optimizer, topology="allreduce" if method == "ddp" else method,
                                 framework="torch-ddp" if method == "ddp" else "decentpy", workers=args.workers,
                                 local_world_size=LOCAL_WORLD_SIZE, epochs=args.epochs, steps=a["steps"],
                                 batch_size=args.batch_size, lr=a["lr"], seeds=";".join(map(str, seeds)),
                                 test_acc=f"{acc:.6f}", ddp_test_acc=f"{bacc:.6f}",
                                 delta_vs_ddp="" if method == "ddp" else f"{acc - bacc:+.6f}",
                                 delta_vs_uncompressed=vs_plain,
                                 final_train_loss=f"{statistics.mean(a['loss']):.6f}",
                                 consensus_before_avg="" if method == "ddp" else f"{statistics.mean(a['cons']):.4e}",
                                 rank_acc_spread=f"{max(a['spread']):.2e}",
                                 wall_s=f"{statistics.mean(a['wall']):.2f}"))
    print()
    print_table(hdr, table, group=lambda t: t[0])
    print("test acc: the averaged model (global_avg) for the decentralized runs; DDP's replicas are identical. "
          "consensus: RMS distance of the workers to their average just before global_avg.")
    path = Path(args.out) / "bench_convergence.csv"
    write_csv(path, list(out_rows[0]), out_rows)
    print(f"\nwrote {path} (total {wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
