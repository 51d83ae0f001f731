"""Parameters that get no gradient are not updated (issue 41), as torch's optimizers skip a
parameter whose ``.grad`` is None: no weight decay, no moment update, while the gossip mix still
averages them with the peers. Checked against torch's own optimizers (world of one) and against a
float64 re-computation of decentralized SGD (two ranks, a parameter unused on one of them).
"""

from __future__ import annotations

import logging
from typing import Dict, List

import pytest
import torch
from torch import nn

from dist_harness import run_workers, single_process_group
from reference import HIDDEN, IN, OUT, batch, loss_fn, make_mlp


class Partly(nn.Module):
    """An MLP plus ``extra``, a bias added to the output only while ``use_extra`` is set, and
    ``never``, a layer no forward uses."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = make_mlp(seed)
        torch.manual_seed(seed + 1)
        self.extra = nn.Parameter(torch.randn(OUT) * 0.1)
        self.never = nn.Linear(IN, HIDDEN)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out + self.extra if self.use_extra else out


def _copy_into(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        for a, b in zip(dst.parameters(), src.parameters()):
            a.copy_(b)


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_unused_parameters_are_not_updated_as_in_torch(opt: str, caplog) -> None:
    """``never`` gets no gradient in any iteration and ``extra`` none in iterations 3 and 4: decentpy
    updates neither then (``never`` stays bit for bit what it was, in spite of weight decay), as
    torch's AdamW / SGD with momentum skip a parameter whose .grad is None; every parameter ends
    where torch's ends (SGD exactly, AdamW while ``extra`` is used throughout: see the next test), and
    the warning names each parameter once."""
    from decentpy import DecentralizedDataParallel
    from decentpy import optim as O

    model, ref = Partly(0), Partly(0)
    _copy_into(ref, model)
    never_before = model.never.weight.detach().clone()
    named = list(ref.named_parameters())
    if opt == "adamw":
        fn = lambda n: O.optim_fn_adamw(n, lr=0.01, weight_decay=0.1)  # noqa: E731
        ref_opt = torch.optim.AdamW(O.split_decay_groups(named, 0.1), lr=0.01)
        unused_steps = ()  # AdamW's bias correction counts a bucket's steps: see the next test
    else:
        fn = lambda n: O.optim_fn_sgd(n, lr=0.05, momentum=0.9, weight_decay=0.01)  # noqa: E731
        ref_opt = torch.optim.SGD(O.split_decay_groups(named, 0.01), lr=0.05, momentum=0.9)
        unused_steps = (3, 4)
    with single_process_group("gloo"), caplog.at_level(logging.WARNING, logger="decentpy"):
        ddp = DecentralizedDataParallel(model, fn, topology="complete")
        for k in range(7):
            x, y = batch(0, k)
            model.use_extra = ref.use_extra = k not in unused_steps
            loss_fn(ddp(x), y).backward()
            loss_fn(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        ddp.close()
    assert torch.equal(model.never.weight.detach(), never_before)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=n)
    warned = [r.getMessage() for r in caplog.records if "got no gradient" in r.getMessage()]
    names = ["'never.weight'", "'never.bias'"] + (["'extra'"] if unused_steps else [])
    for name in names:
        assert sum(name in w for w in warned) == 1, (name, warned)


def test_adam_step_count_of_a_parameter_that_resumes() -> None:
    """A parameter without a gradient for some iterations does not move then, and resumes with the
    bias corrections of its bucket's step count (torch counts per parameter): documented, and
    bounded here -- its first step after the pause differs from torch's by less than the step size."""
    from decentpy import DecentralizedDataParallel
    from decentpy import optim as O

    model, ref = Partly(0), Partly(0)
    _copy_into(ref, model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    held: List[torch.Tensor] = []
    with single_process_group("gloo"):
        ddp = DecentralizedDataParallel(model, lambda n: O.optim_fn_adamw(n, lr=0.01, weight_decay=0.0),
                                        topology="complete")
        for k in range(6):
            x, y = batch(0, k)
            model.use_extra = ref.use_extra = k not in (2, 3)
            loss_fn(ddp(x), y).backward()
            loss_fn(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            held.append(model.extra.detach().clone())
        ddp.close()
    assert torch.equal(held[2], held[1]) and torch.equal(held[3], held[1])  # not moved while unused
    assert (model.extra.detach() - ref.extra.detach()).abs().max() < 2 * 0.01


def partly_worker(rank: int, world: int, steps: int) -> Dict[str, torch.Tensor]:
    from decentpy import DecentralizedDataParallel
    from decentpy import optim as O

    model = Partly(0)
    ddp = DecentralizedDataParallel(model, lambda n: O.optim_fn_sgd(n, lr=0.1, momentum=0.9, weight_decay=0.0),
                                    topology="complete")
    for k in range(steps):
        model.use_extra = rank == 0 or k == 0
        x, y = batch(rank, k)
        loss_fn(ddp(x), y).backward()
    ddp.consensus_distance()  # waits for the exchange in flight (a collective); the parameters stay as they are
    out = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ddp.close()
    return out


def test_parameter_unused_on_one_rank_is_mixed_but_stepped_only_where_it_has_a_gradient() -> None:
    """``extra`` is used on rank 0 only after the first iteration (in the first, every rank must use
    every parameter it will ever use on another: the buckets are fixed then, and a different
    gradient-ready order is refused with an error naming the parameter): rank 1 does not step it but
    mixes it with rank 0's every iteration (gossip averages parameters, not gradients; torch DDP
    would average rank 0's gradient with a zero one instead). Against a float64 re-computation of
    decentralized SGD with momentum on two ranks: x_r <- mean of both, then where rank r has a
    gradient b_r <- 0.9 b_r + g_r (g_r at its first step) and x_r -= lr * b_r (rank 1's momentum
    buffer of ``extra`` would move it at every step otherwise)."""
    steps = 5
    res = run_workers(partly_worker, 2, steps, timeout=180)
    models = [Partly(0).double() for _ in range(2)]
    bufs: List[Dict[int, torch.Tensor]] = [{}, {}]
    for k in range(steps):
        grads = []
        for r, m in enumerate(models):
            m.use_extra = r == 0 or k == 0
            for p in m.parameters():
                p.grad = None
            x, y = batch(r, k)
            loss_fn(m(x.double()), y.double()).backward()
            grads.append([p.grad for p in m.parameters()])
        with torch.no_grad():
            for tensors in zip(*[list(m.parameters()) for m in models]):
                mean = sum(t.detach().clone() for t in tensors) / 2
                for t in tensors:
                    t.copy_(mean)
            for m, gs, buf in zip(models, grads, bufs):
                for j, (p, g) in enumerate(zip(m.parameters(), gs)):
                    if g is not None:
                        buf[j] = g.clone() if j not in buf else 0.9 * buf[j] + g
                        p -= 0.1 * buf[j]
    for r, m in enumerate(models):
        for n, p in m.named_parameters():
            torch.testing.assert_close(res[r][n], p.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {r} {n}")
    assert not torch.equal(res[0]["extra"], res[1]["extra"])  # rank 0 stepped it after the last mix
