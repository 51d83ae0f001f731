"""AFTER: decent_dp_before.py on decentpy: only the three import lines changed (decent_dp -> decentpy).

    torchrun --standalone --nproc_per_node=2 examples/migration/decent_dp_after.py
"""
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from decentpy.ddp import DecentralizedDataParallel as DecentDP
from decentpy.optim import lr_scheduler_fn_cosine_with_warmup, optim_fn_adamw
from decentpy.utils import initialize_dist


def make_data(rank, world_size):  # a small synthetic 4-class task; rank r reads rows r, r + n, ...
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1024, 20, generator=g), torch.randn(20, 4, generator=g)
    y = (x @ w).argmax(1)
    return (x[:896][rank::world_size], y[:896][rank::world_size]), (x[896:], y[896:])


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def main(epochs=4, batch=32):
    rank, world_size = initialize_dist()
    (x_train, y_train), (x_test, y_test) = make_data(rank, world_size)
    steps = epochs * (len(x_train) // batch)
    ddp = DecentDP(make_model(),
                   optim_fn=partial(optim_fn_adamw, lr=3e-3, weight_decay=0.0),
                   lr_scheduler_fn=partial(lr_scheduler_fn_cosine_with_warmup, t_max=steps, t_warmup=10),
                   topology="complete")
    losses = []
    for epoch in range(epochs):
        ddp.train()
        for i in range(0, len(x_train) - batch + 1, batch):
            loss = F.cross_entropy(ddp(x_train[i:i + batch]), y_train[i:i + batch])
            loss.backward()
        losses.append(loss.item())
    ddp.global_avg()
    ddp.eval()
    with torch.no_grad():
        acc = (ddp(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:
        print(f"epoch losses {[round(v, 4) for v in losses]}, test accuracy {acc:.3f}")
    dist.destroy_process_group()
    return {"losses": losses, "accuracy": acc}


if __name__ == "__main__":
    main()
