"""Bad input: a clear exception on every rank, before any collective, and nothing corrupted."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from dist_harness import run_workers
from reference import batch, decentpy_optim_fn, loss_fn, make_mlp


def construct_worker(rank: int, world: int, case: str) -> str:
    """Try a bad construction; return the error text (the same on every rank) or 'no error'."""
    from decentpy import DecentralizedDataParallel

    model = make_mlp(0)
    kwargs = dict(topology="ring")
    optim_fn = decentpy_optim_fn("adam")
    if case == "unknown_topology":
        kwargs["topology"] = "torus"
    elif case == "aer_one_node":
        kwargs.update(topology="alternating-exp-ring", local_world_size=world)
    elif case == "lws_not_dividing":
        # gossip topologies now accept a partial last node (test_topology); the node strategies,
        # which shard or all-reduce over equal nodes, still refuse it
        kwargs.update(topology="complete", local_world_size=2, intra_node="allreduce")
    elif case == "model_differs":
        if rank == world - 1:
            model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 9), nn.Tanh(), nn.Linear(9, 3))
    elif case == "sparse":
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 3))
    elif case == "optim_not_optimizer":
        optim_fn = lambda named: [p for _, p in named]  # noqa: E731
    elif case == "optim_wrong_params":
        optim_fn = lambda named: torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)  # noqa: E731
    elif case == "optim_missing_params":
        optim_fn = lambda named: torch.optim.SGD([named[0][1]], lr=0.1)  # noqa: E731
    elif case == "fused_float64":
        model = model.double()  # decentpy's fused optimizers step fp32/bf16/fp16 only
    elif case == "hook_on_one_rank":  # the hook's process groups are created collectively
        optim_fn = lambda named: (_HookedSGD if rank == 1 else torch.optim.SGD)(  # noqa: E731
            [p for _, p in named], lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        DecentralizedDataParallel(model, optim_fn, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        untouched = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        # The process group must still work: no rank is stuck in a half-started collective.
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        return f"{type(exc).__name__}: {exc} | untouched={untouched} | allreduce={t.item()}"
    return "no error"


CASES = {
    "unknown_topology": (4, ["torus", "complete", "ring", "one-peer-exp", "alternating-exp-ring"]),
    "aer_one_node": (4, ["alternating-exp-ring", "local_world_size"]),
    "lws_not_dividing": (3, ["local_world_size", "2", "3"]),
    "model_differs": (2, ["rank 1", "differs"]),
    "sparse": (2, ["sparse"]),
    "optim_not_optimizer": (2, ["optim_fn", "Optimizer", "list"]),
    "optim_wrong_params": (2, ["optim_fn", "not given"]),
    "optim_missing_params": (2, ["optim_fn", "leaves out", "0.bias"]),
    "fused_float64": (2, ["Adam", "torch.float64", "torch.optim.AdamW"]),
    "hook_on_one_rank": (2, ["without pre_average_hook on rank 0", "with one on rank 1"]),
}


class _HookedSGD(torch.optim.SGD):
    def pre_average_hook(self, edge, weight) -> None:  # decent-dp's extension point
        pass


def construct_all_worker(rank: int, world: int, cases: list) -> dict:
    """Every bad construction for one world size, in one process group, one after the other."""
    return {case: construct_worker(rank, world, case) for case in cases}


_RESULTS: dict = {}


def _results_for(world: int) -> dict:
    if world not in _RESULTS:
        cases = sorted(c for c, (w, _) in CASES.items() if w == world)
        res = run_workers(construct_all_worker, world, cases, timeout=240)
        _RESULTS[world] = {c: [r[c] for r in res] for c in cases}
    return _RESULTS[world]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_construction_raises_on_every_rank(case: str) -> None:
    world, needles = CASES[case]
    res = _results_for(world)[case]
    for r, text in enumerate(res):
        assert text != "no error", f"rank {r} accepted {case}"
        for needle in needles:
            assert needle in text, f"rank {r}: '{needle}' not in error for {case}: {text}"
        assert f"allreduce={float(world)}" in text
        if case != "model_differs":
            assert "untouched=True" in text


def _runtime_error_of(action: Callable[[], object]) -> str:
    """The message of the RuntimeError ``action`` raises, or 'no error'."""
    try:
        action()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def used_twice_worker(rank: int, world: int) -> str:
    from decentpy import DecentralizedDataParallel

    model = make_mlp(0)
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn("adam"), topology="complete")
    x, y = batch(rank, 0)
    loss_fn(ddp(x), y).backward()  # the first iteration fixes the bucket layout
    out = ddp(x)
    loss_fn(out, y).backward(retain_graph=True)
    return _runtime_error_of(lambda: loss_fn(out, y).backward())  # a second backward, same forward


def test_second_gradient_in_one_iteration_is_refused_with_the_parameter_name() -> None:
    res = run_workers(used_twice_worker, 2, timeout=180)
    for r in res:
        assert "received a gradient twice" in r and "'4." in r, r


def cast_after_first_iteration_worker(rank: int, world: int) -> str:
    from decentpy import DecentralizedDataParallel

    model = make_mlp(0)
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn("adamw"), topology="complete")
    x, y = batch(rank, 0)
    loss_fn(ddp(x), y).backward()
    model.double()
    return _runtime_error_of(lambda: loss_fn(ddp(x.double()), y.double()).backward())


def test_cast_after_first_iteration_is_a_clear_error() -> None:
    res = run_workers(cast_after_first_iteration_worker, 2, timeout=120)
    for msg in res:
        assert "no longer lives" in msg and "before wrapping" in msg and "parameter '4.bias'" in msg, msg


def reentrant_worker(rank: int, world: int) -> str:
    from decentpy import DecentralizedDataParallel

    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # The second use goes through a separate autograd graph whose backward runs inside
            # the first one (as reentrant checkpointing does): two accumulations in one backward.
            h = self.lin(x)
            inner = torch.utils.checkpoint.checkpoint(self.lin, h, use_reentrant=True)
            return inner

    model = Twice()
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn("adam"), topology="complete")
    x = torch.randn(2, 4, requires_grad=True)
    return _runtime_error_of(lambda: ddp(x).sum().backward())


def test_reentrant_double_use_is_refused_with_the_parameter_name() -> None:
    res = run_workers(reentrant_worker, 2, timeout=180)
    for r in res:
        assert "received a gradient twice" in r and "'lin." in r, r


def test_wrapping_before_init_process_group_raises() -> None:
    import torch.distributed as dist

    from decentpy import DecentralizedDataParallel

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam"))
