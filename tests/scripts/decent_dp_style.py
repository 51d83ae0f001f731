"""A training script written the way decent-dp's own scripts are, importing only ``decentpy.*``.

tests/test_dropin.py runs it under torchrun as it is, and again with every ``decentpy`` replaced
by ``decent_dp`` (the import-only switch, in reverse) to compare the losses. It uses what real
decent-dp scripts use: ``initialize_dist``, a ``Topology`` subclass registered with
``TopologyReg``, ``optim_fn`` over ``(name, tensor)`` pairs, the ``optim`` helpers and classes,
``model.zero_grad()`` before backward, the LR read through ``_lr_schedulers`` / ``_optims``,
``global_avg`` / ``revert_global_avg``, a checkpoint of ``state_dict()`` plus ``_optims`` and
``_lr_schedulers``, evaluation code that loads it into a plain model, and an optimizer with
``pre_average_hook``. Each rank writes what it saw to ``$DROPIN_OUT/rank<r>.json``.
"""

import json
import os
from functools import partial
from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn

from decentpy.utils import initialize_dist

rank, world_size = initialize_dist()

from decentpy.ddp import LR_SCHEDULER_FN_TYPE, OPTIM_FN_TYPE  # noqa: E402,F401
from decentpy.ddp import DecentralizedDataParallel as DecentDP  # noqa: E402
from decentpy.optim import AccumAdamW, lr_scheduler_fn_cosine_with_warmup, optim_fn_adam  # noqa: E402
from decentpy.topo import Edge, Topology, TopologyReg  # noqa: E402

torch.set_num_threads(1)
STEPS, RESUME_AT = 7, 4


@TopologyReg.register("test-pairs")
class PairsTopology(Topology):
    """Ranks (0, 1), (2, 3), ... average with self weight 0.7."""

    def _get_topo_edges(self) -> List[List[Edge]]:
        return [[Edge(ranks=[i, i + 1], weight=0.7) for i in range(0, self._world_size, 2)]]


ITERATION = [0]  # the script's iteration counter, read by the hook


class CountingAdam(torch.optim.Adam):
    """torch's Adam, recording every pre_average_hook call (and using edge.group)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.calls = []

    def pre_average_hook(self, edge, weight):
        t = torch.ones(1)
        dist.all_reduce(t, group=edge.group)  # the edge's process group spans exactly edge.ranks
        self.calls.append([ITERATION[0], list(edge.ranks), float(weight), float(t.item())])


def make_model(seed: int) -> nn.Module:
    # No bias before BatchNorm: its gradient is float noise, which Adam would amplify differently
    # in every implementation (and BatchNorm in eval mode then shows it).
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def data(step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def current_lr(model) -> float:
    if model._lr_schedulers and model._lr_schedulers[0] is not None:
        return model._lr_schedulers[0].get_last_lr()[0]
    return model._optims[0].param_groups[0]["lr"] if len(model._optims) > 0 else 0.0


def train(model, steps, first: int = 0, zero_grad: bool = True):
    losses, lrs = [], []
    for k in range(first, first + steps):
        ITERATION[0] = k + 1
        model.train()
        x, y = data(k)
        loss = nn.functional.mse_loss(model(x), y)
        if zero_grad:  # as decent-dp's quickstart (before forward, decent-dp would drop its lazy first step)
            model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        lrs.append(current_lr(model))
    return losses, lrs


def adam_fn(params):
    return optim_fn_adam(params, lr=0.01, weight_decay=0.0)


def accum_adamw_fn(params):
    return AccumAdamW([p for _, p in params], lr=0.01, weight_decay=0.05, accum_iter=2)


def counting_fn(params):
    return CountingAdam([p for _, p in params], lr=0.01)


sched_fn = partial(lr_scheduler_fn_cosine_with_warmup, t_max=STEPS, t_warmup=2)
out = {"rank": rank, "world_size": world_size, "backend": dist.get_backend()}
x_test = torch.randn(16, 6, generator=torch.Generator().manual_seed(7))

# 1. complete topology, optim_fn helper, scheduler, checkpoint, evaluation in a plain model, resume
model = DecentDP(make_model(0), optim_fn=adam_fn, lr_scheduler_fn=sched_fn, topology="complete",
                 sync_buffer_in_global_avg=True, bucket_size_in_mb=0.0005)
losses, lrs = train(model, RESUME_AT)
model.global_avg(will_revert=False)
path = os.path.join(os.environ["DROPIN_OUT"], f"ckpt{rank}.pt")
torch.save({"model": model.state_dict(),
            "optimizers": [o.state_dict() for o in model._optims],
            "lr_schedulers": [s.state_dict() for s in model._lr_schedulers if s is not None]}, path)
ckpt = torch.load(path)
more, more_lrs = train(model, STEPS - RESUME_AT, RESUME_AT)
out["complete"] = {"losses": losses + more, "lrs": lrs + more_lrs, "n_buckets": len(model._optims),
                   "keys": list(ckpt["model"])}

plain = make_model(1)  # evaluation code: strip the wrapper's prefix, load strictly
plain.load_state_dict({k[len("_model."):] if k.startswith("_model.") else k: v for k, v in ckpt["model"].items()})
plain.eval()
resumed = DecentDP(make_model(2), optim_fn=adam_fn, lr_scheduler_fn=sched_fn, topology="complete",
                   sync_buffer_in_global_avg=True, bucket_size_in_mb=0.0005)
resumed.load_state_dict(ckpt["model"])
resumed.eval()
with torch.no_grad():
    out["complete"]["plain_eval"] = plain(x_test).tolist()
    out["complete"]["wrapper_eval"] = resumed(x_test).tolist()
if len(resumed._optims) > 0:  # decent-dp builds its optimizers lazily, in the second iteration
    for o, sd in zip(resumed._optims, ckpt["optimizers"]):
        o.load_state_dict(sd)
    for s, sd in zip([s for s in resumed._lr_schedulers if s is not None], ckpt["lr_schedulers"]):
        s.load_state_dict(sd)
    out["complete"]["resumed"], out["complete"]["resumed_lrs"] = train(resumed, STEPS - RESUME_AT, RESUME_AT)

# 2. a registered custom topology, AccumAdamW, global_avg / revert around an evaluation, an
#    adaptive mixing factor, gradient accumulation with set_accumulate_grad
model = DecentDP(make_model(0), optim_fn=accum_adamw_fn, topology="test-pairs")
losses, _ = train(model, 4)
d2c = model.global_avg(will_revert=True, return_d2c=True)
model.eval()
with torch.no_grad():
    avg_eval = model(x_test).tolist()
model.revert_global_avg()
model.set_adaptive_factor(0.5)
more, _ = train(model, 2, 4)
model.set_accumulate_grad(True)
accumulated, _ = train(model, 1, 6)  # gradients only
model.set_accumulate_grad(False)
last, _ = train(model, 2, 7, zero_grad=False)
out["pairs"] = {"losses": losses + more + accumulated + last, "avg_eval": avg_eval, "d2c": d2c}

# 3. an optimizer with pre_average_hook (torch's Adam underneath), on the custom topology
model = DecentDP(make_model(0), optim_fn=counting_fn, topology="test-pairs", bucket_size_in_mb=0.0005)
losses, _ = train(model, 5)
out["hook"] = {"losses": losses, "calls": [o.calls for o in model._optims]}

with open(os.path.join(os.environ["DROPIN_OUT"], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
