"""A faulty peer is bounded and named (issue 52): what arrives from a peer is checked before it is mixed
(decentpy/engine/peer_check.py).

Unit tests of the rules against float64 re-computations written from them (the mix factor, the skip
row, the bound of the history, the sketch and the group verdict), kernel tests of the new passes and of
the kernel's ``mix_factor`` against torch ops, and the probe suite: one faulty member among 4 gloo
workers on ``ring`` and ``alternating-exp-ring`` (2 nodes x 2), faults on the wire
(tests/peer_check_probe.py), one spawn per topology.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List

import pytest
import torch

from decentpy import FaultyPeerError, PeerCheck, PeerFaultyError, PeerReportedError, PeerTimeoutError
from decentpy.comm.failures import faulty_peer_of
from decentpy.engine import peer_check as pc
from decentpy.optim import kernels
from decentpy.optim.grad_scaling import UNSCALED
from dist_harness import run_workers
from peer_check_probe import FAULTY, LR_JUMP, OWN_NAN, probe_worker

pytestmark = pytest.mark.timeout(300)

MASK = (1 << 64) - 1


# -- float64 re-computations of the rules -----------------------------------------------------------


def mix64(x: int) -> int:
    """splitmix64's finaliser, as csrc/kernels/peer_check.h writes it."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def sketch64(y: torch.Tensor, seed: int, k: int) -> List[float]:
    """The sketch of csrc/kernels/peer_check.h, element by element in float64: k slots, sum y^2, and
    the non-finite indicator (0, or NaN)."""
    n = y.numel()
    L = 1
    while L < 256 and 2 * L * 16 * k <= n:
        L *= 2
    vals = y.double().tolist()
    out = [0.0] * k
    sig = [-1.0 if mix64((j + mix64(~seed & MASK)) & MASK) >> 63 else 1.0 for j in range(L)]
    for c in range((n + L - 1) // L):
        x = mix64(c ^ seed)
        slot, t = (x & 0xFFFFFFFF) % k, (-1.0 if x >> 63 else 1.0)
        out[slot] += t * math.fsum(sig[j] * vals[c * L + j] for j in range(min(L, n - c * L)))
    return out + [math.fsum(v * v for v in vals), math.fsum(v - v for v in vals)]


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def peer_mix_rule(a: float, b: float, f: float) -> tuple:
    """The factor on the mix, from its definition: p + f (c - p) in place of c (a + b = 1 for a pair)."""
    if not f > 0:
        return 1.0, 0.0, False
    if f >= 1:
        return a, b, True
    return a + b * (1 - f), b * f, True


# -- the arithmetic ----------------------------------------------------------------------------------


@pytest.mark.parametrize("a,b,f", [(0.5, 0.5, 1.0), (0.5, 0.5, 2.0), (0.5, 0.5, 0.25), (0.75, 0.25, 0.6),
                                   (1 / 3, 2 / 3, 0.1), (0.5, 0.5, 0.0), (0.5, 0.5, -1.0), (0.5, 0.5, float("nan")),
                                   (0.0, 1.0, 0.0)])
def test_mix_factor_coefficients_follow_the_rule(a: float, b: float, f: float) -> None:
    got = kernels.peer_mix(a, b, f)
    want = peer_mix_rule(f32(a), f32(b), f32(f) if not math.isnan(f) else f)
    assert got[2] == want[2]
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=1e-7) and got[1] == pytest.approx(want[1], rel=1e-6)
    if f >= 1:  # an accepted contribution mixes with exactly the coefficients it would without the check
        assert (got[0], got[1]) == (f32(a), f32(b))
    if want[2] and a + b == 1:  # a pair's row stays a convex combination
        assert got[0] + got[1] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("f", [1.0, 0.4, 0.0])
def test_kernel_mix_factor_against_torch(dtype: torch.dtype, f: float) -> None:
    torch.manual_seed(0)
    n = 1000
    p0 = torch.randn(n).to(dtype)
    c = (torch.randn(n) * 3).to(dtype)
    if f == 0.0:
        c[::7] = float("nan")  # never read: a NaN there must not reach p
    a, b = 0.5, 0.5
    p = p0.clone()
    kernels.mix(p, c, a, b, mix_factor=torch.tensor([f]))
    ra, rb, reads = peer_mix_rule(a, b, f)
    want = p0.double() if not reads else ra * p0.double() + rb * c.double()
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert torch.isfinite(p).all()
    assert torch.allclose(p.double(), want, rtol=tol, atol=tol)
    if f == 1.0:  # bit for bit the plain mix
        q = p0.clone()
        kernels.mix(q, c, a, b)
        assert torch.equal(p, q)
    if f == 0.0:
        assert torch.equal(p, p0)


