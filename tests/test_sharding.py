"""Sharded training (decentpy.OSS, ShardedDataParallel, ShardedGradScaler) on gloo workers.

Every run is checked against plain PyTorch computed in the same workers on a twin model, never
against decentpy itself: torch DDP (``find_unused_parameters`` where needed) + the same torch
optimizer on the full model, ``torch.nn.utils.clip_grad_norm_`` on the DDP-averaged gradients,
``torch.amp.GradScaler("cpu")``, torch's LR schedulers on both, torch's own ``Join`` with DDP,
torch optimizers' ``state_dict``/``load_state_dict``. The one exception is by design: a run resumed
from a saved state must be bit-identical to the same run left uninterrupted.

One spawn per world size runs every scenario and returns all results; world 4 also runs every
scenario on two disjoint sub-groups of 2 ({1, 3} and {0, 2}, concurrently). The tests below only
assert on the cached results, so a failure names its scenario and configuration.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import traceback
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from dist_harness import run_workers
from reference import IN, OUT, batch, loss_fn, make_cnn, make_mlp

RTOL, ATOL = 1e-5, 1e-6
SUBGROUPS = ([1, 3], [0, 2])  # the sub-groups of the world-4 spawn; [1, 3]: group rank != global rank

# --- models and optimizers -----------------------------------------------------------------------


class Branchy(nn.Module):
    """``side`` is used on some steps / some ranks only; ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, 16)
        self.out = nn.Linear(16, OUT)
        self.side = nn.Linear(16, OUT)
        self.never = nn.Linear(4, 4)

    def forward(self, x: Tensor, use_side: bool = False) -> Tensor:
        h = torch.tanh(self.inp(x))
        y = self.out(h)
        return y + self.side(h) if use_side else y


def use_side(grank: int, k: int) -> bool:
    # step 0, 3: unused on every rank; step 1, 4: used on group rank 0 only; step 2: used everywhere
    return (k % 3 == 1 and grank == 0) or k % 3 == 2


def make_model(kind: str) -> nn.Module:
    if kind == "mlp":
        return make_mlp(0)
    if kind == "branchy":
        return Branchy()
    if kind == "linear":  # two tensors: on 4 ranks, two of them own nothing
        torch.manual_seed(0)
        return nn.Linear(IN, OUT)
    if kind == "cnn":  # channels_last convolutions: gradients viewed in the parameters' memory layout
        return make_cnn(0).to(memory_format=torch.channels_last)
    if kind == "tripwire":  # a frozen LongTensor parameter (fairscale's test model): kept, never stepped
        model = make_mlp(0)
        model.register_parameter("tripwire", nn.Parameter(torch.LongTensor([3, 3]), requires_grad=False))
        return model
    if kind == "big":  # a 90,000-element weight: above OSS's default split size (2**16)
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, 300), nn.Tanh(), nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, OUT))
    if kind == "odd":  # weights of 66 and 33 elements: split into pieces of unequal length
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, 11), nn.Tanh(), nn.Linear(11, OUT))
    raise ValueError(kind)


OPTIMS: Dict[str, Tuple[type, dict]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5)),  # not fused: torch's own step on the pieces
}


def param_groups(model: nn.Module, how: str) -> Any:
    """What the optimizer is given: the bare parameter iterator, or two groups (weights, biases)
    with their own hyperparameters."""
    if how == "one":
        return model.parameters()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": weights}, {"params": biases, "lr": 0.2, "momentum": 0.5}]


def group_names(model: nn.Module, how: str) -> List[List[Tuple[str, int]]]:
    named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]  # others: no owner
    if how == "one":
        return [[(n, p.numel()) for n, p in named]]
    return [[(n, p.numel()) for n, p in named if n.endswith("weight")],
            [(n, p.numel()) for n, p in named if not n.endswith("weight")]]


def expected_owners(groups: List[List[Tuple[str, int]]], gsize: int, loads: Optional[List[int]] = None) -> Dict[str, int]:
    """The documented partition rule for parameters below the split size, written from its text:
    all parameters of all groups laid end to end (group order, then order in the group) and cut
    into one share per rank in rank order: with nothing owned yet, total // world each, one more
    for the lowest total % world ranks; on top of ``loads`` (parameters added later), the shares
    fill the least loaded ranks up to one common level (the rounding remainder one element each
    to the lowest of them). A parameter goes to the first rank whose share ends at or after its
    midpoint."""
    items = [(name, numel) for g in groups for name, numel in g]
    total = sum(n for _, n in items)
    loads = list(loads) if loads is not None else [0] * gsize
    level = 0.0
    for k in range(1, gsize + 1):  # the level reached when the k least loaded ranks share the total
        low = sorted(loads)[:k]
        level = (total + sum(low)) / k
        if k == gsize or level <= sorted(loads)[k]:
            break
    shares = [max(0, int(level - loads[r])) if loads[r] < level else 0 for r in range(gsize)]
    for r in range(gsize):
        if sum(shares) < total and loads[r] < level:
            shares[r] += 1
    ends, acc = [], 0
    for r in range(gsize):
        acc += shares[r]
        ends.append(acc)
    owner, pos = {}, 0
    for name, numel in items:
        mid = pos + numel / 2
        owner[name] = next((r for r in range(gsize) if mid <= ends[r]), gsize - 1)
        pos += numel
    return owner


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def grads(model: nn.Module) -> Dict[str, Optional[Tensor]]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


# --- the worker ------------------------------------------------------------------------------------


class Ctx:
    def __init__(self, pg: Any, ref_pg: Any, grank: int, gsize: int, tag: str, ckpt_dir: str) -> None:
        self.pg, self.ref_pg, self.grank, self.gsize, self.tag, self.ckpt_dir = pg, ref_pg, grank, gsize, tag, ckpt_dir

    def barrier(self) -> None:
        dist.barrier(group=self.pg)


