"""Compressed gossip (CHOCO with per-edge public copies for pairs, a shared public mean for larger
groups): the fused kernel pass and the group reduction against a float64 re-computation, training
through the wrapper against tests/compression_reference.py, global-mean
preservation, bytes per step against the formula, checkpoints, and the refusals.

Tolerances. Both sides apply the same quantiser, but the fp32 implementation and the float64
reference may round a value that sits within fp32 precision of a rounding boundary (an int8 code
half-way between two integers, a bf16 tie) to different neighbours. Such a flip moves that element
by one rounding unit of its block, and the error feedback keeps it at that size. So every element
must agree within rtol 1e-5 of the parameters' scale, except elements that differ by at most a few
rounding units (2 x the largest unit seen by the reference), and those must be rare (<= 1%).
A group shares one public mean, so a flip in an owner's re-quantised mean moves that element on
every member at once, and the gradients spread the difference (far below a unit) to more elements
step after step: on the 1312-element model with complete SGD int8, 2 elements beyond 1e-5 after 4
steps, 17 after 5, 131 after 8, the largest 0.14 units (ring on the same model: 2 after 8 steps).
So the group runs here are 4 steps long, or 5 on the 2-block MLP (Join).
"""

from __future__ import annotations

import io
import math
import time
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

from compression_reference import (CODE_MAX, INT8_BLOCK, FlatModels, flat_layout, group_schedule,
                                   one_peer_exp_partner, pair_schedule, quantize64, ring_partner, simulate_choco)
from dist_harness import run_workers
from reference import IN, OUT, batch, decentpy_optim_fn, loss_fn, make_mlp, REF_OPTIMIZERS

STEPS = 4
GAMMA = 0.8
COMBOS = [(topo, opt, kind) for topo in ("ring", "one-peer-exp") for opt in ("sgd", "adamw") for kind in ("int8", "bf16")]
# groups of more than two ranks: complete (one group of 4) and alternating-exp-ring with 2 ranks per node
# (a group of 4, then the node pairs)
# complete runs SGD: with AdamW a single rounding flip at step 2 (a value within fp32 precision of a
# rounding boundary, here of the owner's re-quantised mean) spreads through the gradients into ~10% of
# the elements at step 4, each off by under a third of a rounding unit, which the flip count below
# cannot tell from a bug; AdamW with the block-scaled group path is covered by int4 on the AER group.
COMBOS += [("complete", "sgd", "int8"), ("alternating-exp-ring", "sgd", "int8"),
           ("alternating-exp-ring", "adamw", "bf16")]
# a wider model (a 1312-element bucket: 6 scale blocks, the last partial), so that every member of the group
# of 4 owns a chunk (1, 2, 1 and 2 blocks); the default MLP (2 blocks) leaves two members without one
COMBOS += [("complete+wide", "sgd", "int8"), ("complete+wide", "adamw", "bf16")]
# int4: a pair topology and a group one
COMBOS += [("ring", "sgd", "int4"), ("alternating-exp-ring", "adamw", "int4")]
LOCAL_WORLD_SIZE = {"alternating-exp-ring": 2}
# compressed exchanges between nodes: 2 nodes of 2 ranks, the node pair every step; shard: each rank
# compresses its half of the bucket for the same half on the other node; allreduce: the node mean
NODE_COMBOS = [("ring/shard", "adamw", "int8"), ("ring/allreduce", "sgd", "bf16"), ("ring/shard", "sgd", "int4")]
COMBOS += NODE_COMBOS


