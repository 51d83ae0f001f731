"""Fused optimizers used standalone: against torch.optim where they coincide, state_dict, LR
schedulers, weight-decay grouping of the optim_fn helpers, and the torch -> fused conversion."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from decentpy import optim as O
from reference import RefAccumAdam


def _model(dtype=torch.float32, channels_last=False) -> nn.Module:
    # No conv bias before BatchNorm: its gradient would be pure rounding noise, which Adam
    # normalises into lr-sized steps in arbitrary directions (fp32 and fp64 then disagree).
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    m = m.to(dtype)
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
    return m


def _loss(m: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 3, 6, 6, generator=g).to(next(m.parameters()).dtype)
    return m(x).float().pow(2).mean()


PAIRS = {
    "sgd": (lambda ps: O.SGD(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd_momentum": (lambda ps: O.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd_nesterov": (lambda ps: O.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam": (lambda ps: O.Adam(ps, lr=0.01, weight_decay=0.01),
             lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01)),
    "adamw": (lambda ps: O.AdamW(ps, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)),
    "accum_adam": (lambda ps: O.AccumAdam(ps, lr=0.01, weight_decay=0.01, accum_iter=3),
                   lambda ps: RefAccumAdam([{"params": list(ps), "weight_decay": 0.01}], 0.01, (0.9, 0.999), 1e-8,
                                           3, False)),
    "accum_adamw": (lambda ps: O.AccumAdamW(ps, lr=0.01, weight_decay=0.1, accum_iter=2),
                    lambda ps: RefAccumAdam([{"params": list(ps), "weight_decay": 0.1}], 0.01, (0.9, 0.999), 1e-8,
                                            2, True)),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_optimizer_matches_torch(name: str, channels_last: bool) -> None:
    fused_fn, ref_fn = PAIRS[name]
    m = _model(channels_last=channels_last)
    ref = copy.deepcopy(m).double()
    opt, ref_opt = fused_fn(m.parameters()), ref_fn(ref.parameters())
    for step in range(7):
        for model, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
    for (n, a), b in zip(m.named_parameters(), ref.parameters()):
        assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-5), f"{name}: '{n}' differs by {(a.double() - b).abs().max():.3g}"
        if channels_last and a.dim() == 4:
            assert a.is_contiguous(memory_format=torch.channels_last)


def test_bf16_parameters_use_fp32_state_and_track_fp32_training() -> None:
    m16, m32 = _model(torch.bfloat16), _model(torch.float32)
    o16, o32 = O.AdamW(m16.parameters(), lr=0.01), torch.optim.AdamW(m32.parameters(), lr=0.01)
    for step in range(5):
        for model, o in ((m16, o16), (m32, o32)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
    for p in m16.parameters():
        assert o16.state[p]["exp_avg"].dtype == torch.float32
    for a, b in zip(m16.parameters(), m32.parameters()):
        assert torch.allclose(a.float(), b, rtol=0.05, atol=0.02)


def test_state_dict_roundtrip_and_lr_scheduler() -> None:
    m = _model()
    opt = O.AdamW(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(3):
        opt.zero_grad()
        _loss(m, step).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    m2 = copy.deepcopy(m)
    opt2 = O.AdamW(m2.parameters(), lr=0.1)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for model, o in ((m, opt), (m2, opt2)):
        o.zero_grad()
        _loss(model, 9).backward()
        o.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_optim_fn_helpers_decay_weights_only() -> None:
    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    m.bn = nn.BatchNorm1d(2)
    named = list(m.named_parameters())
    opt = O.optim_fn_adamw(named, lr=0.1, weight_decay=0.3)
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in named:
        expect = 0.3 if name in ("0.weight", "2.weight") else 0.0
        assert wd[id(p)] == expect, f"'{name}' got weight decay {wd[id(p)]}, want {expect}"
    assert isinstance(opt, O.AdamW)
    assert isinstance(O.optim_fn_accum_adam(named), O.AccumAdam)
    assert isinstance(O.optim_fn_sgd(named), O.SGD)


def test_torch_optimizers_are_fused_only_when_equivalent() -> None:
    p = [nn.Parameter(torch.randn(3))]
    fused = O.fuse_torch_optimizer(torch.optim.AdamW(p, lr=0.3, weight_decay=0.2, betas=(0.5, 0.6)))
    assert type(fused) is O.AdamW and fused.param_groups[0]["lr"] == 0.3
    assert fused.param_groups[0]["betas"] == (0.5, 0.6)
    keep = torch.optim.Adam(p, amsgrad=True)
    assert O.fuse_torch_optimizer(keep) is keep
    other = torch.optim.RMSprop(p)
    assert O.fuse_torch_optimizer(other) is other


@pytest.mark.parametrize("kwargs,match", [({"lr": -1.0}, "learning rate"), ({"betas": (1.0, 0.9)}, "betas"),
                                          ({"accum_iter": 0}, "accum_iter")])
def test_bad_hyperparameters_name_the_value(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        O.AccumAdam([nn.Parameter(torch.zeros(2))], **kwargs)
