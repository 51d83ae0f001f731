"""decentpy.DiLoCo over FSDP2-sharded replicas (``fully_shard``, DTensor parameters), on 4 gloo CPU
ranks = 2 replicas x 2 shards: the outer step runs on each rank's local shard against the same shard
of the other replica (``group=mesh["replicate"]``).

References: a plain-torch re-computation of DiLoCo on the unsharded model (two replicas in one
process, each on the whole batch its two shard ranks split, torch's AdamW inside, the mean
pseudo-gradient into torch's Nesterov SGD outside); a run resumed through
``torch.distributed.checkpoint`` (one checkpoint per replica, over its shard group) against the
uninterrupted one, bit for bit.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List

import pytest
import torch

import decentpy

H = 3           # inner steps per outer step
STEPS = 11      # 3 outer steps, and 2 inner steps of the 4th window
SAVE_AT = 5     # a checkpoint 2 steps into the second window
LR_IN = 1e-2


def _inner(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR_IN, weight_decay=0.01, foreach=False)


def _outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _half(replica: int, shard: int, step: int) -> Any:
    """Shard rank ``shard`` of replica ``replica`` takes its half of the replica's batch."""
    from reference import BATCH, batch

    x, y = batch(replica, step)
    h = BATCH // 2
    return x[shard * h:(shard + 1) * h], y[shard * h:(shard + 1) * h]


