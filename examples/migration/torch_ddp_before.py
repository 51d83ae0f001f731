"""BEFORE: a torch DistributedDataParallel script (the decentpy version is torch_ddp_after.py).

    torchrun --standalone --nproc_per_node=2 examples/migration/torch_ddp_before.py
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


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

    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(loader))
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()                              # gradients all-reduced during backward
            optimizer.step()
            scheduler.step()
        losses.append(loss.item())

    model.eval()                                         # every rank holds the same model
    acc = accuracy(model.module, test)
    if rank == 0 and checkpoint_dir:                     # one checkpoint for the job
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(checkpoint_dir, "ddp.pt"))
    if rank == 0:
        print(f"epoch losses {[round(v, 4) for v in losses]}, test accuracy {acc:.3f}")
    dist.destroy_process_group()
    return {"losses": losses, "accuracy": acc}


if __name__ == "__main__":
    main()
