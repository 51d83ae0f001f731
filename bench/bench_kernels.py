"""Microbenchmark of the fused mix-and-step kernel (decentpy._C.mix_and_step) on one bucket.

Workload: AdamW on a fp32 bucket with an all-reduce style mix (mix_a = w - s, mix_b = 1, the send
buffer aliasing the comm buffer, send_scale = s). Per element the fused kernel reads p, c, g, m, v
and writes p, m, v, send: 9 x 4 bytes; with --zero-grad (the default, what training uses: the
reducer passes zero_grad=True) it also writes g = 0 right after reading it: 10 x 4 bytes.

Compared with:
  (a) the best torch sequence: p.mul_(a).add_(c, alpha=b); torch AdamW(fused=True) step
      (foreach when fused is not supported here); torch.mul(p, s, out=send); with --zero-grad
      also grad.zero_()
  (b) the same with torch's default per-parameter AdamW (foreach=False)
  (c) a same-run dst.copy_(src) moving the same number of bytes (read + write) as the fused kernel
  (d) with --zero-grad only: the fused kernel without zero_grad followed by grad.zero_() (the
      separate zeroing pass that zero_grad replaces)

After the first zero_grad call the gradient stays zero: same memory traffic and the same
arithmetic (AdamW has no data-dependent branch), so the timing is that of a training step.

Compressed gossip (--compression int8|int4|bf16|all|none, default all): the fused compressing
pass (kernels.compressed_step: received q into the peer's copy, CHOCO mix, AdamW, zero_grad, next
q = Q(p - copy) into the send bytes and the copy update) against the same work as torch ops
(dequantise (int4: unpack the nibbles), two adds, torch AdamW fused/foreach, grad.zero_(), the
difference, per-block amax, scale, round, clamp, the int8/bf16 casts or the int4 nibble packing,
the copy update). Target: >= 1.5x on CPU. --compressed-only skips the uncompressed pass.

Usage: python bench/bench_kernels.py [--size-mb 25] [--repeats 9] [--threads N] [--device cpu|cuda|all]
                                     [--zero-grad | --no-zero-grad]
                                     [--compression int8|int4|bf16|all|none] [--compressed-only]
"""
import argparse
import os
import platform
import statistics
import sys
import time

import torch

from decentpy.optim import kernels

ADAM = kernels.OptKind.ADAM
TARGET_A, TARGET_B, TARGET_COPY = 1.5, 4.0, 0.70


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timer(device):
    """Returns a function timing fn() in seconds (CUDA: events on the current stream)."""
    if device.type == "cuda":
        def run(fn):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return run


def interleaved_medians(fns, device, repeats):
    """Median seconds of each of ``fns`` (name -> callable) after two warm-up calls each, timed in
    interleaved rounds (each round times every variant once, so load changes hit all of them alike)."""
    run = timer(device)
    for fn in fns.values():
        for _ in range(2):
            run(fn)
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            samples[k].append(run(fn))
    return {k: statistics.median(v) for k, v in samples.items()}


def make_torch_adamw(p, lr, wd, betas, eps, mode):
    """mode: 'fused', 'foreach' or 'default' (foreach=False). Returns (optimizer, mode used)."""
    kw = dict(lr=lr, weight_decay=wd, betas=betas, eps=eps)
    if mode == "fused":
        try:
            opt = torch.optim.AdamW([p], fused=True, **kw)
            opt.step()  # raises here when fused is not supported for this device
            return opt, "fused"
        except (RuntimeError, TypeError, ValueError):
            mode = "foreach"
    if mode == "foreach":
        opt = torch.optim.AdamW([p], foreach=True, **kw)
        opt.step()
        return opt, "foreach"
    opt = torch.optim.AdamW([p], foreach=False, **kw)
    opt.step()
    return opt, "default (foreach=False)"


