"""Bucket layout over a wrapper's life: built at construction, rebuilt only when it must be.

The wrapper moves parameters into flat blocks when it is constructed (reverse registration
order); the first backward records the gradient-ready order and rebuilds the buckets only if that
order packs them differently, or if a parameter was given new storage, dtype or device after
wrapping. Every case is checked against the float64 plain-PyTorch reference.
"""

from __future__ import annotations

import tempfile
from typing import Dict, List

import pytest
import torch
from torch import nn

from dist_harness import run_workers
from reference import assert_close_params, batch, decentpy_optim_fn, loss_fn, make_mlp, simulate

STEPS = 5
TINY_CAP_MB = 0.0002  # ~210 bytes: a few small tensors per bucket


class Reordered(nn.Module):
    """``make_mlp(0)``'s layers, registered last-first: gradients arrive in registration order."""

    NAMES = {"last": "4", "mid": "2", "first": "0"}

    def __init__(self) -> None:
        super().__init__()
        seq = make_mlp(0)
        self.last, self.mid, self.first = seq[4], seq[2], seq[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.mid(torch.tanh(self.first(x)))))


def _as_mlp_names(model: nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        head, _, tail = n.partition(".")
        out[f"{Reordered.NAMES.get(head, head)}.{tail}"] = p.detach().double().clone()
    return out


def _storage_of_blocks(ddp) -> List[bool]:
    """For every parameter and gradient: does it live in its bucket's blocks?"""
    ok = []
    for b in ddp.buckets:
        for p in b.params:
            ok.append(p.untyped_storage().data_ptr() == b.param_block.untyped_storage().data_ptr())
            ok.append(p.grad is None or p.grad.untyped_storage().data_ptr()
                      == b.grad_block.untyped_storage().data_ptr())
    return ok


def _reference(topo: str = "one-peer-exp", opt: str = "adamw", steps: int = STEPS):
    from decentpy.topology import make_topology

    return simulate(4, make_topology(topo, 4, 1).mixing_matrix, opt, steps)


# --- construction ---------------------------------------------------------------------------------

def construction_worker(rank: int, world: int) -> dict:
    from decentpy import DecentralizedDataParallel

    model = make_mlp(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {id(p): n for n, p in model.named_parameters()}
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn("adamw"), topology="one-peer-exp",
                                    bucket_size_in_mb=TINY_CAP_MB)
    out = {
        "values_kept": all(torch.equal(before[n], p) for n, p in model.named_parameters()),
        "grads_none": all(p.grad is None for p in model.parameters()),
        "in_blocks": _storage_of_blocks(ddp),
        "order": [ids[id(p)] for b in ddp.buckets for p in b.params],
        "lr": ddp.get_lr(),
    }
    # A backward after an eval-mode forward (of the inner model) is no iteration: gradients only
    # accumulate, as with torch DDP; zero_grad() then discards them and training is unaffected.
    model.eval()
    x, y = batch(rank, 0)
    loss_fn(ddp(x), y).backward()
    out["eval_backward"] = (ddp.step_count, all(p.grad is not None for p in model.parameters()))
    ddp.zero_grad()
    model.train()
    for k in range(STEPS):
        x, y = batch(rank, k)
        loss_fn(ddp(x), y).backward()
    ddp.consensus_distance()
    out["params"] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    out["in_blocks_after"] = _storage_of_blocks(ddp)
    out["grads_are_views"] = all(p.grad is not None for p in model.parameters())
    return out


def test_parameters_live_in_buckets_from_construction() -> None:
    res = run_workers(construction_worker, 4, timeout=180)
    registration = [n for n, _ in make_mlp(0).named_parameters()]
    for r in res:
        assert r["values_kept"], "wrapping changed a parameter's value"
        assert r["grads_none"], "wrapping gave parameters a gradient before the first backward"
        assert all(r["in_blocks"]) and all(r["in_blocks_after"]), "a parameter or gradient left its bucket"
        assert r["grads_are_views"]
        assert r["eval_backward"] == (0, True), "an eval-mode backward stepped or lost its gradients"
        # construction layout: reverse registration order, the order torch's autograd produces here
        assert r["order"] == list(reversed(registration))
        assert r["lr"] == pytest.approx(0.01)
    assert_close_params([r["params"] for r in res], _reference(), rtol=2e-5, atol=2e-5, what="construction layout")


# --- rebuilds -------------------------------------------------------------------------------------

def reorder_worker(rank: int, world: int, path: str) -> dict:
    from decentpy import DecentralizedDataParallel

    def make() -> DecentralizedDataParallel:
        return DecentralizedDataParallel(Reordered(), decentpy_optim_fn("adamw"), topology="one-peer-exp",
                                         bucket_size_in_mb=TINY_CAP_MB)

    ddp = make()
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    construction = [[names[id(p)] for p in b.params] for b in ddp.buckets]
    ready: List[str] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: ready.append(names[id(p)]))
             for p in ddp.module.parameters()]
    for k in range(STEPS):
        if k == 2:
            torch.save(ddp.training_state_dict(), f"{path}/ckpt{rank}.pt")
        x, y = batch(rank, k)
        loss_fn(ddp(x), y).backward()
        if k == 0:
            for h in hooks:
                h.remove()
    ddp.consensus_distance()
    final = [[names[id(p)] for p in b.params] for b in ddp.buckets]

    # Hyperparameters edited through decent-dp's `_optims` before the first iteration survive the
    # rebuild: with lr 0 the (equal) workers only mix, so nothing moves.
    edited = make()
    before = _as_mlp_names(edited.module)
    for opt in edited._optims:
        for group in opt.param_groups:
            group["lr"] = 0.0
    edited_construction = [len(b.params) for b in edited.buckets]
    for k in range(2):
        x, y = batch(rank, k)
        loss_fn(edited(x), y).backward()
    edited_out = {"rebuilt": [len(b.params) for b in edited.buckets] != edited_construction,
                  "lrs": [g["lr"] for o in edited._optims for g in o.param_groups],
                  "unchanged": all(torch.equal(before[n], p) for n, p in _as_mlp_names(edited.module).items())}

    resumed = make()  # construction layout again; the checkpoint carries the rebuilt one
    resumed.load_training_state_dict(torch.load(f"{path}/ckpt{rank}.pt", weights_only=False))
    rnames = {id(p): n for n, p in resumed.module.named_parameters()}
    loaded = [[rnames[id(p)] for p in b.params] for b in resumed.buckets]
    for k in range(2, STEPS):
        x, y = batch(rank, k)
        loss_fn(resumed(x), y).backward()
    resumed.consensus_distance()
    return {"construction": construction, "final": final, "loaded": loaded, "ready": ready,
            "params": _as_mlp_names(ddp.module), "resumed": _as_mlp_names(resumed.module),
            "in_blocks": _storage_of_blocks(ddp) + _storage_of_blocks(resumed), "edited": edited_out}


