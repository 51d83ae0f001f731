# quickstart.py -- run with: torchrun --standalone --nproc_per_node=2 quickstart.py
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from decentpy import DecentralizedDataParallel
from decentpy.optim import optim_fn_adamw
from decentpy.utils import initialize_dist

rank, world_size = initialize_dist()  # from torchrun's environment: gloo on CPU, NCCL with a GPU per rank
local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun: this rank's GPU on its machine
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")

# A toy task (4 classes from 20 features); every rank trains on its own shard of the data.
g = torch.Generator().manual_seed(0)
x, w = torch.randn(2048, 20, generator=g), torch.randn(20, 4, generator=g)
y = (x @ w).argmax(1)
x, y = x.to(device), y.to(device)
x_train, y_train = x[:1792][rank::world_size], y[:1792][rank::world_size]

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)  # before wrapping it
ddp = DecentralizedDataParallel(model, optim_fn=partial(optim_fn_adamw, lr=3e-3), topology="ring")

ddp.train()
for epoch in range(5):
    for i in range(0, len(x_train), 32):
        loss = F.cross_entropy(ddp(x_train[i:i + 32]), y_train[i:i + 32])
        loss.backward()  # each bucket mixes with its peers and steps here: no optimizer.step()

distance = ddp.consensus_distance()  # how far apart the workers' models are (a collective)
ddp.global_avg()                     # every rank now holds the exact average of the models
ddp.eval()
with torch.no_grad():
    accuracy = (ddp(x[1792:]).argmax(1) == y[1792:]).float().mean().item()
if rank == 0:
    print(f"{world_size} workers on {device.type} ({dist.get_backend()}): consensus distance {distance:.2e}; "
          f"test accuracy of the averaged model {accuracy:.3f}")
dist.destroy_process_group()
