"""AFTER: torch_ddp_before.py moved to decentpy's decentralized data parallelism.

    torchrun --standalone --nproc_per_node=2 examples/migration/torch_ddp_after.py

What changed (each marked CHANGED below):
1. the optimizer is built per bucket by ``optim_fn`` and the LR scheduler by ``lr_scheduler_fn``;
2. no ``optimizer.step()`` / ``zero_grad()``: each bucket steps inside ``backward()``;
3. ``ddp.global_avg()`` before evaluating or saving: the workers' models differ slightly;
4. checkpoints to resume are per rank (``training_state_dict``); the averaged model is one file.
"""
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from decentpy import DecentralizedDataParallel                      # CHANGED
from decentpy.optim import optim_fn_sgd                             # CHANGED


def make_data():  # a small synthetic 4-class task, the same on every rank
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1024, 20, generator=g), torch.randn(20, 4, generator=g)
    y = (x @ w).argmax(1)
    return TensorDataset(x[:896], y[:896]), TensorDataset(x[896:], y[896:])


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def accuracy(model, data):
    x, y = data.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main(epochs=4, checkpoint_dir=None):
    dist.init_process_group("gloo")                      # torchrun's environment ("nccl" on GPUs)
    rank = dist.get_rank()
    train, test = make_data()
    sampler = DistributedSampler(train, shuffle=True, seed=0)   # each rank reads its own shard
    loader = DataLoader(train, batch_size=32, sampler=sampler)

    steps = epochs * len(loader)
    model = DecentralizedDataParallel(                                             # CHANGED (1)
        make_model(),
        optim_fn=partial(optim_fn_sgd, lr=0.05, momentum=0.9, weight_decay=0.0),
        lr_scheduler_fn=partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=steps),
        topology="complete")          # "ring", "one-peer-exp", ... (docs: choosing a topology)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()           # CHANGED (2): mixes with the peers and steps, bucket by bucket
        losses.append(loss.item())

    if checkpoint_dir:                                                             # CHANGED (4)
        # (training_state_dict completes the exchange in flight itself and saves it: no wait() first)
        torch.save(model.training_state_dict(), os.path.join(checkpoint_dir, f"rank{rank}.pt"))
    model.global_avg()                # CHANGED (3): every rank now holds the exact average
    model.eval()
    acc = accuracy(model.module, test)
    if rank == 0 and checkpoint_dir:  # the averaged model: a plain state dict, one file
        torch.save(model.module.state_dict(), os.path.join(checkpoint_dir, "model.pt"))
    model.close()
    if rank == 0:
        print(f"epoch losses {[round(v, 4) for v in losses]}, test accuracy {acc:.3f}")
    dist.destroy_process_group()
    return {"losses": losses, "accuracy": acc}


if __name__ == "__main__":
    main()
