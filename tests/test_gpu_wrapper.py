"""The wrapper on a GPU, in a world of one process: what only a CUDA device can show.

- The in-backward step does not synchronise with the host: with the non-finite check (the
  default), a GradScaler or clipping, the kernels read each bucket's gradient norm on the device,
  and the per-bucket skip verdicts travel to pinned host memory without a wait; they are read at
  the next backward (an event wait on a copy long done, not a stream synchronisation). Counted with
  torch's CUDA sync debug mode.
- A CPU model under the NCCL backend is refused with a message saying what to do.

Every test here skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tools.cuda_sync import syncs_in
from dist_harness import single_process_group
from reference import assert_close_params, batch, decentpy_optim_fn, loss_fn, make_mlp, simulate

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["plain", "unchecked", "scaler", "clip"])
def test_backward_does_not_synchronise(mode: str) -> None:
    """Neither the non-finite check (nonfinite='skip', the default), a GradScaler nor clipping makes
    a backward wait for the GPU (measured on an H200 before the verdicts were deferred: one read-back
    per iteration cost 0.6 ms of a 3.2 ms iteration, the GPU idle while the host launched the next
    forward)."""
    from decentpy import DecentralizedDataParallel
    from decentpy.optim import optim_fn_adamw

    with single_process_group("gloo"):
        scaler = torch.amp.GradScaler("cuda") if mode == "scaler" else None
        ddp = DecentralizedDataParallel(make_mlp(0).cuda(), optim_fn_adamw, topology="complete", scaler=scaler,
                                        grad_clip_norm=1.0 if mode == "clip" else 0.0, bucket_size_in_mb=0.0005,
                                        nonfinite="ignore" if mode == "unchecked" else "skip")
        assert len(ddp.buckets) > 1
        counts = []
        for k in range(3):
            x, y = (t.cuda() for t in batch(0, k))
            loss = loss_fn(ddp(x), y)
            loss = scaler.scale(loss) if scaler is not None else loss
            counts.append(syncs_in(loss.backward))
        ddp.close()
    # iteration 0 also fixes the bucket layout; from then on: no sync
    assert counts[1:] == [0, 0], counts


@needs_cuda
@pytest.mark.cuda
def test_cpu_model_under_nccl_is_refused() -> None:
    from decentpy import DecentralizedDataParallel
    from decentpy.optim import optim_fn_adamw

    with single_process_group("nccl"):
        model = make_mlp(0)
        with pytest.raises(ValueError, match=r"backend is nccl but parameter '0.weight' is on cpu; move the model"):
            DecentralizedDataParallel(model, optim_fn_adamw)
        assert all(p.device.type == "cpu" for p in model.parameters())


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("intra_node", ["shard", "allreduce"])
def test_intra_node_path_on_gpu_matches_cpu_without_host_sync(intra_node: str) -> None:
    """A node of one rank on the GPU: the node path (pieces, shard optimizer, reduction buffers, the
    step of bucket k when bucket k+1 is ready) steps as on the CPU, and its backward never waits for
    the host. At world size 1 nothing is mixed: both equal the float64 re-computation."""
    from decentpy import DecentralizedDataParallel

    steps = 3
    results = {}
    with single_process_group("gloo"):
        for device in ("cpu", "cuda"):
            model = make_mlp(0).to(device)
            ddp = DecentralizedDataParallel(model, decentpy_optim_fn("adamw"), topology="complete",
                                            local_world_size=1, intra_node=intra_node, bucket_size_in_mb=0.0005)
            assert len(ddp.buckets) > 1  # several buckets: each steps when the next one is ready
            counts = []
            for k in range(steps):
                x, y = (t.to(device) for t in batch(0, k))
                loss = loss_fn(ddp(x), y)
                if device == "cuda":
                    counts.append(syncs_in(loss.backward))
                else:
                    loss.backward()
            ddp.wait()
            results[device] = {n: p.detach().double().cpu().clone() for n, p in model.named_parameters()}
            ddp.close()
    assert counts[1:] == [0] * (steps - 1), counts
    want = simulate(1, lambda k: torch.ones(1, 1), "adamw", steps)
    start = dict(make_mlp(0).double().named_parameters())
    assert max((want[0][n] - start[n]).abs().max().item() for n in start) > 1e-3  # the reference trained
    for device, got in results.items():
        assert_close_params([got], want, rtol=1e-5, atol=1e-6, what=f"{device} intra_node={intra_node}")
