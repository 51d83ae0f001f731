"""AFTER: torchft_diloco_before.py on decentpy: the Manager (and its Lighthouse) deleted, the import
switched, the replicas are the ranks of a torchrun job.

    torchrun --standalone --nproc_per_node=2 examples/migration/torchft_diloco_after.py
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from decentpy import DiLoCo


def make_data(replica, replicas):  # a small synthetic 4-class task; each replica its own half
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1024, 20, generator=g), torch.randn(20, 4, generator=g)
    y = (x @ w).argmax(1)
    return TensorDataset(x[replica:896:replicas], y[replica:896:replicas]), TensorDataset(x[896:], y[896:])


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def accuracy(model, data):
    x, y = data.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main(epochs=4, checkpoint_dir=None):
    dist.init_process_group("gloo")                      # torchrun's environment ("nccl" on GPUs)
    replica = dist.get_rank()
    train, test = make_data(replica, dist.get_world_size())
    loader = DataLoader(train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(replica))

    model = make_model()
    inner_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    outer_optimizer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    losses = []
    with DiLoCo([model], inner_optimizer, outer_optimizer, sync_every=8):  # topology="ring": a gossip outer step
        for epoch in range(epochs):
            for x, y in loader:
                inner_optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                inner_optimizer.step()                   # every 8th step: the outer step
            losses.append(loss.item())

    acc = accuracy(model, test)
    if replica == 0:
        print(f"epoch losses {[round(v, 4) for v in losses]}, test accuracy {acc:.3f}")
    dist.destroy_process_group()
    return {"losses": losses, "accuracy": acc}


if __name__ == "__main__":
    main()