SCENARIOS: Dict[str, dict] = {
    "sgd": dict(opt="sgd"),                                   # oss.zero_grad() (torch's default: None)
    "sgd_keep": dict(opt="sgd", zero=("sdp", False)),         # sdp.zero_grad(set_to_none=False)
    "adam": dict(opt="adam", zero=("sdp", True)),
    "adam_keep": dict(opt="adam", zero=("oss", False)),
    "adamw": dict(opt="adamw"),
    "two_groups": dict(opt="sgd", groups="two"),
    "frozen": dict(opt="adam", frozen=["2.weight"]),
    "flip": dict(opt="adam", frozen=["4.bias"], flip=(["0.weight"], ["4.bias"])),
    "unused": dict(opt="adam", model="branchy", find_unused=True),
    "no_sync": dict(opt="sgd", micro=3, accum="no_sync"),
    # requires_grad changes, then the next forward (which rebuilds the buckets) runs under no_sync
    "flip_no_sync": dict(opt="adam", frozen=["4.bias"], flip=(["0.weight"], ["4.bias"]), micro=3, accum="no_sync"),
    "flip_reduce": dict(opt="sgd", frozen=["4.bias"], flip=(["0.weight"], ["4.bias"]), micro=2, accum="reduce"),
    "reduce": dict(opt="adam", micro=2, accum="reduce"),
    "sched_step": dict(opt="sgd", sched="step"),
    "sched_lambda": dict(opt="adamw", sched="lambda"),
    "amp": dict(opt="adam", amp=True, steps=6),
    "clip2": dict(opt="sgd", clip=(0.1, 2.0)),
    "clipinf": dict(opt="sgd", clip=(0.02, math.inf)),
    "two_tensors": dict(opt="adam", model="linear"),
    "int_param": dict(opt="adam", model="tripwire"),
    "small_buckets": dict(opt="adam", sdp=dict(reduce_buffer_size=40)),  # several buckets per owner
    "no_buckets": dict(opt="sgd", sdp=dict(reduce_buffer_size=0)),      # one reduction per parameter
    "two_oss": dict(opt="sgd", groups="two", oss="two"),    # one sharded optimizer per param group
    "add_group": dict(opt="adam", groups="two", add_group=True, zero=("sdp", True)),  # biases added at step 1
    "cnn": dict(opt="adamw", model="cnn"),
}
AMP_BAD_STEP = 2


def _scheduler(kind: Optional[str], opt: torch.optim.Optimizer) -> Any:
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + k))
    return None


def run_parity(ctx: Ctx, name: str) -> dict:
    """One scenario: the sharded run and the DDP reference side by side, step by step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from decentpy import OSS, ShardedDataParallel, ShardedGradScaler

    cfg = SCENARIOS[name]
    kind, how = cfg.get("model", "mlp"), cfg.get("groups", "one")
    cls, kw = OPTIMS[cfg["opt"]]
    steps, micro, accum = cfg.get("steps", 4), cfg.get("micro", 1), cfg.get("accum")
    zero_on, set_to_none = cfg.get("zero", ("oss", None))
    freeze_later, unfreeze_later = cfg.get("flip", ([], []))
    g = ctx.grank

    model = make_model(kind)
    ref = make_model(kind)
    for n, p in model.named_parameters():
        if n in cfg.get("frozen", []):
            p.requires_grad_(False)
    # The reference keeps every parameter trainable and drops the gradient of those the sharded
    # model has frozen before stepping (a torch optimizer skips params whose grad is None).
    groups_s, groups_r = param_groups(model, how), param_groups(ref, how)
    added_s = added_r = None
    if cfg.get("add_group"):  # the biases join the optimizers after the first step
        *groups_s, added_s = groups_s
        *groups_r, added_r = groups_r
    if cfg.get("oss") == "two":  # one OSS per group, both in one ShardedDataParallel
        osses = [OSS(grp["params"], optim=cls, group=ctx.pg, **dict(kw, **{k: v for k, v in grp.items() if k != "params"}))
                 for grp in groups_s]
    else:
        osses = [OSS(groups_s, optim=cls, group=ctx.pg, **kw)]
    oss = osses[0]
    sdp = ShardedDataParallel(model, osses if len(osses) > 1 else oss, process_group=ctx.pg, **cfg.get("sdp", {}))
    opt = cls(groups_r, **kw)
    ddp = DDP(ref, process_group=ctx.ref_pg, find_unused_parameters=cfg.get("find_unused", False))
    sched_s, sched_r = _scheduler(cfg.get("sched"), oss), _scheduler(cfg.get("sched"), opt)
    if cfg.get("amp"):
        scaler_s = ShardedGradScaler(init_scale=2.0 ** 10, growth_interval=2, process_group=ctx.pg, device="cpu")
        scaler_r = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)

    params_by_name = dict(model.named_parameters())
    names = group_names(model, how)[:-1] if added_s is not None else group_names(model, how)
    def owners_now() -> Dict[str, int]:
        oss_of = {id(p): o for o in osses for grp in o.param_groups for p in grp["params"]}
        return {n: oss_of[id(p)].owner_of(p) for n, p in params_by_name.items()
                if id(p) in oss_of and p.is_floating_point()}

    owners = owners_now()
    local_ids = {id(p) for o in osses for p in o.local_params}
    out: Dict[str, Any] = {
        "owners": owners,
        "expected_owners": ({n: r for grp in names for n, r in expected_owners([grp], ctx.gsize).items()}
                            if len(osses) > 1 else expected_owners(names, ctx.gsize)),
        "local_ok": local_ids == {id(p) for n, p in params_by_name.items() if owners.get(n) == g},
        "rank_world": (oss.rank, oss.world_size),
        "reductions": sdp.reductions_per_backward,
        "group_sizes": ([len(pg["params"]) for o in osses for pg in o.param_groups],
                        [len(pg["params"]) for pg in opt.param_groups]),
        "init": (flat(model), flat(ref)),
        "got": [], "want": [], "g_got": [], "g_want": [], "lrs": [], "scales": [], "totals": [], "gscale": [],
    }
    bad_rank = 1 if ctx.gsize > 1 else 0
    for k in range(steps):
        if k == 1 and added_s is not None:
            oss.add_param_group(added_s)
            opt.add_param_group(added_r)
            loads = [0] * ctx.gsize
            for n, r in owners.items():
                loads[r] += params_by_name[n].numel()
            out["expected_added"] = expected_owners(group_names(model, how)[1:], ctx.gsize, loads)
            out["owners_added"] = {n: oss.owner_of(params_by_name[n]) for n, _ in group_names(model, how)[1]}
        if k == 1:
            for n in freeze_later:
                params_by_name[n].requires_grad_(False)
            for n in unfreeze_later:
                params_by_name[n].requires_grad_(True)
        fwd = {"use_side": use_side(g, k)} if kind == "branchy" else {}
        for mb in range(micro):
            x, y = batch(g, k * micro + mb, "cnn" if kind == "cnn" else "mlp")
            if kind == "cnn":
                x = x.contiguous(memory_format=torch.channels_last)
            if cfg.get("amp") and k == AMP_BAD_STEP and g == bad_rank:
                x = x.clone()
                x[0, 0] = float("inf")  # non-finite gradients on one rank, in one parameter only
            last = mb == micro - 1
            sync_s = accum == "reduce" or (accum == "no_sync" and not last)
            with sdp.no_sync() if sync_s else nullcontext():
                loss = loss_fn(sdp(x, **fwd), y)
                (scaler_s.scale(loss) if cfg.get("amp") else loss).backward()
            with ddp.no_sync() if not last else nullcontext():
                loss = loss_fn(ddp(x, **fwd), y)
                (scaler_r.scale(loss) if cfg.get("amp") else loss).backward()
        if accum == "reduce":
            sdp.reduce()
        for n, p in ref.named_parameters():
            if not params_by_name[n].requires_grad:
                p.grad = None
        if cfg.get("clip"):
            max_norm, norm_type = cfg["clip"]
            total_s = oss.clip_grad_norm(max_norm, norm_type=norm_type)
            total_r = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
            out["totals"].append((float(total_s), float(total_r)))
        out["g_got"].append(grads(model))
        out["g_want"].append(grads(ref))
        out["gscale"].append(float(scaler_r.get_scale()) if cfg.get("amp") else 1.0)  # AMP: grads are scaled
        if cfg.get("amp"):
            scaler_s.step(oss)
            scaler_s.update()
            scaler_r.step(opt)
            scaler_r.update()
            out["scales"].append((float(scaler_s.get_scale()), float(scaler_r.get_scale())))
        else:
            for o in osses:
                o.step()
            opt.step()
        if sched_s is not None:
            sched_s.step()
            sched_r.step()
            out["lrs"].append(([pg["lr"] for pg in oss.param_groups], [pg["lr"] for pg in opt.param_groups]))
        if zero_on == "oss" and set_to_none is None:
            oss.zero_grad()  # torch's default
        elif zero_on == "oss":
            oss.zero_grad(set_to_none=set_to_none)
        else:
            sdp.zero_grad(set_to_none=set_to_none)
        for o in osses[1:]:
            o.zero_grad()
        # as the module-level sdp.zero_grad, ref.zero_grad also resets gradients no optimizer holds
        (ref if zero_on == "sdp" else opt).zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        out["got"].append(flat(model))
        out["want"].append(flat(ref))
    out["owners_end"] = owners_now()
    if kind == "tripwire":
        out["tripwire"] = (model.tripwire.detach().clone(), [o.shards_of(model.tripwire) for o in osses])
    return out


def run_partition(ctx: Ctx) -> dict:
    """fairscale's sharding case: sizes [9, 7, 5, 3] repeated world times give equal shards."""
    from decentpy import OSS

    params = [torch.zeros(s, 1, requires_grad=True) for s in [9, 7, 5, 3] * ctx.gsize]
    oss = OSS(params, optim=torch.optim.SGD, group=ctx.pg, lr=0.1)
    parts = oss.partition_parameters()
    ids = [id(p) for part in parts for grp in part for p in grp["params"]]
    owner_numel = [0] * ctx.gsize
    for p in params:
        owner_numel[oss.owner_of(p)] += p.numel()
    return {
        "n_parts": len(parts),
        "part_numel": [sum(p.numel() for grp in part for p in grp["params"]) for part in parts],
        "part_lr": [[grp["lr"] for grp in part] for part in parts],
        "each_once": sorted(ids) == sorted(id(p) for p in params),
        "owner_numel": owner_numel,
        "local_numel": sum(p.numel() for p in oss.local_params),
        "owner_matches_partition": all(oss.owner_of(p) == r for r, part in enumerate(parts)
                                       for grp in part for p in grp["params"]),
    }


