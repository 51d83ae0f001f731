"""A probe of bad calls (issue 52): each is a named error on every rank, or a correct result --
never a silent acceptance, a hang, a misdiagnosis (a live rank blamed as dead) or a process killed
by a signal.

Two spawns of 2 gloo workers run every case one after the other (:data:`CASES`); after each, an
all-reduce of ones must return 2 (no rank left in a half-started collective), and where a call
failed the parameters it was given are untouched. Each case returns what every rank saw; the parent
checks the exception type (by name, through the class's MRO) and the words of the message, or
checks a result against a float64 re-computation from the gathered parameters.

Cases covered elsewhere and not repeated here: tests/test_bad_input.py (unknown topology, a model or
optimizer hook that differs, sparse gradients, optim_fn returning something else), tests/
test_sharding_bad_input.py (OSS / ShardedDataParallel construction and state dicts), tests/
test_local_sgd.py (local_steps=0, fragments that do not divide local_steps, fragment_sync_delay,
fragment_update_alpha < 0, fragments without local_steps or with a time budget), tests/
test_failures.py (settings that differ: bucket_size_in_mb, topology, lr; non-finite gradients),
tests/test_checkpoints.py (checkpoint files), tests/test_no_pickle.py (crafted messages).
"""

from __future__ import annotations

import datetime
import math
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_harness import run_workers, single_process_group
from reference import IN, OUT, batch, decentpy_optim_fn, loss_fn, make_mlp

WORLD = 2
NAN, INF = float("nan"), float("inf")
SHORT = datetime.timedelta(seconds=2)  # the wrapper's timeout where a case waits for a rank that never comes


class Ctx:
    """What a case hands back besides its exception: the modules whose parameters must be untouched
    by a failed call (snapshotted when watched)."""

    def __init__(self) -> None:
        self.watched: List[Tuple[nn.Module, List[torch.Tensor]]] = []

    def watch(self, module: nn.Module) -> nn.Module:
        self.watched.append((module, [p.detach().clone() for p in module.parameters()]))
        return module

    def untouched(self) -> bool:
        return all(torch.equal(a, b.detach()) for m, snap in self.watched for a, b in zip(snap, m.parameters()))


def _ddp(model: Optional[nn.Module] = None, optim: str = "adam", **kw: Any) -> Any:
    from decentpy import DecentralizedDataParallel

    return DecentralizedDataParallel(model if model is not None else make_mlp(0), decentpy_optim_fn(optim), **kw)


def _construct(ctx: Ctx, optim_fn: Any = None, **kw: Any) -> Any:
    """A wrapper over a watched fresh model (construction cases)."""
    from decentpy import DecentralizedDataParallel

    model = ctx.watch(make_mlp(0))
    return DecentralizedDataParallel(model, optim_fn if optim_fn is not None else decentpy_optim_fn("adam"), **kw)


def _trained(rank: int, steps: int = 2, **kw: Any) -> Any:
    ddp = _ddp(**kw)
    for k in range(steps):
        x, y = batch(rank, k)
        loss_fn(ddp(x), y).backward()
    return ddp


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in module.parameters()])


def _gathered(module: nn.Module) -> List[torch.Tensor]:
    mine = _flat(module)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return out


def _sgd(named: Any, **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], **kw)


# --- the wrapper's construction --------------------------------------------------------------------

def c_lr_nan_fused(rank: int, ctx: Ctx) -> Any:
    from decentpy.optim import optim_fn_adam
    return _construct(ctx, lambda named: optim_fn_adam(named, lr=NAN))


def c_lr_nan_torch_sgd_on_rank1(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, lambda named: _sgd(named, lr=NAN if rank == 1 else 0.1))


def c_lr_negative(rank: int, ctx: Ctx) -> Any:
    from decentpy.optim import optim_fn_sgd
    return _construct(ctx, lambda named: optim_fn_sgd(named, lr=-0.1))


def c_lr_inf_rmsprop(rank: int, ctx: Ctx) -> Any:  # torch's RMSprop accepts it; not fused: the wrapper's check
    return _construct(ctx, lambda named: torch.optim.RMSprop([p for _, p in named], lr=INF))


def c_beta_one(rank: int, ctx: Ctx) -> Any:
    from decentpy.optim import optim_fn_adam
    return _construct(ctx, lambda named: optim_fn_adam(named, beta2=1.0))


def c_eps_zero(rank: int, ctx: Ctx) -> Any:
    from decentpy.optim import optim_fn_adamw
    return _construct(ctx, lambda named: optim_fn_adamw(named, eps=0.0))


def c_weight_decay_inf_torch_adamw(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, lambda named: torch.optim.AdamW([p for _, p in named], weight_decay=INF))


def c_momentum_nan_torch_sgd(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, lambda named: _sgd(named, lr=0.1, momentum=NAN))


def c_group_lr_nan(rank: int, ctx: Ctx) -> Any:  # one parameter group of two
    return _construct(ctx, lambda named: torch.optim.Adam(
        [{"params": [p for _, p in named[:1]]}, {"params": [p for _, p in named[1:]], "lr": NAN}], lr=0.01))


def c_outer_optim_lr_nan(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, local_steps=2, outer_optim=lambda ps: torch.optim.SGD(ps, lr=NAN))


