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


NONE, SGD, ADAM, ACCUM = 0, 1, 2, 3
KIND_NAMES = {NONE: "none", SGD: "sgd", ADAM: "adam", ACCUM: "accumadam"}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def f32(x):
    """The float32 value the kernel sees for a scalar argument."""
    return float(torch.tensor(x, dtype=torch.float32))


def hyper_row(lr=0.01, wd=0.0, momentum=0.0, dampening=0.0, nesterov=False, beta1=0.9,
              beta2=0.999, eps=1e-8, step=1, accum_iter=1):
    bc1 = 1 - beta1 ** step
    bc2 = math.sqrt(1 - beta2 ** step)
    return [lr, wd, momentum, dampening, 1.0 if nesterov else 0.0, beta1, beta2, eps, bc1, bc2,
            1.0 / accum_iter]


def reference(kind, p, g, states, c, want_send, segs, hyper, a, b, s, gs, decoupled, init,
              boundary, skip):
    """float64 re-computation. Returns (param64, [states64], send64 or None)."""
    P = p.double().clone()
    S = [t.double().clone() for t in states]
    if c is not None:
        P = f32(a) * P + f32(b) * c.double()
    if kind != NONE and not skip:
        G = g.double() * f32(gs)
        for lo, hi, gi in segs:
            lr, wd, mom, damp, nest, b1, b2, eps, bc1, bc2, accs = [f32(v) for v in hyper[gi]]
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
             ngroups=3, seed=0, mix=(0.6, 0.4), send_scale=1.0, zero_grad=False, nan_grad=False):
    """comm_mode: none | comm | send | comm+send | alias (send is the comm buffer).

    zero_grad: run the kernel with zero_grad=True as well and check that it leaves grad exactly
    zero and gives bit-identical param / states / send to zero_grad=False. nan_grad: poison some
    gradients with nan / inf (with skip=True: the non-finite step that is skipped)."""
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
    hyper = [
        hyper_row(lr=0.1, wd=wd, momentum=momentum, dampening=dampening, nesterov=nesterov,
                  step=3, accum_iter=4),
        hyper_row(lr=0.03, wd=0.0, momentum=momentum * 0.5, dampening=0.1, nesterov=not nesterov,
                  beta1=0.8, beta2=0.99, eps=1e-6, step=1, accum_iter=2),
        hyper_row(lr=0.2, wd=wd * 10, momentum=momentum, nesterov=nesterov, beta1=0.95,
                  beta2=0.9, eps=1e-3, step=10, accum_iter=1),
    ][:ngroups]
    if kind == SGD and not ns:
        for row in hyper:
            row[2] = 0.0
    segs = make_segments(n, len(hyper))
    a, b = mix

    P_ref, S_ref, send_ref = reference(kind, p, g, states, c, want_send, segs, hyper, a, b,
                                       send_scale, grad_scale, decoupled, init, boundary, skip)

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
        _C.mix_and_step(kind, p_k, g_k, st_k, c_k, send_k, seg_tensor(segs), hyper, a, b,
                        send_scale, grad_scale, decoupled, init, boundary, skip, zero_grad=zg)
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
    _C.mix_and_step(kind, p, None, states, c, None, seg_tensor([(0, n, 0)]), [hyper_row()],
                    0.5, 0.5, 1.0, 1.0, False, False, True, True)
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
    hyper = [hyper_row(lr=0.001 * (i + 1), wd=0.01 * i) for i in range(8)]
    P_ref, S_ref, _ = reference(ADAM, p, g, st, None, False, segs, hyper, 1, 0, 1, 1, True, False,
                                False, False)
    pk = p.clone()
    _C.mix_and_step(ADAM, pk, g, st, None, None, seg_tensor(segs), hyper, 1.0, 0.0, 1.0, 1.0,
                    True, False, False, False)
    torch.testing.assert_close(pk.double(), P_ref.float().double(), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(st[1].double(), S_ref[1].float().double(), rtol=2e-6, atol=1e-9)


def test_numel_zero():
    p = torch.zeros(0)
    _C.mix_and_step(ADAM, p, torch.zeros(0), [torch.zeros(0), torch.zeros(0)], None, None,
                    torch.zeros(0, 3, dtype=torch.int64), [hyper_row()], 1.0, 0.0, 1.0, 1.0,
                    False, False, False, False)


def test_none_kind_no_segments():
    p = torch.randn(100)
    c = torch.randn(100)
    ref = 0.25 * p.double() + 0.75 * c.double()
    _C.mix_and_step(NONE, p, None, [], c, None, torch.zeros(0, 3, dtype=torch.int64), [], 0.25,
                    0.75, 1.0, 1.0, False, False, False, False)
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


def test_mix_preserves_mean_of_pair():
    # Two workers averaging (w = 1/2) get exactly equal results, so the mean is kept.
    n = 4097
    x = torch.randn(n)
    y = torch.randn(n)
    xa, ya = x.clone(), y.clone()
    seg = torch.zeros(0, 3, dtype=torch.int64)
    _C.mix_and_step(NONE, xa, None, [], y.clone(), None, seg, [], 0.5, 0.5, 1.0, 1.0, False,
                    False, False, False)
    _C.mix_and_step(NONE, ya, None, [], x.clone(), None, seg, [], 0.5, 0.5, 1.0, 1.0, False,
                    False, False, False)
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
    _C.mix_and_step(ADAM, pk, g, st, None, None, seg_tensor([(0, n, 0)]),
                    [hyper_row(lr=1e-2, wd=0.1, step=1)], 1.0, 0.0, 1.0, 1.0, True, False, False,
                    False)
    torch.testing.assert_close(pk, tp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st[0], opt.state[tp]["exp_avg"])
    torch.testing.assert_close(st[1], opt.state[tp]["exp_avg_sq"])


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
            _C.mix_and_step(NONE, p, g, [], c, send, torch.zeros(0, 3, dtype=torch.int64), [],
                            0.25, 0.75, 1.0, 1.0, False, False, False, False, zero_grad=True)
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
        _C.mix_and_step(ADAM, p1, run_g.clone(), st1, None, None, seg_tensor([(0, n, 0)]),
                        [hyper_row()], 1.0, 0.0, 1.0, 1.0, True, False, False, False)
        _C.mix_and_step(ADAM, p, g, st, None, None, seg_tensor([(0, n, 0)]), [hyper_row()], 1.0,
                        0.0, 1.0, 1.0, True, False, False, False, zero_grad=True)
        assert torch.equal(g, torch.zeros(n))
        assert torch.equal(p, p1) and torch.equal(st[0], st1[0]) and torch.equal(st[1], st1[1])


def test_zero_grad_numel_zero_and_version_bump():
    p = torch.zeros(0)
    _C.mix_and_step(ADAM, p, torch.zeros(0), [torch.zeros(0), torch.zeros(0)], None, None,
                    torch.zeros(0, 3, dtype=torch.int64), [hyper_row()], 1.0, 0.0, 1.0, 1.0,
                    False, False, False, False, zero_grad=True)
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
    # gradients, so the next step starts from the fresh gradients only.
    optim = pytest.importorskip("decentpy.optim")
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
    opt.bucket_step(params, [0, n1], block, grad, segs, None, None, 1.0, 0.0, 1.0, 1.0, True,
                    zero_grad=True)
    assert torch.equal(grad, torch.zeros(n)), "skipped step must still zero the gradients"
    assert torch.equal(block, p0)
    assert int(opt._shared_step.item()) == 0
    # Next step: finite gradients accumulate into the zeroed block (as backward does).
    fresh = torch.randn(n, generator=torch.Generator().manual_seed(2))
    grad += fresh
    opt.bucket_step(params, [0, n1], block, grad, segs, None, None, 1.0, 0.0, 1.0, 1.0, False,
                    zero_grad=True)
    assert torch.equal(grad, torch.zeros(n))
    # Reference: the same optimizer that never saw the skipped step, without zero_grad.
    grad2 = fresh.clone()
    opt2.bucket_step(params2, [0, n1], block2, grad2, segs, None, None, 1.0, 0.0, 1.0, 1.0, False)
    assert torch.equal(grad2, fresh), "without zero_grad the gradients are left alone"
    assert torch.equal(block, block2)
    assert bool(torch.isfinite(block).all())


# ---- bad inputs ------------------------------------------------------------------------------

def _good(n=64, dtype=torch.float32, kind=ADAM):
    return dict(
        kind=kind, param=torch.randn(n).to(dtype), grad=torch.randn(n).to(dtype),
        states=[torch.zeros(n) for _ in range(n_states(kind, True))], comm=None, send=None,
        segments=seg_tensor([(0, n, 0)]), hyper=[hyper_row()], mix_a=1.0, mix_b=0.0,
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
    with pytest.raises(RuntimeError, match=r"uses group 1 but hyper has 1 rows"):
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
    with pytest.raises(RuntimeError, match=r"uses group 2 but hyper has 2 rows"):
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


def test_too_many_groups_and_bad_rows():
    kw = _good()
    kw["hyper"] = [hyper_row()] * 9
    with pytest.raises(RuntimeError, match=r"hyper has 9 rows.*at most 8"):
        _call(**kw)
    kw = _good()
    kw["hyper"] = [hyper_row()[:5]]
    with pytest.raises(RuntimeError, match=r"hyper\[0\] has 5 values; expected 11"):
        _call(**kw)


def test_missing_grad_and_momentum_buffer():
    kw = _good()
    kw["grad"] = None
    with pytest.raises(RuntimeError, match=r"grad is required"):
        _call(**kw)
    kw = _good(kind=SGD)
    kw["states"] = []
    kw["hyper"] = [hyper_row(momentum=0.9)]
    with pytest.raises(RuntimeError, match=r"momentum 0.9.*no momentum buffer"):
        _call(**kw)


def test_scale_copy_bad_inputs():
    with pytest.raises(RuntimeError, match=r"src has dtype Half but dst has dtype Float"):
        _C.scale_copy_(torch.zeros(4), torch.zeros(4, dtype=torch.half), 1.0)
    with pytest.raises(RuntimeError, match=r"src has 5 elements"):
        _C.scale_copy_(torch.zeros(4), torch.zeros(5), 1.0)


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
