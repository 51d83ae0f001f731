"""Decentralized data-parallel training of a small CNN on scikit-learn's digits, on CPU.

Launch (4 workers = 2 "nodes" x 2 local workers, gloo backend)::

    torchrun --standalone --nproc_per_node=4 examples/train_digits.py
    torchrun --standalone --nproc_per_node=4 examples/train_digits.py \
        --topology one-peer-exp --optimizer sgd --epochs 10 --compare none

Every worker trains its own copy of the model on a disjoint shard of the training set; after each
local step it averages its parameters with the peers chosen by the topology (gossip), instead of
an all-reduce of gradients. At the end ``ddp.global_avg()`` gives every worker the exact average
of all models, whose test accuracy is reported. ``--compare complete`` (the default) then repeats
the same run with the ``complete`` topology and prints both results side by side.

The data set (1797 8x8 images) ships with scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import decentpy.optim as dopt
from decentpy import DecentralizedDataParallel as DDP
from decentpy import PreemptionCheckpointer
from decentpy.comm import everyone
from decentpy.config import runtime_summary
from decentpy.utils import choose_backend, initialize_dist

log = logging.getLogger("train_digits")

OPTIMIZERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "accum-adam": dopt.optim_fn_accum_adam,
    "accum-adamw": dopt.optim_fn_accum_adamw,
    "adam": dopt.optim_fn_adam,
    "adamw": dopt.optim_fn_adamw,
    "sgd": dopt.optim_fn_sgd,
}
DEFAULT_LR: Dict[str, float] = {
    "accum-adam": 3e-3,
    "accum-adamw": 3e-3,
    "adam": 3e-3,
    "adamw": 3e-3,
    "sgd": 0.05,
}


@dataclass
class Data:
    """Standardized digits, train and test split, as NCHW float tensors."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


@dataclass
class RunResult:
    """Outcome of one training run."""

    topology: str
    test_acc: float
    setup_s: float  # DDP construction (sub-group creation), once per process and topology
    wall_s: float  # training + global_avg + evaluation, after setup
    final_train_loss: float
    final_consensus: float


class SmallCNN(nn.Module):
    """Conv(1,16,3)-ReLU-Conv(16,32,3)-ReLU-flatten-Linear(512,64)-ReLU-Linear(64,10)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3)  # 8x8 -> 6x6
        self.conv2 = nn.Conv2d(16, 32, 3)  # 6x6 -> 4x4
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="alternating-exp-ring", help="communication topology")
    p.add_argument("--optimizer", default="accum-adam", choices=sorted(OPTIMIZERS))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=None, help="default: 3e-3 for Adam variants, 0.05 for SGD")
    p.add_argument("--batch-size", type=int, default=16, help="per-worker batch size")
    p.add_argument("--accum-iter", type=int, default=4, help="accum_iter of AccumAdam/AccumAdamW")
    p.add_argument("--schedule", default="cosine", choices=["cosine", "constant"], help="learning-rate schedule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compare",
        default="complete",
        help="after the main run, train again with this topology and print both results ('none': skip)",
    )
    p.add_argument(
        "--local-world-size",
        type=int,
        default=2,
        help="workers per node as seen by the topology (torchrun --standalone would say all of them; "
        "alternating-exp-ring needs >= 2 per node and >= 2 nodes)",
    )
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write a consistent checkpoint (every rank, manifest last) every --checkpoint-every steps and "
                        "on SIGTERM (then stop); see decentpy.PreemptionCheckpointer")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir")
    p.add_argument("--backend", default=None,
                   help="process-group backend (default: nccl with one GPU per worker, else gloo)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model trains (auto: cuda when a GPU is visible; workers may share one GPU, "
                        "over gloo)")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="write each rank's training state (DIR/<topology>/train_state_rank<r>.pt, resumable with "
                        "load_training_state_dict) and the averaged model (DIR/<topology>/model.pt), then check that "
                        "the model file loads into a plain SmallCNN with the same test accuracy")
    return p.parse_args(argv)


def load_data(seed: int) -> Data:
    """Load scikit-learn's bundled digits, split 80/20 (stratified, seeded) and standardize.

    Every rank computes the same split from the same seed, so no data is exchanged.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    digits = load_digits()
    x, y = digits.data.astype("float32"), digits.target.astype("int64")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_tr)  # constant pixels keep scale 1
    x_tr, x_te = scaler.transform(x_tr), scaler.transform(x_te)

    def to_images(a) -> Tensor:  # type: ignore[no-untyped-def]
        return torch.from_numpy(a.astype("float32")).reshape(-1, 1, 8, 8).contiguous()

    return Data(to_images(x_tr), torch.from_numpy(y_tr), to_images(x_te), torch.from_numpy(y_te))