def c_timeout_zero(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, timeout=datetime.timedelta(0))


def c_timeout_negative_on_rank1(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, timeout=datetime.timedelta(seconds=-1) if rank == 1 else None)


def c_timeout_number(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, timeout=30)


def c_liveness_zero(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, peer_liveness_timeout=datetime.timedelta(0))


def c_liveness_negative(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, peer_liveness_timeout=datetime.timedelta(seconds=-1))


def c_grad_clip_nan(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, grad_clip_norm=NAN)


def c_grad_clip_negative_on_rank1(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, grad_clip_norm=-1.0 if rank == 1 else 1.0)


def c_grad_clip_string(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, grad_clip_norm="1.0")


def c_bucket_size_zero(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, bucket_size_in_mb=0)


def c_bucket_size_inf_on_rank0(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, bucket_size_in_mb=INF if rank == 0 else 25)


def c_bucket_size_below_a_byte(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, bucket_size_in_mb=1e-9)


def c_local_world_size_zero(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, local_world_size=0)


def c_local_world_size_float(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, local_world_size=1.5)


def c_local_world_sizes_disagree(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, local_world_size=1, _local_world_size=2)


def c_flag_as_string(rank: int, ctx: Ctx) -> Any:  # "False" would be true
    return _construct(ctx, param_as_bucket_view="False")


def c_broadcast_parameters_none(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, broadcast_parameters=None)


def c_comm_unknown(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, comm="mpi")


def c_intra_node_unknown(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, intra_node="ring")


def c_intra_node_list(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, intra_node=["gossip"])


def c_nonfinite_unknown(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, nonfinite="warn")


def c_compression_number(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, compression=8)


def c_compression_unknown_on_rank1(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, compression="int3" if rank == 1 else None)


def c_local_steps_float(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, local_steps=2.5)


def c_local_steps_and_budget(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, local_steps=4, sync_every_s=1.0)


def c_budget_nan(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, sync_every_s=NAN)


def c_scheduler_class_without_partial(rank: int, ctx: Ctx) -> Any:
    """torch's StepLR given as lr_scheduler_fn (it needs step_size too): the hint names functools.partial."""
    return _ddp(lr_scheduler_fn=torch.optim.lr_scheduler.StepLR)


def c_scaler_not_a_scaler(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, scaler="yes")


def c_optim_fn_none(rank: int, ctx: Ctx) -> Any:
    from decentpy import DecentralizedDataParallel
    return DecentralizedDataParallel(ctx.watch(make_mlp(0)), None)


def c_model_not_a_module(rank: int, ctx: Ctx) -> Any:
    from decentpy import DecentralizedDataParallel
    return DecentralizedDataParallel([nn.Parameter(torch.zeros(3))], decentpy_optim_fn("adam"))


def c_model_wrapped_twice(rank: int, ctx: Ctx) -> Any:
    """A DecentralizedDataParallel around another: refused at construction (it would hook every
    parameter twice), the inner one still trains."""
    inner = _ddp()
    try:
        return _ddp(inner)
    finally:
        inner.close()


def c_model_in_a_live_wrapper(rank: int, ctx: Ctx) -> Any:
    """One model in two live wrappers: refused; after the first is closed the model may be wrapped again."""
    model = make_mlp(0)
    first = _ddp(model)
    try:
        _ddp(model)
    finally:
        first.close()


def c_model_in_torch_ddp(rank: int, ctx: Ctx) -> Any:
    return _ddp(nn.parallel.DistributedDataParallel(make_mlp(0)))


def c_model_rewrapped_after_close(rank: int, ctx: Ctx) -> Any:
    """A closed wrapper frees its model: a new wrapper around it trains (no error)."""
    model = make_mlp(0)
    _ddp(model).close()
    ddp = _ddp(model)
    x, y = batch(rank, 0)
    loss_fn(ddp(x), y).backward()
    ddp.close()
    return "ok"


def c_process_group_string(rank: int, ctx: Ctx) -> Any:
    return _construct(ctx, process_group="world")


# --- the wrapper's methods -------------------------------------------------------------------------

def m_adaptive_factor_above_one(rank: int, ctx: Ctx) -> Any:
    ddp = _trained(rank)
    ddp.set_adaptive_factor(1.5)


def m_adaptive_factor_nan(rank: int, ctx: Ctx) -> Any:
    ddp = _trained(rank)
    ddp.set_adaptive_factor(NAN)


def m_load_state_dict_wrong_shape(rank: int, ctx: Ctx) -> Any:
    ddp = _trained(rank)
    sd = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    sd["0.bias"] = sd["0.bias"].add(1.0)  # loaded first ...
    sd["4.weight"] = torch.zeros(OUT + 1, 8)  # ... and this one does not fit: nothing may be loaded
    ctx.watch(ddp.module)
    ddp.load_state_dict(sd)


def m_load_state_dict_missing_key(rank: int, ctx: Ctx) -> Any:
    ddp = _trained(rank)
    sd = {k: v.add(1.0) for k, v in ddp.module.state_dict().items() if k != "2.bias"}
    ctx.watch(ddp.module)
    ddp.load_state_dict(sd)