def test_fused_step_with_mix_factor_is_the_step_with_the_factors_coefficients() -> None:
    """A fused optimizer pass (SGD with momentum) with ``mix_factor`` f: the same bits as the pass with
    peer_mix's coefficients; with f = 0 and a NaN comm, the pass without comm."""
    from decentpy.optim.fused import SGD

    torch.manual_seed(1)
    n = 777

    def run(comm: Any, a: float, b: float, factor: Any) -> torch.Tensor:
        p = torch.nn.Parameter(torch.linspace(-1, 1, n))
        opt = SGD([p], lr=0.1, momentum=0.9)
        g = torch.linspace(0.5, -0.5, n)
        for _ in range(2):
            opt.bucket_step([p], [0], p.data, g.clone(), kernels.segments_for_numel(n, p.device), comm, None, a, b,
                            1.0, UNSCALED, False, mix_factor=factor)
            opt.finish_bucket_step(True)
        return p.detach().clone()

    c = torch.randn(n)
    a2, b2, _ = kernels.peer_mix(0.5, 0.5, 0.3)
    assert torch.equal(run(c, 0.5, 0.5, torch.tensor([0.3])), run(c, a2, b2, None))
    bad = c.clone()
    bad[::5] = float("nan")
    assert torch.equal(run(bad, 0.5, 0.5, torch.tensor([0.0])), run(None, 1.0, 0.0, None))


def test_mix_factor_is_checked() -> None:
    p, c = torch.zeros(10), torch.ones(10)
    with pytest.raises(RuntimeError, match="mix_factor"):
        kernels.mix(p, c, 0.5, 0.5, mix_factor=torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match="no comm"):
        kernels.mix(p, None, 0.5, 0.5, mix_factor=torch.tensor([0.5]))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.mix(p, c, 0.5, 0.5, mix_factor=torch.tensor([0.5], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 37, 5000, 300_001])
