"""The fused outer step of local-steps training (csrc/kernels/outer_step.h, decentpy.optim.outer), one
process, against plain torch:
- ``outer_step`` through the kernel equals torch's own SGD (Nesterov, plain, weight decay), Adam and
  AdamW stepping the global copy to float32 rounding, its state included, for float32 and bfloat16
  parameters, from the global copy or a mixed one, with the parameters reset or merged (alpha);
- the pseudo-gradient's wire bytes (int8, int4, bf16) are the block-scaled codes a plain-torch
  float32 re-computation gives, and the error feedback telescopes: the wires' sum is the true sum
  plus the last excess, which stays within half a quantisation step;
- bad inputs raise with the name of the argument, and a custom optimizer takes torch's step; the
  window and compression rules (``LocalSteps.check``) of both faces of local steps;
- a weighted mean's buffer (``weigh`` / ``unweigh``) gives ``sum w d / sum w`` under a mix;
- on a GPU, the CUDA passes equal their CPU twins (skipped without one).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import pytest
import torch

from decentpy.optim import kernels
from decentpy.local_steps import LocalSteps, diloco_outer_optim
from decentpy.local_steps.exchange import unweigh, weigh
from decentpy.optim.outer import fused_outer_reason, outer_step, pseudo_gradient

C = kernels.Compressor
N = 3 * 256 + 37  # an odd tail block

OPTIMIZERS = {
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
    "sgd-wd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.0, weight_decay=0.1),
    "sgd-damp": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.8, dampening=0.3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.95), weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
}


def _torch_outer(opt: torch.optim.Optimizer, ref: torch.Tensor, start: torch.Tensor, delta: torch.Tensor) -> None:
    with torch.no_grad():
        ref.copy_(start)
    ref.grad = delta.clone()
    opt.step()
    ref.grad = None


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_outer_step_equals_torchs_optimizer(name: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(N, generator=g)
    x = (theta + 0.01 * torch.randn(N, generator=g)).to(dtype)
    opt = OPTIMIZERS[name]([theta])
    ref = theta.clone()
    ref_opt = OPTIMIZERS[name]([ref])
    for k in range(4):
        delta = 0.01 * torch.randn(N, generator=g)
        mix = theta + 1e-3 * torch.randn(N, generator=g) if k == 2 else None  # a gossip step's mixed copy
        alpha = 0.25 if k == 3 else 0.0
        local = x.float().clone()
        fused = outer_step(opt, [x], [theta], [delta], stepped=[theta], theta_mix=None if mix is None else [mix],
                           alpha=alpha)
        assert fused
        _torch_outer(ref_opt, ref, mix if mix is not None else ref, delta)
        torch.testing.assert_close(theta, ref, rtol=1e-6, atol=1e-6)
        want_x = (ref + alpha * (local - ref)).to(dtype)
        torch.testing.assert_close(x.float(), want_x.float(), rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-2)
    mine, theirs = opt.state_dict()["state"].get(0, {}), ref_opt.state_dict()["state"].get(0, {})
    assert mine.keys() == theirs.keys()
    for key in mine:
        torch.testing.assert_close(torch.as_tensor(mine[key]).float(), torch.as_tensor(theirs[key]).float(),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_outer_step_over_the_models_parameters_equals_torchs() -> None:
    """The torchft face's form: the optimizer holds the parameters themselves (stepped = params)."""
    g = torch.Generator().manual_seed(2)
    x, theta = torch.randn(N, generator=g), torch.randn(N, generator=g)
    delta = torch.randn(N, generator=g)
    opt = diloco_outer_optim([x])
    ref, ref_theta = x.clone(), theta.clone()
    ref_opt = diloco_outer_optim([ref])
    assert outer_step(opt, [x], [theta], [delta])
    _torch_outer(ref_opt, ref, ref_theta, delta)
    torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(theta, ref, rtol=1e-6, atol=1e-6)