def m_revert_without_backup(rank: int, ctx: Ctx) -> Any:
    ddp = _trained(rank)
    ctx.watch(ddp.module)
    ddp.revert_global_avg()


def _load(rank: int, ctx: Ctx, edit: Callable[[Dict[str, Any]], Dict[str, Any]], **kw: Any) -> Any:
    """Train, save, train on, then load an edited state: refused, nothing loaded."""
    ddp = _trained(rank, **kw)
    state = ddp.training_state_dict()
    x, y = batch(rank, 5)
    loss_fn(ddp(x), y).backward()
    ddp.wait()
    ctx.watch(ddp.module)
    opt_before = [{k: v.clone() for k, v in st.items()} for st in ddp._optims[0].state.values()]
    try:
        return ddp.load_training_state_dict(edit(state))
    finally:
        after = [st for st in ddp._optims[0].state.values()]
        same = all(torch.equal(a[k], b[k]) for a, b in zip(opt_before, after) for k in a)
        ctx.watched.append((nn.Module(), []))
        ctx.optimizer_untouched = same  # type: ignore[attr-defined]


def m_load_other_ranks_state(rank: int, ctx: Ctx) -> Any:
    return _load(rank, ctx, lambda s: dict(s, rank=1 - rank))


def m_load_other_topology(rank: int, ctx: Ctx) -> Any:
    return _load(rank, ctx, lambda s: dict(s, topology="ring"))


def m_load_optimizers_empty_on_rank1(rank: int, ctx: Ctx) -> Any:
    return _load(rank, ctx, lambda s: dict(s, optimizers=[]) if rank == 1 else s)


def m_load_schedulers_miscounted(rank: int, ctx: Ctx) -> Any:
    return _load(rank, ctx, lambda s: dict(s, schedulers=s["schedulers"] + [None]))


def m_load_wrong_world_size(rank: int, ctx: Ctx) -> Any:
    return _load(rank, ctx, lambda s: dict(s, world_size=3))


def m_load_other_models_weights(rank: int, ctx: Ctx) -> Any:
    return _load(rank, ctx, lambda s: dict(s, model={**s["model"], "4.weight": torch.zeros(OUT + 1, 8)}))


def m_load_not_a_training_state(rank: int, ctx: Ctx) -> Any:
    return _load(rank, ctx, lambda s: {"step": 3})


def _consensus_reference(ddp: Any) -> float:
    """sqrt(1/n sum_i ||x_i - mean||^2) over the gathered parameters, in float64."""
    xs = _gathered(ddp.module)
    mean = torch.stack(xs).mean(0)
    return math.sqrt(sum(float(((x - mean) ** 2).sum()) for x in xs) / len(xs))


def m_global_avg_on_rank0_only(rank: int, ctx: Ctx) -> Any:
    """Rank 0 calls global_avg alone (rank 1 goes on to a plain collective): a named error there
    after the timeout, nothing sent; the next whole-model call of both (consensus_distance) works:
    checked against the gathered parameters in float64."""
    ddp = _trained(rank, timeout=SHORT)
    ddp.wait()
    err = None
    if rank == 0:
        ctx.watch(ddp.module)
        try:
            ddp.global_avg()
        except Exception as exc:  # noqa: BLE001 - checked by the parent
            err = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # rank 1's next operation: a collective of its own, while rank 0 waits in the store
    got = ddp.consensus_distance()
    return {"lone_error": err, "untouched": ctx.untouched(), "consensus": got, "reference": _consensus_reference(ddp)}


def m_lone_call_meets_another_call(rank: int, ctx: Ctx) -> Any:
    """Rank 0 calls global_avg while rank 1 calls consensus_distance: both name the mismatch (their
    calls at the same position differ), nothing sent; their next call together works."""
    ddp = _trained(rank, timeout=SHORT)
    ddp.wait()
    ctx.watch(ddp.module)
    err = None
    try:
        ddp.global_avg() if rank == 0 else ddp.consensus_distance()
    except Exception as exc:  # noqa: BLE001 - checked by the parent
        err = f"{type(exc).__name__}: {exc}"
    untouched = ctx.untouched()
    return {"error": err, "untouched": untouched, "consensus": ddp.consensus_distance(),
            "reference": _consensus_reference(ddp)}


def m_consensus_on_rank1_only(rank: int, ctx: Ctx) -> Any:
    """Rank 1 calls consensus_distance alone; then both call global_avg: the exact mean (float64
    re-computation from the parameters gathered before)."""
    ddp = _trained(rank, timeout=SHORT)
    ddp.wait()
    err = None
    if rank == 1:
        try:
            ddp.consensus_distance()
        except Exception as exc:  # noqa: BLE001 - checked by the parent
            err = f"{type(exc).__name__}: {exc}"
    want = torch.stack(_gathered(ddp.module)).mean(0)
    ddp.global_avg(will_revert=False)
    return {"lone_error": err, "mean_error": float((_flat(ddp.module) - want).abs().max())}


def m_global_avg_sync_buffers_differ(rank: int, ctx: Ctx) -> Any:
    ddp = _trained(rank, timeout=SHORT)
    ctx.watch(ddp.module)
    ddp.global_avg(sync_buffers=rank == 1)