def shard_indices(n: int, rank: int, world: int, seed: int) -> Tensor:
    """Disjoint, equal-sized shard of ``range(n)`` for ``rank`` (like DistributedSampler, drop_last).

    A seeded permutation (identical on every rank) is cut to a multiple of ``world`` and strided
    by rank. Equal sizes matter: in decentralized training every worker must take the same
    number of steps, or its neighbours would wait for an exchange that never comes.
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    per_rank = n // world
    return perm[rank : per_rank * world : world]


def make_optim_fn(name: str, lr: float, accum_iter: int) -> Callable[[List[Tuple[str, Tensor]]], torch.optim.Optimizer]:
    """Bind the learning rate (and accum_iter for the accumulated variants) to a decentpy optimizer helper."""
    fn = OPTIMIZERS[name]
    if name.startswith("accum-"):
        return functools.partial(fn, lr=lr, accum_iter=accum_iter)
    return functools.partial(fn, lr=lr)


def all_sum(values: List[float], device: torch.device) -> List[float]:
    """Sum a few floats over all ranks (on ``device``: NCCL reduces GPU tensors only)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(ddp: DDP, x: Tensor, y: Tensor, batch_size: int = 512) -> float:
    """Accuracy of the wrapped model on (x, y); in eval mode, so no step or exchange happens."""
    ddp.eval()
    device = next(ddp.parameters()).device
    correct = 0
    for i in range(0, len(x), batch_size):
        out = ddp(x[i : i + batch_size].to(device)).cpu()
        correct += int((out.argmax(1) == y[i : i + batch_size]).sum())
    return correct / len(x)


def choose_device(args: argparse.Namespace) -> Tuple[torch.device, Optional[str]]:
    """The device the model trains on, and the backend to ask for (None: initialize_dist's choice).

    With a GPU per worker, initialize_dist's own choice: NCCL, each local rank on its own GPU. With
    fewer GPUs than workers on the node (decentpy.utils.choose_backend refuses NCCL then), the workers
    share them over gloo (decentpy stages gloo's point-to-point messages through host memory)."""
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu"), args.backend or "gloo"
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    try:
        _, index = choose_backend(local_rank, local_world, gpus)
        return torch.device("cuda", index), args.backend
    except RuntimeError:  # fewer GPUs than workers: share them
        index = local_rank % gpus
        torch.cuda.set_device(index)
        return torch.device("cuda", index), args.backend or "gloo"


