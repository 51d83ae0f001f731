"""Sharding bad input: a clear exception on every rank, and the process group still works after it.

Every case runs, one after the other, in one spawn of 2 gloo workers; after each, an all_reduce of
ones must return the world size (no rank left inside a half-started collective).
"""

from __future__ import annotations

import copy
import traceback
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_harness import run_workers
from reference import IN, OUT, batch, loss_fn, make_mlp

WORLD = 2
NO_GPU = ("needs a CUDA device: the case puts (or moves) parameters on a second device type, and this "
          "machine has only the CPU")


def _adam_sd_of(model: nn.Module) -> dict:
    """A plain torch Adam's state dict over ``model``, after one step (so its state has tensors)."""
    opt = torch.optim.Adam(model.parameters(), lr=5.0)
    x, y = batch(0, 0)
    loss_fn(model(x), y).backward()
    opt.step()
    return copy.deepcopy(opt.state_dict())


def _trained_oss(rank: int) -> Tuple[nn.Module, Any, Any]:
    from decentpy import OSS, ShardedDataParallel

    model = make_mlp(0)
    oss = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    sdp = ShardedDataParallel(model, oss)
    x, y = batch(rank, 0)
    loss_fn(sdp(x), y).backward()
    oss.step()
    oss.zero_grad()
    return model, oss, sdp


class TwoExtras(nn.Module):
    """A frozen parameter pair in front of the trainable body; on rank 1 both have other shapes."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.extra_a = nn.Parameter(torch.zeros(3 if rank == 0 else 4), requires_grad=False)
        self.extra_b = nn.Parameter(torch.zeros(5 if rank == 0 else 7), requires_grad=False)
        self.body = make_mlp(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def case_empty(rank: int) -> Any:
    from decentpy import OSS
    return OSS([], optim=torch.optim.SGD, lr=0.1)


def case_not_tensor(rank: int) -> Any:
    from decentpy import OSS
    return OSS([nn.Parameter(torch.zeros(3)), 1.0], optim=torch.optim.SGD, lr=0.1)


def case_optim_module_class(rank: int) -> Any:
    from decentpy import OSS
    return OSS(make_mlp(0).parameters(), optim=nn.Linear, lr=0.1)


def case_optim_instance(rank: int) -> Any:
    from decentpy import OSS
    model = make_mlp(0)
    return OSS(model.parameters(), optim=torch.optim.SGD(model.parameters(), lr=0.1), lr=0.1)


def case_oss_params_differ(rank: int) -> Any:
    from decentpy import OSS
    # group 0 index 2 differs first ((4,) vs (6,)); group 1 index 1 differs too ((5,) vs (7,))
    shapes = [[(2, 3), (3,), (4,) if rank == 0 else (6,)], [(8,), (5,) if rank == 0 else (7,)]]
    groups = [{"params": [nn.Parameter(torch.zeros(s)) for s in g]} for g in shapes]
    return OSS(groups, optim=torch.optim.SGD, lr=0.1)


def case_sdp_module_differs(rank: int) -> Any:
    from decentpy import OSS, ShardedDataParallel
    model = TwoExtras(rank)
    trainable = [p for p in model.parameters() if p.requires_grad]  # the same on all ranks: OSS accepts them
    oss = OSS(trainable, optim=torch.optim.SGD, lr=0.1)
    return ShardedDataParallel(model, oss)


def case_negative_buffer(rank: int) -> Any:
    from decentpy import OSS, ShardedDataParallel
    model = make_mlp(0)
    return ShardedDataParallel(model, OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1), reduce_buffer_size=-1)


def case_several_device_types(rank: int) -> Any:
    from decentpy import OSS, ShardedDataParallel
    model = nn.Sequential(nn.Linear(IN, 16).cuda(), nn.Linear(16, OUT))
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    return ShardedDataParallel(model, oss)


def case_state_dict_before_consolidation(rank: int) -> Any:
    _, oss, _ = _trained_oss(rank)
    return oss.state_dict()


def _load_foreign(rank: int, foreign: nn.Module) -> Dict[str, Any]:
    """Load another model's torch Adam state into a trained OSS; it must refuse and stay as it was."""
    _, oss, _ = _trained_oss(rank)
    bad = _adam_sd_of(foreign)
    oss.consolidate_state_dict(recipient_rank=-1)
    before = copy.deepcopy(oss.state_dict())
    lrs = [g["lr"] for g in oss.param_groups]
    try:
        oss.load_state_dict(bad)
    except Exception as exc:  # noqa: BLE001
        oss.consolidate_state_dict(recipient_rank=-1)
        after = oss.state_dict()
        same = _state_equal(before, after) and [g["lr"] for g in oss.param_groups] == lrs
        raise type(exc)(f"{exc} [untouched={same}]") from exc
    return {}


def case_state_dict_of_fewer_params(rank: int) -> Any:
    torch.manual_seed(3)
    return _load_foreign(rank, nn.Linear(IN, OUT))


