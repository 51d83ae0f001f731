"""Profile a few decentralized training steps, then keep training (tests/test_dropin.py).

The shape of the published decent-dp experiment scripts: the torch profiler wraps the loop with a
wait/warmup/active schedule and ``profiler.step()`` per iteration, training goes on after it
stops. Pair exchanges launched while the profiler ran used to crash the process at exit. Rank 0
writes the names of the profiled events to ``$PROFILE_OUT``.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, schedule

from decentpy.ddp import DecentralizedDataParallel
from decentpy.optim import optim_fn_adamw
from decentpy.utils import initialize_dist

rank, world_size = initialize_dist()
torch.set_num_threads(1)
torch.manual_seed(0)
model = DecentralizedDataParallel(
    nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)),
    optim_fn_adamw, topology=os.environ.get("TOPOLOGY", "ring"), bucket_size_in_mb=0.01)
names = set()


def step(k: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + k)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()


with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
             on_trace_ready=lambda p: names.update(e.key for e in p.key_averages()), record_shapes=True,
             profile_memory=True) as profiler:
    for k in range(6):
        step(k)
        profiler.step()
for k in range(6, 30):
    step(k)
if rank == 0:
    with open(os.environ["PROFILE_OUT"], "w") as f:
        json.dump(sorted(names), f)
dist.destroy_process_group()
