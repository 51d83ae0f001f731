"""CPU fused mix-and-step kernel against a float64 PyTorch re-computation of the equations in
csrc/kernels/mix_and_step.h (never against the extension itself)."""
import math
import os
import platform
import subprocess
import sys

import pytest
import torch


from decentpy import _C
from reference import GRAD_NORM_CASES, SKIP_NORM_CASES, grad_factor64


NONE, SGD, ADAM, ACCUM = _C.OptKind.NONE, _C.OptKind.SGD, _C.OptKind.ADAM, _C.OptKind.ACCUM_ADAM
KIND_NAMES = {NONE: "none", SGD: "sgd", ADAM: "adam", ACCUM: "accumadam"}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def f32(x):
    """The float32 value the kernel sees for a scalar argument."""
    return float(torch.tensor(x, dtype=torch.float32))


def group(lr=0.01, wd=0.0, momentum=0.0, dampening=0.0, nesterov=False, beta1=0.9,
          beta2=0.999, eps=1e-8, step=1, accum_iter=1):
    """One parameter group's hyper-parameters (the kernel derives the bias corrections from the
    1-based ``step``)."""
    return _C.GroupHyper(lr=lr, weight_decay=wd, momentum=momentum, dampening=dampening,
                         nesterov=nesterov, beta1=beta1, beta2=beta2, eps=eps, bias_step=step,
                         accum_iter=accum_iter)



def reference(kind, p, g, states, c, want_send, segs, groups, a, b, s, gs, decoupled, init,
              boundary, skip):
    """float64 re-computation. Returns (param64, [states64], send64 or None).

    ``groups`` are GroupHyper (their fields are the float32 values the kernel reads); the bias
    corrections are derived from ``bias_step`` in float64, as the kernel derives them."""
    P = p.double().clone()
    S = [t.double().clone() for t in states]
    if c is not None:
        P = f32(a) * P + f32(b) * c.double()
    if kind != NONE and not skip:
        G = g.double() * f32(gs)
        for lo, hi, gi in segs:
            h = groups[gi]
            lr, wd, mom, damp, nest = h.lr, h.weight_decay, h.momentum, h.dampening, h.nesterov
            b1, b2, eps = h.beta1, h.beta2, h.eps
            bc1 = 1 - b1 ** h.bias_step
            bc2 = math.sqrt(1 - b2 ** h.bias_step)
            accs = 1.0 / h.accum_iter
            x = P[lo:hi].clone()
            gg = G[lo:hi].clone()
            if kind == SGD:
                gg = gg + wd * x
                if S and mom != 0:
                    buf = gg.clone() if init else mom * S[0][lo:hi] + (1 - damp) * gg
                    S[0][lo:hi] = buf
                    gg = gg + mom * buf if nest else buf
                x = x - lr * gg
            else:
                if decoupled:
                    x = x * (1 - lr * wd)
                else:
                    gg = gg + wd * x
                M, V = S[0][lo:hi], S[1][lo:hi]
                if kind == ADAM:
                    M = b1 * M + (1 - b1) * gg
                    V = b2 * V + (1 - b2) * gg * gg
                    S[0][lo:hi], S[1][lo:hi] = M, V
                    mt, vt = M, V
                else:
                    acc = S[2][lo:hi] + accs * gg
                    mt = b1 * M + (1 - b1) * gg
                    vt = b2 * V + (1 - b2) * gg * gg
                    if boundary:
                        S[0][lo:hi] = b1 * M + (1 - b1) * acc
                        S[1][lo:hi] = b2 * V + (1 - b2) * acc * acc
                        acc = torch.zeros_like(acc)
                    S[2][lo:hi] = acc
                x = x - (lr / bc1) * mt / (vt.sqrt() / bc2 + eps)
            P[lo:hi] = x
    send = f32(s) * P.to(p.dtype).double() if want_send else None  # s * p as stored
    return P, S, send


def n_states(kind, momentum):
    return {NONE: 0, SGD: 1 if momentum else 0, ADAM: 2, ACCUM: 3}[kind]


def make_segments(n, ngroups):
    """Several uneven segments cycling through the groups (boundaries not vector-aligned)."""
    if n == 0:
        return []
    cuts = sorted({0, n} | {max(1, min(n - 1, int(n * f))) for f in (0.13, 0.5, 0.51, 0.77)}
                  if n > 2 else {0, n})
    return [(cuts[i], cuts[i + 1], i % ngroups) for i in range(len(cuts) - 1)]


def seg_tensor(segs):
    if not segs:
        return torch.zeros(0, 3, dtype=torch.int64)
    return torch.tensor(segs, dtype=torch.int64)


def ulp_tol(dtype):
    # (rtol, atol) for comparing against the reference rounded to the storage dtype (~2 ulp).
    if dtype == torch.float32:
        return 2e-6, 1e-6
    if dtype == torch.bfloat16:
        return 2 * 2.0 ** -8, 1e-5
    return 2 * 2.0 ** -11, 1e-5


