"""CUDA fused mix-and-step and scale-copy kernels against a float64 re-computation.

Runs only on a machine with a CUDA device and a decentpy build with CUDA kernels; elsewhere the
whole module is skipped (it still collects on a CPU-only install).

The reference (`reference_mix_and_step`) re-computes the per-element equations of
csrc/kernels/mix_and_step.h in float64 on the GPU, from the same (storage-dtype) inputs and the
same float32 scalars the kernel receives. fp32 results are compared at ~1e-6 relative; bf16 / fp16
results against the reference rounded to the storage dtype, within 2 ulp. `send` is checked as
send_scale * (p as stored).
"""

import math

import pytest
import torch

from reference import GRAD_NORM_CASES, SKIP_NORM_CASES, grad_factor64

pytestmark = pytest.mark.cuda

try:  # collect fine on a CPU-only install / without a built extension
    from decentpy import _C
except Exception:  # pragma: no cover - depends on the install
    _C = None


def _cuda_kernels_available():
    if _C is None or not torch.cuda.is_available():
        return False
    try:
        return bool(_C.build_info().get("cuda_kernels", False))
    except Exception:
        return False


if not _cuda_kernels_available():
    pytest.skip(
        "needs a CUDA device and decentpy._C built with CUDA kernels",
        allow_module_level=True,
    )

DEV = torch.device("cuda")
NONE, SGD, ADAM, ACCUM_ADAM = _C.OptKind.NONE, _C.OptKind.SGD, _C.OptKind.ADAM, _C.OptKind.ACCUM_ADAM
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 3, 7, 1000003, 2**20 + 5]
# Per-group values the reference uses, derived from a GroupHyper as the kernel derives them.
HYPER_FIELDS = [
    "lr", "weight_decay", "momentum", "dampening", "nesterov", "beta1", "beta2", "eps",
    "bias_correction1", "bias_correction2_sqrt", "accum_scale",
]


# ---------------------------------------------------------------------------------------------
# Reference (float64). Shareable: depends on torch only.
# ---------------------------------------------------------------------------------------------

def _f32(x):
    """A Python scalar as the kernel sees it (rounded to float32), as float."""
    return float(torch.tensor(float(x), dtype=torch.float32))


def _group_values(h):
    """The reference's per-group values (HYPER_FIELDS order) from a GroupHyper: its fields are the
    float32 values the kernel reads; the bias corrections are derived from the 1-based bias_step
    in float64, as the kernel derives them."""
    return [h.lr, h.weight_decay, h.momentum, h.dampening, 1.0 if h.nesterov else 0.0, h.beta1,
            h.beta2, h.eps, 1.0 - h.beta1 ** h.bias_step, math.sqrt(1.0 - h.beta2 ** h.bias_step),
            1.0 / h.accum_iter]