# state dicts: Adam over two groups with their own hyperparameters; absurd ones to load into
SD_KW = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.01)
SD_ABSURD = dict(lr=123.0, betas=(0.1, 0.2), weight_decay=7.0)
HYPER_KEYS = ("lr", "betas", "weight_decay")


def sd_groups(model: nn.Module, absurd: bool = False) -> List[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": weights}, {"params": biases, "lr": 55.0 if absurd else 0.02, "weight_decay": 0.0}]


def _train_sharded(sdp: nn.Module, oss: Any, model: nn.Module, grank: int, ks: range,
                   two_batches: bool = False) -> List[Tensor]:
    traj = []
    for k in ks:
        x, y = batch(grank, k)
        if two_batches:  # world 2 replaying world 4: group rank r carries ranks r and r + 2 (the mean
            x2, y2 = batch(grank + 2, k)  # over both batches: the world-4 average gradient)
            x, y = torch.cat([x, x2]), torch.cat([y, y2])
        loss_fn(sdp(x), y).backward()
        oss.step()
        oss.zero_grad()
        traj.append(flat(model))
    return traj


def _train_ref(ddp: nn.Module, opt: torch.optim.Optimizer, model: nn.Module, grank: int, ks: range) -> List[Tensor]:
    traj = []
    for k in ks:
        x, y = batch(grank, k)
        loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        traj.append(flat(model))
    return traj


def _hyper(groups: List[dict]) -> List[dict]:
    return [{k: grp[k] for k in HYPER_KEYS if k in grp} for grp in groups]


def run_state_dict(ctx: Ctx) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from decentpy import OSS, ShardedDataParallel

    g, Adam = ctx.grank, torch.optim.Adam
    path = os.path.join(ctx.ckpt_dir, f"ckpt_{ctx.tag}.pt")
    model = make_mlp(0)
    oss = OSS(sd_groups(model), optim=Adam, group=ctx.pg, **SD_KW)
    sdp = ShardedDataParallel(model, oss, process_group=ctx.pg)
    ref = make_mlp(0)
    opt = Adam(sd_groups(ref), **SD_KW)
    ddp = DDP(ref, process_group=ctx.ref_pg)
    out: Dict[str, Any] = {"path": path}
    out["first"] = _train_sharded(sdp, oss, model, g, range(3))
    out["ref_first"] = _train_ref(ddp, opt, ref, g, range(3))
    hyper_saved = _hyper(oss.param_groups)

    oss.consolidate_state_dict(recipient_rank=0)
    if g == 0:
        out["sd0"] = oss.state_dict()
        torch.save({"model": model.state_dict(), "optim": out["sd0"]}, path)
    if ctx.gsize > 1:
        oss.consolidate_state_dict(recipient_rank=1)
        if g == 1:
            out["sd1"] = oss.state_dict()
    out["sd_all"] = copy.deepcopy(oss.state_dict(all_ranks=True))
    ref_sd = copy.deepcopy(opt.state_dict())
    ref_model_sd = copy.deepcopy(ref.state_dict())
    out["ref_sd"] = ref_sd
    ctx.barrier()  # the file is written

    out["straight"] = _train_sharded(sdp, oss, model, g, range(3, 6))
    out["ref_straight"] = _train_ref(ddp, opt, ref, g, range(3, 6))

    ck = torch.load(path, weights_only=False)
    # reload into a fresh OSS built with absurd hyperparameters, continue
    m2 = make_mlp(7)
    m2.load_state_dict(ck["model"])
    oss2 = OSS(sd_groups(m2, absurd=True), optim=Adam, group=ctx.pg, **SD_ABSURD)
    sdp2 = ShardedDataParallel(m2, oss2, process_group=ctx.pg)
    oss2.load_state_dict(copy.deepcopy(ck["optim"]))  # torch's load_state_dict keeps the tensors: one copy each
    out["hyper"] = (hyper_saved, _hyper(oss2.param_groups))
    out["resumed"] = _train_sharded(sdp2, oss2, m2, g, range(3, 6))

    # OSS's consolidated state -> a plain torch Adam (on DDP), continue
    m3 = make_mlp(7)
    m3.load_state_dict(ck["model"])
    opt3 = Adam(sd_groups(m3, absurd=True), **SD_ABSURD)
    opt3.load_state_dict(copy.deepcopy(ck["optim"]))
    out["torch_hyper"] = _hyper(opt3.param_groups)
    ddp3 = DDP(m3, process_group=ctx.ref_pg)
    out["torch_from_oss"] = _train_ref(ddp3, opt3, m3, g, range(3, 6))

    # a plain torch Adam's state dict -> OSS.load_state_dict, continue
    m4 = make_mlp(7)
    m4.load_state_dict(ref_model_sd)
    oss4 = OSS(sd_groups(m4, absurd=True), optim=Adam, group=ctx.pg, **SD_ABSURD)
    sdp4 = ShardedDataParallel(m4, oss4, process_group=ctx.pg)
    oss4.load_state_dict(copy.deepcopy(ref_sd))
    out["oss_from_torch"] = _train_sharded(sdp4, oss4, m4, g, range(3, 6))
    return out


def run_join(ctx: Ctx) -> dict:
    """Uneven inputs: group rank r has 3 + r batches."""
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as DDP

    from decentpy import OSS, Join, ShardedDataParallel

    n = 3 + ctx.grank
    model = make_mlp(0)
    oss = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.pg, lr=0.01)
    sdp = ShardedDataParallel(model, oss, process_group=ctx.pg)
    with Join([sdp, oss]):
        for i in range(n):
            x, y = batch(ctx.grank, i)
            loss_fn(sdp(x), y).backward()
            oss.step()
            oss.zero_grad()
    got = flat(model)
    ref = make_mlp(0)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ddp = DDP(ref, process_group=ctx.ref_pg)
    with TorchJoin([ddp]):
        for i in range(n):
            x, y = batch(ctx.grank, i)
            loss_fn(ddp(x), y).backward()
            opt.step()  # torch's pattern: each rank steps for its own batches only
            opt.zero_grad()
    return {"n": n, "got": got, "ref": flat(ref), "init": flat(make_mlp(0))}


