"""End to end with CUDA tensors: the CPU tests' references, run with the model on a GPU.

- Every topology x every fused optimizer on 4 processes sharing one GPU over gloo (the messages
  cross through pinned host copies: gloo's send/recv cannot read device memory), against the same
  float64 re-computation as tests/test_ddp_reference.py.
- A GradScaler with per-bucket clipping and a worker whose gradients overflow, on the GPU, against
  the float64 reference of tests/test_ddp_features.py.
- ``comm='nccl'`` at world size 1 (decentpy's own NCCL communicator) with every fused optimizer,
  against the float64 reference.
- Mixed precision: bf16 autocast, and fp16 autocast with a GradScaler, against torch's own AdamW
  on the same GPU model under the same autocast (world size 1: the step is the whole difference).
- OSS + ShardedDataParallel on 2 processes sharing the GPU over gloo, against torch DDP + AdamW.
- Compressed gossip (int8, bf16, int4; pairs, a group of 4 through the shared-mean exchange, a sharded
  node pair) on 4 processes sharing the GPU: the CUDA kernels and the group reduction in training,
  against tests/test_compression.py's float64 re-computation and tolerances.
- The README's quickstart (examples/quickstart.py) under torchrun on the GPUs, one rank per GPU
  (NCCL): the script moves its model and data to ``cuda:LOCAL_RANK``, which the wrapper requires.

NCCL across ranks needs one GPU per rank: those cases live in tests/test_nccl_comm.py and
tests/test_gpu_pipeline.py and skip with fewer than 2 GPUs. Every test here skips without CUDA.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List

import pytest
import torch

from dist_harness import run_workers, single_process_group, torchrun
from reference import assert_close_params, batch, decentpy_optim_fn, loss_fn, make_mlp, simulate
from test_compression import check_combo, train_combo
from test_ddp_features import amp_worker, check_grad_scaler_run
from test_ddp_reference import combos_4, reference_params, train_all

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FUSED = ["sgd", "adam", "adamw", "accum_adam", "accum_adamw"]


@pytest.fixture(scope="module")
def shared_gpu_results() -> List[Dict[str, Dict[str, torch.Tensor]]]:
    return run_workers(train_all, 4, combos_4(), 2, "cuda", timeout=400)


@pytest.mark.parametrize("topo,opt", combos_4())
def test_every_topology_and_optimizer_on_a_shared_gpu(shared_gpu_results, topo: str, opt: str) -> None:
    got = [r[f"{topo}/{opt}"] for r in shared_gpu_results]
    assert_close_params(got, reference_params(4, topo, opt), rtol=2e-5, atol=2e-5, what=f"cuda {topo}/{opt} n=4")


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_grad_scaler_and_clipping_on_gpu(opt: str) -> None:
    check_grad_scaler_run(run_workers(amp_worker, 4, opt, "cuda", timeout=300), opt)


@pytest.mark.parametrize("opt", FUSED)
def test_nccl_communicator_world_of_one(opt: str) -> None:
    from decentpy import DecentralizedDataParallel

    steps = 5
    with single_process_group("nccl"):
        model = make_mlp(0).cuda()
        ddp = DecentralizedDataParallel(model, decentpy_optim_fn(opt), topology="complete", comm="nccl",
                                        bucket_size_in_mb=0.0002)
        assert "nccl" in type(ddp.communicator).__name__.lower(), type(ddp.communicator)
        for k in range(steps):
            x, y = (t.cuda() for t in batch(0, k))
            loss_fn(ddp(x), y).backward()
        ddp.wait()
        got = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
        ddp.close()
    want = simulate(1, lambda k: torch.ones(1, 1), opt, steps)
    assert_close_params([got], want, rtol=2e-5, atol=2e-5, what=f"comm='nccl' world 1 {opt}")


def _autocast_run(dtype: torch.dtype, ours: bool, steps: int = 6) -> Dict[str, torch.Tensor]:
    """``steps`` AdamW iterations of the MLP under autocast(dtype) on the GPU, by decentpy (world of one)
    or by plain torch; fp16 with a GradScaler."""
    from decentpy import DecentralizedDataParallel

    model = make_mlp(0).cuda()
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0) if dtype == torch.float16 else None
    named = list(model.named_parameters())
    if ours:
        net = DecentralizedDataParallel(model, decentpy_optim_fn("adamw"), topology="complete", scaler=scaler)
    else:
        net, opt = model, decentpy_optim_fn("torch_adamw")(named)
    for k in range(steps):
        x, y = (t.cuda() for t in batch(0, k))
        with torch.autocast("cuda", dtype=dtype):
            loss = loss_fn(net(x), y)
        if ours:
            (scaler.scale(loss) if scaler is not None else loss).backward()
        else:
            opt.zero_grad()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
    if ours:
        net.wait()
        net.close()
    return {n: p.detach().double().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16-scaler"])
def test_autocast_matches_torch_adamw(dtype: torch.dtype) -> None:
    with single_process_group("gloo"):
        got = _autocast_run(dtype, ours=True)
    want = _autocast_run(dtype, ours=False)
    start = {n: p.detach().double() for n, p in make_mlp(0).named_parameters()}
    moved = max((want[n] - start[n]).abs().max().item() for n in want)
    assert moved > 1e-2, f"the reference barely trained ({moved:.3g}): the comparison would prove nothing"
    # Same forward, same gradients; the two AdamW implementations round differently, and a
    # parameter a rounding apart can round differently to the autocast dtype: 1% of the movement.
    assert_close_params([got], [want], rtol=0.0, atol=0.01 * moved, what=f"autocast {dtype}")


def _sharded_worker(rank: int, world: int) -> List[float]:
    """OSS + ShardedDataParallel beside torch DDP + AdamW, CUDA tensors over gloo; the largest
    parameter difference after each step."""
    from torch.nn.parallel import DistributedDataParallel

    from decentpy import OSS, ShardedDataParallel

    torch.cuda.set_device(0)
    model, ref = make_mlp(0).cuda(), make_mlp(0).cuda()
    oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=64)
    ddp = DistributedDataParallel(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    errs = []
    for k in range(4):
        x, y = (t.cuda() for t in batch(rank, k))
        loss_fn(sdp(x), y).backward()
        loss_fn(ddp(x), y).backward()
        oss.step()
        opt.step()
        oss.zero_grad()
        opt.zero_grad()
        errs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    return errs


def test_oss_sharded_ddp_on_a_shared_gpu_matches_torch_ddp() -> None:
    for rank, errs in enumerate(run_workers(_sharded_worker, 2, timeout=300)):
        assert max(errs) <= 1e-5, (rank, errs)


# one of each compressed path: pairs (int8 SGD, bf16 AdamW), the group of 4 where every member owns a
# chunk, the AER groups with int4 AdamW, and compressed shards between two nodes of two ranks
COMPRESSED = [("ring", "sgd", "int8"), ("one-peer-exp", "adamw", "bf16"), ("complete+wide", "sgd", "int8"),
              ("alternating-exp-ring", "adamw", "int4"), ("ring/shard", "adamw", "int8")]


def _compressed_worker(rank: int, world: int) -> Dict[tuple, Dict]:
    torch.set_num_threads(1)
    from test_compression import STEPS

    return {c: train_combo(rank, *c, STEPS, device="cuda") for c in COMPRESSED}


@pytest.fixture(scope="module")
def compressed_results() -> List[Dict[tuple, Dict]]:
    return run_workers(_compressed_worker, 4, timeout=300)


@pytest.mark.parametrize("topo,opt,kind", COMPRESSED)
def test_compressed_gossip_on_a_shared_gpu(compressed_results, topo: str, opt: str, kind: str) -> None:
    check_combo([r[(topo, opt, kind)] for r in compressed_results], topo, opt, kind)


def test_quickstart_on_the_gpus() -> None:
    """What the README says: the same script on GPUs uses NCCL, one GPU per rank, and trains."""
    nproc = min(torch.cuda.device_count(), 2)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "quickstart.py")
    res = torchrun(script, nproc, env={}, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    m = re.search(r"(\d+) workers on (\w+) \((\w+)\): consensus distance \S+; test accuracy of the averaged "
                  r"model (\S+)", res.stdout)
    assert m and m.group(1, 2, 3) == (str(nproc), "cuda", "nccl"), res.stdout
    assert float(m.group(4)) >= 0.85, res.stdout
