"""OptimizerStateAveraging (decentpy/state_averaging.py) against the float64 re-computation.

4 gloo workers in one spawn run every configuration; the reference is ``reference.simulate`` with
torch's own Adam(W), whose states are averaged over the workers after the steps the helper averages
on. Also: bad settings raise on every rank before any collective, and intra_node='shard' is refused.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

from dist_harness import run_workers
from reference import assert_close_params, batch, decentpy_optim_fn, loss_fn, make_mlp, simulate

N = 4
STEPS = 6
#: (topology, decentpy optimizer, reference optimizer, every, states, bucket cap in MB)
CASES: List[Tuple[str, str, str, int, Tuple[str, ...], float]] = [
    ("ring", "adamw", "adamw", 1, ("exp_avg_sq",), 25),
    ("complete", "adam", "adam", 2, ("exp_avg", "exp_avg_sq"), 0.0002),  # one bucket per tensor
    ("one-peer-exp", "torch_adamw", "adamw", 3, ("exp_avg_sq",), 25),  # torch's optimizer: per-parameter states
]


def _case_id(case: Tuple[Any, ...]) -> str:
    return f"{case[0]}-{case[1]}-every{case[3]}-{'+'.join(case[4])}"


def _train(rank: int, world: int) -> Dict[str, Any]:
    from decentpy import DecentralizedDataParallel, OptimizerStateAveraging, SettingsMismatchError

    out: Dict[str, Any] = {}
    for case in CASES:
        topo, opt, _, every, states, cap = case
        model = make_mlp(seed=0)
        ddp = DecentralizedDataParallel(model, decentpy_optim_fn(opt), topology=topo, local_world_size=1,
                                        bucket_size_in_mb=cap)
        avg = OptimizerStateAveraging(ddp, every=every, states=states)
        did = []
        for k in range(STEPS):
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
            did.append(avg.step())
        ddp.consensus_distance()
        out[_case_id(case)] = ({n: p.detach().double().clone() for n, p in model.named_parameters()}, did)
        ddp.close()
    # bad input: every=0 on rank 1 only raises on every rank, before any collective
    model = make_mlp(seed=0)
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn("adamw"), topology="ring", local_world_size=1)
    try:
        OptimizerStateAveraging(ddp, every=0 if rank == 1 else 2)
    except (ValueError, RuntimeError) as exc:
        out["bad_every"] = f"{type(exc).__name__}: {exc}"
    try:
        OptimizerStateAveraging(ddp, every=4 if rank == 2 else 2)
    except SettingsMismatchError as exc:
        out["mismatch"] = str(exc)
    ddp.close()
    # intra_node='shard': each rank's optimizer holds another piece of the state
    ddp = DecentralizedDataParallel(make_mlp(seed=0), decentpy_optim_fn("adamw"), topology="ring",
                                    local_world_size=2, intra_node="shard")
    try:
        OptimizerStateAveraging(ddp)
        out["shard"] = "accepted"
    except (ValueError, RuntimeError) as exc:
        out["shard"] = str(exc)
    ddp.close()
    return out


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_workers(_train, N, timeout=300)


def _reference(topo: str, ref_opt: str, every: int, states: Tuple[str, ...]) -> List[Dict[str, torch.Tensor]]:
    from decentpy.topology import make_topology

    def average(k: int, opts: List[torch.optim.Optimizer]) -> None:
        if (k + 1) % every:
            return
        per_worker = [[p for g in o.param_groups for p in g["params"]] for o in opts]
        with torch.no_grad():
            for params in zip(*per_worker):
                for name in states:
                    mean = torch.stack([o.state[p][name] for o, p in zip(opts, params)]).mean(0)
                    for o, p in zip(opts, params):
                        o.state[p][name].copy_(mean)

    return simulate(N, make_topology(topo, N, 1).mixing_matrix, ref_opt, STEPS, after_step=average)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_the_float64_reference(results, case) -> None:
    topo, _, ref_opt, every, states, _ = case
    got = [r[_case_id(case)][0] for r in results]
    assert [r[_case_id(case)][1] for r in results] == [[(k + 1) % every == 0 for k in range(STEPS)]] * N
    want = _reference(topo, ref_opt, every, states)
    assert_close_params(got, want, rtol=2e-5, atol=2e-5, what=_case_id(case))
    # the averaging changes the result (else the comparison above would prove nothing)
    plain = _reference(topo, ref_opt, STEPS + 1, states)  # never averages
    assert max((got[0][n] - plain[0][n]).abs().max().item() for n in plain[0]) > 1e-4


def test_bad_settings_raise_on_every_rank(results) -> None:
    assert "every must be an int >= 1" in results[1]["bad_every"]
    for r in (0, 2, 3):
        assert "rank 1" in results[r]["bad_every"] and "every must be an int >= 1" in results[r]["bad_every"]
    for r in range(N):
        assert "every" in results[r]["mismatch"] and "rank 2" in results[r]["mismatch"]



def test_shard_refused(results) -> None:
    assert all("intra_node='shard'" in r["shard"] for r in results), [r["shard"] for r in results]
