"""Microbenchmark of the CUDA fused mix-and-step and scale-copy kernels.

For each kernel (mix_and_step for SGD-momentum, Adam, AdamW, AccumAdamW, all with comm + send;
scale_copy; scale_copy with the squared norm of its source, how a gradient enters its bucket; the
int8 group reduction of compressed gossip, 4 members, fp32 parameters), each dtype (fp32, bf16)
and each bucket size (25 MiB, 256 MiB of parameters):

- achieved bandwidth: bytes the kernel must move (every read and every write counted once) /
  median time, against a device-to-device copy (`dst.copy_(src)`) moving the same number of
  bytes (reads + writes) in the same run;
- speedup over torch's own sequence on the same flat bucket: mix `p.mul_(a).add_(c, alpha=b)`,
  then the optimizer step (`torch.optim.*(fused=True)` and, separately, `foreach=True`), then
  `torch.mul(p, s, out=send)`. AccumAdamW has no torch counterpart: its baseline is AdamW's
  sequence (which moves less: no accumulator).

Targets: >= 85% of the copy bandwidth, >= 2x torch's sequence.

Timing: CUDA events around each run on the current stream, warmup, median of --runs (>= 20).

    python -m bench.bench_kernels_cuda [--sizes-mib 25 256] [--dtypes fp32 bf16] [--runs 30] [--out-dir bench/out]

Writes bench_kernels_cuda.csv and .png (fraction of the copy bandwidth, speedup over torch) to --out-dir.

Exits 0 with "no CUDA device, skipping" when there is no GPU.
"""

import argparse
import sys
from pathlib import Path

import torch

from bench.common.plots import finish_axes, finish_figure, pyplot
from bench.common.tables import write_outputs
from tools.cuda_sync import time_ms

COPY_TARGET = 0.85
SPEEDUP_TARGET = 2.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_ext():
    """decentpy.optim.kernels when its extension carries the CUDA kernels, else (None, why)."""
    try:
        from decentpy.optim import kernels
    except Exception as e:  # noqa: BLE001
        return None, f"decentpy.optim.kernels not importable ({e})"
    try:
        info = kernels.build_info()
    except Exception as e:  # noqa: BLE001
        return None, f"decentpy.optim.kernels.build_info() failed ({e})"
    if not info.get("cuda_kernels", False):
        return None, "decentpy._C was built without CUDA kernels"
    return kernels, ""


def copy_ms(total_bytes, runs, warmup):
    """A device copy moving total_bytes (half read, half written)."""
    n = total_bytes // 2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), runs, warmup)
    del src, dst
    return ms


def group(K, lr=1e-3, wd=0.01, momentum=0.0, beta1=0.9, beta2=0.999, eps=1e-8, step=10,
          accum_iter=4):
    """One parameter group (the kernel derives the bias corrections from the 1-based step)."""
    return K.GroupHyper(lr=lr, weight_decay=wd, momentum=momentum, beta1=beta1, beta2=beta2,
                         eps=eps, bias_step=step, accum_iter=accum_iter)


# name -> (kind name in kernels.OptKind, number of fp32 state buffers read, written, decoupled,
#          accum_boundary, group keyword arguments)
CASES = {
    "SGD-momentum": ("SGD", 1, 1, False, False, dict(lr=1e-2, momentum=0.9)),
    "Adam": ("ADAM", 2, 2, False, False, {}),
    "AdamW": ("ADAM", 2, 2, True, False, {}),
    "AccumAdamW": ("ACCUM_ADAM", 3, 1, True, False, {}),
    "AccumAdamW@boundary": ("ACCUM_ADAM", 3, 3, True, True, {}),
}