def case_state_dict_of_other_shapes(rank: int) -> Any:
    torch.manual_seed(3)  # six tensors, as the MLP, with other shapes
    other = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, 9), nn.Tanh(), nn.Linear(9, OUT))
    return _load_foreign(rank, other)


def case_grad_requires_grad(rank: int) -> Any:
    _, _, sdp = _trained_oss(rank)
    x, y = batch(rank, 1)
    loss_fn(sdp(x), y).backward(create_graph=True)


def case_grad_requires_grad_at_forward(rank: int) -> Any:
    """fairscale's test_catch_grad_grad: a .grad that requires grad is refused at forward."""
    model, _, sdp = _trained_oss(rank)
    sdp.zero_grad()
    model[0].weight.grad = torch.zeros_like(model[0].weight).requires_grad_(True)
    x, _ = batch(rank, 1)
    sdp(x)


def case_param_moved_device(rank: int) -> Any:
    model, oss, sdp = _trained_oss(rank)
    model.cuda()
    x, y = batch(rank, 1)
    loss_fn(sdp(x.cuda()), y.cuda()).backward()
    oss.step()


def _state_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    return a == b


# name -> (function, needs a GPU, exception type, phrases that must all be in the message,
#          phrases that must not be)
CASES: Dict[str, Tuple[Callable[[int], Any], bool, type, List[str], List[str]]] = {
    "empty": (case_empty, False, ValueError, ["empty parameter list"], []),
    "not_tensor": (case_not_tensor, False, TypeError, ["Tensor"], []),
    "optim_module_class": (case_optim_module_class, False, TypeError, ["optim", "Linear"], []),
    "optim_instance": (case_optim_instance, False, TypeError, ["optim", "SGD"], []),
    "oss_params_differ": (case_oss_params_differ, False, ValueError, ["differ", "(4,)", "(6,)"], ["(7,)"]),
    "sdp_module_differs": (case_sdp_module_differs, False, ValueError, ["differ", "extra_a"], ["extra_b"]),
    "negative_buffer": (case_negative_buffer, False, ValueError, ["reduce_buffer_size", "-1"], []),
    "several_device_types": (case_several_device_types, True, ValueError, ["device"], []),
    "state_dict_before_consolidation": (case_state_dict_before_consolidation, False, RuntimeError,
                                        ["consolidate_state_dict"], []),
    "state_dict_of_fewer_params": (case_state_dict_of_fewer_params, False, ValueError, ["untouched=True"], []),
    "state_dict_of_other_shapes": (case_state_dict_of_other_shapes, False, ValueError, ["untouched=True"], []),
    "grad_requires_grad": (case_grad_requires_grad, False, RuntimeError, ["require"], []),
    "grad_requires_grad_at_forward": (case_grad_requires_grad_at_forward, False, RuntimeError,
                                      ["'0.weight'", "requires grad", "zero_grad"], []),
    "param_moved_device": (case_param_moved_device, True, RuntimeError, ["moved"], []),
}


def bad_input_worker(rank: int, world: int, names: List[str]) -> Dict[str, Dict[str, Any]]:
    out = {}
    for name in names:
        fn = CASES[name][0]
        try:
            fn(rank)
            res: Dict[str, Any] = {"type": None, "msg": "no error"}
        except Exception as exc:  # noqa: BLE001 - the parent checks type and message
            res = {"type": type(exc).__name__, "types": [c.__name__ for c in type(exc).__mro__], "msg": str(exc),
                   "tb": traceback.format_exc()}
        t = torch.ones(1)
        dist.all_reduce(t)
        res["allreduce"] = t.item()
        out[name] = res
    return out


_RESULTS: Dict[str, List[Dict[str, Any]]] = {}


def _results() -> Dict[str, List[Dict[str, Any]]]:
    if not _RESULTS:
        names = [n for n, c in CASES.items() if not c[1] or torch.cuda.is_available()]
        res = run_workers(bad_input_worker, WORLD, names, timeout=180)
        _RESULTS.update({n: [r[n] for r in res] for n in names})
    return _RESULTS


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_on_every_rank(case: str) -> None:
    _, needs_gpu, exc_type, needles, absent = CASES[case]
    if needs_gpu and not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    for r, res in enumerate(_results()[case]):
        assert exc_type.__name__ in res.get("types", [res["type"]]), \
            f"{case}: rank {r} raised {res['type']} ({res['msg']}), expected {exc_type.__name__}\n{res.get('tb', '')}"
        for needle in needles:
            assert needle in res["msg"], f"{case}: rank {r}: '{needle}' not in the message: {res['msg']}"
        for needle in absent:
            assert needle not in res["msg"], \
                f"{case}: rank {r}: names '{needle}', not the first difference: {res['msg']}"
        assert res["allreduce"] == float(WORLD), f"{case}: the process group is broken after the error on rank {r}"