def m_methods_after_close(rank: int, ctx: Ctx) -> Any:
    ddp = _trained(rank)
    ddp.close()
    out = {}
    x, _ = batch(rank, 9)
    for name, call in (("forward", lambda: ddp(x)), ("global_avg", lambda: ddp.global_avg()),
                       ("consensus_distance", lambda: ddp.consensus_distance()),
                       ("load_training_state_dict", lambda: ddp.load_training_state_dict({})),
                       ("revert_global_avg", lambda: ddp.revert_global_avg())):
        try:
            call()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - checked by the parent
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


# --- DiLoCo / LocalSGD -----------------------------------------------------------------------------

def _diloco(ctx: Ctx, **kw: Any) -> Any:
    from decentpy import DiLoCo
    model = ctx.watch(kw.pop("model", None) or make_mlp(0))
    inner = kw.pop("inner", None) or torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = kw.pop("outer", None) or torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    kw.setdefault("sync_every", 4)
    d = DiLoCo(model, inner, outer, **kw)
    d.close()
    return d


def d_sync_every_differs(rank: int, ctx: Ctx) -> Any:
    return _diloco(ctx, sync_every=2 if rank == 0 else 3)


def d_sync_every_zero(rank: int, ctx: Ctx) -> Any:
    return _diloco(ctx, sync_every=0)


def d_topology_differs(rank: int, ctx: Ctx) -> Any:
    return _diloco(ctx, topology="complete" if rank == 0 else "ring")


def d_fragment_alpha_differs(rank: int, ctx: Ctx) -> Any:
    model = make_mlp(0)
    return _diloco(ctx, model=model, sync_every=4, fragment_update_alpha=0.5 * rank)


def d_model_differs(rank: int, ctx: Ctx) -> Any:
    model = make_mlp(0) if rank == 0 else nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))
    return _diloco(ctx, model=model)


def d_inner_lr_nan(rank: int, ctx: Ctx) -> Any:
    model = make_mlp(0)
    return _diloco(ctx, model=model, inner=torch.optim.SGD(model.parameters(), lr=NAN))


def d_outer_lr_nan_on_rank1(rank: int, ctx: Ctx) -> Any:
    model = make_mlp(0)
    return _diloco(ctx, model=model, outer=torch.optim.SGD(model.parameters(), lr=NAN if rank == 1 else 0.7))


def d_outer_lr_differs(rank: int, ctx: Ctx) -> Any:
    model = make_mlp(0)
    return _diloco(ctx, model=model, outer=torch.optim.SGD(model.parameters(), lr=0.75 if rank else 0.7))


def d_comm_unknown(rank: int, ctx: Ctx) -> Any:
    return _diloco(ctx, comm="mpi")


def d_broadcast_parameters_string(rank: int, ctx: Ctx) -> Any:
    return _diloco(ctx, broadcast_parameters="yes")


def d_group_string(rank: int, ctx: Ctx) -> Any:
    return _diloco(ctx, group="world")


def d_should_quantize_with_bf16(rank: int, ctx: Ctx) -> Any:
    return _diloco(ctx, should_quantize=True, compression="bf16")


def l_localsgd_sync_every_differs(rank: int, ctx: Ctx) -> Any:
    from decentpy import LocalSGD
    model = ctx.watch(make_mlp(0))
    with LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1 + rank):
        pass


def l_localsgd_model_not_module(rank: int, ctx: Ctx) -> Any:
    from decentpy import LocalSGD
    model = make_mlp(0)
    return LocalSGD(list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)


# --- OSS / ShardedDataParallel ---------------------------------------------------------------------

def o_oss_lr_nan(rank: int, ctx: Ctx) -> Any:
    from decentpy import OSS
    return OSS(ctx.watch(make_mlp(0)).parameters(), optim=torch.optim.SGD, lr=NAN)


def o_oss_weight_decay_inf_on_rank1(rank: int, ctx: Ctx) -> Any:
    from decentpy import OSS
    return OSS(ctx.watch(make_mlp(0)).parameters(), optim=torch.optim.SGD, lr=0.1,
               weight_decay=INF if rank == 1 else 0.0)


def o_oss_recipient_out_of_range(rank: int, ctx: Ctx) -> Any:
    from decentpy import OSS
    oss = OSS(make_mlp(0).parameters(), optim=torch.optim.SGD, lr=0.1)
    oss.consolidate_state_dict(recipient_rank=WORLD)


# --- at run time: last in their spawn (a report stays on the job's error board) -------------------

def r_lr_nan_set_on_rank1(rank: int, ctx: Ctx) -> Any:
    """After two iterations rank 1 sets its first bucket's learning rate to NaN (as the issue's probe
    did): it raises before stepping anything (parameters untouched), rank 0 raises a
    PeerReportedError naming it while waiting for rank 1's next exchange; nothing non-finite
    anywhere."""
    ddp = _trained(rank, steps=2, topology="complete")
    if rank == 1:
        ddp._optims[0].param_groups[0]["lr"] = NAN
    ddp.wait()
    ctx.watch(ddp.module)
    done = 0
    t0 = time.monotonic()
    try:
        for k in range(2, 8):
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
            done += 1
    finally:
        ctx.finite = all(bool(torch.isfinite(p).all()) for p in ddp.parameters())  # type: ignore[attr-defined]
        ctx.seconds = time.monotonic() - t0  # type: ignore[attr-defined]
        ctx.done = done  # type: ignore[attr-defined]