def reference_mix_and_step(kind, param, grad, states, comm, has_send, segments, hyper,
                           mix_a, mix_b, send_scale, grad_scale, decoupled_weight_decay,
                           momentum_init, accum_boundary, skip_update):
    """Float64 re-computation of csrc/kernels/mix_and_step.h.

    Arguments mirror decentpy._C.mix_and_step (segments: list of (begin, end, group) rows; hyper:
    the list of GroupHyper). Returns (p, states, send) as float64 tensors (send None when has_send
    is false); p is un-rounded, send = send_scale * (p rounded to param's dtype).
    """
    dev = param.device
    numel = param.numel()
    p = param.double().clone()
    if comm is not None:
        p = _f32(mix_a) * p + _f32(mix_b) * comm.double()
    out_states = [s.double().clone() for s in states]
    if kind != NONE and not skip_update:
        # Per-element hyper-parameters (float32 fields as the kernel receives them; bias
        # corrections derived in float64).
        hyp = torch.tensor([_group_values(h) for h in hyper], dtype=torch.float64, device=dev)
        lengths = torch.tensor([e - b for b, e, _ in segments], dtype=torch.int64, device=dev)
        gidx = torch.tensor([g for _, _, g in segments], dtype=torch.int64, device=dev)
        assert int(lengths.sum()) == numel
        grp = torch.repeat_interleave(gidx, lengths)
        H = {name: hyp[grp, k] for k, name in enumerate(HYPER_FIELDS)}
        g = grad.double() * _f32(grad_scale)
        lr, wd = H["lr"], H["weight_decay"]
        if kind == SGD:
            g = g + wd * p
            if out_states:
                mom, damp = H["momentum"], H["dampening"]
                buf = out_states[0]
                new_buf = g.clone() if momentum_init else mom * buf + (1.0 - damp) * g
                has = mom != 0
                out_states[0] = torch.where(has, new_buf, buf)
                g_mom = torch.where(H["nesterov"] != 0, g + mom * new_buf, new_buf)
                g = torch.where(has, g_mom, g)
            p = p - lr * g
        else:
            if decoupled_weight_decay:
                p = p * (1.0 - lr * wd)
            else:
                g = g + wd * p
            b1, b2, eps = H["beta1"], H["beta2"], H["eps"]
            bc1, bc2s = H["bias_correction1"], H["bias_correction2_sqrt"]
            m, v = out_states[0], out_states[1]
            if kind == ACCUM_ADAM:
                out_states[2] = out_states[2] + H["accum_scale"] * g
            mt = b1 * m + (1.0 - b1) * g
            vt = b2 * v + (1.0 - b2) * g * g
            p = p - (lr / bc1) * mt / (vt.sqrt() / bc2s + eps)
            if kind == ADAM:
                out_states[0], out_states[1] = mt, vt
            elif accum_boundary:
                acc = out_states[2]
                out_states[0] = b1 * m + (1.0 - b1) * acc
                out_states[1] = b2 * v + (1.0 - b2) * acc * acc
                out_states[2] = torch.zeros_like(acc)
    send = None
    if has_send:
        send = _f32(send_scale) * p.to(param.dtype).double()
    return p, out_states, send


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def assert_matches(out, ref64, what, fp32_rtol=2e-6, fp32_atol=1e-6):
    """out (storage dtype) against the float64 reference: fp32 at ~1e-6 relative; bf16/fp16
    against the reference rounded to the dtype, within 2 ulp (plus fp32 compute noise)."""
    dtype = out.dtype
    o = out.double()
    if dtype == torch.float32:
        ref = ref64
        tol = fp32_rtol * ref.abs() + fp32_atol
    else:
        ref = ref64.to(dtype).double()
        tol = 2.0 * torch.finfo(dtype).eps * ref.abs() + 1e-6
    diff = (o - ref).abs()
    bad = ~(diff <= tol)  # NaN counts as bad
    if bool(bad.any()):
        idx = bad.nonzero()[:5].flatten().tolist()
        raise AssertionError(
            f"{what} ({dtype}): {int(bad.sum())}/{out.numel()} elements off, first at {idx}: "
            f"got {o[idx].tolist()} expected {ref[idx].tolist()} (diff {diff[idx].tolist()})"
        )


def _buffer(numel, dtype, offset, fill):
    """A 1-D tensor of numel elements at element `offset` of a fresh allocation (misaligned
    views for offset % vector width != 0), filled by `fill(n)` (float32 CUDA)."""
    base = torch.empty(numel + offset, dtype=dtype, device=DEV)
    t = base[offset:offset + numel]
    t.copy_(fill(numel).to(dtype))
    return t


def _randn(scale=1.0):
    return lambda n: torch.randn(n, device=DEV) * scale


def _rand(lo, hi):
    return lambda n: torch.rand(n, device=DEV) * (hi - lo) + lo


def hyper_row(lr=1e-2, weight_decay=0.0, momentum=0.0, dampening=0.0, nesterov=False,
              beta1=0.9, beta2=0.999, eps=1e-8, step=3, accum_iter=4):
    """One parameter group (a _C.GroupHyper; the kernel derives the bias corrections from the
    1-based step and accum_scale = 1 / accum_iter)."""
    return _C.GroupHyper(lr=lr, weight_decay=weight_decay, momentum=momentum,
                         dampening=dampening, nesterov=nesterov, beta1=beta1, beta2=beta2,
                         eps=eps, bias_step=step, accum_iter=accum_iter)


def make_states(kind, numel, offset, momentum_buffer):
    if kind == SGD:
        return [_buffer(numel, torch.float32, offset, _randn(0.1))] if momentum_buffer else []
    if kind == ADAM:
        return [_buffer(numel, torch.float32, offset, _randn(0.1)),
                _buffer(numel, torch.float32, offset, _rand(1e-4, 1e-2))]
    if kind == ACCUM_ADAM:
        return [_buffer(numel, torch.float32, offset, _randn(0.1)),
                _buffer(numel, torch.float32, offset, _rand(1e-4, 1e-2)),
                _buffer(numel, torch.float32, offset, _randn(0.1))]
    return []


