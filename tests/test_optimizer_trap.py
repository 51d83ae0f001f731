"""A torch optimizer next to the wrapper (torch DDP's habit: ``opt.step()`` after ``backward()``)
would step the parameters a second time, silently (issue 41). It is refused, naming the
parameters, before it changes anything; ``ddp.allow_optimizer`` lets one through on purpose; the
wrapper's own optimizers (the buckets', a torch optimizer from optim_fn included) and optimizers
over other parameters are untouched; after ``close()`` the parameters are free again.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import single_process_group
from reference import batch, loss_fn, make_mlp


def test_a_second_optimizer_is_refused_then_allowed_and_released() -> None:
    from decentpy import DecentralizedDataParallel
    from decentpy import optim as O

    model = make_mlp(0)
    with single_process_group("gloo"):
        ddp = DecentralizedDataParallel(model, lambda n: O.optim_fn_adamw(n, lr=0.01), topology="complete")
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
        other = torch.nn.Linear(3, 3)
        other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
        x, y = batch(0, 0)
        loss_fn(ddp(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"AdamW.step\(\) would step parameter\(s\) '0.weight', '0.bias'.*"
                                               r"already stepped inside backward\(\).*ddp.allow_optimizer"):
            opt.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # refused before any change
        other(torch.ones(1, 3)).sum().backward()
        other_opt.step()  # parameters decentpy does not step
        ddp.allow_optimizer(opt)
        opt.step()  # on purpose: it steps (with the zero gradients it finds, AdamW's decay moves them)
        assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        fresh = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(RuntimeError, match="already stepped inside backward"):
            fresh.step()
        ddp.close()
        fresh.step()  # closed: the parameters are the user's again


def test_the_wrappers_own_torch_optimizer_is_not_refused() -> None:
    """optim_fn may return a torch optimizer (the generic path: decentpy calls its step() inside the
    backward): that step is the wrapper's own."""
    from decentpy import DecentralizedDataParallel

    model, ref = make_mlp(0), make_mlp(0)
    ref_opt = torch.optim.RMSprop(ref.parameters(), lr=0.01)
    with single_process_group("gloo"):
        ddp = DecentralizedDataParallel(model, lambda n: torch.optim.RMSprop([p for _, p in n], lr=0.01),
                                        topology="complete")
        for k in range(3):
            x, y = batch(0, k)
            loss_fn(ddp(x), y).backward()
            loss_fn(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        ddp.close()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