def r_scheduler_nan_on_rank1(rank: int, ctx: Ctx) -> Any:
    """Rank 1's LR scheduler makes the learning rate NaN at its third step (LambdaLR); as above."""
    from decentpy import DecentralizedDataParallel

    factor = (lambda s: NAN if s >= 3 else 1.0) if rank == 1 else (lambda s: 1.0)
    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("sgd"), topology="complete",
                                    lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor))
    ctx.watch(ddp.module)
    done = 0
    t0 = time.monotonic()
    try:
        for k in range(8):
            x, y = batch(rank, k)
            ctx.watched = [(ddp.module, [p.detach().clone() for p in ddp.module.parameters()])]
            loss_fn(ddp(x), y).backward()
            done += 1
    finally:
        ctx.finite = all(bool(torch.isfinite(p).all()) for p in ddp.parameters())  # type: ignore[attr-defined]
        ctx.seconds = time.monotonic() - t0  # type: ignore[attr-defined]
        ctx.done = done  # type: ignore[attr-defined]


# name -> (function, spawn, {rank: (exception name or None for a result, [words])} or None: same for all)
Expect = Dict[int, Tuple[Optional[str], List[str]]]


def both(name: Optional[str], words: List[str]) -> Expect:
    return {r: (name, words) for r in range(WORLD)}


def on(bad: int, name: str, words: List[str], what: str) -> Expect:
    """``bad`` raises ``name`` with ``words``; the others a RuntimeError naming rank ``bad`` and ``what``."""
    return {r: (name, words) if r == bad else ("RuntimeError", [f"failed on rank {bad}", what] + words)
            for r in range(WORLD)}


