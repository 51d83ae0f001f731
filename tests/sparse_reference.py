"""SparseLoCo's outer exchange re-computed from its stated rule (decentpy/local_steps/sparse.py and
csrc/kernels/sparse.h's contract) with numpy float32 scalars, one element at a time: the reference
the kernels' bytes and buffers are compared with. Slow; for buffers of a few thousand elements.

Rounding: every operation is one float32 rounding, as the contract states, except the error
update ``decay * e + d``, which the kernels compute as a fused multiply-add: a ``decay`` whose
products are exact in float32 (0, 0.5, 1) makes both the same.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

F = np.float32


def _layout(n: int, chunk: int, k: int) -> Tuple[int, List[int]]:
    chunks = -(-n // chunk)
    ks = [min(k, n - c * chunk) for c in range(chunks)]
    return chunks, ks


def wire_bytes(n: int, chunk: int, k: int) -> int:
    chunks, ks = _layout(n, chunk, k)
    s = sum(ks)
    return 8 * chunks + (3 * s + 1) // 2 + (s + 3) // 4


def pack(x: torch.Tensor, theta: torch.Tensor, error: torch.Tensor, chunk: int, k: int,
         decay: float) -> Tuple[bytes, torch.Tensor]:
    """(the message's bytes, the new error buffer) for float32 ``x``, ``theta``, ``error``."""
    xs, ts, es = (t.detach().cpu().numpy().astype(np.float32) for t in (x, theta, error))
    n = xs.size
    e = np.empty(n, dtype=np.float32)
    for i in range(n):
        e[i] = F(F(decay) * es[i]) + F(ts[i] - xs[i])
    chunks, ks = _layout(n, chunk, k)
    scales = np.zeros(2 * chunks, dtype=np.float32)
    offsets: List[int] = []
    codes: List[int] = []
    for c in range(chunks):
        base, size, kc = c * chunk, min(chunk, n - c * chunk), ks[c]
        order = sorted(range(size), key=lambda j: (-abs(float(e[base + j])) if not math.isnan(e[base + j])
                                                    else -math.inf, j))
        sel = sorted(order[:kc])
        vals = [e[base + j] for j in sel]
        total = F(0)
        for v in vals:
            total = F(total + F(abs(v)))
        a = F(total / F(kc))
        lo, hi, nlo, nhi = F(0), F(0), 0, 0
        for v in vals:
            if F(abs(v)) >= a:
                hi, nhi = F(hi + F(abs(v))), nhi + 1
            else:
                lo, nlo = F(lo + F(abs(v))), nlo + 1
        s_lo = F(lo / F(nlo)) if nlo else F(0)
        s_hi = F(hi / F(nhi)) if nhi else F(0)
        scales[2 * c], scales[2 * c + 1] = s_lo, s_hi
        for j, v in zip(sel, vals):
            code = (1 if v < 0 else 0) | (2 if F(abs(v)) >= a else 0)
            s = s_hi if code & 2 else s_lo
            e[base + j] = F(v - (-s if code & 1 else s))
            offsets.append(j)
            codes.append(code)
    packed = bytearray((len(codes) + 3) // 4)
    for t, code in enumerate(codes):
        packed[t // 4] |= code << (2 * (t % 4))
    twelve = bytearray((3 * len(offsets) + 1) // 2)  # 12 bits per offset, the lower slot first
    for t, o in enumerate(offsets):
        bit = 12 * t
        for b in range(12):
            if (o >> b) & 1:
                twelve[(bit + b) // 8] |= 1 << ((bit + b) % 8)
    wire = scales.tobytes() + bytes(twelve) + bytes(packed)
    assert len(wire) == wire_bytes(n, chunk, k)
    return wire, torch.from_numpy(e)


def decode(wire: bytes, n: int, chunk: int, k: int) -> torch.Tensor:
    """The float32 values of one message (zero where it sends nothing)."""
    chunks, ks = _layout(n, chunk, k)
    s = sum(ks)
    scales = np.frombuffer(wire[:8 * chunks], dtype=np.float32)
    twelve = wire[8 * chunks:8 * chunks + (3 * s + 1) // 2]
    offsets = [sum(((twelve[(12 * t + b) // 8] >> ((12 * t + b) % 8)) & 1) << b for b in range(12)) for t in range(s)]
    codes = wire[8 * chunks + (3 * s + 1) // 2:]
    out = np.zeros(n, dtype=np.float32)
    t = 0
    for c in range(chunks):
        for _ in range(ks[c]):
            code = (codes[t // 4] >> (2 * (t % 4))) & 3
            v = scales[2 * c + 1] if code & 2 else scales[2 * c]
            out[c * chunk + int(offsets[t])] = -v if code & 1 else v
            t += 1
    return torch.from_numpy(out)


def mean(wires: Sequence[bytes], n: int, chunk: int, k: int) -> torch.Tensor:
    """The members' mean: their decoded values added in order, then times float32(1 / m)."""
    acc = np.zeros(n, dtype=np.float32)
    for w in wires:
        acc = (acc + decode(w, n, chunk, k).numpy()).astype(np.float32)
    inv = F(F(1) / F(len(wires)))
    return torch.from_numpy((acc * inv).astype(np.float32))