def torch_sequence(name, p, c, g, send, impl, a, b, s):
    """torch's own mix -> step -> send sequence on the same flat bucket; None if unsupported."""
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    kw = {"fused": True} if impl == "fused" else {"foreach": True}
    try:
        if name == "SGD-momentum":
            opt = torch.optim.SGD([param], lr=1e-2, momentum=0.9, weight_decay=0.01, **kw)
        elif name == "Adam":
            opt = torch.optim.Adam([param], lr=1e-3, weight_decay=0.01, **kw)
        else:  # AdamW, and the stand-in for AccumAdamW
            opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **kw)
        opt.step()  # create the state (and check the implementation is supported)
    except Exception:  # noqa: BLE001 - e.g. fused SGD / bf16 unsupported in this torch
        return None

    def run():
        with torch.no_grad():
            param.mul_(a).add_(c, alpha=b)
        opt.step()
        torch.mul(param.detach(), s, out=send)

    return run


def bench_one(K, name, dtype, nbytes, runs, warmup, rows):
    kind_name, st_read, st_write, decoupled, boundary, group_kw = CASES[name]
    kind = getattr(K.OptKind, kind_name)
    groups = [group(K, **group_kw)]
    esize = torch.finfo(dtype).bits // 8
    numel = nbytes // esize
    dev = "cuda"
    p = torch.randn(numel, device=dev).to(dtype)
    c = torch.randn(numel, device=dev).to(dtype)
    g = torch.randn(numel, device=dev).to(dtype)
    send = torch.empty_like(p)
    nstates = {"SGD": 1, "ADAM": 2, "ACCUM_ADAM": 3}[kind_name]
    states = [torch.zeros(numel, device=dev, dtype=torch.float32) for _ in range(nstates)]
    if kind != K.OptKind.SGD:
        states[1].fill_(1e-4)
    segs = K.segments_for_numel(numel, torch.device(dev))
    a, b, s = 0.5, 0.5, 1.0

    def ours():
        K.fused_step(kind, p, g, states, segs, groups, comm=c, send=send, mix_a=a, mix_b=b, send_scale=s,
                     decoupled_weight_decay=decoupled, accum_boundary=boundary)

    # reads p, c, g; writes p, send; state reads / writes (fp32)
    moved = 5 * numel * esize + (st_read + st_write) * numel * 4
    t_ours = time_ms(ours, runs, warmup)
    t_copy = copy_ms(moved, runs, warmup)
    res = {"kernel": f"mix_and_step {name}", "dtype": dtype, "MiB": nbytes >> 20,
           "ms": t_ours, "GBs": moved / t_ours / 1e6, "copyGBs": moved / t_copy / 1e6}
    res["pct"] = t_copy / t_ours
    base = "AdamW" if name.startswith("AccumAdamW") else name
    for impl in ("fused", "foreach"):
        fn = torch_sequence(base, p, c, g, torch.empty_like(p), impl, a, b, s)
        if fn is None:
            res[impl] = None
        else:
            res[impl] = time_ms(fn, runs, warmup) / t_ours
        del fn
    rows.append(res)
    del p, c, g, send, states
    torch.cuda.empty_cache()