HYPER = "HyperparameterError"
CASES: Dict[str, Tuple[Callable[[int, Ctx], Any], int, Expect]] = {
    # construction: optimizer hyper-parameters (one rule, decentpy.optim.hyperparams)
    "lr_nan_fused": (c_lr_nan_fused, 0, both(HYPER, ["lr=nan", "finite number >= 0", "param group 0"])),
    "lr_nan_torch_sgd_on_rank1": (c_lr_nan_torch_sgd_on_rank1, 0,
                                  on(1, HYPER, ["lr=nan", "finite number >= 0"], "DecentralizedDataParallel")),
    "lr_negative": (c_lr_negative, 0, both(HYPER, ["lr=-0.1", ">= 0"])),
    "lr_inf_rmsprop": (c_lr_inf_rmsprop, 0, both(HYPER, ["bucket 0", "RMSprop", "lr=inf"])),
    "beta_one": (c_beta_one, 0, both(HYPER, ["betas=(0.9, 1.0)", "[0, 1)"])),
    "eps_zero": (c_eps_zero, 0, both(HYPER, ["eps=0.0", "> 0"])),
    "weight_decay_inf_torch_adamw": (c_weight_decay_inf_torch_adamw, 0, both(HYPER, ["weight_decay=inf"])),
    "momentum_nan_torch_sgd": (c_momentum_nan_torch_sgd, 0, both(HYPER, ["momentum=nan"])),
    "group_lr_nan": (c_group_lr_nan, 0, both(HYPER, ["param group 1", "lr=nan"])),
    "outer_optim_lr_nan": (c_outer_optim_lr_nan, 0, both(HYPER, ["outer_optim", "lr=nan"])),
    # construction: the wrapper's own arguments
    "timeout_zero": (c_timeout_zero, 0, both("ValueError", ["timeout", "timedelta > 0", "0 s"])),
    "timeout_negative_on_rank1": (c_timeout_negative_on_rank1, 0,
                                  on(1, "ValueError", ["timeout", "timedelta > 0", "-1 s"], "ValueError")),
    "timeout_number": (c_timeout_number, 0, both("TypeError", ["timeout", "datetime.timedelta", "int"])),
    "liveness_zero": (c_liveness_zero, 0, both("ValueError", ["peer_liveness_timeout", "timedelta > 0"])),
    "liveness_negative": (c_liveness_negative, 0, both("ValueError", ["peer_liveness_timeout", "-1 s"])),
    "grad_clip_nan": (c_grad_clip_nan, 0, both("ValueError", ["grad_clip_norm", "nan", "0 disables clipping"])),
    "grad_clip_negative_on_rank1": (c_grad_clip_negative_on_rank1, 0,
                                    on(1, "ValueError", ["grad_clip_norm", "-1.0"], "ValueError")),
    "grad_clip_string": (c_grad_clip_string, 0, both("TypeError", ["grad_clip_norm", "'1.0'", "str"])),
    "bucket_size_zero": (c_bucket_size_zero, 0, both("ValueError", ["bucket_size_in_mb", "> 0", "got 0"])),
    "bucket_size_inf_on_rank0": (c_bucket_size_inf_on_rank0, 0,
                                 on(0, "ValueError", ["bucket_size_in_mb", "inf"], "ValueError")),
    "bucket_size_below_a_byte": (c_bucket_size_below_a_byte, 0, both("ValueError", ["bucket_size_in_mb", "byte"])),
    "local_world_size_zero": (c_local_world_size_zero, 0, both("ValueError", ["local_world_size", ">= 1", "0"])),
    "local_world_size_float": (c_local_world_size_float, 0, both("TypeError", ["local_world_size", "1.5"])),
    "local_world_sizes_disagree": (c_local_world_sizes_disagree, 0,
                                   both("ValueError", ["local_world_size=1", "_local_world_size=2"])),
    "flag_as_string": (c_flag_as_string, 0, both("TypeError", ["param_as_bucket_view", "'False'"])),
    "broadcast_parameters_none": (c_broadcast_parameters_none, 0, both("TypeError", ["broadcast_parameters"])),
    "comm_unknown": (c_comm_unknown, 0, both("ValueError", ["comm must be one of", "'mpi'"])),
    "intra_node_unknown": (c_intra_node_unknown, 0, both("ValueError", ["intra_node must be one of", "'ring'"])),
    "intra_node_list": (c_intra_node_list, 0, both("ValueError", ["intra_node must be one of", "['gossip']"])),
    "nonfinite_unknown": (c_nonfinite_unknown, 0, both("ValueError", ["nonfinite must be one of", "'warn'"])),
    "compression_number": (c_compression_number, 0, both("TypeError", ["compression must be", "int"])),
    "compression_unknown_on_rank1": (c_compression_unknown_on_rank1, 0,
                                     on(1, "ValueError", ["compression", "int3"], "ValueError")),
    "local_steps_float": (c_local_steps_float, 0, both("TypeError", ["local_steps", "2.5"])),
    "local_steps_and_budget": (c_local_steps_and_budget, 0, both("ValueError", ["local_steps", "sync_every_s",
                                                                                "not both"])),
    "budget_nan": (c_budget_nan, 0, both("ValueError", ["sync_every_s", "nan"])),
    "scaler_not_a_scaler": (c_scaler_not_a_scaler, 0, both("TypeError", ["scaler", "GradScaler", "str"])),
    "scheduler_class_without_partial": (c_scheduler_class_without_partial, 0,
                                        both("TypeError", ["lr_scheduler_fn=StepLR", "functools.partial",
                                                           "step_size"])),
    "optim_fn_none": (c_optim_fn_none, 0, both("TypeError", ["optim_fn must be callable", "NoneType"])),
    "model_not_a_module": (c_model_not_a_module, 0, both("TypeError", ["model must be a torch.nn.Module", "list"])),
    "model_wrapped_twice": (c_model_wrapped_twice, 0, both("TypeError", ["already a DecentralizedDataParallel",
                                                                         "ddp.module"])),
    "model_in_a_live_wrapper": (c_model_in_a_live_wrapper, 0, both("ValueError", ["already trained by a "
                                                                                  "DecentralizedDataParallel",
                                                                                  "close()"])),
    "model_in_torch_ddp": (c_model_in_torch_ddp, 0, both("TypeError", ["torch's DistributedDataParallel",
                                                                       "model.module"])),
    "model_rewrapped_after_close": (c_model_rewrapped_after_close, 0, both(None, [])),
    "process_group_string": (c_process_group_string, 0, both("TypeError", ["process_group", "ProcessGroup", "str"])),
    # the wrapper's methods
    "adaptive_factor_above_one": (m_adaptive_factor_above_one, 0, both("ValueError", ["adaptive factor", "1.5",
                                                                                      "<= 1"])),
    "adaptive_factor_nan": (m_adaptive_factor_nan, 0, both("ValueError", ["adaptive factor", "nan"])),
    "load_state_dict_wrong_shape": (m_load_state_dict_wrong_shape, 0,
                                    both("ValueError", ["'_model.4.weight'", "(4, 8)", "(3, 8)"])),
    "load_state_dict_missing_key": (m_load_state_dict_missing_key, 0, both("KeyError", ["missing", "2.bias"])),
    "revert_without_backup": (m_revert_without_backup, 0, both("RuntimeError", ["no backup", "global_avg"])),
    "load_other_ranks_state": (m_load_other_ranks_state, 0, {0: ("ValueError", ["saved by group rank 1",
                                                                                "this is group rank 0"]),
                                                             1: ("ValueError", ["saved by group rank 0",
                                                                                "this is group rank 1"])}),
    "load_other_topology": (m_load_other_topology, 0, both("ValueError", ["topology 'ring'", "'complete'"])),
    "load_optimizers_empty_on_rank1": (m_load_optimizers_empty_on_rank1, 0,
                                       on(1, "ValueError", ["1 buckets but 0 optimizers"], "load_training_state_dict")),
    "load_schedulers_miscounted": (m_load_schedulers_miscounted, 0, both("ValueError", ["1 buckets but 2 schedulers"])),
    "load_wrong_world_size": (m_load_wrong_world_size, 0, both("ValueError", ["world size 3", "has 2"])),
    "load_other_models_weights": (m_load_other_models_weights, 0, both("ValueError", ["'4.weight'", "(4, 8)"])),
    "load_not_a_training_state": (m_load_not_a_training_state, 0, both("KeyError", ["not a decentpy training state"])),
    "global_avg_on_rank0_only": (m_global_avg_on_rank0_only, 0, both(None, [])),
    "consensus_on_rank1_only": (m_consensus_on_rank1_only, 0, both(None, [])),
    "lone_call_meets_another_call": (m_lone_call_meets_another_call, 0, both(None, [])),
    "global_avg_sync_buffers_differ": (m_global_avg_sync_buffers_differ, 0,
                                       both("ArrivalError", ["different whole-group calls",
                                                             "global_avg(sync_buffers=True)"])),
    "methods_after_close": (m_methods_after_close, 0, both(None, [])),
    # OSS
    "oss_lr_nan": (o_oss_lr_nan, 0, both(HYPER, ["OSS", "lr=nan"])),
    "oss_weight_decay_inf_on_rank1": (o_oss_weight_decay_inf_on_rank1, 0,
                                      on(1, HYPER, ["weight_decay=inf"], "OSS")),
    "oss_recipient_out_of_range": (o_oss_recipient_out_of_range, 0, both("ValueError", ["recipient_rank", "got 2"])),
    # run time, last of spawn 0
    "lr_nan_set_on_rank1": (r_lr_nan_set_on_rank1, 0, {
        1: (HYPER, ["rank 1", "lr=nan", "bucket 0's optimizer", "param group 0", "nothing was stepped"]),
        0: ("PeerReportedError", ["rank 1", "HyperparameterError", "lr=nan"])}),
    # DiLoCo / LocalSGD (spawn 1)
    "diloco_sync_every_differs": (d_sync_every_differs, 1,
                                  both("SettingsMismatchError", ["sync_every differs", "2 on rank 0", "3 on rank 1"])),
    "diloco_sync_every_zero": (d_sync_every_zero, 1, both("ValueError", ["sync_every", "got 0"])),
    "diloco_topology_differs": (d_topology_differs, 1, both("SettingsMismatchError", ["topology", "'ring'"])),
    "diloco_fragment_alpha_differs": (d_fragment_alpha_differs, 1,
                                      both("SettingsMismatchError", ["fragment_update_alpha", "0.5"])),
    "diloco_model_differs": (d_model_differs, 1, both("SettingsMismatchError", ["model", "rank 1"])),
    "diloco_inner_lr_nan": (d_inner_lr_nan, 1, both(HYPER, ["inner optimizer", "lr=nan"])),
    "diloco_outer_lr_nan_on_rank1": (d_outer_lr_nan_on_rank1, 1,
                                     on(1, HYPER, ["outer optimizer 0", "lr=nan"], "DiLoCo")),
    "diloco_outer_lr_differs": (d_outer_lr_differs, 1, both("SettingsMismatchError", ["outer_optimizer", "0.75"])),
    "diloco_comm_unknown": (d_comm_unknown, 1, both("ValueError", ["comm must be one of", "'mpi'"])),
    "diloco_broadcast_parameters_string": (d_broadcast_parameters_string, 1,
                                           both("TypeError", ["broadcast_parameters", "'yes'"])),
    "diloco_group_string": (d_group_string, 1, both("TypeError", ["group", "ProcessGroup", "str"])),
    "diloco_should_quantize_with_bf16": (d_should_quantize_with_bf16, 1,
                                         both("ValueError", ["should_quantize", "bf16"])),
    "localsgd_sync_every_differs": (l_localsgd_sync_every_differs, 1,
                                    both("SettingsMismatchError", ["sync_every", "1 on rank 0", "2 on rank 1"])),
    "localsgd_model_not_module": (l_localsgd_model_not_module, 1, both("TypeError", ["model must be an nn.Module"])),
    # run time, last of spawn 1
    "scheduler_nan_on_rank1": (r_scheduler_nan_on_rank1, 1, {
        1: (HYPER, ["rank 1", "lr=nan", "bucket 0's optimizer", "step 3"]),
        0: ("PeerReportedError", ["rank 1", "HyperparameterError", "lr=nan"])}),
}