def test_peer_stats_against_float64(dtype: torch.dtype, n: int) -> None:
    torch.manual_seed(n)
    p = torch.randn(n).to(dtype)
    c = (p.float() + 0.01 * torch.randn(n)).to(dtype)
    d2, p2, cnf, pnf = kernels.peer_stats(p, c).tolist()
    want_d2 = float(((c.double() - p.double()) ** 2).sum())
    want_p2 = float((p.double() ** 2).sum())
    assert d2 == pytest.approx(want_d2, rel=1e-4, abs=1e-12) and p2 == pytest.approx(want_p2, rel=1e-4)
    assert cnf == 0 and pnf == 0
    d2, p2, cnf, pnf = kernels.peer_stats(p, None).tolist()
    assert d2 == 0 and cnf == 0 and p2 == pytest.approx(want_p2, rel=1e-4)
    for bad in (float("nan"), float("inf"), float("-inf")):
        cb, pb = c.clone(), p.clone()
        cb[n // 2] = bad
        assert math.isnan(kernels.peer_stats(p, cb)[2].item()) and kernels.peer_stats(p, cb)[3].item() == 0
        pb[n - 1] = bad
        assert math.isnan(kernels.peer_stats(pb, c)[3].item())
    again = kernels.peer_stats(p, c)
    assert torch.equal(again, kernels.peer_stats(p, c))  # the same bits every run


def test_peer_stats_same_bits_for_any_thread_count() -> None:
    torch.manual_seed(3)
    p, c = torch.randn(400_003), torch.randn(400_003)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.peer_stats(p, c).clone()
        s1 = kernels.peer_sketch(p, 7, 32).clone()
        torch.set_num_threads(2)
        assert torch.equal(one, kernels.peer_stats(p, c))
        assert torch.equal(s1, kernels.peer_sketch(p, 7, 32))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n,k", [(5, 4), (100, 8), (3000, 32), (70_000, 32)])
def test_sketch_against_float64(n: int, k: int) -> None:
    torch.manual_seed(n)
    y = torch.randn(n)
    got = kernels.peer_sketch(y, 12345, k).tolist()
    want = sketch64(y, 12345, k)
    scale = math.sqrt(want[k])
    for g, w in zip(got[:k], want[:k]):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-12 * scale)
    assert got[k] == pytest.approx(want[k], rel=1e-12) and got[k + 1] == 0
    y[n // 3] = float("nan")
    assert math.isnan(kernels.peer_sketch(y, 12345, k)[k + 1].item())


def test_sketch_is_linear_and_estimates_the_norm() -> None:
    torch.manual_seed(5)
    n, k = 20_000, 32
    x, z = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    xs, zs = x.float(), z.float()
    # linear: S(x) + S(z) = S(x + z) up to the rounding of x + z in float32
    lhs = kernels.peer_sketch(xs, 9, k)[:k] + kernels.peer_sketch(zs, 9, k)[:k]
    rhs = kernels.peer_sketch(xs + zs, 9, k)[:k]
    assert torch.allclose(lhs, rhs, rtol=0, atol=1e-4)
    # E ||S d||^2 = ||d||^2 over the seeds (each a draw of the signs)
    d = (xs - zs)
    ests = [float((kernels.peer_sketch(d, seed, k)[:k] ** 2).sum()) for seed in range(60)]
    assert statistics.mean(ests) == pytest.approx(float((d.double() ** 2).sum()), rel=0.15)
    # a single seed is within a factor that leaves a bound of 10 its meaning
    assert all(0.3 < e / float((d.double() ** 2).sum()) < 2.5 for e in ests)


def sampled_indices(n: int, sample: int) -> torch.Tensor:
    """The elements the passes read with ``sample`` (csrc/kernels/peer_check.h): unit u of SAMPLE_UNIT
    elements when u % sample == 0, in order."""
    unit = kernels.SAMPLE_UNIT
    idx = torch.arange(n)
    return idx[(idx // unit) % sample == 0]


@pytest.mark.parametrize("n", [1, 64, 65, 1000, 70_001])
@pytest.mark.parametrize("sample", [1, 3, 8])
def test_sampled_passes_read_the_sampled_elements(n: int, sample: int) -> None:
    torch.manual_seed(n + sample)
    p, c = torch.randn(n), torch.randn(n)
    idx = sampled_indices(n, sample)
    assert kernels.peer_sampled_count(n, sample) == idx.numel()
    d2, p2, cnf, pnf = kernels.peer_stats(p, c, sample=sample).tolist()
    assert d2 == pytest.approx(float(((c[idx].double() - p[idx].double()) ** 2).sum()), rel=1e-4, abs=1e-9)
    assert p2 == pytest.approx(float((p[idx].double() ** 2).sum()), rel=1e-4, abs=1e-9)
    k = 8
    got = kernels.peer_sketch(p, 77, k, sample=sample).tolist()
    want = sketch64(p[idx], 77, k)
    scale = math.sqrt(want[k]) if want[k] else 1.0
    assert all(g == pytest.approx(w, rel=1e-12, abs=1e-12 * scale) for g, w in zip(got, want))
    if sample > 1 and n > kernels.SAMPLE_UNIT + 1:  # an element the sample does not read is not seen
        q = c.clone()
        q[kernels.SAMPLE_UNIT + 1] = float("nan")
        assert kernels.peer_stats(p, q, sample=sample)[2].item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_element_guard_against_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    n = 5000
    p0 = torch.randn(n).to(dtype)
    c = (p0.float() + 0.01 * torch.randn(n)).to(dtype)
    a, b, g = 0.5, 0.5, 0.2
    # within the guard everywhere: the plain mix, bit for bit
    p, q = p0.clone(), p0.clone()
    count = torch.zeros(1, dtype=torch.int64)
    kernels.mix(p, c, a, b, mix_guard=g, mix_guarded=count)
    kernels.mix(q, c, a, b)
    assert torch.equal(p, q) and count.item() == 0
    # outliers (NaN, inf, beyond the guard) keep p, and are counted; where p itself is not finite, not counted
    bad = c.clone()
    bad[[3, 700, 4999]] = torch.tensor([float("nan"), float("inf"), 1e6]).to(dtype)
    own = p0.clone()
    own[11] = float("nan")
    p = own.clone()
    count.zero_()
    kernels.mix(p, bad, a, b, mix_guard=g, mix_guarded=count)
    mixed = (a * own.double() + b * bad.double())
    keep = ~((mixed - own.double()).abs() <= g)
    want = torch.where(keep, own.double(), mixed)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(p), fin) and torch.allclose(p.double()[fin], want[fin], rtol=tol, atol=tol)
    assert count.item() == 3 and keep.sum().item() == 4


def test_pair_verdict_follows_the_rule() -> None:
    def stats(d: float, pn: float, c_ok: bool = True, p_ok: bool = True) -> torch.Tensor:
        return torch.tensor([d * d, pn * pn, 0.0 if c_ok else float("nan"), 0.0 if p_ok else float("nan")],
                            dtype=torch.float64)

    skip, clip, rais = pc.SkipPolicy(), pc.ClipPolicy(), pc.RaisePolicy()
    for policy in (skip, clip, rais):
        f, d, tau, c_ok, p_ok = pc.pair_verdict(stats(0.5, 3.0), 2.0, 1.0, policy).tolist()
        assert (f, d, tau, c_ok, p_ok) == (1.0, 0.5, 2.0, 1.0, 1.0)  # within: mixed as it is
        f, *_ = pc.pair_verdict(stats(0.5, 3.0, c_ok=False), 2.0, 1.0, policy).tolist()
        assert f == 0.0  # not finite: dropped whatever the policy
        f, *_ = pc.pair_verdict(stats(0.5, 3.0, p_ok=False), 2.0, 1.0, policy).tolist()
        assert f == 0.0  # this replica not finite: nothing read (it takes the peer's values instead)
    assert pc.pair_verdict(stats(8.0, 3.0), 2.0, 1.0, skip)[0].item() == 0.0
    assert pc.pair_verdict(stats(8.0, 3.0), 2.0, 1.0, rais)[0].item() == 0.0
    assert pc.pair_verdict(stats(8.0, 3.0), 2.0, 1.0, clip)[0].item() == pytest.approx(2.0 / 8.0)  # min(1, tau / d)
    # the first bound: relative to this replica's norm
    f, d, tau, *_ = pc.pair_verdict(stats(2.9, 3.0), None, 1.0, skip).tolist()
    assert (f, tau) == (1.0, 3.0)
    assert pc.pair_verdict(stats(3.1, 3.0), None, 1.0, skip)[0].item() == 0.0
    # the clipped mix in float64: p + w f (c - p), i.e. the pair row (w + (1-w)(1-f), (1-w) f)
    w, fc = 0.5, 0.25
    a, b, _ = peer_mix_rule(w, 1 - w, fc)
    p, c = 1.0, 9.0
    assert a * p + b * c == pytest.approx(p + (1 - w) * fc * (c - p))


def test_history_bound_rule() -> None:
    hist = [(0, 1.0), (1, 2.0), (2, 3.0), (3, 100.0), (4, 5.0)]
    assert pc.history_bound([], 5, 10.0, 16) is None
    assert pc.history_bound(hist, 1, 10.0, 1) is None  # nothing from steps <= 1 - 2
    assert pc.history_bound(hist, 2, 10.0, 1) == 10.0 * 1.0
    assert pc.history_bound(hist, 4, 10.0, 3) == 10.0 * 2.0  # steps 0..2
    assert pc.history_bound(hist, 4, 10.0, 4) is None  # not yet a full window: the first bound
    assert pc.history_bound(hist, 6, 10.0, 5) == 10.0 * statistics.median([1, 2, 3, 100, 5])
    assert pc.history_bound(hist, 6, 10.0, 2) == 10.0 * statistics.median([100, 5])  # the last window only


def _fingerprints(xs: List[torch.Tensor], scale: float, seed: int, k: int) -> torch.Tensor:
    rows = []
    for x in xs:
        s = kernels.peer_sketch(x * scale, seed, k)
        rows.append(torch.cat([(s[-1:] != 0).double(), s[k:k + 1], s[:k]]))
    return torch.stack(rows)


def test_group_verdict_names_a_scaled_member_and_an_inconsistent_sum() -> None:
    torch.manual_seed(2)
    m, n, k, s = 4, 4000, pc.SKETCH_SLOTS, 0.25
    base = torch.randn(n)
    xs = [base + 0.01 * torch.randn(n) for _ in range(m)]
    seed = pc.SKETCH_SEED

    def verdict(members: List[torch.Tensor], sent: List[torch.Tensor], tau: Any) -> List[float]:
        fp = _fingerprints(members, s, seed, k)
        total = sum(x * s for x in sent)
        return pc.group_verdict(fp, kernels.peer_sketch(total, seed, k), s, 2.0 ** -24, tau, 1.0).tolist()

    v = verdict(xs, xs, None)
    f, consistent, tau, cn = v[:4]
    ds, bad = v[4:4 + m], v[4 + m:]
    assert f == 1.0 and consistent == 1.0 and not any(bad)
    assert cn == pytest.approx(float(base.norm()), rel=0.3) and tau == cn  # the first bound: the center's norm
    # each distance against the float64 rule on the members' float64 sketches
    sk = torch.stack([torch.tensor(sketch64(x * s, seed, k)[:k], dtype=torch.float64) / s for x in xs])
    srt = sk.sort(dim=0).values
    center = (srt[1] + srt[2]) / 2
    want = torch.linalg.vector_norm(sk - center, dim=1)
    assert torch.allclose(torch.tensor(ds, dtype=torch.float64), want, rtol=1e-9, atol=1e-12)
    # a member sending 1e4 x its parameters, with a fingerprint of what it sends: named
    lied = [x.clone() for x in xs]
    lied[3] *= 1e4
    v = verdict(lied, lied, None)
    assert v[0] == 0.0 and v[1] == 1.0 and v[4 + m:] == [0.0, 0.0, 0.0, 1.0]
    # a member whose data is not what it fingerprinted (sign flipped after the fingerprint): inconsistent
    sent = [x.clone() for x in xs]
    sent[2] = -sent[2]
    v = verdict(xs, sent, 1e9)
    assert v[0] == 0.0 and v[1] == 0.0 and v[4 + m:] == [0.0] * m
    # a non-finite member: named, and the sum is not finite either
    nan = [x.clone() for x in xs]
    nan[1][::3] = float("nan")
    v = verdict(nan, nan, 1e9)
    assert v[0] == 0.0 and v[4 + m + 1] == 1.0
    # the bound of the history: a member beyond it is named, within it the group mixes
    v = verdict(xs, xs, 1e-6)
    assert v[0] == 0.0 and all(v[4 + m:])
    v = verdict(xs, xs, 10.0)
    assert v[0] == 1.0


def test_peer_check_argument() -> None:
    assert pc.resolve_peer_check("raise") == PeerCheck("raise", 10.0, 16)
    assert pc.resolve_peer_check(None).policy == "off"
    assert pc.resolve_peer_check(PeerCheck("clip", 3.0, 8)) == PeerCheck("clip", 3.0, 8)
    with pytest.raises(ValueError, match="'skip'.*'clip'.*'raise'.*'off'.*got 'drop'"):
        PeerCheck("drop")
    with pytest.raises(ValueError, match="bound must be a finite number > 1.*got 0.5"):
        PeerCheck("skip", 0.5)
    with pytest.raises(ValueError, match="window must be an int >= 1.*got 0"):
        PeerCheck("skip", 10.0, 0)
    with pytest.raises(TypeError, match="peer_check must be a policy name"):
        pc.resolve_peer_check(3)  # type: ignore[arg-type]


def test_faulty_peer_errors() -> None:
    err = FaultyPeerError("FaultyPeerError: rank 0: faulty peer rank 3 sent ...", 3, 1, 7, 1e4, 2.0, [0, 3])
    assert (err.peer, err.bucket, err.step, err.distance, err.bound, err.group) == (3, 1, 7, 1e4, 2.0, [0, 3])
    assert faulty_peer_of(str(err)) == 3 and faulty_peer_of("nothing") == -1
    other = PeerFaultyError("rank 1: ... faulty peer rank 3 ...", [0], 1, 7, 1.0, peer=3)
    assert isinstance(other, FaultyPeerError) and isinstance(other, PeerReportedError)
    assert isinstance(other, PeerTimeoutError) and other.peer == 3 and other.ranks == [0]


# -- the probes --------------------------------------------------------------------------------------


def guard_worker(rank: int, world: int) -> Dict[str, Any]:
    """Two ranks, a bucket large enough to be sampled: a clean run is bit for bit the unchecked one (the
    sample and the kernel's element guard included), and one element of rank 1's send corrupted where the
    sample does not read it (NaN once, 1e30 once) is kept out of rank 0's mix by the guard, and named."""
    import logging

    from decentpy import DecentralizedDataParallel
    from peer_check_probe import Records

    out: Dict[str, Any] = {}
    unsampled = kernels.SAMPLE_UNIT + 5  # unit 1: not read when the sample is one unit in 2 or more
    for name, check, value in (("clean", None, None), ("off", "off", None), ("nan", None, float("nan")),
                               ("huge", None, 1e30)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))
        records = Records()
        logging.getLogger("decentpy").addHandler(records)
        ddp = DecentralizedDataParallel(model, torch_sgd, topology="ring",
                                        **({} if check is None else {"peer_check": check}))
        assert pc.sample_for(ddp.buckets[0].numel) > 1
        if value is not None and rank == 1:
            comm, send_recv = ddp.communicator, ddp.communicator.send_recv
            keep: List[torch.Tensor] = []

            def bad_send(bucket: int, peer: int, send: torch.Tensor, recv: torch.Tensor, k: List[int] = [0]) -> Any:
                k[0] += 1
                if k[0] == 6:
                    send = send.detach().clone()
                    send[unsampled] = value
                    keep.append(send)
                return send_recv(bucket, peer, send, recv)

            comm.send_recv = bad_send
        g = torch.Generator().manual_seed(rank)
        for _ in range(10):
            x = torch.randn(8, 512, generator=g)
            ddp(x).square().mean().backward()
        ddp.wait()
        logging.getLogger("decentpy").removeHandler(records)
        out[name] = {"params": [p.detach().clone() for p in model.parameters()], "stats": ddp.stats(),
                     "warnings": records.lines}
        ddp.close()
    return out


def torch_sgd(named: Any) -> Any:
    return torch.optim.SGD([p for _, p in named], lr=0.05)


def test_sampled_check_and_element_guard() -> None:
    res = run_workers(guard_worker, 2, timeout=120)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(res[r]["clean"]["params"], res[r]["off"]["params"])), r
        assert res[r]["clean"]["stats"]["peer_checks_failed"] == 0
    for name in ("nan", "huge"):
        got = res[0][name]
        assert all(torch.isfinite(p).all() and p.abs().max() < 100 for p in got["params"]), name
        assert got["stats"].get("peer_checks_failed_rank1", 0) == 1, (name, got["stats"])
        assert any("faulty peer rank 1" in m and "did not read" in m for m in got["warnings"]), got["warnings"]