def test_buckets_rebuilt_in_gradient_ready_order() -> None:
    with tempfile.TemporaryDirectory() as d:
        res = run_workers(reorder_worker, 4, d, timeout=240)
    for r in res:
        flat_final = [n for b in r["final"] for n in b]
        assert r["construction"] != r["final"], "the construction layout should not have survived"
        # every bucket holds parameters whose gradients arrive together, in bucket order
        assert sorted(flat_final) == sorted(r["ready"])
        pos = {n: i for i, n in enumerate(r["ready"])}
        for earlier, later in zip(r["final"], r["final"][1:]):
            assert max(pos[n] for n in earlier) < min(pos[n] for n in later)
        assert r["loaded"] == r["final"], "a checkpoint did not restore its bucket layout"
        assert r["edited"]["rebuilt"] and r["edited"]["lrs"] and set(r["edited"]["lrs"]) == {0.0}
        assert r["edited"]["unchanged"], "an lr edited through _optims was lost when the buckets were rebuilt"
        assert all(r["in_blocks"])
        for n in r["params"]:
            assert torch.equal(r["params"][n], r["resumed"][n]), f"resumed run diverged at '{n}'"
    assert_close_params([r["params"] for r in res], _reference(), rtol=2e-5, atol=2e-5, what="rebuilt layout")