def run_case(rank: int, name: str) -> Dict[str, Any]:
    fn = CASES[name][0]
    ctx = Ctx()
    t0 = time.monotonic()
    out: Dict[str, Any]
    try:
        value = fn(rank, ctx)
        out = {"type": None, "types": [], "text": "", "value": value if isinstance(value, dict) else None}
    except Exception as exc:  # noqa: BLE001 - the parent checks type and message
        out = {"type": type(exc).__name__, "types": [c.__name__ for c in type(exc).__mro__], "text": str(exc),
               "tb": traceback.format_exc()[-3000:]}
    out["seconds"] = time.monotonic() - t0
    out["untouched"] = ctx.untouched()
    for extra in ("optimizer_untouched", "finite", "done"):
        if hasattr(ctx, extra):
            out[extra] = getattr(ctx, extra)
    t = torch.ones(1)
    dist.all_reduce(t)  # every case ends with a working process group
    out["allreduce"] = t.item()
    return out


def worker(rank: int, world: int, spawn: int) -> Dict[str, Dict[str, Any]]:
    torch.set_num_threads(1)
    return {name: run_case(rank, name) for name, (_, s, _) in CASES.items() if s == spawn}


_RESULTS: Dict[int, List[Dict[str, Dict[str, Any]]]] = {}