def float64_worker(rank: int, world: int) -> Dict[str, Any]:
    """float64 parameters (torch's path, the passes read a float32 copy) on 3 ranks: ``complete`` (a group
    of 3: the fingerprints' own float64 all-reduce) and ``ring`` (pairs): a clean run flags nothing, and
    rank 2 sending NaN once is dropped by the others (named by a pair)."""
    from decentpy import DecentralizedDataParallel

    out: Dict[str, Any] = {}
    for topology in ("complete", "ring"):
        for name, fault in (("clean", False), ("off", False), ("nan", True)):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
            ddp = DecentralizedDataParallel(model, torch_sgd, topology=topology,
                                            **({"peer_check": "off"} if name == "off" else {}))
            if fault and rank == 2:
                launch, k = ddp.communicator.all_reduce, [0]
                send_recv = ddp.communicator.send_recv

                def poison(t: torch.Tensor) -> torch.Tensor:
                    k[0] += 1
                    return t.detach().clone().fill_(float("nan")) if k[0] == 4 else t

                # the body (1-D; the fingerprints' rows are 2-D)
                ddp.communicator.all_reduce = lambda b, ranks, buf: launch(b, ranks, buf.copy_(poison(buf))  # type: ignore[method-assign]
                                                                           if buf.dim() == 1 else buf)
                ddp.communicator.send_recv = lambda b, peer, send, recv: send_recv(b, peer, poison(send), recv)  # type: ignore[method-assign]
            g = torch.Generator().manual_seed(rank)
            for _ in range(8):
                ddp(torch.randn(4, 6, generator=g, dtype=torch.float64)).square().mean().backward()
            ddp.wait()
            out[f"{topology}/{name}"] = {"params": [p.detach().clone() for p in model.parameters()],
                                         "stats": ddp.stats()}
            ddp.close()
    return out


