"""Decentralized pipelines on scikit-learn's digits, on CPU: 2 stages x 2 replicas, beside plain decentpy.

Launch (4 processes: replica r holds ranks 2r and 2r + 1, stage s of every replica gossips with
the other replicas' stage s)::

    torchrun --standalone --nproc_per_node=4 examples/pipeline_gossip_digits.py
    torchrun --standalone --nproc_per_node=4 examples/pipeline_gossip_digits.py --stages 1 --replicas 4 --balance 7 \
        --topology ring

Every stage must hold parameters (a stage without any has nothing to gossip, and the wrapper
refuses it): with this 7-layer model, at most 3 stages.

The composition (``decentpy.hybrid``): ``pipeline_groups`` lays the ranks out and creates the
groups, each replica's ``AsyncPipe`` runs on its pipeline group, and each stage's partition is
wrapped in a ``DecentralizedDataParallel`` on its stage's replica group. Every replica trains on
its own shard; per mini-batch, the micro-batches' backwards accumulate and the last one mixes the
stage with its replicas and steps, bucket by bucket (no optimizer in the loop). At the end
``global_avg`` gives every replica the average model, whose test accuracy is reported.

Then the same layers are trained with plain decentpy (every rank a whole model, no pipeline) on
the same global batch per step, and both accuracies are printed.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from decentpy import AsyncPipe, DecentralizedDataParallel
from decentpy.hybrid import pipeline_groups
from decentpy.optim import optim_fn_sgd
from decentpy.utils import initialize_dist

log = logging.getLogger("pipeline_gossip_digits")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2, help="stages x replicas must equal the number of processes")
    p.add_argument("--balance", default="4,3", help="layers per stage, comma-separated (7 layers in all)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--topology", default="complete", help="gossip topology of each stage's replicas")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="mini-batch per replica")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compare", action="store_true", help="skip the plain decentpy run")
    p.add_argument("--verbose", action="store_true", help="decentpy's own INFO logs too")
    return p.parse_args(argv)


def layers() -> List[nn.Module]:
    """7 layers: 64 -> 128 -> 128 -> 10, with dropout (as examples/pipeline_digits.py)."""
    return [nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(128, 10)]


def load_digits_split(seed: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x, y, train indices, test indices): 1500 training and 297 test images, the same on every rank."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    return x, y, order[:1500], order[1500:]


def batches(shard: Tensor, batch_size: int, seed: int) -> List[Tensor]:
    """The shard's mini-batches for one epoch; a function of ``seed`` alone, so every stage of a
    replica cuts the same ones (stage 0 feeds the inputs, the final stage the targets)."""
    perm = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(seed))]
    return [perm[i:i + batch_size] for i in range(0, len(perm), batch_size)]


def optimizer(lr: float) -> Callable[[List[Tuple[str, Tensor]]], torch.optim.Optimizer]:
    return lambda named: optim_fn_sgd(named, lr=lr, momentum=0.9, weight_decay=1e-4)


def train_pipelines(args: argparse.Namespace, x: Tensor, y: Tensor, train: Tensor,
                    test: Tensor) -> Dict[str, Any]:
    groups = pipeline_groups(args.stages, args.replicas)
    assert groups is not None  # every rank is in the layout (its ranks default to the world)
    torch.manual_seed(args.seed)  # replica 0's values are broadcast to the others by the wrapper anyway
    pipe = AsyncPipe(nn.Sequential(*layers()), [int(b) for b in args.balance.split(",")], group=groups.pipeline,
                     chunks=args.chunks, schedule=args.schedule)
    ddp = pipe.wrap_partition(lambda part: DecentralizedDataParallel(
        part, optimizer(args.lr), topology=args.topology, process_group=groups.replicas))
    assert ddp is not None  # every rank holds a stage
    per_replica = len(train) // args.replicas  # equal shards: every replica runs as many steps
    shard = train[groups.replica * per_replica:(groups.replica + 1) * per_replica]
    reporting = groups.final_stage and groups.replica == 0
    result: Dict[str, Any] = {"losses": []}
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        pipe.train()
        total = torch.zeros(2, dtype=torch.float64)  # (loss sum, samples) of this replica
        for idx in batches(shard, args.batch_size, args.seed * 1000 + 10 * epoch + groups.replica):
            loss = pipe.train_step(x[idx], y[idx], F.cross_entropy)  # the stage's wrapper steps inside
            if loss is not None:
                total += torch.tensor([loss.item() * len(idx), len(idx)], dtype=torch.float64)
        distance = ddp.consensus_distance()  # of this stage's replicas (a collective over them)
        if groups.final_stage:
            dist.all_reduce(total, group=groups.replicas)  # every replica's final stage
            mean = float(total[0] / total[1])
            result["losses"].append(mean)
            if reporting:
                log.info("epoch %d: train loss %.4f (mean of %d replicas), consensus distance of the last stage "
                         "%.2e", epoch + 1, mean, args.replicas, distance)
    ddp.global_avg(will_revert=False)  # every stage: the exact average of its replicas
    pipe.eval()
    with torch.no_grad():
        out = pipe(x[test] if groups.first_stage else None)
    seconds = time.perf_counter() - t0
    ddp.close()
    if not reporting:
        return {}
    result["accuracy"] = (out.argmax(1) == y[test]).float().mean().item()
    result["seconds"] = seconds
    log.info("pipelines (%d stages x %d replicas, %s, chunks %d): test accuracy %.3f in %.1f s", args.stages,
             args.replicas, args.topology, args.chunks, result["accuracy"], seconds)
    return result


def train_plain(args: argparse.Namespace, x: Tensor, y: Tensor, train: Tensor, test: Tensor) -> Tuple[float, float]:
    """Plain decentpy: every rank a whole model on its own shard, the same global batch per step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(args.seed)
    model = nn.Sequential(*layers())
    ddp = DecentralizedDataParallel(model, optimizer(args.lr), topology=args.topology)
    per_rank = len(train) // world
    shard = train[rank * per_rank:(rank + 1) * per_rank]
    batch = max(1, args.batch_size * args.replicas // world)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        for idx in batches(shard, batch, args.seed * 1000 + 10 * epoch + rank):
            F.cross_entropy(ddp(x[idx]), y[idx]).backward()
    ddp.global_avg(will_revert=False)
    model.eval()
    with torch.no_grad():
        acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    seconds = time.perf_counter() - t0
    ddp.close()
    return acc, seconds


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Train and evaluate both ways; on the final stage of replica 0 returns the per-epoch train
    losses, the test accuracy of the averaged pipelines and of plain decentpy (``{}`` elsewhere)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.verbose:
        logging.getLogger("decentpy").setLevel(logging.WARNING)
    initialize_dist()
    x, y, train, test = load_digits_split(args.seed)
    result = train_pipelines(args, x, y, train, test)
    if not args.no_compare:
        acc, seconds = train_plain(args, x, y, train, test)
        if result:
            result["plain_accuracy"], result["plain_seconds"] = acc, seconds
            log.info("plain decentpy (%d workers, %s): test accuracy %.3f in %.1f s", dist.get_world_size(),
                     args.topology, acc, seconds)
            log.info("test accuracy: pipelines %.3f, plain decentpy %.3f", result["accuracy"], acc)
    # every rank done before the teardown (a rank tearing gloo down while a peer still uses it can abort)
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