def _wire(kind: str, n: int) -> int:
    """The documented wire size: bf16 2n; int8 / int4 the fp32 block scales, then n or ceil(n/2) code bytes."""
    if kind == "bf16":
        return 2 * n
    return 4 * (-(-n // INT8_BLOCK)) + (n if kind == "int8" else -(-n // 2))


def _decode(kind: str, q: torch.Tensor, n: int) -> torch.Tensor:
    """D(q) in float64 from the wire bytes, read as docs/compression.md lays them out: the fp32 block
    scales, then the codes (int8: a byte each; int4: two's-complement nibbles, the even element low)."""
    nb = -(-n // INT8_BLOCK)
    scales = q[:4 * nb].view(torch.float32).double()
    if kind == "int8":
        codes = q[4 * nb:].view(torch.int8).double()
    else:
        b = q[4 * nb:].to(torch.int32)
        nib = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)
        codes = torch.where(nib >= 8, nib - 16, nib).double()
        assert codes.numel() == n + n % 2
        if n % 2:
            assert int(nib[-1]) == 0, "int4, odd count: the last high nibble is padding 0"
        codes = codes[:n]
    assert float(codes.abs().max()) <= CODE_MAX[kind]
    return codes * scales.repeat_interleave(INT8_BLOCK)[:n]


def check_close(got: torch.Tensor, want: torch.Tensor, unit: float, what: str) -> None:
    """Elementwise within 1e-5 of the scale, but for rare single-rounding-unit flips (see the module doc)."""
    scale = max(1.0, float(want.abs().max()))
    err = (got.double() - want).abs()
    exact = err <= 1e-5 * scale
    flips = ~exact
    assert bool((err[flips] <= 2.0 * unit + 1e-5 * scale).all()), (
        f"{what}: max error {float(err.max()):.3g} beyond one rounding unit ({unit:.3g})")
    assert int(flips.sum()) <= max(2, got.numel() // 100), (
        f"{what}: {int(flips.sum())} of {got.numel()} elements differ by a rounding unit (more than 1%)")


# ---------------------------------------------------------------------------------------------
# The kernel pass alone
# ---------------------------------------------------------------------------------------------

def _kernel_case(kind: str, opt: str, seed: int = 0) -> None:
    from decentpy.optim import kernels
    from decentpy.optim.compression import Compression

    c = Compression(kind, gamma=0.7)
    g = torch.Generator().manual_seed(seed)
    n = 3 * INT8_BLOCK + 77  # a partial last block
    x = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 0.1
    peer = x + 0.01 * torch.randn(n, generator=g)
    mine = x + 0.01 * torch.randn(n, generator=g)
    nxt = x + 0.01 * torch.randn(n, generator=g)
    # the bytes a peer sent: a real q of some difference
    sender = peer.clone()
    q_recv = torch.zeros(c.wire_bytes(n), dtype=torch.uint8)
    src = torch.randn(n, generator=g) * 0.02 + sender
    kernels.compressed_step(kernels.OptKind.NONE, c.compressor, src.clone(), None, [], None, [], q_send=q_recv,
                            self_copy_next=sender)
    dq_recv = sender.double() - peer.double()  # what D(q_recv) is (the sender's copy moved by exactly it)
    # two parameter groups: [0, 300) and [300, n)
    segments = torch.tensor([[0, 300, 0], [300, n, 1]], dtype=torch.int64)
    if opt == "sgd":
        hyper = [kernels.GroupHyper(lr=0.05, momentum=0.9, weight_decay=0.01),
                 kernels.GroupHyper(lr=0.1, momentum=0.9)]
        states = [torch.randn(n, generator=g) * 0.01]
        okind, decoupled = kernels.OptKind.SGD, False
    else:
        hyper = [kernels.GroupHyper(lr=0.01, weight_decay=0.1, bias_step=3),
                 kernels.GroupHyper(lr=0.02, bias_step=3)]
        states = [torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 1e-3]
        okind, decoupled = kernels.OptKind.ADAM, True
    q_send = torch.zeros(c.wire_bytes(n), dtype=torch.uint8)
    p, gr, st = x.clone(), grad.clone(), [s.clone() for s in states]
    pc, mc, nc = peer.clone(), mine.clone(), nxt.clone()
    kernels.compressed_step(okind, c.compressor, p, gr, st, segments, hyper, q_recv=q_recv, peer_copy=pc,
                            self_copy_mix=mc, choco_mix=0.7 * 0.5, q_send=q_send, self_copy_next=nc,
                            decoupled_weight_decay=decoupled, zero_grad=True)
    # float64 reference
    stats: Dict[str, float] = {}
    P = x.double()
    PC = peer.double() + dq_recv
    P = P + 0.7 * 0.5 * (PC - mine.double())
    G = grad.double()
    for gi, (lo, hi) in enumerate(((0, 300), (300, n))):
        h = hyper[gi]
        sl = slice(lo, hi)
        if opt == "sgd":
            gg = G[sl] + h.weight_decay * P[sl]
            buf = h.momentum * states[0].double()[sl] + gg
            P[sl] = P[sl] - h.lr * buf
        else:
            P[sl] = P[sl] * (1 - h.lr * h.weight_decay)
            m = 0.9 * states[0].double()[sl] + 0.1 * G[sl]
            v = 0.999 * states[1].double()[sl] + 0.001 * G[sl] ** 2
            P[sl] = P[sl] - h.lr / (1 - 0.9 ** 3) * m / (v.sqrt() / math.sqrt(1 - 0.999 ** 3) + 1e-8)
    dq = quantize64(kind, P - nxt.double(), stats)
    unit = stats["unit"]
    check_close(p, P, unit, f"{kind}/{opt} param")
    check_close(pc, PC, 1e-6, f"{kind}/{opt} peer copy")
    check_close(nc, nxt.double() + dq, unit, f"{kind}/{opt} next copy")
    if kind != "bf16":  # the wire layout: what the next copy moved by is what the bytes say
        assert q_send.numel() == _wire(kind, n)
        assert torch.allclose(nxt.double() + _decode(kind, q_send, n), nc.double(), rtol=0, atol=1e-6)
    assert torch.count_nonzero(gr) == 0, "zero_grad: the gradient is zeroed in the pass"
    assert torch.equal(mc, mine), "the copy used for the mix is not the next peer's: it stays"
    # the receiving end: the same bytes applied to an equal copy give a bit-identical copy
    other = nxt.clone()
    kernels.compressed_step(kernels.OptKind.NONE, c.compressor, torch.zeros(n), None, [], None, [],
                            q_recv=q_send, peer_copy=other,
                            self_copy_mix=torch.zeros(n), choco_mix=0.0)
    assert torch.equal(other, nc), "both ends of an edge must hold bit-identical copies"


@pytest.mark.parametrize("kind", ["int8", "bf16", "int4"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_kernel_pass_matches_float64(kind: str, opt: str) -> None:
    _kernel_case(kind, opt)


def _group_case(kind: str, device: str = "cpu") -> Dict[str, torch.Tensor]:
    """One owner's reduction over the chunk [256, 901) of a 1100-element bucket, 3 members."""
    from decentpy.optim import kernels
    from decentpy.optim.compression import Compression

    c = Compression(kind)
    n, lo, hi = 1100, 256, 901
    g = torch.Generator().manual_seed(3)
    qs = []
    for t in range(3):  # real q of random differences, each with its own scales
        q = torch.zeros(c.wire_bytes(n), dtype=torch.uint8)
        kernels.compressed_step(kernels.OptKind.NONE, c.compressor, torch.randn(n, generator=g) * (t + 1) * 0.01,
                                None, [], None, [], q_send=q, self_copy_next=torch.zeros(n))
        qs.append(q.to(device))
    out = torch.full((c.wire_bytes(n),), 0xAB, dtype=torch.uint8, device=device)
    mine = torch.randn(n, generator=g).to(device)
    before = mine.clone()
    kernels.group_reduce(c.compressor, qs, out, mine, lo, hi)
    return {"qs": [q.cpu() for q in qs], "out": out.cpu(), "mine": mine.cpu(), "before": before.cpu()}


@pytest.mark.parametrize("kind", ["int8", "bf16", "int4"])
def test_group_reduce_matches_float64(kind: str) -> None:
    """r = Q(mean of the members' D(q)) on the owner's chunk only; the owner's copy keeps m (D(r) - mu)."""
    from decentpy.optim import kernels
    from decentpy.optim.compression import Compression

    n, lo, hi, m = 1100, 256, 901, 3
    case = _group_case(kind)
    comp = Compression(kind).compressor
    if kind == "bf16":
        dq = [q.view(torch.bfloat16).double() for q in case["qs"]]
        got_r = case["out"].view(torch.bfloat16).double()[lo:hi]
    else:
        dq = [_decode(kind, q, n) for q in case["qs"]]
        got_r = _decode(kind, case["out"], n)[lo:hi]
    mu = sum(d[lo:hi] for d in dq) / m
    stats: Dict[str, float] = {}
    want_r = quantize64(kind, mu, stats)  # the chunk starts on a scale block: its blocks are the wire's
    check_close(got_r, want_r, stats["unit"], f"{kind} r")
    adj = case["mine"].double() - case["before"].double()
    torch.testing.assert_close(adj[lo:hi], m * (got_r - mu), rtol=0, atol=1e-6)
    assert torch.equal(case["mine"][:lo], case["before"][:lo]) and torch.equal(case["mine"][hi:], case["before"][hi:])
    # only the chunk's bytes were written
    written = torch.zeros_like(case["out"], dtype=torch.bool)
    for a, b in kernels.wire_regions(comp, n, lo, hi):
        written[a:b] = True
    assert bool((case["out"][~written] == 0xAB).all()), "bytes outside the chunk were written"
    assert kernels.wire_regions(comp, n, lo, hi) == (
        [(2 * lo, 2 * hi)] if kind == "bf16" else
        [(4, 16), (20 + lo // (1 if kind == "int8" else 2), 20 + -(-hi // (1 if kind == "int8" else 2)))])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_group_reduce_cuda_matches_cpu() -> None:
    for kind in ("int8", "bf16", "int4"):
        a, b = _group_case(kind, "cpu"), _group_case(kind, "cuda")
        for key in ("out", "mine"):
            assert_same_bits(a[key], b[key], f"{kind} {key}")


def assert_same_bits(cpu: torch.Tensor, cuda: torch.Tensor, what: str) -> None:
    """The CPU and CUDA kernels agree bit for bit (one arithmetic, compress.h), NaN equal to NaN."""
    differ = ~((cpu == cuda) | (cpu.isnan() & cuda.isnan())) if cpu.is_floating_point() else cpu != cuda
    assert not bool(differ.any()), (
        f"{what}: CUDA and CPU differ in {int(differ.sum())} of {cpu.numel()} elements, first at "
        f"{int(differ.nonzero()[0])}: cpu {cpu[differ][:4].tolist()} cuda {cuda[differ][:4].tolist()}")


def test_kernel_refuses_bad_buffers() -> None:
    from decentpy.optim import kernels

    n = 300
    p = torch.zeros(n)
    seg = None
    with pytest.raises(RuntimeError, match="take 308"):  # 2 scales + 300 codes: the right size is named
        kernels.compressed_step(kernels.OptKind.NONE, kernels.Compressor.INT8, p, None, [], seg, [],
                                q_send=torch.zeros(300, dtype=torch.uint8), self_copy_next=torch.zeros(n))
    with pytest.raises(RuntimeError, match="float32 parameters only"):
        kernels.compressed_step(kernels.OptKind.NONE, kernels.Compressor.BF16, p.bfloat16(), None, [], seg, [],
                                q_send=torch.zeros(2 * n, dtype=torch.uint8), self_copy_next=torch.zeros(n))
    with pytest.raises(RuntimeError, match="uint8"):
        kernels.compressed_step(kernels.OptKind.NONE, kernels.Compressor.BF16, p, None, [], seg, [],
                                q_send=torch.zeros(n, dtype=torch.bfloat16), self_copy_next=torch.zeros(n))
    with pytest.raises(RuntimeError, match="take 158"):  # int4: 2 scales + 150 code bytes
        kernels.compressed_step(kernels.OptKind.NONE, kernels.Compressor.INT4, p, None, [], seg, [],
                                q_send=torch.zeros(308, dtype=torch.uint8), self_copy_next=torch.zeros(n))
    with pytest.raises(RuntimeError, match="take 159"):  # an odd count: the last code byte half used
        kernels.compressed_step(kernels.OptKind.NONE, kernels.Compressor.INT4, torch.zeros(301), None, [], seg, [],
                                q_recv=torch.zeros(158, dtype=torch.uint8), peer_copy=torch.zeros(301),
                                self_copy_mix=torch.zeros(301))
    q = torch.zeros(308, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="must start at a multiple of 256"):
        kernels.group_reduce(kernels.Compressor.INT8, [q], torch.zeros(308, dtype=torch.uint8), p, 100, 300)
    with pytest.raises(RuntimeError, match="1 to 128"):
        kernels.group_reduce(kernels.Compressor.INT8, [q] * 129, torch.zeros(308, dtype=torch.uint8), p, 0, 300)
    with pytest.raises(RuntimeError, match="take 308"):
        kernels.group_reduce(kernels.Compressor.INT8, [q], torch.zeros(300, dtype=torch.uint8), p, 0, 300)
    assert kernels.compressed_bytes(kernels.Compressor.INT8, n) == 4 * 2 + n == _wire("int8", n)
    assert kernels.compressed_bytes(kernels.Compressor.BF16, n) == 2 * n
    for m in (1, 256, 257, 300, 301, 512, 513):
        assert kernels.compressed_bytes(kernels.Compressor.INT4, m) == 4 * (-(-m // 256)) + (m + 1) // 2 == _wire("int4", m)


def test_wire_slots_stay_4_byte_aligned() -> None:
    """A buffer of several members' wire slots (a group's receive bytes) starts every slot at a multiple of 4 bytes, also
    when the wire size is not one (int4 of 12 elements: 4 + 6 bytes; a shard of 4 * odd elements with
    intra_node='shard' and 8 ranks per node): the kernel reads the fp32 block scales there."""
    from decentpy.optim import kernels
    from decentpy.engine.choco import EdgeCopies, wire_buffer_bytes

    n = 12
    wire = _wire("int4", n)
    assert wire == 10 and wire_buffer_bytes(3, wire) == 2 * 12 + 10 and wire_buffer_bytes(1, wire) == wire
    st = EdgeCopies({}, {}, torch.zeros(wire, dtype=torch.uint8), wire)
    recv = torch.zeros(wire_buffer_bytes(3, wire), dtype=torch.uint8)  # a group's receive slots
    for t in range(3):
        q = st.slot(recv, t)
        assert q.numel() == wire and q.data_ptr() % 4 == 0
        kernels.compressed_step(kernels.OptKind.NONE, kernels.Compressor.INT4, torch.randn(n), None, [], None, [],
                                q_send=q, self_copy_next=torch.zeros(n))


def test_kinds_and_their_errors() -> None:
    from decentpy.optim.compression import DEFAULT_GAMMA, Compression, resolve_compression, wire_bytes

    assert Compression("int4").gamma == DEFAULT_GAMMA["int4"]
    assert resolve_compression("INT4") == Compression("int4")
    assert wire_bytes("int4", 301) == _wire("int4", 301) and wire_bytes(None, 3) == 12
    for bad in (lambda: Compression("int2"), lambda: wire_bytes("int2", 3)):
        with pytest.raises(ValueError, match="'bf16', 'int8' or 'int4', got 'int2'"):
            bad()
    with pytest.raises(TypeError, match="'bf16', 'int8' or 'int4'"):
        resolve_compression(4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_cuda_matches_cpu() -> None:
    from decentpy.optim import kernels

    for kind, comp in (("int8", kernels.Compressor.INT8), ("bf16", kernels.Compressor.BF16),
                       ("int4", kernels.Compressor.INT4)):
        n = 5 * INT8_BLOCK + 3
        g = torch.Generator().manual_seed(1)
        bufs = [torch.randn(n, generator=g) for _ in range(6)]
        seg = kernels.segments_for_numel(n, torch.device("cpu"))
        hyper = [kernels.GroupHyper(lr=0.01, weight_decay=0.1, bias_step=2)]
        wire = kernels.compressed_bytes(comp, n)
        q_recv = torch.randint(0, 255, (wire,), dtype=torch.uint8, generator=g)
        if kind != "bf16":  # every byte pattern is a valid code (int4's nibble 8 reads as -8)
            q_recv[:4 * 6].view(torch.float32).copy_(torch.rand(6, generator=g) * 0.01)
        outs = []
        for dev in ("cpu", "cuda"):
            p, gr, m, v, pc, nc = [t.clone().to(dev) for t in bufs]
            v.abs_()
            q_send = torch.zeros(wire, dtype=torch.uint8, device=dev)
            kernels.compressed_step(kernels.OptKind.ADAM, comp, p, gr, [m, v], seg.to(dev), hyper,
                                    q_recv=q_recv.to(dev), peer_copy=pc, self_copy_mix=bufs[0].to(dev), choco_mix=0.4,
                                    q_send=q_send, self_copy_next=nc, decoupled_weight_decay=True)
            outs.append([t.cpu() for t in (p, pc, nc, q_send)])
        # random bf16 codes include NaNs: equal as values, and the wire holds the one canonical NaN
        for name, a, b in zip(("param", "peer_copy", "self_copy_next", "q_send"), *outs):
            assert_same_bits(a, b, f"{kind} {name}")


# ---------------------------------------------------------------------------------------------
# Through the wrapper, 4 workers
# ---------------------------------------------------------------------------------------------

def make_model(topo: str) -> nn.Module:
    """The combo's model: ``topo`` ending in ``+wide`` takes an 80-wide hidden layer."""
    if topo.endswith("+wide"):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, 80), nn.Tanh(), nn.Linear(80, 8), nn.Tanh(), nn.Linear(8, OUT))
    return make_mlp(0)


def train_combo(rank: int, topo: str, opt: str, kind: str, steps: int, device: str = "cpu") -> Dict[str, Any]:
    """One combo through the wrapper; ``device='cuda'``: the model and batches on the GPU (several
    processes may share one; the compressed messages cross gloo through host copies)."""
    from decentpy import Compression, DecentralizedDataParallel

    model = make_model(topo).to(device)
    topo = topo.partition("+")[0]
    topo, _, intra = topo.partition("/")
    nodes = {"intra_node": intra, "local_world_size": 2} if intra else \
        {"local_world_size": LOCAL_WORLD_SIZE.get(topo, 1)}
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn(opt), topology=topo,
                                    compression=Compression(kind, gamma=GAMMA), **nodes)
    sent = []
    for k in range(steps):
        before = ddp.bytes_sent
        x, y = (t.to(device) for t in batch(rank, k))
        loss_fn(ddp(x), y).backward()
        sent.append(ddp.bytes_sent - before)
    ddp.wait()
    b = ddp.buckets[0]
    out = {"flat": b.param_block.detach().cpu().clone(), "numel": b.numel, "n_buckets": len(ddp.buckets),
           "offsets": list(b.offsets), "sent": sent, "total_sent": ddp.bytes_sent, "memory": ddp._strategy.memory_bytes(),
           "peers": list(ddp._strategy.exchange.peers)}
    ddp.close()
    return out


def _linear_mean(rank: int, kind: str, topology: str = "ring") -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients independent of x (loss = <c_{i,k}, p>): plain SGD's worker mean is
    x0 - lr * sum_k mean_i c_{i,k} whatever the mixing does, if the mixing preserves the mean."""
    from decentpy import DecentralizedDataParallel

    torch.manual_seed(0)
    model = nn.Linear(700, 1, bias=False)
    ddp = DecentralizedDataParallel(model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.5),
                                    topology=topology, local_world_size=LOCAL_WORLD_SIZE.get(topology, 1),
                                    compression=kind)
    for k in range(6):
        c = torch.Generator().manual_seed(100 * rank + k)
        coef = torch.randn(700, generator=c)
        ddp(torch.zeros(1, 700))  # arms the iteration
        (model.weight.view(-1) * coef).sum().backward()
    ddp.wait()
    w = model.weight.detach().clone().view(-1)
    ddp.close()
    torch.manual_seed(0)
    return w, nn.Linear(700, 1, bias=False).weight.detach().clone().view(-1)


class _ThreeLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(600, 1, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


def _linear_mean_buckets(rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_linear_mean`, int8 on the group of 4 (complete) with three buckets (one per layer,
    600 elements: 3 scale blocks for 4 members), so that several group exchanges are in flight at once
    through the helper thread, and ``param_as_bucket_view=False``."""
    from decentpy import DecentralizedDataParallel

    model = _ThreeLinear()
    ddp = DecentralizedDataParallel(model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.5),
                                    topology="complete", compression="int8", bucket_size_in_mb=600 * 4 / 2 ** 20,
                                    param_as_bucket_view=False)
    assert len(ddp.buckets) == 3
    for k in range(6):
        ddp(torch.zeros(1, 600))  # arms the iteration
        loss = sum((layer.weight.view(-1) * torch.randn(600, generator=torch.Generator().manual_seed(
            100 * rank + 10 * k + j))).sum() for j, layer in enumerate(model.layers))
        loss.backward()
    ddp.wait()
    w = torch.cat([layer.weight.detach().view(-1) for layer in model.layers])
    ddp.close()
    return w, torch.cat([layer.weight.detach().view(-1) for layer in _ThreeLinear().layers])


def _checkpoint(rank: int, kind: str, topology: str = "one-peer-exp") -> bool:
    from decentpy import DecentralizedDataParallel

    def make() -> DecentralizedDataParallel:
        return DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adamw"), topology=topology,
                                         local_world_size=LOCAL_WORLD_SIZE.get(topology, 1), compression=kind)

    def run(ddp: DecentralizedDataParallel, ks: range) -> None:
        for k in ks:
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()

    a = make()
    run(a, range(3))
    buf = io.BytesIO()  # as a checkpoint on disk: the state dict holds live tensors
    torch.save(a.training_state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    run(a, range(3, 6))
    a.wait()
    want = a.buckets[0].param_block.clone()
    a.close()
    b = make()
    b.load_training_state_dict(sd)
    run(b, range(3, 6))
    b.wait()
    got = b.buckets[0].param_block.clone()
    b.close()
    return bool(torch.equal(got, want))


def _refusals(rank: int) -> List[str]:
    from decentpy import DecentralizedDataParallel

    msgs = []
    for kwargs in ({"topology": "ring", "compression": "int8", "comm": "nccl"},
                   {"topology": "ring", "compression": "zstd"}):
        try:
            DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("sgd"), **kwargs)
            msgs.append("no error")
        except (ValueError, RuntimeError) as exc:
            msgs.append(str(exc))
    return msgs


CLIP = 0.05  # small enough that every step of the test clips


def _amp_and_clip(rank: int) -> Dict[str, Any]:
    """int8 ring: (a) bf16 autocast with a GradScaler (a power-of-two scale: scaling and unscaling
    are exact) against the same autocast run without it -- the same bits; (b) gradient clipping
    (no autocast), compared with the float64 reference below."""
    from decentpy import Compression, DecentralizedDataParallel

    out: Dict[str, Any] = {}
    for use_scaler in (True, False):
        model = make_mlp(0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000) if use_scaler else None
        ddp = DecentralizedDataParallel(model, decentpy_optim_fn("sgd"), topology="ring", scaler=scaler,
                                        compression=Compression("int8", gamma=GAMMA))
        for k in range(STEPS):
            x, y = batch(rank, k)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(ddp(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        ddp.wait()
        out["scaler" if use_scaler else "plain"] = ddp.buckets[0].param_block.detach().clone()
        ddp.close()
    model = make_mlp(0)
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn("sgd"), topology="ring", grad_clip_norm=CLIP,
                                    compression=Compression("int8", gamma=GAMMA))
    for k in range(STEPS):
        x, y = batch(rank, k)
        loss_fn(ddp(x), y).backward()
    ddp.wait()
    out["clip"] = ddp.buckets[0].param_block.detach().clone()
    ddp.close()
    return out


def _join(rank: int, topology: str = "ring", nonfinite: str = "skip") -> torch.Tensor:
    """int8 under Join: rank r has 2 + r batches; a rank out of data keeps mixing and sending (in a
    group: its chunks, and the reduction of its own chunk). ``nonfinite='ignore'``: no gradient norm
    is taken at all (the default 'skip' takes one per bucket)."""
    from decentpy import Compression, DecentralizedDataParallel

    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("sgd"), topology=topology,
                                    compression=Compression("int8", gamma=GAMMA), nonfinite=nonfinite)
    with ddp.join():
        for k in range(2 + rank):
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
    ddp.wait()
    out = ddp.buckets[0].param_block.detach().clone()
    ddp.close()
    return out


def _skip_and_resume(rank: int) -> Dict[str, Any]:
    """int8 ring, nonfinite='skip' (the default), with a NaN loss on rank 1 at step 1, and a
    checkpoint at step 3 resumed in a fresh wrapper: the skipped update (that rank mixes and sends,
    steps nothing) and the resume, in one run; the continuous run's parameters, and whether the
    resumed run's equal them bit for bit."""
    from decentpy import Compression, DecentralizedDataParallel

    def make() -> DecentralizedDataParallel:
        return DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("sgd"), topology="ring",
                                         compression=Compression("int8", gamma=GAMMA))

    def run(ddp: DecentralizedDataParallel, ks: range) -> None:
        for k in ks:
            x, y = batch(rank, k)
            loss = loss_fn(ddp(x), y)
            (loss * float("nan") if (rank, k) == (1, 1) else loss).backward()

    a = make()
    run(a, range(3))
    buf = io.BytesIO()
    torch.save(a.training_state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    run(a, range(3, 6))
    a.wait()
    want = a.buckets[0].param_block.detach().clone()
    skipped = a.stats()["skipped_bucket_updates"]
    a.close()
    b = make()
    b.load_training_state_dict(sd)
    run(b, range(3, 6))
    b.wait()
    got = b.buckets[0].param_block.detach().clone()
    b.close()
    return {"params": want, "resumed_equal": bool(torch.equal(got, want)), "skipped": skipped}


# 'raise' on node shards: rank RAISE_RANK's loss is NaN at iteration RAISE_STEP (see _raise_on_node_shards)
RAISE_RANK, RAISE_STEP, RAISE_ITERS = 1, 1, 6


def _raise_on_node_shards(rank: int, world: int) -> Dict[str, Any]:
    """intra_node='shard' + int8 + nonfinite='raise' (2 nodes of 2 ranks, AdamW): rank 1's loss is NaN
    at iteration 1. Its node's reduce-scatter spreads the NaN to both shards, so both ranks of node 0
    skip the update (after the mix, which already happened), send finite compressed shards and raise
    NonFiniteGradientError at the end of that backward; node 1 learns it through the error board while
    waiting for node 0 (a PeerNonFiniteError at iteration 2 or 3). What each rank holds afterwards: its
    shard of the parameters and its shard's optimizer state (the node's all-gather may be in flight:
    the other shard is not read). Run last in the spawn: the error board keeps the report."""
    from decentpy import Compression, DecentralizedDataParallel, NonFiniteGradientError

    model = make_mlp(0)
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn("adamw"), topology="ring", intra_node="shard",
                                    local_world_size=2, compression=Compression("int8", gamma=GAMMA),
                                    nonfinite="raise")
    err: Dict[str, Any] = {"type": None}
    done = 0
    try:
        for k in range(RAISE_ITERS):
            x, y = batch(rank, k)
            loss = loss_fn(ddp(x), y)
            (loss * float("nan") if (rank, k) == (RAISE_RANK, RAISE_STEP) else loss).backward()
            done = k + 1
        ddp.wait()
    except NonFiniteGradientError as exc:
        err = {"type": type(exc).__name__, "text": str(exc), "rank": exc.rank, "step": getattr(exc, "step", None)}
    b = ddp.buckets[0]
    opt = b.state_optimizer
    state: Dict[str, torch.Tensor] = {}
    for name in ("exp_avg", "exp_avg_sq"):
        flat = torch.zeros(b.hi - b.lo, dtype=torch.float64)
        for piece, off in zip(b.pieces, b.piece_offsets):
            flat[off:off + piece.numel()] = opt.state[piece][name].detach().double().reshape(-1)
        state[name] = flat
    steps = sorted({float(opt.state[piece]["step"]) for piece in b.pieces})
    # every rank is done before any leaves: the job's store lives in rank 0's process, and a rank still
    # waiting for its error would otherwise find the store gone instead of the report
    store = torch.distributed.distributed_c10d._get_default_store()
    store.add("test_raise_on_node_shards_done", 1)
    deadline = time.monotonic() + 60
    while int(store.add("test_raise_on_node_shards_done", 0)) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"error": err, "done": done, "n_buckets": len(ddp.buckets), "numel": b.numel,
            "lo": b.lo, "hi": b.hi, "shard": b.param_block[b.lo:b.hi].detach().double().clone(), "state": state,
            "steps": steps}


def _all(rank: int, world: int) -> Dict[str, Any]:
    torch.set_num_threads(1)
    return {"train": {c: train_combo(rank, *c, STEPS) for c in COMBOS},
            "amp_clip": _amp_and_clip(rank), "join": _join(rank), "join_group": _join(rank, "complete"),
            "join_ignore": _join(rank, nonfinite="ignore"),
            "mean": {**{k: _linear_mean(rank, k) for k in ("int8", "bf16", "int4")},
                     "int8-aer": _linear_mean(rank, "int8", "alternating-exp-ring"),
                     "int8-buckets": _linear_mean_buckets(rank)},
            "ckpt": {**{k: _checkpoint(rank, k) for k in ("int8", "bf16")},
                     "int8-aer": _checkpoint(rank, "int8", "alternating-exp-ring")},
            "skip_resume": _skip_and_resume(rank), "refusals": _refusals(rank),
            "raise_shard": _raise_on_node_shards(rank, world)}  # last: after a 'raise' the error board holds it


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_workers(_all, 4, timeout=300)


def _node_reference(topo: str, opt: str, kind: str) -> Tuple[List[torch.Tensor], Dict[str, float]]:
    """Two nodes of two ranks as two workers whose gradient is the mean of their ranks' (the node's
    exact reduction), exchanging with each other every step; each rank ends with its node's model."""
    intra = topo.partition("/")[2]
    models = [make_mlp(0).double() for _ in range(2)]
    opts = [REF_OPTIMIZERS[opt](m) for m in models]

    def grads(node: int, k: int, m: nn.Module) -> None:
        for r in (2 * node, 2 * node + 1):
            x, y = batch(r, k)
            (loss_fn(m(x.double()), y.double()) / 2).backward()

    want, stats = simulate_choco(models, opts, grads, pair_schedule(lambda k, i: 1 - i), kind, GAMMA, STEPS,
                                 shards=2 if intra == "shard" else 1)
    return [want[r // 2] for r in range(4)], stats


def combo_reference(topo: str, opt: str, kind: str) -> Tuple[List[torch.Tensor], Dict[str, float]]:
    """Each of the 4 ranks' final flat bucket for a combo, by the float64 re-computation."""
    if "/" in topo:
        return _node_reference(topo, opt, kind)
    n = 4
    models = [make_model(topo).double() for _ in range(n)]
    topo = topo.partition("+")[0]
    opts = [REF_OPTIMIZERS[opt](m) for m in models]

    def grads(i: int, k: int, m: nn.Module) -> None:
        x, y = batch(i, k)
        loss_fn(m(x.double()), y.double()).backward()

    if topo in ("ring", "one-peer-exp"):
        schedule = pair_schedule(ring_partner(n) if topo == "ring" else one_peer_exp_partner(n))
    else:
        schedule = group_schedule(topo, n, LOCAL_WORLD_SIZE.get(topo, 1))
    return simulate_choco(models, opts, grads, schedule, kind, GAMMA, STEPS)


@pytest.mark.parametrize("topo,opt,kind", COMBOS)
def test_training_matches_float64_reference(results: List[Dict[str, Any]], topo: str, opt: str, kind: str) -> None:
    check_combo([r["train"][(topo, opt, kind)] for r in results], topo, opt, kind)


def check_combo(runs: List[Dict[str, Any]], topo: str, opt: str, kind: str) -> None:
    """The ranks' ``train_combo`` results against the float64 re-computation (see check_close)."""
    want, stats = combo_reference(topo, opt, kind)
    offsets, total = flat_layout([p.shape for p in reversed(list(make_model(topo).parameters()))])
    for rank, run in enumerate(runs):
        assert run["n_buckets"] == 1 and run["offsets"] == offsets and run["numel"] == total
        check_close(run["flat"], want[rank], stats["unit"], f"{topo}/{opt}/{kind} rank {rank}")
    # the workers' mean follows the reference's mean (no rounding flip survives averaging unbounded)
    mean = torch.stack([r["flat"].double() for r in runs]).mean(0)
    check_close(mean, torch.stack(want).mean(0), stats["unit"], f"{topo}/{opt}/{kind} mean")


@pytest.mark.parametrize("kind", ["int8", "bf16", "int4"])
def test_bytes_per_step_equal_the_formula(results: List[Dict[str, Any]], kind: str) -> None:
    for topo in ("ring", "one-peer-exp") if kind != "int4" else ("ring",):
        for r in results:
            run = r["train"][(topo, "sgd", kind)]
            n = run["numel"]
            assert run["sent"] == [_wire(kind, n)] * STEPS
            # this bucket is small (a partial scale block); a 25 MiB one: 0.254x (int8), 0.5x (bf16), 0.129x (int4)
            big = 25 * 2 ** 20 // 4
            assert _wire(kind, big) / (4 * big) <= {"int8": 0.2541, "bf16": 0.5, "int4": 0.1290}[kind]
            # memory: two fp32 copies per distinct peer, plus the send and receive bytes
            assert len(run["peers"]) == 2
            assert run["memory"] == 2 * 2 * n * 4 + 2 * _wire(kind, n)


def _group_wire(kind: str, n: int, m: int, pos: int) -> int:
    """The documented bytes of one compressed group exchange for the member at ``pos``: the ceil(n/256)
    scale blocks split into m chunks (member p: blocks [p B // m, (p + 1) B // m)); it sends every other
    member that member's chunk of its q, then its own reduced chunk to each of the m - 1 others."""
    blocks = -(-n // INT8_BLOCK)

    def size(p: int) -> int:
        return min((p + 1) * blocks // m * INT8_BLOCK, n) - min(p * blocks // m * INT8_BLOCK, n)

    return sum(_wire(kind, size(p)) for p in range(m) if p != pos) + (m - 1) * _wire(kind, size(pos))


def test_group_bytes_and_memory_equal_the_formula(results: List[Dict[str, Any]]) -> None:
    """A group of m ranks: a reduce-scatter and an all-gather of compressed chunks (2 (m - 1) / m wire
    sizes for equal chunks); the iteration k exchange is for step k + 1 (alternating-exp-ring at n = 4,
    L = 2: odd steps pairs, even steps the group of 4). Memory: two copies per pair partner and per
    group, the send bytes, m - 1 receive slots and the reduced bytes."""
    for rank, r in enumerate(results):
        aer = r["train"][("alternating-exp-ring", "sgd", "int8")]
        n = aer["numel"]
        w, g = _wire("int8", n), _group_wire("int8", n, 4, rank)
        # a group exchange's second round leaves from a helper thread during the next iteration: its bytes
        # show in the total (after wait()), not in the iteration that launched it
        assert aer["sent"][0] == w and aer["total_sent"] == 2 * w + 2 * g
        slots = 2 * -(-w // 4) * 4 + w  # 3 receive slots, each 4-byte aligned
        assert len(aer["peers"]) == 1 and aer["memory"] == 2 * 2 * n * 4 + slots + 2 * w
        full = r["train"][("complete", "sgd", "int8")]
        assert full["total_sent"] == g * STEPS
        # between nodes: one pair exchange per step, of this rank's shard (half the bucket) or the whole bucket
        shard = r["train"][("ring/shard", "adamw", "int8")]
        assert shard["sent"] == [_wire("int8", n // 2)] * STEPS
        assert shard["memory"] == 2 * (n // 2) * 4 + 2 * _wire("int8", n // 2)
        node = r["train"][("ring/allreduce", "sgd", "bf16")]
        assert node["sent"] == [_wire("bf16", n)] * STEPS
    # a 25 MiB bucket in a group of 4: half the bytes of one compressed copy per edge (2 / m)
    big = 25 * 2 ** 20 // 4
    assert _group_wire("int8", big, 4, 0) / (3 * _wire("int8", big)) == pytest.approx(0.5, abs=1e-3)


def test_group_exchanges_of_several_buckets_preserve_the_mean(results: List[Dict[str, Any]]) -> None:
    ws = [r["mean"]["int8-buckets"][0].double() for r in results]
    x0 = results[0]["mean"]["int8-buckets"][1].double()
    total = torch.zeros(1800, dtype=torch.float64)
    for rank in range(4):
        for k in range(6):
            total += torch.cat([torch.randn(600, generator=torch.Generator().manual_seed(100 * rank + 10 * k + j))
                                for j in range(3)]).double()
    got, want = torch.stack(ws).mean(0), x0 - 0.5 * total / 4
    assert torch.allclose(got, want, rtol=0, atol=2e-5), float((got - want).abs().max())
    assert float(torch.stack(ws).std(0).max()) > 0, "workers differ (the test would be vacuous otherwise)"


@pytest.mark.parametrize("kind", ["int8", "bf16", "int4", "int8-aer"])
def test_mixing_preserves_the_global_mean(results: List[Dict[str, Any]], kind: str) -> None:
    ws = [r["mean"][kind][0].double() for r in results]
    x0 = results[0]["mean"][kind][1].double()
    total = torch.zeros(700, dtype=torch.float64)
    for rank in range(4):
        for k in range(6):
            total += torch.randn(700, generator=torch.Generator().manual_seed(100 * rank + k)).double()
    want = x0 - 0.5 * total / 4
    got = torch.stack(ws).mean(0)
    assert torch.allclose(got, want, rtol=0, atol=2e-5), float((got - want).abs().max())
    assert float(torch.stack(ws).std(0).max()) > 0, "workers differ (the test would be vacuous otherwise)"


def test_amp_with_a_grad_scaler_gives_the_same_bits(results: List[Dict[str, Any]]) -> None:
    for r in results:
        got, want = r["amp_clip"]["scaler"], r["amp_clip"]["plain"]
        assert torch.equal(got, want), float((got - want).abs().max())
    assert not torch.equal(results[0]["amp_clip"]["plain"], results[1]["amp_clip"]["plain"])  # not vacuous


def test_clipping_matches_float64_reference(results: List[Dict[str, Any]]) -> None:
    n = 4
    models = [make_mlp(0).double() for _ in range(n)]
    opts = [REF_OPTIMIZERS["sgd"](m) for m in models]

    def grads(i: int, k: int, m: nn.Module) -> None:
        x, y = batch(i, k)
        loss_fn(m(x.double()), y.double()).backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)  # one bucket: the bucket's norm
        assert float(norm) > CLIP  # every step clips (the test would be vacuous otherwise)

    want, stats = simulate_choco(models, opts, grads, pair_schedule(ring_partner(n)), "int8", GAMMA, STEPS)
    for rank, r in enumerate(results):
        check_close(r["amp_clip"]["clip"], want[rank], stats["unit"], f"clip rank {rank}")


def test_join_matches_float64_reference(results: List[Dict[str, Any]]) -> None:
    """Uneven inputs: rank r steps on its 2 + r batches, then only applies, mixes and sends (its
    optimizer skips: no gradient) until the last rank's 5 iterations are done; the same with
    nonfinite='ignore' (no gradient norm taken)."""
    n = 4
    models = [make_mlp(0).double() for _ in range(n)]
    opts = [REF_OPTIMIZERS["sgd"](m) for m in models]

    def grads(i: int, k: int, m: nn.Module) -> None:
        if k < 2 + i:
            x, y = batch(i, k)
            loss_fn(m(x.double()), y.double()).backward()

    want, stats = simulate_choco(models, opts, grads, pair_schedule(ring_partner(n)), "int8", GAMMA, 2 + n - 1)
    for rank, r in enumerate(results):
        check_close(r["join"], want[rank], stats["unit"], f"join rank {rank}")
        # compression x nonfinite='ignore' x Join (no gradient norm taken at all; the gradients are
        # finite, so the same re-computation)
        check_close(r["join_ignore"], want[rank], stats["unit"], f"join, nonfinite='ignore', rank {rank}")
    # a group of 4 (complete; the 2-block MLP: two members own a chunk, the others none)
    models = [make_mlp(0).double() for _ in range(n)]
    opts = [REF_OPTIMIZERS["sgd"](m) for m in models]
    want, stats = simulate_choco(models, opts, grads, group_schedule("complete", n), "int8", GAMMA, 2 + n - 1)
    for rank, r in enumerate(results):
        check_close(r["join_group"], want[rank], stats["unit"], f"join (complete) rank {rank}")


def _raise_reference(iters: int) -> Tuple[List[torch.Tensor], List[Dict[str, Any]], Dict[str, float]]:
    """The 'raise' scenario's nodes after ``iters`` iterations of the float64 node-level CHOCO
    re-computation (2 node workers, each bucket compressed in 2 shards) in which node 0 has no
    gradient at RAISE_STEP (it mixes and sends, its optimizer does not step): each node's flat
    parameters, and its AdamW state in the same flat layout (``exp_avg``, ``exp_avg_sq``; ``step``:
    the set of the parameters' step counts)."""
    models = [make_mlp(0).double() for _ in range(2)]
    opts = [REF_OPTIMIZERS["adamw"](m) for m in models]

    def grads(node: int, k: int, m: nn.Module) -> None:
        if (node, k) == (RAISE_RANK // 2, RAISE_STEP):
            return
        for r in (2 * node, 2 * node + 1):
            x, y = batch(r, k)
            (loss_fn(m(x.double()), y.double()) / 2).backward()

    want, stats = simulate_choco(models, opts, grads, pair_schedule(lambda k, i: 1 - i), "int8", GAMMA, iters,
                                 shards=2)
    flat = FlatModels(models)
    states: List[Dict[str, Any]] = []
    for i, o in enumerate(opts):
        st: Dict[str, Any] = {}
        for name in ("exp_avg", "exp_avg_sq"):
            t = torch.zeros(flat.total, dtype=torch.float64)
            for p, off in zip(flat.params[i], flat.offsets):
                t[off:off + p.numel()] = o.state[p][name].reshape(-1)
            st[name] = t
        st["step"] = sorted({float(o.state[p]["step"]) for p in flat.params[i]})
        states.append(st)
    return want, states, stats


def test_nonfinite_raise_on_node_shards_with_int8_raises_everywhere_without_corruption(
        results: List[Dict[str, Any]]) -> None:
    """nonfinite='raise' x intra_node='shard' and x compression (pairs the other tests leave out):
    rank 1's NaN loss at iteration 1 raises NonFiniteGradientError on every rank -- on node 0 (rank 0
    through the node's reduction) at that iteration, on node 1 (a PeerNonFiniteError) while it waits
    for node 0 -- and each rank's shard of the parameters and of the AdamW state is the float64
    reference of the iterations before the raise, nothing non-finite anywhere: node 0 mixed at
    iteration 1 but did not step (its step counts stay 1); node 1 raised at iteration 2 or 3, before
    mixing (which of the two is timing: the report may win over node 0's last exchange)."""
    refs = {iters: _raise_reference(iters) for iters in (RAISE_STEP + 1, RAISE_STEP + 2, RAISE_STEP + 3)}
    _, total = flat_layout([p.shape for p in reversed(list(make_mlp(0).parameters()))])
    for rank, r in enumerate(results):
        run, node = r["raise_shard"], rank // 2
        err = run["error"]
        assert err["type"] is not None, f"rank {rank}: trained {run['done']} iterations and raised nothing"
        assert "not finite" in err["text"], (rank, err)
        if node == RAISE_RANK // 2:  # its own node's gradient: raised at that iteration, naming itself
            assert err["type"] == "NonFiniteGradientError" and err["rank"] == rank and err["step"] == RAISE_STEP, \
                (rank, err)
            assert run["done"] == RAISE_STEP, (rank, run["done"])
            candidates = [RAISE_STEP + 1]
        else:  # a peer node's report, naming a rank of node 0
            assert err["type"] == "PeerNonFiniteError" and err["rank"] in (0, 1), (rank, err)
            assert run["done"] in (RAISE_STEP + 1, RAISE_STEP + 2), (rank, run["done"])
            candidates = [run["done"]]
        assert run["n_buckets"] == 1 and run["numel"] == total
        lo, hi = (rank % 2) * total // 2, (rank % 2 + 1) * total // 2
        assert (run["lo"], run["hi"]) == (lo, hi), (rank, run["lo"], run["hi"])
        assert bool(torch.isfinite(run["shard"]).all()), f"rank {rank}: non-finite parameters after the raise"
        for iters in candidates:
            want, states, stats = refs[iters]
            what = f"raise: rank {rank} after {iters} iterations"
            check_close(run["shard"], want[node][lo:hi], stats["unit"], what)
            assert run["steps"] == states[node]["step"], (what, run["steps"], states[node]["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                got, ref = run["state"][name], states[node][name][lo:hi]
                err_max = float((got - ref).abs().max())
                # (fp32 against float64 gradients: ~1e-5 of the largest value seen; a step more or less: ~1)
                assert err_max <= 1e-3 * float(ref.abs().max()), f"{what}: {name} differs by {err_max:.3g}"
            # not vacuous: one iteration more is far outside the tolerance of check_close
            later = refs[iters + 1][0][node][lo:hi]
            assert float((later - run["shard"]).abs().max()) > 10 * stats["unit"], what


def test_skipped_update_and_resume_match_float64_reference(results: List[Dict[str, Any]]) -> None:
    """Compression x nonfinite='skip' x resume (a pair the other tests leave out): rank 1's step-1
    update is skipped (its gradient not finite) while it still mixes and sends -- the float64
    CHOCO re-computation with no gradient for that rank at that step -- and a checkpoint taken two
    steps later resumes to the same bits."""
    n = 4
    models = [make_mlp(0).double() for _ in range(n)]
    opts = [REF_OPTIMIZERS["sgd"](m) for m in models]

    def grads(i: int, k: int, m: nn.Module) -> None:
        if (i, k) != (1, 1):
            x, y = batch(i, k)
            loss_fn(m(x.double()), y.double()).backward()

    want, stats = simulate_choco(models, opts, grads, pair_schedule(ring_partner(n)), "int8", GAMMA, 6)
    for rank, r in enumerate(results):
        sr = r["skip_resume"]
        assert sr["resumed_equal"], f"rank {rank}: the resumed run differs from the continuous one"
        assert sr["skipped"] == (1 if rank == 1 else 0), (rank, sr["skipped"])
        check_close(sr["params"], want[rank], stats["unit"], f"skip + resume rank {rank}")


def test_checkpoint_resume_is_exact(results: List[Dict[str, Any]]) -> None:
    for r in results:
        assert r["ckpt"] == {"int8": True, "bf16": True, "int8-aer": True}


def test_refusals_name_the_reason(results: List[Dict[str, Any]]) -> None:
    msgs = results[0]["refusals"]
    assert "NCCL communicator" in msgs[0]
    assert "compression kind must be one of" in msgs[1]


def test_single_process_refuses_low_precision_params() -> None:
    from dist_harness import single_process_group
    from decentpy import DecentralizedDataParallel

    with single_process_group("gloo"):
        with pytest.raises(Exception, match="float32 parameters only"):
            DecentralizedDataParallel(make_mlp(0).bfloat16(), decentpy_optim_fn("sgd"), topology="complete",
                                      compression="bf16")


# ---------------------------------------------------------------------------------------------
# Node groups of more than two nodes: 3 nodes x 2 ranks, `complete` over the nodes
# ---------------------------------------------------------------------------------------------

def _node_group_mean(rank: int, world: int) -> Dict[str, Tuple[torch.Tensor, torch.Tensor, List[int]]]:
    """``intra_node='shard'`` / ``'allreduce'`` with int8 and ``complete`` over 3 nodes: the ranks that
    hold the same shard (or local rank) on the 3 nodes form a compressed group of 3; with gradients
    independent of the parameters, SGD's mean over all ranks is x0 - lr * sum_k mean_i c_{i,k}
    whatever the mixing does, if the node reduction and the group exchange preserve the mean."""
    from decentpy import DecentralizedDataParallel

    torch.set_num_threads(1)
    out = {}
    for intra in ("shard", "allreduce"):
        model = _ThreeLinear()
        ddp = DecentralizedDataParallel(model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.5),
                                        topology="complete", intra_node=intra, local_world_size=2,
                                        compression="int8")
        for k in range(5):
            ddp(torch.zeros(1, 600))
            loss = sum((layer.weight.view(-1) * torch.randn(600, generator=torch.Generator().manual_seed(
                100 * rank + 10 * k + j))).sum() for j, layer in enumerate(model.layers))
            loss.backward()
        ddp.wait()
        out[intra] = (torch.cat([layer.weight.detach().view(-1) for layer in model.layers]),
                      torch.tensor(float(ddp.bytes_sent)), [b.numel for b in ddp.buckets])
        ddp.close()
    return out


@pytest.mark.timeout(300)
def test_node_groups_of_three_preserve_the_mean() -> None:
    results = run_workers(_node_group_mean, 6, timeout=240)
    x0 = torch.cat([layer.weight.detach().view(-1) for layer in _ThreeLinear().layers]).double()
    total = torch.zeros(1800, dtype=torch.float64)
    for rank in range(6):
        for k in range(5):
            total += torch.cat([torch.randn(600, generator=torch.Generator().manual_seed(100 * rank + 10 * k + j))
                                for j in range(3)]).double()
    want = x0 - 0.5 * total / 6
    for intra in ("shard", "allreduce"):
        ws = [r[intra][0].double() for r in results]
        got = torch.stack(ws).mean(0)
        assert torch.allclose(got, want, rtol=0, atol=2e-5), (intra, float((got - want).abs().max()))
        assert float(torch.stack(ws).std(0).max()) > 0, f"{intra}: workers identical (vacuous)"
        # 5 group exchanges of each bucket (with shards: this rank's half of it), the rank at position
        # node = rank // 2 of its group of 3
        for rank, r in enumerate(results):
            part = 2 if intra == "shard" else 1
            want_bytes = 5 * sum(_group_wire("int8", n // part, 3, rank // 2) for n in r[intra][2])
            assert float(r[intra][1]) == want_bytes, (intra, rank, r[intra][2])
