"""decentpy.AsyncPipe where fairscale's AsyncPipe tests run on a world of one process, in this
process (a HashStore gloo group: no spawn). The fairscale behaviour each test mirrors is named in
its docstring (fairscale 0.4.13, tests/nn/pipe_process/test_pipe.py unless said otherwise); the
reference is always the unpipelined model. The multi-process cases are scenarios of
tests/test_pipeline.py (1-tuples across boundaries, in-place on the output, gradients of
gradients, stages in different modes).
"""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from dist_harness import single_process_group


@pytest.fixture(scope="module")
def one_rank() -> Any:
    with single_process_group("gloo"):
        yield


def pipe_of(module: Any, balance: List[int], **kw: Any) -> Any:
    from decentpy import AsyncPipe

    kw.setdefault("timeout", 10.0)
    return AsyncPipe(module, balance, **kw)


def test_empty_pipe(one_rank: Any) -> None:
    """empty_module: an empty nn.Sequential with an empty balance is the identity; only a tensor or
    tensors is accepted."""
    pipe = pipe_of(nn.Sequential(), [])
    t = torch.tensor([42])
    assert pipe(t) is t
    pair = (torch.tensor([42]),)
    assert pipe(pair) is pair
    with pytest.raises(TypeError):
        pipe(42)
    assert len(pipe) == 0 and list(pipe) == [] and pipe.partition is None and pipe.pipeline is None
    assert pipe.stage is None and not pipe.final_stage and pipe.balance == []
    assert pipe.train_step(t, t, lambda o, y: (o - y).float().pow(2).mean()) is None
    with pytest.raises(ValueError, match="module and sum of balance have different length"):
        pipe_of(nn.Sequential(), [1])  # recommend_auto_balance


def test_too_few_ranks_is_an_index_error(one_rank: Any) -> None:
    """too_few_devices: fairscale raises IndexError when len(balance) exceeds the group size."""
    from decentpy.pipeline import TooFewRanksError

    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)])
    with pytest.raises(IndexError) as info:
        pipe_of(model, [1, 1, 1, 1])
    assert isinstance(info.value, ValueError) and isinstance(info.value, TooFewRanksError)
    assert "ranks: 1, partitions: 4" in str(info.value), str(info.value)


def test_public_attributes(one_rank: Any) -> None:
    """public_attrs, partitions, devices: what fairscale's tests read from a pipe."""
    pipe = pipe_of(nn.Sequential(nn.Linear(1, 1)), (1,), chunks=42, checkpoint="always")
    assert pipe.balance == [1] and pipe.chunks == 42 and pipe.checkpoint == "always"
    assert isinstance(pipe.partition, nn.Sequential) and pipe.partitions == [pipe.partition]
    assert pipe.pipeline is not None and pipe.final_stage and pipe.group.rank() == 0
    assert pipe.devices == [torch.device("cpu")]
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or 'never'"):
        pipe_of(nn.Sequential(nn.Linear(1, 1)), [1], checkpoint="INVALID_CHECKPOINT")
    with pytest.raises(TypeError, match="module must be nn.Sequential to be partitioned"):
        pipe_of(nn.Linear(1, 1), [1])


class One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, only_a: Tuple[Tensor]) -> Tuple[Tensor]:
        (a,) = only_a
        return (self.fc(a),)


@pytest.mark.parametrize("chunks", [1, 2])
def test_one_tuple_in_one_tuple_out(one_rank: Any, chunks: int) -> None:
    """input_singleton: a model returning a 1-tuple returns a 1-tuple through the pipe (also in
    eval mode), with the gradients of the unpipelined model and of the input."""
    torch.manual_seed(0)
    ref = nn.Sequential(One())
    pipe = pipe_of(nn.Sequential(One()), [1], chunks=chunks)
    pipe.partition.load_state_dict(ref.state_dict())
    a = torch.rand(10, 1, requires_grad=True)
    a_ref = a.detach().clone().requires_grad_(True)
    out = pipe((a,))
    assert isinstance(out, tuple) and len(out) == 1, type(out)
    (a_out,) = out
    a_out.mean().backward()
    ref((a_ref,))[0].mean().backward()
    assert torch.allclose(a.grad, a_ref.grad) and torch.allclose(pipe[0].fc.weight.grad, ref[0].fc.weight.grad)
    pipe.eval()
    out = pipe((a,))
    assert isinstance(out, tuple) and len(out) == 1