def _results(spawn: int) -> List[Dict[str, Dict[str, Any]]]:
    if spawn not in _RESULTS:
        # (a rank must not exit before the others read the last case's report: the job's store lives in
        # rank 0's process; every case ends with an all-reduce, which keeps them together)
        _RESULTS[spawn] = run_workers(worker, WORLD, spawn, timeout=300, require_clean_exit=True)
    return _RESULTS[spawn]


def test_the_probe_has_at_least_45_cases() -> None:
    assert len(CASES) >= 45, len(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_call_is_a_named_error_on_every_rank_or_a_correct_result(case: str) -> None:
    _, spawn, expect = CASES[case]
    per_rank = [r[case] for r in _results(spawn)]
    for rank, got in enumerate(per_rank):
        want, words = expect[rank]
        assert got["allreduce"] == WORLD, f"{case}: the process group is broken after it on rank {rank}"
        if want is None:
            assert got["type"] is None, f"{case}: rank {rank} raised {got['type']}: {got['text']}\n{got.get('tb')}"
            continue
        assert want in got["types"], (f"{case}: rank {rank} raised {got['type']} ({got['text']!r}), expected {want}"
                                      f"\n{got.get('tb', '')}")
        for w in words:
            assert w in got["text"], f"{case}: rank {rank}: {w!r} not in {got['text']!r}"
        if case not in ("scheduler_nan_on_rank1", "lr_nan_set_on_rank1") or rank == 1:  # (rank 0 trains on)
            assert got["untouched"], f"{case}: rank {rank}'s parameters changed although the call failed"
        if "optimizer_untouched" in got:
            assert got["optimizer_untouched"], f"{case}: rank {rank}'s optimizer state changed"
        assert got["seconds"] < 30, (case, rank, got["seconds"])


def test_a_lone_whole_model_call_is_named_and_the_next_one_is_correct() -> None:
    """global_avg on rank 0 alone: an ArrivalError there naming rank 1 within the timeout; rank 1
    never blocks, and the next call of both (consensus_distance) is the float64 value. The same for
    consensus_distance on rank 1 alone, followed by global_avg: the exact mean."""
    res = [r["global_avg_on_rank0_only"]["value"] for r in _results(0)]
    assert res[0]["lone_error"] is not None and res[0]["lone_error"].startswith("ArrivalError"), res[0]
    assert "rank(s) [1]" in res[0]["lone_error"] and "Nothing was sent" in res[0]["lone_error"], res[0]
    assert res[0]["untouched"] and res[1]["lone_error"] is None
    for r in res:
        assert r["consensus"] > 0 and r["consensus"] == pytest.approx(r["reference"], rel=1e-6), r
    res = [r["lone_call_meets_another_call"]["value"] for r in _results(0)]
    for r in res:
        assert r["error"].startswith("ArrivalError") and "different whole-group calls" in r["error"], r
        assert "'global_avg(sync_buffers=False)'" in r["error"] or "'consensus_distance()'" in r["error"], r
        assert r["untouched"] and r["consensus"] == pytest.approx(r["reference"], rel=1e-6), r
    res = [r["consensus_on_rank1_only"]["value"] for r in _results(0)]
    assert res[0]["lone_error"] is None and res[1]["lone_error"].startswith("ArrivalError"), res
    assert "rank(s) [0]" in res[1]["lone_error"], res[1]
    for r in res:
        assert r["mean_error"] < 1e-6, r


def test_methods_after_close_name_the_close() -> None:
    for rank, r in enumerate(_results(0)):
        out = r["methods_after_close"]["value"]
        for name, text in out.items():
            assert text.startswith("RuntimeError") and name in text and "was closed" in text, (rank, name, text)


def test_a_nan_learning_rate_at_run_time_stops_every_rank_without_corruption() -> None:
    """The bad rank raises before its kernel pass (nothing stepped: its parameters are the ones
    before that iteration), the other within a few seconds of waiting for it; every parameter is
    finite on both."""
    for case in ("lr_nan_set_on_rank1", "scheduler_nan_on_rank1"):
        spawn = CASES[case][1]
        per = [r[case] for r in _results(spawn)]
        for rank, got in enumerate(per):
            assert got["finite"], (case, rank)
            assert got["seconds"] < 15, (case, rank, got["seconds"])
        assert per[1]["untouched"], case
        assert per[1]["done"] == (0 if case == "lr_nan_set_on_rank1" else 3), (case, per[1]["done"])


def test_diloco_checks_its_inner_step_before_it_runs() -> None:
    """The inner optimizer's hyper-parameters are checked before each of its steps (a NaN set
    after construction, e.g. by a scheduler): a named error, the model untouched (one process)."""
    from decentpy import DiLoCo, HyperparameterError

    with single_process_group("gloo"):
        model = make_mlp(0)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with DiLoCo(model, inner, outer, sync_every=2):
            x, y = batch(0, 0)
            loss_fn(model(x), y).backward()
            inner.step()
            inner.param_groups[0]["lr"] = NAN
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(HyperparameterError, match=r"inner optimizer \(SGD\), param group 0: lr=nan"):
                inner.step()
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
