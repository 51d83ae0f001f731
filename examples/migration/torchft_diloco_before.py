"""BEFORE: a torchft 0.2.0 DiLoCo script (each process its own replica group, a Manager talking to
torchft's Lighthouse); the decentpy version is torchft_diloco_after.py.

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 10000 &
    TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=0 python examples/migration/torchft_diloco_before.py &
    TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=1 python examples/migration/torchft_diloco_before.py
"""
import os
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchft import Manager, ProcessGroupGloo
from torchft.local_sgd import DiLoCo


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
    replica = int(os.environ.get("REPLICA_GROUP_ID", 0))
    train, test = make_data(replica, 2)
    loader = DataLoader(train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(replica))

    model = make_model()
    inner_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    outer_optimizer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner_optimizer.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner_optimizer.state_dict()},
        replica_id=f"diloco_{replica}",
        timeout=timedelta(seconds=30),
    )
    losses = []
    with DiLoCo(manager, [model], inner_optimizer, outer_optimizer, sync_every=8):
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
    manager.shutdown()
    return {"losses": losses, "accuracy": acc}


if __name__ == "__main__":
    main()