def bench_device(device, numel, repeats, zero_grad=True):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(scale=1.0):
        return (torch.randn(numel, generator=gen) * scale).to(device)

    w, s = 0.5, 0.5  # all-reduce style: p = (w - s) p + c, send = s p
    lr, wd, betas, eps = 1e-3, 0.01, (0.9, 0.999), 1e-8
    step = 10  # bias-correction step (the kernel derives the corrections from it)
    groups = [kernels.GroupHyper(lr=lr, weight_decay=wd, beta1=betas[0], beta2=betas[1], eps=eps,
                            bias_step=step)]
    segments = kernels.segments_for_numel(numel, device)

    # Fused kernel buffers.
    p, c, g = rnd(), rnd(), rnd(1e-3)
    m, v = torch.zeros(numel, device=device), torch.zeros(numel, device=device)

    def step(param, grad, states, comm, zero):
        # all-reduce style: the received sum is the send buffer itself
        kernels.fused_step(ADAM, param, grad, states, segments, groups, comm=comm, send=comm,
                           mix_a=w - s, mix_b=1.0, send_scale=s, decoupled_weight_decay=True, zero_grad=zero)

    def fused():
        step(p, g, [m, v], c, zero_grad)

    # (d) the unfused zeroing that zero_grad replaces (own buffers: same traffic as `fused`).
    pd, cd, gd = rnd(), rnd(), rnd(1e-3)
    md, vd = torch.zeros(numel, device=device), torch.zeros(numel, device=device)

    def fused_then_zero():
        step(pd, gd, [md, vd], cd, False)
        gd.zero_()

    # Torch sequences.
    def torch_seq(mode):
        tp = torch.nn.Parameter(rnd())
        tp.grad = rnd(1e-3)
        tc = rnd()
        send = torch.empty_like(tc)
        opt, used = make_torch_adamw(tp, lr, wd, betas, eps, mode)

        def fn():
            with torch.no_grad():
                tp.mul_(w - s).add_(tc, alpha=1.0)
            opt.step()
            with torch.no_grad():
                torch.mul(tp, s, out=send)
                if zero_grad:
                    tp.grad.zero_()

        return fn, used

    seq_a, used_a = torch_seq("fused")
    seq_b, used_b = torch_seq("default")

    # Same-run copy moving the same bytes: fused moves 9 * numel * 4 bytes (5 reads + 4 writes),
    # 10 * numel * 4 with zero_grad (+ the grad write); a copy of k elements moves 2 * k * 4 bytes.
    streams = 10 if zero_grad else 9
    bytes_moved = streams * numel * 4
    copy_elems = (streams * numel) // 2
    src = torch.randn(copy_elems, generator=gen).to(device)
    dst = torch.empty_like(src)
    copy_bytes = 2 * copy_elems * 4

    fns = {"fused": fused, "a": seq_a, "b": seq_b, "copy": lambda: dst.copy_(src)}
    if zero_grad:
        fns["d"] = fused_then_zero
    med = interleaved_medians(fns, device, repeats)
    t_fused, t_a, t_b, t_copy = med["fused"], med["a"], med["b"], med["copy"]

    gbs = lambda b, t: b / t / 1e9
    zg = ", zero_grad" if zero_grad else ""
    rows = [
        (f"fused kernels.fused_step (AdamW, comm+send{zg})", t_fused, gbs(bytes_moved, t_fused)),
        (f"(a) torch mix + AdamW {used_a} + mul", t_a, gbs(bytes_moved, t_a)),
        (f"(b) torch mix + AdamW {used_b} + mul", t_b, gbs(bytes_moved, t_b)),
        ("(c) dst.copy_(src), same bytes", t_copy, gbs(copy_bytes, t_copy)),
    ]
    if zero_grad:
        rows.append(("(d) fused without zero_grad + grad.zero_()", med["d"],
                     gbs(bytes_moved, med["d"])))
    print(f"\n[{device}] bucket {numel * 4 / 2**20:.1f} MiB fp32 ({numel} elements), "
          f"fused moves {bytes_moved / 2**20:.0f} MiB ({streams} x 4 B/element), median of {repeats} "
          f"interleaved runs")
    print(f"{'variant':54s} {'time ms':>9s} {'GB/s':>8s}")
    for name, t, bw in rows:
        print(f"{name:54s} {t * 1e3:9.2f} {bw:8.1f}")
    ra, rb = t_a / t_fused, t_b / t_fused
    pc = gbs(bytes_moved, t_fused) / gbs(copy_bytes, t_copy)
    ok = lambda x, tgt: "ok" if x >= tgt else "BELOW TARGET"
    print(f"speed-up vs (a): {ra:5.2f}x   (target >= {TARGET_A}x)  {ok(ra, TARGET_A)}")
    print(f"speed-up vs (b): {rb:5.2f}x   (target >= {TARGET_B}x)  {ok(rb, TARGET_B)}")
    print(f"fused bandwidth: {100 * pc:5.1f}% of copy (target >= {100 * TARGET_COPY:.0f}%)  "
          f"{ok(pc, TARGET_COPY)}")
    if zero_grad:
        print(f"zero_grad fused in the pass vs separate grad.zero_(): {med['d'] / t_fused:5.2f}x")
    if "fused" not in used_a:
        print("note: torch AdamW(fused=True) is not supported here; (a) uses foreach.")
    out = dict(fused=t_fused, a=t_a, b=t_b, copy=t_copy)
    if zero_grad:
        out["fused_then_zero"] = med["d"]
    return out


