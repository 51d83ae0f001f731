"""Pipeline-parallel training of an MLP on scikit-learn's digits, on CPU: decentpy.AsyncPipe.

Launch (one stage per process; the layers are split by ``--balance``)::

    torchrun --standalone --nproc_per_node=2 examples/pipeline_digits.py
    torchrun --standalone --nproc_per_node=4 examples/pipeline_digits.py --balance 2,2,2,1 --schedule gpipe

Every rank calls ``pipe.train_step`` each step (stage 0 feeds the inputs, the last stage the
targets and the loss); each stage steps its own optimizer on its own layers. The last stage
prints the loss and, at the end, the test accuracy of the pipelined model (an eval-mode forward
through every stage).
"""

from __future__ import annotations

import argparse
import gc
import logging
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from decentpy import AsyncPipe
from decentpy.utils import initialize_dist

log = logging.getLogger("pipeline_digits")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--balance", default="4,3", help="layers per stage, comma-separated (7 layers in all)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--checkpoint", choices=("always", "except_last", "never"), default="except_last")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def layers() -> List[nn.Module]:
    """7 layers: 64 -> 128 -> 128 -> 10, with dropout (recomputed identically under checkpointing)."""
    return [nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(128, 10)]


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Train and evaluate; the final stage's per-epoch train losses and test accuracy (empty on
    the other stages)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    initialize_dist()
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(x), generator=g)
    train, test = order[:1500], order[1500:]

    torch.manual_seed(args.seed)  # the same initial model on every rank (each builds only its stage)
    pipe = AsyncPipe(nn.Sequential(*layers()), [int(b) for b in args.balance.split(",")], chunks=args.chunks,
                     checkpoint=args.checkpoint, schedule=args.schedule)
    params = list(pipe.parameters())
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9) if params else None
    result: Dict[str, Any] = {}
    for epoch in range(args.epochs):
        pipe.train()
        perm = train[torch.randperm(len(train), generator=g)]
        total = 0.0
        for i in range(0, len(perm), args.batch_size):
            idx = perm[i:i + args.batch_size]
            loss = pipe.train_step(x[idx], y[idx], F.cross_entropy)
            if opt is not None:
                opt.step()
                opt.zero_grad()
            if loss is not None:
                total += loss.item() * len(idx)
        if pipe.final_stage:
            log.info("epoch %d: train loss %.4f", epoch + 1, total / len(perm))
            result.setdefault("losses", []).append(total / len(perm))
    pipe.eval()
    with torch.no_grad():
        out = pipe(x[test] if pipe.stage == 0 else None)
    if pipe.final_stage:
        acc = (out.argmax(1) == y[test]).float().mean().item()
        log.info("test accuracy %.3f (%d stages, chunks %d, %s)", acc, pipe.num_stages, args.chunks, args.schedule)
        result["accuracy"] = acc
    # Free the pipe now, while the interpreter is fully alive: it holds the process group, and a gloo
    # group whose last reference goes during interpreter shutdown can abort the process ("terminate
    # called without an active exception"). Every rank is done before the teardown.
    del pipe, opt, params
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