def changed_after_wrap_worker(rank: int, world: int, change: str) -> dict:
    from decentpy import DecentralizedDataParallel

    model = make_mlp(0).double() if change == "double_from_start" else make_mlp(0)
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn("torch_adamw"), topology="one-peer-exp")
    construction = [b.param_block.untyped_storage().data_ptr() for b in ddp.buckets]
    with torch.no_grad():
        if change == "new_storage":  # same values, storage of its own
            model[2].weight.data = model[2].weight.data.clone()
        elif change == "double":
            model.double()
    dtype = torch.float64 if change.startswith("double") else torch.float32
    for k in range(STEPS):
        x, y = batch(rank, k)
        loss_fn(ddp(x.to(dtype)), y.to(dtype)).backward()
    ddp.consensus_distance()
    return {"params": {n: p.detach().double().clone() for n, p in model.named_parameters()},
            "rebuilt": [b.param_block.untyped_storage().data_ptr() for b in ddp.buckets] != construction,
            "dtypes": {str(b.param_block.dtype) for b in ddp.buckets},
            "in_blocks": _storage_of_blocks(ddp)}


@pytest.mark.parametrize("change", ["new_storage", "double", "double_from_start"])
def test_parameters_changed_after_wrapping_are_picked_up(change: str) -> None:
    """float64 also shows torch's own optimizer step on the generic path, at full precision."""
    res = run_workers(changed_after_wrap_worker, 4, change, timeout=180)
    f64 = change.startswith("double")
    tol = 1e-10 if f64 else 2e-5
    assert_close_params([r["params"] for r in res], _reference(), rtol=tol, atol=tol, what=change)
    for r in res:
        assert r["rebuilt"] == (change != "double_from_start")
        assert all(r["in_blocks"])
        assert r["dtypes"] == ({"torch.float64"} if f64 else {"torch.float32"})


# --- parameters without a gradient ----------------------------------------------------------------

class WithUnused(nn.Module):
    """``make_mlp(0)`` plus a layer that forward never uses (its parameters get no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_mlp(0)
        self.unused = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def unused_worker(rank: int, world: int) -> dict:
    from decentpy import DecentralizedDataParallel

    model = WithUnused()
    before = {n: p.detach().clone() for n, p in model.unused.named_parameters()}
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn("sgd_plain"), topology="ring")
    names = {id(p): n for n, p in model.named_parameters()}
    for k in range(STEPS):
        x, y = batch(rank, k)
        loss_fn(ddp(x), y).backward()
    ddp.consensus_distance()
    return {"params": {n[len("net."):]: p.detach().double().clone() for n, p in model.named_parameters()
                       if n.startswith("net.")},
            "unused_kept": all(torch.equal(before[n], p) for n, p in model.unused.named_parameters()),
            "unused_grads_zero": all(p.grad is not None and not p.grad.any() for p in model.unused.parameters()),
            "last_bucket": [names[id(p)] for p in ddp.buckets[-1].params],
            "in_blocks": _storage_of_blocks(ddp)}


def test_parameters_without_gradient_get_a_bucket_and_a_zero_gradient_step() -> None:
    res = run_workers(unused_worker, 4, timeout=180)
    assert_close_params([r["params"] for r in res], _reference("ring", "sgd_plain"), rtol=2e-5, atol=2e-5,
                        what="model with an unused layer")
    for r in res:
        assert r["unused_kept"], "plain SGD with a zero gradient must leave the unused layer as it was"
        assert r["unused_grads_zero"]
        assert set(r["last_bucket"]) >= {"unused.weight", "unused.bias"}, r["last_bucket"]
        assert all(r["in_blocks"])