def train_once(args: argparse.Namespace, data: Data, topology: str) -> RunResult:
    """Train a fresh model (same seed) with ``topology``; return the averaged model's test accuracy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]

    torch.manual_seed(args.seed)  # identical initial model on every rank (and in every run)
    model = SmallCNN().to(args.device_)

    shard = shard_indices(len(data.x_train), rank, world, args.seed)
    steps_per_epoch = (len(shard) + args.batch_size - 1) // args.batch_size
    total_steps = steps_per_epoch * args.epochs

    lr_scheduler_fn = None
    if args.schedule == "cosine":
        lr_scheduler_fn = functools.partial(
            dopt.lr_scheduler_fn_cosine_with_warmup,
            t_max=total_steps,
            t_warmup=max(1, total_steps // 10),
        )

    dist.barrier()
    t0 = time.perf_counter()
    ddp = DDP(
        model,
        make_optim_fn(args.optimizer, lr, args.accum_iter),
        lr_scheduler_fn=lr_scheduler_fn,
        topology=topology,
        local_world_size=min(args.local_world_size, world),
    )
    setup_s = time.perf_counter() - t0
    if rank == 0:
        log.info(
            "[%s] %d workers (local world size %d), %s lr=%g, batch %d/worker, %d samples/worker, "
            "%d steps/epoch; setup %.2fs",
            topology, world, min(args.local_world_size, world), args.optimizer, lr,
            args.batch_size, len(shard), steps_per_epoch, setup_s,
        )  # fmt: skip

    shuffle = torch.Generator().manual_seed(args.seed * 1000 + rank)  # own shuffling per worker
    loss_sum = correct = count = 0.0
    cons = float("nan")
    ckpt = None
    first_epoch, first_offset, step, order_saved = 1, 0, 0, None
    if args.checkpoint_dir:
        ckpt = PreemptionCheckpointer(ddp, os.path.join(args.checkpoint_dir, topology), every=args.checkpoint_every)
        resumed = ckpt.resume() if args.resume else None
        if resumed is not None:
            e = resumed["extra"]
            step, first_epoch, first_offset, order_saved = resumed["step"], e["epoch"], e["offset"], e["order"]
            shuffle.set_state(e["shuffle"])
            loss_sum, correct, count = e["sums"]
            if rank == 0:
                log.info("[%s] resumed at step %d (epoch %d)", topology, step, first_epoch)
    stopped = False
    for epoch in range(first_epoch, args.epochs + 1):
        te = time.perf_counter()
        ddp.train()
        if order_saved is not None:  # resuming inside this epoch
            order, order_saved = order_saved, None
        else:
            order = shard[torch.randperm(len(shard), generator=shuffle)]
            loss_sum = correct = count = 0.0
        for i in range(first_offset, len(order), args.batch_size):
            idx = order[i : i + args.batch_size]
            x, y = data.x_train[idx].to(args.device_), data.y_train[idx].to(args.device_)
            out = ddp(x)
            loss = F.cross_entropy(out, y)
            loss.backward()  # the optimizer steps and the exchange is launched inside backward
            loss_sum += float(loss.detach()) * len(y)
            correct += float((out.detach().argmax(1) == y).sum())
            count += len(y)
            step += 1
            if ckpt is not None and ckpt.after_step(step, {
                    "epoch": epoch, "offset": i + args.batch_size, "order": order, "shuffle": shuffle.get_state(),
                    "sums": (loss_sum, correct, count)}):
                stopped = True
                break
        first_offset = 0
        if stopped:
            if rank == 0:
                log.info("[%s] preempted: checkpoint of step %d written; run again with --resume", topology, step)
            break
        loss_sum, correct, count = all_sum([loss_sum, correct, count], args.device_)
        cons = ddp.consensus_distance()  # collective: every rank calls it
        if rank == 0:
            log.info(
                "[%s] epoch %2d/%d  loss %.4f  train acc %.3f  consensus %.3e  %.2fs",
                topology, epoch, args.epochs, loss_sum / count, correct / count, cons,
                time.perf_counter() - te,
            )  # fmt: skip

    if args.save:
        out_dir = os.path.join(args.save, topology)
        os.makedirs(out_dir, exist_ok=True)
        # Each worker's own trajectory: model, per-bucket optimizer/scheduler state, step, layout and
        # the exchange in flight (resume with ddp.load_training_state_dict(torch.load(...))).
        torch.save(ddp.training_state_dict(), os.path.join(out_dir, f"train_state_rank{rank}.pt"))
    ddp.global_avg()  # every worker now holds the exact average of all models
    acc = evaluate(ddp, data.x_test, data.y_test)
    if args.save and rank == 0:
        save_and_check_model(ddp, os.path.join(args.save, topology, "model.pt"), data, acc)
    dist.barrier()
    wall = time.perf_counter() - t0 - setup_s

    # Sanity check: after global_avg every rank must hold the same model, hence the same accuracy.
    accs = everyone(acc)  # (plain data as JSON: torch's object collectives would unpickle what a peer sends)
    if rank == 0:
        if max(accs) - min(accs) > 1e-12:
            log.warning("[%s] ranks disagree after global_avg: test accuracies %s", topology, accs)
        log.info("[%s] averaged model: test acc %.4f (%d samples), training wall %.1fs (+ setup %.1fs)",
                 topology, acc, len(data.y_test), wall, setup_s)  # fmt: skip

    del ddp, model
    gc.collect()
    return RunResult(topology, acc, setup_s, wall, loss_sum / max(count, 1.0), cons)


def save_and_check_model(ddp: DDP, path: str, data: Data, acc: float) -> None:
    """Save the averaged model as the wrapper's ``state_dict()`` (keys ``_model.*``) and load it the
    way evaluation code does: into a plain model, prefix stripped, strictly."""
    torch.save(ddp.state_dict(), path)
    state = torch.load(path)
    plain = SmallCNN()
    plain.load_state_dict({k.removeprefix("_model."): v for k, v in state.items()})
    plain.eval()
    with torch.no_grad():
        plain_acc = int((plain(data.x_test).argmax(1) == data.y_test).sum()) / len(data.y_test)
    log.info("saved the averaged model to %s; loaded into a plain SmallCNN: test acc %.4f (wrapper: %.4f)",
             path, plain_acc, acc)
    if abs(plain_acc - acc) > 1e-12:
        raise RuntimeError(f"the saved model evaluates to {plain_acc}, the wrapper to {acc}")


def main(argv: Optional[List[str]] = None) -> None:
    """Parse options, set up the process group, train (and optionally compare), shut down."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # several workers share few cores
    args.device_, backend = choose_device(args)
    rank, _ = initialize_dist(backend=backend)  # torchrun's environment
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        if rank == 0:
            log.info("%s, torch %s, world size %d, backend %s, device %s", runtime_summary(),
                     torch.__version__, dist.get_world_size(), dist.get_backend(), args.device_)  # fmt: skip
        data = load_data(args.seed)
        results = [train_once(args, data, args.topology)]
        if args.compare and args.compare.lower() != "none":
            results.append(train_once(args, data, args.compare))
        if rank == 0:
            print_table(results)
    finally:
        dist.destroy_process_group()


def print_table(results: List[RunResult]) -> None:
    """Final summary: one row per run."""
    w = max(len("topology"), *(len(r.topology) for r in results))
    lines = [
        f"{'topology':<{w}}  {'test acc (avg model)':>20}  {'final train loss':>16}  {'consensus':>10}"
        f"  {'train wall':>10}  {'setup':>6}",
    ]
    for r in results:
        lines.append(
            f"{r.topology:<{w}}  {r.test_acc:>20.4f}  {r.final_train_loss:>16.4f}  {r.final_consensus:>10.2e}"
            f"  {r.wall_s:>9.1f}s  {r.setup_s:>5.1f}s"
        )
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
