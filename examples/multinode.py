# multinode.py -- one torchrun per host; see docs/howto/multinode.md. On each of two hosts:
#   torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 \
#            --rdzv-id=my-job multinode.py
# The nodes come from torchrun's environment (LOCAL_WORLD_SIZE): alternating-exp-ring mixes across
# the nodes, intra_node="shard" shares each node's memory. Each rank prints one JSON line.
import argparse
import json
import os
import sys
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from decentpy import DecentralizedDataParallel
from decentpy.optim import optim_fn_adamw
from decentpy.utils import initialize_dist

p = argparse.ArgumentParser(description="decentpy across hosts: a few steps of gossip over torchrun's nodes")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--local-world-size", type=int, default=None,
               help="processes per node (default: torchrun's LOCAL_WORLD_SIZE)")
args = p.parse_args()

rank, world_size = initialize_dist()  # torchrun's rendezvous: gloo on CPU, NCCL with a GPU per rank
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")

g = torch.Generator().manual_seed(0)
x, w = torch.randn(4096, 20, generator=g), torch.randn(20, 4, generator=g)
y = (x @ w).argmax(1)
x, y = x[rank::world_size].to(device), y[rank::world_size].to(device)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
ddp = DecentralizedDataParallel(model, optim_fn=partial(optim_fn_adamw, lr=3e-3), topology="alternating-exp-ring",
                                intra_node="shard", local_world_size=args.local_world_size)
for step in range(args.steps):
    i = (32 * step) % (len(x) - 32)
    F.cross_entropy(ddp(x[i:i + 32]), y[i:i + 32]).backward()
ddp.wait()
checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
line = json.dumps({"rank": rank, "world": world_size, "node": int(os.environ.get("GROUP_RANK", "0")),
                   "replicas": ddp.topology.world_size, "topology": ddp.topology.name,  # (shard: one replica a node)
                   "checksum": checksum})
os.write(sys.stdout.fileno(), (line + "\n").encode())  # one write(2): the ranks share torchrun's stdout
ddp.close()
