"""Decentralized pipelines (decentpy.hybrid): S stages x R replicas, AsyncPipe per replica and a
DecentralizedDataParallel per stage's replica group, joined by ``AsyncPipe.wrap_partition``.

Invariants, each against something independent of the composition:

* R = 1 equals the plain pipeline (AsyncPipe + torch SGD after each step): same losses and
  parameters, float64 (generic optimizer path) and float32 (fused kernel);
* S = 1 equals plain decentpy (the wrapper on the whole model, ``loss.backward()`` on the whole
  batch, no pipe);
* S = 2, R = 2, ``complete`` topology: every stage of every replica equals the float64 plain-PyTorch
  re-computation of decentralized training of the whole model (``reference.simulate``: replica r's
  gradient of its whole mini-batch at its un-mixed parameters, then the mix with the other
  replica's parameters, then its own SGD step), with every driver (GPipe, 1F1B, fairscale's
  ``pipe(x)`` + ``loss.backward()``), micro-batches that accumulate and checkpointing on;
* uneven inputs under Join (replica 1 runs out after 2 of 4 mini-batches): nobody hangs, and the
  joined replica mixes without stepping (``simulate(skip=...)``).

One spawn of 4 gloo workers runs every scenario (a scenario that raises records its traceback);
the example runs in a second one.
"""

from __future__ import annotations

import copy
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

from dist_harness import run_example_main, run_workers, single_process_group
from reference import assert_close_params, batch, loss_fn, make_mlp, simulate

BALANCE = [3, 2]           # make_mlp: Linear, Tanh, Linear | Tanh, Linear
STEPS = 4
CHUNKS = 3                 # batch 8 -> micro-batches of 3, 3, 2
DRIVERS = ("gpipe", "1f1b", "forward")
WAIT_S = 30.0              # every wait of the pipe and of the wrapper (a hang becomes an error)
SGD = dict(lr=0.05, momentum=0.9, nesterov=True)  # reference.REF_OPTIMIZERS["sgd"], weight decay 0.01 on weights


# --- helpers run in the workers ------------------------------------------------------------------------


def sgd_fn(named: List[Tuple[str, Tensor]]) -> torch.optim.Optimizer:
    """torch SGD with reference.py's 'sgd' settings (fused by decentpy in float32; its own step in float64)."""
    from decentpy.optim import split_decay_groups

    return torch.optim.SGD(split_decay_groups(named, 0.01), **SGD)


def model(dtype: torch.dtype, seed: int = 0) -> nn.Sequential:
    return make_mlp(seed).to(dtype)


def make_pipe(module: nn.Module, group: Any, balance: List[int], chunks: int = CHUNKS) -> Any:
    from decentpy import AsyncPipe

    return AsyncPipe(module, balance, group=group, chunks=chunks, timeout=WAIT_S)


def gossip(pipe: Any, group: Any, topology: str, optim_fn: Callable[..., Any] = sgd_fn) -> Any:
    """The composition: this stage's partition in a DecentralizedDataParallel on its replica group."""
    import datetime

    from decentpy import DecentralizedDataParallel

    return pipe.wrap_partition(lambda part: DecentralizedDataParallel(
        part, optim_fn, topology=topology, process_group=group, timeout=datetime.timedelta(seconds=WAIT_S)))


def step(pipe: Any, x: Tensor, y: Tensor, driver: str) -> Optional[float]:
    """One mini-batch's forward and backward; the loss on the final stage."""
    if driver == "forward":
        out = pipe(x if pipe.stage == 0 else None)
        if not pipe.final_stage:
            pipe.back_helper(out)
            return None
        loss = loss_fn(out, y.to(out.dtype))
        loss.backward()
        return loss.item()
    loss = pipe.train_step(x, y.to(x.dtype), loss_fn, schedule=driver)
    return None if loss is None else loss.item()


def params(module: nn.Module) -> Dict[str, Tensor]:
    return {n: p.detach().double().clone() for n, p in module.named_parameters()}