def run_case(kind, dtype, numel, *, offset=0, offsets=None, segments=None, hyper=None,
             has_comm=True, has_send=True, send_aliases_comm=False, momentum_buffer=True,
             decoupled=False, momentum_init=False, accum_boundary=False, skip_update=False,
             mix_a=0.5, mix_b=0.5, send_scale=1.0 / 3.0, grad_scale=0.75, grad_fill=None,
             zero_grad=False, grad_norm=None, scaler_scale=None, clip_norm=0.0):
    """Build fresh random inputs, run the kernel, compare every output with the reference.

    zero_grad: also run with zero_grad=False on copies (same offsets), and check that zero_grad
    leaves grad exactly zero and every other output bit-identical.

    grad_norm (a float): passed (with scaler_scale, a float or None, and clip_norm) as one-element
    device tensors, so the kernel derives the gradient factor and the skip itself (grad_scale is
    then passed as 1); the reference gets grad_factor64's (factor, skip)."""
    off = dict(param=offset, grad=offset, comm=offset, send=offset, state=offset)
    off.update(offsets or {})
    if segments is None:
        segments = [(0, numel, 0)]
    if hyper is None:
        hyper = [hyper_row(weight_decay=0.01, momentum=0.9 if momentum_buffer else 0.0,
                           dampening=0.1)]

    param = _buffer(numel, dtype, off["param"], _randn())
    grad = _buffer(numel, dtype, off["grad"], grad_fill or _randn())
    comm = _buffer(numel, dtype, off["comm"], _randn()) if has_comm else None
    states = make_states(kind, numel, off["state"], momentum_buffer)
    if send_aliases_comm:
        assert has_comm and has_send
        send = comm
    elif has_send:
        send = _buffer(numel, dtype, off["send"], lambda n: torch.full((n,), float("nan"),
                                                                       device=DEV))
    else:
        send = None

    norm_t = scale_t = None
    ref_gs, skipped = grad_scale, skip_update
    if grad_norm is not None:
        norm_t = torch.tensor([grad_norm], dtype=torch.float32, device=DEV)
        if scaler_scale is not None:
            scale_t = torch.tensor([scaler_scale], dtype=torch.float32, device=DEV)
        factor, norm_skip = grad_factor64(grad_norm, 1.0 if scaler_scale is None else scaler_scale,
                                          clip_norm)
        ref_gs, skipped = factor, skip_update or norm_skip
        grad_scale = 1.0  # the kernel derives the factor
    ref_p, ref_states, ref_send = reference_mix_and_step(
        kind, param, grad, states, comm, has_send, segments, hyper, mix_a, mix_b, send_scale,
        ref_gs, decoupled, momentum_init, accum_boundary, skipped)
    states_before = [s.clone() for s in states]
    grad_before = grad.clone()

    def launch(p_, g_, st_, c_, s_, zg):
        _C.mix_and_step(kind=kind, param=p_, grad=g_, states=st_, comm=c_, send=s_,
                        segments=seg_t, groups=hyper, mix_a=mix_a, mix_b=mix_b,
                        send_scale=send_scale, grad_scale=grad_scale, grad_norm=norm_t,
                        scaler_scale=scale_t, clip_norm=clip_norm,
                        decoupled_weight_decay=decoupled, momentum_init=momentum_init,
                        accum_boundary=accum_boundary, skip_update=skip_update, zero_grad=zg)

    seg_t = torch.tensor(segments, dtype=torch.int64, device=DEV).reshape(-1, 3)
    plain = None
    if zero_grad:
        def twin(t, key):
            if t is None:
                return None
            u = _buffer(numel, t.dtype, off[key], lambda n: torch.zeros(n, device=DEV))
            u.copy_(t)
            return u
        p2, g2, c2 = twin(param, "param"), twin(grad, "grad"), twin(comm, "comm")
        st2 = [twin(x, "state") for x in states]
        s2 = c2 if send_aliases_comm else twin(send, "send")
        launch(p2, g2, st2, c2, s2, False)
        plain = (p2, st2, c2, s2)
    launch(param, grad, states, comm, send, zero_grad)
    torch.cuda.synchronize()
    if zero_grad:
        assert torch.equal(grad, torch.zeros_like(grad)), "zero_grad must leave grad exactly zero"
        assert not bool(torch.signbit(grad).any()), "zero_grad must store +0"
        p2, st2, c2, s2 = plain
        assert torch.equal(param, p2), "zero_grad changed param"
        for k, (a_, b_) in enumerate(zip(states, st2)):
            assert torch.equal(a_, b_), f"zero_grad changed state{k}"
        if comm is not None:
            assert torch.equal(comm, c2), "zero_grad changed comm / send"
        if send is not None:
            assert torch.equal(send, s2), "zero_grad changed send"
        grad = grad_before  # the checks below are about the values read

    assert_matches(param, ref_p, "param")
    for k, (s, r) in enumerate(zip(states, ref_states)):
        assert_matches(s, r, f"state{k}", fp32_rtol=2e-6, fp32_atol=1e-7)
    if has_send:
        assert_matches(send, ref_send, "send")
    # Inputs that must not be written (grad: unless zero_grad, checked above).
    assert torch.equal(grad, grad_before) or skipped  # NaN grads: compare bits below
    if skipped:
        assert torch.equal(grad.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           grad_before.view(torch.int16 if dtype != torch.float32
                                            else torch.int32))
    if skipped or kind == NONE:
        for s, b in zip(states, states_before):
            assert torch.equal(s, b), "state changed without an update"
    if kind == ACCUM_ADAM and not accum_boundary and not skipped:
        # Outside the boundary M and V are read only (bit-identical).
        assert torch.equal(states[0], states_before[0])
        assert torch.equal(states[1], states_before[1])
    return param, states, send