def run_case(kind, dtype, n, comm_mode="none", momentum=0.9, nesterov=False, dampening=0.0,
             init=False, decoupled=False, boundary=False, skip=False, grad_scale=1.0, wd=0.01,
             ngroups=3, seed=0, mix=(0.6, 0.4), send_scale=1.0, zero_grad=False, nan_grad=False,
             grad_norm=None, scaler_scale=None, clip_norm=0.0):
    """comm_mode: none | comm | send | comm+send | alias (send is the comm buffer).

    zero_grad: run the kernel with zero_grad=True as well and check that it leaves grad exactly
    zero and gives bit-identical param / states / send to zero_grad=False. nan_grad: poison some
    gradients with nan / inf (with skip=True: the non-finite step that is skipped).

    grad_norm (a float): pass it (and scaler_scale, a float or None, and clip_norm) to the kernel
    as one-element tensors, so the kernel derives the gradient factor and the skip itself; the
    reference gets grad_factor64's (factor, skip) instead (grad_scale must then be 1).

    Returns the kernel's (param, grad, states, comm, send)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(scale=1.0, positive=False):
        t = torch.randn(n, generator=gen, dtype=torch.float64) * scale
        return t.abs() if positive else t

    p = rnd().to(dtype)
    g = rnd(0.5).to(dtype)
    if nan_grad and n:
        g[::7] = float("nan")
        g[3::11] = float("inf")
    states = []
    ns = n_states(kind, momentum)
    if kind == SGD and ns:
        states = [rnd(0.1).float()]
    elif kind in (ADAM, ACCUM):
        states = [rnd(0.1).float(), rnd(0.01, positive=True).float()]
        if kind == ACCUM:
            states.append(rnd(0.2).float())
    c = rnd().to(dtype) if comm_mode in ("comm", "comm+send", "alias") else None
    want_send = comm_mode in ("send", "comm+send", "alias")
    groups = [
        group(lr=0.1, wd=wd, momentum=momentum, dampening=dampening, nesterov=nesterov,
              step=3, accum_iter=4),
        group(lr=0.03, wd=0.0, momentum=momentum * 0.5, dampening=0.1, nesterov=not nesterov,
              beta1=0.8, beta2=0.99, eps=1e-6, step=1, accum_iter=2),
        group(lr=0.2, wd=wd * 10, momentum=momentum, nesterov=nesterov, beta1=0.95,
              beta2=0.9, eps=1e-3, step=10, accum_iter=1),
    ][:ngroups]
    if kind == SGD and not ns:
        for h in groups:
            h.momentum = 0.0
    segs = make_segments(n, len(groups))
    a, b = mix

    norm_t = scale_t = None
    ref_gs, ref_skip = grad_scale, skip
    if grad_norm is not None:
        assert grad_scale == 1.0, "with grad_norm the kernel derives the factor"
        norm_t = torch.tensor([grad_norm], dtype=torch.float32)
        scale_t = torch.tensor([scaler_scale], dtype=torch.float32) if scaler_scale is not None else None
        factor, norm_skip = grad_factor64(grad_norm, 1.0 if scaler_scale is None else scaler_scale,
                                          clip_norm)
        ref_gs, ref_skip = factor, skip or norm_skip
    P_ref, S_ref, send_ref = reference(kind, p, g, states, c, want_send, segs, groups, a, b,
                                       send_scale, ref_gs, decoupled, init, boundary, ref_skip)

    def launch(zg):
        p_k = p.clone()
        g_k = g.clone()
        st_k = [t.clone() for t in states]
        c_k = c.clone() if c is not None else None
        if comm_mode == "alias":
            send_k = c_k
        elif want_send:
            send_k = torch.full((n,), float("nan"), dtype=dtype)
        else:
            send_k = None
        _C.mix_and_step(kind=kind, param=p_k, grad=g_k, states=st_k, comm=c_k, send=send_k,
                        segments=seg_tensor(segs), groups=groups, mix_a=a, mix_b=b,
                        send_scale=send_scale, grad_scale=grad_scale, grad_norm=norm_t,
                        scaler_scale=scale_t, clip_norm=clip_norm, decoupled_weight_decay=decoupled,
                        momentum_init=init, accum_boundary=boundary, skip_update=skip, zero_grad=zg)
        return p_k, g_k, st_k, c_k, send_k

    p_k, g_k, st_k, c_k, send_k = launch(False)
    assert torch.equal(g_k.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       g.view(torch.int16 if dtype != torch.float32 else torch.int32)), \
        "grad must not be written without zero_grad"
    if zero_grad:
        zp, zg_, zst, zc, zsend = launch(True)
        assert torch.equal(zg_, torch.zeros_like(zg_)), "zero_grad must leave grad exactly zero"
        assert not torch.signbit(zg_).any(), "zero_grad must store +0"
        assert torch.equal(zp, p_k), "zero_grad changed param"
        for i, (s0, s1) in enumerate(zip(zst, st_k)):
            assert torch.equal(s0, s1), f"zero_grad changed state {i}"
        if want_send:
            assert torch.equal(zsend, send_k), "zero_grad changed send"
        if c is not None:
            assert torch.equal(zc, c_k), "zero_grad changed comm"
        p_k, st_k, c_k, send_k = zp, zst, zc, zsend

    rtol, atol = ulp_tol(dtype)
    torch.testing.assert_close(p_k.double(), P_ref.to(dtype).double(), rtol=rtol, atol=atol,
                               msg=lambda m: f"param mismatch: {m}")
    for i, (sk, sr) in enumerate(zip(st_k, S_ref)):
        torch.testing.assert_close(sk.double(), sr.float().double(), rtol=2e-6, atol=1e-7,
                                   msg=lambda m, i=i: f"state {i} mismatch: {m}")
    if want_send:
        torch.testing.assert_close(send_k.double(), send_ref.to(dtype).double(), rtol=rtol,
                                   atol=atol, msg=lambda m: f"send mismatch: {m}")
        if send_scale == 1.0:
            assert torch.equal(send_k, p_k), "send must equal the stored parameter when s = 1"
    elif c_k is not None:
        assert torch.equal(c_k, c), "comm must not be written when send is None"
    if ref_skip:
        for i, (sk, s0) in enumerate(zip(st_k, states)):
            assert torch.equal(sk, s0), f"a skipped update changed state {i}"
    return p_k, g_k, st_k, c_k, send_k


COMM_MODES = ["none", "comm", "send", "comm+send", "alias"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("comm_mode", COMM_MODES)
@pytest.mark.parametrize("kind", [NONE, SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
def test_kinds_dtypes_comm(kind, dtype, comm_mode):
    run_case(kind, dtype, 1000, comm_mode=comm_mode, decoupled=(kind == ADAM), boundary=True,
             send_scale=0.5 if comm_mode == "comm+send" else 1.0)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("dampening", [0.0, 0.3])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgd_flags(nesterov, dampening, init, dtype):
    run_case(SGD, dtype, 777, comm_mode="comm", nesterov=nesterov, dampening=dampening, init=init)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_sgd_no_momentum(dtype):
    run_case(SGD, dtype, 515, comm_mode="comm+send", momentum=0.0)


@pytest.mark.parametrize("kind", [ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("boundary", [False, True])
def test_adam_weight_decay_and_boundary(kind, decoupled, boundary):
    run_case(kind, torch.float32, 1001, comm_mode="alias", decoupled=decoupled, boundary=boundary)


@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_skip_update(kind, dtype):
    # Mix and send only: param = a p + b c, states untouched, grad may even be None.
    run_case(kind, dtype, 333, comm_mode="comm+send", skip=True)
    n = 100
    p = torch.randn(n).to(dtype)
    c = torch.randn(n).to(dtype)
    states = [torch.randn(n) for _ in range(n_states(kind, True))]
    before = [s.clone() for s in states]
    p0 = p.clone()
    _C.mix_and_step(kind=kind, param=p, grad=None, states=states, comm=c, send=None,
                    segments=seg_tensor([(0, n, 0)]), groups=[group()], mix_a=0.5, mix_b=0.5,
                    send_scale=1.0, grad_scale=1.0, decoupled_weight_decay=False,
                    momentum_init=False, accum_boundary=True, skip_update=True)
    for s0, s1 in zip(before, states):
        assert torch.equal(s0, s1)
    rtol, atol = ulp_tol(dtype)
    torch.testing.assert_close(p.double(), (0.5 * p0.double() + 0.5 * c.double()).to(dtype).double(),
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
def test_grad_scale(kind):
    run_case(kind, torch.float32, 640, comm_mode="comm", grad_scale=0.125, boundary=True)


@pytest.mark.parametrize("n", [1, 7, 15, 17, 33, 1000003])
@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
def test_odd_sizes(n, kind):
    dtype = torch.float32 if n < 1000 else (torch.bfloat16 if kind == ADAM else torch.float32)
    run_case(kind, dtype, n, comm_mode="comm+send", boundary=(kind == ACCUM), decoupled=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [1, 9, 31, 1000003])
def test_odd_sizes_half(dtype, n):
    run_case(ADAM, dtype, n, comm_mode="alias", decoupled=True)


def test_single_segment_and_group():
    run_case(ADAM, torch.float32, 4099, comm_mode="comm", ngroups=1)


def test_many_threads_segments_cross_chunks():
    # Segments much smaller than the parallel grain and chunks crossing them.
    n = 200_003
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    st = [torch.zeros(n), torch.zeros(n)]
    bounds = list(range(0, n, 997)) + [n]
    segs = [(bounds[i], bounds[i + 1], i % 8) for i in range(len(bounds) - 1)]
    groups = [group(lr=0.001 * (i + 1), wd=0.01 * i) for i in range(_C.MAX_GROUPS)]
    P_ref, S_ref, _ = reference(ADAM, p, g, st, None, False, segs, groups, 1, 0, 1, 1, True, False,
                                False, False)
    pk = p.clone()
    _C.mix_and_step(kind=ADAM, param=pk, grad=g, states=st, segments=seg_tensor(segs),
                    groups=groups, mix_a=1.0, mix_b=0.0, send_scale=1.0, grad_scale=1.0,
                    decoupled_weight_decay=True)
    torch.testing.assert_close(pk.double(), P_ref.float().double(), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(st[1].double(), S_ref[1].float().double(), rtol=2e-6, atol=1e-9)


def test_numel_zero():
    p = torch.zeros(0)
    _C.mix_and_step(kind=ADAM, param=p, grad=torch.zeros(0), states=[torch.zeros(0), torch.zeros(0)],
                    comm=None, send=None, segments=torch.zeros(0, 3, dtype=torch.int64),
                    groups=[group()], mix_a=1.0, mix_b=0.0, send_scale=1.0, grad_scale=1.0)


def test_none_kind_no_segments():
    p = torch.randn(100)
    c = torch.randn(100)
    ref = 0.25 * p.double() + 0.75 * c.double()
    _C.mix_and_step(kind=NONE, param=p, grad=None, states=[], comm=c, send=None,
                    segments=torch.zeros(0, 3, dtype=torch.int64), groups=[], mix_a=0.25,
                    mix_b=0.75, send_scale=1.0, grad_scale=1.0)
    torch.testing.assert_close(p.double(), ref.float().double(), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [1, 13, 100_001])
def test_scale_copy(dtype, n):
    src = torch.randn(n).to(dtype)
    dst = torch.empty(n, dtype=dtype)
    _C.scale_copy_(dst, src, 0.3)
    rtol, atol = ulp_tol(dtype)
    torch.testing.assert_close(dst.double(), (f32(0.3) * src.double()).to(dtype).double(),
                               rtol=rtol, atol=atol)
    # in place
    x = src.clone()
    _C.scale_copy_(x, x, 2.0)
    assert torch.equal(x, (src.double() * 2).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [0, 1, 13, 100_001, 40_000_003])
def test_scale_copy_sumsq(dtype, n):
    """The copy also writes partial sums of the squares of src: their sum is its squared norm
    (against float64), every slot written (poisoned before), and the same bits on a second run."""
    src = (torch.randn(n) * 3).to(dtype)
    dst = torch.full((n,), float("nan"), dtype=dtype)
    sumsq = torch.full((_C.NORM_SLOTS,), float("nan"))
    _C.scale_copy_(dst, src, 1.0, sumsq)
    assert torch.equal(dst, src)
    assert torch.isfinite(sumsq).all()
    ref = src.double().square().sum()
    torch.testing.assert_close(sumsq.double().sum(), ref, rtol=1e-5, atol=1e-6)
    again = torch.full_like(sumsq, float("nan"))
    _C.scale_copy_(torch.empty_like(src), src, 1.0, again)
    assert torch.equal(again, sumsq)


def test_scale_copy_sumsq_not_finite():
    src = torch.randn(1000)
    for bad in (float("inf"), float("nan")):
        src[517] = bad
        sumsq = torch.zeros(_C.NORM_SLOTS)
        _C.scale_copy_(torch.empty_like(src), src, 1.0, sumsq)
        assert not torch.isfinite(sumsq.sum())


def test_mix_preserves_mean_of_pair():
    # Two workers averaging (w = 1/2) get exactly equal results, so the mean is kept.
    n = 4097
    x = torch.randn(n)
    y = torch.randn(n)
    xa, ya = x.clone(), y.clone()
    seg = torch.zeros(0, 3, dtype=torch.int64)
    _C.mix_and_step(kind=NONE, param=xa, comm=y.clone(), segments=seg, mix_a=0.5, mix_b=0.5)
    _C.mix_and_step(kind=NONE, param=ya, comm=x.clone(), segments=seg, mix_a=0.5, mix_b=0.5)
    assert torch.equal(xa, ya)


def test_build_info():
    info = _C.build_info()
    for key in ("cpu_kernels", "cuda_kernels", "cuda_archs", "nccl", "openmp",
                "vector_width_fp32", "compiler"):
        assert key in info
    assert info["cpu_kernels"] is True
    assert info["vector_width_fp32"] in (4, 8, 16, 32)
    assert isinstance(info["cuda_archs"], str)


def test_matches_torch_adamw_one_step():
    # Cross-check the conventions (bias corrections, eps placement) with torch.optim.AdamW.
    n = 1000
    p = torch.randn(n)
    g = torch.randn(n)
    tp = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([tp], lr=1e-2, weight_decay=0.1, foreach=False)
    tp.grad = g.clone()
    opt.step()
    st = [torch.zeros(n), torch.zeros(n)]
    pk = p.clone()
    _C.mix_and_step(kind=ADAM, param=pk, grad=g, states=st, segments=seg_tensor([(0, n, 0)]),
                    groups=[group(lr=1e-2, wd=0.1, step=1)], mix_a=1.0, mix_b=0.0,
                    send_scale=1.0, grad_scale=1.0, decoupled_weight_decay=True)
    torch.testing.assert_close(pk, tp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st[0], opt.state[tp]["exp_avg"])
    torch.testing.assert_close(st[1], opt.state[tp]["exp_avg_sq"])


@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_no_update_group_is_mixed_and_sent_only(kind, dtype):
    """Elements of a group with no_update (parameters without a gradient) are mixed and sent, their
    gradient zeroed, but neither the parameter nor the state is updated; the other elements equal
    a pass over them alone."""
    n, cut = 1003, 517
    torch.manual_seed(1)
    p, c, g = (torch.randn(n).to(dtype) for _ in range(3))
    states = [torch.rand(n) * 0.1 for _ in range(n_states(kind, True))]
    frozen = group(lr=0.05, wd=0.1, momentum=0.9, step=3, accum_iter=2)
    frozen.no_update = True
    kw = dict(kind=kind, mix_a=0.25, mix_b=0.75, send_scale=1.0, decoupled_weight_decay=True, accum_boundary=True)
    pk, gk, sk, send = p.clone(), g.clone(), [s.clone() for s in states], torch.empty(n, dtype=dtype)
    _C.mix_and_step(param=pk, grad=gk, states=sk, comm=c, send=send, zero_grad=True,
                    segments=seg_tensor([(0, cut, 0), (cut, n, 1)]),
                    groups=[group(lr=0.05, wd=0.1, momentum=0.9, step=3, accum_iter=2), frozen], **kw)
    # the first part against the same pass over it alone
    pa, sa = p[:cut].clone(), [s[:cut].clone() for s in states]
    _C.mix_and_step(param=pa, grad=g[:cut].clone(), states=sa, comm=c[:cut], segments=seg_tensor([(0, cut, 0)]),
                    groups=[group(lr=0.05, wd=0.1, momentum=0.9, step=3, accum_iter=2)], **kw)
    assert torch.equal(pk[:cut], pa) and all(torch.equal(a[:cut], b) for a, b in zip(sk, sa))
    # the rest: mixed only, state untouched, gradient zeroed, send = p as stored
    mixed = (0.25 * p[cut:].double() + 0.75 * c[cut:].double()).to(dtype)
    torch.testing.assert_close(pk[cut:].double(), mixed.double(), rtol=1e-2 if dtype != torch.float32 else 1e-6,
                               atol=1e-3 if dtype != torch.float32 else 1e-7)
    assert all(torch.equal(a[cut:], b[cut:]) for a, b in zip(sk, states))
    assert not gk.any() and torch.equal(send, pk)


@pytest.mark.parametrize("decoupled", [False, True])
def test_deferred_verdict_picks_the_bias_step(decoupled):
    """prev_skip (a flag the kernel reads): false -> the groups' own bias steps, true -> the
    alternative ones; each run equals torch's Adam/AdamW after that many steps' worth of bias
    correction (same state, same gradient)."""
    n = 1000
    p, g = torch.randn(n), torch.randn(n)
    m0, v0 = torch.randn(n) * 0.1, torch.rand(n) * 0.01
    for flag, k in ((False, 5), (True, 4)):
        tp = torch.nn.Parameter(p.clone())
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        opt = cls([tp], lr=1e-2, weight_decay=0.1, foreach=False)
        opt.state[tp] = {"step": torch.tensor(float(k - 1)), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
        tp.grad = g.clone()
        opt.step()
        st, pk = [m0.clone(), v0.clone()], p.clone()
        _C.mix_and_step(kind=ADAM, param=pk, grad=g, states=st, segments=seg_tensor([(0, n, 0)]),
                        groups=[group(lr=1e-2, wd=0.1, step=5)], decoupled_weight_decay=decoupled,
                        prev_skip=torch.tensor([flag]), alt_bias_steps=[4])
        torch.testing.assert_close(pk, tp.detach(), rtol=1e-5, atol=1e-6, msg=f"prev_skip={flag}")


def test_deferred_verdict_bad_inputs():
    _refuses(lambda kw: None, r"prev_skip needs one alt_bias_steps entry per parameter group: 1 groups, got 0",
             prev_skip=torch.tensor([False]))
    _refuses(lambda kw: None, r"alt_bias_steps is only read together with prev_skip", alt_bias_steps=[3])
    _refuses(lambda kw: None, r"prev_skip must be a one-element bool or uint8 tensor, got Float",
             prev_skip=torch.zeros(1), alt_bias_steps=[1])
    _refuses(lambda kw: None, r"alt_bias_steps\[0\] is 0; bias-correction steps are 1-based",
             prev_skip=torch.tensor([True]), alt_bias_steps=[0])


# ---- gradient factor read from memory: grad_norm / scaler_scale / clip_norm ------------------



@pytest.mark.parametrize("case", list(GRAD_NORM_CASES) + list(SKIP_NORM_CASES))
def test_grad_factor_rule_matches_float64(case):
    # The host binding applies the same rule as the kernels: against the float64 formula here.
    norm, scale, clip = {**GRAD_NORM_CASES, **SKIP_NORM_CASES}[case]
    want, want_skip = grad_factor64(norm, 1.0 if scale is None else scale, clip)
    got, skip = _C.grad_factor(norm, 1.0 if scale is None else scale, clip)
    assert skip == want_skip == (case in SKIP_NORM_CASES)
    if not skip:
        assert got == pytest.approx(want, rel=1e-6, abs=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", list(GRAD_NORM_CASES))
@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
def test_device_grad_factor(kind, case, dtype):
    # grad_norm / scaler_scale as one-element tensors: the kernel derives the factor itself. Against
    # the reference with grad_scale = the factor computed in float64 here.
    norm, scale, clip = GRAD_NORM_CASES[case]
    run_case(kind, dtype, 1000, comm_mode="comm+send", grad_norm=norm, scaler_scale=scale,
             clip_norm=clip, decoupled=(kind == ADAM), boundary=True, send_scale=0.5,
             zero_grad=True)
    run_case(kind, dtype, 17, comm_mode="alias", grad_norm=norm, scaler_scale=scale,
             clip_norm=clip, decoupled=True, seed=17)


@pytest.mark.parametrize("case", list(GRAD_NORM_CASES))
@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
def test_device_grad_factor_equals_host_factor(kind, case):
    # The factor read from memory and the same factor passed as grad_scale (from the host binding
    # of the same rule) give bit-identical results.
    norm, scale, clip = GRAD_NORM_CASES[case]
    factor, skip = _C.grad_factor(norm, 1.0 if scale is None else scale, clip)
    assert not skip
    outs = []
    for device_read in (True, False):
        kw = _good(n=1001, kind=kind)
        kw["states"] = [torch.full((1001,), 0.01) for _ in kw["states"]]
        kw["comm"] = torch.randn(1001, generator=torch.Generator().manual_seed(4))
        kw.update(mix_a=0.5, mix_b=0.5)
        torch.manual_seed(5)
        kw["param"] = torch.randn(1001)
        kw["grad"] = torch.randn(1001) * 100
        if device_read:
            kw.update(grad_norm=torch.tensor([norm]),
                      scaler_scale=None if scale is None else torch.tensor([scale]), clip_norm=clip)
        else:
            kw.update(grad_scale=factor)
        _call(**kw)
        outs.append([kw["param"]] + kw["states"])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("comm_mode", ["comm+send", "alias", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", list(SKIP_NORM_CASES))
@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
def test_device_grad_factor_non_finite_skips(kind, case, dtype, comm_mode):
    # A non-finite unscaled norm skips the update (states untouched) but still mixes, sends and
    # zeroes grad: against the reference with skip=True (run_case derives it from grad_factor64).
    norm, scale, clip = SKIP_NORM_CASES[case]
    assert grad_factor64(norm, 1.0 if scale is None else scale, clip)[1]
    for n in (5, 333):
        run_case(kind, dtype, n, comm_mode=comm_mode, grad_norm=norm, scaler_scale=scale,
                 clip_norm=clip, boundary=True, decoupled=(kind != SGD), zero_grad=True,
                 nan_grad=(case != "overflow"), seed=n)


def test_device_grad_factor_bad_inputs():
    norm = torch.tensor([1.0])
    _refuses(lambda kw: kw.update(scaler_scale=torch.tensor([2.0])),
             r"scaler_scale is only read together with grad_norm")
    _refuses(lambda kw: kw.update(grad_norm=norm, grad_scale=0.5),
             r"with grad_norm the kernel derives the gradient factor itself; grad_scale must be 1")
    _refuses(lambda kw: kw.update(grad_norm=torch.tensor([1.0], dtype=torch.float64)),
             r"grad_norm must be a one-element float32 tensor")
    _refuses(lambda kw: kw.update(grad_norm=torch.ones(2)),
             r"grad_norm must be a one-element float32 tensor")
    _refuses(lambda kw: kw.update(grad_norm=norm, scaler_scale=torch.ones(1, 1, dtype=torch.half)),
             r"scaler_scale must be a one-element float32 tensor")
    _refuses(lambda kw: kw.update(grad_norm=norm, clip_norm=-1.0), r"clip_norm must be >= 0")


# ---- zero_grad: the gradient is zeroed in the same pass ---------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("comm_mode", COMM_MODES)
@pytest.mark.parametrize("kind", [NONE, SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
def test_zero_grad_kinds_dtypes(kind, dtype, comm_mode):
    run_case(kind, dtype, 1000, comm_mode=comm_mode, decoupled=(kind == ADAM), boundary=True,
             send_scale=0.5 if comm_mode == "comm+send" else 1.0, zero_grad=True)


@pytest.mark.parametrize("n", [1, 7, 17, 33, 1001, 100_003])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
def test_zero_grad_odd_sizes_segments(kind, dtype, n):
    # numel not a multiple of any vector width, 3 groups over uneven segments (not vector-aligned).
    run_case(kind, dtype, n, comm_mode="alias", decoupled=True, boundary=(n % 2 == 1),
             zero_grad=True, seed=n)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_zero_grad_sgd_variants(nesterov, init, momentum):
    run_case(SGD, torch.float32, 777, comm_mode="comm", nesterov=nesterov, init=init,
             momentum=momentum, zero_grad=True)


@pytest.mark.parametrize("comm_mode", ["none", "comm+send", "alias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM], ids=lambda k: KIND_NAMES[k])
def test_zero_grad_skip_update_nan(kind, dtype, comm_mode):
    # Non-finite gradients: the update is skipped, grad is not read but still zeroed.
    for n in (5, 333, 100_003):
        run_case(kind, dtype, n, comm_mode=comm_mode, skip=True, nan_grad=True, zero_grad=True,
                 seed=n)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_zero_grad_kind_none_no_segments(dtype):
    # kind None with an empty segment table, with and without comm / send.
    for n in (3, 1000, 70_001):
        for c_mode in ("none", "comm", "send"):
            p = torch.randn(n).to(dtype)
            g = torch.full((n,), float("nan")).to(dtype)
            c = torch.randn(n).to(dtype) if c_mode == "comm" else None
            send = torch.empty(n, dtype=dtype) if c_mode == "send" else None
            p0 = p.clone()
            _C.mix_and_step(kind=NONE, param=p, grad=g, states=[], comm=c, send=send,
                            segments=torch.zeros(0, 3, dtype=torch.int64), groups=[], mix_a=0.25,
                            mix_b=0.75, send_scale=1.0, grad_scale=1.0, zero_grad=True)
            assert torch.equal(g, torch.zeros_like(g))
            if c is not None:
                ref = (0.25 * p0.double() + 0.75 * c.double()).to(dtype)
                torch.testing.assert_close(p.double(), ref.double(), rtol=ulp_tol(dtype)[0],
                                           atol=1e-6)
            else:
                assert torch.equal(p, p0)
            if send is not None:
                assert torch.equal(send, p)


def test_zero_grad_unaligned_views():
    # Buffers at odd element offsets (not co-aligned with param): still zeroed, same results.
    n = 1003
    base_g = torch.randn(n + 3)
    for off in (0, 1, 3):
        g = base_g[off:off + n].clone() if off == 0 else base_g.clone()[off:off + n]
        run_g = g.clone()
        p = torch.randn(n + 1)[1:]
        st = [torch.zeros(n), torch.zeros(n)]
        p1, st1 = p.clone(), [t.clone() for t in st]
        _C.mix_and_step(kind=ADAM, param=p1, grad=run_g.clone(), states=st1,
                        segments=seg_tensor([(0, n, 0)]), groups=[group()],
                        decoupled_weight_decay=True)
        _C.mix_and_step(kind=ADAM, param=p, grad=g, states=st, segments=seg_tensor([(0, n, 0)]),
                        groups=[group()], decoupled_weight_decay=True, zero_grad=True)
        assert torch.equal(g, torch.zeros(n))
        assert torch.equal(p, p1) and torch.equal(st[0], st1[0]) and torch.equal(st[1], st1[1])


def test_zero_grad_numel_zero_and_version_bump():
    p = torch.zeros(0)
    _C.mix_and_step(kind=ADAM, param=p, grad=torch.zeros(0), states=[torch.zeros(0), torch.zeros(0)],
                    comm=None, send=None, segments=torch.zeros(0, 3, dtype=torch.int64),
                    groups=[group()], mix_a=1.0, mix_b=0.0, send_scale=1.0, grad_scale=1.0,
                    zero_grad=True)
    kw = _good()
    g = kw["grad"]
    v0 = g._version
    _call(**kw, zero_grad=True)
    assert g._version > v0, "zero_grad writes grad: its version counter must move"
    assert torch.equal(g, torch.zeros_like(g))


def test_zero_grad_bad_inputs():
    _refuses(lambda kw: kw.update(grad=None), r"grad is required", zero_grad=True)
    _refuses(lambda kw: kw.update(grad=None, skip_update=True), r"zero_grad=True needs grad", zero_grad=True)
    _refuses(lambda kw: kw.update(grad=kw["param"]), r"grad must not share memory with param", zero_grad=True)
    _refuses(lambda kw: kw.update(comm=kw["grad"]),
             r"grad \(zero_grad=True\) must not share memory with comm", zero_grad=True)
    _refuses(lambda kw: kw.update(send=kw["grad"]),
             r"grad \(zero_grad=True\) must not share memory with send", zero_grad=True)
    _refuses(lambda kw: kw["states"].__setitem__(0, kw["grad"]),
             r"grad \(zero_grad=True\) must not share memory with states\[0\]", zero_grad=True)
    # Without zero_grad a read-only grad shared with comm is still accepted (old behaviour).
    kw = _good()
    kw["comm"] = kw["grad"].clone()
    _call(**kw)


@pytest.mark.parametrize("opt_name", ["SGD", "Adam", "AccumAdamW"])
def test_bucket_step_zero_grad_after_skipped_step(opt_name):
    # FusedOptimizer.bucket_step(zero_grad=True), as the reducer calls it: a skipped step
    # (non-finite gradients) leaves the parameters and the step count alone but zeroes the
    # gradients, so the next step starts from the fresh gradients only. The step counter moves in
    # finish_bucket_step(updated), as decentpy.bucket calls it after an update.
    optim = pytest.importorskip("decentpy.optim")
    from decentpy.optim.grad_scaling import UNSCALED
    n1, n2 = 10, 23
    n = n1 + n2
    segs = seg_tensor([(0, n, 0)])

    def make():
        block = torch.randn(n, generator=torch.Generator().manual_seed(1))
        params = [torch.nn.Parameter(block[:n1]), torch.nn.Parameter(block[n1:])]
        kw = dict(lr=0.1, momentum=0.9) if opt_name == "SGD" else dict(lr=0.01)
        return block, params, getattr(optim, opt_name)(params, **kw)

    block, params, opt = make()
    block2, params2, opt2 = make()
    grad = torch.full((n,), float("nan"))
    grad[5] = float("inf")
    p0 = block.clone()
    opt.bucket_step(params, [0, n1], block, grad, segs, None, None, 1.0, 0.0, 1.0, UNSCALED, True,
                    zero_grad=True)
    assert torch.equal(grad, torch.zeros(n)), "skipped step must still zero the gradients"
    assert torch.equal(block, p0)
    assert int(opt._shared_step.item()) == 0
    # Next step: finite gradients accumulate into the zeroed block (as backward does).
    fresh = torch.randn(n, generator=torch.Generator().manual_seed(2))
    grad += fresh
    opt.bucket_step(params, [0, n1], block, grad, segs, None, None, 1.0, 0.0, 1.0, UNSCALED, False,
                    zero_grad=True)
    opt.finish_bucket_step(True)
    assert torch.equal(grad, torch.zeros(n))
    # Reference: the same optimizer that never saw the skipped step, without zero_grad.
    grad2 = fresh.clone()
    opt2.bucket_step(params2, [0, n1], block2, grad2, segs, None, None, 1.0, 0.0, 1.0, UNSCALED, False)
    opt2.finish_bucket_step(True)
    assert torch.equal(grad2, fresh), "without zero_grad the gradients are left alone"
    assert torch.equal(block, block2)
    assert bool(torch.isfinite(block).all())
    assert int(opt._shared_step.item()) == int(opt2._shared_step.item()) == 1


# ---- bad inputs ------------------------------------------------------------------------------

def _good(n=64, dtype=torch.float32, kind=ADAM):
    return dict(
        kind=kind, param=torch.randn(n).to(dtype), grad=torch.randn(n).to(dtype),
        states=[torch.zeros(n) for _ in range(n_states(kind, True))], comm=None, send=None,
        segments=seg_tensor([(0, n, 0)]), groups=[group()], mix_a=1.0, mix_b=0.0,
        send_scale=1.0, grad_scale=1.0, decoupled_weight_decay=True, momentum_init=False,
        accum_boundary=False, skip_update=False)


def _call(**kw):
    _C.mix_and_step(**kw)


def _refuses(edit, match, **call_kw):
    """A good call with ``edit(kw)`` applied raises RuntimeError matching ``match``."""
    kw = _good()
    edit(kw)
    with pytest.raises(RuntimeError, match=match):
        _call(**kw, **call_kw)


def test_good_call_works():
    _call(**_good())


def test_bad_param_dtype():
    kw = _good()
    kw["param"] = kw["param"].double()
    kw["grad"] = kw["grad"].double()
    with pytest.raises(RuntimeError, match=r"param has dtype Double.*float32, bfloat16 and float16"):
        _call(**kw)


def test_bad_grad_dtype():
    kw = _good()
    kw["grad"] = kw["grad"].half()
    with pytest.raises(RuntimeError, match=r"grad has dtype Half but param has dtype Float"):
        _call(**kw)


def test_bad_numel():
    kw = _good()
    kw["comm"] = torch.randn(63)
    with pytest.raises(RuntimeError, match=r"comm has 63 elements.*param has 64"):
        _call(**kw)


def test_bad_state_count():
    kw = _good()
    kw["states"] = kw["states"][:1]
    with pytest.raises(RuntimeError, match=r"Adam takes 2 state tensors.*got 1"):
        _call(**kw)
    kw = _good(kind=ACCUM)
    kw["states"] = kw["states"][:2]
    with pytest.raises(RuntimeError, match=r"AccumAdam takes 3 state tensors.*got 2"):
        _call(**kw)


def test_bad_state_dtype():
    kw = _good()
    kw["states"][1] = kw["states"][1].double()
    with pytest.raises(RuntimeError, match=r"states\[1\] has dtype Double.*float32"):
        _call(**kw)


def test_send_aliasing_param():
    kw = _good()
    kw["send"] = kw["param"]
    with pytest.raises(RuntimeError, match=r"send must not share memory with param"):
        _call(**kw)


def test_param_not_1d_or_not_contiguous():
    kw = _good()
    kw["param"] = torch.randn(8, 8)
    with pytest.raises(RuntimeError, match=r"param must be 1-D"):
        _call(**kw)
    kw = _good()
    kw["param"] = torch.randn(128)[::2]
    with pytest.raises(RuntimeError, match=r"param must be contiguous"):
        _call(**kw)


def test_bad_segments():
    kw = _good()
    kw["segments"] = seg_tensor([(0, 30, 0), (31, 64, 0)])
    with pytest.raises(RuntimeError, match=r"segments\[1\].*does not continue at 30"):
        _call(**kw)
    kw = _good()
    kw["segments"] = seg_tensor([(0, 64, 1)])
    with pytest.raises(RuntimeError, match=r"uses group 1 but there are 1 parameter groups"):
        _call(**kw)
    kw = _good()
    kw["segments"] = seg_tensor([(0, 60, 0)])
    with pytest.raises(RuntimeError, match=r"segments end at 60 but param has 64"):
        _call(**kw)
    kw = _good()
    kw["segments"] = torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"segments has dtype Int"):
        _call(**kw)


def test_check_segments_for_device_tables():
    # Tables bound for the GPU are validated on the host with check_segments (the kernel trusts them).
    _C.check_segments(seg_tensor([(0, 30, 0), (30, 64, 1)]), 64, 2)
    with pytest.raises(RuntimeError, match=r"segments\[1\].*does not continue at 30"):
        _C.check_segments(seg_tensor([(0, 30, 0), (31, 64, 0)]), 64, 1)
    with pytest.raises(RuntimeError, match=r"uses group 2 but there are 2 parameter groups"):
        _C.check_segments(seg_tensor([(0, 64, 2)]), 64, 2)
    with pytest.raises(RuntimeError, match=r"segments end at 60 but param has 64"):
        _C.check_segments(seg_tensor([(0, 60, 0)]), 64, 1)
    with pytest.raises(RuntimeError, match=r"contiguous int64 \[nseg, 3\]"):
        _C.check_segments(torch.zeros(2, 2, dtype=torch.int64), 64, 1)


def test_state_buffers_must_not_overlap_other_buffers():
    _refuses(lambda kw: kw["states"].__setitem__(1, kw["states"][0]),
             r"states\[1\] must not share memory with states\[0\]")
    _refuses(lambda kw: kw.update(comm=kw["states"][0]), r"states\[0\] must not share memory with comm")
    _refuses(lambda kw: kw.update(send=kw["states"][1]), r"states\[1\] must not share memory with send")
    _refuses(lambda kw: kw.update(grad=kw["states"][0]), r"states\[0\] must not share memory with grad")


def test_too_many_groups_and_bad_groups():
    assert _C.MAX_GROUPS == 8
    kw = _good()
    kw["groups"] = [group()] * 9
    with pytest.raises(RuntimeError, match=r"9 parameter groups; at most 8 groups may share one bucket"):
        _call(**kw)
    kw = _good()
    kw["groups"] = []
    with pytest.raises(RuntimeError, match=r"groups is empty; kind Adam needs at least one"):
        _call(**kw)
    # Groups are typed: a hyper row of the wrong length can no longer be built. What replaces that
    # check: a plain list (an old-style row) instead of a GroupHyper, an int instead of an OptKind,
    # positional arguments, all refused by the binding.
    kw = _good()
    kw["groups"] = [[0.01, 0.0, 0.0, 0.0, 0.0]]
    with pytest.raises(TypeError):
        _call(**kw)
    kw = _good()
    kw["kind"] = 2
    with pytest.raises(TypeError):
        _call(**kw)
    kw = _good()
    with pytest.raises(TypeError):
        _C.mix_and_step(*kw.values())
    with pytest.raises(TypeError):
        _C.GroupHyper(0.01)  # keyword-only fields
    # Bad field values are refused with the group named.
    kw = _good()
    kw["groups"] = [group(), group(step=0)]
    kw["segments"] = seg_tensor([(0, 32, 0), (32, 64, 1)])
    with pytest.raises(RuntimeError, match=r"groups\[1\] has bias_step 0; bias-correction steps are 1-based"):
        _call(**kw)
    kw = _good(kind=ACCUM)
    kw["groups"] = [group(accum_iter=0)]
    with pytest.raises(RuntimeError, match=r"groups\[0\] has accum_iter 0; it must be >= 1"):
        _call(**kw)
    kw = _good()
    kw["segments"] = None
    with pytest.raises(RuntimeError, match=r"segments is required for kind Adam"):
        _call(**kw)


def test_missing_grad_and_momentum_buffer():
    kw = _good()
    kw["grad"] = None
    with pytest.raises(RuntimeError, match=r"grad is required"):
        _call(**kw)
    kw = _good(kind=SGD)
    kw["states"] = []
    kw["groups"] = [group(momentum=0.9)]
    with pytest.raises(RuntimeError, match=r"momentum 0.9.*no momentum buffer"):
        _call(**kw)


def test_scale_copy_bad_inputs():
    with pytest.raises(RuntimeError, match=r"src has dtype Half but dst has dtype Float"):
        _C.scale_copy_(torch.zeros(4), torch.zeros(4, dtype=torch.half), 1.0)
    with pytest.raises(RuntimeError, match=r"src has 5 elements"):
        _C.scale_copy_(torch.zeros(4), torch.zeros(5), 1.0)
    with pytest.raises(RuntimeError, match=rf"sumsq must be a contiguous float32 tensor of {_C.NORM_SLOTS} elements, got Float with 7"):
        _C.scale_copy_(torch.zeros(4), torch.zeros(4), 1.0, torch.zeros(7))
    slots = torch.zeros(_C.NORM_SLOTS + 4)
    with pytest.raises(RuntimeError, match=r"sumsq must not overlap dst or src"):
        _C.scale_copy_(slots[:8], torch.zeros(8), 1.0, slots[4:])


# --- every compiled ISA variant ---------------------------------------------------------------

@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ISA variants exist on x86-64 only")
@pytest.mark.parametrize("cap", ["default", "avx2"])
def test_every_isa_variant_passes_the_kernel_tests(cap: str) -> None:
    """The process picks one variant (the best the CPU has); rerun this file with torch's
    ATEN_CPU_CAPABILITY forcing each lower one, so every compiled body meets the reference."""
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("already a forced-ISA run (no recursion)")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
    picked = subprocess.run([sys.executable, "-c", "from decentpy import _C; print(_C.build_info()['cpu_kernel_isa'])"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert picked.returncode == 0, picked.stderr
    if cap == "avx2" and picked.stdout.strip() == "default":
        pytest.skip("this CPU has no AVX2")
    assert picked.stdout.strip() == cap
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"kernel tests failed with the {cap} variant:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and " failed" not in run.stdout
