"""Microbenchmark of the fused outer step of local-steps training (csrc/kernels/outer_step.h) on one
bucket, CPU and (when there is one) CUDA.

The outer step of one bucket is two passes around the outer exchange: the pack (the pseudo-gradient
``theta - x``, or with int8 its wire bytes, error-fed) and the apply (DiLoCo's Nesterov SGD on the
global copy with the mixed pseudo-gradient, the new global copy, the parameters reset to it). Per
element, float32 parameters: the pack reads x, theta and writes d (12 bytes; int8: also reads and
writes the excess, writes 1 code byte: 17 bytes + the scales); the apply reads d (int8: 1 byte),
theta, the momentum and writes theta, the momentum, x (24 bytes; int8: 21).

SparseLoCo's exchange (``sparse``, csrc/kernels/sparse.h, the defaults: 64 of every 4096 entries in 2
bits, decay 0.95) is three passes: the pack (reads x, theta, the error buffer, writes it: 16 bytes,
plus the chunk's selection in cache), the mean of four members' messages (writes d: 4 bytes) and the
outer step theta - d (reads d and theta, writes theta and x: 16 bytes): 36 bytes per element.

Compared with:
  (torch) the same work as torch ops: ``d = theta - x`` (int8: ``- excess``, the per-block amax,
          scale, round, clamp, the int8 cast, ``excess = D(q) - d``, the dequantisation before the
          step), torch's SGD(nesterov) over theta (fused where torch has it here, else foreach),
          ``x.copy_(theta)``;
          sparse: the error update, ``topk`` of ``|e|`` per chunk row, the two centroids per row, the codes
          packed four to a byte, ``e`` minus the decoded values (scatter), the four members' values
          added into a zero buffer (``index_add_``) and averaged, ``theta -= d``, ``x.copy_(theta)``;
  (copy)  a same-run ``dst.copy_(src)`` moving the fused passes' bytes (read + write).

Prints medians of interleaved runs, the ratios, and the machine; writes
``bench/out/bench_outer_step.csv`` and ``.png``.

Usage: python -m bench.bench_outer_step [--size-mb 25] [--repeats 9] [--device cpu|cuda|all]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

from bench.bench_kernels import interleaved_medians
from bench.common.machine import report_machine
from bench.common.plots import finish_axes, finish_figure, pyplot
from bench.common.tables import write_outputs
from decentpy.optim import kernels
from decentpy.local_steps import SparseOuter, diloco_outer_optim
from decentpy.optim.outer import outer_step, pseudo_gradient

OUT = Path(__file__).resolve().parent / "out"
BLOCK = kernels.INT8_BLOCK
FIELDS = ["device", "kind", "numel", "fused_ms", "torch_ms", "copy_ms", "speedup_vs_torch", "pct_of_copy",
          "bytes_per_element", "pack_ms", "pack_pct_of_copy", "cpu", "cores", "torch", "gpu"]


def _torch_sgd(theta: torch.Tensor) -> torch.optim.Optimizer:
    """DiLoCo's outer SGD, torch's fastest form here (fused on CUDA, foreach otherwise)."""
    try:
        return torch.optim.SGD([theta], lr=0.7, momentum=0.9, nesterov=True, fused=theta.is_cuda)
    except (RuntimeError, TypeError):
        return torch.optim.SGD([theta], lr=0.7, momentum=0.9, nesterov=True, foreach=True)


def _report(device: torch.device, kind: str, numel: int, moved: int, med: Dict[str, float], repeats: int,
            title: str, fused: str) -> Dict[str, Any]:
    """Print one variant's medians and ratios (fused against torch's ops and a copy of ``moved`` bytes)
    and return its row."""
    pct = med["copy"] / med["fused"]
    ratio = med["torch"] / med["fused"]
    print(f"\n[{device}] {title}, bucket {numel * 4 / 2**20:.1f} MiB fp32, median of {repeats} interleaved runs")
    print(f"  fused {fused:<17} {med['fused'] * 1e3:9.2f} ms  ({moved / med['fused'] / 1e9:6.1f} GB/s)")
    print(f"  torch ops, same work    {med['torch'] * 1e3:9.2f} ms  -> fused is {ratio:.2f}x faster")
    print(f"  copy of the same bytes  {med['copy'] * 1e3:9.2f} ms  -> fused runs at {100 * pct:.1f}% of copy")
    return dict(device=device.type, kind=kind, numel=numel, fused_ms=round(med["fused"] * 1e3, 3),
                torch_ms=round(med["torch"] * 1e3, 3), copy_ms=round(med["copy"] * 1e3, 3),
                speedup_vs_torch=round(ratio, 3), pct_of_copy=round(100 * pct, 1),
                bytes_per_element=round(moved / numel, 2))


SPARSE = SparseOuter()
MEMBERS = 4


def bench_sparse(device: torch.device, numel: int, repeats: int) -> Dict[str, Any]:
    """SparseLoCo's pack, the mean of four members' messages and its outer step: fused against torch ops."""
    chunk, k = SPARSE.chunk, SPARSE.k
    numel = max(chunk, numel // chunk * chunk)
    rows = numel // chunk
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(numel, generator=gen)
    x0 = theta0 - 0.01 * torch.randn(numel, generator=gen)

    x, theta = x0.to(device), theta0.to(device)
    error = torch.zeros_like(theta)
    wire = torch.empty(SPARSE.wire_bytes(numel), dtype=torch.uint8, device=device)
    delta = torch.empty_like(theta)
    opt = torch.optim.SGD([theta], lr=1.0)

    def fused() -> None:
        kernels.sparse_pack(x, theta, error, wire, chunk, k, SPARSE.decay)
        kernels.sparse_mean([wire] * MEMBERS, delta, chunk, k)  # (four members' messages: the same bytes here)
        assert outer_step(opt, [x], [theta], [delta], stepped=[theta])

    tx, tth = x0.to(device), theta0.to(device)
    te = torch.zeros_like(tth)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=device)
    packed = torch.empty(rows, k // 4, dtype=torch.uint8, device=device)
    base = (torch.arange(rows, device=device) * chunk)[:, None]

    def torch_ops() -> None:
        with torch.no_grad():
            te.mul_(SPARSE.decay).add_(tth - tx)
            e = te.view(rows, chunk)
            idx = e.abs().topk(k, dim=1).indices.sort(dim=1).values
            v = e.gather(1, idx)
            m = v.abs()
            a = m.mean(dim=1, keepdim=True)
            hi = m >= a
            s_hi = (m * hi).sum(1, keepdim=True) / hi.sum(1, keepdim=True).clamp(min=1)
            s_lo = (m * ~hi).sum(1, keepdim=True) / (~hi).sum(1, keepdim=True).clamp(min=1)
            code = (v < 0).to(torch.uint8) | (hi.to(torch.uint8) << 1)
            packed.copy_((code.view(rows, k // 4, 4) << shifts).sum(-1, dtype=torch.uint8))  # (the wire's codes)
            dec = torch.where(hi, s_hi, s_lo) * torch.where(v < 0, -1.0, 1.0)
            e.scatter_add_(1, idx, -dec)
            flat = (idx + base).view(-1)
            d = torch.zeros_like(tth)
            for _ in range(MEMBERS):
                d.index_add_(0, flat, dec.view(-1))
            tth.sub_(d.mul_(1.0 / MEMBERS))
            tx.copy_(tth)

    moved = 36 * numel
    src = torch.empty(moved // 8, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    psrc = torch.empty(16 * numel // 8, dtype=torch.float32, device=device)  # the pack's own bytes (16 / element)
    pdst = torch.empty_like(psrc)
    med = interleaved_medians({"fused": fused, "torch": torch_ops, "copy": lambda: dst.copy_(src),
                               "pack": lambda: kernels.sparse_pack(x, theta, error, wire, chunk, k, SPARSE.decay),
                               "pack_copy": lambda: pdst.copy_(psrc)}, device, repeats)
    row = _report(device, "sparse", numel, moved, med, repeats,
                  f"SparseLoCo's exchange ({k} of every {chunk}, 2 bits) and outer step, {MEMBERS} members' messages",
                  "pack + mean + apply")
    ppct = med["pack_copy"] / med["pack"]
    print(f"  the pack pass alone     {med['pack'] * 1e3:9.2f} ms  -> {100 * ppct:.1f}% of a copy of its 16 bytes "
          f"per element ({med['pack_copy'] * 1e3:.2f} ms)")
    return dict(row, pack_ms=round(med["pack"] * 1e3, 3), pack_pct_of_copy=round(100 * ppct, 1))


def bench(device: torch.device, numel: int, repeats: int, kind: str) -> Dict[str, Any]:
    if kind == "sparse":
        return bench_sparse(device, numel, repeats)
    numel = max(BLOCK, numel // BLOCK * BLOCK)
    nb = numel // BLOCK
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(numel, generator=gen)
    x0 = theta0 - 0.01 * torch.randn(numel, generator=gen)
    comp = kernels.Compressor.INT8 if kind == "int8" else None

    # fused: pack, (the exchange), apply -- the engine's two passes
    x, theta = x0.to(device), theta0.to(device)
    opt = diloco_outer_optim([theta])
    excess = torch.zeros_like(theta) if comp is not None else None
    out = (torch.empty(kernels.compressed_bytes(comp, numel), dtype=torch.uint8, device=device) if comp is not None
           else torch.empty_like(theta))

    def fused() -> None:
        pseudo_gradient(x, theta, out, comp, excess)
        assert outer_step(opt, [x], [theta], [out], stepped=[theta], compressor=comp)

    # torch: the same work as torch ops
    tx, tth = x0.to(device), theta0.to(device)
    topt = _torch_sgd(tth)
    t_ex = torch.zeros_like(tth)
    codes = torch.empty(numel, dtype=torch.int8, device=device)

    def torch_ops() -> None:
        with torch.no_grad():
            d = tth - tx
            if kind == "int8":
                d.sub_(t_ex)
                db = d.view(nb, BLOCK)
                sc = db.abs().amax(dim=1) / 127.0
                safe = torch.where(sc > 0, sc, torch.ones_like(sc))
                codes.copy_(torch.round(db / safe[:, None]).clamp_(-127, 127).view(-1))
                dq = (codes.float().view(nb, BLOCK) * sc[:, None]).view(-1)  # (the receiver's dequantisation)
                torch.sub(dq, d, out=t_ex)
                d = dq
        tth.grad = d
        topt.step()
        tth.grad = None
        with torch.no_grad():
            tx.copy_(tth)

    per_elem = (12 + 24) if comp is None else (17 + 21)
    moved = per_elem * numel + (8 * nb if comp is not None else 0)
    src = torch.empty(moved // 8, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    med = interleaved_medians({"fused": fused, "torch": torch_ops, "copy": lambda: dst.copy_(src)}, device, repeats)
    return _report(device, kind, numel, moved, med, repeats, f"outer step ({kind}), DiLoCo's Nesterov SGD",
                   "pack + apply")


def plot(rows: List[Dict[str, Any]], machine: Dict[str, str], path: Path) -> Any:
    plt = pyplot("pip install matplotlib")
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    labels = [f"{r['device']} {r['kind']}" for r in rows]
    axes[0].bar(labels, [r["pct_of_copy"] for r in rows], label="fused, % of a same-run copy")
    axes[0].axhline(100, color="grey", lw=0.8)
    finish_axes(axes[0], "% of copy bandwidth", "fused outer step (pack + apply)", grid_axis="y")
    axes[1].bar(labels, [r["speedup_vs_torch"] for r in rows], color="tab:orange", label="torch ops time / fused time")
    axes[1].axhline(1, color="grey", lw=0.8)
    finish_axes(axes[1], "speed-up", "vs torch's sequence of the same ops", grid_axis="y")
    return finish_figure(fig, f"bench_outer_step: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}",
                         path)


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=25.0, help="bucket size in MiB of fp32 (default 25)")
    ap.add_argument("--repeats", type=int, default=9, help="timed runs per variant (median)")
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the CSV and the plot (default bench/out)")
    ap.add_argument("--docs", action="store_true",
                    help="also write the published table (docs/data/bench_outer_step.csv) and plot (docs/)")
    args = ap.parse_args(argv)
    machine = report_machine()
    devices = [torch.device("cpu")] if args.device in ("cpu", "all") else []
    if args.device in ("cuda", "all") and torch.cuda.is_available() and kernels.build_info()["cuda_kernels"]:
        devices.append(torch.device("cuda"))
    elif args.device == "cuda":
        print("cuda: not available, or decentpy built without its CUDA kernels", file=sys.stderr)
        return 1
    gpu = torch.cuda.get_device_name() if any(d.type == "cuda" for d in devices) else ""
    rows = []
    for d in devices:
        for kind in ("fp32", "int8", "sparse"):
            row = bench(d, int(args.size_mb * 2**20) // 4, max(args.repeats, 1), kind)
            row.update(cpu=machine["cpu"], cores=machine["cores"], torch=machine["torch"], gpu=gpu)
            rows.append(row)
    write_outputs(args.out, "bench_outer_step", FIELDS, rows, lambda p: plot(rows, machine, p))
    if args.docs:
        docs = Path(__file__).resolve().parents[1] / "docs"
        table = [{"device": r["device"], "pseudo-gradient": r["kind"], "fused pack + apply ms": r["fused_ms"],
                  "torch ops ms": r["torch_ms"], "copy of the same bytes ms": r["copy_ms"],
                  "fused vs torch": f"{r['speedup_vs_torch']:.2f}x", "% of copy": r["pct_of_copy"],
                  "bytes / element": r["bytes_per_element"],
                  "pack pass % of copy": r.get("pack_pct_of_copy", "")} for r in rows]
        write_outputs(docs / "data", "bench_outer_step", list(table[0]), table)
        plot(rows, machine, docs / "bench_outer_step.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