# ---------------------------------------------------------------------------------------------
# mix_and_step
# ---------------------------------------------------------------------------------------------

KIND_CASES = {
    "none": dict(kind=NONE),
    "sgd": dict(kind=SGD, momentum_buffer=False),
    "sgd_momentum": dict(kind=SGD),
    "sgd_nesterov_init": dict(kind=SGD, momentum_init=True,
                              hyper=[hyper_row(weight_decay=0.01, momentum=0.9, nesterov=True)]),
    "adam": dict(kind=ADAM),
    "adamw": dict(kind=ADAM, decoupled=True),
    "accum_adam": dict(kind=ACCUM_ADAM),
    "accum_adamw_boundary": dict(kind=ACCUM_ADAM, decoupled=True, accum_boundary=True),
}


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(KIND_CASES))
def test_mix_and_step_matches_reference(case, dtype, numel, offset):
    torch.manual_seed(numel * 7 + offset)
    run_case(dtype=dtype, numel=numel, offset=offset, **KIND_CASES[case])


# More vectors than the grid has threads (132 SMs x 8 blocks x 256 threads on an H100/H200): the
# boundary pass on a 2-byte type keeps two vectors a thread in flight, k and k + stride, and the
# second one (and the last thread's lone first one) only exists past one grid's worth of vectors.
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_two_vectors_a_thread_match_reference(dtype, offset):
    torch.manual_seed(11 + offset)
    run_case(dtype=dtype, numel=3 * 2**20 * 4 + 4 * 1001 + 3, offset=offset,
             **KIND_CASES["accum_adamw_boundary"])