TARGET_COMPRESSED = 1.5


def bench_compressed(device, numel, repeats, kind):
    """The compressing fused pass vs the same work as torch ops (AdamW, int8, int4 or bf16)."""
    block = kernels.INT8_BLOCK
    numel = max(block, numel // block * block)
    nb = numel // block
    gen = torch.Generator(device="cpu").manual_seed(1)

    def rnd(scale=1.0):
        return (torch.randn(numel, generator=gen) * scale).to(device)

    lr, wd, betas, eps, gw = 1e-3, 0.01, (0.9, 0.999), 1e-8, 0.4
    comp = getattr(kernels.Compressor, kind.upper())
    wire = kernels.compressed_bytes(comp, numel)
    groups = [kernels.GroupHyper(lr=lr, weight_decay=wd, beta1=betas[0], beta2=betas[1], eps=eps, bias_step=10)]
    segments = kernels.segments_for_numel(numel, device)
    # a received q: a real compression of a small difference
    base = rnd()
    q_recv = torch.zeros(wire, dtype=torch.uint8, device=device)
    kernels.compressed_step(kernels.OptKind.NONE, comp, base + rnd(1e-3), None, [], None, [], q_send=q_recv,
                            self_copy_next=base.clone())

    p, g, m, v = rnd(), rnd(1e-3), torch.zeros(numel, device=device), torch.zeros(numel, device=device)
    pc, sm, sn = base.clone(), base + rnd(1e-4), base + rnd(1e-4)
    q_send = torch.zeros(wire, dtype=torch.uint8, device=device)

    def fused():
        kernels.compressed_step(ADAM, comp, p, g, [m, v], segments, groups, q_recv=q_recv, peer_copy=pc,
                                self_copy_mix=sm, choco_mix=gw, q_send=q_send, self_copy_next=sn,
                                decoupled_weight_decay=True, zero_grad=True)

    tp = torch.nn.Parameter(rnd())
    tp.grad = rnd(1e-3)
    opt, used = make_torch_adamw(tp, lr, wd, betas, eps, "fused")
    tpc, tsm, tsn = base.clone(), base + rnd(1e-4), base + rnd(1e-4)
    if kind == "int8":
        r_scales = q_recv[:4 * nb].view(torch.float32)
        r_codes = q_recv[4 * nb:].view(torch.int8)
        t_send = torch.zeros(wire, dtype=torch.uint8, device=device)
        s_scales = t_send[:4 * nb].view(torch.float32)
        s_codes = t_send[4 * nb:].view(torch.int8)
    elif kind == "int4":  # two's-complement nibbles, the even element low (docs/compression.md)
        r_scales = q_recv[:4 * nb].view(torch.float32)
        r_codes = q_recv[4 * nb:]
        t_send = torch.zeros(wire, dtype=torch.uint8, device=device)
        s_scales = t_send[:4 * nb].view(torch.float32)
        s_codes = t_send[4 * nb:].view(torch.int8)
    else:
        r_bf16 = q_recv.view(torch.bfloat16)
        t_send = torch.zeros(wire, dtype=torch.uint8, device=device).view(torch.bfloat16)

    def torch_ops():
        with torch.no_grad():
            if kind == "int8":
                dq = (r_codes.float().view(nb, block) * r_scales[:, None]).view(-1)
            elif kind == "int4":  # sign-extending arithmetic shifts of the int8 bytes
                lo = (r_codes << 4).view(torch.int8) >> 4
                hi = r_codes.view(torch.int8) >> 4
                codes = torch.stack([lo, hi], dim=1).view(nb, block)
                dq = (codes.float() * r_scales[:, None]).view(-1)
            else:
                dq = r_bf16.float()
            tpc.add_(dq)
            tp.add_(tpc - tsm, alpha=gw)
        opt.step()
        with torch.no_grad():
            tp.grad.zero_()
            d = tp - tsn
            if kind in ("int8", "int4"):
                cmax = 127.0 if kind == "int8" else 7.0
                db = d.view(nb, block)
                sc = db.abs().amax(dim=1) / cmax
                safe = torch.where(sc > 0, sc, torch.ones_like(sc))
                codes = torch.round(db / safe[:, None]).clamp_(-cmax, cmax)
                if kind == "int8":
                    s_codes.copy_(codes.view(-1))
                else:
                    pairs = codes.view(-1, 2).to(torch.int8)
                    torch.bitwise_or(pairs[:, 0] & 0xF, pairs[:, 1] << 4, out=s_codes)
                s_scales.copy_(sc)
                tsn.add_((codes * sc[:, None]).view(-1))
            else:
                t_send.copy_(d)
                tsn.add_(t_send.float())

    med = interleaved_medians({"fused": fused, "torch": torch_ops}, device, repeats)
    ratio = med["torch"] / med["fused"]
    print(f"\n[{device}] compressed gossip pass, {kind} ({wire / (4 * numel):.3f}x the fp32 bytes on the wire), "
          f"AdamW, bucket {numel * 4 / 2**20:.1f} MiB fp32, median of {repeats} interleaved runs")
    print(f"{'variant':54s} {'time ms':>9s}")
    print(f"{'fused kernels.compressed_step':54s} {med['fused'] * 1e3:9.2f}")
    print(f"{'same work as torch ops (AdamW ' + used + ')':54s} {med['torch'] * 1e3:9.2f}")
    ok = "ok" if ratio >= TARGET_COMPRESSED else "BELOW TARGET"
    print(f"speed-up vs torch ops: {ratio:5.2f}x   (target >= {TARGET_COMPRESSED}x on CPU)  {ok}")
    return dict(fused=med["fused"], torch=med["torch"], ratio=ratio)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=25.0, help="bucket size in MiB of fp32 (default 25)")
    ap.add_argument("--repeats", type=int, default=9, help="timed runs per variant (median; >= 7)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                    help="cpu, cuda, or all (cpu + cuda when available; default)")
    ap.add_argument("--zero-grad", action=argparse.BooleanOptionalAction, default=True,
                    help="benchmark the kernel with zero_grad=True (the training mode; default) "
                         "or without (--no-zero-grad: 9 x 4 B/element as before)")
    ap.add_argument("--compression", choices=["int8", "int4", "bf16", "all", "none"], default="all",
                    help="also benchmark the compressed gossip pass (default: all = int8, int4 and bf16)")
    ap.add_argument("--compressed-only", action="store_true",
                    help="only the compressed gossip pass (skip the uncompressed fused-pass comparison)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = int(args.size_mb * 2**20) // 4
    info = kernels.build_info()
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical cores, torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, python {platform.python_version()}")
    print(f"decentpy._C: cpu kernels {info.get('cpu_kernel_isa', '?')} "
          f"(fp32 width {info['vector_width_fp32']}), cuda kernels {info['cuda_kernels']} "
          f"{info['cuda_archs']}, openmp {info['openmp']}, {info['compiler']}")
    devices = []
    if args.device in ("cpu", "all"):
        devices.append(torch.device("cpu"))
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        if info["cuda_kernels"]:
            devices.append(torch.device("cuda"))
            print(f"gpu: {torch.cuda.get_device_name()}")
        else:
            print("cuda: available but decentpy was built without CUDA kernels; skipped")
    elif args.device == "cuda":
        print("cuda: not available", file=sys.stderr)
        return 1
    for d in devices:
        if not args.compressed_only:
            bench_device(d, numel, max(args.repeats, 1), zero_grad=args.zero_grad)
        kinds = {"all": ["int8", "int4", "bf16"], "none": []}.get(args.compression, [args.compression])
        for kind in kinds:
            bench_compressed(d, numel, max(args.repeats, 1), kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