def guarded(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - recorded; the other scenarios go on
        return {"error": traceback.format_exc()}


# --- scenarios (world 4) -------------------------------------------------------------------------------


def sc_one_replica(rank: int, world: int) -> Dict[str, Any]:
    """R = 1: two 2-stage layouts side by side ({0, 1} and {2, 3}, through ``ranks``); on each, the
    plain pipe with torch SGD and the gossiping one (a replica group of one) train from the same
    model on the same batches."""
    from decentpy.hybrid import pipeline_groups

    mine = [pipeline_groups(2, 1, ranks=r) for r in ([0, 1], [2, 3])]  # every rank creates every group
    groups = mine[rank // 2]
    assert groups is not None and mine[1 - rank // 2] is None
    assert (groups.stage, groups.replica, groups.replica_ranks) == (rank % 2, 0, (rank,))
    out: Dict[str, Any] = {}
    runs = [(d, torch.float64) for d in DRIVERS] + [("1f1b", torch.float32)]
    for driver, dtype in runs:
        plain = make_pipe(model(dtype), groups.pipeline, BALANCE)
        opt = sgd_fn(list(plain.partition.named_parameters()))
        hybrid = make_pipe(model(dtype), groups.pipeline, BALANCE)
        ddp = gossip(hybrid, groups.replicas, "complete")
        losses: Dict[str, List[Optional[float]]] = {"plain": [], "hybrid": []}
        for k in range(STEPS):
            x, y = batch(groups.replica + 2 * (rank // 2), k)
            losses["plain"].append(step(plain, x.to(dtype), y, driver))
            opt.step()
            opt.zero_grad()
            losses["hybrid"].append(step(hybrid, x.to(dtype), y, driver))
        ddp.close()
        out[f"{driver}/{dtype}"] = {"losses": losses, "plain": params(plain.partition),
                                    "hybrid": params(hybrid.partition)}
    return out


def sc_one_stage(rank: int, world: int) -> Dict[str, Any]:
    """S = 1, R = 4 (ring, fused Adam): one-stage pipes whose wrapper gossips over all four, vs
    plain decentpy on the whole model and batch."""
    from decentpy import DecentralizedDataParallel
    from decentpy.hybrid import pipeline_groups
    from decentpy.optim import optim_fn_adam

    groups = pipeline_groups(1, 4)
    assert groups is not None and (groups.stage, groups.replica) == (0, rank)
    out: Dict[str, Any] = {}
    for driver in ("gpipe", "forward"):
        adam = lambda named: optim_fn_adam(named, lr=0.01, weight_decay=0.01)  # noqa: E731
        pipe = make_pipe(model(torch.float32, seed=rank), groups.pipeline, [5], chunks=2)
        ddp = gossip(pipe, groups.replicas, "ring", adam)
        plain = model(torch.float32, seed=rank)
        ref = DecentralizedDataParallel(plain, adam, topology="ring")
        for k in range(STEPS):
            x, y = batch(rank, k)
            step(pipe, x, y, driver)
            loss_fn(ref(x), y).backward()
        ddp.close()
        ref.close()
        out[driver] = {"hybrid": params(pipe.partition), "plain": params(plain)}
    return out


def sc_reference(rank: int, world: int) -> Dict[str, Any]:
    """S = 2, R = 2, complete, float64: each driver from a fresh model (replica 1 starts from other
    values: the wrapper's broadcast makes the replicas equal)."""
    from decentpy.hybrid import pipeline_groups

    groups = pipeline_groups(2, 2)
    assert groups is not None
    assert groups.pipeline_ranks == (2 * groups.replica, 2 * groups.replica + 1)
    assert groups.replica_ranks == (groups.stage, groups.stage + 2)
    out: Dict[str, Any] = {"stage": groups.stage, "replica": groups.replica}
    for driver in DRIVERS:
        pipe = make_pipe(model(torch.float64, seed=0 if groups.replica == 0 else 5), groups.pipeline, BALANCE)
        ddp = gossip(pipe, groups.replicas, "complete")
        for k in range(STEPS):
            x, y = batch(groups.replica, k)
            step(pipe, x.double(), y, driver)
        out[driver] = params(pipe.partition)
        out[f"{driver}/steps"] = ddp.step_count
        ddp.close()
    return out


def sc_join(rank: int, world: int) -> Dict[str, Any]:
    """S = 2, R = 2, uneven inputs: replica 1 has 2 mini-batches, replica 0 has 4; each rank runs
    its loop in its wrapper's Join."""
    from decentpy.hybrid import pipeline_groups

    groups = pipeline_groups(2, 2)
    assert groups is not None
    pipe = make_pipe(model(torch.float64), groups.pipeline, BALANCE)
    ddp = gossip(pipe, groups.replicas, "complete")
    mine = STEPS if groups.replica == 0 else 2
    t0 = time.monotonic()
    with ddp.join():
        for k in range(mine):
            x, y = batch(groups.replica, k)
            step(pipe, x.double(), y, "1f1b")
    seconds = time.monotonic() - t0
    out = {"stage": groups.stage, "replica": groups.replica, "params": params(pipe.partition),
           "steps": ddp.step_count, "seconds": seconds}
    ddp.close()
    return out


SCENARIOS = {"one_replica": sc_one_replica, "one_stage": sc_one_stage, "reference": sc_reference,
             "join": sc_join}


def hybrid_worker(rank: int, world: int) -> Dict[str, Any]:
    return {name: guarded(fn, rank, world) for name, fn in SCENARIOS.items()}


_CACHE: Dict[str, List[Dict[str, Any]]] = {}


def scenario(name: str) -> List[Any]:
    if "results" not in _CACHE:
        _CACHE["results"] = run_workers(hybrid_worker, 4, timeout=120, pg_timeout_s=60)
    res = [r[name] for r in _CACHE["results"]]
    errors = [f"rank {r}:\n{v['error']}" for r, v in enumerate(res) if isinstance(v, dict) and "error" in v]
    assert not errors, f"scenario {name} raised:\n" + "\n".join(errors)
    return res


def per_replica(res: List[Dict[str, Any]], key: str) -> List[Dict[str, Tensor]]:
    """Each replica's whole model: its stages' parameters merged (names as in the model)."""
    merged: List[Dict[str, Tensor]] = [{}, {}]
    for r in res:
        merged[r["replica"]].update(r[key])
    return merged


def complete_2(k: int) -> Tensor:
    return torch.full((2, 2), 0.5, dtype=torch.float64)


# --- tests ---------------------------------------------------------------------------------------------


def test_one_replica_equals_plain_pipeline() -> None:
    for rank, res in enumerate(scenario("one_replica")):
        assert set(res) == {f"{d}/{torch.float64}" for d in DRIVERS} | {f"1f1b/{torch.float32}"}
        for key, run in res.items():
            tol = 1e-12 if "float64" in key else 1e-5
            plain, hybrid = run["losses"]["plain"], run["losses"]["hybrid"]
            if rank % 2 == 1:  # the final stage
                assert all(abs(a - b) <= tol for a, b in zip(plain, hybrid)), (rank, key, plain, hybrid)
                assert plain[-1] < plain[0], (rank, key, plain)
            assert_close_params([run["hybrid"]], [run["plain"]], rtol=tol, atol=tol, what=f"rank {rank} {key}")


def test_one_stage_equals_plain_decentpy() -> None:
    for rank, res in enumerate(scenario("one_stage")):
        for driver, run in res.items():
            # chunks=2 sums two micro-batches' gradients where plain decentpy takes the batch's: float32 rounding
            assert_close_params([run["hybrid"]], [run["plain"]], rtol=1e-5, atol=1e-5, what=f"rank {rank} {driver}")


def test_two_by_two_complete_matches_reference() -> None:
    res = scenario("reference")
    want = simulate(2, complete_2, "sgd", STEPS)
    assert any(not torch.allclose(want[0][n], want[1][n]) for n in want[0])  # gossip is not all-reduce
    for driver in DRIVERS:
        assert all(r[f"{driver}/steps"] == STEPS for r in res)
        got = per_replica(res, driver)
        assert_close_params(got, want, rtol=1e-10, atol=1e-10, what=f"S=2 R=2 complete, {driver}")


def test_uneven_inputs_under_join() -> None:
    res = scenario("join")
    assert all(r["seconds"] < WAIT_S for r in res), [r["seconds"] for r in res]
    assert sorted((r["replica"], r["steps"]) for r in res) == [(0, STEPS), (0, STEPS), (1, STEPS), (1, STEPS)]
    want = simulate(2, complete_2, "sgd", STEPS, skip=lambda i, k: i == 1 and k >= 2)
    assert_close_params(per_replica(res, "params"), want, rtol=1e-10, atol=1e-10, what="Join, replica 1 joined at 2")


# --- in one process ------------------------------------------------------------------------------------


def test_layout_and_bad_sizes() -> None:
    from decentpy.hybrid import factor_pairs, pipeline_layout

    lay = pipeline_layout(3, 2, world_size=6)
    assert lay.pipelines == ((0, 1, 2), (3, 4, 5))
    assert lay.stage_replicas == ((0, 3), (1, 4), (2, 5))
    assert lay.rank_of(stage=2, replica=1) == 5 and lay.position(4) == (1, 1)
    custom = pipeline_layout(2, 2, ranks=[4, 5, 6, 7], world_size=8)
    assert custom.pipelines == ((4, 5), (6, 7)) and custom.position(0) is None
    assert factor_pairs(6) == [(1, 6), (2, 3), (3, 2), (6, 1)]
    with pytest.raises(ValueError, match=r"3 x 2 = 6, but there are 4 ranks; valid \(stages, replicas\) for 4: "
                                         r"\(1, 4\), \(2, 2\), \(4, 1\)"):
        pipeline_layout(3, 2, world_size=4)
    with pytest.raises(ValueError, match="stages must be a positive int, got 0"):
        pipeline_layout(0, 2, world_size=4)
    with pytest.raises(ValueError, match=r"global ranks in \[0, 4\), got \[4\]"):
        pipeline_layout(2, 1, ranks=[3, 4], world_size=4)
    with pytest.raises(ValueError, match="distinct"):
        pipeline_layout(2, 1, ranks=[1, 1], world_size=4)


def test_wrap_partition_in_one_process() -> None:
    """World of one: S = R = 1 trains through the wrapper; bad wrappers are refused."""
    from decentpy import AsyncPipe, DecentralizedDataParallel
    from decentpy.hybrid import pipeline_groups

    with single_process_group("gloo"):
        with pytest.raises(ValueError, match=r"valid \(stages, replicas\) for 1: \(1, 1\)"):
            pipeline_groups(2, 1)
        groups = pipeline_groups(1, 1)
        assert groups is not None and groups.first_stage and groups.final_stage
        pipe = AsyncPipe(model(torch.float64), [5], group=groups.pipeline, chunks=2)
        with pytest.raises(ValueError, match="does not hold the partition's parameter '0.weight'"):
            pipe.wrap_partition(lambda part: copy.deepcopy(part))
        ddp = pipe.wrap_partition(lambda part: DecentralizedDataParallel(part, sgd_fn, process_group=groups.replicas))
        assert pipe.partition_wrapper is ddp and ddp.module is pipe.partition
        with pytest.raises(RuntimeError, match="already called"):
            pipe.wrap_partition(lambda part: part)
        ref = model(torch.float64)
        opt = sgd_fn(list(ref.named_parameters()))
        for k in range(3):
            x, y = batch(0, k)
            pipe.train_step(x.double(), y.double(), loss_fn)
            loss_fn(ref(x.double()), y.double()).backward()
            opt.step()
            opt.zero_grad()
        assert ddp.step_count == 3
        assert_close_params([params(pipe.partition)], [params(ref)], rtol=1e-12, atol=1e-12, what="S=R=1")
        ddp.close()


# --- the example -----------------------------------------------------------------------------------------


def example_worker(rank: int, world: int) -> Dict[str, Any]:
    return run_example_main("pipeline_gossip_digits.py", ["--epochs", "6"])


def test_example_trains() -> None:
    """examples/pipeline_gossip_digits.py's main() on 4 spawned gloo workers (2 stages x 2 replicas,
    then plain decentpy on 4): both classify the held-out digits."""
    t0 = time.monotonic()
    res = run_workers(example_worker, 4, timeout=240)
    report = [r for r in res if r]
    assert len(report) == 1, res  # the final stage of replica 0 reports
    r = report[0]
    assert len(r["losses"]) == 6 and r["losses"][-1] < r["losses"][0] * 0.5, r["losses"]
    assert r["accuracy"] > 0.8 and r["plain_accuracy"] > 0.8, r
    print(f"example: {time.monotonic() - t0:.1f} s, {r}")