def _straddling_segments(numel):
    """Segments whose boundaries mostly fall inside 16-byte vectors (plus tiny ones)."""
    cuts = {0, numel}
    for c in (1, 3, 4, 5, 13, 64, 1001, numel // 3, numel // 3 + 1, numel // 2 + 7,
              (2 * numel) // 3 + 8, numel - 9, numel - 2):
        if 0 < c < numel:
            cuts.add(c)
    cuts = sorted(cuts)
    return [(b, e, k % 5) for k, (b, e) in enumerate(zip(cuts[:-1], cuts[1:]))]


MULTI_HYPER = [
    hyper_row(lr=1e-2, weight_decay=0.01, momentum=0.9, dampening=0.1, step=3),
    hyper_row(lr=3e-3, weight_decay=0.0, momentum=0.0, step=3),              # no momentum
    hyper_row(lr=5e-2, weight_decay=0.05, momentum=0.5, nesterov=True, beta1=0.8,
              beta2=0.99, eps=1e-6, step=1, accum_iter=2),
    hyper_row(lr=1e-3, weight_decay=0.1, momentum=0.99, dampening=0.5, beta1=0.95,
              beta2=0.9999, step=10, accum_iter=8),
    hyper_row(lr=0.0, weight_decay=0.0, momentum=0.9),                       # frozen
]


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
@pytest.mark.parametrize("numel", [37, 1000003, 2**20 + 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["sgd_momentum", "sgd_nesterov_init", "adam", "adamw",
                                  "accum_adam", "accum_adamw_boundary"])
def test_mix_and_step_groups_and_straddling_segments(case, dtype, numel, offset):
    torch.manual_seed(numel + offset)
    cfg = dict(KIND_CASES[case])
    cfg["hyper"] = MULTI_HYPER
    run_case(dtype=dtype, numel=numel, offset=offset, segments=_straddling_segments(numel),
             **cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_grid_stride_loop_repeats(dtype):
    # 2^24 + 3 elements: more 16-byte vectors than the grid has threads on any current GPU, so
    # every thread runs several iterations and carries its segment cache across them.
    numel = 2**24 + 3
    torch.manual_seed(11)
    cfg = dict(KIND_CASES["adamw"])
    cfg["hyper"] = MULTI_HYPER
    run_case(dtype=dtype, numel=numel, offset=1, segments=_straddling_segments(numel), **cfg)


def test_kernels_run_on_the_current_stream():
    # Inputs are written on a side stream behind a long kernel; the fused kernel and scale_copy_
    # must queue behind them on that (current) stream. Results are read after an event on the
    # side stream, never a device-wide synchronize, so a launch on another stream would be seen.
    n = (1 << 20) + 3
    side = torch.cuda.Stream()
    want_p = torch.linspace(-1, 1, n, device=DEV)
    want_c = torch.linspace(2, 3, n, device=DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        param = torch.zeros(n, device=DEV)
        comm = torch.zeros(n, device=DEV)
        out = torch.zeros(n, device=DEV)
        seg = torch.tensor([[0, n, 0]], dtype=torch.int64, device=DEV)
        torch.cuda._sleep(200_000_000)
        param.copy_(want_p)
        comm.copy_(want_c)
        _C.mix_and_step(kind=NONE, param=param, grad=None, states=[], comm=comm, send=None,
                        segments=seg, groups=[hyper_row()], mix_a=0.25, mix_b=0.75,
                        send_scale=1.0, grad_scale=1.0)
        _C.scale_copy_(out, param, 2.0)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    mixed = 0.25 * want_p + 0.75 * want_c
    torch.testing.assert_close(param, mixed, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, 2.0 * mixed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_group_many_segments(dtype):
    # num_groups == 1 (no lookup) with a table of several segments all pointing at group 0.
    numel = 100003
    segs = [(0, 5, 0), (5, 50001, 0), (50001, numel, 0)]
    run_case(kind=ADAM, dtype=dtype, numel=numel, segments=segs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", [NONE, SGD, ADAM, ACCUM_ADAM])
@pytest.mark.parametrize("numel", [7, 1000003])
def test_skip_update_mixes_and_sends_only(kind, dtype, numel):
    torch.manual_seed(11)
    nan_grad = lambda n: torch.full((n,), float("nan"), device=DEV)  # noqa: E731
    run_case(kind=kind, dtype=dtype, numel=numel, skip_update=True, accum_boundary=True,
             grad_fill=nan_grad)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", [NONE, SGD, ADAM, ACCUM_ADAM])
@pytest.mark.parametrize("numel", [3, 2**20 + 5])
def test_send_aliases_comm(kind, dtype, numel, offset):
    torch.manual_seed(5)
    run_case(kind=kind, dtype=dtype, numel=numel, offset=offset, send_aliases_comm=True,
             accum_boundary=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", [NONE, SGD, ADAM, ACCUM_ADAM])
@pytest.mark.parametrize("comm_send", [(False, True), (True, False), (False, False)],
                         ids=["send_only", "comm_only", "neither"])
def test_optional_comm_and_send(kind, dtype, comm_send):
    has_comm, has_send = comm_send
    torch.manual_seed(3)
    param, _, _ = run_case(kind=kind, dtype=dtype, numel=1000003, has_comm=has_comm,
                           has_send=has_send)
    assert bool(torch.isfinite(param).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM_ADAM])
@pytest.mark.parametrize("which", ["param", "comm", "send", "grad", "state"])
def test_not_co_aligned_buffers(kind, dtype, which):
    # One buffer at a different offset than the others: the scalar fallback must be exact too.
    torch.manual_seed(9)
    run_case(kind=kind, dtype=dtype, numel=100003, offsets={which: 1}, accum_boundary=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_head_peeling_offsets(dtype, offset):
    # All buffers at the same misalignment: vector path with a scalar head.
    torch.manual_seed(offset)
    run_case(kind=ACCUM_ADAM, dtype=dtype, numel=4099, offset=offset, accum_boundary=True,
             segments=_straddling_segments(4099), hyper=MULTI_HYPER)


def test_consecutive_steps_accumulate():
    # Three AccumAdamW steps, boundary at the last, against the reference applied three times.
    torch.manual_seed(21)
    numel = 2**20 + 5
    param = torch.randn(numel, device=DEV)
    states = [torch.zeros(numel, device=DEV) for _ in range(3)]
    ref_p = param.double()
    ref_states = [s.double() for s in states]
    segs = [(0, numel, 0)]
    seg_t = torch.tensor(segs, dtype=torch.int64, device=DEV)
    for t in (1, 2, 3):
        hyper = [hyper_row(lr=1e-2, weight_decay=0.01, step=1, accum_iter=3)]
        grad = torch.randn(numel, device=DEV)
        comm = torch.randn(numel, device=DEV)
        send = torch.full_like(param, float("nan"))
        boundary = t == 3
        p_in = ref_p.float()  # the reference continues from the kernel's fp32 state
        s_in = [s.clone() for s in states]
        ref_p, ref_states, ref_send = reference_mix_and_step(
            ACCUM_ADAM, p_in, grad, s_in, comm, True, segs, hyper, 0.5, 0.5, 1.0, 1.0,
            True, False, boundary, False)
        _C.mix_and_step(kind=ACCUM_ADAM, param=param, grad=grad, states=states, comm=comm,
                        send=send, segments=seg_t, groups=hyper, mix_a=0.5, mix_b=0.5,
                        send_scale=1.0, grad_scale=1.0, decoupled_weight_decay=True,
                        accum_boundary=boundary)
        torch.cuda.synchronize()
        assert_matches(param, ref_p, f"param step {t}")
        for k in range(3):
            assert_matches(states[k], ref_states[k], f"state{k} step {t}", fp32_atol=1e-7)
        assert torch.equal(send, param)  # send_scale 1: p as stored, bit for bit
        ref_p = param.double()
    assert bool((states[2] == 0).all())


# ---------------------------------------------------------------------------------------------
# Gradient factor read from device memory: grad_norm / scaler_scale / clip_norm
# ---------------------------------------------------------------------------------------------



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(GRAD_NORM_CASES))
@pytest.mark.parametrize("kcase", ["sgd_momentum", "adam", "accum_adamw_boundary"])
def test_device_grad_factor(kcase, case, dtype):
    # The kernel reads the norm and the scaler's scale from device memory and derives the factor:
    # against the reference with grad_scale = the factor computed in float64 here.
    norm, scale, clip = GRAD_NORM_CASES[case]
    torch.manual_seed(23)
    run_case(dtype=dtype, numel=100003, segments=_straddling_segments(100003), hyper=MULTI_HYPER,
             grad_norm=norm, scaler_scale=scale, clip_norm=clip, zero_grad=True,
             **KIND_CASES[kcase])
    run_case(dtype=dtype, numel=7, offset=1, grad_norm=norm, scaler_scale=scale, clip_norm=clip,
             **KIND_CASES[kcase])


@pytest.mark.parametrize("case", list(GRAD_NORM_CASES))
@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM_ADAM])
def test_device_grad_factor_equals_host_factor(kind, case):
    # The factor read from device memory and the same factor passed as grad_scale (from the host
    # binding of the same rule) give bit-identical results.
    norm, scale, clip = GRAD_NORM_CASES[case]
    factor, skip = _C.grad_factor(norm, 1.0 if scale is None else scale, clip)
    assert not skip
    n = 100003
    torch.manual_seed(29)
    p0, g0, c0 = torch.randn(n, device=DEV), torch.randn(n, device=DEV) * 100, torch.randn(n, device=DEV)
    nstates = {SGD: 1, ADAM: 2, ACCUM_ADAM: 3}[kind]
    seg_t = torch.tensor([[0, n, 0]], dtype=torch.int64, device=DEV)
    outs = []
    for device_read in (True, False):
        p, states = p0.clone(), [torch.full((n,), 0.01, device=DEV) for _ in range(nstates)]
        kw = dict(kind=kind, param=p, grad=g0.clone(), states=states, comm=c0.clone(),
                  segments=seg_t, groups=[hyper_row(weight_decay=0.01, momentum=0.9)], mix_a=0.5,
                  mix_b=0.5, accum_boundary=True)
        if device_read:
            kw.update(grad_norm=torch.tensor([norm], device=DEV), clip_norm=clip,
                      scaler_scale=None if scale is None else torch.tensor([scale], device=DEV))
        else:
            kw.update(grad_scale=factor)
        _C.mix_and_step(**kw)
        outs.append([p] + states)
    torch.cuda.synchronize()
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SKIP_NORM_CASES))
@pytest.mark.parametrize("kind", [SGD, ADAM, ACCUM_ADAM])
@pytest.mark.parametrize("comm_send", [(True, True), (False, False)], ids=["comm_send", "neither"])
def test_device_grad_factor_non_finite_skips(kind, case, dtype, comm_send):
    # A non-finite unscaled norm skips the update (states untouched, checked in run_case) but the
    # kernel still mixes, sends and zeroes grad: against the reference with skip_update=True.
    norm, scale, clip = SKIP_NORM_CASES[case]
    assert grad_factor64(norm, 1.0 if scale is None else scale, clip)[1]
    torch.manual_seed(31)
    nan_grad = (lambda n: torch.full((n,), float("nan"), device=DEV)) if case != "overflow" else None
    for numel in (7, 1000003):
        run_case(kind=kind, dtype=dtype, numel=numel, grad_norm=norm, scaler_scale=scale,
                 clip_norm=clip, accum_boundary=True, grad_fill=nan_grad, has_comm=comm_send[0],
                 has_send=comm_send[1], zero_grad=True)


def test_device_grad_factor_tensors_must_be_on_the_device():
    p = torch.randn(1000, device=DEV)
    g = torch.randn(1000, device=DEV)
    seg_t = torch.tensor([[0, 1000, 0]], dtype=torch.int64, device=DEV)
    kw = dict(kind=SGD, param=p, grad=g, segments=seg_t, groups=[hyper_row()])
    with pytest.raises(RuntimeError, match=r"grad_norm is on cpu but param is on cuda"):
        _C.mix_and_step(**kw, grad_norm=torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match=r"scaler_scale is on cpu but param is on cuda"):
        _C.mix_and_step(**kw, grad_norm=torch.tensor([1.0], device=DEV),
                        scaler_scale=torch.tensor([2.0]))
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# zero_grad: grad zeroed in the same pass
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
@pytest.mark.parametrize("numel", [1, 7, 37, 1000003])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(KIND_CASES))
def test_zero_grad_matches_reference(case, dtype, numel, offset):
    torch.manual_seed(numel * 5 + offset)
    run_case(dtype=dtype, numel=numel, offset=offset, zero_grad=True, **KIND_CASES[case])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["sgd_momentum", "adamw", "accum_adamw_boundary"])