def test_float64_parameters_are_checked() -> None:
    res = run_workers(float64_worker, 3, timeout=180)
    for topology in ("complete", "ring"):
        for r in range(3):
            clean, off = res[r][f"{topology}/clean"], res[r][f"{topology}/off"]
            assert clean["stats"]["peer_checks"] > 0 and clean["stats"]["peer_checks_failed"] == 0, (topology, r)
            assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(clean["params"], off["params"]))
        for r in (0, 1):  # the honest ranks: finite, and rank 2 named
            got = res[r][f"{topology}/nan"]
            assert all(torch.isfinite(p).all() for p in got["params"]), (topology, r)
        # a pair names rank 2; in the group its NaN was put on the wire after its fingerprint (data that does
        # not match its fingerprint): detected by every member, dropped, not named (docs/failures.md)
        key = "peer_checks_failed_rank2" if topology == "ring" else "peer_checks_failed_unnamed"
        assert any(res[r][f"{topology}/nan"]["stats"].get(key, 0) >= 1 for r in (0, 1)), \
            (topology, [res[r][f"{topology}/nan"]["stats"] for r in (0, 1)])


CLEAN, OFF = "clean/skip", "clean/off"
LIMIT = 1.5  # the others' final loss, at most this times the clean run's


def _runs(topology: str) -> List[tuple]:
    runs = [(CLEAN, None, None, "exchange"), (OFF, "off", None, "exchange"), ("clean/lagged", None, None, "lagged")]
    faults = ["1e4 once (step 0)", "1e4 once (step 19)", "NaN once (step 9)", "sign flip every step",
              "random every step"]
    runs += [(f"{f}/skip", None, f, "exchange") for f in faults]
    runs += [("1e4 once (step 19)/off", "off", "1e4 once (step 19)", "exchange"),
             ("NaN once (step 9)/off", "off", "NaN once (step 9)", "exchange"),
             ("sign flip every step/lagged", None, "sign flip every step", "lagged"),
             ("1e4 once (step 0)/clip", "clip", "1e4 once (step 0)", "exchange"),
             (f"{OWN_NAN}/skip", None, OWN_NAN, "exchange"),
             (f"{LR_JUMP}/skip", None, LR_JUMP, "exchange"), (f"{LR_JUMP}/off", "off", LR_JUMP, "exchange")]
    if topology != "ring":
        runs.append(("sign flip every step/comm", None, "sign flip every step", "comm"))
    return runs