def _reference(steps: int) -> List[List[torch.Tensor]]:
    """DiLoCo on two unsharded replicas in one process (each replica's whole batch)."""
    from reference import batch, loss_fn, make_mlp

    models = [make_mlp(0) for _ in range(2)]
    inners = [_inner(m.parameters()) for m in models]
    theta = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
    outer = _outer(theta)
    for k in range(steps):
        for r, (m, o) in enumerate(zip(models, inners)):
            x, y = batch(r, k)
            o.zero_grad()
            loss_fn(m(x), y).backward()
            o.step()
        if (k + 1) % H == 0:
            with torch.no_grad():
                for i, t in enumerate(theta):
                    t.grad = sum(t.detach() - list(m.parameters())[i].detach() for m in models) / 2
                outer.step()
                for m in models:
                    for p, t in zip(m.parameters(), theta):
                        p.copy_(t)
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def _fsdp_model(mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from reference import make_mlp

    model = make_mlp(0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return model


#: the configurations run on the FSDP2 replicas (each resumed through DCP): DiLoCo against the
#: plain-torch re-computation; Streaming DiLoCo (two fragments, exchanges in flight over one inner
#: step, merged with alpha 0.5) against decentpy's DiLoCo on the unsharded model; int8 pseudo-gradients
#: with error feedback (quantised per shard: blocks of the local shard, so no unsharded twin)
CASES: Dict[str, Dict[str, Any]] = {
    "exact": {},
    "streaming": dict(fragment_sync_delay=1, fragment_update_alpha=0.5),
    "int8": dict(compression="int8"),
}


def _fragments(model: torch.nn.Module, case: str) -> Any:
    return [model[0:2], model[2:]] if case == "streaming" else model


def _worker(rank: int, world: int, ckpt: str) -> Dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from reference import batch, loss_fn, make_mlp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica, shard = mesh.get_coordinate()
    replicas = mesh["replicate"].get_group()
    out: Dict[str, Any] = {"replica": replica, "shard": shard}

    def build(case: str, model: Any = None) -> Any:
        model = _fsdp_model(mesh) if model is None else model
        inner = _inner(model.parameters())
        frags = _fragments(model, case)
        outers = ([_outer(f.parameters()) for f in frags] if isinstance(frags, list)
                  else _outer(model.parameters()))
        d = decentpy.DiLoCo(frags, inner, outers, sync_every=4 if case == "streaming" else H,
                            group=replicas, **CASES[case])
        return model, inner, d

    def train(model: Any, inner: Any, steps: range, whole: bool = False) -> None:
        for k in steps:
            x, y = batch(replica, k) if whole else _half(replica, shard, k)
            inner.zero_grad()
            loss_fn(model(x), y).backward()
            inner.step()

    def state(model: Any, inner: Any, d: Any) -> Dict[str, Any]:
        msd, osd = get_state_dict(model, inner)
        return {"model": msd, "inner": osd, "diloco": decentpy.RankState(d)}

    for case in CASES:
        path = os.path.join(ckpt, case, f"replica{replica}")
        model, inner, d = build(case)
        got: Dict[str, Any] = {}
        with d:
            got["exchanged_numel"] = sum(p.to_local().numel() for p in model.parameters())
            train(model, inner, range(SAVE_AT))
            dcp.save(state(model, inner, d), checkpoint_id=path, process_group=mesh["shard"].get_group())
            train(model, inner, range(SAVE_AT, STEPS))
            got["outer_steps"], got["bytes_sent"] = d.outer_steps, d.bytes_sent
        got["local"] = [p.to_local().detach().clone() for p in model.parameters()]
        got["full"] = [p.full_tensor().detach().clone() for p in model.parameters()]  # (over the shard group)
        got["model_numel"] = sum(p.numel() for p in model.parameters())
        # the resume: a fresh model, optimizers and DiLoCo, loaded from this replica's checkpoint
        model, inner, d = build(case)
        with d:
            st = state(model, inner, d)
            dcp.load(st, checkpoint_id=path, process_group=mesh["shard"].get_group())
            set_state_dict(model, inner, model_state_dict=st["model"], optim_state_dict=st["inner"])
            train(model, inner, range(SAVE_AT, STEPS))
        got["resumed"] = [p.to_local().detach().clone() for p in model.parameters()]
        if case == "streaming" and shard == 0:  # the unsharded twin, on the shard-0 ranks (one per replica)
            model, inner, d = build(case, make_mlp(0))
            with d:
                train(model, inner, range(STEPS), whole=True)
            got["unsharded"] = [p.detach().clone() for p in model.parameters()]
        out[case] = got
    # the world as the group: shards 0 and 1 would be averaged together -- refused on every rank
    try:
        other = _fsdp_model(mesh)
        decentpy.DiLoCo(other, _inner(other.parameters()), _outer(other.parameters()), sync_every=H)
        out["world_group"] = None
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out["world_group"] = f"{type(exc).__name__}: {exc}"
    # the wrapper steps whole parameters inside the backward, which FSDP2 owns: refused, naming DiLoCo
    try:
        decentpy.DecentralizedDataParallel(_fsdp_model(mesh), lambda named: torch.optim.SGD([p for _, p in named],
                                                                                            lr=0.1))
        out["wrapper"] = None
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out["wrapper"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    pytest.importorskip("torch.distributed.fsdp")
    from dist_harness import run_workers

    with tempfile.TemporaryDirectory() as ckpt:
        return run_workers(_worker, 4, ckpt, timeout=240)


@pytest.mark.timeout(300)
def test_diloco_on_fsdp2_shards_equals_unsharded_diloco(results: List[Dict[str, Any]]) -> None:
    """After 3 outer steps and 2 inner steps on, each replica's FSDP2 model (gathered) equals the
    unsharded re-computation's replica to float32 rounding; each outer exchange moved this rank's
    shard once (its float32 pseudo-gradient: the two shard ranks' bytes add up to one whole-model
    replica's)."""
    want = _reference(STEPS)
    for res in results:
        r = res["exact"]
        assert r["outer_steps"] == STEPS // H
        for got, ref in zip(r["full"], want[res["replica"]]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for replica in (0, 1):
        mine = [r["exact"] for r in results if r["replica"] == replica]
        assert sum(r["exchanged_numel"] for r in mine) == mine[0]["model_numel"]
        for r in mine:
            assert r["bytes_sent"] == 4 * r["exchanged_numel"] * (STEPS // H) < 4 * r["model_numel"] * (STEPS // H)
    # the replicas differ between outer steps (2 inner steps on) and agreed at the last outer step
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["exact"]["full"], results[2]["exact"]["full"]))


def test_streaming_diloco_on_fsdp2_shards_equals_the_unsharded_run(results: List[Dict[str, Any]]) -> None:
    """Streaming DiLoCo (two fragments, delay 1, alpha 0.5) on the FSDP2 replicas equals decentpy's
    Streaming DiLoCo on the unsharded model (each replica's whole batch) to float32 rounding."""
    for res in results:
        if res["shard"] == 0:
            r = res["streaming"]
            assert r["outer_steps"] > 2
            for got, ref in zip(r["full"], r["unsharded"]):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_diloco_on_fsdp2_resumes_through_dcp_bit_for_bit(results: List[Dict[str, Any]], case: str) -> None:
    """A fresh model, inner and outer optimizer and DiLoCo loaded from the replica's DCP checkpoint
    (taken 2 inner steps into a window; with int8 the error feedback in it) end bit-equal."""
    for res in results:
        r = res[case]
        for a, b in zip(r["local"], r["resumed"]):
            assert torch.equal(a, b), (case, res["replica"], res["shard"], float((a - b).abs().max()))
    if case == "int8":  # the compression is real: the result differs from the float32 exchange's
        assert not all(torch.equal(a, b) for a, b in zip(results[0]["int8"]["local"], results[0]["exact"]["local"]))


def test_the_wrapper_refuses_an_fsdp2_model_on_every_rank(results: List[Dict[str, Any]]) -> None:
    for r in results:
        assert r["wrapper"] is not None and r["wrapper"].startswith("TypeError") and "DTensor" in r["wrapper"] \
            and "decentpy.DiLoCo" in r["wrapper"], r["wrapper"]


def test_diloco_over_the_world_on_fsdp2_shards_is_refused_on_every_rank(results: List[Dict[str, Any]]) -> None:
    for r in results:
        msg = r["world_group"]
        assert msg is not None and "shard of each DTensor parameter" in msg and "group=mesh['replicate']" in msg, msg


def _gossip_worker(rank: int, world: int) -> Dict[str, Any]:
    """4 replicas of one shard each (a (4, 1) mesh: DTensor parameters whose shard is the whole
    tensor): DiLoCo's gossip outer step on a ring, against decentpy's on the plain model."""
    from torch.distributed.device_mesh import init_device_mesh

    from reference import batch, loss_fn, make_mlp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    out: Dict[str, Any] = {}
    for name, model in (("fsdp", _fsdp_model(mesh)), ("plain", make_mlp(0))):
        inner = _inner(model.parameters())
        with decentpy.DiLoCo(model, inner, _outer(model.parameters()), sync_every=H, topology="ring",
                             group=mesh["replicate"].get_group()) as d:
            for k in range(STEPS):
                x, y = batch(rank, k)
                inner.zero_grad()
                loss_fn(model(x), y).backward()
                inner.step()
            out[f"{name}_outer_steps"] = d.outer_steps
        out[name] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    return out


@pytest.mark.timeout(300)
def test_the_gossip_outer_step_on_fsdp2_parameters_equals_the_plain_one() -> None:
    """A gossip outer step ([theta; delta] mixed with the ring's neighbours) over DTensor parameters
    equals the same DiLoCo on plain parameters to float32 rounding, and it is a gossip step: the
    replicas differ."""
    pytest.importorskip("torch.distributed.fsdp")
    from dist_harness import run_workers

    results = run_workers(_gossip_worker, 4, timeout=240)
    for r in results:
        assert r["fsdp_outer_steps"] == r["plain_outer_steps"] == STEPS // H
        for a, b in zip(r["fsdp"], r["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["fsdp"], results[1]["fsdp"]))