def test_zero_grad_groups_and_straddling_segments(case, dtype):
    numel = 100_003
    torch.manual_seed(2)
    cfg = dict(KIND_CASES[case])
    cfg["hyper"] = MULTI_HYPER
    run_case(dtype=dtype, numel=numel, segments=_straddling_segments(numel), zero_grad=True,
             **cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", [NONE, SGD, ADAM, ACCUM_ADAM])
@pytest.mark.parametrize("comm_send", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["comm_send", "comm_only", "send_only", "neither"])
@pytest.mark.parametrize("numel", [7, 1000003])
def test_zero_grad_skip_update_nan(kind, dtype, comm_send, numel):
    # Non-finite gradients: not read, but zeroed (the next iteration must not see them).
    torch.manual_seed(13)
    nan_grad = lambda n: torch.full((n,), float("nan"), device=DEV)  # noqa: E731
    run_case(kind=kind, dtype=dtype, numel=numel, skip_update=True, accum_boundary=True,
             grad_fill=nan_grad, has_comm=comm_send[0], has_send=comm_send[1], zero_grad=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("which", ["param", "grad", "comm"])
def test_zero_grad_not_co_aligned(dtype, which):
    torch.manual_seed(17)
    run_case(kind=ADAM, dtype=dtype, numel=100003, offsets={which: 1}, zero_grad=True)


def test_zero_grad_needs_grad_and_no_alias():
    p = torch.randn(1000, device=DEV)
    g = torch.randn(1000, device=DEV)
    seg_t = torch.tensor([[0, 1000, 0]], dtype=torch.int64, device=DEV)
    with pytest.raises(RuntimeError, match="needs grad"):
        _C.mix_and_step(kind=SGD, param=p, grad=None, states=[], segments=seg_t,
                        groups=[hyper_row()], skip_update=True, zero_grad=True)
    with pytest.raises(RuntimeError, match="must not share memory with send"):
        _C.mix_and_step(kind=SGD, param=p, grad=g, states=[], send=g, segments=seg_t,
                        groups=[hyper_row()], zero_grad=True)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# scale_copy_
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (0, 1), (3, 3)], ids=str)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_copy(dtype, numel, offsets, inplace):
    if inplace and offsets[0] != offsets[1]:
        pytest.skip("in place needs one buffer")
    torch.manual_seed(numel)
    src = _buffer(numel, dtype, offsets[1], _randn(3.0))
    alpha = 1.0 / 3.0
    ref = _f32(alpha) * src.double()
    if inplace:
        dst = src
    else:
        dst = _buffer(numel, dtype, offsets[0], lambda n: torch.full((n,), float("nan"),
                                                                     device=DEV))
        src_before = src.clone()
    _C.scale_copy_(dst, src, alpha)
    torch.cuda.synchronize()
    assert_matches(dst, ref, "scale_copy dst", fp32_rtol=1e-6, fp32_atol=0.0)
    if not inplace:
        assert torch.equal(src, src_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_copy_alpha_one_is_exact_copy(dtype):
    src = torch.randn(2**20 + 5, device=DEV).to(dtype)
    dst = torch.full_like(src, float("nan"))
    _C.scale_copy_(dst, src, 1.0)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)


