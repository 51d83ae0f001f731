"""Diagnosis on a lent GPU (issue 26): the fused kernel under the wrapper's launch settings, one
factor at a time; and an NCCL self-exchange (blocking / non-blocking; the exchange first, as in
tests/test_nccl_comm.py).

    python3 -m tools.gpu_diag kernel | nccl-blocking | nccl-nonblocking
"""

from __future__ import annotations

import sys

import torch

from tools.cuda_sync import time_ms


def kernel() -> None:
    from decentpy.optim import kernels as K

    n = 4096 * 4096 + 4096  # one Linear(4096, 4096) bucket: weight and bias
    p = torch.randn(n, device="cuda")
    g = torch.randn(n, device="cuda") * 1e-5
    m = torch.zeros(n, device="cuda")
    v = torch.zeros(n, device="cuda")
    one = K.segments_for_numel(n, torch.device("cuda"))
    two = torch.tensor([[0, 4096, 1], [4096, n, 0]], dtype=one.dtype).cuda()
    norm = torch.ones(1, device="cuda")
    hyp1 = [K.GroupHyper(lr=1e-4, weight_decay=0.01, bias_step=10)]
    hyp2 = hyp1 + [K.GroupHyper(lr=1e-4, weight_decay=0.0, bias_step=10)]
    moved = 8 * n * 4  # p, g, m, v read; p, m, v, g (zeros) written
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = time_ms(lambda: dst.copy_(src), 30, 5)
    print(f"copy of the same bytes: {t_copy:.3f} ms")
    for name, segs, hyp, zero, gn in [("1 group", one, hyp1, False, None), ("2 groups", two, hyp2, False, None),
                                      ("1 group + zero_grad", one, hyp1, True, None),
                                      ("1 group + grad_norm", one, hyp1, False, norm),
                                      ("2 groups + zero + norm (the wrapper)", two, hyp2, True, norm)]:
        def run() -> None:
            K.fused_step(K.OptKind.ADAM, p, g, [m, v], segs, hyp, grad_norm=gn, zero_grad=zero,
                         decoupled_weight_decay=True)
        t = time_ms(run, 30, 5)
        print(f"{name:40s} {t:.3f} ms  ({100 * t_copy / t:.0f}% of copy)")
    g.normal_().mul_(1e-5)  # gradients back (zero_grad cleared them)
    torch.cuda.synchronize()


def nccl(blocking: bool) -> None:
    from decentpy import _C

    comm = _C.NcclCommunicator(_C.nccl_get_unique_id(), 0, 1, 0, 30000, blocking=blocking)
    print("init ok", _C.nccl_info(), flush=True)
    n = 1 << 20
    send = torch.arange(n, device="cuda", dtype=torch.float32)
    recv = torch.zeros(n, device="cuda")
    work = comm.exchange(send, recv, 0, "self")
    print("exchange launched", flush=True)
    work.wait(10_000)
    torch.cuda.synchronize()
    print("exchange ok", bool(torch.equal(send, recv)), work.peers, flush=True)
    work = comm.all_reduce(send, "ar")
    work.wait(10_000)
    torch.cuda.synchronize()
    print("all_reduce ok", flush=True)
    comm.close()


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "kernel":
        kernel()
    else:
        nccl(what == "nccl-blocking")