def bench_scale_copy(K, dtype, nbytes, runs, warmup, rows):
    esize = torch.finfo(dtype).bits // 8
    numel = nbytes // esize
    src = torch.randn(numel, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    moved = 2 * numel * esize
    t_ours = time_ms(lambda: K.scale_copy(dst, src, 0.5), runs, warmup)
    t_copy = copy_ms(moved, runs, warmup)
    t_torch = time_ms(lambda: torch.mul(src, 0.5, out=dst), runs, warmup)
    rows.append({"kernel": "scale_copy", "dtype": dtype, "MiB": nbytes >> 20, "ms": t_ours,
                 "GBs": moved / t_ours / 1e6, "copyGBs": moved / t_copy / 1e6,
                 "pct": t_copy / t_ours, "fused": t_torch / t_ours, "foreach": None,
                 "speedup_target": False})  # torch.mul is one pass too: ~1x expected
    del src, dst
    torch.cuda.empty_cache()


def bench_copy_norm(K, dtype, nbytes, runs, warmup, rows):
    """A gradient copied into its bucket with its squared norm in the same pass (what the wrapper
    does for every gradient autograd hands over, then sum + sqrt of the slots): against torch's
    copy followed by a norm (two passes over the gradient)."""
    esize = torch.finfo(dtype).bits // 8
    numel = nbytes // esize
    src = torch.randn(numel, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    slots = torch.empty(K.NORM_SLOTS, device="cuda")
    moved = 2 * numel * esize

    def ours():
        K.scale_copy(dst, src, 1.0, sumsq=slots)
        slots.sum().sqrt_()

    def theirs():
        dst.copy_(src)
        torch.linalg.vector_norm(src, dtype=torch.float32)

    t_ours = time_ms(ours, runs, warmup)
    t_copy = copy_ms(moved, runs, warmup)
    t_torch = time_ms(theirs, runs, warmup)
    rows.append({"kernel": "scale_copy+norm", "dtype": dtype, "MiB": nbytes >> 20, "ms": t_ours,
                 "GBs": moved / t_ours / 1e6, "copyGBs": moved / t_copy / 1e6,
                 "pct": t_copy / t_ours, "fused": t_torch / t_ours, "foreach": None,
                 "speedup_target": False})  # torch: copy_ then vector_norm (3 words an element against 2)
    del src, dst
    torch.cuda.empty_cache()


def bench_group_reduce(K, nbytes, runs, warmup, rows, members=4):
    """The owner's step of a compressed (int8) group exchange over a whole bucket of fp32
    parameters: read the ``members`` q wires and its public copy, write r and the copy. No torch
    counterpart."""
    comp = K.Compressor.INT8
    numel = (nbytes // 4) // K.INT8_BLOCK * K.INT8_BLOCK
    wire = K.compressed_bytes(comp, numel)
    qs = []
    for t in range(members):  # real q of random differences, each with its own block scales
        q = torch.empty(wire, dtype=torch.uint8, device="cuda")
        K.compressed_step(K.OptKind.NONE, comp, torch.randn(numel, device="cuda") * 0.01 * (t + 1), None, [], None,
                          [], q_send=q, self_copy_next=torch.zeros(numel, device="cuda"))
        qs.append(q)
    out = torch.empty(wire, dtype=torch.uint8, device="cuda")
    mine = torch.randn(numel, device="cuda")
    moved = (members + 1) * wire + 8 * numel
    t_ours = time_ms(lambda: K.group_reduce(comp, qs, out, mine, 0, numel), runs, warmup)
    t_copy = copy_ms(moved, runs, warmup)
    rows.append({"kernel": f"group_reduce int8 x{members}", "dtype": torch.float32, "MiB": nbytes >> 20,
                 "ms": t_ours, "GBs": moved / t_ours / 1e6, "copyGBs": moved / t_copy / 1e6,
                 "pct": t_copy / t_ours, "fused": None, "foreach": None, "speedup_target": False})
    del qs, out, mine
    torch.cuda.empty_cache()


def fmt_x(v):
    return "   n/a" if v is None else f"{v:5.2f}x"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[25, 256])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--kernels", nargs="+", default=list(CASES) + ["scale_copy", "scale_copy+norm", "group_reduce"])
    ap.add_argument("--out-dir", type=Path, default=Path("bench/out"))
    args = ap.parse_args()
    args.runs = max(args.runs, 20)

    if not torch.cuda.is_available():
        print("no CUDA device, skipping")
        return 0
    K, why = load_ext()
    if K is None:
        print(f"{why}; skipping the kernel benchmark")
        return 0

    props = torch.cuda.get_device_properties(0)
    print(f"device: {torch.cuda.get_device_name(0)} ({props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB)")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"decentpy kernels for {K.build_info().get('cuda_archs', '?')}")
    print(f"median of {args.runs} runs after {args.warmup} warmup; GB/s = bytes moved (reads + "
          f"writes) / time; copy = dst.copy_(src) of the same bytes in the same run")
    print()

    rows = []
    for mib in args.sizes_mib:
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            for k in args.kernels:
                if k == "scale_copy":
                    bench_scale_copy(K, dtype, mib << 20, args.runs, args.warmup, rows)
                elif k == "scale_copy+norm":
                    bench_copy_norm(K, dtype, mib << 20, args.runs, args.warmup, rows)
                elif k == "group_reduce":
                    if dname == args.dtypes[0]:  # fp32 parameters only: once per size
                        bench_group_reduce(K, mib << 20, args.runs, args.warmup, rows)
                elif k in CASES:
                    bench_one(K, k, dtype, mib << 20, args.runs, args.warmup, rows)
                else:
                    print(f"unknown kernel {k!r}", file=sys.stderr)
                    return 2

    hdr = (f"{'kernel':34} {'dtype':6} {'MiB':>5} {'time ms':>9} {'GB/s':>8} {'copy GB/s':>10} "
           f"{'%copy':>6} {'vs fused':>9} {'vs foreach':>10}")
    print(hdr)
    print("-" * len(hdr))
    ok_bw = ok_sp = True
    for r in rows:
        dn = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[r["dtype"]]
        print(f"{r['kernel']:34} {dn:6} {r['MiB']:5d} {r['ms']:9.4f} {r['GBs']:8.0f} "
              f"{r['copyGBs']:10.0f} {100 * r['pct']:5.1f}% {fmt_x(r['fused']):>9} "
              f"{fmt_x(r['foreach']):>10}")
        ok_bw &= r["pct"] >= COPY_TARGET
        if r.get("speedup_target", True):
            sp = [v for v in (r["fused"], r["foreach"]) if v is not None]
            ok_sp &= all(v >= SPEEDUP_TARGET for v in sp)
    print()
    print(f"target: >= {100 * COPY_TARGET:.0f}% of copy bandwidth: "
          f"{'met' if ok_bw else 'NOT met'}")
    print(f"target: >= {SPEEDUP_TARGET:.0f}x torch's sequence (mix, optimizer step, send; "
          f"mix_and_step rows): {'met' if ok_sp else 'NOT met'}")
    print("(scale_copy's 'vs fused' column is torch.mul(src, a, out=dst), a single pass too; scale_copy+norm's is "
          "copy_ then vector_norm, two passes; group_reduce has no torch counterpart)")
    print("(AccumAdamW rows compare with AdamW's torch sequence, which has no accumulator)")
    device = torch.cuda.get_device_name(0)
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    csv_rows = [{"device": device, "torch": torch.__version__, "kernel": r["kernel"], "dtype": names[r["dtype"]],
                 "MiB": r["MiB"], "ms": r["ms"], "GBs": r["GBs"], "copy_GBs": r["copyGBs"], "frac_copy": r["pct"],
                 "speedup_vs_fused": r["fused"], "speedup_vs_foreach": r["foreach"]} for r in rows]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_outputs(args.out_dir, "bench_kernels_cuda", list(csv_rows[0]), csv_rows,
                  plot=lambda path: plot(csv_rows, device, path))
    return 0


def plot(rows, device, path):
    """Two panels: fraction of the copy bandwidth, and speedup over torch's fused sequence."""
    plt = pyplot("pip install matplotlib")
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['kernel'].replace('mix_and_step ', '')}\n{r['dtype']} {r['MiB']}MiB" for r in rows]
    xs = range(len(rows))
    axes[0].bar(xs, [100 * r["frac_copy"] for r in rows], label="fused kernel")
    axes[0].axhline(100 * COPY_TARGET, color="red", linestyle="--", label="target")
    axes[1].bar(xs, [r["speedup_vs_fused"] or 0 for r in rows], label="vs torch fused")
    axes[1].axhline(SPEEDUP_TARGET, color="red", linestyle="--", label="target")
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
    finish_axes(axes[0], "% of device copy bandwidth", "achieved bandwidth", grid_axis="y")
    finish_axes(axes[1], "speedup (x)", "over torch's mix + step + send", grid_axis="y")
    return finish_figure(fig, f"decentpy CUDA kernels on {device}, torch {torch.__version__}", path)


if __name__ == "__main__":
    sys.exit(main())