@pytest.fixture(scope="module", params=["ring", "alternating-exp-ring"])
def probes(request: Any) -> tuple:
    topology = request.param
    raise_fault = "1e4 once (step 19)"  # AER: mixed in the group of 4; ring: by a pair
    return topology, run_workers(probe_worker, 4, topology, _runs(topology), raise_fault, timeout=240)


def _others(res: List[Dict[str, Any]], name: str, key: str = "loss") -> List[Any]:
    return [res[r][name][key] for r in range(4) if r != FAULTY]


def test_clean_run_is_bit_identical_to_off(probes: tuple) -> None:
    """Nothing flagged: the checked run is the unchecked one, bit for bit where every exchange is a pair
    (ring); where groups of more than two sum their bodies with the fingerprints' tail (AER's group of
    4), the backend splits the longer buffer otherwise for its sum, so the two runs agree to float32
    rounding only (the same mean, the additions in another order)."""
    topology, res = probes
    for r in range(4):
        assert all(torch.equal(a, b) for a, b in zip(res[r][CLEAN]["params"], res[r]["clean/lagged"]["params"])), r
        pairs = [(a, b) for a, b in zip(res[r][CLEAN]["params"], res[r][OFF]["params"])]
        if topology == "ring":
            assert all(torch.equal(a, b) for a, b in pairs), r
        else:
            assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in pairs), \
                (r, max(float((a - b).abs().max()) for a, b in pairs))
        s = res[r][CLEAN]["stats"]
        assert s["peer_checks"] > 0 and s["peer_checks_failed"] == 0, (topology, r, s)
        assert res[r][CLEAN]["warnings"] == [], (topology, r)
        assert res[r][OFF]["stats"]["peer_checks"] == 0


