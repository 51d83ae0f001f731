"""Gossip on a process group: disjoint wrappers side by side, each against its own reference.

Worlds of 4 (two groups of 2) and 8 (two groups of 4). The groups interleave global ranks, so
group ranks differ from global ones; every iteration the user runs a collective on the default
group and one on their own group between the wrapper's exchanges. Each group must match the
float64 plain-PyTorch re-computation of decentralized training over its own members
(``reference.simulate`` with that group's data), a joined rank of one group must not disturb
the other, and ``global_avg`` / ``consensus_distance`` must stay inside the group.
"""

from __future__ import annotations

import contextlib

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from dist_harness import run_workers
from reference import assert_close_params, batch, decentpy_optim_fn, loss_fn, make_mlp, simulate

STEPS = 5
# (topology, optimizer, bucket MiB, steps of each member by group rank or None: STEPS each)
Spec = Tuple[str, str, float, Optional[List[int]]]

LAYOUT_4 = [[0, 2], [1, 3]]
RUNS_4: List[List[Spec]] = [
    [("ring", "adam", 25, None), ("complete", "sgd", 0.0002, None)],
    # group 0's first member runs out of data after 3 iterations (Join); group 1 trains on
    [("one-peer-exp", "adamw", 0.0002, [3, STEPS]), ("complete", "accum_adam", 25, None)],
]
LAYOUT_8 = [[0, 1, 4, 5], [2, 3, 6, 7]]  # nodes of 2 ranks ($LOCAL_WORLD_SIZE=2): 2 per node per group
RUNS_8: List[List[Spec]] = [
    [("alternating-exp-ring", "accum_adam", 25, None), ("overlap3", "sgd", 0.0002, None)],
    [("complete", "adam", 0.0002, None), ("one-peer-exp", "adamw", 25, None)],
]


def _topology(name: str, n: int, local: int) -> Any:
    """A registered name, or 'overlap3': 3-rank groups that overlap across steps (their sub-groups
    are created by some members of the wrapper's group and not by others)."""
    from decentpy.topology import CustomTopology, make_topology

    if name != "overlap3":
        return make_topology(name, n, local)

    def groups(step: int) -> List[Tuple[Tuple[int, ...], float]]:
        return [((0, 1, 2), 1 / 3), ((3,), 1.0)] if step == 0 else [((1, 2, 3), 1 / 3), ((0,), 1.0)]

    return CustomTopology.from_groups(groups, period=2, world_size=n, local_world_size=local, name="overlap3")


def train_groups(rank: int, world: int, layout: List[List[int]], runs: List[List[Spec]]) -> Dict[str, Any]:
    import torch.distributed as dist

    from decentpy import DecentralizedDataParallel

    groups = [dist.new_group(ranks) for ranks in layout]  # every rank, same order (torch's rule)
    g = next(i for i, ranks in enumerate(layout) if rank in ranks)
    group, members = groups[g], layout[g]
    out: Dict[str, Any] = {"group": g}

    other = groups[1 - g]  # this rank is not a member: refused before any collective
    try:
        DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("sgd"), process_group=other)
    except ValueError as exc:
        out["non_member_error"] = str(exc)

    for ri, run in enumerate(runs):
        topo, opt, cap, steps_of = run[g]
        gr = members.index(rank)
        model = make_mlp(seed=0 if gr == 0 else 100 + rank)  # the group's first rank's values are broadcast
        ddp = DecentralizedDataParallel(model, decentpy_optim_fn(opt), topology=_topology(topo, len(members), 2)
                                        if topo == "overlap3" else topo, process_group=group, bucket_size_in_mb=cap)
        out[f"{ri}/shape"] = (ddp.topology.world_size, ddp.topology.local_world_size, ddp.group_rank)
        steps = STEPS if steps_of is None else steps_of[gr]
        uneven = steps_of is not None
        anyone_uneven = any(spec[3] is not None for spec in run)  # then no per-iteration world collective
        with ddp.join() if uneven else contextlib.nullcontext():
            for k in range(steps):
                x, y = batch(rank, k)
                loss_fn(ddp(x), y).backward()
                # the user's own collectives between iterations, on the default group and on their group
                if not anyone_uneven:
                    t = torch.ones(1)
                    dist.all_reduce(t)
                    assert t.item() == world, t.item()
                if not uneven:
                    u = torch.tensor([float(rank)])
                    dist.all_reduce(u, group=group)
                    assert u.item() == sum(members), u.item()
        out[f"{ri}/consensus"] = ddp.consensus_distance()
        out[f"{ri}/params"] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        ddp.global_avg(will_revert=False)
        out[f"{ri}/avg"] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        ddp.close()
        t = torch.ones(1)
        dist.all_reduce(t)  # the default group is still in step after every run
        assert t.item() == world
    return out


@pytest.fixture(scope="module")
def results_4() -> List[Dict[str, Any]]:
    return run_workers(train_groups, 4, LAYOUT_4, RUNS_4, timeout=240)


@pytest.fixture(scope="module")
def results_8() -> List[Dict[str, Any]]:
    return run_workers(train_groups, 8, LAYOUT_8, RUNS_8, timeout=400, env={"LOCAL_WORLD_SIZE": "2"})


def _check(results: List[Dict[str, Any]], layout: List[List[int]], runs: List[List[Spec]], local: int) -> None:
    for ri, run in enumerate(runs):
        for g, members in enumerate(layout):
            topo, opt, _, steps_of = run[g]
            n = len(members)
            t = _topology(topo, n, local)
            skip = None
            if steps_of is not None:
                skip = lambda i, k, s=steps_of: k >= s[i]  # noqa: E731 - a joined worker only mixes
            want = simulate(n, t.mixing_matrix, opt, STEPS, skip=skip, data_ranks=members)
            got = [results[r][f"{ri}/params"] for r in members]
            what = f"run {ri}, group {members} ({topo}/{opt})"
            assert_close_params(got, want, rtol=2e-5, atol=2e-5, what=what)
            for gr, r in enumerate(members):
                assert results[r][f"{ri}/shape"] == (n, local, gr), what
            # global_avg: the exact mean of this group's members, nobody else's
            mean = {k: torch.stack([w[k] for w in want]).mean(0) for k in want[0]}
            assert_close_params([results[r][f"{ri}/avg"] for r in members], [mean] * n, rtol=2e-5, atol=2e-5,
                                what=what + " global_avg")
            d = torch.sqrt(sum(((w[k] - mean[k]) ** 2).sum() for w in want for k in w) / n).item()
            for r in members:
                assert results[r][f"{ri}/consensus"] == pytest.approx(d, rel=1e-4, abs=1e-6), what


def test_two_groups_of_two_in_a_world_of_four(results_4) -> None:
    _check(results_4, LAYOUT_4, RUNS_4, local=1)
    for r, res in enumerate(results_4):
        assert "not a member" in res["non_member_error"], res.get("non_member_error")


def test_two_groups_of_four_in_a_world_of_eight(results_8) -> None:
    _check(results_8, LAYOUT_8, RUNS_8, local=2)


def test_groups_are_independent(results_4) -> None:
    """Gossip stays inside a group: the two groups' averages differ (different data and optimizers)."""
    a = results_4[0]["0/avg"]
    b = results_4[1]["0/avg"]
    assert any(not torch.allclose(a[k], b[k]) for k in a)
