"""SparseLoCo's outer exchange kernels (csrc/kernels/sparse.h) against the rule re-computed element by
element (tests/sparse_reference.py): the message's bytes, the error buffer and the members' mean,
bit for bit, on the CPU; the CUDA kernels against the CPU ones where a GPU is present. Bad layouts
and tensors get errors naming them. The training through both faces is in test_local_sgd.py and
test_local_steps_home.py.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch

import sparse_reference as R
from decentpy.local_steps import SparseOuter
from decentpy.optim import kernels


def _inputs(n: int, seed: int, ties: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    theta = torch.randn(n, generator=g)
    error = torch.randn(n, generator=g) * 0.1
    if ties:  # many equal magnitudes: the lower offset goes first
        theta = torch.round(theta * 2) / 2
        x = torch.zeros(n)
        error = torch.zeros(n)
    return x, theta, error


CASES = [(1000, 64, 8, 0.5, False), (300, 64, 8, 0.0, False), (64, 64, 64, 1.0, False), (4100, 4096, 64, 0.5, False),
         (257, 16, 4, 0.5, True), (3, 4, 4, 0.5, False), (0, 64, 8, 0.5, False)]


@pytest.mark.parametrize("n,chunk,k,decay,ties", CASES)
def test_pack_matches_the_rule_bit_for_bit(n: int, chunk: int, k: int, decay: float, ties: bool) -> None:
    x, theta, error = _inputs(n, n + chunk, ties)
    want_wire, want_error = R.pack(x, theta, error, chunk, k, decay)
    wire = torch.empty(kernels.sparse_wire_bytes(n, chunk, k), dtype=torch.uint8)
    assert wire.numel() == R.wire_bytes(n, chunk, k)
    got_error = error.clone()
    kernels.sparse_pack(x, theta, got_error, wire, chunk, k, decay)
    assert bytes(wire.numpy()) == want_wire
    assert torch.equal(got_error, want_error)
    if n:  # what was sent plus what stays is the error-fed pseudo-gradient
        sent = R.decode(want_wire, n, chunk, k)
        assert int((sent != 0).sum()) <= R.wire_bytes(n, chunk, k)
        full = decay * error.double() + (theta - x).double()
        torch.testing.assert_close((sent + got_error).double(), full, rtol=0, atol=1e-6)


def test_the_selection_keeps_the_largest_and_sends_about_a_density_of_the_bytes() -> None:
    n, chunk, k = 8192, 4096, 64
    x, theta, error = _inputs(n, 3)
    wire = torch.empty(SparseOuter(k=k, chunk=chunk).wire_bytes(n), dtype=torch.uint8)
    e = error.clone()
    kernels.sparse_pack(x, theta, e, wire, chunk, k, 0.95)
    sent = R.decode(bytes(wire.numpy()), n, chunk, k)
    full = 0.95 * error + (theta - x)
    for c in range(n // chunk):
        part = slice(c * chunk, (c + 1) * chunk)
        chosen = sent[part] != 0
        assert int(chosen.sum()) == k
        # every chosen magnitude is at least every unchosen one
        assert float(full[part][chosen].abs().min()) >= float(full[part][~chosen].abs().max())
    assert wire.numel() == 2 * (8 + 3 * k // 2 + k // 4)  # per chunk: two scales, k 12-bit offsets, k codes
    assert wire.numel() / (4 * n) < 0.0074  # 0.73% of the fp32 bytes at 64 of 4096


@pytest.mark.parametrize("members", [1, 3, 4])
def test_mean_matches_the_rule_bit_for_bit(members: int) -> None:
    n, chunk, k = 700, 64, 12
    wires = []
    for t in range(members):
        x, theta, error = _inputs(n, 10 + t)
        w = torch.empty(kernels.sparse_wire_bytes(n, chunk, k), dtype=torch.uint8)
        kernels.sparse_pack(x, theta, error, w, chunk, k, 0.5)
        wires.append(w)
    out = torch.full((n,), float("nan"))
    kernels.sparse_mean(wires, out, chunk, k)
    want = R.mean([bytes(w.numpy()) for w in wires], n, chunk, k)
    assert torch.equal(out, want)


def test_bad_layouts_and_tensors_are_named() -> None:
    n = 100
    x, theta, error = _inputs(n, 0)
    wire = torch.empty(kernels.sparse_wire_bytes(n, 64, 8), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="chunk must be a power of two"):
        kernels.sparse_pack(x, theta, error, wire, 48, 8, 0.5)
    with pytest.raises(RuntimeError, match="k must be a multiple of 4"):
        kernels.sparse_pack(x, theta, error, wire, 64, 6, 0.5)
    with pytest.raises(RuntimeError, match="decay must be in"):
        kernels.sparse_pack(x, theta, error, wire, 64, 8, 1.5)
    with pytest.raises(RuntimeError, match="wire must be a contiguous uint8 tensor of sparse_wire_bytes"):
        kernels.sparse_pack(x, theta, error, wire[:-1], 64, 8, 0.5)
    with pytest.raises(RuntimeError, match="theta must be a contiguous float32 tensor"):
        kernels.sparse_pack(x, theta.double(), error, wire, 64, 8, 0.5)
    with pytest.raises(RuntimeError, match="error must not share memory with theta"):
        kernels.sparse_pack(x, theta, theta, wire, 64, 8, 0.5)
    with pytest.raises(RuntimeError, match="1 to 128 input messages"):
        kernels.sparse_mean([], torch.empty(n), 64, 8)
    for bad, text in [(dict(chunk=8192), "chunk must be a power of two in"), (dict(k=6), "k must be a multiple of 4"),
                      (dict(decay=-0.1), "decay must be in"), (dict(k=128, chunk=64), "k must be a multiple of 4")]:
        with pytest.raises(ValueError, match=text):
            SparseOuter(**bad).check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA kernels are compiled, not run")
@pytest.mark.parametrize("n,chunk,k,decay,ties", CASES)
def test_cuda_kernels_match_the_cpu_bit_for_bit(n: int, chunk: int, k: int, decay: float, ties: bool) -> None:
    x, theta, error = _inputs(n, n + chunk, ties)
    decay = 0.95 if decay == 0.5 else decay  # (the fused multiply-add on both)
    wire = torch.empty(kernels.sparse_wire_bytes(n, chunk, k), dtype=torch.uint8)
    e = error.clone()
    kernels.sparse_pack(x, theta, e, wire, chunk, k, decay)
    dev = torch.device("cuda")
    wd = torch.empty_like(wire, device=dev)
    ed = error.to(dev)
    kernels.sparse_pack(x.to(dev), theta.to(dev), ed, wd, chunk, k, decay)
    assert torch.equal(wd.cpu(), wire) and torch.equal(ed.cpu(), e)
    out, outd = torch.empty(n), torch.empty(n, device=dev)
    kernels.sparse_mean([wire, wire], out, chunk, k)
    kernels.sparse_mean([wd, wd], outd, chunk, k)
    assert torch.equal(outd.cpu(), out)
