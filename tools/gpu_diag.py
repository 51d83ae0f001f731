"""Diagnosis on a lent GPU (issue 26): the fused kernel under the wrapper's launch settings, one
factor at a time; an NCCL self-exchange (blocking / non-blocking, the exchange first as in
tests/test_nccl_comm.py); and, for a crash inside the extension, which symbols of decentpy._C the
dynamic linker bound into other libraries than the usual ones (an NCCL built with a static libstdc++
that exports std:: symbols would interpose them).

    python3 -m tools.gpu_diag kernel | nccl-blocking | nccl-nonblocking | nccl-bindings | ostream [STAGE]
    python3 -m tools.gpu_diag intra-node

ostream: an error message that formats integers (c10::str, an std::ostringstream) raised inside
decentpy._C at successive stages of NCCL use, each in its own process (a crash ends only its stage).
intra-node: the wrapper at world size 1 on the CPU and the GPU, with and without intra_node, against
torch's AdamW in float64 (at world size 1 there is nothing to mix: the result is AdamW's).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

import torch

from bench.bench_kernels_cuda import time_ms


def kernel() -> None:
    from decentpy import kernels as K

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


# mangled names in namespace std: functions (_ZSt), members (_ZNSt, _ZNKSt), the abbreviated
# std::ostream / istream / string / allocator / iostream (So, Si, Ss, Sa, Sd), vtables and typeinfo
STD_SYMBOL = re.compile(r"^_Z(?:N|NK|TV|TI|TS)?S[toisad]")
USUAL = ("libstdc++", "libc.so", "libm.so", "libgcc_s", "libtorch", "libc10", "ld-linux", "libpython",
         "decentpy/_C", "libpthread", "libdl", "librt")


def nccl_bindings() -> None:
    from decentpy import _C

    lib = _C.nccl_load_library()
    names = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True).stdout.split("\n")
    std = [ln.split()[-1] for ln in names if ln.split() and STD_SYMBOL.match(ln.split()[-1])]
    print(f"libnccl: {lib}; {len(std)} std:: symbols defined and exported", std[:5])
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, LD_DEBUG="bindings", LD_DEBUG_OUTPUT=os.path.join(d, "ld"))
        r = subprocess.run([sys.executable, "-m", "tools.gpu_diag", "nccl-nonblocking"], env=env,
                           capture_output=True, text=True, timeout=120)
        print(f"nccl-nonblocking under LD_DEBUG=bindings: rc={r.returncode}\n{r.stdout[-1500:]}{r.stderr[-1500:]}")
        line = re.compile(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: \S+ symbol `([^']+)'")
        ours, into_nccl = collections.Counter(), collections.Counter()
        for path in glob.glob(os.path.join(d, "ld*")):
            with open(path, errors="replace") as f:
                for ln in f:
                    m = line.search(ln)
                    if not m:
                        continue
                    src, dst, sym = m.groups()
                    if "decentpy/_C" in src and not any(u in dst for u in USUAL):
                        ours[(os.path.basename(dst), sym)] += 1
                    if "libnccl" in dst and "libnccl" not in src:
                        into_nccl[(os.path.basename(src), sym)] += 1
    print(f"decentpy._C symbols bound outside {USUAL}: {len(ours)}")
    for (dst, sym), k in ours.most_common(30):
        print(f"  {k:3d} -> {dst}: {sym}")
    print(f"symbols of other objects bound into libnccl: {len(into_nccl)}")
    for (src, sym), k in into_nccl.most_common(30):
        print(f"  {k:3d} {src}: {sym}")


OSTREAM_STAGES = ("plain", "loaded", "blocking", "nonblocking", "nonblocking+exchange")


def ostream_stage(stage: str) -> None:
    from decentpy import _C
    from decentpy import kernels as K

    comm = None
    if stage != "plain":
        _C.nccl_load_library()
        uid = _C.nccl_get_unique_id()
        if stage != "loaded":
            comm = _C.NcclCommunicator(uid, 0, 1, 0, 30000, blocking=stage == "blocking")
        if stage.endswith("+exchange"):
            a, b = torch.ones(8, device="cuda"), torch.zeros(8, device="cuda")
            comm.exchange(a, b, 0, "x").wait(10_000)
            torch.cuda.synchronize()
    p = torch.zeros(100, device="cuda")
    seg = K.segments_for_numel(100, torch.device("cuda"))
    hyp = [K.GroupHyper(lr=1e-3, weight_decay=0.0, bias_step=1)]
    try:
        K.fused_step(K.OptKind.ADAM, p, torch.zeros(100, device="cuda"), [torch.zeros(99, device="cuda"), p.clone()],
                     seg, hyp)
    except RuntimeError as e:
        print(f"{stage}: launcher error formatted: {str(e).splitlines()[0][:100]}", flush=True)
    if comm is not None:
        try:
            comm.exchange(torch.zeros(8, device="cuda"), torch.zeros(9, device="cuda"), 0, "x")
        except RuntimeError as e:
            print(f"{stage}: binding error formatted: {str(e).splitlines()[0][:100]}", flush=True)
        comm.close()


def ostream() -> None:
    for stage in OSTREAM_STAGES:
        r = subprocess.run([sys.executable, "-m", "tools.gpu_diag", "ostream", stage], capture_output=True,
                           text=True, timeout=60)
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        print(f"stage {stage}: rc={r.returncode}", *tail, sep="\n    ", flush=True)


def intra_node() -> None:
    import copy

    sys.path.insert(0, "tests")
    from dist_harness import single_process_group
    from reference import batch, loss_fn, make_mlp

    from decentpy import DecentralizedDataParallel
    from decentpy.engine import gossip, node
    from decentpy.optim import optim_fn_adamw, split_decay_groups

    runs = [(device, intra, cap, nonfinite, wait_each, "")
            for device in ("cpu", "cuda") for intra in (None, "allreduce", "shard")
            for cap, nonfinite, wait_each in ((25, "skip", False), (0.0005, "skip", False),
                                              (0.0005, "ignore", False), (0.0005, "skip", True))]
    # the node strategies' one difference from plain gossip at world size 1 is that bucket k steps
    # when bucket k+1 is ready: undo that, or wait for the device before every step
    runs += [("cuda", "allreduce", 0.0005, "skip", False, "no-deferral"),
             ("cuda", "allreduce", 0.0005, "skip", False, "sync-before-step")]
    plain_ready, node_ready, mix_and_step = (gossip.GossipStrategy.bucket_ready, node.NodeGossip.bucket_ready,
                                             gossip.GossipStrategy.mix_and_step)

    def synced(self, *a: object, **k: object) -> None:
        torch.cuda.synchronize()
        mix_and_step(self, *a, **k)

    with single_process_group("gloo"):
        for device, intra, cap, nonfinite, wait_each, patch in runs:
            node.NodeGossip.bucket_ready = plain_ready if patch == "no-deferral" else node_ready
            gossip.GossipStrategy.mix_and_step = synced if patch == "sync-before-step" else mix_and_step
            model = make_mlp(0).to(device)
            ref = copy.deepcopy(model).double().cpu()
            kw = {} if intra is None else {"intra_node": intra, "local_world_size": 1}
            ddp = DecentralizedDataParallel(model, optim_fn_adamw, topology="complete", bucket_size_in_mb=cap,
                                            nonfinite=nonfinite, **kw)
            opt = torch.optim.AdamW(split_decay_groups(list(ref.named_parameters()), 0.1), lr=1e-3)
            for k in range(3):
                x, y = batch(0, k)
                loss_fn(ddp(x.to(device)), y.to(device)).backward()
                opt.zero_grad()
                loss_fn(ref(x.double()), y.double()).backward()
                opt.step()
                if wait_each:
                    ddp.wait()
            ddp.wait()
            errs = [(p.detach().double().cpu() - q).abs().max().item()
                    for p, q in zip(model.parameters(), ref.parameters())]
            n_buckets = len(ddp.buckets)
            ddp.close()
            print(f"{device:4s} intra={str(intra):9s} cap={cap:<7} nonfinite={nonfinite:6s} wait_each={wait_each:d} {patch} "
                  f"buckets={n_buckets} max error per parameter vs torch AdamW: "
                  f"{' '.join(f'{e:.1e}' for e in errs)}", flush=True)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "kernel":
        kernel()
    elif what == "nccl-bindings":
        nccl_bindings()
    elif what == "ostream":
        ostream_stage(sys.argv[2]) if len(sys.argv) > 2 else ostream()
    elif what == "intra-node":
        intra_node()
    else:
        nccl(what == "nccl-blocking")
