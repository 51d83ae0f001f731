"""BEFORE: a fairscale 0.4.13 script with sharded optimizer state and gradients (OSS +
ShardedDataParallel); the decentpy version is fairscale_after.py.

    torchrun --standalone --nproc_per_node=2 examples/migration/fairscale_before.py
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim.oss import OSS


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
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler)

    model = make_model()
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.05, momentum=0.9)  # state sharded
    model = ShardedDataParallel(model, optimizer)        # each gradient reduced to its owner
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(loader))
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            optimizer.zero_grad(set_to_none=False)       # fairscale 0.4.13 needs False (see the guide)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()                             # each rank steps its shard, then broadcasts
            scheduler.step()
        losses.append(loss.item())

    model.eval()
    acc = accuracy(model.module, test)
    optimizer.consolidate_state_dict(recipient_rank=0)   # a collective: the whole state on rank 0
    if rank == 0 and checkpoint_dir:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(checkpoint_dir, "sharded.pt"))
    if rank == 0:
        print(f"epoch losses {[round(v, 4) for v in losses]}, test accuracy {acc:.3f}")
    dist.destroy_process_group()
    return {"losses": losses, "accuracy": acc}


if __name__ == "__main__":
    main()
