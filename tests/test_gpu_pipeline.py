"""AsyncPipe with stages on a GPU: what only CUDA can show (the protocol itself is tested on gloo
with CPU stages in test_pipeline.py).

- Two stages sharing one GPU, messages over gloo (tensors cross through the host): gradients and
  output equal the unpipelined model on the same GPU (float64), for the fairscale-style driver
  and both schedules, with checkpointing (CUDA RNG state restored in the recomputation: dropout).
- Two stages on two GPUs over NCCL (the wire is the GPU; skipped with fewer than 2 GPUs: NCCL
  needs one device per rank).

Every test here skips without CUDA.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_harness import run_workers

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                               reason="NCCL pipeline needs 2 GPUs (one per rank)")


def _model(device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).double().to(device)


def _gpu_worker(rank: int, world: int, device_of_rank: List[int], nccl: bool) -> Dict[str, float]:
    from decentpy import AsyncPipe

    device = torch.device("cuda", device_of_rank[rank])
    torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl") if nccl else None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 16, generator=g, dtype=torch.float64).to(device)
    y = torch.randn(12, 4, generator=g, dtype=torch.float64).to(device)
    ref = _model(device)
    ref_out = ref(x)
    ((ref_out - y) ** 2).mean().backward()
    refp = dict(ref.named_parameters())
    out: Dict[str, float] = {}
    for driver in ("forward", "gpipe", "1f1b"):
        for ckpt in ("never", "always"):
            pipe = AsyncPipe(_model(device), [3, 2], group=group, chunks=4, checkpoint=ckpt, timeout=60)
            if driver == "forward":
                res = pipe(x if pipe.stage == 0 else None)
                if pipe.final_stage:
                    ((res - y) ** 2).mean().backward()
                    err = (res.detach() - ref_out.detach()).abs().max().item()
                else:
                    pipe.back_helper(res)
                    err = 0.0
            else:
                loss = pipe.train_step(x, y, lambda o, t: ((o - t) ** 2).mean(), schedule=driver)
                err = 0.0 if loss is None else abs(loss.item() - ((ref_out - y) ** 2).mean().item())
            for n, p in pipe.partition.named_parameters():
                assert p.grad is not None and p.grad.device == device, (n, p.grad)
                err = max(err, (p.grad - refp[n].grad).abs().max().item())
            out[f"{driver}/{ckpt}"] = err
    # dropout on the GPU, recomputed for backward: the same masks as without checkpointing
    grads = {}
    for ckpt in ("never", "always"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4), nn.Dropout(0.5)).double().to(device)
        pipe = AsyncPipe(model, [2, 2], group=group, chunks=3, checkpoint=ckpt, timeout=60)
        torch.manual_seed(10 + rank)
        pipe.train_step(x, y, lambda o, t: ((o - t) ** 2).mean())
        grads[ckpt] = [p.grad for p in pipe.parameters()]
    out["dropout"] = max((a - b).abs().max().item() for a, b in zip(grads["never"], grads["always"]))
    return out


@needs_cuda
def test_stages_on_one_gpu_over_gloo() -> None:
    for rank, res in enumerate(run_workers(_gpu_worker, 2, [0, 0], False, timeout=300)):
        for key, err in res.items():
            assert err <= 1e-10, (rank, key, err)


@needs_two
def test_stages_on_two_gpus_over_nccl() -> None:
    for rank, res in enumerate(run_workers(_gpu_worker, 2, [0, 1], True, timeout=300)):
        for key, err in res.items():
            assert err <= 1e-10, (rank, key, err)