# --- large parameters split into pieces over the ranks ----------------------------------------------

SPLIT_MIN = 32  # make_mlp's weights (96 and 128 elements) are split; the other tensors stay whole
SPLIT_RUNS = {"sgd": ("sgd", {}), "adamw": ("adamw", {}), "amp": ("adam", {"amp": True}), "clip": ("sgd", {"clip": 0.1}),
              "odd": ("adam", {"model": "odd"}),  # pieces of unequal length (66 and 33 elements)
              "fp16": ("adam", {"model": "odd", "fp16": True}),  # broadcast_fp16 and reduce_fp16
              "torch_ddp": ("adamw", {"wrap": "ddp"}),  # OSS alone (ZeRO-1) beside torch DDP
              # OSS beside torch DDP, the gradients made inside step(closure) (fairscale's benchmark
              # mode): the closure zeroes (through the OSS, or the module), runs forward and backward
              "closure_sgd": ("sgd", {"wrap": "ddp", "closure": "oss"}),
              "closure_rmsprop": ("rmsprop", {"wrap": "ddp", "closure": "module"}),
              "closure_adamw": ("adamw", {"wrap": "ddp", "closure": "oss"}),
              # the same at OSS's default split size, on a weight above it
              "closure_big": ("rmsprop", {"wrap": "ddp", "closure": "module", "model": "big", "split": None})}


def _pieces_hold_ddp_grads(oss: Any, model: nn.Module, ref: nn.Module, grank: int,
                           scale: float = 1.0, tol: float = RTOL, sharded: bool = True) -> Tuple[bool, List[str]]:
    """This rank's pieces hold their slice (memory order) of DDP's averaged gradient, its whole
    parameters the whole gradient; a split parameter's own .grad is None (``sharded``: under
    ShardedDataParallel; beside torch DDP it keeps its whole gradient). ``scale``: AMP's (both
    sides' gradients are scaled by it)."""
    refs = dict(ref.named_parameters())
    split = []
    ok = True
    for n, p in model.named_parameters():
        want = refs[n].grad
        shards = oss.shards_of(p)
        if not shards[0].whole:
            split.append(n)
            ok &= (p.grad is None) == sharded
        for sh in shards:
            if sh.owner != grank:
                continue
            got = oss.local_tensor(p, sh).grad
            w = want if sh.whole else want.reshape(-1)[sh.start:sh.end]
            ok &= got is not None and torch.allclose(got.reshape(w.shape) / scale, w / scale, rtol=tol,
                                                     atol=max(ATOL, tol / 10), equal_nan=True)
    return bool(ok), split