@pytest.mark.parametrize("fault", ["1e4 once (step 0)", "1e4 once (step 19)", "NaN once (step 9)",
                                   "sign flip every step", "random every step"])
def test_default_policy_bounds_a_faulty_peer_and_names_it(probes: tuple, fault: str) -> None:
    topology, res = probes
    clean = _others(res, CLEAN)
    got = _others(res, f"{fault}/skip")
    assert all(math.isfinite(g) and g <= LIMIT * c for g, c in zip(got, clean)), (topology, fault, got, clean)
    # named in the logs of the ranks that received its contribution, and counted in their stats
    named = [r for r in range(4) if r != FAULTY and any(f"faulty peer rank {FAULTY}" in m
                                                        for m in res[r][f"{fault}/skip"]["warnings"])]
    counted = [r for r in range(4) if r != FAULTY and res[r][f"{fault}/skip"]["stats"].get(
        f"peer_checks_failed_rank{FAULTY}", 0) > 0]
    assert named and named == counted, (topology, fault, named, counted)
    if fault.endswith("every step"):
        # every neighbour of the faulty rank: ring 0 and 2; alternating-exp-ring its node's pair (2) and the
        # group of 4 (0, 1); rate-limited: one warning per bucket, not one per step
        assert named == ([0, 2] if topology == "ring" else [0, 1, 2]), (topology, fault, named)
        for r in named:
            lines = [m for m in res[r][f"{fault}/skip"]["warnings"] if "faulty peer" in m]
            assert len(lines) <= 4, (topology, r, lines)


