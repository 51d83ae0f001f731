"""OSS + ShardedDataParallel on a GPU under NCCL, in a world of one process: what only a CUDA
device can show (the multi-rank behaviour is tested on gloo in test_sharding.py; NCCL needs one
GPU per rank, which the test machines do not have).

- Training matches plain torch AdamW on the same GPU model, parameter by parameter.
- A backward in which every parameter has a gradient does not synchronise with the host (the
  usage flags are set and summed on the device); one with an unused parameter reads back once
  (whether it keeps a gradient at all is decided on the host, as torch DDP). Counted with torch's
  CUDA sync debug mode.

Every test here skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tools.cuda_sync import syncs_in
from dist_harness import single_process_group
from reference import IN, OUT, batch, loss_fn, make_mlp

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_mlp(0)
        self.unused = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@needs_cuda
@pytest.mark.cuda
def test_nccl_training_matches_torch_adamw() -> None:
    from decentpy import OSS, ShardedDataParallel

    with single_process_group("nccl"):
        model, ref = make_mlp(0).cuda(), make_mlp(0).cuda()
        oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        sdp = ShardedDataParallel(model, oss, reduce_buffer_size=64)
        opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
        for k in range(4):
            x, y = (t.cuda() for t in batch(0, k))
            loss_fn(sdp(x), y).backward()
            loss_fn(ref(x), y).backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"step {k}: grad of {n}")
            oss.step()
            opt.step()
            oss.zero_grad()
            opt.zero_grad()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {k}: {n}")


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("unused", [False, True])
def test_backward_reads_back_only_for_an_unused_parameter(unused: bool) -> None:
    from decentpy import OSS, ShardedDataParallel

    with single_process_group("nccl"):
        model = (WithUnused() if unused else make_mlp(0)).cuda()
        oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.01)
        sdp = ShardedDataParallel(model, oss, reduce_buffer_size=64)
        counts = []
        for k in range(3):
            x, y = (t.cuda() for t in batch(0, k))
            loss = loss_fn(sdp(x), y)
            counts.append(syncs_in(loss.backward))
            if unused:
                assert model.unused.weight.grad is None
            oss.step()
            oss.zero_grad()
    # the first backward also finds which parameters are used (decided on the host, once)
    assert counts[1:] == ([1, 1] if unused else [0, 0]) and counts[0] <= 1, counts
