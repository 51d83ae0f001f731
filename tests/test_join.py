"""Uneven inputs with Join: ports of PyTorch's join test cases, and decentralized training where
rank r gets 3 + r batches, checked against the reference (joined ranks mix without stepping)."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_workers
from reference import assert_close_params, batch, decentpy_optim_fn, loss_fn, make_mlp, simulate

# --- a toy joinable, as in torch's own join tests ----------------------------------------------------


def _make_allreducer_classes():
    from decentpy import Join, Joinable, JoinHook

    class AllReducerJoinHook(JoinHook):
        def __init__(self, allreducer: "AllReducer", num_allreduces: int) -> None:
            self.allreducer = allreducer
            self.num_allreduces = num_allreduces

        def main_hook(self) -> None:
            for _ in range(self.num_allreduces):
                t = torch.zeros(1)
                dist.all_reduce(t, group=self.allreducer.process_group)
            self.allreducer.main_hook_calls += 1

        def post_hook(self, is_last_joiner: bool) -> None:
            self.allreducer.post_hook_calls.append(is_last_joiner)

    class AllReducer(Joinable):
        def __init__(self, process_group: Any) -> None:
            super().__init__()
            self.process_group = process_group
            self.main_hook_calls = 0
            self.post_hook_calls: List[bool] = []

        def __call__(self, num_allreduces: int = 1) -> float:
            Join.notify_join_context(self)
            total = 0.0
            for _ in range(num_allreduces):
                t = torch.ones(1)
                dist.all_reduce(t, group=self.process_group)
                total += t.item()
            return total

        def join_hook(self, **kwargs: Any) -> JoinHook:
            return AllReducerJoinHook(self, kwargs.get("num_allreduces", 1))

        @property
        def join_device(self) -> torch.device:
            return torch.device("cpu")

        @property
        def join_process_group(self) -> Any:
            return self.process_group

    return AllReducer


def toy_join_worker(rank: int, world: int, case: str) -> Dict[str, Any]:
    from decentpy import Join

    AllReducer = _make_allreducer_classes()
    pg = dist.new_group(list(range(world)))
    inputs = 3 + rank  # uneven: rank r has 3 + r iterations
    out: Dict[str, Any] = {}
    if case == "main_and_post_hooks":
        a = AllReducer(pg)
        with Join([a]):
            for _ in range(inputs):
                a()
        out.update(main=a.main_hook_calls, post=a.post_hook_calls)
    elif case == "several_joinables_and_kwargs":
        a, b = AllReducer(pg), AllReducer(pg)
        with Join([a, b], num_allreduces=2):
            for _ in range(inputs):
                a(2)
                b(2)
        out.update(main=[a.main_hook_calls, b.main_hook_calls], post=[a.post_hook_calls, b.post_hook_calls])
    elif case == "disable":
        a = AllReducer(pg)
        total = 0.0
        with Join([a], enable=False):
            for _ in range(3):  # even inputs: disabling is legal
                total += a()
        out.update(main=a.main_hook_calls, post=a.post_hook_calls, total=total)
    elif case == "throw":
        a = AllReducer(pg)
        try:
            with Join([a], throw_on_early_termination=True):
                for _ in range(inputs):
                    a()
            out["error"] = None
        except RuntimeError as exc:
            out["error"] = str(exc)
    return out


def test_join_main_and_post_hooks() -> None:
    res = run_workers(toy_join_worker, 4, "main_and_post_hooks", timeout=180)
    longest = 3 + 3
    for r, o in enumerate(res):
        assert o["main"] == longest - (3 + r)  # one shadow per iteration the others still run
        assert o["post"] == [r == 3]  # post hook once; only the last joiner is the last joiner


def test_join_several_joinables_and_kwargs() -> None:
    res = run_workers(toy_join_worker, 4, "several_joinables_and_kwargs", timeout=180)
    for r, o in enumerate(res):
        assert o["main"] == [3 - r, 3 - r]
        assert o["post"] == [[r == 3], [r == 3]]


def test_join_disable() -> None:
    res = run_workers(toy_join_worker, 2, "disable", timeout=180)
    for o in res:
        assert o == {"main": 0, "post": [], "total": 6.0}


def test_join_throw_on_early_termination_raises_on_every_rank() -> None:
    res = run_workers(toy_join_worker, 3, "throw", timeout=180)
    for o in res:
        assert o["error"] is not None and ("exhausted" in o["error"])


# --- decentralized training with uneven inputs --------------------------------------------------------

TOPOS = ["complete", "ring", "one-peer-exp", "alternating-exp-ring"]


def uneven_worker(rank: int, world: int, with_torch_ddp: bool, use_method: bool) -> Dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from decentpy import DecentralizedDataParallel, Join

    out: Dict[str, Any] = {}
    for topo in TOPOS:
        model = make_mlp(0)
        ddp = DecentralizedDataParallel(model, decentpy_optim_fn("adam"), topology=topo, local_world_size=2)
        joinables: List[Any] = [ddp]
        other = None
        if with_torch_ddp:
            other = TorchDDP(torch.nn.Linear(3, 1))
            joinables = [other, ddp]  # torch's joinable first: decentpy must not be the first
        ctx = ddp.join(global_avg=True) if use_method else Join(joinables, global_avg=True)
        with ctx:
            for k in range(3 + rank):
                x, y = batch(rank, k)
                loss = loss_fn(ddp(x), y)
                if other is not None:
                    loss = loss + other(torch.ones(2, 3)).sum() * 0.0
                loss.backward()
        out[topo] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        out[topo + "/step"] = ddp.step_count
    return out


@pytest.mark.parametrize("with_torch_ddp,use_method", [(False, True), (True, False)])
def test_uneven_inputs_every_topology_no_hang_and_matches_reference(with_torch_ddp: bool, use_method: bool) -> None:
    from decentpy.topology import make_topology

    world = 4
    res = run_workers(uneven_worker, world, with_torch_ddp, use_method, timeout=240)
    for topo in TOPOS:
        for r in range(world):
            assert res[r][topo + "/step"] == 3 + world - 1, "joined ranks must shadow every iteration"
            for n in res[0][topo]:
                assert torch.equal(res[r][topo][n], res[0][topo][n]), f"{topo}: models differ after global_avg"
        # Reference: rank r steps on its 3 + r batches, then only mixes; the final average.
        t = make_topology(topo, world, 2)
        ref = simulate(world, t.mixing_matrix, "adam", 3 + world - 1, skip=lambda i, k: k >= 3 + i)
        mean = {n: torch.stack([w[n] for w in ref]).mean(0) for n in ref[0]}
        assert_close_params([res[0][topo]], [mean], rtol=2e-5, atol=2e-5, what=f"uneven inputs, {topo}")


# --- a rank with no data at all ---------------------------------------------------------------------

def join_before_first_iteration_worker(rank: int, world: int) -> str:
    from decentpy import DecentralizedDataParallel

    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("sgd"), topology="ring")
    with ddp.join():
        for k in range(2 if rank == 0 else 0):  # rank 1 has no batch: it joins at once
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
    return "no error"


def test_joining_before_the_first_iteration_names_the_rank() -> None:
    # The first iteration confirms the bucket layout on all ranks (a collective), so a rank needs
    # one before it can shadow the others; the rank that ran out of data says so. Its peer then
    # fails on the closed connection instead of hanging.
    res = run_workers(join_before_first_iteration_worker, 2, timeout=120, pg_timeout_s=20,
                      allow_failures=True)
    assert "rank 1 joined before its first training iteration" in res[1], res[1]
    assert res[0] != "no error", "rank 0 cannot complete an iteration whose peer left"