def test_a_custom_outer_optimizer_takes_its_own_step() -> None:
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(N, generator=g)
    x = theta.clone()
    delta = torch.randn(N, generator=g)
    opt = torch.optim.RMSprop([theta], lr=0.01)
    assert fused_outer_reason(opt) is not None
    ref = theta.clone()
    ref_opt = torch.optim.RMSprop([ref], lr=0.01)
    assert not outer_step(opt, [x], [theta], [delta], stepped=[theta])
    _torch_outer(ref_opt, ref, ref, delta)
    assert torch.equal(theta, ref) and torch.equal(x, ref)
    with pytest.raises(ValueError, match="compressed outer exchange needs the fused outer step, and RMSprop"):
        wire = torch.empty(kernels.compressed_bytes(C.INT8, N), dtype=torch.uint8)
        outer_step(opt, [x], [theta], [wire], stepped=[theta], compressor=C.INT8)


def _codes_f32(kind: str, d: torch.Tensor) -> torch.Tensor:
    """D(Q(d)) re-computed in float32 with torch (scale amax / 127 or / 7, codes rounded half to even)."""
    if kind == "bf16":
        return d.to(torch.bfloat16).float()
    cmax = 127.0 if kind == "int8" else 7.0
    pad = (-d.numel()) % 256
    blocks = torch.cat([d, d.new_zeros(pad)]).view(-1, 256)
    s = blocks.abs().amax(dim=1, keepdim=True) / cmax
    codes = torch.where(s > 0, torch.round(blocks / torch.where(s > 0, s, torch.ones_like(s))).clamp(-cmax, cmax),
                        torch.zeros_like(blocks))
    return (codes * s).reshape(-1)[:d.numel()]