def test_off_reproduces_the_fault(probes: tuple) -> None:
    topology, res = probes
    clean = _others(res, OFF)
    assert all(g > 1000 * c for g, c in zip(_others(res, "1e4 once (step 19)/off"), clean))
    assert all(math.isnan(g) for g in _others(res, "NaN once (step 9)/off"))


def test_lagged_verdicts_and_clip(probes: tuple) -> None:
    """The GPU's way (the verdict read a step late, the kernel reading the factor) on the CPU, and
    ClippedGossip under a single fault."""
    topology, res = probes
    for name, base in (("sign flip every step/lagged", CLEAN), ("1e4 once (step 0)/clip", CLEAN)):
        got, clean = _others(res, name), _others(res, base)
        assert all(g <= LIMIT * c for g, c in zip(got, clean)), (topology, name, got, clean)


def test_own_nonfinite_parameters_are_named_and_replaced(probes: tuple) -> None:
    topology, res = probes
    run = res[FAULTY][f"{OWN_NAN}/skip"]
    assert math.isfinite(run["loss"]) and run["stats"].get("nonfinite_param_checks", 0) > 0, run["stats"]
    lines = [m for m in run["warnings"] if "not finite" in m]
    assert lines and all("parameters" in m for m in lines), lines
    assert not any("nothing non-finite was sent" in m for m in lines), lines
    if topology == "ring":  # a pair at every step: it takes its peer's values at once
        assert run["stats"]["params_taken_from_peer"] > 0
    clean = _others(res, CLEAN)
    assert all(g <= LIMIT * c for g, c in zip(_others(res, f"{OWN_NAN}/skip"), clean))


def test_a_change_of_scale_on_every_rank_is_not_a_faulty_peer(probes: tuple) -> None:
    """Every rank's learning rate x10 at once: the distances jump past the bound on every peer together;
    the check does not split the replicas for good (its history restarts) and the run ends as the
    unchecked one does."""
    topology, res = probes
    got, off = _others(res, f"{LR_JUMP}/skip"), _others(res, f"{LR_JUMP}/off")
    assert all(g <= LIMIT * o for g, o in zip(got, off)), (topology, got, off)

    def spread(name: str) -> float:  # the largest distance between two ranks' final parameters
        flat = [torch.cat([p.reshape(-1) for p in res[r][name]["params"]]) for r in range(4)]
        return max(float((a - b).norm()) for a in flat for b in flat)

    assert spread(f"{LR_JUMP}/skip") <= 2 * spread(f"{LR_JUMP}/off"), topology  # not split for good
    for r in range(4):  # a few contributions at the jump, not every one after it (30 steps x 2 buckets)
        assert res[r][f"{LR_JUMP}/skip"]["stats"]["peer_checks_failed"] <= 2 * pc.RESET_STREAK, (topology, r)


def test_group_data_that_does_not_match_its_fingerprint(probes: tuple) -> None:
    topology, res = probes
    if topology == "ring":
        pytest.skip("no group of more than two ranks on a ring")
    got, clean = _others(res, "sign flip every step/comm"), _others(res, CLEAN)
    assert all(g <= LIMIT * c for g, c in zip(got, clean))
    for r in (0, 1):  # they see rank 3 only in the group: detected, not named
        lines = res[r]["sign flip every step/comm"]["warnings"]
        assert any("does not match its members' fingerprints" in m for m in lines), (r, lines)
        assert res[r]["sign flip every step/comm"]["stats"].get("peer_checks_failed_unnamed", 0) > 0


def test_raise_names_the_faulty_peer_on_every_rank(probes: tuple) -> None:
    topology, res = probes
    for r in range(4):
        got = res[r]["raise"]
        assert "FaultyPeerError" in got["types"], (topology, r, got)
        assert got["peer"] == FAULTY and f"faulty peer rank {FAULTY}" in got["text"], (topology, r, got)
        assert got["s"] < 15, (topology, r, got)
    detected = [r for r in range(4) if res[r]["raise"]["types"][0] == "FaultyPeerError"]
    assert detected, "some rank raised FaultyPeerError itself"
    assert any("distance" in res[r]["raise"]["text"] and "bound" in res[r]["raise"]["text"] for r in detected)