@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (0, 1)], ids=str)
@pytest.mark.parametrize("numel", [0, 7, 1000003, 2**24 + 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_copy_sumsq(dtype, numel, offsets):
    """The copy of a gradient into its bucket with its squared norm in the same pass: an exact
    copy; every slot written (poisoned before); the slots' sum against float64; the same bits on
    a second run into the same buffers (a fixed reduction order; the split into blocks depends on
    the buffers' alignment, so another destination may sum in another order)."""
    torch.manual_seed(numel + 1)
    src = _buffer(numel, dtype, offsets[1], _randn(3.0))
    dst = _buffer(numel, dtype, offsets[0], lambda n: torch.full((n,), float("nan"), device=DEV))
    sumsq = torch.full((_C.NORM_SLOTS,), float("nan"), device=DEV)
    _C.scale_copy_(dst, src, 1.0, sumsq)
    again = torch.full_like(sumsq, float("nan"))
    _C.scale_copy_(dst, src, 1.0, again)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    assert torch.isfinite(sumsq).all()
    torch.testing.assert_close(sumsq.double().sum(), src.double().square().sum(), rtol=1e-5, atol=1e-6)
    assert torch.equal(again, sumsq)
    if numel > 1:
        src[numel // 2] = float("nan")
        _C.scale_copy_(dst, src, 1.0, sumsq)
        assert not torch.isfinite(sumsq.sum())


@pytest.mark.parametrize("kind", ["SGD", "ADAM", "ACCUM_ADAM"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_update_group_matches_cpu(kind, dtype):
    """Segments of a no_update group (parameters without a gradient) on the GPU: the same result as
    the CPU kernel (bit for bit in fp32), their parameters mixed only and state untouched."""
    n, cut = 1000003, 400037
    torch.manual_seed(3)
    p, c, g = (torch.randn(n).to(dtype) for _ in range(3))
    nst = {"SGD": 1, "ADAM": 2, "ACCUM_ADAM": 3}[kind]
    states = [torch.rand(n) * 0.1 for _ in range(nst)]
    live = _C.GroupHyper(lr=0.05, weight_decay=0.1, momentum=0.9, bias_step=3, accum_iter=2)
    frozen = _C.GroupHyper(lr=0.05, weight_decay=0.1, momentum=0.9, bias_step=3, accum_iter=2, no_update=True)
    outs = []
    for dev in ("cpu", DEV):
        pk, gk, sk = p.clone().to(dev), g.clone().to(dev), [s.clone().to(dev) for s in states]
        _C.mix_and_step(kind=getattr(_C.OptKind, kind), param=pk, grad=gk, states=sk, comm=c.to(dev),
                        segments=torch.tensor([[0, cut, 0], [cut, n, 1]], device=dev), groups=[live, frozen],
                        mix_a=0.25, mix_b=0.75, decoupled_weight_decay=True, accum_boundary=True, zero_grad=True)
        outs.append([pk.cpu()] + [s.cpu() for s in sk])
    torch.cuda.synchronize()
    for a, b in zip(*outs):
        if dtype == torch.float32:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-2, atol=1e-3)
    for a, s in zip(outs[1][1:], states):
        assert torch.equal(a[cut:], s[cut:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deferred_verdict_matches_cpu(dtype):
    """The flag in device memory picks the bias corrections as the CPU kernel does with the same
    flag in host memory (fp32: bit for bit; one arithmetic, update.h)."""
    n = 1000003
    torch.manual_seed(7)
    p, g = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    m0, v0 = torch.randn(n) * 0.1, torch.rand(n) * 0.01
    hyper = _C.GroupHyper(lr=1e-2, weight_decay=0.1, bias_step=5)
    for flag in (False, True):
        outs = []
        for dev in ("cpu", DEV):
            pk, st = p.clone().to(dev), [m0.clone().to(dev), v0.clone().to(dev)]
            _C.mix_and_step(kind=_C.OptKind.ADAM, param=pk, grad=g.to(dev), states=st,
                            segments=torch.tensor([[0, n, 0]], device=dev), groups=[hyper],
                            decoupled_weight_decay=True, prev_skip=torch.tensor([flag], device=dev),
                            alt_bias_steps=[4])
            outs.append((pk.cpu(), st[0].cpu(), st[1].cpu()))
        torch.cuda.synchronize()
        for a, b in zip(*outs):
            if dtype == torch.float32:
                assert torch.equal(a, b), f"prev_skip={flag}"
            else:
                torch.testing.assert_close(a.double(), b.double(), rtol=1e-2, atol=1e-3)


def test_no_pending_cuda_error():
    # Everything above ran on the current stream; a sticky error would surface here.
    torch.cuda.synchronize()
    x = torch.ones(1, device=DEV)
    assert float(x.sum()) == 1.0


def test_send_aliasing_param_is_refused():
    p = torch.randn(1000, device=DEV)
    g = torch.randn(1000, device=DEV)
    seg_t = torch.tensor([[0, 1000, 0]], dtype=torch.int64, device=DEV)
    with pytest.raises((RuntimeError, ValueError)):
        _C.mix_and_step(kind=SGD, param=p, grad=g, states=[], send=p, segments=seg_t,
                        groups=[hyper_row()])
    torch.cuda.synchronize()
