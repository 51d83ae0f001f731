"""decentpy's per-iteration overhead on a GPU, against torch's fused AdamW, at world size 1.

A ~100M-parameter MLP (``--layers`` x Linear(``--width``, ``--width``)) on one GPU, a small batch so
that the optimizer step is a large part of the iteration. In one run, timed with CUDA events
(median of ``--runs`` iterations after a warm-up):

- ``torch``: forward, backward, ``torch.optim.AdamW(fused=True).step()`` (the gradients kept, as
  decentpy keeps them: autograd adds each new gradient to the existing one in place);
- ``torch + zero_grad``: the same with ``opt.zero_grad()`` (set to None) after the step, the usual
  loop: autograd then hands each gradient over without a pass over it, and the step reads it once;
- ``fwd+bwd``: forward and backward alone; ``step``: the fused AdamW step alone;
- ``decentpy``: ``DecentralizedDataParallel(topology='complete')`` in a world of one process: the
  forward and backward, with the fused step run bucket by bucket inside the backward; with the
  default non-finite check (a norm per bucket) and with ``nonfinite='ignore'``; with
  ``--ablations`` also the default with each part of its path flipped in turn (the norm taken
  while the gradients are copied in, off by default, switched on; the deferred skip verdicts and
  the release of consumed gradients switched off), and with all three off.

Overhead = decentpy - torch: what the hooks, bucket bookkeeping and launches cost beyond the work
torch does, as a fraction of torch's iteration (target < 5%) and of its step. The host
synchronisations of a decentpy backward are counted with torch's sync debug mode (target: none).

    python -m bench.bench_overhead_cuda [--width 4096] [--layers 6] [--batch 64] [--runs 50] [--ablations]

Exits 0 with "no CUDA device, skipping" when there is no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from bench.bench_kernels_cuda import time_ms
from bench.common.machine import report_machine
from bench.common.tables import print_targets, write_outputs
from tools.cuda_sync import syncs_in

OVERHEAD_TARGET = 0.05


def profile(name: str, fn: Callable[[], None], iters: int = 5) -> str:
    """Tables of ``iters`` iterations of fn under the torch profiler: GPU kernels by total time, host
    calls by total CPU time (printed and returned)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    text = (f"== {name}: {iters} iterations, by GPU time\n"
            + events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60)
            + f"\n== {name}: by host time\n"
            + events.table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60))
    print(text)
    return text


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: List[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods).cuda()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bucket-mib", type=float, default=25.0)
    ap.add_argument("--out-dir", type=Path, default=Path("bench/out"))
    ap.add_argument("--ablations", action="store_true",
                    help="also time nonfinite='skip' with each part of its path switched off in turn: the norm taken "
                         "while copying gradients in, the deferred skip verdicts, the release of consumed gradients")
    ap.add_argument("--profile", action="store_true",
                    help="also profile 5 iterations of each (torch profiler): the kernels by GPU time and the host "
                         "calls by CPU time, into <out-dir>/bench_overhead_cuda_profile.txt")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device, skipping")
        return 0

    from decentpy import DecentralizedDataParallel
    from decentpy.engine.bucket import Bucket
    from decentpy.engine.gossip import GossipStrategy
    from decentpy.optim import optim_fn_adamw

    machine = report_machine()
    gpu = torch.cuda.get_device_name(0)
    print(f"gpu: {gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.randn(args.batch, args.width, device="cuda")
    y = torch.randn(args.batch, args.width, device="cuda")
    loss_fn = nn.functional.mse_loss

    ref = make_model(args.width, args.layers)
    nparams = sum(p.numel() for p in ref.parameters())
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {nparams / 1e6:.1f}M parameters, "
          f"batch {args.batch}; median of {args.runs} iterations after {args.warmup}")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def fwd_bwd() -> None:
        loss_fn(ref(x), y).backward()

    def torch_iter() -> None:
        fwd_bwd()
        opt.step()

    def torch_iter_zero() -> None:
        fwd_bwd()
        opt.step()
        opt.zero_grad()

    profiles: List[str] = []
    t_fb = time_ms(fwd_bwd, args.runs, args.warmup)
    t_torch = time_ms(torch_iter, args.runs, args.warmup)
    t_step = time_ms(opt.step, args.runs, args.warmup)
    t_torch_zero = time_ms(torch_iter_zero, args.runs, args.warmup)
    if args.profile:
        profiles.append(profile("torch", torch_iter))
    del ref, opt
    torch.cuda.empty_cache()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    results: Dict[str, Dict[str, float]] = {}
    # (setting, nonfinite, the norm from the copies, deferred verdicts, release of consumed gradients)
    defaults = (Bucket.norm_while_copying, GossipStrategy.defers_verdicts, Bucket.release_consumed_grads)
    settings = [("skip", "skip", *defaults), ("ignore", "ignore", *defaults)]
    if args.ablations:
        copies, defer, release = defaults
        settings += [("skip, norm while copying" if not copies else "skip, norm by a second pass", "skip",
                      not copies, defer, release),
                     ("skip, verdicts read first", "skip", copies, False, release),
                     ("skip, gradients kept (added in place)", "skip", copies, defer, False),
                     ("skip, none of the three (the earlier path)", "skip", False, False, False)]
    try:
        for setting, nonfinite, copies, defer, release in settings:
            Bucket.norm_while_copying, GossipStrategy.defers_verdicts = copies, defer
            Bucket.release_consumed_grads = release
            model = make_model(args.width, args.layers)
            ddp = DecentralizedDataParallel(model, lambda named: optim_fn_adamw(named, lr=1e-4, weight_decay=0.01),
                                            topology="complete", bucket_size_in_mb=args.bucket_mib,
                                            nonfinite=nonfinite)

            def ours() -> None:
                loss_fn(ddp(x), y).backward()

            t = time_ms(ours, args.runs, args.warmup)
            syncs = [syncs_in(ours) for _ in range(5)]
            if args.profile and setting == "skip":
                profiles.append(profile("decentpy", ours))
            results[setting] = {"ms": t, "syncs": max(syncs[1:]), "buckets": len(ddp.buckets)}
            ddp.close()
            del ddp, model
            torch.cuda.empty_cache()
    finally:
        Bucket.norm_while_copying, GossipStrategy.defers_verdicts, Bucket.release_consumed_grads = defaults
        dist.destroy_process_group()
    t_ours, buckets = results["skip"]["ms"], int(results["skip"]["buckets"])

    over = t_ours - t_torch
    rows: List[Dict[str, object]] = []
    for setting, r in results.items():
        o = r["ms"] - t_torch
        rows.append({"gpu": gpu, "torch": torch.__version__, "cpu": machine.get("cpu", ""),
                     "params_m": round(nparams / 1e6, 1), "batch": args.batch, "buckets": buckets,
                     "setting": setting, "torch_iter_ms": t_torch, "fwd_bwd_ms": t_fb,
                     "fused_adamw_step_ms": t_step, "torch_iter_zero_grad_ms": t_torch_zero,
                     "decentpy_iter_ms": r["ms"], "overhead_ms": o,
                     "overhead_of_iter": o / t_torch, "overhead_of_step": o / t_step,
                     "overhead_vs_zero_grad": (r["ms"] - t_torch_zero) / t_torch_zero,
                     "host_syncs_per_iter": r["syncs"]})
    print()
    print(f"{'torch fwd+bwd+fused AdamW':40} {t_torch:9.3f} ms")
    print(f"{'  fwd+bwd alone':40} {t_fb:9.3f} ms")
    print(f"{'  fused AdamW step alone':40} {t_step:9.3f} ms")
    print(f"{'torch, with zero_grad() after the step':40} {t_torch_zero:9.3f} ms")
    for setting, r in results.items():
        o = r["ms"] - t_torch
        print(f"{'decentpy, ' + setting:48} {r['ms']:9.3f} ms   overhead {o:+.3f} ms = "
              f"{100 * o / t_torch:+.1f}% of torch's iteration, {100 * o / t_step:+.1f}% of its step; "
              f"{int(r['syncs'])} host sync(s) per iteration ({buckets} buckets); "
              f"{100 * (r['ms'] - t_torch_zero) / t_torch_zero:+.1f}% of torch's loop with zero_grad()")
    print_targets([
        (f"overhead < {100 * OVERHEAD_TARGET:.0f}% of the iteration (default settings)", over / t_torch < OVERHEAD_TARGET,
         f"{100 * over / t_torch:+.1f}%"),
        ("no host synchronisation in the backward (the skip verdicts are read at the next backward)",
         results["skip"]["syncs"] == 0 and results["ignore"]["syncs"] == 0,
         f"{int(results['skip']['syncs'])} per iteration (nonfinite='skip'), "
         f"{int(results['ignore']['syncs'])} (nonfinite='ignore')"),
    ])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_outputs(args.out_dir, "bench_overhead_cuda", list(rows[0]), rows)
    if profiles:
        path = args.out_dir / "bench_overhead_cuda_profile.txt"
        path.write_text("\n\n".join(profiles))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