def run_split(ctx: Ctx) -> dict:
    """Parity with DDP when the weights are split into pieces (gradients, clipping, AMP), and the
    state dict joined back into torch's format."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from decentpy import OSS, ShardedDataParallel, ShardedGradScaler

    g, out = ctx.grank, {}
    for name, (opt_name, extra) in SPLIT_RUNS.items():
        cls, kw = OPTIMS[opt_name]
        fp16 = extra.get("fp16", False)
        model, ref = make_model(extra.get("model", "mlp")), make_model(extra.get("model", "mlp"))
        split = {"min_split_numel": extra.get("split", SPLIT_MIN)} if extra.get("split", SPLIT_MIN) else {}
        oss = OSS(model.parameters(), optim=cls, group=ctx.pg, broadcast_fp16=fp16, **split, **kw)
        with_ddp = extra.get("wrap") == "ddp"
        closure = extra.get("closure")
        sdp = (DDP(model, process_group=ctx.pg) if with_ddp else
               ShardedDataParallel(model, oss, process_group=ctx.pg, reduce_buffer_size=64, reduce_fp16=fp16))
        opt = cls(ref.parameters(), **kw)
        ddp = DDP(ref, process_group=ctx.ref_pg)
        amp = extra.get("amp", False)
        if amp:
            scaler_s = ShardedGradScaler(init_scale=2.0 ** 10, growth_interval=2, process_group=ctx.pg, device="cpu")
            scaler_r = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        rec: Dict[str, Any] = {"got": [], "want": [], "grads_ok": [], "split": [], "totals": [], "scales": [],
                               "losses": []}
        for k in range(4):
            x, y = batch(g, k)
            if amp and k == AMP_BAD_STEP and g == min(1, ctx.gsize - 1):
                x = x.clone()
                x[0, 0] = float("inf")
            for net in ((ddp,) if closure else (sdp, ddp)):
                loss = loss_fn(net(x), y)
                (((scaler_s if net is sdp else scaler_r).scale(loss)) if amp else loss).backward()
            if closure:
                def make_grads(x: Tensor = x, y: Tensor = y) -> Tensor:
                    (oss if closure == "oss" else model).zero_grad()
                    loss = loss_fn(sdp(x), y)
                    loss.backward()
                    return loss
                rec["losses"].append((float(oss.step(make_grads).detach()), float(loss.detach())))  # loss: DDP's, just above
                opt.step()
            elif not with_ddp:
                ok, rec["split"] = _pieces_hold_ddp_grads(oss, model, ref, g, scaler_r.get_scale() if amp else 1.0,
                                                          tol=2e-3 if fp16 else RTOL)
                rec["grads_ok"].append(ok)
            if "clip" in extra:
                rec["totals"].append((float(oss.clip_grad_norm(extra["clip"])),
                                      float(torch.nn.utils.clip_grad_norm_(ref.parameters(), extra["clip"]))))
            if amp:
                for sc, o in ((scaler_s, oss), (scaler_r, opt)):
                    sc.step(o)
                    sc.update()
                rec["scales"].append((float(scaler_s.get_scale()), float(scaler_r.get_scale())))
            elif not closure:
                oss.step()
                opt.step()
            if with_ddp:  # the pieces took their slices of DDP's whole gradients in step()
                ok, rec["split"] = _pieces_hold_ddp_grads(oss, model, ref, g, sharded=False)
                rec["grads_ok"].append(ok)
            oss.zero_grad()
            opt.zero_grad()
            rec["got"].append(flat(model))
            rec["want"].append(flat(ref))
        out[name] = rec

    # The state dict: pieces joined into torch's per-parameter format, reload, cross-load.
    model, ref = make_model("mlp"), make_model("mlp")
    oss = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.pg, min_split_numel=SPLIT_MIN, lr=0.01)
    sdp = ShardedDataParallel(model, oss, process_group=ctx.pg)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ddp = DDP(ref, process_group=ctx.ref_pg)
    _train_sharded(sdp, oss, model, g, range(3))
    _train_ref(ddp, opt, ref, g, range(3))
    sd = oss.state_dict(all_ranks=True)
    out["sd_ok"] = sd.keys() == opt.state_dict().keys() and _state_close(sd["state"], opt.state_dict()["state"])
    m2 = make_model("mlp")
    m2.load_state_dict(model.state_dict())
    oss2 = OSS(m2.parameters(), optim=torch.optim.Adam, group=ctx.pg, min_split_numel=SPLIT_MIN, lr=123.0)
    sdp2 = ShardedDataParallel(m2, oss2, process_group=ctx.pg)
    oss2.load_state_dict(copy.deepcopy(sd))
    m3 = make_model("mlp")
    m3.load_state_dict(model.state_dict())
    opt3 = torch.optim.Adam(m3.parameters(), lr=5.0)
    opt3.load_state_dict(copy.deepcopy(sd))  # the consolidated state into a plain torch optimizer
    ddp3 = DDP(m3, process_group=ctx.ref_pg)
    out["straight"] = _train_sharded(sdp, oss, model, g, range(3, 5))
    out["reloaded"] = _train_sharded(sdp2, oss2, m2, g, range(3, 5))
    out["torch"] = _train_ref(ddp3, opt3, m3, g, range(3, 5))
    return out


def _state_close(a: Dict[int, dict], b: Dict[int, dict]) -> bool:
    if a.keys() != b.keys():
        return False
    for i in a:
        if a[i].keys() != b[i].keys():
            return False
        for k in a[i]:
            x, y = a[i][k], b[i][k]
            if isinstance(x, Tensor):
                if x.shape != y.shape or not torch.allclose(x.double(), y.double(), rtol=RTOL, atol=ATOL):
                    return False
            elif x != y:
                return False
    return True


def _guard(fn: Callable[..., dict], *args: Any) -> dict:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the scenario's test
        return {"error": traceback.format_exc()}


def _run_all(ctx: Ctx) -> dict:
    res = {name: _guard(run_parity, ctx, name) for name in SCENARIOS}
    res["partition"] = _guard(run_partition, ctx)
    res["state_dict"] = _guard(run_state_dict, ctx)
    res["join"] = _guard(run_join, ctx)
    res["split"] = _guard(run_split, ctx)
    return res


def sharding_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    out: Dict[str, Any] = {}
    ref_pg = dist.new_group(list(range(world)))
    out["full"] = _run_all(Ctx(None, ref_pg, rank, world, f"full{world}", ckpt_dir))
    if world == 4:
        groups = {}
        for ranks in SUBGROUPS:  # every rank creates every group, in the same order
            groups[tuple(ranks)] = (dist.new_group(ranks), dist.new_group(ranks))
        mine = next(r for r in SUBGROUPS if rank in r)
        pg, rpg = groups[tuple(mine)]
        tag = "sub" + "".join(map(str, mine))
        out["sub"] = _run_all(Ctx(pg, rpg, mine.index(rank), len(mine), tag, ckpt_dir))
    dist.barrier()  # nobody leaves (rank 0 hosts the store) while a sub-group still runs
    return out


def reload_worker(rank: int, world: int, path: str) -> dict:
    """World 2 continues from a state saved at world 4, replaying world 4's batches."""
    from decentpy import OSS, ShardedDataParallel

    ck = torch.load(path, weights_only=False)
    model = make_mlp(7)
    model.load_state_dict(ck["model"])
    oss = OSS(sd_groups(model, absurd=True), optim=torch.optim.Adam, **SD_ABSURD)
    sdp = ShardedDataParallel(model, oss)
    oss.load_state_dict(ck["optim"])
    traj = _train_sharded(sdp, oss, model, rank, range(3, 6), two_batches=True)
    oss.consolidate_state_dict(recipient_rank=0)
    sd = oss.state_dict() if rank == 0 else None
    return {"traj": traj, "hyper": _hyper(oss.param_groups), "sd": sd}


# --- the parent: one spawn per world size, cached ---------------------------------------------------

_CACHE: Dict[Any, Any] = {}
CONFIGS = ["w1", "w2", "w4", "w4sub"]