def _decode(kind: str, wire: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The documented wire layout (csrc/kernels/mix_and_step.h) read back with torch: code x scale in
    ``dtype`` (float64: the exact product)."""
    if kind == "bf16":
        return wire.view(torch.bfloat16).to(dtype)
    nb = -(-n // 256)
    scales = wire[:4 * nb].view(torch.float32).repeat_interleave(256)[:n]
    body = wire[4 * nb:]
    if kind == "int8":
        codes = body.view(torch.int8).float()[:n]
    else:
        lo = (body.to(torch.int16) << 12).to(torch.int16) >> 12
        hi = (body.to(torch.int16) << 8).to(torch.int16) >> 12
        codes = torch.stack([lo, hi], dim=1).reshape(-1)[:n].float()
    return codes.to(dtype) * scales.to(dtype)


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
def test_compressed_pseudo_gradient_and_its_error_feedback(kind: str) -> None:
    comp = {"int8": C.INT8, "int4": C.INT4, "bf16": C.BF16}[kind]
    g = torch.Generator().manual_seed(4)
    theta = torch.randn(N, generator=g)
    excess = torch.zeros(N)
    wire = torch.empty(kernels.compressed_bytes(comp, N), dtype=torch.uint8)
    sent = torch.zeros(N, dtype=torch.float64)
    true = torch.zeros(N, dtype=torch.float64)
    for k in range(6):
        x = theta - 0.01 * torch.randn(N, generator=g)
        d = (theta - x) - excess  # float32, as the kernel computes it
        pseudo_gradient(x, theta, wire, comp, excess)
        got = _decode(kind, wire, N)
        assert torch.equal(got, _codes_f32(kind, d)), f"step {k}: the wire is not Q(theta - x - excess)"
        # the excess D(q) - d, for block codes code * scale - d rounded once (a fused multiply-add)
        want = got - d if kind == "bf16" else (_decode(kind, wire, N, torch.float64) - d.double()).float()
        assert torch.equal(excess, want)
        sent += got.double()
        true += (theta - x).double()
    # telescoping: sum D(q) = sum (theta - x) + the last excess, which is at most half a step
    torch.testing.assert_close(sent, true + excess.double(), rtol=0, atol=1e-5)
    step = {"int8": 0.04 / 127, "int4": 0.04 / 7, "bf16": 0.04 * 2 ** -8}[kind]
    assert excess.abs().max().item() <= step, excess.abs().max().item()


def test_the_plain_pseudo_gradient() -> None:
    g = torch.Generator().manual_seed(5)
    theta, x = torch.randn(N, generator=g), torch.randn(N, generator=g).to(torch.bfloat16)
    out = torch.empty(N)
    pseudo_gradient(x, theta, out)
    assert torch.equal(out, theta - x.float())


def test_bad_inputs_name_the_argument() -> None:
    x, theta, out = torch.zeros(N), torch.zeros(N), torch.zeros(N)
    cases: List[Callable[[], None]] = [
        lambda: pseudo_gradient(x, theta.double(), out),
        lambda: pseudo_gradient(x, theta, torch.zeros(N - 1)),
        lambda: pseudo_gradient(x, theta, torch.empty(7, dtype=torch.uint8), C.INT8, torch.zeros(N)),
        lambda: pseudo_gradient(x, theta, torch.empty(kernels.compressed_bytes(C.INT8, N), dtype=torch.uint8), C.INT8),
        lambda: kernels.outer_apply(x, theta, out, kernels.OptKind.SGD, kernels.GroupHyper(lr=0.1, momentum=0.9), []),
        lambda: kernels.outer_apply(x, theta, out, kernels.OptKind.ADAM, kernels.GroupHyper(lr=0.1), []),
        lambda: kernels.outer_apply(x, theta, out, kernels.OptKind.SGD, kernels.GroupHyper(lr=0.1), [], alpha=2.0),
        lambda: kernels.outer_apply(x, x, out, kernels.OptKind.SGD, kernels.GroupHyper(lr=0.1), []),
    ]
    want = ["theta must be a float32 tensor", "out has", "out has 7 bytes", "a compressor needs excess",
            "with momentum takes [momentum_buffer]", "Adam takes [exp_avg, exp_avg_sq]", "alpha must be in [0, 1]",
            "theta must not share memory with param"]
    for case, text in zip(cases, want):
        with pytest.raises(RuntimeError, match=None) as info:
            case()
        assert text in str(info.value), (text, str(info.value))
    with pytest.raises(ValueError, match="alpha must be in"):
        outer_step(torch.optim.SGD([theta], lr=0.1), [x], [theta], [out], stepped=[theta], alpha=-1.0)


@pytest.mark.parametrize("kw, text", [
    (dict(sync_every=4, sync_every_s=2.0), "give local_steps (inner steps) or sync_every_s (seconds), not both"),
    (dict(sync_every_s=0.0), "number of seconds > 0, got 0.0"),
    (dict(sync_every_s=True), "got True"),
    (dict(sync_every_s=float("nan")), "got nan"),
    (dict(), "local_steps must be an int >= 1 (inner steps per outer step), got None (or give sync_every_s"),
    (dict(sync_every=True), "got True"),
    (dict(sync_every=8, fragments=3), "local_steps=8 must be a multiple of the number of fragments (3)"),
    (dict(sync_every=8, fragments=2, fragment_sync_delay=4), "fragment_sync_delay must be an int in [0, 4)"),
    (dict(sync_every=8, fragment_update_alpha=1.5), "fragment_update_alpha must be in [0, 1], got 1.5"),
    (dict(sync_every_s=3.0, fragments=2), "sync_every_s (a time budget) runs one fragment"),
    (dict(sync_every=8, fragments=0), "fragments must be an int >= 1, got 0"),
])
def test_window_rules(kw: dict, text: str) -> None:
    with pytest.raises(ValueError) as info:
        LocalSteps(**kw).check("local_steps")
    assert text in str(info.value), str(info.value)


def test_window_rules_accept_what_is_valid() -> None:
    assert LocalSteps(sync_every=8).check("local_steps") == 8
    assert LocalSteps(sync_every=8, fragments=4, fragment_sync_delay=1).check() == 2
    assert LocalSteps(sync_every_s=3).check() == 0
    with pytest.raises(TypeError, match="outer_optim must be callable"):
        LocalSteps(sync_every=2, outer_optim=3).check()  # type: ignore[arg-type]


def test_a_weighted_buffer_mixes_to_the_weighted_mean() -> None:
    """Three members' buffers [theta; w d; w] mixed with weights W (as a plan's mix does): the body
    becomes sum W_j w_j d_j / sum W_j w_j, the part before it the plain mix."""
    g = torch.Generator().manual_seed(3)
    n, mix = 5, torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    thetas, deltas, ws = torch.randn(3, n, generator=g), torch.randn(3, n, generator=g), [3.0, 1.0, 0.0]
    bufs = []
    for theta, d, w in zip(thetas, deltas, ws):
        buf = torch.cat([theta, d, torch.zeros(1)])
        weigh(buf[n:2 * n], buf[-1:], w)
        bufs.append(buf)
    mixed = sum(m.item() * b for m, b in zip(mix, bufs))
    out = unweigh(mixed, n)
    w64 = torch.tensor(ws, dtype=torch.float64) * mix
    want = (w64[:, None] * deltas.double()).sum(0) / w64.sum()
    torch.testing.assert_close(out[n:].double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:n].double(), (mix[:, None] * thetas.double()).sum(0), rtol=1e-6, atol=1e-6)
    assert out.numel() == 2 * n
    zero = torch.zeros(n + 1)  # nobody stepped: no move, no NaN
    assert torch.equal(unweigh(zero, n), torch.zeros(n))


def _cuda_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not kernels.build_info().get("cuda_kernels"):
        pytest.skip("decentpy was built without its CUDA kernels")


@pytest.mark.parametrize("kind", ["none", "int8", "int4", "bf16"])
def test_cuda_passes_equal_their_cpu_twins(kind: str) -> None:
    _cuda_or_skip()
    for dtype in (torch.float32, torch.bfloat16):
        _cuda_twin(kind, dtype)


def _cuda_twin(kind: str, dtype: torch.dtype) -> None:
    comp: Optional["kernels.Compressor"] = {"none": None, "int8": C.INT8, "int4": C.INT4, "bf16": C.BF16}[kind]
    g = torch.Generator().manual_seed(6)
    n = 1 << 16 | 37
    theta = torch.randn(n, generator=g)
    x = (theta - 0.01 * torch.randn(n, generator=g)).to(dtype)
    excess = 1e-4 * torch.randn(n, generator=g) if comp is not None else None
    size = kernels.compressed_bytes(comp, n) if comp is not None else 4 * n
    out = torch.empty(size, dtype=torch.uint8) if comp is not None else torch.empty(n)
    dev = torch.device("cuda")
    x_d, theta_d = x.to(dev), theta.to(dev)
    excess_d = excess.to(dev) if excess is not None else None
    out_d = torch.empty_like(out, device=dev)
    pseudo_gradient(x, theta, out, comp, excess)
    pseudo_gradient(x_d, theta_d, out_d, comp, excess_d)
    assert torch.equal(out_d.cpu(), out)
    if excess is not None:
        assert torch.equal(excess_d.cpu(), excess)
    mom = torch.randn(n, generator=g)
    mom_d = mom.to(dev)
    hyper = kernels.GroupHyper(lr=0.7, momentum=0.9, nesterov=1)
    kernels.outer_apply(x, theta, out, kernels.OptKind.SGD, hyper, [mom], compressor=comp, alpha=0.5)
    kernels.outer_apply(x_d, theta_d, out_d, kernels.OptKind.SGD, hyper, [mom_d], compressor=comp, alpha=0.5)
    torch.cuda.synchronize()
    assert torch.equal(theta_d.cpu(), theta) and torch.equal(mom_d.cpu(), mom) and torch.equal(x_d.cpu(), x)