@pytest.mark.parametrize("chunks, checkpoint", [(1, "never"), (1, "always"), (3, "except_last")])
def test_output_is_owned(one_rank: Any, chunks: int, checkpoint: str) -> None:
    """The output may be modified in place (y.add_(1), a collective writing into it as
    parallel_randoms' all_gather does), with the unpipelined model's gradients; one micro-batch's
    output is the last layer's own memory (no copy)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    pipe = pipe_of(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), [3], chunks=chunks,
                   checkpoint=checkpoint)
    pipe.partition.load_state_dict(ref.state_dict())
    seen: List[Tensor] = []
    pipe[-1].register_forward_hook(lambda _m, _a, o: seen.append(o))
    x = torch.randn(6, 4)
    y = pipe(x)
    y.add_(1.0)
    y.pow(2).mean().backward()
    r = ref(x)
    r.add_(1.0)
    r.pow(2).mean().backward()
    assert torch.allclose(y.detach(), r.detach())
    for p, q in zip(pipe.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    if chunks == 1:
        assert y.data_ptr() == seen[0].data_ptr()
    dist.all_gather([y], torch.full_like(y, 3.0))
    assert bool((y == 3.0).all())


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_gradients_of_gradients_refused(one_rank: Any) -> None:
    """As fairscale refuses gradients of gradients at forward (test_sharded_ddp_features'
    test_catch_grad_grad: a parameter whose gradient requires grad): a training forward raises
    RuntimeError before a layer runs; the create_graph=True backward itself raises too. Eval
    forwards and the next clean step work."""
    calls: List[int] = []
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    model[0].register_forward_pre_hook(lambda *_: calls.append(1))
    pipe = pipe_of(model, [2], chunks=2)
    x = torch.rand(4, 2)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        pipe(x).pow(2).sum().backward(create_graph=True)
    pipe.zero_grad(set_to_none=True)
    pipe[0].weight.grad = torch.zeros_like(pipe[0].weight).requires_grad_(True)
    calls.clear()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        pipe(x)
    assert calls == []
    with pytest.raises(RuntimeError, match="create_graph=True"):
        pipe.train_step(x, torch.zeros(4, 3), lambda o, t: (o - t).pow(2).mean())
    pipe.eval()
    pipe(x)
    pipe.train()
    pipe.zero_grad(set_to_none=True)
    pipe(x).sum().backward()
    assert pipe[0].weight.grad is not None and not pipe[0].weight.grad.requires_grad


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_lazy_module_deferred_batch_norm(one_rank: Any, checkpoint: str) -> None:
    """deferred_batch_norm with lazy=True: a LazyModule in the list, DeferredBatchNorm's running
    statistics equal BatchNorm's on the whole batch."""
    from copy import deepcopy

    from decentpy.pipeline import LazyModule

    bn = nn.BatchNorm2d(3)
    pipe_bn = deepcopy(bn)
    pipe = pipe_of([LazyModule(lambda: pipe_bn)], [1], chunks=2, checkpoint=checkpoint, deferred_batch_norm=True)
    x = torch.rand(4, 3, 10, 10)
    pipe(x).mean().backward()
    bn(x).mean().backward()
    assert torch.allclose(pipe[0].running_mean, bn.running_mean, atol=1e-4)
    assert torch.allclose(pipe[0].running_var, bn.running_var, atol=1e-4)


def test_checkpointing_and_recomputing_flags(one_rank: Any) -> None:
    """fairscale's is_checkpointing() / is_recomputing() (tests/nn/pipe/test_checkpoint.py): the
    first run of a checkpointed micro-batch, then its recomputation; neither without checkpoint."""
    from decentpy.pipeline import is_checkpointing, is_recomputing

    logs: List[Tuple[bool, bool]] = []

    class Detect(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            logs.append((is_checkpointing(), is_recomputing()))
            return x * x  # saves x: the backward needs the recomputation

    for checkpoint, want in (("always", [(True, False), (False, True)]), ("never", [(False, False)])):
        logs.clear()
        pipe = pipe_of(nn.Sequential(Detect()), [1], checkpoint=checkpoint)
        pipe(torch.rand(2, 1, requires_grad=True)).sum().backward()
        assert logs == want, (checkpoint, logs)