def _spawn(world: int) -> List[dict]:
    if "tmp" not in _CACHE:  # the checkpoints' folder, removed when the test session ends
        _CACHE["tmp"] = tempfile.TemporaryDirectory(prefix="decentpy_sharding_")
    if world not in _CACHE:
        _CACHE[world] = run_workers(sharding_worker, world, _CACHE["tmp"].name, timeout=360, pg_timeout_s=45)
    return _CACHE[world]


def _group(config: str) -> List[List[dict]]:
    """Per group of the configuration, the group ranks' results (all scenarios)."""
    if config == "w4sub":
        res = _spawn(4)
        return [[res[r]["sub"] for r in ranks] for ranks in SUBGROUPS]
    world = int(config[1:])
    return [[r["full"] for r in _spawn(world)]]


def _scenario(config: str, name: str) -> List[List[dict]]:
    groups = []
    for grp in _group(config):
        per_rank = [r[name] for r in grp]
        errors = [f"--- group rank {i} ---\n{r['error']}" for i, r in enumerate(per_rank) if "error" in r]
        if errors:
            pytest.fail(f"{name} on {config} raised:\n" + "\n".join(errors), pytrace=False)
        groups.append(per_rank)
    return groups


def _close(a: Tensor, b: Tensor, rtol: float = RTOL, atol: float = ATOL, nan: bool = False) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=nan)


def _diff(a: Tensor, b: Tensor) -> str:
    d = (a.double() - b.double()).abs()
    d = torch.where(torch.isnan(d), torch.zeros_like(d), d)
    return f"max abs diff {d.max().item():.3g} at {int(d.argmax())}"


def _check_trajectory(per_rank: List[dict], got: str, want: str, what: str) -> None:
    """Every group rank bit-identical to group rank 0 after every step; within tolerance of the
    reference after every step."""
    steps = len(per_rank[0][want])
    assert steps > 0 and all(len(r[got]) == steps for r in per_rank)
    for k in range(steps):
        for i, r in enumerate(per_rank[1:], 1):
            assert torch.equal(r[got][k], per_rank[0][got][k]), \
                f"{what}: group rank {i} differs from group rank 0 after step {k}: " \
                f"{_diff(r[got][k], per_rank[0][got][k])}"
        for i, r in enumerate(per_rank):
            assert _close(r[got][k], r[want][k]), \
                f"{what}: group rank {i} differs from the reference after step {k}: {_diff(r[got][k], r[want][k])}"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_parity_with_torch_ddp(scenario: str, config: str) -> None:
    """Params after every step within 1e-5 of torch DDP + the torch optimizer, bit-identical on all
    ranks; owned grads equal DDP's averaged grads, non-owned grads None; the partition follows
    the spec's rule."""
    what = f"{scenario} on {config}"
    groups = _scenario(config, scenario)
    for per_rank in groups:
        r0 = per_rank[0]
        gsize = len(per_rank)
        assert r0["owners"] == r0["expected_owners"], f"{what}: partition {r0['owners']} is not the spec's rule"
        for i, r in enumerate(per_rank):
            assert r["owners"] == r0["owners"], f"{what}: ranks disagree on owners"
            assert r["local_ok"], f"{what}: local_params on group rank {i} are not the params it owns"
            assert r["rank_world"] == (i, gsize), f"{what}: oss.rank/world_size = {r['rank_world']}"
            assert r["group_sizes"][0] == r["group_sizes"][1], f"{what}: oss.param_groups are not the full groups"
            assert torch.equal(r["init"][0], r["init"][1])
        # the reference itself is consistent (DDP keeps ranks identical)
        for r in per_rank[1:]:
            for k, w in enumerate(r["want"]):
                assert torch.equal(w, r0["want"][k]), f"{what}: the DDP reference diverged across ranks (test bug)"
        # gradients right before the step: owner holds the averaged gradient, the others None
        owners = r0["owners"]
        for k in range(len(r0["g_want"])):
            scale = r0["gscale"][k]
            for n, owner in owners.items():
                want = r0["g_want"][k][n]
                for i, r in enumerate(per_rank):
                    got = r["g_got"][k][n]
                    if i != owner:
                        assert got is None, f"{what}: step {k}: '{n}' has a .grad on non-owner group rank {i}"
                        continue
                    if want is None:
                        assert got is None or not got.any(), f"{what}: step {k}: '{n}' has a gradient, DDP has none"
                    else:
                        got = torch.zeros_like(want) if got is None else got
                        got, want = got / scale, want / scale
                        assert _close(got, want, nan=True), f"{what}: step {k}: grad of '{n}': {_diff(got, want)}"
        _check_trajectory(per_rank, "got", "want", what)
        # not vacuous: training moved the parameters
        assert not torch.equal(r0["got"][-1], r0["init"][0]), f"{what}: parameters never changed"
    if config == "w4sub":  # both sub-groups ran the same scenario on the same data concurrently
        for a, b in zip(groups[0], groups[1]):
            for k in range(len(a["got"])):
                assert torch.equal(a["got"][k], b["got"][k]), f"{what}: the two sub-groups differ after step {k}"
    extra = _EXTRA_CHECKS.get(scenario)
    if extra is not None:
        for per_rank in groups:
            extra(per_rank, what)


def _check_sched(per_rank: List[dict], what: str) -> None:
    lrs = per_rank[0]["lrs"]
    assert len(lrs) > 0
    for k, (got, want) in enumerate(lrs):
        assert got == pytest.approx(want, rel=1e-12), f"{what}: lr after step {k}: {got} vs torch's {want}"
    assert lrs[-1][1] != lrs[0][1], f"{what}: the schedule never moved the lr (test bug)"


def _check_reductions(per_rank: List[dict], what: str) -> None:
    """One reduce per owner with the default buffer (each owner's elements are one run), one per
    parameter with reduce_buffer_size=0, more than one per owner with a tiny buffer."""
    r0, gsize = per_rank[0], len(per_rank)
    owners, n = len(set(r0["owners"].values())), r0["reductions"]
    if gsize == 1:
        assert n == 0, f"{what}: {n} reductions on a group of one"
    elif what.startswith("sgd "):
        assert n == owners, f"{what}: {n} reductions per backward for {owners} owners"
    elif what.startswith("no_buckets"):
        assert n == len(r0["owners"]), f"{what}: {n} reductions for {len(r0['owners'])} parameters"
    else:
        assert n > owners, f"{what}: {n} reductions with a 40-element buffer, {owners} owners"


def _check_amp(per_rank: List[dict], what: str) -> None:
    for i, r in enumerate(per_rank):
        scales = r["scales"]
        for k, (got, want) in enumerate(scales):
            assert got == want, f"{what}: group rank {i}: scale after step {k}: {got} vs torch's {want}"
        assert scales[AMP_BAD_STEP][1] == scales[AMP_BAD_STEP - 1][1] / 2, "the reference did not skip (test bug)"
        traj = r["got"]
        assert torch.equal(traj[AMP_BAD_STEP], traj[AMP_BAD_STEP - 1]), \
            f"{what}: group rank {i} changed parameters at the step the reference skipped"
        for k in range(1, len(traj)):
            if k != AMP_BAD_STEP:
                assert not torch.equal(traj[k], traj[k - 1]), f"{what}: step {k} was skipped on group rank {i}"
        assert all(torch.isfinite(t).all() for t in traj)


def _check_clip(per_rank: List[dict], what: str) -> None:
    max_norm = SCENARIOS[what.split(" ")[0]]["clip"][0]
    totals = [r["totals"] for r in per_rank]
    for i, t in enumerate(totals):
        assert [a for a, _ in t] == [a for a, _ in totals[0]], f"{what}: the returned norm differs across ranks"
        for k, (got, want) in enumerate(t):
            assert got == pytest.approx(want, rel=RTOL, abs=ATOL), \
                f"{what}: group rank {i} step {k}: clip_grad_norm returned {got}, torch {want}"
    assert any(want > max_norm for _, want in totals[0]), f"{what}: clipping never active (test bug)"


def _check_unused(per_rank: List[dict], what: str) -> None:
    r0 = per_rank[0]
    for n in ("never.weight", "never.bias"):
        owner = r0["owners"][n]
        for k, gr in enumerate(per_rank[owner]["g_got"]):
            assert gr[n] is None, f"{what}: step {k}: '{n}' (never used) has a gradient on its owner"
    owner = r0["owners"]["side.weight"]
    for k, gr in enumerate(per_rank[owner]["g_got"]):
        globally_used = any(use_side(q, k) for q in range(len(per_rank)))
        assert (gr["side.weight"] is not None) == globally_used, \
            f"{what}: step {k}: side.weight grad None-ness is wrong (globally used: {globally_used})"


def _check_flip(per_rank: List[dict], what: str) -> None:
    for r in per_rank:
        assert r["owners_end"] == r["owners"], f"{what}: changing trainability moved parameters"


def _check_add_group(per_rank: List[dict], what: str) -> None:
    for r in per_rank:
        assert r["owners_added"] == r["expected_added"], \
            f"{what}: the added group's partition {r['owners_added']} is not the rule's {r['expected_added']}"


def _check_int_param(per_rank: List[dict], what: str) -> None:
    for r in per_rank:
        value, shards = r["tripwire"]
        assert value.tolist() == [3, 3] and shards == [[]], f"{what}: the LongTensor parameter {value}, shards {shards}"


def _check_two_tensors(per_rank: List[dict], what: str) -> None:
    owners = set(per_rank[0]["owners"].values())
    if len(per_rank) == 4:
        assert len(owners) == 2, f"{what}: two tensors on four ranks: two ranks own nothing, owners {owners}"


_EXTRA_CHECKS: Dict[str, Callable[[List[dict], str], None]] = {
    "sched_step": _check_sched, "sched_lambda": _check_sched, "amp": _check_amp, "clip2": _check_clip,
    "clipinf": _check_clip, "unused": _check_unused, "flip": _check_flip, "two_tensors": _check_two_tensors,
    "add_group": _check_add_group, "int_param": _check_int_param, "sgd": _check_reductions, "no_buckets": _check_reductions,
    "small_buckets": _check_reductions,
}


@pytest.mark.parametrize("config", CONFIGS)
def test_zero_grad_set_to_none_and_keep_give_the_same_trajectory(config: str) -> None:
    """fairscale's bug: stale gradients after zero_grad(set_to_none=True)."""
    for none, keep in (("sgd", "sgd_keep"), ("adam", "adam_keep")):
        for a_grp, b_grp in zip(_scenario(config, none), _scenario(config, keep)):
            for i, (a, b) in enumerate(zip(a_grp, b_grp)):
                for k in range(len(a["got"])):
                    assert _close(a["got"][k], b["got"][k], rtol=1e-6, atol=1e-7), \
                        f"{none} vs {keep} on {config}: group rank {i} step {k}: {_diff(a['got'][k], b['got'][k])}"


@pytest.mark.parametrize("config", CONFIGS)
def test_partition_gives_equal_shards_for_fairscale_sizes(config: str) -> None:
    for per_rank in _scenario(config, "partition"):
        gsize = len(per_rank)
        for i, r in enumerate(per_rank):
            assert r["n_parts"] == gsize
            assert r["each_once"], "partition_parameters(): a parameter is missing or repeated"
            assert r["part_numel"] == [24] * gsize, f"partition_parameters() numel per rank {r['part_numel']}"
            assert r["owner_numel"] == [24] * gsize, f"owner_of numel per rank {r['owner_numel']}"
            assert r["local_numel"] == 24
            assert r["owner_matches_partition"]
            assert all(lr == 0.1 for part in r["part_lr"] for lr in part)


def _state_equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    return a == b


def _check_torch_format(sd: dict, ref_sd: dict, what: str) -> None:
    """The consolidated state dict is torch's: same indices, same per-param keys, values close to
    the torch optimizer's after the same steps, same groups."""
    assert set(sd) >= {"state", "param_groups"}
    assert sorted(sd["state"]) == sorted(ref_sd["state"]) == list(range(6)), \
        f"{what}: state indices {sorted(sd['state'])}"
    for idx, want in ref_sd["state"].items():
        got = sd["state"][idx]
        assert set(got) == set(want), f"{what}: state[{idx}] keys {set(got)} vs torch's {set(want)}"
        for key, w in want.items():
            gv = got[key]
            if key == "step":
                assert float(gv) == float(w), f"{what}: state[{idx}]['step'] = {gv}, torch {w}"
            else:
                assert _close(torch.as_tensor(gv).float(), w.float(), rtol=1e-4, atol=1e-7), \
                    f"{what}: state[{idx}]['{key}']: {_diff(torch.as_tensor(gv), w)}"
    assert len(sd["param_groups"]) == len(ref_sd["param_groups"])
    for gg, wg in zip(sd["param_groups"], ref_sd["param_groups"]):
        assert list(gg["params"]) == list(wg["params"]), f"{what}: group params {gg['params']} vs {wg['params']}"
        for k in ("lr", "betas", "eps", "weight_decay"):
            got, want = (tuple(gg[k]), tuple(wg[k])) if k == "betas" else (gg[k], wg[k])
            assert got == want, f"{what}: group '{k}' = {got}, torch's {want}"


@pytest.mark.parametrize("config", CONFIGS)
def test_state_dict_consolidate_save_reload_and_cross_load(config: str) -> None:
    for per_rank in _scenario(config, "state_dict"):
        gsize = len(per_rank)
        r0 = per_rank[0]
        what = f"state_dict on {config}"
        _check_trajectory(per_rank, "first", "ref_first", f"{what} (steps 0-2)")
        _check_torch_format(r0["sd0"], r0["ref_sd"], f"{what}: consolidated on rank 0")
        if gsize > 1:
            assert _state_equal(per_rank[1]["sd1"], r0["sd0"]), f"{what}: consolidated on rank 1 differs from rank 0"
        for i, r in enumerate(per_rank):
            assert _state_equal(r["sd_all"], r0["sd0"]), f"{what}: state_dict(all_ranks=True) on group rank {i} differs"
        for i, r in enumerate(per_rank):
            # reload into a fresh OSS with absurd hyperparameters: bit-identical continuation
            assert r["hyper"][1] == r["hyper"][0], \
                f"{what}: hyperparameters not restored by load_state_dict: {r['hyper']}"
            for k, (a, b) in enumerate(zip(r["resumed"], r["straight"])):
                assert torch.equal(a, b), f"{what}: group rank {i} resumed run diverged at step {3 + k}: {_diff(a, b)}"
            # torch Adam loading OSS's state continues as the OSS run
            assert r["torch_hyper"] == r["hyper"][0]
            for k, (a, b) in enumerate(zip(r["torch_from_oss"], r["straight"])):
                assert _close(a, b), f"{what}: torch Adam from OSS's state, group rank {i} step {3 + k}: {_diff(a, b)}"
        _check_trajectory(per_rank, "straight", "ref_straight", f"{what} (steps 3-5)")
        _check_trajectory(per_rank, "oss_from_torch", "ref_straight", f"{what} (OSS from torch's state)")
        assert len(r0["resumed"]) == 3


def test_reload_at_a_different_world_size() -> None:
    """Saved at world 4, loaded at world 2 (each rank replays two of world 4's batches): continues
    world 4's uninterrupted run."""
    full = _scenario("w4", "state_dict")[0]
    path = full[0]["path"]
    assert os.path.exists(path)
    res = run_workers(reload_worker, 2, path, timeout=180)
    want = full[0]["straight"]
    for i, r in enumerate(res):
        assert r["hyper"] == full[0]["hyper"][0], "hyperparameters not restored"
        for k, (a, b) in enumerate(zip(r["traj"], want)):
            assert torch.equal(a, res[0]["traj"][k]), f"world 2: ranks differ after step {3 + k}"
            assert _close(a, b), f"world 2 continuation vs world 4 after step {3 + k}: {_diff(a, b)}"
        assert len(r["traj"]) == 3
    sd = res[0]["sd"]  # re-consolidated at world 2: the whole model's state, 6 steps taken
    assert sorted(sd["state"]) == list(range(6)), f"re-consolidated at world 2: state indices {sorted(sd['state'])}"
    assert all(float(s["step"]) == 6 for s in sd["state"].values())


@pytest.mark.parametrize("config", CONFIGS)
def test_join_uneven_inputs_match_torch_ddp_join(config: str) -> None:
    for per_rank in _scenario(config, "join"):
        longest = max(per_rank, key=lambda r: r["n"])
        want = longest["ref"]  # the rank that ran every batch; torch's Join syncs the others to it
        for i, r in enumerate(per_rank):
            assert r["n"] == 3 + i
            assert torch.equal(r["ref"], want), "torch's Join did not sync the final model (test bug)"
            assert torch.equal(r["got"], per_rank[0]["got"]), f"join on {config}: group rank {i} differs from rank 0"
            assert _close(r["got"], want), \
                f"join on {config}: group rank {i} vs torch DDP + Join: {_diff(r['got'], want)}"
        assert not torch.equal(want, per_rank[0]["init"])


@pytest.mark.parametrize("config", CONFIGS)
def test_split_parameters_match_torch_ddp(config: str) -> None:
    """Weights split into pieces over the ranks: each piece holds its slice of DDP's averaged
    gradient, training (SGD, AdamW, AMP with an overflow, clipping) follows DDP, all ranks stay
    identical; the consolidated state equals torch Adam's, reloads bit-identically and loads into a
    plain torch Adam."""
    for per_rank in _scenario(config, "split"):
        r0 = per_rank[0]
        for name in SPLIT_RUNS:
            what = f"split {name} on {config}"
            runs = [r[name] for r in per_rank]
            if len(per_rank) > 1:
                assert runs[0]["split"], f"{what}: no parameter was split (test bug)"
            for i, run in enumerate(runs):
                assert all(run["grads_ok"]), f"{what}: group rank {i}: gradients {run['grads_ok']}"
            if name == "fp16":  # fp16 on the wire: close to DDP; the owners keep their fp32 values
                for i, run in enumerate(runs):
                    for k, (a, b) in enumerate(zip(run["got"], run["want"])):
                        assert _close(a, b, rtol=5e-3, atol=5e-4), f"{what}: group rank {i} step {k}: {_diff(a, b)}"
                        assert _close(a, runs[0]["got"][k], rtol=2e-3, atol=1e-3), f"{what}: ranks drift apart"
                continue
            _check_trajectory(runs, "got", "want", what)
            if name == "clip":
                assert all(a == pytest.approx(b, rel=RTOL, abs=ATOL) for a, b in runs[0]["totals"]), \
                    f"{what}: norms {runs[0]['totals']}"
                assert any(b > 0.1 for _, b in runs[0]["totals"]), f"{what}: clipping never active (test bug)"
            if name.startswith("closure"):  # step(closure) returns the closure's loss: DDP's
                for i, run in enumerate(runs):
                    assert len(run["losses"]) == 4 and all(a == pytest.approx(b, rel=RTOL) for a, b in run["losses"]), \
                        f"{what}: group rank {i}: losses (OSS, DDP) {run['losses']}"
            if name == "amp":
                assert all(a == b for a, b in runs[0]["scales"]), f"{what}: scales {runs[0]['scales']}"
                assert torch.equal(runs[0]["got"][AMP_BAD_STEP], runs[0]["got"][AMP_BAD_STEP - 1])
        for i, r in enumerate(per_rank):
            assert r["sd_ok"], f"split on {config}: group rank {i}: the joined state differs from torch Adam's"
            for k, (a, b, t) in enumerate(zip(r["straight"], r["reloaded"], r["torch"])):
                assert torch.equal(a, b), f"split on {config}: reloaded run differs at step {k}: {_diff(a, b)}"
                assert _close(a, t), f"split on {config}: torch Adam with the loaded state differs: {_diff(a, t)}"
            assert torch.equal(r["straight"][-1], r0["straight"][-1])
